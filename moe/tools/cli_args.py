"""Argument types shared by the ``python -m moe`` subcommands.

Each is an argparse ``type``: it turns the text into a value or refuses it with the constraint and
the value; argparse names the flag, and ``python -m moe`` prints the whole as one line::

    python -m moe plan: error: argument --top-k: must be >= 1 (got 0)
"""

from __future__ import annotations

import argparse
from typing import Callable, Sequence


def int_at_least(least: int) -> Callable[[str], int]:
    """An int ``>= least``."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be an int >= {least} (got {text!r})") from None
        if value < least:
            raise argparse.ArgumentTypeError(f"must be >= {least} (got {value})")
        return value

    return parse


def one_of(choices: Sequence[str], what: str) -> Callable[[str], str]:
    """One of ``choices`` (a ``what``, e.g. "preset"); the refusal lists them all."""

    def parse(text: str) -> str:
        if text not in choices:
            raise argparse.ArgumentTypeError(f"unknown {what} {text!r}; choose from {', '.join(choices)}")
        return text

    return parse


def comma_separated(item: Callable[[str], object], example: str) -> Callable[[str], list]:
    """A non-empty comma-separated list, each element parsed by ``item`` (e.g. ``int_at_least(1)``)."""

    def parse(text: str) -> list:
        parts = [part.strip() for part in text.split(",") if part.strip()]
        if not parts:
            raise argparse.ArgumentTypeError(f"must be a comma-separated list, e.g. {example} (got {text!r})")
        return [item(part) for part in parts]

    return parse
