"""``python -m moe {demo, plan, backends, bench, tune}``: the command line."""

from __future__ import annotations

import argparse
import sys

from moe.demo import run_demo
from moe.oracle.cli import add_plan_parser


def _demo_parser(sub) -> None:
    p = sub.add_parser("demo", help="build a real model's MoE layer, run it and check it against reference")
    p.add_argument("--preset", default="qwen3-30b-a3b", help="model preset (see moe/presets)")
    p.add_argument("--tokens", type=int, default=37, help="M, tokens in the batch (default 37)")
    p.add_argument("--quant", default=None, help="quantization scheme (default: bf16)")
    p.add_argument("--experts", default=None, help="force an experts backend by name")
    p.add_argument("--device", default=None, help="cpu or cuda (default: cuda if available)")
    p.add_argument("--full-size", action="store_true", help="do not scale the layer down on CPU")
    p.add_argument("--ep", type=int, default=1, metavar="N",
                   help="expert parallelism: N CPU processes (gloo), sharded vs unsharded")
    p.set_defaults(func=_demo)


def _demo(a) -> int:
    if a.ep > 1:
        from moe.parallel_demo import run_ep_demo

        return run_ep_demo(a.ep, a.preset, a.tokens, a.quant)
    return run_demo(a.preset, a.tokens, a.quant, a.experts, a.device, a.full_size)


def _backends_parser(sub) -> None:
    p = sub.add_parser("backends", help="print the support table generated from the capability declarations")
    p.set_defaults(func=lambda a: print(backends_table()) or 0)


def backends_table() -> str:
    """Markdown table of every registered backend, read from its declaration."""
    from moe.registry import experts_classes, prepare_finalize_classes

    rows = ["| experts | formats | weight x activation | activations | devices | SM | libraries | output | status |",
            "|---|---|---|---|---|---|---|---|---|"]
    for name, cls in experts_classes().items():
        cap = cls.capabilities
        quant = ", ".join(sorted(f"{w.value}×{a.value}" for w, a in cap.quant))
        sm = _sm_range(cap.min_capability, cap.max_capability)
        status = "ready" if cap.implemented else "declared only"
        rows.append(
            f"| {name} | {', '.join(sorted(f.value for f in cap.formats))} | {quant} | "
            f"{', '.join(sorted(a.value for a in cap.activations))} | {', '.join(sorted(cap.devices))} | {sm} | "
            f"{', '.join(cap.libraries) or '-'} | {cap.output.value} | {status} |"
        )
    rows += ["", "| prepare/finalize | format | quantizes activations to | status |", "|---|---|---|---|"]
    for name, cls in prepare_finalize_classes().items():
        fmts = ", ".join(sorted(f.value for f in cls.quant_formats)) or "-"
        rows.append(f"| {name} | {cls.format.value} | {fmts} | {'ready' if cls.implemented else 'declared only'} |")
    return "\n".join(rows)


def _sm_range(low, high) -> str:
    if low is None and high is None:
        return "-"
    fmt = lambda cc: f"{cc[0]}{cc[1]}"  # noqa: E731
    if low == high:
        return f"SM{fmt(low)}"
    return f"SM{fmt(low) if low else '?'}" + (f"-SM{fmt(high)}" if high else "+")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m moe", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    _demo_parser(sub)
    add_plan_parser(sub)
    _backends_parser(sub)
    _add(sub, "bench", "time experts backends on a GPU against the roofline (and torch_grouped)",
         "moe.bench", "add_bench_arguments", "bench_command")
    _add(sub, "tune", "search Triton launch configurations and write them as data files",
         "moe.tune", "add_tune_arguments", "tune_command")
    return parser


def _add(sub, name: str, help: str, module: str, add_arguments: str, command: str) -> None:
    """A subcommand whose arguments and body live in ``module`` (imported when the parser is built)."""
    import importlib

    mod = importlib.import_module(module)
    p = sub.add_parser(name, help=help, description=help)
    getattr(mod, add_arguments)(p)
    p.set_defaults(func=getattr(mod, command))


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
