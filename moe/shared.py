"""Shared experts: the dense MLP every token passes through beside its routed experts.

``SharedExperts(H, I, activation=...)`` holds its own weights in the canonical dense layout::

    w13 [2I, H]  rows [gate; up]   (non-gated activations, Nemotron-H's relu2: [I, H])
    w2  [H, I]
    gate [1, H]  optional, Qwen2-MoE's ``shared_expert_gate``
    out = (activation(x @ w13^T) @ w2^T) * sigmoid(x @ gate^T)     (the last factor only with a gate)

computed in its dtype, as the transformers modules compute it. ``moe.shared_loaders`` reads it from
the checkpoint layouts of DeepSeek-V3/V4, Qwen2-MoE, Nemotron-H and Llama-4.

A `moe.FusedMoE` built with ``shared_experts=`` (a `SharedExperts` or a `SharedExpertsConfig`) runs it
itself. On CUDA it runs on a second stream (`SharedStream`): that stream waits for everything queued
before the layer (its input), computes into an output allocated on the layer's stream, and records an
event; the routed experts run meanwhile, and the layer's stream waits for that event right before
finalize, which adds the output. No host synchronization, so the layer can be captured in a CUDA graph.
On a CPU the shared experts run first, then the routed ones.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch

from moe.activation import Activation
from moe.errors import MoEConfigError
from moe.problem import MoEProblem, check_dtype
from moe.weights import check_finite


@dataclass(frozen=True)
class SharedExpertsConfig:
    """What `moe.FusedMoE` builds a `SharedExperts` from (H, dtype and device are the layer's).

    ``intermediate_size``: I of the shared MLP (DeepSeek: ``moe_intermediate_size * n_shared_experts``;
    Qwen2-MoE: ``shared_expert_intermediate_size``). ``activation``: None for the layer's own.
    ``sigmoid_gate``: Qwen2-MoE's ``shared_expert_gate``.

    >>> SharedExpertsConfig(2048)
    SharedExpertsConfig(intermediate_size=2048, activation=None, sigmoid_gate=False)
    """

    intermediate_size: int
    activation: "str | Activation | None" = None
    sigmoid_gate: bool = False

    def __post_init__(self):
        _check_size("intermediate_size", self.intermediate_size)
        if self.activation is not None:
            object.__setattr__(self, "activation", Activation.parse(self.activation))
        if not isinstance(self.sigmoid_gate, bool):
            raise MoEConfigError(f"sigmoid_gate must be a bool (got {self.sigmoid_gate!r})")

    def build(self, layer: MoEProblem, device: torch.device | str) -> "SharedExperts":
        """The module for a layer of problem ``layer`` on ``device``."""
        return SharedExperts(layer.hidden_size, self.intermediate_size, activation=self.activation or layer.activation,
                             sigmoid_gate=self.sigmoid_gate, dtype=layer.dtype, device=device)

    def problem(self, layer: MoEProblem) -> MoEProblem:
        """The dense MLP as the oracle costs it: one expert, top-1, unquantized in the layer's dtype (its
        roofline is a dense MLP's). The sigmoid gate, H multiply-adds a token, is left out."""
        return MoEProblem.create(num_experts=1, top_k=1, hidden_size=layer.hidden_size,
                                 intermediate_size=self.intermediate_size,
                                 activation=self.activation or layer.activation, dtype=layer.dtype,
                                 max_tokens=layer.max_tokens)


class SharedExperts(torch.nn.Module):
    """A dense MLP ``forward(x [M, H]) -> [M, H]`` (the module docstring has the math).

    >>> shared = SharedExperts(64, 32, dtype=torch.float32)
    >>> shared.load_weights(w13=torch.randn(64, 64) / 8, w2=torch.randn(64, 32) / 8)
    >>> shared(torch.randn(3, 64)).shape
    torch.Size([3, 64])
    """

    def __init__(self, hidden_size: int, intermediate_size: int, *, activation: "str | Activation" = "silu",
                 sigmoid_gate: bool = False, dtype: torch.dtype = torch.bfloat16,
                 device: torch.device | str = "cpu"):
        super().__init__()
        self.config = SharedExpertsConfig(intermediate_size, Activation.parse(activation), sigmoid_gate)
        _check_size("hidden_size", hidden_size)
        check_dtype(dtype)
        self.hidden_size, self.intermediate_size = hidden_size, intermediate_size
        self.activation: Activation = self.config.activation  # type: ignore[assignment]
        rows = self.activation.w13_rows(intermediate_size)
        empty = dict(dtype=dtype, device=torch.device(device))
        self.register_buffer("w13", torch.empty(rows, hidden_size, **empty))
        self.register_buffer("w2", torch.empty(hidden_size, intermediate_size, **empty))
        self.register_buffer("gate", torch.empty(1, hidden_size, **empty) if sigmoid_gate else None)
        self.loaded = False

    @property
    def dtype(self) -> torch.dtype:
        return self.w13.dtype

    @property
    def device(self) -> torch.device:
        return self.w13.device

    @property
    def sigmoid_gate(self) -> bool:
        return self.config.sigmoid_gate

    def extra_repr(self) -> str:
        return (f"H={self.hidden_size}, I={self.intermediate_size}, activation={self.activation.name}, "
                f"sigmoid_gate={self.sigmoid_gate}, dtype={self.dtype}, device={self.device}")

    def load_weights(self, *, w13: torch.Tensor, w2: torch.Tensor, gate: torch.Tensor | None = None) -> None:
        """Dense float weights in the canonical layout (module docstring), cast to the module's dtype;
        ``gate [1, H]`` exactly when built with ``sigmoid_gate=True``. Raises `MoEConfigError` naming the
        argument for a wrong shape, a non-float or non-finite tensor, or a missing/unexpected gate."""
        if (gate is not None) != self.sigmoid_gate:
            raise MoEConfigError(
                f"gate: {'missing' if gate is None else 'given'}, but these shared experts were built with "
                f"sigmoid_gate={self.sigmoid_gate}; pass gate [1, H] exactly when sigmoid_gate=True (Qwen2-MoE)")
        H, rows = self.hidden_size, self.w13.shape[0]
        wanted = [("w13", w13, (rows, H), "[2I, H] rows [gate; up]" if self.activation.is_gated else "[I, H]"),
                  ("w2", w2, (H, self.intermediate_size), "[H, I]")]
        wanted += [("gate", gate, (1, H), "[1, H]")] if gate is not None else []
        for name, tensor, shape, dims in wanted:
            if not isinstance(tensor, torch.Tensor) or not tensor.is_floating_point():
                got = tensor.dtype if isinstance(tensor, torch.Tensor) else type(tensor).__name__
                raise MoEConfigError(f"{name} must be a floating-point torch.Tensor {dims} (got {got})")
            if tuple(tensor.shape) != shape:
                raise MoEConfigError(f"{name} must be {dims} = {list(shape)} for H={H}, I={self.intermediate_size}, "
                                     f"activation {self.activation.name} (got {list(tensor.shape)})")
            check_finite(name, tensor)
        with torch.no_grad():
            for name, tensor, _, _ in wanted:
                getattr(self, name).copy_(tensor)
        self.loaded = True

    def load_checkpoint(self, tensors: Mapping[str, torch.Tensor], layout: str, *, prefix: str = "") -> None:
        """The shared MLP as a checkpoint stores it: ``layout`` one of ``moe.shared_loaders.SHARED_LAYOUTS``,
        ``prefix`` the MoE block's ("model.layers.3.mlp.")."""
        from moe.shared_loaders import read_shared

        self.load_weights(**read_shared(tensors, layout, prefix=prefix, hidden_size=self.hidden_size,
                                        intermediate_size=self.intermediate_size,
                                        gated=self.activation.is_gated, sigmoid_gate=self.sigmoid_gate))

    def check(self, hidden: torch.Tensor) -> None:
        """Raises `MoEConfigError` unless loaded and ``hidden`` is ``[M, H]`` of the module's dtype and device."""
        if not self.loaded:
            raise MoEConfigError("SharedExperts has no weights; call load_weights or load_checkpoint first")
        if hidden.dim() != 2 or hidden.shape[1] != self.hidden_size or hidden.dtype != self.dtype:
            raise MoEConfigError(f"shared experts take [M, {self.hidden_size}] {self.dtype} (got "
                                 f"{list(hidden.shape)} {hidden.dtype})")
        if hidden.device != self.device:
            raise MoEConfigError(f"hidden is on {hidden.device} but the shared experts are on {self.device}")

    def forward(self, hidden: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """``hidden [M, H]`` -> ``[M, H]`` in the module's dtype, written into ``out`` when given."""
        self.check(hidden)
        inner = self.activation(torch.nn.functional.linear(hidden, self.w13))
        if self.gate is None:
            return torch.matmul(inner, self.w2.t(), out=out)
        scale = torch.sigmoid(torch.nn.functional.linear(hidden, self.gate))
        return torch.mul(torch.nn.functional.linear(inner, self.w2), scale, out=out)


@dataclass(frozen=True)
class PendingShared:
    """Shared experts' output being computed on a second CUDA stream: ``tensor [M, H]`` (allocated on
    the layer's stream) is complete on any stream that waited for ``ready``. `join` waits."""

    tensor: torch.Tensor
    ready: torch.cuda.Event


def join(shared_output: "torch.Tensor | PendingShared | None") -> torch.Tensor | None:
    """The shared output, usable on the current stream: for a `PendingShared`, the current stream waits
    (on the GPU, not the host) for its event first. Called right before finalize adds it."""
    if not isinstance(shared_output, PendingShared):
        return shared_output
    torch.cuda.current_stream(shared_output.tensor.device).wait_event(shared_output.ready)
    return shared_output.tensor


def pending_tensor(shared_output: "torch.Tensor | PendingShared | None") -> torch.Tensor | None:
    """The tensor a shared output is or will be (for shape checks, which read no data)."""
    return shared_output.tensor if isinstance(shared_output, PendingShared) else shared_output


class SharedStream:
    """A second CUDA stream on which shared experts run beside the routed experts of the layer's stream."""

    def __init__(self, device: torch.device):
        self.stream = torch.cuda.Stream(device)

    def launch(self, shared: SharedExperts, hidden: torch.Tensor) -> PendingShared:
        """Queues ``shared(hidden)`` on the second stream after everything queued so far on the current
        one (``hidden`` included); returns at once with the output and the event that marks it done."""
        shared.check(hidden)
        main = torch.cuda.current_stream(hidden.device)
        # allocated on the layer's stream, which frees it there after its join: no record_stream needed
        out = torch.empty_like(hidden)
        self.stream.wait_stream(main)
        with torch.cuda.stream(self.stream):
            shared(hidden, out=out)
            ready = self.stream.record_event()
        return PendingShared(out, ready)


def shared_experts_for(given: "SharedExperts | SharedExpertsConfig | None", layer: MoEProblem,
                       device: torch.device) -> SharedExperts | None:
    """The layer's `SharedExperts`: built from a config, or the given module checked against the layer."""
    if given is None:
        return None
    if isinstance(given, SharedExpertsConfig):
        return given.build(layer, device)
    if isinstance(given, SharedExperts):
        _check_fits(given, layer, device)
        return given
    raise MoEConfigError(f"shared_experts must be a moe.SharedExperts, a moe.SharedExpertsConfig or None "
                         f"(got {type(given).__name__})")


def _check_fits(shared: SharedExperts, layer: MoEProblem, device: torch.device) -> None:
    mine = (shared.hidden_size, shared.dtype, shared.device.type)
    theirs = (layer.hidden_size, layer.dtype, device.type)
    if mine != theirs:
        raise MoEConfigError(
            f"shared_experts has H={mine[0]}, dtype {mine[1]}, device {mine[2]} but the layer has H={theirs[0]}, "
            f"dtype {theirs[1]}, device {theirs[2]}; build it with the layer's, or pass "
            f"SharedExpertsConfig({shared.intermediate_size}) and let the layer build it")


def _check_size(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise MoEConfigError(f"{name} must be a positive int (got {value!r})")

