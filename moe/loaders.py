"""Loaders: the expert tensors of real checkpoint layouts -> `ExpertWeights` (the canonical layout).

``load_experts(tensors, layout, num_experts=E, prefix="model.layers.3.mlp.")`` reads one MoE layer
from a flat ``{key: tensor}`` mapping (a safetensors state dict) and returns canonical weights:
``w13 [E, 2I, H]`` rows ``[gate; up]``, ``w2 [E, H, I]``, optional fp32 biases. No other module
knows checkpoint layouts; `requantize` converts loaded weights to another format.

The layouts, as the Hugging Face transformers modeling code defines them (``nn.Linear(in, out)``
stores its weight as ``[out, in]``; keys below follow ``prefix``):

``qwen3`` -- ``Qwen3MoeSparseMoeBlock.experts``, a ModuleList of ``Qwen3MoeMLP``
    (models/qwen3_moe/modeling_qwen3_moe.py): ``experts.{e}.gate_proj.weight [I, H]``,
    ``experts.{e}.up_proj.weight [I, H]``, ``experts.{e}.down_proj.weight [H, I]`` with
    I = ``moe_intermediate_size``; forward ``down_proj(act(gate_proj(x)) * up_proj(x))``.
    The block is ``model.layers.{l}.mlp.``.
``deepseek`` -- ``DeepseekV3MoE.experts``, a ModuleList of ``DeepseekV3MLP``
    (models/deepseek_v3/modeling_deepseek_v3.py): the same keys, shapes and forward as qwen3.
    ``mlp.shared_experts.*`` is a dense MLP and not read here.
``mixtral`` -- ``MixtralSparseMoeBlock.experts``, a ModuleList of ``MixtralBlockSparseTop2MLP``
    (models/mixtral/modeling_mixtral.py): ``experts.{e}.w1.weight [I, H]`` (gate),
    ``experts.{e}.w3.weight [I, H]`` (up), ``experts.{e}.w2.weight [H, I]`` (down); forward
    ``w2(act(w1(x)) * w3(x))``. The block is ``model.layers.{l}.block_sparse_moe.``.
    (Recent transformers fuse these in memory as ``gate_up_proj [E, 2I, H]``; checkpoints on the
    Hub keep the per-expert keys, which is what this loader reads.)
``gpt_oss`` -- ``GptOssExperts`` (models/gpt_oss/modeling_gpt_oss.py) at ``model.layers.{l}.mlp.``:
    bf16 form: ``experts.gate_up_proj [E, H, 2I]`` used as ``x @ gate_up_proj[e] + bias[e]`` with
    gate = ``[..., ::2]`` and up = ``[..., 1::2]`` (interleaved); ``experts.gate_up_proj_bias
    [E, 2I]``, interleaved alike; ``experts.down_proj [E, I, H]`` used as ``act @ down_proj[e]``;
    ``experts.down_proj_bias [E, H]``. We transpose to ``[E, 2I, H]`` / ``[E, H, I]`` and
    de-interleave to ``[gate; up]``.
    MXFP4 form (the original checkpoint; ``Mxfp4GptOssExperts`` in transformers.integrations.mxfp4):
    ``experts.gate_up_proj_blocks [E, 2I, H/32, 16]`` and ``experts.gate_up_proj_scales
    [E, 2I, H/32]``, ``experts.down_proj_blocks [E, H, I/32, 16]`` and ``experts.down_proj_scales
    [E, H, I/32]``, all uint8, and the biases as above. ``convert_moe_packed_tensors`` decodes byte
    j of block g of a row into elements ``32g + 2j`` (low nibble) and ``32g + 2j + 1`` (high
    nibble) through the LUT ``+0 +.5 +1 +1.5 +2 +3 +4 +6 -0 -.5 -1 -1.5 -2 -3 -4 -6``, multiplies
    by ``2**(scale - 127)`` (ldexp), then transposes ``[E, 2I, H] -> [E, H, 2I]``: block rows are
    the interleaved gate/up columns of the bf16 form. That is our mxfp4 packing exactly (low
    nibble = even element, e8m0 with bias 127), so blocks are reshaped to ``[E, R, H/2]`` and rows
    de-interleaved -- data, scales and bias together -- without dequantizing.
    Which form a checkpoint holds is told by which keys exist.
``nemotron_h`` -- ``NemotronHExperts`` (models/nemotron_h/modeling_nemotron_h.py) as ``save_pretrained``
    writes it, at ``backbone.layers.{l}.mixer.``: non-gated (relu2) experts,
    ``experts.{e}.up_proj.weight [I, H]`` and ``experts.{e}.down_proj.weight [H, I]``; forward
    ``down_proj(relu2(up_proj(x)))``. With a latent MoE (``moe_latent_size`` set), H here is the latent
    size: ``fc1_latent_proj`` / ``fc2_latent_proj`` project to and from it outside the experts.
``transformers_fused`` -- the experts module of transformers >= 5 in memory (its ``state_dict``;
    ``save_pretrained`` converts back to the per-expert keys above): ``experts.gate_up_proj [E, 2I, H]``
    rows ``[gate; up]`` (Qwen3-MoE, Mixtral, DeepSeek-V3/V4), or ``experts.up_proj [E, I, H]`` for
    non-gated experts (Nemotron-H); ``experts.down_proj [E, H, I]``; optional ``experts.gate_up_proj_bias
    [E, 2I]`` (``up_proj_bias``) and ``experts.down_proj_bias [E, H]``. This is the canonical layout.
``transformers_fused_transposed`` -- the transposed, interleaved in-memory form (GPT-OSS's
    ``is_transposed=True, is_concatenated=False``): the ``gpt_oss`` bf16 form, biases optional.
``transformers_transposed`` -- the transposed in-memory form without interleaving (``is_transposed=True``,
    concatenated or without a gate), experts computed ``x @ W``: ``experts.gate_up_proj [E, H, 2I]`` columns
    ``[gate | up]`` (OpenAI's privacy filter) or ``experts.up_proj [E, H, I]`` for non-gated experts (Ergo);
    ``experts.down_proj [E, I, H]``; optional ``experts.gate_up_proj_bias [E, 2I]`` (``up_proj_bias``) and
    ``experts.down_proj_bias [E, H]``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

import torch

from moe.errors import MoEConfigError
from moe.quant import QuantFormat, QuantizedTensor, QuantScheme
from moe.quant.mx import MX_BLOCK  # 32 elements (16 bytes of e2m1) per e8m0 scale
from moe.weights import DENSE_DTYPES, ExpertWeights, check_finite, resolve_quant

LAYOUTS = ("qwen3", "deepseek", "mixtral", "gpt_oss", "nemotron_h", "transformers_fused",
           "transformers_fused_transposed", "transformers_transposed")

# layout -> checkpoint module names of (gate, up, down) under experts.{e}.; gate None: non-gated experts
_PER_EXPERT_NAMES = {
    "qwen3": ("gate_proj", "up_proj", "down_proj"),
    "deepseek": ("gate_proj", "up_proj", "down_proj"),
    "mixtral": ("w1", "w3", "w2"),
    "nemotron_h": (None, "up_proj", "down_proj"),
}
_E8M0_NAN = 0xFF  # the e8m0 encoding of NaN
# a key each layout always has, to name the layout a checkpoint looks like when it is loaded as another
_FIRST_KEYS = {
    **{layout: f"experts.0.{names[0] or names[1]}.weight" for layout, names in _PER_EXPERT_NAMES.items()
       if layout != "deepseek"},
    "gpt_oss": "experts.down_proj_bias",
    "transformers_fused": "experts.down_proj",
}


def load_experts(
    tensors: Mapping[str, torch.Tensor],
    layout: str,
    *,
    num_experts: int,
    prefix: str = "",
    dtype: torch.dtype | None = None,
    hidden_size: int | None = None,
    intermediate_size: int | None = None,
) -> ExpertWeights:
    """Reads one MoE layer's experts stored in ``layout`` (one of `LAYOUTS`) from ``tensors``.

    ``prefix`` is prepended to every key ("model.layers.3.mlp."). ``dtype`` is the storage dtype
    of unquantized weights (None: the checkpoint's); an MXFP4 gpt_oss checkpoint stays MXFP4 and
    ignores it (`requantize` converts). ``hidden_size`` / ``intermediate_size``, when given (a
    layer's H and I), are checked on the first tensor read, so a transposed or foreign tensor is
    named itself rather than the next one that disagrees with it. Raises `MoEConfigError` naming
    the key for a missing key, a wrong shape or dtype, experts of different sizes and NaN.
    """
    if layout not in LAYOUTS:
        raise MoEConfigError(f"layout: unknown checkpoint layout {layout!r}; choose one of {LAYOUTS}")
    if isinstance(num_experts, bool) or not isinstance(num_experts, int) or num_experts <= 0:
        raise MoEConfigError(f"num_experts must be a positive int (got {num_experts!r})")
    if not isinstance(tensors, Mapping):
        raise MoEConfigError(
            f"tensors: expected a mapping of key -> torch.Tensor such as a state dict (got {type(tensors).__name__})"
        )
    if not isinstance(prefix, str):
        raise MoEConfigError(f"prefix: expected a str such as 'model.layers.3.mlp.' (got {prefix!r})")
    sizes = _Sizes(hidden_size, intermediate_size)
    checkpoint = _Checkpoint(tensors, prefix, layout, sizes.note())
    if layout == "gpt_oss":
        return _load_gpt_oss(checkpoint, num_experts, dtype, sizes)
    if layout == "transformers_fused":
        return _load_fused(checkpoint, num_experts, dtype, sizes)
    if layout == "transformers_fused_transposed":
        return _load_gpt_oss_dense(checkpoint, num_experts, dtype, sizes)
    if layout == "transformers_transposed":
        return _load_fused(checkpoint, num_experts, dtype, sizes, transposed=True)
    return _load_per_expert(checkpoint, num_experts, dtype, sizes)


def requantize(
    weights: ExpertWeights,
    quant: "str | QuantScheme | QuantFormat",
    *,
    dtype: torch.dtype | None = None,
) -> ExpertWeights:
    """``weights`` stored in ``quant``'s weight format (dequantize, then quantize again).

    Returns ``weights`` itself when the format already matches (and, for unquantized weights, the
    dtype too). ``dtype`` is as in `ExpertWeights.from_dense`; unquantized results default to
    float32 unless ``quant`` names a dtype ("bf16").
    """
    fmt, dtype = resolve_quant(quant, dtype)
    same_dtype = dtype is None or fmt is not QuantFormat.NONE or dtype == weights.w13.data.dtype
    if fmt == weights.weight_format and same_dtype:
        return weights
    w13, w2 = weights.dequantize(torch.float32)
    return ExpertWeights.from_dense(w13, w2, weights.b13, weights.b2, quant=fmt, dtype=dtype)


def to_layout(weights: ExpertWeights, layout: str, *, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Unquantized canonical ``weights`` as ``layout`` stores them (keys without a prefix), in ``dtype``:
    the inverse of `load_experts` for the in-memory transformers layouts, which ``moe.integrations.transformers``
    uses to give a module its parameters back. Other layouts raise `MoEConfigError`."""
    writers = {"transformers_fused": _fused_tensors, "transformers_fused_transposed": _fused_transposed_tensors,
               "transformers_transposed": _transposed_tensors}
    if layout not in writers:
        raise MoEConfigError(f"layout: to_layout writes {tuple(writers)} (got {layout!r})")
    if weights.weight_format is not QuantFormat.NONE:
        raise MoEConfigError(f"to_layout takes unquantized weights (got {weights.weight_format.value})")
    tensors = writers[layout](weights)
    return {key: value.to(dtype) for key, value in tensors.items() if value is not None}


def _fused_tensors(weights: ExpertWeights) -> dict[str, torch.Tensor | None]:
    first = "gate_up_proj" if weights.w13_rows == 2 * weights.intermediate_size else "up_proj"
    return {f"experts.{first}": weights.w13.data, "experts.down_proj": weights.w2.data,
            f"experts.{first}_bias": weights.b13, "experts.down_proj_bias": weights.b2}


def _transposed_tensors(weights: ExpertWeights) -> dict[str, torch.Tensor | None]:
    return {key: value.transpose(1, 2).contiguous() if key.endswith("proj") and value is not None else value
            for key, value in _fused_tensors(weights).items()}


def _fused_transposed_tensors(weights: ExpertWeights) -> dict[str, torch.Tensor | None]:
    b13 = None if weights.b13 is None else _interleave_rows(weights.b13)
    return {"experts.gate_up_proj": _interleave_rows(weights.w13.data).transpose(1, 2).contiguous(),
            "experts.down_proj": weights.w2.data.transpose(1, 2).contiguous(),
            "experts.gate_up_proj_bias": b13, "experts.down_proj_bias": weights.b2}


@dataclasses.dataclass(frozen=True)
class _Sizes:
    """The H and I a layer expects of a checkpoint, when known (None: whatever the checkpoint holds)."""

    hidden: int | None = None
    inter: int | None = None

    def note(self) -> str:
        known = [f"{n}={v}" for n, v in (("H", self.hidden), ("I", self.inter)) if v is not None]
        return f" (the layer has {', '.join(known)})" if known else ""

    @property
    def gate_up_rows(self) -> int | None:
        """2I, the rows of gate and up together."""
        return None if self.inter is None else 2 * self.inter


@dataclasses.dataclass(frozen=True)
class _Checkpoint:
    """One layer's tensors, read by key relative to ``prefix``; every error names the full key."""

    tensors: Mapping[str, torch.Tensor]
    prefix: str
    layout: str  # named in errors: "mixtral", "gpt_oss (MXFP4 form)"
    sizes_note: str = ""  # " (the layer has H=.., I=..)": said with every shape error

    def has(self, key: str) -> bool:
        return self.prefix + key in self.tensors

    def missing(self, *keys: str) -> MoEConfigError:
        names = " or ".join(repr(self.prefix + k) for k in keys)
        near = sorted(k for k in self.tensors if isinstance(k, str) and k.startswith(self.prefix))[:6]
        dotted = self.prefix + "." + keys[0]
        hint = f"; did you mean prefix={self.prefix + '.'!r}?" if self.prefix and dotted in self.tensors else ""
        others = [name for name, key in _FIRST_KEYS.items() if name != self.layout.split()[0] and self.has(key)]
        hint += f"; the keys look like the {others[0]!r} layout" if others and not hint else ""
        return MoEConfigError(
            f"missing key {names}, which the {self.layout} layout expects; "
            f"keys under prefix {self.prefix!r} start with {near or 'nothing'}{hint}"
        )

    def get(
        self,
        key: str,
        dims: str,
        shape: tuple[int | None, ...],
        note: str = "",
        dtype: torch.dtype | None = None,
    ) -> torch.Tensor:
        """The tensor at ``prefix + key``, checked for dtype, shape and NaN.

        ``dims`` names the dimensions in errors ("[E, H, 2I]"); ``shape`` holds their sizes, None
        where any size goes. ``*_blocks`` / ``*_scales`` keys are uint8, other keys ``dtype`` if
        given, else any of `DENSE_DTYPES`.
        """
        full = self.prefix + key
        if full not in self.tensors:
            raise self.missing(key)
        tensor = self.tensors[full]
        if not isinstance(tensor, torch.Tensor):
            raise MoEConfigError(f"{full!r}: expected a torch.Tensor (got {type(tensor).__name__})")
        if key.endswith(("_blocks", "_scales")):
            dtypes = (torch.uint8,)
        else:
            dtypes = DENSE_DTYPES if dtype is None else (dtype,)
        if tensor.dtype not in dtypes:
            fp8 = tensor.dtype.is_floating_point and tensor.element_size() == 1
            raise MoEConfigError(
                f"{full!r}: dtype must be one of {dtypes} for the {self.layout} layout{note} "
                f"(got {tensor.dtype})" + ("; dequantize fp8 checkpoints first" if fp8 else "")
            )
        got = tuple(tensor.shape)
        if len(got) != len(shape) or any(w is not None and w != g for w, g in zip(shape, got)):
            want = "(" + ", ".join("*" if w is None else str(w) for w in shape) + ")"
            raise MoEConfigError(f"{full!r}: expected shape {dims} = {want}{note}{self.sizes_note} (got {got})")
        if tensor.dtype.is_floating_point:
            check_finite(repr(full), tensor)
        return tensor


def _load_per_expert(
    checkpoint: _Checkpoint, num_experts: int, dtype: torch.dtype | None, sizes: _Sizes
) -> ExpertWeights:
    """qwen3 / deepseek / mixtral / nemotron_h: nn.Linear weights ``[out, in]`` per expert (gate, up, down;
    nemotron_h has no gate)."""
    gate_name, up_name, down_name = _PER_EXPERT_NAMES[checkpoint.layout]
    first = f"experts.0.{gate_name or up_name}.weight"
    reference = checkpoint.get(first, "[I, H]", (sizes.inter, sizes.hidden))
    (inter, hidden), stored = reference.shape, reference.dtype
    beyond = f"experts.{num_experts}.{gate_name or up_name}.weight"
    if checkpoint.has(beyond):
        raise MoEConfigError(
            f"found key {checkpoint.prefix + beyond!r} but num_experts={num_experts}; pass the "
            "layer's full expert count (ExpertWeights.select_experts takes a subset)"
        )
    note = f" (as {checkpoint.prefix + first!r}: every expert has the same sizes and dtype)"
    get = lambda e, name, dims, shape: checkpoint.get(f"experts.{e}.{name}.weight", dims, shape, note, stored)  # noqa: E731
    w13, w2 = [], []
    for e in range(num_experts):
        rows = [get(e, name, "[I, H]", (inter, hidden)) for name in (gate_name, up_name) if name is not None]
        w13.append(torch.cat(rows, dim=0))
        w2.append(get(e, down_name, "[H, I]", (hidden, inter)))
    return ExpertWeights.from_dense(torch.stack(w13), torch.stack(w2), dtype=dtype)


def _load_fused(checkpoint: _Checkpoint, num_experts: int, dtype: torch.dtype | None, sizes: _Sizes,
                transposed: bool = False) -> ExpertWeights:
    """transformers_fused: the canonical layout under transformers' names; contiguous tensors of the
    requested dtype are used as they are (no copy). ``transposed`` (transformers_transposed): the same
    tensors stored ``x @ W``, transposed back (a copy)."""
    gated = checkpoint.has("experts.gate_up_proj") or not checkpoint.has("experts.up_proj")
    first = "experts.gate_up_proj" if gated else "experts.up_proj"
    rows = sizes.gate_up_rows if gated else sizes.inter
    r = "2I" if gated else "I"

    def get(key: str, out_dims: str, in_dims: str, out_size, in_size) -> torch.Tensor:
        if not transposed:
            return checkpoint.get(key, f"[E, {out_dims}, {in_dims}]", (num_experts, out_size, in_size))
        return checkpoint.get(key, f"[E, {in_dims}, {out_dims}]", (num_experts, in_size, out_size)).transpose(1, 2)

    w13 = get(first, r, "H", rows, sizes.hidden)
    _, rows, hidden = w13.shape
    if gated:
        _check_even_rows(checkpoint, first, rows, multiple=1)
    w2 = get("experts.down_proj", "H", "I", hidden, rows // 2 if gated else rows)
    b13 = _optional(checkpoint, first + "_bias", "[E, R]", (num_experts, rows))
    b2 = _optional(checkpoint, "experts.down_proj_bias", "[E, H]", (num_experts, hidden))
    if transposed:
        w13, w2 = w13.contiguous(), w2.contiguous()
    return ExpertWeights.from_dense(w13, w2, b13, b2, dtype=dtype)


def _optional(checkpoint: _Checkpoint, key: str, dims: str, shape: tuple[int, ...]) -> torch.Tensor | None:
    return checkpoint.get(key, dims, shape) if checkpoint.has(key) else None


def _load_gpt_oss(
    checkpoint: _Checkpoint, num_experts: int, dtype: torch.dtype | None, sizes: _Sizes
) -> ExpertWeights:
    """The MXFP4 form when its blocks are present, else the bf16 form."""
    if checkpoint.has("experts.gate_up_proj_blocks"):
        mxfp4 = dataclasses.replace(checkpoint, layout="gpt_oss (MXFP4 form)")
        return _load_gpt_oss_mxfp4(mxfp4, num_experts, sizes)
    if checkpoint.has("experts.gate_up_proj"):
        dense = dataclasses.replace(checkpoint, layout="gpt_oss (bf16 form)")
        return _load_gpt_oss_dense(dense, num_experts, dtype, sizes)
    raise checkpoint.missing("experts.gate_up_proj", "experts.gate_up_proj_blocks")


def _load_gpt_oss_dense(
    checkpoint: _Checkpoint, num_experts: int, dtype: torch.dtype | None, sizes: _Sizes
) -> ExpertWeights:
    gate_up_shape = (num_experts, sizes.hidden, sizes.gate_up_rows)
    gate_up = checkpoint.get("experts.gate_up_proj", "[E, H, 2I]", gate_up_shape)
    _, hidden, rows = gate_up.shape
    _check_even_rows(checkpoint, "experts.gate_up_proj", rows, multiple=1)
    down = checkpoint.get("experts.down_proj", "[E, I, H]", (num_experts, rows // 2, hidden))
    b13, b2 = _gpt_oss_biases(checkpoint, num_experts, rows, hidden)
    w13 = _deinterleave_rows(gate_up.transpose(1, 2))  # x @ [E, H, 2I] -> rows of [E, 2I, H]
    return ExpertWeights.from_dense(w13, down.transpose(1, 2).contiguous(), b13, b2, dtype=dtype)


def _load_gpt_oss_mxfp4(checkpoint: _Checkpoint, num_experts: int, sizes: _Sizes) -> ExpertWeights:
    block_bytes = MX_BLOCK // 2
    key = "experts.gate_up_proj_blocks"
    hidden_blocks = None if sizes.hidden is None or sizes.hidden % MX_BLOCK else sizes.hidden // MX_BLOCK
    blocks_shape = (num_experts, sizes.gate_up_rows, hidden_blocks, block_bytes)
    blocks = checkpoint.get(key, "[E, 2I, H/32, 16]", blocks_shape)
    experts, rows, hidden_blocks, _ = blocks.shape
    _check_even_rows(checkpoint, key, rows, multiple=MX_BLOCK)
    hidden, inter = hidden_blocks * MX_BLOCK, rows // 2
    up_shape, down_shape = (experts, rows, hidden_blocks), (experts, hidden, inter // MX_BLOCK)
    scales = _e8m0(checkpoint, "experts.gate_up_proj_scales", "[E, 2I, H/32]", up_shape)
    down_blocks = checkpoint.get(
        "experts.down_proj_blocks", "[E, H, I/32, 16]", (*down_shape, block_bytes)
    )
    down_scales = _e8m0(checkpoint, "experts.down_proj_scales", "[E, H, I/32]", down_shape)
    b13, b2 = _gpt_oss_biases(checkpoint, experts, rows, hidden)
    # Packed bytes stay in their row, so de-interleaving rows moves data and scales alike.
    w13 = _mxfp4_weight(blocks.reshape(experts, rows, hidden // 2), scales, deinterleave=True)
    down_blocks = down_blocks.reshape(experts, hidden, inter // 2)
    w2 = _mxfp4_weight(down_blocks, down_scales, deinterleave=False)
    return ExpertWeights(w13, w2, b13, b2)


def _e8m0(checkpoint: _Checkpoint, key: str, dims: str, shape: tuple[int, ...]) -> torch.Tensor:
    """MXFP4 scale bytes, which must not hold the e8m0 NaN."""
    scale = checkpoint.get(key, dims, shape)
    if bool((scale == _E8M0_NAN).any()):
        raise MoEConfigError(f"{checkpoint.prefix + key!r} contains NaN at load (e8m0 byte 0xFF)")
    return scale


def _check_even_rows(checkpoint: _Checkpoint, key: str, rows: int, multiple: int) -> None:
    if rows % (2 * multiple):
        raise MoEConfigError(
            f"{checkpoint.prefix + key!r}: the gate/up dimension 2I={rows} must be even, "
            f"with I a multiple of {multiple}"
        )


def _gpt_oss_biases(
    checkpoint: _Checkpoint, experts: int, rows: int, hidden: int
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """``(b13 [E, 2I] de-interleaved, b2 [E, H])`` in float32; the gpt_oss layout requires them, the
    transformers_fused_transposed layout reads them where they are present."""
    keys = ("experts.gate_up_proj_bias", "experts.down_proj_bias")
    if checkpoint.layout.startswith("transformers") and not any(checkpoint.has(k) for k in keys):
        return None, None
    b13 = checkpoint.get(keys[0], "[E, 2I]", (experts, rows))
    b2 = checkpoint.get(keys[1], "[E, H]", (experts, hidden))
    return _deinterleave_rows(b13.float()), b2.float().contiguous()


def _mxfp4_weight(data: torch.Tensor, scale: torch.Tensor, *, deinterleave: bool) -> QuantizedTensor:
    if deinterleave:
        data, scale = _deinterleave_rows(data), _deinterleave_rows(scale)
    return QuantizedTensor(
        data=data.contiguous(), scale=scale.contiguous(), fmt=QuantFormat.MXFP4, role="weight"
    )


def _deinterleave_rows(x: torch.Tensor) -> torch.Tensor:
    """Dimension 1 from interleaved ``g0, u0, g1, u1, ...`` to ``[gate; up]``, as a new tensor."""
    return torch.cat([x[:, 0::2], x[:, 1::2]], dim=1)


def _interleave_rows(x: torch.Tensor) -> torch.Tensor:
    """Dimension 1 from ``[gate; up]`` to interleaved ``g0, u0, g1, u1, ...`` (undoes `_deinterleave_rows`)."""
    gate, up = x.chunk(2, dim=1)
    return torch.stack([gate, up], dim=2).flatten(1, 2)
