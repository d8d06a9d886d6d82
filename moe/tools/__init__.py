"""The tools around the library: the command line and what it runs.

    cli.py       ``python -m moe {demo, plan, backends, bench, tune}``: parsing and error reporting
    cli_args.py  argparse types shared by the subcommands
    plan.py      ``python -m moe plan``: the oracle's decision for a problem, explained
    demo.py      ``python -m moe demo``: a preset's layer built, run and checked against a float32 loop
    ep_demo.py   ``python -m moe demo --ep N``: the layer sharded over N processes; the rank launcher
    bench.py     ``python -m moe bench``: backends timed against the roofline on a GPU
    tune.py      ``python -m moe tune``: the Triton launch-config search
    docs.py      ``python -m moe.tools.docs``: the generated support table of docs/writing-a-backend.md

The library (``moe`` and its other packages) never imports this package.
"""
