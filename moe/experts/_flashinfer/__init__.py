"""Helpers behind the FlashInfer experts (private: no stable API).

One concept per module::

    library.py   lazy import of flashinfer, the MoE feature probe, activation-type mapping
    modes.py     ``ModeSpec``: what one (weight, activation) format pair needs, and its check
    layouts.py   pure-torch weight layout transforms shared by the backends (gate/up order, padding,
                 trtllm-gen row shuffles, block-K layout, 128x4 scale swizzle, packed top-k)
    sm90.py      pure-torch twins of the SM90 mixed-input (W4A16) weight and scale interleaves
    packing.py   per-backend prepared-weight records and the canonical -> kernel conversions

Nothing here imports flashinfer at module import time: every module is importable, and every layout
transform runs, on a CPU-only machine without flashinfer.
"""
