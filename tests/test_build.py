"""The oracle decides, ``moe.build.build`` builds: ``plan()`` constructs nothing and touches no device,
and its workspace bytes are those of the kernels that ``build`` makes from it."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import yaml

from moe.build import build
from moe.kernel import ModularKernel
from moe.oracle import Policy, plan
from moe.platform import Platform
from moe.presets import load_preset
from moe.problem import MoEProblem, ParallelConfig
from moe.registry import experts_classes, prepare_finalize_classes

BUCKETS = Policy(buckets=(1, 16, 256))


def _problem(quant: str, ep: int = 1, max_tokens: int = 512) -> MoEProblem:
    return load_preset("qwen3-30b-a3b").problem(quant=quant, max_tokens=max_tokens,
                                                parallel=ParallelConfig(ep_size=ep))


@pytest.fixture
def nothing_built(monkeypatch):
    """Every registered class refuses construction, and torch.cuda refuses every question."""
    classes = [*experts_classes().values(), *prepare_finalize_classes().values()]
    for cls in classes:
        monkeypatch.setattr(cls, "__init__", lambda self, *a, name=cls.name, **k: pytest.fail(f"built {name}"))
    for name in ("is_available", "device_count", "get_device_capability", "get_device_name", "current_device"):
        monkeypatch.setattr(torch.cuda, name, lambda *a, name=name, **k: pytest.fail(f"torch.cuda.{name} called"))


@pytest.mark.parametrize("platform", ["cpu", "h100", "b200"])
@pytest.mark.parametrize("quant,ep", [("bf16", 1), ("fp8", 1), ("nvfp4", 1), ("bf16", 2), ("mxfp4", 2)])
def test_plan_builds_nothing_and_touches_no_device(nothing_built, platform, quant, ep):
    decided = plan(_problem(quant, ep), Platform.preset(platform), BUCKETS, allow_empty=True)
    assert decided.candidates and (decided.workspace_bytes > 0) == bool(decided.buckets)


@pytest.mark.parametrize("platform,quant,force", [
    ("cpu", "bf16", ()), ("cpu", "fp8", ("batched",)), ("h100", "bf16", ()), ("h100", "fp8", ()),
    ("b200", "nvfp4", ()), ("b200", "bf16", ("flashinfer_cutlass",)),
])
def test_plan_workspace_is_what_the_built_kernels_reserve(monkeypatch, platform, quant, force):
    # as on a machine without a GPU: on the GPU it runs on, flashinfer_cutlass asks its library for its
    # scratch, and that figure is the built kernel's own, not the plan's (the plan reads declarations)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    decided = plan(_problem(quant), Platform.preset(platform), dataclasses.replace(BUCKETS, force=force))
    kernels = build(decided, "cpu")
    assert set(kernels) == set(decided.pairs())
    assert decided.workspace_bytes == max(k.workspace_bytes() for k in kernels.values()) > 0


def test_build_passes_one_manager_to_every_kernel_at_construction(monkeypatch, tmp_path):
    given = []
    init = ModularKernel.__init__

    def spy(self, *args, **kwargs):
        given.append(kwargs["workspace"])
        init(self, *args, **kwargs)

    monkeypatch.setattr(ModularKernel, "__init__", spy)
    profile = tmp_path / "split.yaml"  # torch_grouped hopeless up to 4 tokens: two pairs in one plan
    profile.write_text(yaml.safe_dump({"version": 1, "backends": {"torch_grouped": {"cpu": [
        {"tokens": 4, "quant": "*", "efficiency": 0.001, "overhead_us": 1e6},
        {"tokens": 64, "quant": "*", "efficiency": 1.0}]}}}))
    problem = MoEProblem.create(num_experts=6, top_k=2, hidden_size=40, intermediate_size=24, quant="fp32",
                                dtype=torch.float32, max_tokens=64)
    decided = plan(problem, Platform.preset("cpu"), Policy(buckets=(4,), profiles=(str(profile),)))
    kernels = build(decided, "cpu")
    assert [str(p) for p in kernels] == ["local + reference", "local + torch_grouped"]
    assert len(given) == 2 and given[0] is given[1]
    assert all(k.workspace is given[0] for k in kernels.values())
    assert [k.problem.max_tokens for k in kernels.values()] == [4, 64]
