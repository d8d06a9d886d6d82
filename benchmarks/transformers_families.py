"""Which MoE families of the installed transformers `moe.integrations.transformers.use_moe` serves: every model whose
modeling file decorates its experts with ``@use_experts_implementation``, built tiny and random from its own config
class on the CPU, its logits in float32 through the ``"moe"`` implementation against transformers' ``"eager"`` one.

    python benchmarks/transformers_families.py                       # every family; a table on stdout
    python benchmarks/transformers_families.py --family qwen3_moe ergo --json out.json

The tiny config sets the size fields a config class takes (hidden 32, 4 experts, top-2, 2 layers, ...) and leaves the
rest at its defaults, so some families do not build or do not run eagerly at it (a validator, a vocabulary-sized
default, a hybrid cache): those read "not built" with the phase and error, and say nothing about moe. Families whose
defaults stay large (multimodal wrappers) are skipped above ``--max-params``. tests/test_transformers.py covers the
families moe names, with configs written for each; this finds what a new transformers release adds.

A family is "served" when every experts module runs on a FusedMoE and the logits match eager within 1e-4 (relative),
"fallback" when moe declined a module (with its reason), and "failed" when moe raised or the logits differ: the exit
status is 1 if any family failed, 2 on bad arguments. A match counts only where the experts move the logits: with
their outputs zeroed, eager's logits must change by 1e-2 or more, else the family reads "unchecked".
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import inspect
import json
import sys
import warnings
from pathlib import Path

import torch

TOLERANCE = 1e-4  # float32 logits, relative: what tests/test_transformers.py asks of the named families
INFLUENCE = 1e-2  # below this relative change of the logits with the experts' outputs zeroed, a match is "unchecked"
TINY = dict(vocab_size=64, hidden_size=32, intermediate_size=48, moe_intermediate_size=16, num_experts=4,
            n_routed_experts=4, num_local_experts=4, moe_num_experts=4, num_experts_per_tok=2, moe_k=2, moe_topk=2,
            num_experts_per_token=2, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=2, head_dim=16,
            max_position_embeddings=64, shared_expert_intermediate_size=16, moe_shared_expert_intermediate_size=16,
            n_shared_experts=1, num_shared_experts=1, first_k_dense_replace=0, first_dense_layers=0,
            num_dense_blocks=0, decoder_sparse_step=1, moe_layer_freq=1, expert_interval=1, mlp_only_layers=[],
            sliding_window=8, kv_lora_rank=8, q_lora_rank=8, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8,
            n_group=1, topk_group=1, pad_token_id=0, bos_token_id=1, eos_token_id=2)


@dataclasses.dataclass
class Result:
    family: str
    status: str  # served, fallback, failed, unchecked, not built, skipped
    detail: str = ""
    relative_error: float | None = None  # moe's logits against eager's
    modules: int = 0
    influence: float | None = None  # eager's logits with the experts' outputs zeroed, against eager's


def families() -> list[str]:
    """The installed transformers' model folders whose modeling file uses the experts interface."""
    import transformers

    root = Path(transformers.__file__).parent / "models"
    return sorted(d.name for d in root.iterdir()
                  if (d / f"modeling_{d.name}.py").is_file()
                  and "use_experts_implementation" in (d / f"modeling_{d.name}.py").read_text(errors="replace"))


# tried in turn where the one before does not build or run eagerly (MLA wants as many KV heads as heads; some do not)
VARIANTS = ({}, {"num_key_value_heads": 1})
# what a family's own validators or layer lists need at the tiny size, on top of `TINY`
FAMILY_FIELDS = {
    "zaya": dict(num_experts_per_tok=1),  # "supports num_experts_per_tok=1 only"
    "granitemoehybrid": dict(mamba_n_heads=4, mamba_d_head=16, mamba_n_groups=1, mamba_expand=2),
    "kolibri1_1": dict(index_num_heads=1, index_head_dim=8, index_topk=4),
    "lfm2_moe": dict(layer_types=["full_attention", "full_attention"], num_dense_layers=0),
}


def tiny_config(family: str, variant: dict | None = None):
    """The family's config class (the one whose model_type is the family's), with the fields of `TINY`, then of
    `FAMILY_FIELDS`, then of ``variant``, that it takes."""
    module = importlib.import_module(f"transformers.models.{family}.configuration_{family}")
    classes = [c for name, c in vars(module).items()
               if isinstance(c, type) and name.endswith("Config") and c.__module__ == module.__name__]
    cls = next((c for c in classes if getattr(c, "model_type", None) == family), classes[0])
    taken = inspect.signature(cls.__init__).parameters
    return cls(**{k: v for k, v in {**TINY, **FAMILY_FIELDS.get(family, {}), **(variant or {})}.items() if k in taken})


def _build(config):
    import transformers

    try:
        return transformers.AutoModelForCausalLM.from_config(config)
    except ValueError:  # not a causal LM (an encoder, a multimodal model): its base model
        return transformers.AutoModel.from_config(config)


def _describe(error: Exception) -> str:
    return f"{type(error).__name__}: {' '.join(str(error).split())[:200]}"


def _output(result) -> torch.Tensor:
    logits = getattr(result, "logits", None)
    return logits if logits is not None else result.last_hidden_state


def check(family: str, max_params: int = 20_000_000) -> Result:
    """One family through eager and through moe, at the first of `VARIANTS` that builds and runs eagerly;
    exceptions of the config or of eager are its "not built"."""
    for variant in VARIANTS:
        result = _check(family, max_params, variant)
        if result.status != "not built":
            return result
    return result


def _check(family: str, max_params: int, variant: dict) -> Result:
    import moe.integrations.transformers as moe_hf
    from moe.tolerance import relative_error

    phase = "config"
    try:
        config = tiny_config(family, variant)
        with torch.device("meta"):
            count = sum(p.numel() for p in _build(config).parameters())
        if count > max_params:
            return Result(family, "skipped", f"{count / 1e6:.0f}M parameters at the tiny config (> --max-params)")
        phase = "build"
        torch.manual_seed(0)
        model = _build(config).float().eval()
        experts = [m for _, m in model.named_modules() if moe_hf._is_experts(m)]
        if not experts:
            return Result(family, "not built", "no experts module at the tiny config")
        with torch.no_grad():  # random experts of a visible size (some initializers leave them near zero)
            for name, param in model.named_parameters():
                if "experts" in name:
                    param.normal_(0, 0.5)
        ids = torch.randint(0, 64, (2, 7), generator=torch.Generator().manual_seed(1))
        phase = "eager"
        model.set_experts_implementation("eager")
        with torch.no_grad():  # one forward, no cache: hybrid models' caches trip over some tiny layer patterns
            expected = _output(model(ids, use_cache=False))
            hooks = [m.register_forward_hook(lambda module, args, out: torch.zeros_like(out)) for m in experts]
            without = _output(model(ids, use_cache=False))  # the experts' outputs zeroed: do they move the logits?
            for hook in hooks:
                hook.remove()
    except Exception as error:  # noqa: BLE001 -- the tiny config, not moe: reported, not raised
        return Result(family, "not built", f"{phase}: {_describe(error)}")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", moe_hf.ExpertsFallbackWarning)
            report = moe_hf.use_moe(model)
            with torch.no_grad():
                got = _output(model(ids, use_cache=False))
    except Exception as error:  # noqa: BLE001 -- moe raised: the failure this looks for
        return Result(family, "failed", f"moe: {_describe(error)}", modules=len(experts))
    error = float(relative_error(got, expected))
    fallbacks = sorted({served for served in report.values() if served.startswith("fallback")})
    influence = float(relative_error(without, expected))
    if influence < INFLUENCE:  # a match would say nothing
        return Result(family, "unchecked", f"the experts move the logits by {influence:.1e} at the tiny config",
                      error, len(experts), influence)
    if error > TOLERANCE:
        return Result(family, "failed", f"logits differ from eager ({error:.1e} > {TOLERANCE:g})", error,
                      len(experts), influence)
    if fallbacks:
        return Result(family, "fallback", "; ".join(fallbacks), error, len(experts), influence)
    return Result(family, "served", "; ".join(sorted(set(report.values()))), error, len(experts), influence)


def table(results: list[Result], version: str) -> str:
    statuses = ("served", "fallback", "failed", "unchecked", "not built", "skipped")
    counts = {s: sum(r.status == s for r in results) for s in statuses}
    lines = [f"transformers {version}: " + ", ".join(f"{n} {s}" for s, n in counts.items()), "",
             "| family | status | moe vs eager | experts zeroed vs eager | detail |", "|---|---|---|---|---|"]
    for r in results:
        err, moved = ("" if v is None else f"{v:.1e}" for v in (r.relative_error, r.influence))
        lines.append(f"| {r.family} | {r.status} | {err} | {moved} | {r.detail.replace('|', '/')} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--family", nargs="+", metavar="NAME", help="these model folders only (default: every one)")
    parser.add_argument("--max-params", type=int, default=20_000_000, help="skip larger tiny models (default 20M)")
    parser.add_argument("--json", type=Path, help="also write the results here")
    args = parser.parse_args(argv)
    try:
        import transformers
    except ImportError:
        print("transformers is not installed: pip install 'moe[transformers]'", file=sys.stderr)
        return 2
    known = families()
    unknown = sorted(set(args.family or ()) - set(known))
    if unknown:
        print(f"--family: {unknown} are not MoE families of transformers {transformers.__version__} "
              f"(those are: {', '.join(known)})", file=sys.stderr)
        return 2
    if args.max_params < 1:
        print(f"--max-params must be >= 1 (got {args.max_params})", file=sys.stderr)
        return 2
    from moe.progress import progress

    chosen = args.family or known
    bar, results = progress(len(chosen), "families"), []
    for family in chosen:
        results.append(check(family, args.max_params))
        bar.step(f"{family}: {results[-1].status}")
    print(table(results, transformers.__version__))
    if args.json:
        args.json.write_text(json.dumps({"transformers": transformers.__version__, "torch": torch.__version__,
                                         "results": [dataclasses.asdict(r) for r in results]}, indent=1) + "\n")
    return 1 if any(r.status == "failed" for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
