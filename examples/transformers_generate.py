"""Greedy generation with a transformers MoE model whose experts run on `moe`, checked against eager.

    python examples/transformers_generate.py                      # a tiny random Qwen3-MoE, CPU, no download
    python examples/transformers_generate.py --model PATH --device cuda --tokens 32

Prints the tokens of both runs, whether they match, and what serves each MoE layer.
"""

from __future__ import annotations

import argparse

import torch
import transformers

import moe.integrations.transformers as moe_hf


def tiny_qwen3_moe() -> transformers.PreTrainedModel:
    config = transformers.Qwen3MoeConfig(
        vocab_size=128, hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_experts=8,
        num_experts_per_tok=2, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        max_position_embeddings=128, tie_word_embeddings=False)
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(config)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", help="a local transformers checkpoint (default: a tiny random Qwen3-MoE)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--tokens", type=int, default=16, help="new tokens to generate")
    args = parser.parse_args()
    if args.model:
        dtype = torch.bfloat16 if args.device.startswith("cuda") else torch.float32
        model = transformers.AutoModelForCausalLM.from_pretrained(args.model, dtype=dtype)
    else:
        model = tiny_qwen3_moe()
    model = model.to(args.device).eval()
    prompt = torch.randint(0, model.config.vocab_size, (1, 8), generator=torch.Generator().manual_seed(1))
    options = dict(max_new_tokens=args.tokens, min_new_tokens=args.tokens, do_sample=False, pad_token_id=0)

    model.set_experts_implementation("eager")
    eager = model.generate(prompt.to(args.device), **options)
    served = moe_hf.use_moe(model)  # every MoE layer's experts on a FusedMoE the oracle chose
    patched = model.generate(prompt.to(args.device), **options)

    for name, what in served.items():
        print(f"{name}: {what}")
    print("eager:", eager[0, prompt.shape[1]:].tolist())
    print("moe:  ", patched[0, prompt.shape[1]:].tolist())
    print("tokens match eager:", torch.equal(eager, patched))


if __name__ == "__main__":
    main()
