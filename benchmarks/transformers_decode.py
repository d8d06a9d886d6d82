"""Greedy decode of transformers MoE models with eager, grouped_mm and moe experts: tokens, step time, memory.

    PYTHONPATH=. python benchmarks/transformers_decode.py [--layers 4] [--tokens 32] [--families qwen3 gpt_oss]

Random weights at real layer shapes (Qwen3-30B-A3B and GPT-OSS-20B, typed in from their configs: no
download), a few layers, bf16 on CUDA. For each experts implementation, one greedy decode of ``--tokens``
tokens after a 16-token prompt (one warm-up decode first); reports whether the tokens equal eager's, the
median decode-step time (CUDA-synchronized, per token), the GPU memory allocated between decodes (weights,
moe's shared workspace) and the peak during the decode. moe runs last:
GPT-OSS's experts are released into the layers' converted copy there. Prints a markdown table;
``--json PATH`` also writes the rows. ``--device cpu --shrink 16`` is a smoke run with every size divided by 16.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
import warnings

import torch
import transformers

import moe.integrations.transformers as moe_hf

# from the models' config.json: Qwen/Qwen3-30B-A3B and openai/gpt-oss-20b
SHAPES = {
    "qwen3": ("Qwen3-30B-A3B", transformers.Qwen3MoeConfig, dict(
        vocab_size=151936, hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768, num_experts=128,
        num_experts_per_tok=8, norm_topk_prob=True, num_attention_heads=32, num_key_value_heads=4, head_dim=128,
        decoder_sparse_step=1, mlp_only_layers=[], max_position_embeddings=4096, tie_word_embeddings=False)),
    "gpt_oss": ("GPT-OSS-20B", transformers.GptOssConfig, dict(
        vocab_size=201088, hidden_size=2880, intermediate_size=2880, num_local_experts=32, num_experts_per_tok=4,
        num_attention_heads=64, num_key_value_heads=8, head_dim=64, sliding_window=128, swiglu_limit=7.0,
        max_position_embeddings=4096, tie_word_embeddings=False)),
}
SIZES = ("vocab_size", "hidden_size", "intermediate_size", "moe_intermediate_size", "num_attention_heads",
         "num_key_value_heads", "head_dim")  # what --shrink divides (E and k stay)


def build(family: str, layers: int, shrink: int, device: str, dtype: torch.dtype):
    name, config_class, sizes = SHAPES[family]
    sizes = {k: max(v // shrink, 2) if k in SIZES and shrink > 1 else v for k, v in sizes.items()}
    if family == "gpt_oss":
        sizes["layer_types"] = ["sliding_attention", "full_attention"] * (layers // 2) + ["sliding_attention"] * (layers % 2)
    config = config_class(**sizes, num_hidden_layers=layers)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=dtype).to(device).eval()
    return name, model


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


@torch.no_grad()
def decode(model, prompt: torch.Tensor, tokens: int, device: str) -> tuple[list[int], list[float], list]:
    """Greedy: the prompt once, then ``tokens`` single-token steps on the KV cache; (tokens, step seconds,
    each step's float32 logits on the CPU, taken after the timed region)."""
    out = model(prompt, use_cache=True)
    past, token = out.past_key_values, out.logits[:, -1:].argmax(-1)
    produced, times, logits = [token.item()], [], [out.logits[0, -1].float().cpu()]
    for _ in range(tokens - 1):
        sync(device)
        start = time.perf_counter()
        out = model(token, past_key_values=past, use_cache=True)
        token = out.logits[:, -1:].argmax(-1)
        sync(device)
        times.append(time.perf_counter() - start)
        past = out.past_key_values
        produced.append(token.item())
        logits.append(out.logits[0, -1].float().cpu())
    return produced, times, logits


def measure(model, implementation: str, prompt, tokens: int, device: str) -> dict:
    served = None
    if implementation == "moe":
        served = moe_hf.use_moe(model)
    else:
        model.set_experts_implementation(implementation)
    decode(model, prompt, 4, device)  # warm-up: JIT, autotune, allocator
    resident = 0
    if device.startswith("cuda"):
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        resident = torch.cuda.memory_allocated()  # weights (and moe's shared workspace), between decodes
    produced, times, logits = decode(model, prompt, tokens, device)
    peak = torch.cuda.max_memory_allocated() if device.startswith("cuda") else 0
    return dict(implementation=implementation, tokens=produced, step_ms=1e3 * statistics.median(times),
                resident_gib=resident / 2**30, peak_gib=peak / 2**30, served=served, logits=logits)


def flip(row: dict, eager: dict, step: int | None) -> str:
    """At the first step where greedy tokens differ (histories equal up to there): eager's gap between
    its best and second-best logit, and this run's largest logit difference from eager at that step. A
    gap below the difference means the flip is a near-tie within the implementation's rounding."""
    if step is None:
        return "-"
    top2 = eager["logits"][step].topk(2).values
    gap = (top2[0] - top2[1]).item()
    noise = (row["logits"][step] - eager["logits"][step]).abs().max().item()
    return f"{step} (eager gap {gap:.3f}, logit diff {noise:.3f})"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--families", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--shrink", type=int, default=1, help="divide every size by this (smoke runs)")
    parser.add_argument("--json", help="also write the rows here")
    args = parser.parse_args()
    warnings.filterwarnings("ignore", category=FutureWarning)  # past_key_values is renamed in newer transformers
    dtype = torch.bfloat16 if args.device.startswith("cuda") else torch.float32
    device_name = torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu"
    rows = []
    print(f"device: {device_name}, {args.layers} layers, {args.tokens} greedy tokens, {dtype}, torch "
          f"{torch.__version__}, transformers {transformers.__version__}\n")
    print("| model | experts | tokens == eager | first difference at | decode step (ms, median) | resident (GiB) "
          "| peak in decode (GiB) |")
    print("|---|---|---|---|---|---|---|")
    for family in args.families:
        name, model = build(family, args.layers, args.shrink, args.device, dtype)
        prompt = torch.randint(0, model.config.vocab_size, (1, 16), generator=torch.Generator().manual_seed(1))
        prompt = prompt.to(args.device)
        eager = None
        for implementation in ("eager", "grouped_mm", "moe"):  # moe last: it may release GPT-OSS's parameters
            row = measure(model, implementation, prompt, args.tokens, args.device)
            eager = eager or row
            diff = next((i for i, (a, b) in enumerate(zip(row["tokens"], eager["tokens"])) if a != b), None)
            row.update(model=name, device=device_name, equal=row["tokens"] == eager["tokens"],
                       first_difference=diff, at_difference=flip(row, eager, diff))
            rows.append(row)
            print(f"| {name} | {implementation} | {row['equal']} | {row['at_difference']} | "
                  f"{row['step_ms']:.2f} | {row['resident_gib']:.2f} | {row['peak_gib']:.2f} |")
        served = rows[-1]["served"]
        print(f"\n{name} moe layers: {sorted(set(served.values()))}\n")
        del model
        if args.device.startswith("cuda"):
            torch.cuda.empty_cache()
    if args.json:
        with open(args.json, "w") as file:
            json.dump([{k: v for k, v in row.items() if k != "logits"} for row in rows], file, indent=1)


if __name__ == "__main__":
    main()
