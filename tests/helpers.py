"""Builders shared by the tests: small problems; weights and inputs come from the conformance kit."""

from __future__ import annotations

import functools
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import torch

from moe import MoEProblem, ParallelConfig
from moe.quant import QuantFormat
from moe.testing.inputs import random_inputs, random_weights  # noqa: F401  (re-exported for the tests)
from moe.testing.cases import SIZES


def make_problem(weight_fmt=QuantFormat.NONE, *, quant="bf16", activation="silu", dtype=torch.bfloat16,
                 num_experts=6, top_k=2, has_bias=False, max_tokens=64, expert_map=None, **kwargs) -> MoEProblem:
    hidden, intermediate = SIZES[weight_fmt]
    parallel = ParallelConfig(expert_map=tuple(expert_map)) if expert_map else ParallelConfig()
    return MoEProblem.create(
        num_experts=num_experts, top_k=top_k, hidden_size=kwargs.pop("hidden_size", hidden),
        intermediate_size=kwargs.pop("intermediate_size", intermediate), activation=activation,
        quant=quant, dtype=dtype, has_bias=has_bias, max_tokens=max_tokens, parallel=parallel, **kwargs,
    )


def assert_same_block_layout(got, want) -> None:
    """Two `BlockLayout`s of the same routing agree: counts, padded ends, local ids, and each expert's
    segment holds the same slots (their order within a segment is free; padding rows are not read); ``got``'s
    ``slot_rows`` is the inverse of its ``sorted_slots`` on every slot that is here."""
    assert torch.equal(got.expert_counts.cpu(), want.expert_counts.cpu())
    assert torch.equal(got.expert_ends.cpu(), want.expert_ends.cpu())
    assert torch.equal(got.local_ids.cpu(), want.local_ids.cpu())
    ends = want.expert_ends.cpu().long()
    for e, count in enumerate(want.expert_counts.cpu().tolist()):
        start = int(ends[e]) - -(-count // want.block_m) * want.block_m
        segment = slice(start, start + count)
        assert torch.equal(got.sorted_slots.cpu()[segment].sort().values, want.sorted_slots.cpu()[segment].sort().values)
    here = (got.local_ids.cpu() >= 0).nonzero().squeeze(1)
    rows = got.slot_rows.cpu().long()[here]
    assert torch.equal(got.sorted_slots.cpu().long()[rows], here), "slot_rows is not sorted_slots' inverse"


@functools.lru_cache(maxsize=None)
def benchmark_script(name: str):
    """``benchmarks/<name>.py`` as a module, registered in `sys.modules` before it runs (a dataclass there looks its
    module up while being defined)."""
    if name not in sys.modules:
        path = Path(__file__).resolve().parents[1] / "benchmarks" / f"{name}.py"
        spec = importlib.util.spec_from_file_location(name, path)
        sys.modules[name] = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(sys.modules[name])
    return sys.modules[name]


def compiled_in_subprocess(name: str, expression: str, timeout: int = 600):
    """The JSON value of ``expression`` evaluated in a fresh process with TRITON_INTERPRET off, where
    ``benchmarks/<name>.py`` is imported as ``s``: its kernels compile for a GPU target there (this process's
    kernels were decorated for the interpreter)."""
    root = Path(__file__).resolve().parents[1]
    code = (f"import json, sys; sys.path[:0] = [sys.argv[1], sys.argv[1] + '/benchmarks']; import {name} as s; "
            f"print(json.dumps({expression}))")
    done = subprocess.run([sys.executable, "-c", code, str(root)], capture_output=True, text=True, timeout=timeout,
                          env=dict(os.environ, TRITON_INTERPRET="0"))
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])
