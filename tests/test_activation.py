import math

import pytest
import torch

from moe import Activation, MoEConfigError


def test_silu_gelu_gated_on_hand_values():
    x = torch.tensor([[1.0, -2.0, 3.0, 0.5]])  # gate [1, -2], up [3, 0.5]
    silu = lambda v: v / (1 + math.exp(-v))  # noqa: E731
    gelu = lambda v: 0.5 * v * (1 + math.erf(v / math.sqrt(2)))  # noqa: E731
    torch.testing.assert_close(Activation.parse("silu")(x), torch.tensor([[silu(1) * 3, silu(-2) * 0.5]]))
    torch.testing.assert_close(Activation.parse("gelu")(x), torch.tensor([[gelu(1) * 3, gelu(-2) * 0.5]]))


def test_swiglu_oai_clamps_and_defaults():
    act = Activation.parse("swiglu_oai")
    assert (act.alpha, act.beta, act.limit) == (1.702, 1.0, 7.0)
    x = torch.tensor([[10.0, -1.0, 9.0, -9.0]])  # gate [10, -1] -> [7, -1]; up [9, -9] -> [7, -7]
    expect = [7 / (1 + math.exp(-1.702 * 7)) * (7 + 1), -1 / (1 + math.exp(1.702)) * (-7 + 1)]
    torch.testing.assert_close(act(x), torch.tensor([expect]))


def test_swiglu_oai_configurable_deepseek_v4_style():
    act = Activation.parse("swiglu_oai", alpha=1.0, beta=0.0, limit=3.0)
    x = torch.tensor([[5.0, 2.0]])  # gate 5 -> 3, up 2
    torch.testing.assert_close(act(x), torch.tensor([[3 / (1 + math.exp(-3)) * 2]]))


def test_relu2_is_not_gated():
    act = Activation.parse("relu2")
    assert not act.is_gated and act.w13_rows(16) == 16
    torch.testing.assert_close(act(torch.tensor([-2.0, 0.0, 3.0])), torch.tensor([0.0, 0.0, 9.0]))


def test_errors():
    with pytest.raises(MoEConfigError, match=r"activation must be one of \('silu'"):
        Activation.parse("swish")
    with pytest.raises(MoEConfigError, match="takes no alpha/beta/limit"):
        Activation.parse("silu", limit=7.0) if False else Activation(Activation.parse("silu").kind, limit=7.0)
    with pytest.raises(MoEConfigError, match="limit must be > 0"):
        Activation.parse("swiglu_oai", limit=0.0)
    with pytest.raises(MoEConfigError, match="even last dimension"):
        Activation.parse("silu")(torch.ones(3))


def test_repr_round_trips():
    from moe.activation import ActivationKind  # noqa: F401  (eval needs it)

    act = Activation.parse("swiglu_oai", limit=10.0)
    assert eval(repr(act)) == act


@pytest.mark.parametrize("name", ["silu", "gelu", "swiglu_oai", "relu2"])
def test_out_gets_the_same_values_rounded_once(name):
    """``out=`` writes the result there, bit for bit what the call returns, cast once to out's dtype."""
    act = Activation.parse(name)
    x = 3 * torch.randn(5, 8)
    out = torch.empty(5, 4 if act.is_gated else 8, dtype=torch.bfloat16)
    assert act(x, out=out) is out
    assert torch.equal(out, act(x).to(torch.bfloat16))
