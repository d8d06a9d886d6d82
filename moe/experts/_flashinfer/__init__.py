"""Helpers behind the FlashInfer experts (private: no stable API).

One concept per module::

    library.py        lazy import of flashinfer, the MoE feature probe, activation-type mapping
    base.py           what the backends share: their modes' shape (architectures, bf16), one
                      constructor (``FlashInferExperts``), the NVFP4 activation scale, warm-up inputs
    layouts.py        pure-torch weight layout transforms shared by the backends (``Geometry``, gate/up
                      order, padding, trtllm-gen row shuffles, block-K layout, 128x4 scale swizzle,
                      packed top-k)
    sm90.py           pure-torch twins of the SM90 mixed-input (W4A16) weight and scale interleaves
    cutlass_modes.py  per backend, one strategy per mode (scheme): its prepared-weight record, the
    trtllm_modes.py   canonical -> kernel conversion, its extra buffers and kernel arguments
    cutedsl_modes.py

Nothing here imports flashinfer at module import time: every module is importable, and every layout
transform runs, on a CPU-only machine without flashinfer.
"""
