"""Turns the bench results committed under benchmarks/results/ into the oracle's measured profile
(moe/oracle/profiles/measured-h200.yaml), so plans on an H200 rank backends by what was measured.

    python benchmarks/make_measured_profile.py

Every entry is one (backend, scheme, preset shape, M) time; the oracle turns it into an efficiency
against the roofline of that shape and interpolates between token counts.
"""

from __future__ import annotations

import json
from pathlib import Path

from moe.oracle.profile import PROFILE_DIR, ProfileEntry, save_profile
from moe.platform import Platform
from moe.presets import load_preset

RESULTS = Path(__file__).parent / "results"
SOURCES = {  # file -> (list key, fixed preset or None to read each record's), in order
    "triton_profile_bf16_nvidia-h200.json": ("entries", None),
    "triton_profile_fp8_block_mxfp4_nvidia-h200.json": ("entries", None),
    "flashinfer_cutlass_gpt-oss-20b_h200.json": ("records", "gpt-oss-20b"),
    # later files replace earlier measurements of the same backend, scheme, shape and M
    "triton_mxfp4_nvidia-h200.json": ("records", None),  # after the MXFP4 scale-load rework
    # session 2: TMA weight tiles, the new alignment, the sync-free torch_grouped, FlashInfer at every preset
    "fp8_block_nvidia-h200.json": ("records", None),
    "mxfp4_gpt-oss-120b_nvidia-h200.json": ("records", None),
    "bf16_qwen3_mixtral_nvidia-h200.json": ("records", None),
    "bf16_gpt-oss_deepseek_nvidia-h200.json": ("records", None),
}


def main() -> None:
    platform = Platform.preset("h200")
    entries = []
    for name, (key, fixed_preset) in SOURCES.items():
        data = json.loads((RESULTS / name).read_text())
        for r in data[key]:
            preset = fixed_preset or r["preset"]
            problem = load_preset(preset).problem(quant=r["quant"], max_tokens=max(r["tokens"], 1))
            entries.append(ProfileEntry.measurement(r["experts"], platform, problem, r["tokens"], r["us"],
                                                    preset=preset, note=f"benchmarks/results/{name}"))
    out = PROFILE_DIR / "measured-h200.yaml"
    if out.exists():
        out.unlink()
    save_profile(out, entries, merge=False,
                 description="measured on nvidia-h200 (2026-11-22) by python -m moe bench / benchmarks/flashinfer_bench.py")
    print(f"{out}: {len(entries)} measurements")


if __name__ == "__main__":
    main()
