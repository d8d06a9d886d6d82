"""``python -m moe cache [--clear]``: where the tuning cache is (``MOE_CACHE_DIR``), its entries and sizes."""

from __future__ import annotations

import argparse
import os

from moe.cache import DEFAULT_DIR, DISABLED_VALUES, ENV_VAR, open_cache


def add_cache_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--clear", action="store_true", help="delete every entry (the next loads tune again)")


def cache_command(args: argparse.Namespace) -> int:
    cache = open_cache()  # an unusable folder was warned about on stderr
    if cache is None:
        setting = os.environ.get(ENV_VAR, str(DEFAULT_DIR))
        state = "off" if setting.strip().lower() in DISABLED_VALUES else "unusable, see the warning above"
        print(f"tuning cache: {state} ({ENV_VAR}={setting!r})")
        return 0
    entries = cache.entries()
    sizes = [path.stat().st_size for path in entries]
    print(f"tuning cache: {cache.root} ({len(entries)} entries, {sum(sizes) / 1024:.1f} KiB; set by {ENV_VAR})")
    for path, size in zip(entries, sizes):
        print(f"  {size / 1024:8.1f} KiB  {path.relative_to(cache.root)}")
    if args.clear:
        print(f"cleared {cache.clear()} entries")
    return 0
