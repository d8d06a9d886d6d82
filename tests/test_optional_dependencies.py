"""`import moe`, a layer and the CLI work with only the runtime dependencies (torch, pyyaml).

Each test runs a fresh interpreter in which the optional libraries cannot be imported: the path finder
is replaced by one that does not see them, as if they were not installed (``find_spec`` answers None,
``import`` raises ModuleNotFoundError; torch's own probes, e.g. torch._dynamo's for numpy, see the same). This keeps the rule between CI runs,
whose `make demo` meets the base install for real. The last tests hold the required torch to its floor.
"""

import json
import subprocess
import sys
import textwrap

import pytest

OPTIONAL = ("triton", "flashinfer", "cutlass", "cuda", "matplotlib", "transformers", "numpy")

BLOCKER = textwrap.dedent(
    f"""
    import importlib.machinery, sys

    class _NotInstalled(importlib.machinery.PathFinder):
        # the path finder, blind to the optional libraries: `import numpy` raises ModuleNotFoundError and
        # importlib.util.find_spec("numpy") answers None, exactly as where numpy is not installed
        @classmethod
        def find_spec(cls, name, path=None, target=None):
            if name.split(".")[0] in {OPTIONAL!r}:
                return None
            return importlib.machinery.PathFinder.find_spec(name, path, target)

    sys.meta_path = [_NotInstalled if f is importlib.machinery.PathFinder else f for f in sys.meta_path]
    """
)


def run_without_optional(code: str, timeout: int = 240) -> subprocess.CompletedProcess:
    """Runs ``code`` after the blocker in a new interpreter; warnings are errors there."""
    program = BLOCKER + textwrap.dedent(code)
    return subprocess.run([sys.executable, "-W", "error", "-c", program], capture_output=True, text=True,
                          timeout=timeout)


def _assert_ok(result: subprocess.CompletedProcess) -> None:
    assert result.returncode == 0, f"exit {result.returncode}\nstdout:\n{result.stdout}\nstderr:\n{result.stderr}"


def test_the_blocker_blocks():
    result = run_without_optional("import importlib.util; assert importlib.util.find_spec('numpy') is None; import triton")
    assert result.returncode != 0 and "No module named 'triton'" in result.stderr, result.stderr


def test_import_moe_and_run_a_layer_without_optional_libraries():
    result = run_without_optional(
        """
        import sys, moe, torch  # moe first: torch alone warns that numpy is missing

        layer = moe.FusedMoE(8, 2, 64, 32, dtype=torch.float32, quant="fp32")
        gen = torch.Generator().manual_seed(0)
        w13, w2 = torch.randn(8, 64, 64, generator=gen) / 8, torch.randn(8, 64, 32, generator=gen) / 6
        layer.load_weights(w13=w13, w2=w2)
        x, logits = torch.randn(5, 64, generator=gen), torch.randn(5, 8, generator=gen)
        out = layer(x, logits)

        # the same layer written out: softmax top-2, renormalized, SiLU-gated experts
        weights, ids = torch.softmax(logits, -1).topk(2, dim=-1)
        weights = weights / weights.sum(-1, keepdim=True)
        expected = torch.zeros_like(x)
        for t in range(5):
            for w, e in zip(weights[t], ids[t]):
                gate, up = (w13[e] @ x[t]).chunk(2)
                expected[t] += w * (w2[e] @ (torch.nn.functional.silu(gate) * up))
        assert torch.allclose(out, expected, rtol=1e-4, atol=1e-5), (out - expected).abs().max()
        loaded = sorted(m for m in sys.modules if m.split(".")[0] in %r)
        assert not loaded, loaded
        print("layer", layer.kernel)
        """ % (OPTIONAL,)
    )
    _assert_ok(result)
    assert "layer ModularKernel(local +" in result.stdout


def test_backends_and_plan_list_missing_libraries_with_the_install_line():
    result = run_without_optional(
        """
        from moe.tools.cli import main
        main(["backends"])
        main(["plan", "--preset", "qwen3-30b-a3b", "--explain"])
        """
    )
    _assert_ok(result)
    assert "pip install 'moe[triton]'" in result.stdout
    assert "pip install 'moe[flashinfer]'" in result.stdout


def test_plan_json_without_optional_libraries():
    result = run_without_optional(
        """
        from moe.tools.cli import main
        main(["plan", "--preset", "mixtral-8x7b", "--tokens", "1", "64", "--json"])
        """
    )
    _assert_ok(result)
    plan = json.loads(result.stdout)
    assert [bucket["experts"] for bucket in plan["plan"]] == ["torch_grouped", "torch_grouped"], plan


@pytest.mark.parametrize("quant", ["bf16", "fp8_block", "nvfp4"])
def test_demo_without_optional_libraries(quant):
    result = run_without_optional(
        f"""
        import sys
        from moe.tools.cli import main
        sys.exit(main(["demo", "--tokens", "3", "--quant", "{quant}"]))
        """
    )
    _assert_ok(result)
    assert "-> OK" in result.stdout


def _import_moe_with_torch_version(version: str) -> subprocess.CompletedProcess:
    """``import moe`` in a new interpreter whose torch reports ``version``."""
    code = ("import torch; from torch.torch_version import TorchVersion; "
            f"torch.__version__ = TorchVersion({version!r}); import moe")
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=240)


def test_the_torch_floor_is_the_one_pyproject_requires():
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    from pathlib import Path

    from moe._requirements import MIN_TORCH

    project = tomllib.loads((Path(__file__).resolve().parents[1] / "pyproject.toml").read_text())["project"]
    assert f"torch>={MIN_TORCH},<3" in project["dependencies"]


@pytest.mark.parametrize("version", ["2.10.0+cu128", "2.6.0", "1.13.1"])
def test_an_older_torch_is_a_clear_import_error(version):
    result = _import_moe_with_torch_version(version)
    assert result.returncode != 0
    assert (f"ImportError: moe needs torch >= 2.11, and torch {version} is installed: pip install 'torch>=2.11'"
            in result.stderr), result.stderr


@pytest.mark.parametrize("version", ["2.11.0a0+ecf3bae", "2.11.0", "2.15.0+cu132", "3.0.0"])
def test_the_floor_and_newer_import(version):
    """A pre-release of the floor (NVIDIA's containers ship such builds) is compared by major.minor, and passes."""
    _assert_ok(_import_moe_with_torch_version(version))
