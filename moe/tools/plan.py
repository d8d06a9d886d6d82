"""``python -m moe plan``: what the oracle would run for a layer on a (possibly simulated) platform, and why.

    python -m moe plan --platform b200 --preset deepseek-v3 --quant nvfp4 --activation silu --explain
    python -m moe plan --platform h100 --preset deepseek-v3-ep8-slice --shared-intermediate 2048
    python -m moe plan --platform h100 --experts 128 --top-k 4 --hidden 2880 --intermediate 2880 \\
        --quant mxfp4 --activation swiglu_oai --tokens 1 64 4096 --json

Exit status 0 when some pair can serve, 1 when none can (the output then says why for each candidate),
2 when the flags are wrong (one line naming the flag; with --json, one JSON object ``{"error": ...}``).
"""

from __future__ import annotations

import argparse
import dataclasses
import json

from moe.activation import ACTIVATION_NAMES
from moe.tools.cli_args import int_at_least
from moe.errors import MoEConfigError
from moe.oracle.policy import Policy
from moe.oracle.select import Plan, plan
from moe.platform import PRESET_NAMES, Platform
from moe.presets import preset_names
from moe.problem import MoEProblem, ParallelConfig
from moe.quant import QuantScheme
from moe.quant.scheme import SCHEME_NAMES
from moe.shared import SharedExpertsConfig

QUANT_NAMES = SCHEME_NAMES  # the one list of scheme names (moe/quant/scheme.py), as the demo's
DEFAULT_MAX_TOKENS = 8192
_SHAPE_FLAGS = ("--experts", "--top-k", "--hidden", "--intermediate")


def add_plan_parser(subparsers) -> argparse.ArgumentParser:
    """Adds the ``plan`` subcommand to ``subparsers`` (of ``python -m moe``)."""
    p = subparsers.add_parser("plan", help="which backends the oracle picks per token bucket, and why",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--platform", default="detect", choices=("detect", *PRESET_NAMES), metavar="NAME",
                   help=f"'detect' (this machine) or one of {', '.join(PRESET_NAMES)}")
    p.add_argument("--no-flashinfer", action="store_true", help="simulate the platform without flashinfer")
    p.add_argument("--no-triton", action="store_true", help="simulate the platform without triton")
    shape = p.add_argument_group("layer shape: --preset, or all of --experts --top-k --hidden --intermediate")
    shape.add_argument("--preset", choices=preset_names(), metavar="NAME",
                       help=f"model preset, one of {', '.join(preset_names())}")
    count = int_at_least(1)
    shape.add_argument("--experts", type=count, help="E, the number of experts (a count, not a backend)")
    shape.add_argument("--top-k", type=count, help="k, experts per token")
    shape.add_argument("--hidden", type=count, help="H, hidden size")
    shape.add_argument("--intermediate", type=count, help="I, intermediate size of one expert")
    shape.add_argument("--bias", action="store_true", help="experts have biases (not with --preset: it says)")
    shape.add_argument("--shared-intermediate", type=int_at_least(0), metavar="N",
                       help="I of the shared experts' dense MLP beside the routed ones, same activation "
                            "(default: the preset's, e.g. 2048 for deepseek-v3; 0: none)")
    p.add_argument("--quant", choices=QUANT_NAMES, metavar="SCHEME",
                   help=f"one of {', '.join(QUANT_NAMES)} (default: the preset's checkpoint scheme, or bf16)")
    p.add_argument("--act-quant", choices=("mxfp8",), help="activation format for --quant mxfp4 (default bf16: W4A16)")
    p.add_argument("--activation", choices=ACTIVATION_NAMES, help="default: the preset's, or silu")
    p.add_argument("--ep", type=count, default=1, help="plan for rank 0 of N expert-parallel ranks")
    p.add_argument("--redundant", type=int_at_least(0), default=0, metavar="N",
                   help="N redundant experts (EPLB replicas) over the --ep ranks: the plan is for E + N physical experts")
    p.add_argument("--tokens", type=count, nargs="+", metavar="M", help="bucket edges (default 1 4 16 ... max tokens)")
    p.add_argument("--max-tokens", type=count,
                   help=f"largest M, >= every --tokens (default: the largest --tokens, or {DEFAULT_MAX_TOKENS})")
    p.add_argument("--policy", help="a policy YAML file (default: MOE_POLICY / MOE_EXPERTS / MOE_PROFILE)")
    p.add_argument("--force", help="force an experts or prepare/finalize backend by name")
    p.add_argument("--json", action="store_true", help="print exactly one JSON object")
    p.add_argument("--explain", action="store_true", help="add how each estimate was made and every candidate")
    p.set_defaults(func=run_plan)
    return p


def run_plan(args: argparse.Namespace) -> int:
    if args.json and args.explain:
        raise MoEConfigError("--explain does not go with --json: the JSON holds the plan and every rejected "
                             "candidate's reasons; drop one of them")
    problem = _problem(args)
    result = plan(problem, _platform(args), _policy(args), allow_empty=True, shared=_shared(args, problem))
    print(_render(result, args, problem))
    return 0 if result.buckets else 1


def _render(result: Plan, args: argparse.Namespace, problem: MoEProblem) -> str:
    eplb = _eplb_summary(problem)
    if args.json:
        return json.dumps(result.to_json() | ({"eplb": eplb} if eplb else {}))
    text = result.explain() if args.explain else result.table()
    if not eplb:
        return text
    return (f"eplb       E={eplb['logical_experts']} logical + {eplb['redundant_experts']} redundant = "
            f"{eplb['physical_experts']} physical experts, {eplb['physical_per_rank']} per rank on {args.ep} ranks; "
            "the plan, its capacity and workspace count physical experts\n" + text)


def _eplb_summary(problem: MoEProblem) -> dict | None:
    """The logical and physical expert counts of a problem with redundant experts; None without."""
    n = problem.parallel.num_redundant_experts
    if not n:
        return None
    return {"logical_experts": problem.num_experts, "redundant_experts": n,
            "physical_experts": problem.parallel.num_physical_experts(problem.num_experts),
            "physical_per_rank": problem.local_num_experts}


def _platform(args: argparse.Namespace) -> Platform:
    platform = Platform.detect() if args.platform == "detect" else Platform.preset(args.platform)
    remove = tuple(lib for lib, off in (("flashinfer", args.no_flashinfer), ("triton", args.no_triton)) if off)
    return platform.with_libraries(remove=remove) if remove else platform


def _policy(args: argparse.Namespace) -> Policy:
    policy = Policy.from_file(args.policy) if args.policy else Policy.from_env()
    if args.force:
        from moe.registry import experts_classes, prepare_finalize_classes

        experts = experts_classes()
        same_kind = experts if args.force in experts else prepare_finalize_classes()
        policy = policy.forcing(args.force, source="--force", replacing=same_kind)
    if args.tokens:
        policy = dataclasses.replace(policy, buckets=tuple(sorted(set(args.tokens))))
    return policy


def _problem(args: argparse.Namespace) -> MoEProblem:
    sizes = _sizes(args)
    quant_name = args.quant or sizes.pop("quant")
    if args.act_quant and quant_name != "mxfp4":
        raise MoEConfigError(f"--act-quant {args.act_quant} needs --quant mxfp4 (the scheme is {quant_name})")
    quant = QuantScheme.from_name(quant_name, act_quant=args.act_quant) if args.act_quant else quant_name
    largest = max(args.tokens) if args.tokens else None
    if args.max_tokens is not None and largest is not None and args.max_tokens < largest:
        raise MoEConfigError(f"--max-tokens {args.max_tokens} is smaller than the largest --tokens {largest}; "
                             "raise it or drop that bucket edge")
    if sizes["num_experts"] % args.ep and not args.redundant:
        raise MoEConfigError(f"--ep {args.ep} must divide the number of experts E={sizes['num_experts']} "
                             "(plan shards the experts evenly)")
    return MoEProblem.create(
        num_experts=sizes["num_experts"], top_k=sizes["top_k"], hidden_size=sizes["hidden_size"],
        intermediate_size=sizes["intermediate_size"], has_bias=sizes["has_bias"],
        activation=args.activation or sizes["activation"], quant=quant,
        max_tokens=args.max_tokens or largest or DEFAULT_MAX_TOKENS, parallel=ParallelConfig(ep_size=args.ep, num_redundant_experts=args.redundant),
    )


def _shared(args: argparse.Namespace, problem: MoEProblem) -> MoEProblem | None:
    """The shared experts' dense MLP as the oracle costs it: --shared-intermediate, else the preset's."""
    size = args.shared_intermediate
    if size is None:
        from moe.presets import load_preset

        size = load_preset(args.preset).shared_intermediate_size if args.preset else 0
    return SharedExpertsConfig(size).problem(problem) if size else None


def _sizes(args: argparse.Namespace) -> dict:
    """The layer's sizes from --preset, or from all four shape flags (never a mix of the two)."""
    explicit = {"num_experts": args.experts, "top_k": args.top_k, "hidden_size": args.hidden,
                "intermediate_size": args.intermediate}
    given = [flag for flag, value in zip(_SHAPE_FLAGS, explicit.values()) if value is not None]
    if args.preset:
        if given or args.bias:
            raise MoEConfigError(f"--preset and {', '.join(given + ['--bias'] * args.bias)} exclude each other "
                                 f"(the preset gives the layer's shape and biases)")
        from moe.presets import load_preset

        preset = load_preset(args.preset)
        return {"num_experts": preset.num_experts, "top_k": preset.top_k, "hidden_size": preset.hidden_size,
                "intermediate_size": preset.intermediate_size, "has_bias": preset.has_bias,
                "activation": preset.activation, "quant": preset.quant}
    missing = [flag for flag in _SHAPE_FLAGS if flag not in given]
    if missing:
        raise MoEConfigError(f"give --preset, or all of {' '.join(_SHAPE_FLAGS)} (missing {', '.join(missing)})")
    if args.top_k > args.experts:
        raise MoEConfigError(f"--top-k {args.top_k} is more than --experts {args.experts}: a token picks k "
                             "distinct experts")
    return {**explicit, "has_bias": args.bias, "activation": "silu", "quant": "bf16"}
