"""Validation of routing arguments, shared by `moe.router.Router` and the reference functions.

Each check raises `MoEConfigError` naming the argument, the value and the constraint.
"""

from __future__ import annotations

import torch

from moe.errors import MoEConfigError


def check_logits(logits: object, num_experts: int | None = None) -> None:
    if not isinstance(logits, torch.Tensor):
        raise MoEConfigError(f"router_logits must be a torch.Tensor (got {type(logits).__name__})")
    if logits.dim() != 2:
        raise MoEConfigError(f"router_logits must be 2-D [M, E] (got shape {tuple(logits.shape)})")
    if not logits.is_floating_point():
        raise MoEConfigError(f"router_logits must be floating point (got {logits.dtype})")
    if num_experts is not None and logits.shape[1] != num_experts:
        raise MoEConfigError(
            f"router_logits last dimension must equal num_experts={num_experts} "
            f"(got shape {tuple(logits.shape)})"
        )


def check_top_k(top_k: object, num_experts: int) -> None:
    if isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 1:
        raise MoEConfigError(f"top_k must be an int >= 1 (got {top_k!r})")
    if top_k > num_experts:
        raise MoEConfigError(f"top_k must be <= num_experts (got top_k={top_k}, num_experts={num_experts})")


def check_groups(num_experts: int, top_k: int, n_group: int | None, topk_group: int | None) -> None:
    """The DeepSeek-V3 group constraints; ``n_group=None`` (one group) needs ``topk_group=None``."""
    if n_group is None:
        if topk_group is not None:
            raise MoEConfigError(
                f"topk_group={topk_group!r} needs n_group; pass both or neither (None: one group)"
            )
        return
    for name, value in (("n_group", n_group), ("topk_group", topk_group)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise MoEConfigError(f"{name} must be an int >= 1 when n_group is given (got {value!r})")
    if num_experts % n_group:
        raise MoEConfigError(
            f"n_group must divide num_experts (got n_group={n_group}, num_experts={num_experts})"
        )
    if topk_group > n_group:
        raise MoEConfigError(
            f"topk_group must be <= n_group (got topk_group={topk_group}, n_group={n_group})"
        )
    group_size = num_experts // n_group
    if group_size < 2:
        raise MoEConfigError(
            f"n_group={n_group} leaves groups of {group_size} expert(s) (num_experts={num_experts}); "
            "a group is scored by its top-2 experts, so each needs >= 2; use a smaller n_group"
        )
    if top_k > topk_group * group_size:
        raise MoEConfigError(
            f"top_k={top_k} exceeds the experts of the kept groups: topk_group * num_experts/n_group = "
            f"{topk_group} * {group_size} = {topk_group * group_size}; raise topk_group or lower top_k"
        )


def check_correction_bias(bias: object, num_experts: int) -> None:
    if bias is None:
        return
    if not isinstance(bias, torch.Tensor) or not bias.is_floating_point():
        raise MoEConfigError(
            f"correction_bias must be a floating-point tensor [E] "
            f"(got {bias.dtype if isinstance(bias, torch.Tensor) else type(bias).__name__})"
        )
    if tuple(bias.shape) != (num_experts,):
        raise MoEConfigError(
            f"correction_bias must have shape [num_experts] = ({num_experts},) (got {tuple(bias.shape)})"
        )


def check_renormalize(renormalize: object) -> None:
    if not isinstance(renormalize, bool):
        raise MoEConfigError(f"renormalize must be a bool (got {renormalize!r})")


def check_count(name: str, value: object, minimum: int) -> None:
    """``value`` is an int >= ``minimum`` (bools refused)."""
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise MoEConfigError(f"{name} must be an int >= {minimum} (got {value!r})")


def check_hash_table(table: object, top_k: int, num_choices: int) -> None:
    """``table`` is an integer ``[vocab, top_k]`` tensor of expert ids in ``[0, num_choices)``.

    Reads the values once (a host sync), at construction: a wrong id would index past the experts."""
    if not isinstance(table, torch.Tensor) or table.is_floating_point() or table.is_complex() or table.dtype == torch.bool:
        raise MoEConfigError(
            f"hash_table must be an integer tensor [vocab_size, top_k] of expert ids, DeepSeek-V4's tid2eid "
            f"(got {table.dtype if isinstance(table, torch.Tensor) else type(table).__name__})"
        )
    if table.dim() != 2 or table.shape[1] != top_k or table.shape[0] < 1:
        raise MoEConfigError(
            f"hash_table must have shape [vocab_size, top_k] = [V, {top_k}] with V >= 1 (got {tuple(table.shape)})"
        )
    low, high = int(table.min()), int(table.max())
    if low < 0 or high >= num_choices:
        raise MoEConfigError(
            f"hash_table holds expert ids in [{low}, {high}]; each must lie in [0, {num_choices}) "
            "(num_experts + num_zero_experts)"
        )


def check_input_ids(input_ids: object, num_tokens: int, device: torch.device, vocab_size: int | None) -> None:
    """``input_ids`` is an integer ``[M]`` tensor on ``device``; with ``vocab_size``, every id is in range.

    The range check reads the ids (a host sync); it is skipped while a CUDA graph is being captured
    (the eager warm-up before capture has checked the same code path)."""
    want = f"an integer tensor [M] = [{num_tokens}] of token ids (M = router_logits.shape[0])"
    if not isinstance(input_ids, torch.Tensor):
        raise MoEConfigError(f"input_ids must be {want} (got {type(input_ids).__name__})")
    if input_ids.is_floating_point() or input_ids.is_complex() or input_ids.dtype == torch.bool:
        raise MoEConfigError(f"input_ids must be {want} (got dtype {input_ids.dtype})")
    if tuple(input_ids.shape) != (num_tokens,):
        raise MoEConfigError(f"input_ids must be {want} (got shape {list(input_ids.shape)}); flatten [B, S] ids first")
    if input_ids.device != device:
        raise MoEConfigError(f"input_ids is on {input_ids.device} but router_logits is on {device}")
    if vocab_size is None or num_tokens == 0:
        return
    if input_ids.is_cuda and torch.cuda.is_current_stream_capturing():
        return
    low, high = int(input_ids.min()), int(input_ids.max())
    if low < 0 or high >= vocab_size:
        raise MoEConfigError(
            f"input_ids holds token ids in [{low}, {high}]; the hash_table covers [0, {vocab_size}) (its rows)"
        )
