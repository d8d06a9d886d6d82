import pytest
import torch

from moe import MoEConfigError, MoEProblem, ParallelConfig
from moe.activation import Activation, ActivationKind  # noqa: F401  (repr eval)
from moe.quant import QuantFormat, QuantScheme  # noqa: F401


def make(**kw):
    args = dict(num_experts=8, top_k=2, hidden_size=64, intermediate_size=32)
    args.update(kw)
    return MoEProblem.create(**args)


def test_defaults_and_derived():
    p = make()
    assert p.dtype == torch.bfloat16 and p.quant_name == "bf16" and p.w13_rows == 64
    assert make(activation="relu2").w13_rows == 32
    assert make(quant="fp16").dtype == torch.float16


def test_repr_round_trips():
    p = make(quant="fp8_block", activation="swiglu_oai", has_bias=True)
    assert eval(repr(p)) == p


@pytest.mark.parametrize(
    "kw,match",
    [
        (dict(top_k=9), "top_k must be <= num_experts"),
        (dict(top_k=0), "top_k must be a positive int"),
        (dict(hidden_size=-4), "hidden_size must be a positive int"),
        (dict(intermediate_size=2.5), "intermediate_size must be a positive int"),
        (dict(quant="int3"), "int3"),
        (dict(activation="tanh"), "activation must be one of"),
        (dict(quant="bf16", dtype=torch.float16), "quant='bf16' keeps weights in torch.bfloat16 but dtype=torch.float16"),
        (dict(dtype=torch.int8, quant="fp8"), "dtype must be one of"),
        (dict(parallel=ParallelConfig(ep_size=3)), "num_experts=8 must be divisible by ep_size=3"),
    ],
)
def test_errors_name_the_argument(kw, match):
    with pytest.raises(MoEConfigError, match=match):
        make(**kw)


def test_parallel_config():
    par = ParallelConfig(ep_size=2, ep_rank=1)
    assert par.global_to_local(4) == [-1, -1, 0, 1] and par.local_num_experts(4) == 2
    assert ParallelConfig(expert_map=(1, -1, 0)).local_num_experts(3) == 2
    with pytest.raises(MoEConfigError, match="ep_rank must be in"):
        ParallelConfig(ep_size=2, ep_rank=2)
    with pytest.raises(MoEConfigError, match="expert_map must map"):
        ParallelConfig(expert_map=(0, 0, -1))
    with pytest.raises(MoEConfigError, match="expert_map has 3 entries but num_experts=4"):
        make(num_experts=4, parallel=ParallelConfig(expert_map=(0, 1, 2)))
