"""The README's examples run as written: each Python block in a fresh interpreter, as a reader would paste
it, and its results checked; the command lines that run on a CPU are run too."""

from __future__ import annotations

import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()
PYTHON_BLOCKS = re.findall(r"```python\n(.*?)```", README, re.S)
SHELL_LINES = [line.split("#")[0].strip() for block in re.findall(r"```sh\n(.*?)```", README, re.S)
               for line in block.splitlines()]


def test_the_readme_has_the_examples_this_test_checks():
    assert len(PYTHON_BLOCKS) == 3
    assert any(line.startswith("python -m moe plan") for line in SHELL_LINES)


@pytest.mark.parametrize("index", range(len(PYTHON_BLOCKS)))
def test_each_python_block_runs_in_a_fresh_interpreter(index):
    done = subprocess.run([sys.executable, "-c", PYTHON_BLOCKS[index]], cwd=ROOT, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr
    assert "Traceback" not in done.stderr


def test_the_layer_example_computes_the_mixtral_block():
    namespace: dict = {}
    exec(PYTHON_BLOCKS[0], namespace)  # noqa: S102 -- the README's own code
    out, tensors, prefix = namespace["out"], namespace["tensors"], namespace["prefix"]
    hidden, logits = namespace["hidden_states"], namespace["router_logits"]
    assert out.shape == (5, 256) and out.dtype == torch.bfloat16
    # Mixtral's block: softmax, top-2, renormalized; w2(silu(w1 x) * w3 x), weights rounded to bf16 as loaded
    weights, ids = torch.softmax(logits, -1).topk(2, dim=-1)
    weights = weights / weights.sum(-1, keepdim=True)
    x = hidden.float()
    expected = torch.zeros(5, 256)
    for t in range(5):
        for w, e in zip(weights[t], ids[t].tolist()):
            w1, w3, w2 = (tensors[f"{prefix}experts.{e}.{n}.weight"].bfloat16().float() for n in ("w1", "w3", "w2"))
            expected[t] += w * (w2 @ (torch.nn.functional.silu(w1 @ x[t]) * (w3 @ x[t])))
    assert ((out.float() - expected).norm() / expected.norm()) < 1e-2


def test_the_composition_example_matches_a_hand_written_loop():
    namespace: dict = {}
    exec(PYTHON_BLOCKS[1], namespace)  # noqa: S102
    out, hidden, topk, w13, w2 = (namespace[n] for n in ("out", "hidden", "topk", "w13", "w2"))
    expected = torch.zeros_like(hidden)
    for t in range(hidden.shape[0]):
        for w, e in zip(topk.weights[t], topk.ids[t].tolist()):
            gate, up = (w13[e] @ hidden[t]).chunk(2)
            expected[t] += w * (w2[e] @ (torch.nn.functional.silu(gate) * up))
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)


def test_the_transformers_example_matches_eager():
    pytest.importorskip("transformers")
    namespace: dict = {}
    exec(PYTHON_BLOCKS[2], namespace)  # noqa: S102
    assert namespace["model"].config._experts_implementation == "moe"
    torch.testing.assert_close(namespace["patched"], namespace["eager"], rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("line", [line for line in SHELL_LINES if line.startswith(("python -m moe plan",
                                                                                     "python -m moe backends"))])
def test_readme_command_lines_run(line):
    args = shlex.split(line)
    done = subprocess.run([sys.executable] + args[1:], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip()
