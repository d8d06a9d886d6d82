"""``python -m moe {demo, plan, backends, bench, tune, cache}``: the command line.

A configuration error (a `moe.errors.MoEError`, or a flag argparse refuses) is printed as one line,
``python -m moe <command>: error: <message>``, with the reasons below it when there are several, and
the exit status is 2; with ``plan --json`` it is one JSON object on stdout instead. Any other
exception is a bug and keeps its traceback.
"""

from __future__ import annotations

import argparse
import json
import sys

import torch

from moe.tools.cli_args import int_at_least
from moe.tools.demo import run_demo
from moe.errors import MoEConfigError, MoEError, UnsupportedError
from moe.tools.plan import add_plan_parser
from moe.presets import preset_names
from moe.quant.scheme import SCHEME_NAMES


def _demo_parser(sub) -> None:
    p = sub.add_parser("demo", help="build a real model's MoE layer, run it and check it against a float32 loop")
    p.add_argument("--preset", default="qwen3-30b-a3b", choices=preset_names(), metavar="NAME",
                   help=f"model preset, one of {', '.join(preset_names())} (default qwen3-30b-a3b)")
    p.add_argument("--tokens", type=int_at_least(0), default=37,
                   help="M, tokens in the batch (default 37; 0 runs an empty batch, which has nothing to check)")
    p.add_argument("--quant", default="bf16", choices=SCHEME_NAMES, metavar="SCHEME",
                   help=f"quantization scheme, one of {', '.join(SCHEME_NAMES)} (default bf16)")
    p.add_argument("--experts", default=None, metavar="NAME",
                   help="force an experts backend by name (python -m moe backends lists them)")
    p.add_argument("--device", default=None, choices=("cpu", "cuda"), help="default: cuda if available")
    p.add_argument("--full-size", action="store_true", help="do not scale the layer down on CPU")
    p.add_argument("--ep", type=int_at_least(1), default=1, metavar="N",
                   help="expert parallelism: N >= 2 CPU processes (gloo), sharded vs unsharded (default 1: none)")
    p.set_defaults(func=_demo)


def _demo(a) -> int:
    """Checks every flag against the others and this machine, then runs the demo they ask for."""
    if a.experts is not None:
        from moe.registry import experts_classes

        if a.experts not in experts_classes():
            raise MoEConfigError(f"--experts: unknown experts backend {a.experts!r}; "
                                 f"choose from {', '.join(experts_classes())}")
    if a.device == "cuda" and not torch.cuda.is_available():
        raise UnsupportedError("--device cuda: no CUDA device on this machine")
    if a.ep == 1:
        return run_demo(a.preset, a.tokens, a.quant, a.experts, a.device, a.full_size)
    # the expert-parallel demo: N CPU processes, the layer always scaled down
    refused = {"--device cuda": a.device == "cuda", "--full-size": a.full_size, "--tokens 0": a.tokens == 0}
    for flag, given in refused.items():
        if given:
            raise MoEConfigError(f"{flag} does not go with --ep {a.ep}: the expert-parallel demo runs "
                                 f"{a.ep} CPU processes (gloo) on a scaled-down layer, M >= 1 tokens each")
    from moe.tools.ep_demo import run_ep_demo

    return run_ep_demo(a.ep, a.preset, a.tokens, a.quant, experts=a.experts)


def _backends_parser(sub) -> None:
    p = sub.add_parser("backends", help="print the support table generated from the capability declarations, "
                                        "with whether each backend can run on this machine")
    p.add_argument("--modes", action="store_true", help="add what each experts backend needs per quantization scheme")
    p.set_defaults(func=_backends)


def _backends(a) -> int:
    print(backends_table(_detected_platform()))
    if a.modes:
        print("\n" + modes_table())
    return 0


def _detected_platform():
    from moe.platform import Platform

    return Platform.detect()


def backends_table(platform=None, *, experts=None, prepare_finalize=None, broken=None) -> str:
    """Markdown tables of the backends, read from their declarations.

    ``experts`` and ``prepare_finalize`` (name -> class) default to the registry's, ``broken`` (name ->
    reason) to ``registry.broken_backends()``. The status column says ``implemented``, ``declared only``
    or ``broken: <error>``; it depends on the code only. With a ``platform``, a "here" column says
    whether each backend can run on it: ``yes``, or ``no: <reasons>`` (a missing library with its
    install line). Broken plugins that registered nothing get a table of their own.
    """
    from moe import registry

    experts = registry.experts_classes() if experts is None else experts
    prepare_finalize = registry.prepare_finalize_classes() if prepare_finalize is None else prepare_finalize
    here_e = {name: _here(cls, platform) for name, cls in experts.items()}
    here_pf = {name: _here(cls, platform) for name, cls in prepare_finalize.items()}
    broken = registry.broken_backends() if broken is None else broken  # after _here, which may find more
    here = [] if platform is None else ["here"]
    rows = _header(["experts", "formats", "weight x activation", "activations", "devices", "SM", "libraries",
                    "output", "status"] + here)
    for name, cls in experts.items():
        cap = cls.capabilities
        quant = ", ".join(sorted(f"{w.value}×{a.value}" for w, a in cap.quant))
        rows.append(_row([name, ", ".join(sorted(f.value for f in cap.formats)), quant,
                          ", ".join(sorted(a.value for a in cap.activations)), ", ".join(sorted(cap.devices)),
                          _sm_range(cap.min_capability, cap.max_capability), ", ".join(cap.libraries) or "-",
                          cap.output.value, _status(name, cap.implemented, broken)] + here_e[name]))
    rows += [""] + _header(["prepare/finalize", "format", "quantizes activations to", "status"] + here)
    for name, cls in prepare_finalize.items():
        fmts = ", ".join(sorted(f.value for f in cls.quant_formats)) or "-"
        rows.append(_row([name, cls.format.value, fmts, _status(name, cls.implemented, broken)] + here_pf[name]))
    unregistered = {name: why for name, why in broken.items() if name not in experts and name not in prepare_finalize}
    if unregistered:
        rows += [""] + _header(["plugin", "status"])
        rows += [_row([name, f"broken: {why}"]) for name, why in unregistered.items()]
    return "\n".join(rows)


def modes_table(experts=None) -> str:
    """A markdown table of every experts backend's modes (``Capabilities.modes``): per quantization
    scheme, the kernel, architectures, activations, dtypes, biases, alignment and library features.
    ``experts`` (name -> class) defaults to the registry's."""
    from moe import registry
    from moe.experts.base import Archs

    experts = registry.experts_classes() if experts is None else experts
    rows = _header(["experts", "scheme", "kernel", "SM", "activations", "dtypes", "bias", "alignment", "features"])
    dtype_names = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}
    for name, cls in experts.items():
        for scheme, mode in sorted(cls.capabilities.modes.items(), key=lambda item: item[0].name):
            dtypes = ", ".join(dtype_names.get(d, str(d)) for d in sorted(mode.dtypes, key=str))
            rows.append(_row([name, scheme.name, mode.name or "-", "-" if mode.archs == Archs() else str(mode.archs),
                              ", ".join(sorted(a.value for a in mode.activations)), dtypes,
                              "yes" if mode.bias else "no", _alignment(mode), ", ".join(mode.features) or "-"]))
    return "\n".join(rows)


def _alignment(mode) -> str:
    i_align = str(mode.i_align) if mode.i_align_nongated is None else f"{mode.i_align} (relu2: {mode.i_align_nongated})"
    if (mode.h_align, mode.i_align, mode.i_align_nongated) == (1, 1, None):
        return "-"
    return f"H % {mode.h_align}, I % {i_align}" + (" (padded)" if mode.pads else "")


def _header(names: list[str]) -> list[str]:
    return [_row(names), _row(["---"] * len(names)).replace(" ", "")]


def _row(cells: list[str]) -> str:
    return "| " + " | ".join(" ".join(cell.split()).replace("|", "\\|") for cell in cells) + " |"


def _status(name: str, implemented: bool, broken: dict[str, str]) -> str:
    if name in broken:
        return f"broken: {broken[name]}"
    return "implemented" if implemented else "declared only"


def _here(cls: type, platform) -> list[str]:
    """``[]`` without a platform; else ``["yes"]`` or ``["no: <reasons>"]`` for running ``cls`` there:
    the platform half of its declaration (device, compute capability, libraries). A problem can still be
    refused for reasons that join both (a quantization that needs a newer SM), which ``moe plan`` gives.
    """
    from moe.registry import checked_call

    if platform is None:
        return []
    declaration = cls.capabilities if hasattr(cls, "capabilities") else cls.transport
    reasons = checked_call(cls, "_platform_reasons", platform)
    reasons += [] if declaration.implemented else ["declared only"]
    return ["yes" if not reasons else "no: " + "; ".join(reasons)]


def _sm_range(low, high) -> str:
    if low is None and high is None:
        return "-"
    fmt = lambda cc: f"{cc[0]}{cc[1]}"  # noqa: E731
    if low == high:
        return f"SM{fmt(low)}"
    return f"SM{fmt(low) if low else '?'}" + (f"-SM{fmt(high)}" if high else "+")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="python -m moe", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)  # subparsers are _Parser too
    _demo_parser(sub)
    add_plan_parser(sub)
    _backends_parser(sub)
    _add(sub, "bench", "time experts backends on a GPU against the roofline (and torch_grouped)",
         "moe.tools.bench", "add_bench_arguments", "bench_command")
    _add(sub, "tune", "search Triton launch configurations and write them as data files",
         "moe.tools.tune", "add_tune_arguments", "tune_command")
    _add(sub, "cache", "show the tuning cache (MOE_CACHE_DIR): where it is, its entries and sizes; --clear empties it",
         "moe.tools.cache_cli", "add_cache_arguments", "cache_command")
    return parser


def _add(sub, name: str, help: str, module: str, add_arguments: str, command: str) -> None:
    """A subcommand whose arguments and body live in ``module`` (imported when the parser is built)."""
    import importlib

    mod = importlib.import_module(module)
    p = sub.add_parser(name, help=help, description=help)
    getattr(mod, add_arguments)(p)
    p.set_defaults(func=getattr(mod, command))


class UsageError(Exception):
    """A flag argparse refused; ``prog`` is the (sub)command whose parser refused it."""

    def __init__(self, prog: str, message: str):
        super().__init__(message)
        self.prog = prog


class _Parser(argparse.ArgumentParser):
    """Raises `UsageError` instead of printing the usage and exiting, so `main` reports it like any
    other configuration error: one line, or JSON for ``plan --json``."""

    def error(self, message: str):
        raise UsageError(self.prog, message)


def main(argv: list[str] | None = None) -> int:
    """Runs one command; returns its exit status (2 for a configuration error, reported by `_report`)."""
    argv = sys.argv[1:] if argv is None else list(argv)
    try:
        args = build_parser().parse_args(argv)
    except UsageError as error:  # plan's --json may be abbreviated, as argparse allows
        command = next((word for word in argv if not word.startswith("-")), "")
        asks_json = any(len(word) > 2 and "--json".startswith(word) for word in argv)
        return _report(error, error.prog, json_mode=command == "plan" and asks_json)
    try:
        return int(args.func(args) or 0)
    except MoEError as error:
        return _report(error, f"python -m moe {args.command}", json_mode=args.command == "plan" and args.json)


def _report(error: Exception, prog: str, json_mode: bool) -> int:
    """Prints ``error`` as ``<prog>: error: <message>`` (reasons below it) on stderr, or as
    ``{"error": {"type", "message", "reasons"}}`` on stdout in JSON mode; returns 2."""
    reasons = list(getattr(error, "reasons", ()))
    message = str(error)
    listed = "".join(f"\n  - {r}" for r in reasons)  # UnsupportedError appends its reasons so
    if listed and message.endswith(listed):
        message = message[: -len(listed)]
    if json_mode:
        print(json.dumps({"error": {"type": type(error).__name__, "message": message, "reasons": reasons}}))
        return 2
    if len(reasons) == 1:
        message, reasons = f"{message}: {reasons[0]}", []
    print("\n".join([f"{prog}: error: {message}", *(f"  - {r}" for r in reasons)]), file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
