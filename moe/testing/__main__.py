"""``python -m moe.testing [NAME ...] [--cases full]``: the conformance kit from the command line.

NAME is a registered backend (``plugin_einsum``, ``local``, ...; see ``python -m moe backends``) or
``package.module:Class``; none means every registered backend. Exits 1 when any report failed.
"""

from __future__ import annotations

import argparse
import importlib
import sys


def _resolve(name: str) -> type:
    from moe.registry import experts_classes, prepare_finalize_classes

    if ":" in name:
        module, _, attr = name.partition(":")
        return getattr(importlib.import_module(module), attr)
    classes = {**prepare_finalize_classes(), **experts_classes()}
    if name not in classes:
        raise SystemExit(f"unknown backend {name!r}; registered: {', '.join(sorted(classes))}")
    return classes[name]


def main(argv: list[str] | None = None) -> int:
    from moe.experts.base import Experts
    from moe.registry import experts_classes, prepare_finalize_classes
    from moe.testing.conformance import check_experts, check_prepare_finalize

    parser = argparse.ArgumentParser(prog="python -m moe.testing", description=__doc__.splitlines()[0])
    parser.add_argument("names", nargs="*", help="registered backend names or module:Class (default: all)")
    parser.add_argument("--cases", choices=("quick", "full"), default="quick")
    args = parser.parse_args(argv)
    classes = [_resolve(n) for n in args.names] or [*experts_classes().values(), *prepare_finalize_classes().values()]
    failed = False
    for cls in classes:
        check = check_experts if issubclass(cls, Experts) else check_prepare_finalize
        report = check(cls, cases=args.cases)
        print(report, end="\n\n", flush=True)
        failed |= bool(report.failures)
    return int(failed)


if __name__ == "__main__":
    sys.exit(main())
