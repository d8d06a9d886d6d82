"""Turns the bench results committed under benchmarks/results/ into the oracle's measured profiles
(moe/oracle/profiles/measured-<kind>.yaml), so plans on that platform rank backends by what was measured.

    python benchmarks/make_measured_profile.py                          # every machine below
    python benchmarks/make_measured_profile.py --machine nvidia-h100    # one

Every entry is one (backend, scheme, preset shape, M) time; the oracle turns it into an efficiency
against the roofline of that shape and interpolates between token counts. Files of
``benchmarks/ep_all_to_all.py`` (records with a ``prepare_finalize``) give the transports' prepare +
finalize times at their ``ep_size`` instead (`ep_all_to_all.transport_entries`).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from dataclasses import dataclass
from pathlib import Path

from moe.oracle.profile import PROFILE_DIR, ProfileEntry, save_profile
from moe.platform import Platform
from moe.presets import load_preset

RESULTS = Path(__file__).parent / "results"


@dataclass(frozen=True)
class Machine:
    """One machine's results: the platform preset they were measured on and the files, in order
    (later files replace earlier measurements of the same backend, scheme, shape and M)."""

    kind: str  # Platform preset name; the profile is measured-<kind>.yaml
    # file -> (list key, fixed preset or None to read each record's[, the schemes to read, where not all])
    sources: dict[str, tuple]
    description: str
    # (backend, scheme) -> why: this machine's records of kernels rewritten since it was last lent. They are
    # left out, so the oracle reads a sibling's newer measurements (an H100 the H200's), each turned into an
    # efficiency on its own platform's roofline and scaled by this one's ceilings (moe/oracle/profile.py)
    superseded: dict[tuple[str, str], str] = dataclasses.field(default_factory=dict)
    # the first source file measured after those rewrites (None: none yet): it and the files after it are read
    # whole, and the superseded pairs' records of the files before it stay out, where the new file times their
    # cell or not (a stale cell left beside fresh ones would bend the interpolation between them)
    remeasured_from: str | None = None

    def __post_init__(self):
        if self.remeasured_from is not None and self.remeasured_from not in self.sources:
            raise ValueError(f"remeasured_from={self.remeasured_from!r}: must name one of this machine's sources")

    @property
    def stale_sources(self) -> list[str]:
        """The source files whose `superseded` records stay out: those before `remeasured_from` (every one where
        no file has re-measured them yet)."""
        names = list(self.sources)
        return names[:names.index(self.remeasured_from)] if self.remeasured_from else names


MACHINES = {
    "nvidia-h200": Machine("h200", {
        "triton_profile_bf16_nvidia-h200.json": ("entries", None),
        "triton_profile_fp8_block_mxfp4_nvidia-h200.json": ("entries", None),
        "flashinfer_cutlass_gpt-oss-20b_h200.json": ("records", "gpt-oss-20b"),
        "triton_mxfp4_nvidia-h200.json": ("records", None),  # after the MXFP4 scale-load rework
        # session 2: TMA weight tiles, the new alignment, the sync-free torch_grouped, FlashInfer at every preset
        "fp8_block_nvidia-h200.json": ("records", None),
        "mxfp4_gpt-oss-120b_nvidia-h200.json": ("records", None),
        "bf16_qwen3_mixtral_nvidia-h200.json": ("records", None),
        "bf16_gpt-oss_deepseek_nvidia-h200.json": ("records", None),
        # session 11, nvidia-h200-x2: the transports at EP2 (prepare + finalize; CUDA-graph replay where they capture)
        "ep2_deepseek-v3_bf16_triton_flashinfer_cutlass_nvidia-h200-x2.json": ("records", None),
        "ep2_deepseek-v3_fp8_block_triton_nvidia-h200-x2.json": ("records", None),
        "ep2_qwen3-30b-a3b_bf16_triton_flashinfer_cutlass_nvidia-h200-x2.json": ("records", None),
        "ep2_deepseek-v3_bf16_triton_batched_nvidia-h200-x2.json": ("records", None),
        # session 12: the weight-only decode kernels' one-row FMA tiles (MXFP4 W4A16, NVFP4, MXFP8; M = 1, 4, 16)
        "fp4_gemv_bench_weight_only_nvidia-h200.json": ("records", None),
        # session 13: the e4m3-cvt e2m1 decode and the GEMMs' own split epilogue (finish tiles); FlashInfer beside
        "fp4_gemv_s13_bench_mxfp4_gpt-oss_flashinfer_nvidia-h200.json": ("records", None),
        "fp4_gemv_s13_bench_nvfp4_mxfp8_nvidia-h200.json": ("records", None),
        "fp4_gemv_s13_bench_qwen3_mxfp4_bf16_nvidia-h200.json": ("records", None),
        "fp4_gemv_s13_bench_gpt-oss_bf16_nvidia-h200.json": ("records", None),
        # the whole layer at decode (benchmarks/layer_decode.py): the experts stage of each cell's oracle choice
        "layer_decode_weight_only_nvidia-h200.json": ("cells", None),
        "fp4_gemv_s13_bench_qwen3_mxfp4_flashinfer_nvidia-h200.json": ("records", None),  # Qwen3 MXFP4, FlashInfer beside
        # session 14: the MMA-fragment decode tiles (MXFP4 / NVFP4 at M = 1-64), FlashInfer and bf16 in the same call
        "fp4_gemv_s14_bench_mxfp4_gpt-oss_flashinfer_nvidia-h200.json": ("records", None),
        "fp4_gemv_s14_bench_mxfp4_qwen3_flashinfer_nvidia-h200.json": ("records", None),
        "fp4_gemv_s14_bench_nvfp4_nvidia-h200.json": ("records", None),
        "fp4_gemv_s14_bench_bf16_nvidia-h200.json": ("records", None),
        # session 16: fp8_block with the warp-specialized fp8 tiles in the tables (Qwen3, DeepSeek slice, GPT-OSS),
        # the per-group quantization grid and the segments loaded once, the final code's run (fp8_block only;
        # fp8_block_ws_bench_* is the first run, with bf16 beside it)
        "fp8_block_ws_final_bench_nvidia-h200.json": ("records", None),
        # session 15: the warp-specialized bf16 GEMMs (ws tiles) in the tables, FlashInfer and torch_grouped beside;
        # Qwen3 MXFP4 decode at M = 1-4 after bucket 0.1's re-tune, bf16 beside
        "bf16_ws_mixtral_deepseek_nvidia-h200.json": ("records", None),
        "bf16_ws_qwen3_gpt-oss_nvidia-h200.json": ("records", None),
        "fp4_gemv_s15_bench_qwen3_mxfp4_bf16_nvidia-h200.json": ("records", None),
        # session 17: fp8_block with one-warpgroup ws tiles at two programs per SM in the tables (Qwen3 M = 1024,
        # GPT-OSS M = 4096), the final code's run (fp8_block only)
        "fp8_block_ws2_bench_nvidia-h200.json": ("records", None),
        # session 18: the decode path's one-token tile, its own epilogue and PDL (fp8_block and bf16, M = 1, 4, 16)
        "fp8_decode_s18_bench_nvidia-h200.json": ("records", None),
        # session 19: fp8_block with group_m 4 in the DeepSeek slice's ws tiles, M = 1-16384, the final code's run. Its
        # bf16 records (no FlashInfer beside them) are left to session 15's, which were timed beside FlashInfer
        "fp8_block_s19_bench_nvidia-h200.json": ("records", None, ("fp8_block",)),
        # session 19: the per-shape decode sections of the fp8_block tables (Qwen3, GPT-OSS), M = 1-16
        "fp8_decode_s19_tables_bench_nvidia-h200.json": ("records", None),
        # session 19: Qwen3's M = 4096 bucket on 64-row ws tiles with a ring of 3 (M = 1024-16384)
        "fp8_block_s19_qwen3_bench_nvidia-h200.json": ("records", None),
        # session 20: the fp8_block tables' decode sections re-timed (Qwen3, GPT-OSS, the DeepSeek slice), M = 1-32
        "fp8_decode_s20_tables_bench_nvidia-h200.json": ("records", None),
        # session 21: the decode sections re-timed over the bench's rotated routings (Qwen3, GPT-OSS, the DeepSeek
        # slice), M = 1-32
        "fp8_decode_s21_tables_bench_nvidia-h200.json": ("records", None),
        # session 23: the weight-only tables' one-token decode entries (Qwen3, GPT-OSS; MXFP4, NVFP4, bf16 beside)
        "fp4_gemv_s23_tables_bench_nvidia-h200.json": ("records", None),
        # session 24: programs per slot for a few tokens, the tables' M = 2-3 entries (Qwen3, GPT-OSS; MXFP4, NVFP4,
        # bf16 beside), M = 1-4
        "fp4_gemv_s24_tables_bench_nvidia-h200.json": ("records", None),
        # session 25: Qwen3's M = 4-13 entries (MXFP4, NVFP4, bf16 beside), M = 4-16. The second run's M = 14 took the
        # M = 9 entry, which ships only up to 13 (a tie at 14 in one process: fp4_gemv_decode_nvidia-h200.md)
        "fp4_gemv_s25_tables_bench_m4-8_nvidia-h200.json": ("records", None),
        "fp4_gemv_s25_tables_bench_m7-16_nvidia-h200.json": ("records", None),
        # session 28: the fp8_block tables' decode entries on TMA tiles (Qwen3, GPT-OSS, the DeepSeek slice), M = 1-32
        "fp8_decode_s28_tables_bench_nvidia-h200.json": ("records", None),
        # session 31: bf16 with the ws tiles storing by TMA (M = 1024-16384), FlashInfer's CUTLASS MoE beside them
        "issue14_s31_bf16_nvidia-h200.json": ("records", None),
        # session 32: fp8_block with the ws tiles storing by TMA (M = 1024-16384), then the 64-row buckets again
        # after they took it at two programs per SM; Qwen3 bf16 with GEMM1's gathering loader at M = 16384
        # (M = 4096 and 16384), FlashInfer's CUTLASS MoE beside it
        "fp8_block_s32_ws_tma_store_bench_nvidia-h200.json": ("records", None),
        "fp8_block_s32_64row_bench_nvidia-h200.json": ("records", None),
        "bf16_s32_qwen3_gather_bench_nvidia-h200.json": ("records", None),
        # session 33: the gather writing slot rows only, relaxed alignment atomics; bf16 at M = 256-16384 for the
        # four presets with FlashInfer's CUTLASS MoE beside them, fp8_block at M = 1024-16384
        "bf16_s33_qwen3_bench_nvidia-h200.json": ("records", None),
        "bf16_s33_mixtral_bench_nvidia-h200.json": ("records", None),
        "bf16_s33_gptoss_bench_nvidia-h200.json": ("records", None),
        "bf16_s33_deepseek_slice_bench_nvidia-h200.json": ("records", None),
        "fp8_block_s33_bench_nvidia-h200.json": ("records", None),
        # session 34: bf16 tables with the config sweep's winners (Qwen3 M = 1024, GPT-OSS 4096, the slice's 256, and
        # buckets of the old configs at the slice's 128 and GPT-OSS's 2048), the four presets at M = 1-16384 with
        # FlashInfer's CUTLASS MoE beside them
        "bf16_s34_qwen3_bench_nvidia-h200.json": ("records", None),
        "bf16_s34_mixtral_bench_nvidia-h200.json": ("records", None),
        "bf16_s34_gptoss_bench_nvidia-h200.json": ("records", None),
        "bf16_s34_deepseek_slice_bench_nvidia-h200.json": ("records", None),
        # session 35: tune --refine's confirmed configs (Mixtral and the slice bf16 at M = 256, Qwen3 fp8_block 4096):
        # Mixtral and the slice at M = 128-512 with FlashInfer's CUTLASS MoE beside them, Qwen3 fp8_block at 2048, 4096
        "bf16_s35_mixtral_bench_nvidia-h200.json": ("records", None),
        "bf16_s35_deepseek_slice_bench_nvidia-h200.json": ("records", None),
        "fp8_block_s35_qwen3_bench_nvidia-h200.json": ("records", None),
        # session 36: issue 14's scoreboard on one machine, its bf16 records only (the four presets at M = 1-16384
        # with FlashInfer's CUTLASS MoE beside ours). Its fp8_block and weight-only cells ran unchanged kernels and
        # tables and sit within the spread of the entries above (Qwen3 fp8_block M = 16: 119.1 us here, 112.0 in
        # session 28's bench, 115.9-121.1 in sessions 17-20's); taken, Qwen3's 119.1 would hand M = 5-16 to
        # flashinfer_cutlass on an estimate carried from the H100 (117.6 us), a fp8 path the lent machines' reduced
        # FlashInfer build cannot run
        "issue14_s36_bench_nvidia-h200.json": ("records", None, ("bf16",)),
    }, "measured on nvidia-h200 (2026-11-22 to 2026-12-04; EP2 on nvidia-h200-x2 2026-11-28) by python -m moe bench / "
       "benchmarks/flashinfer_bench.py / benchmarks/ep_all_to_all.py"),
    "nvidia-h100": Machine("h100", {
        "bf16_qwen3_mixtral_nvidia-h100.json": ("records", None),
        "bf16_gpt-oss_deepseek_nvidia-h100.json": ("records", None),
        "mxfp4_gpt-oss-120b_nvidia-h100.json": ("records", None),
        "fp8_block_nvidia-h100.json": ("records", None),
        "fp8_block_qwen3_tuned_nvidia-h100.json": ("records", None),  # after the H100 fp8_block table (Qwen3)
        "bf16_tma_a_tables_nvidia-h100.json": ("records", None),  # after the H100 bf16 tables (Mixtral, DeepSeek)
        # session 7: H100 tables for GPT-OSS bf16 / fp8_block and the DeepSeek slice's fp8_block
        "bf16_fp8_block_gpt-oss_deepseek_tuned_nvidia-h100.json": ("records", None),
        "fp8_decode_tuned_bench_nvidia-h100.json": ("records", None),  # after fp8 W8A8 moved to the decode kernels
        "bf16_all_presets_session7_nvidia-h100.json": ("records", None),  # bf16, all four presets, session 7's tables
        # session 8: triton fp8_block and bf16 after the grouped GEMM's row-mask fix (Qwen3, DeepSeek, GPT-OSS)
        "fp8_vs_bf16_qwen3-30b-a3b_mask_fix_nvidia-h100.json": ("records", None),
        "fp8_vs_bf16_deepseek-v3-ep8-slice_mask_fix_nvidia-h100.json": ("records", None),
        "fp8_vs_bf16_gpt-oss-120b_mask_fix_nvidia-h100.json": ("records", None),
        # session 9: fp8_block with the pipelined-wgmma tiles in the H100 tables at M >= 1024, bf16 beside it
        "fp8_block_wgmma_bench_nvidia-h100.json": ("records", None),
        # session 42 (2026-12-06), the first H100 since session 9: the H100 tables after taking the H200's configs
        # where those were faster (the A/B's time of the config each bucket now holds), then the weight-only decode
        # bench with FlashInfer beside (read back from its printed tables)
        "h100_tables_s42_nvidia-h100.json": ("records", None),
        "decode_s42_nvidia-h100.json": ("records", None),
        # session 43: what session 42 left untimed -- bf16 at M = 1-64 for Mixtral and the DeepSeek slice (FlashInfer
        # beside), fp8_block at M = 1-256 on the decode tiles, Qwen3 NVFP4 / MXFP4 decode
        "decode_s43_nvidia-h100.json": ("records", None),
        # then the weight-only decode cells of session 42 again, in three rounds, after the unpredicated one-token loads
        "weight_only_s43_nvidia-h100.json": ("records", None),
    }, "measured on nvidia-h100 (2026-11-25; triton re-measured 2026-12-06) by python -m moe bench --json and "
       "benchmarks/compare_configs.py",
        superseded={
            ("triton", "mxfp4"): "the weight-only decode kernels were rewritten in sessions 12-14 (one-row FMA tiles, "
                                 "then the MMA-fragment tiles)",
            ("triton", "bf16"): "the warp-specialized tiles (session 15 on) and the decode kernels changed since",
            ("triton", "fp8_block"): "the fp8 warp-specialized tiles (session 16) and fp8 decode tiles changed since",
        }, remeasured_from="h100_tables_s42_nvidia-h100.json"),
}


def measurements(machine: Machine) -> list[ProfileEntry]:
    """Every record of ``machine``'s result files as a profile measurement, in file order."""
    platform = Platform.preset(machine.kind)
    entries = []
    stale_sources = set(machine.stale_sources)
    for name, (key, fixed_preset, *schemes) in machine.sources.items():
        data = json.loads((RESULTS / name).read_text())
        if data[key] and "prepare_finalize" in data[key][0]:  # an expert-parallel file: the transports' times
            entries += _transport_entries(data[key], platform, f"benchmarks/results/{name}")
            continue
        for r in data[key]:
            if "experts_us" in r:  # a benchmarks/layer_decode.py cell: its experts stage, timed as moe bench does
                if r.get("error") or r["experts_us"] is None:
                    continue
                r = {**r, "quant": r["scheme"], "us": r["experts_us"]}
            stale = name in stale_sources and (r["experts"], r["quant"]) in machine.superseded
            if stale or (schemes and r["quant"] not in schemes[0]):
                continue
            preset = fixed_preset or r["preset"]
            problem = load_preset(preset).problem(quant=r["quant"], max_tokens=max(r["tokens"], 1))
            entries.append(ProfileEntry.measurement(r["experts"], platform, problem, r["tokens"], r["us"],
                                                    preset=preset, note=f"benchmarks/results/{name}"))
    return entries


def _transport_entries(rows: list[dict], platform: Platform, note: str) -> list[ProfileEntry]:
    sys.path.insert(0, str(Path(__file__).parent))
    from ep_all_to_all import transport_entries

    return transport_entries(rows, platform, note)


def write(machine: Machine) -> Path:
    """Writes ``moe/oracle/profiles/measured-<kind>.yaml`` from scratch; returns its path."""
    entries = measurements(machine)
    out = PROFILE_DIR / f"measured-{machine.kind}.yaml"
    if out.exists():
        out.unlink()
    kept = save_profile(out, entries, merge=False, description=machine.description).entries
    print(f"{out}: {len(kept)} measurements ({len(entries) - len(kept)} replaced by a later file's)")
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--machine", choices=sorted(MACHINES), action="append",
                        help="the machine whose results to turn into a profile (repeatable; default: all)")
    for name in parser.parse_args().machine or sorted(MACHINES):
        write(MACHINES[name])


if __name__ == "__main__":
    main()
