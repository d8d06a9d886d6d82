"""``moe::fused_moe``: a `FusedMoE` forward as one registered torch custom op, so ``torch.compile`` sees
a single opaque call.

Why an op: a layer's forward slices one shared workspace buffer into views of several dtypes, picks its
kernel by M's token bucket, and may read ids on the host; none of that can be traced (AOTAutograd
rejects "input mutations on views with different dtypes", and a bucket chosen in Python would guard, and
so recompile, on every bucket edge). Inside the op all of it runs eagerly, as without compile; the
compiler sees only ``[M, H] in -> [M, H] out`` (the fake implementation), for any M.

Why a handle: an op's arguments are tensors and scalars, and the weights, workspace and kernels must
stay out of the graph. So each layer registers itself under an int (``register``), the op receives
that int and finds the layer in a registry of weak references: the registry never keeps a layer (and
its weights) alive, and a handle whose layer was freed fails with a clear error. The handle is a
constant of the traced graph (dynamo guards on it), like any other int attribute of a module.

Checks: `FusedMoE.forward` runs its shape, dtype and device checks before calling the op, in eager
mode and at trace time under compile. The id range check (``validate``, a host read) runs inside the
op at run time, compiled or not, and is skipped while a CUDA graph is being captured: a host read is
not allowed there, and a captured graph replays without running Python.
"""

from __future__ import annotations

import itertools
import weakref
from typing import TYPE_CHECKING, Optional, Sequence

import torch

from moe.errors import MoEConfigError, UnsupportedError
from moe.kernel import check_ids_in_range

if TYPE_CHECKING:
    from moe.layer import FusedMoE

# handle -> layer. Module-level state on purpose (see the module docstring): the op can reach a layer only
# through an int. Weak: dropping a model frees its layers whatever the registry holds.
_LAYERS: "weakref.WeakValueDictionary[int, FusedMoE]" = weakref.WeakValueDictionary()
_NEXT_HANDLE = itertools.count(1)


def register(layer: "FusedMoE") -> int:
    """A new handle for ``layer`` (each call a new one: a deep copy registers itself again)."""
    handle = next(_NEXT_HANDLE)
    _LAYERS[handle] = layer
    return handle


def layer_of(handle: int) -> "FusedMoE":
    """The layer registered under ``handle``; `MoEConfigError` when it was freed (or never existed)."""
    layer = _LAYERS.get(handle)
    if layer is None:
        raise MoEConfigError(
            f"moe::fused_moe got layer handle {handle}, which names no live FusedMoE (the layer was freed); "
            "call the layer itself rather than the op with a stale handle"
        )
    return layer


@torch.library.custom_op("moe::fused_moe", mutates_args=())
def fused_moe(
    hidden_states: torch.Tensor,
    router_logits: Optional[torch.Tensor],
    topk_ids: Optional[torch.Tensor],
    topk_weights: Optional[torch.Tensor],
    shared_output: Optional[torch.Tensor],
    input_ids: Optional[torch.Tensor],
    layer: int,
    validate: bool,
    ids_name: str,
) -> torch.Tensor:
    """The forward of the `FusedMoE` registered under ``layer``: ``[M, H]``, a new tensor.

    Routing is ``router_logits [M, E]`` (the layer's router), or ``topk_ids [M, k]`` int32 with
    ``topk_weights [M, k]`` float32, exactly one of the two (``input_ids [M]``: the token ids hash routing
    reads, or None); the arguments were checked by the layer.
    ``validate`` checks the ids lie in ``[0, E)`` (a host read; skipped while a CUDA graph is being
    captured), naming them ``ids_name`` in the error.
    """
    return run_layer(hidden_states, router_logits, topk_ids, topk_weights, shared_output, input_ids, layer,
                     validate, ids_name)


def run_layer(hidden_states, router_logits, topk_ids, topk_weights, shared_output, input_ids, layer: int,
              validate: bool, ids_name: str) -> torch.Tensor:
    """The body of ``moe::fused_moe`` (same arguments), callable without the dispatcher."""
    owner = layer_of(layer)
    if validate and topk_ids is not None and not _capturing(topk_ids):
        check_ids_in_range(owner.problem, topk_ids, ids_name)
    return owner.run(hidden_states, router_logits, topk_ids, topk_weights, shared_output, input_ids)


def call(*args) -> torch.Tensor:
    """``moe::fused_moe(*args)`` where it is needed -- while torch.compile traces, and where an input
    needs a gradient (the op's autograd formula makes a backward fail clearly) -- else its body directly.

    Why not always the op: an eager call through the dispatcher costs host time on every forward, and
    the op's first call imports torch._dynamo (measured on an H100: a layer's first forward took 2.2 s,
    most of it that import). `FusedMoE.forward` calls this.
    """
    if torch.compiler.is_compiling() or (torch.is_grad_enabled() and any(
            isinstance(t, torch.Tensor) and t.requires_grad for t in args[:6])):
        return fused_moe(*args)
    return run_layer(*args)


@fused_moe.register_fake
def _fused_moe_fake(hidden_states, router_logits, topk_ids, topk_weights, shared_output, input_ids, layer, validate,
                    ids_name):
    # the output's shape, dtype and device are the input's: nothing else is visible to the compiler
    return hidden_states.new_empty(hidden_states.shape)


@torch.library.custom_op("moe::fused_moe_backward", mutates_args=())
def _no_backward(grad: torch.Tensor, shape: Sequence[int]) -> torch.Tensor:
    """Stands for the gradient of one input of ``moe::fused_moe``: raises when a backward runs. An op (not
    an error raised in the autograd formula) so that compiling with gradients enabled still works --
    AOTAutograd traces the backward at compile time -- and only running a backward fails."""
    raise UnsupportedError(
        "FusedMoE has no backward (it is an inference layer); run it under torch.no_grad() or "
        "torch.inference_mode(), or detach its output"
    )


@_no_backward.register_fake
def _no_backward_fake(grad, shape):
    return grad.new_empty(shape)


def _setup_context(ctx, inputs, output) -> None:
    # the six tensor arguments; integer ones (ids) take no gradient
    ctx.shapes = [None if t is None or not t.is_floating_point() else t.shape for t in inputs[:6]]


def _backward(ctx, grad):
    # every tensor input gets a gradient that raises, so none is silently left without one
    grads = tuple(None if shape is None else _no_backward(grad, shape) for shape in ctx.shapes)
    return grads + (None, None, None)


fused_moe.register_autograd(_backward, setup_context=_setup_context)


def _capturing(tensor: torch.Tensor) -> bool:
    return tensor.is_cuda and torch.cuda.is_current_stream_capturing()


def mark_tokens_dynamic(*tensors: torch.Tensor, dim: int = 0) -> None:
    """Marks ``dim`` of each tensor, before its first compiled call, as the token count M: one unbacked
    size shared by all of them, so that one graph serves every M in ``0..max_tokens``.

    Dynamo otherwise specializes sizes 0 and 1 (a first call with M = 1 compiles for M = 1 only, and a
    later M compiles again); ``mark_unbacked`` does not, and the shared ``shape_id`` tells it these
    tensors (hidden states, router logits or topk ids and weights, a shared expert's output) have the
    same M. Mark the inputs of the compiled callable: sizes computed inside it follow them.
    """
    from torch._dynamo.decorators import mark_unbacked  # a torch.compile tool: imported where it is used

    for tensor in tensors:
        mark_unbacked(tensor, dim, shape_id="moe_tokens")
