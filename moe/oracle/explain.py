"""Renders a Plan: the per-bucket table, how each estimate was made, and every candidate once."""

from __future__ import annotations

from typing import TYPE_CHECKING

from moe.oracle.cost import STREAM_FORK_JOIN_US, roofline
from moe.oracle.slow_path import slow_buckets, slow_path

if TYPE_CHECKING:
    from moe.oracle.select import Bucket, Plan, Scored


def _tokens(bucket: "Bucket") -> str:
    return str(bucket.low) if bucket.low == bucket.high else f"{bucket.low}-{bucket.high}"


def _scored(s: "Scored | None") -> str:
    return "-" if s is None else f"{str(s.pair):<36} {s.us:>10.1f}"


def _ranges(buckets: list["Bucket"]) -> list[str]:
    """Consecutive buckets joined: [1, 2-4, 5-16] -> ["1-16"]."""
    spans: list[list[int]] = []
    for b in buckets:
        if spans and spans[-1][1] + 1 == b.low:
            spans[-1][1] = b.high
        else:
            spans.append([b.low, b.high])
    return [str(lo) if lo == hi else f"{lo}-{hi}" for lo, hi in spans]


def _header(plan: "Plan") -> list[str]:
    p, pl = plan.problem, plan.platform
    ep = p.parallel
    where = "" if ep.ep_size == 1 else f" (rank {ep.ep_rank} of {ep.ep_size}, {p.local_num_experts} local experts)"
    sm = "" if pl.capability is None else f" SM{pl.capability[0]}{pl.capability[1]},"
    sm += f" {pl.sm_count} SMs," if pl.sm_count else ""
    sm += f" {pl.memory_bytes / 1e9:.0f} GB," if pl.memory_bytes else ""
    rates = " / ".join(f"{name} {rate / 1e12:g}" for name, rate in pl.peak)
    versions = dict(pl.versions)
    libs = []
    for lib in sorted(pl.libraries):
        text = f"{lib} {versions[lib]}" if lib in versions else lib
        count = len(pl.features_of(lib))
        libs.append(text + (f" ({count} MoE entry points)" if count else ""))
    return [
        f"problem    E={p.num_experts} k={p.top_k} H={p.hidden_size} I={p.intermediate_size} "
        f"activation={p.activation.name} quant={p.quant_name} dtype={str(p.dtype).removeprefix('torch.')} "
        f"bias={p.has_bias} max_tokens={p.max_tokens} ep={ep.ep_size}{where}",
        f"platform   {pl.name}: {pl.device}{sm} {pl.memory_bandwidth / 1e12:.2f} TB/s, "
        f"peak TFLOP/s {rates} ({pl.rates_source})",
        f"libraries  {', '.join(libs) or 'none'}",
        f"policy     {plan.policy.source}",
    ] + _shared_header(plan)


def _shared_header(plan: "Plan") -> list[str]:
    shared = plan.shared
    if shared is None:
        return []
    how = ("on a second CUDA stream beside the routed part: layer = max(routed, shared) "
           f"+ {STREAM_FORK_JOIN_US:g} us" if plan.platform.is_cuda else "before the routed part: layer = routed + shared")
    return [f"shared     a dense MLP H={shared.hidden_size} I={shared.intermediate_size} "
            f"activation={shared.activation.name}, {how}"]


def _shared_row(b: "Bucket") -> str:
    if b.shared is None:
        return ""
    return f"   shared {b.shared.alone.us:>8.1f} -> layer {b.layer_us:>8.1f}"


def render_table(plan: "Plan") -> str:
    """The chosen pair per bucket with its estimate and the runner-up, and the workspace."""
    lines = _header(plan) + [""]
    if not plan.buckets:
        lines.append("no (prepare/finalize, experts) pair can serve this problem; see the rejected candidates")
        return "\n".join(lines)
    lines.append(f"{'tokens':<12} {'chosen (prepare/finalize + experts)':<36} {'est. us':>10}   "
                 f"{'runner-up':<36} {'est. us':>10}")
    slow = slow_buckets(plan)
    for b in plan.buckets:
        mark = "  (preferred by policy)" if b.preferred else ""
        mark += "  SLOW PATH" if b in slow else ""
        lines.append(f"{_tokens(b):<12} {_scored(b.chosen)}   {_scored(b.runner_up)}{_shared_row(b)}{mark}")
    members = len(plan.pairs())
    share = ("; experts' share only: an all-to-all sizes its own buffers when built, with the process group"
             if plan.problem.parallel.ep_size > 1 else "")
    lines.append(f"workspace  {plan.workspace_bytes:,} bytes (the largest of {members} kernel"
                 f"{'s' if members > 1 else ''}, each sized for the largest bucket it serves{share})")
    found = slow_path(plan)
    if found is not None:
        lines += ["", found.message()]
    return "\n".join(lines)


def _basis(plan: "Plan", b: "Bucket") -> str:
    s = b.chosen
    mode = plan.classes["experts"][s.pair.experts].capabilities.modes[plan.problem.quant] if plan.classes else None
    computes = None if mode is None else mode.activation_format(plan.problem.quant, plan.platform)
    r = roofline(plan.problem, plan.platform, b.high, activation=computes)
    return (f"  {_tokens(b):<12} M={b.high}: roofline {r.us:.1f} us ({r.bound}-bound, {r.experts_hit:.1f} experts hit, "
            f"{r.precision}); {s.pair.experts}: efficiency {s.experts.efficiency:.2f} + {s.experts.overhead_us:g} us "
            f"[{s.experts.basis}]; {s.pair.prepare_finalize}: {s.transport.us:.1f} us [{s.transport.basis}]"
            + ("" if b.shared is None else f"; shared experts: {b.shared.alone.us:.1f} us, efficiency "
               f"{b.shared.alone.efficiency:.2f} + {b.shared.alone.overhead_us:g} us [{b.shared.alone.basis}]"))


def _status(plan: "Plan", kind: str, name: str) -> str:
    if kind == "experts":
        served = [b for b in plan.buckets if b.chosen.pair.experts == name]
    else:
        served = [b for b in plan.buckets if b.chosen.pair.prepare_finalize == name]
    if served:
        return "chosen for M in " + ", ".join(_ranges(served))
    field = "experts" if kind == "experts" else "prepare_finalize"
    best = min(((s.us, b) for b in plan.buckets for s in b.ranking if getattr(s.pair, field) == name),
               key=lambda t: t[0], default=None)
    if best is None:
        return "viable, not chosen"
    return f"viable, not chosen (its best: {best[0]:.1f} us at M={best[1].high})"


def render(plan: "Plan") -> str:
    """The table, how the chosen estimates were made, and every registered candidate exactly once."""
    lines = [render_table(plan)]
    if plan.buckets:
        lines += ["", "estimates: experts us = overhead + roofline / efficiency (moe/oracle/cost.py); "
                      "profile in brackets"]
        lines += [_basis(plan, b) for b in plan.buckets]
    lines += ["", "candidates (every registered backend, once):"]
    for c in plan.candidates:
        status = "rejected:" if c.reasons else _status(plan, c.kind, c.name)
        lines.append(f"  {c.kind:<17} {c.name:<28} {status}")
        lines += [f"      - {reason}" for reason in c.reasons]
    return "\n".join(lines)


def as_json(plan: "Plan") -> dict:
    """``{"plan": [{"tokens": [lo, hi], "experts", "prepare_finalize", "estimated_us", "shared_us" (the shared
    experts alone; null without them), "layer_us" (with them, Bucket.layer_us)}], "rejected",
    "workspace_bytes", "platform", "slow_path"}``; a bucket's ``slow_path`` is true where the reference
    experts serve it on a GPU, and the top-level ``slow_path`` then says why and what would serve."""
    slow, found = slow_buckets(plan), slow_path(plan)
    return {
        "plan": [
            {"tokens": [b.low, b.high], "experts": b.chosen.pair.experts,
             "prepare_finalize": b.chosen.pair.prepare_finalize, "estimated_us": round(b.chosen.us, 3),
             "slow_path": b in slow,
             "shared_us": None if b.shared is None else round(b.shared.alone.us, 3), "layer_us": round(b.layer_us, 3)}
            for b in plan.buckets
        ],
        "slow_path": None if found is None else found.message(),
        "rejected": {c.name: list(c.reasons) for c in plan.candidates if c.reasons},
        "workspace_bytes": plan.workspace_bytes,
        "platform": plan.platform.name,
    }
