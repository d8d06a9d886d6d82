"""Policy files and environment: force, deny, prefer, buckets, profiles, and their errors."""

from __future__ import annotations

import pytest
import yaml

from moe import MoEConfigError, MoEProblem, Platform, UnsupportedError
from moe.oracle import Policy, plan
from moe.oracle.policy import DEFAULT_BUCKETS, KEYS

CPU = Platform.preset("cpu")
PROBLEM = MoEProblem.create(num_experts=8, top_k=2, hidden_size=64, intermediate_size=32, max_tokens=256)


def _write(tmp_path, data, name="policy.yaml"):
    path = tmp_path / name
    path.write_text(yaml.safe_dump(data) if not isinstance(data, str) else data)
    return path


def test_policy_file_with_every_key(tmp_path):
    (tmp_path / "prof").mkdir()
    _write(tmp_path / "prof", {"version": 1, "backends": {}}, "bench.yaml")
    path = _write(tmp_path, {"force": "reference", "deny": ["batched"], "prefer": ["local"], "prefer_margin": 0.2,
                             "buckets": [1, 8, 64], "profiles": ["prof/bench.yaml"]})
    policy = Policy.from_file(path)
    assert policy.force == ("reference",) and policy.deny == ("batched",) and policy.buckets == (1, 8, 64)
    assert policy.profiles == (str(tmp_path / "prof" / "bench.yaml"),) and policy.source == str(path)
    result = plan(PROBLEM, CPU, policy)
    assert [(b.low, b.high) for b in result.buckets] == [(1, 1), (2, 8), (9, 64), (65, 256)]
    assert {b.chosen.pair.experts for b in result.buckets} == {"reference"}
    assert result.rejected["batched"] == (f"denied by policy ({path})",)
    assert result.rejected["torch_grouped"] == (f"policy ({path}) forces reference",)
    assert Policy.from_file(_write(tmp_path, "", "empty.yaml")) == Policy(source=str(tmp_path / "empty.yaml"))


@pytest.mark.parametrize("data,match", [
    ({"forse": "triton"}, r"unknown key\(s\) \['forse'\]; allowed keys: " + ", ".join(KEYS)),
    ({"force": 3}, "force must be a name or a list of names"),
    ({"deny": [""]}, "deny must be a name or a list of names"),
    ({"buckets": [16, 4]}, "buckets must be a non-empty list of increasing ints >= 1"),
    ({"buckets": []}, "buckets must be"),
    ({"prefer_margin": "big"}, r"prefer_margin must be a number in \[0, 10\)"),
    ({"force": "reference", "deny": ["reference"]}, "both forced and denied"),
    (["force", "triton"], "must be a mapping of force, deny"),
])
def test_invalid_policy_files_name_the_key_and_the_allowed_values(tmp_path, data, match):
    with pytest.raises(MoEConfigError, match=match):
        Policy.from_file(_write(tmp_path, data))


def test_unknown_backend_names_and_two_forced_experts_are_errors():
    with pytest.raises(MoEConfigError, match=r"deny names unknown backend\(s\) \['trition'\]; experts: .*reference"):
        plan(PROBLEM, CPU, Policy(deny=("trition",)))
    with pytest.raises(MoEConfigError, match="force names 2 experts backends"):
        plan(PROBLEM, CPU, Policy(force=("reference", "torch_grouped")))
    with pytest.raises(MoEConfigError, match="does not exist"):
        Policy.from_file("/no/such/policy.yaml")
    with pytest.raises(MoEConfigError, match="profile file .* does not exist"):
        plan(PROBLEM, CPU, Policy(profiles=("/no/such/profile.yaml",)))


def test_environment(tmp_path, monkeypatch):
    path = _write(tmp_path, {"force": "torch_grouped", "buckets": [2]})
    assert Policy.from_env({}) == Policy()
    from_file = Policy.from_env({"MOE_POLICY": str(path)})
    assert from_file.force == ("torch_grouped",) and from_file.buckets == (2,)
    both = Policy.from_env({"MOE_POLICY": str(path), "MOE_EXPERTS": "reference", "MOE_PROFILE": "a.yaml:b.yaml"})
    assert both.force == ("reference",) and both.buckets == (2,) and both.profiles == ("a.yaml", "b.yaml")
    assert both.source == f"{path} + MOE_EXPERTS"
    monkeypatch.setenv("MOE_EXPERTS", "reference")
    assert {b.chosen.pair.experts for b in plan(PROBLEM, CPU).buckets} == {"reference"}


def test_a_forced_backend_that_cannot_serve_raises_nothing_falls_back():
    nvfp4 = MoEProblem.create(num_experts=8, top_k=2, hidden_size=64, intermediate_size=32, quant="nvfp4")
    with pytest.raises(UnsupportedError, match=r"policy \(MOE_EXPERTS\) forces experts 'torch_grouped'") as error:
        plan(nvfp4, CPU, Policy().forcing("torch_grouped", source="MOE_EXPERTS"))
    assert error.value.reasons and "quant nvfp4" in error.value.reasons[0]


def test_bucket_edges_are_closed_by_max_tokens():
    assert Policy().bucket_edges(8192) == (1, 4, 16, 64, 256, 1024, 4096, 8192)
    assert Policy().bucket_edges(1) == (1,)
    assert Policy(buckets=(8, 100)).bucket_edges(50) == (8, 50)
    assert DEFAULT_BUCKETS[0] == 1
