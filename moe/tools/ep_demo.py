"""``python -m moe demo --ep N``: one MoE layer run sharded over N processes and unsharded, compared.

Also the tools that demo and the multi-process tests share:

- `launch_ranks(fn, N)` runs ``fn(rank, N, *args)`` in N spawned processes joined in one process
  group (gloo on CPU, NCCL on GPUs), rendezvous through a file (no port to pick, so none can clash),
  with a hard deadline: a rank that hangs is killed and reported, never waited on forever.
- `compare_on_rank` runs one layer sharded on this rank and unsharded (every rank's tokens in one
  batch, in rank order -- so each expert sees the same rows in the same order as under expert
  parallelism, and the reference experts must agree bit for bit) and returns both results.
"""

from __future__ import annotations

import dataclasses
import datetime
import queue as queue_module
import tempfile
import time
import traceback
from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from moe.errors import MoEConfigError, UnsupportedError
from moe.kernel import ModularKernel
from moe.platform import Platform
from moe.prepare_finalize import all_to_all  # noqa: F401 -- registers all_to_all, all_to_all_batched
from moe.problem import MoEProblem, ParallelConfig
from moe.quant import QuantFormat
from moe.router import Router, TopK
from moe.sharding import local_expert_ids, shard_weights
from moe.synthetic import random_dense
from moe.tolerance import relative_error, tolerance_for
from moe.weights import ExpertWeights


# --- launcher --------------------------------------------------------------------------------------
def launch_ranks(fn: Callable[..., Any], num_ranks: int, args: Sequence[Any] = (), *, backend: str = "gloo",
                 timeout_s: float = 120.0) -> list[Any]:
    """``[fn(0, N, *args), ..., fn(N-1, N, *args)]``, each run in its own process of one group.

    ``fn`` must be importable by name (a module-level function) and return something picklable.
    Raises RuntimeError with the traceback of every rank that failed, TimeoutError (after killing
    every rank) when they are not all done within ``timeout_s``.
    """
    context = mp.get_context("spawn")
    with tempfile.TemporaryDirectory(prefix="moe-ep-") as folder:
        results = context.Queue()
        procs = [context.Process(target=_rank_main, daemon=True,
                                 args=(rank, num_ranks, f"file://{folder}/store", backend, timeout_s, fn,
                                       tuple(args), results))
                 for rank in range(num_ranks)]
        for proc in procs:
            proc.start()
        try:
            reports = _collect(results, procs, timeout_s)
        finally:
            for proc in procs:  # only the processes started here
                if proc.is_alive():
                    proc.kill()
                proc.join(timeout=10)
    failed = {rank: text for rank, (ok, text) in reports.items() if not ok}
    if failed:
        raise RuntimeError("ranks failed:\n" + "\n".join(f"--- rank {r} ---\n{t}" for r, t in sorted(failed.items())))
    return [reports[rank][1] for rank in range(num_ranks)]


def _rank_main(rank, world, init_method, backend, timeout_s, fn, args, results) -> None:
    try:
        torch.set_num_threads(1)  # N ranks share the machine's cores
        device = {}
        if backend == "nccl":
            torch.cuda.set_device(rank)
            device = {"device_id": torch.device("cuda", rank)}
        dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=world,
                                timeout=datetime.timedelta(seconds=timeout_s), **device)
        results.put((rank, True, fn(rank, world, *args)))
    except BaseException:  # noqa: BLE001 -- the parent reports it
        results.put((rank, False, traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _collect(results, procs, timeout_s: float) -> dict[int, tuple[bool, Any]]:
    deadline, reports = time.monotonic() + timeout_s, {}
    while len(reports) < len(procs):
        if time.monotonic() > deadline:
            missing = sorted(set(range(len(procs))) - set(reports))
            raise TimeoutError(f"ranks {missing} did not finish within {timeout_s:.0f} s (killed); "
                               f"reports from the others: {reports}")
        try:
            rank, ok, payload = results.get(timeout=0.2)
            reports[rank] = (ok, payload)
            if not ok:  # the others may wait for it in a collective: give them a moment, then stop
                deadline = min(deadline, time.monotonic() + 10)
        except queue_module.Empty:
            dead = [r for r, p in enumerate(procs) if r not in reports and p.exitcode not in (None, 0)]
            for rank in dead:
                reports[rank] = (False, f"exited with code {procs[rank].exitcode} before reporting")
    return reports


# --- one layer, sharded and not --------------------------------------------------------------------
def round_robin_maps(num_experts: int, ep_size: int) -> list[tuple[int, ...]]:
    """Expert e on rank e % ep_size: every rank's global->local map (a non-contiguous placement)."""
    return [tuple(e // ep_size if e % ep_size == rank else -1 for e in range(num_experts))
            for rank in range(ep_size)]


def random_layer(problem: MoEProblem, seed: int) -> ExpertWeights:
    """Full ``[E, ...]`` weights (all E experts, whatever ``problem.parallel`` says), the same on every
    rank for the same seed."""
    unsharded = dataclasses.replace(problem, parallel=ParallelConfig())
    dense = random_dense(unsharded, torch.Generator().manual_seed(seed))
    return ExpertWeights.from_dense(**dense, quant=problem.quant, dtype=problem.dtype)


def random_tokens(problem: MoEProblem, num_tokens: int, seed: int, router: Router | None = None,
                  favour: Sequence[int] = ()) -> tuple[torch.Tensor, TopK]:
    """``(hidden [M, H], TopK)``; ``favour`` lists experts every token picks first (skewed routing)."""
    gen = torch.Generator().manual_seed(seed)
    hidden = torch.randn(num_tokens, problem.hidden_size, generator=gen).to(problem.dtype)
    logits = torch.randn(num_tokens, problem.num_experts, generator=gen)
    logits[:, list(favour)] += 100.0
    router = router or Router("softmax", problem.num_experts, problem.top_k)
    return hidden, router(logits)


def compare_on_rank(rank: int, world: int, problem: MoEProblem, prepare_finalize: str, experts: str,
                    tokens: Sequence[int], *, seed: int = 0, skew_to_rank: int | None = None,
                    expert_maps: list[tuple[int, ...]] | None = None, truth_experts: str = "reference",
                    router: Router | None = None, device: str = "cpu", platform: Platform | None = None,
                    **pf_options: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """``(sharded, unsharded)`` outputs for this rank's ``tokens[rank]`` tokens.

    ``problem`` is the unsharded layer; the sharded one places experts contiguously, or by
    ``expert_maps[rank]``. The unsharded run uses ``truth_experts`` behind ``local`` (or ``batched``
    for batched-only experts) on every rank's tokens at once. ``platform`` is what the sharded kernel is
    composed for (default: the one detected for ``device``).
    """
    from moe.registry import get_experts, get_prepare_finalize

    weights = random_layer(problem, seed).to(device)
    parallel = ParallelConfig(world, rank, expert_maps[rank] if expert_maps else None)
    sharded = dataclasses.replace(problem, parallel=parallel, max_tokens=max(max(tokens), 1))
    favour = () if skew_to_rank is None else local_expert_ids(
        ParallelConfig(world, skew_to_rank, expert_maps[skew_to_rank] if expert_maps else None), problem.num_experts)
    inputs = [random_tokens(problem, m, seed + 1 + r, router, favour) for r, m in enumerate(tokens)]
    inputs = [(h.to(device), TopK(t.ids.to(device), t.weights.to(device))) for h, t in inputs]
    # unsharded: every rank's tokens in one batch
    truth = _unsharded(problem, truth_experts, weights, inputs, device)
    start = sum(tokens[:rank])
    # sharded: this rank's experts and tokens only
    kernel = ModularKernel(get_prepare_finalize(prepare_finalize)(sharded, **pf_options),
                           get_experts(experts)(sharded), device=device, platform=platform)
    kernel.load(shard_weights(weights, sharded))
    out = kernel.forward(*inputs[rank])
    return out, truth[start:start + tokens[rank]]


def _unsharded(problem: MoEProblem, experts: str, weights: ExpertWeights, inputs, device: str) -> torch.Tensor:
    from moe.formats import ActivationFormat
    from moe.registry import get_experts, get_prepare_finalize

    hidden = torch.cat([h for h, _ in inputs])
    topk = TopK(torch.cat([t.ids for _, t in inputs]), torch.cat([t.weights for _, t in inputs]))
    whole = dataclasses.replace(problem, max_tokens=max(hidden.shape[0], 1))
    experts_cls = get_experts(experts)
    standard = ActivationFormat.STANDARD in experts_cls.capabilities.formats
    kernel = ModularKernel(get_prepare_finalize("local" if standard else "batched")(whole), experts_cls(whole),
                           device=device)
    kernel.load(weights)
    return kernel.forward(hidden, topk)


# --- the demo --------------------------------------------------------------------------------------
DEMO_PAIRS = (("all_to_all", "reference"), ("all_to_all", "torch_grouped"), ("all_to_all_batched", "reference"))


def run_ep_demo(num_ranks: int, preset: str = "qwen3-30b-a3b", tokens: int = 37, quant: str | None = None,
                *, experts: str | None = None, timeout_s: float = 300.0) -> int:
    """Spawns ``num_ranks`` CPU processes (gloo); prints, per prepare/finalize x experts, the largest
    difference between the sharded and the unsharded layer, and the sharded layer's relative error
    against `moe.tools.demo.dequantize_then_compute` (a float32 loop no backend shares). Returns 0 when every
    pair is within its bounds (sharded = unsharded exactly for ``reference`` behind ``all_to_all``), 1
    otherwise.

    ``experts`` runs that backend behind each all-to-all whose format it takes, instead of
    `DEMO_PAIRS`; UnsupportedError when it cannot serve the layer on this CPU. Of `DEMO_PAIRS`, a pair
    that cannot serve ``quant`` is reported as skipped, with its reasons.
    """
    from moe.tools.demo import CPU_LIMITS
    from moe.presets import load_preset

    layer = load_preset(preset).scaled(**CPU_LIMITS)
    if isinstance(num_ranks, bool) or not isinstance(num_ranks, int) or num_ranks < 2 or layer.num_experts % num_ranks:
        divisors = [n for n in range(2, layer.num_experts + 1) if layer.num_experts % n == 0]
        raise MoEConfigError(f"--ep must be an int >= 2 dividing the (scaled) E={layer.num_experts} "
                             f"(got {num_ranks!r}); choose from {', '.join(map(str, divisors))}")
    if isinstance(tokens, bool) or not isinstance(tokens, int) or tokens < 1:
        raise MoEConfigError(f"--tokens must be an int >= 1 for the --ep demo (got {tokens!r})")
    problem = layer.problem(quant=quant or "bf16", max_tokens=max(tokens * num_ranks, 1))
    pairs, skipped = demo_pairs(dataclasses.replace(problem, parallel=ParallelConfig(num_ranks, 0)), experts)
    rows = launch_ranks(_demo_rank, num_ranks, (preset, tokens, quant, pairs), timeout_s=timeout_s)
    print(f"ep demo     {layer.name}: E={problem.num_experts} k={problem.top_k} H={problem.hidden_size} "
          f"I={problem.intermediate_size} {problem.activation.name} routing={layer.routing} quant={problem.quant_name}")
    print(f"ranks       {num_ranks} CPU processes (gloo), {problem.num_experts // num_ranks} experts and "
          f"M={tokens} tokens each; unsharded = one process, all {tokens * num_ranks} tokens")
    status = 0
    for index, pair in enumerate(pairs):
        line, ok = _verdict(pair, [r[index] for r in rows], problem)
        print(line)
        status |= not ok
    for (pf, name), reasons in skipped.items():
        print(f"{pf:<19} + {name:<14} skipped: cannot serve quant={problem.quant_name} ({'; '.join(reasons)})")
    return status


def demo_pairs(problem: MoEProblem, experts: str | None) -> tuple[list[tuple[str, str]], dict]:
    """``(pairs to run, {pair: reasons} skipped)`` for the sharded ``problem`` on this CPU.

    With ``experts``, it runs behind each all-to-all whose activation format it takes; UnsupportedError
    (with every reason) when it cannot serve the problem here. Without, `DEMO_PAIRS`, less those whose
    experts cannot serve the problem.
    """
    from moe.formats import ActivationFormat, OutputKind
    from moe.registry import get_experts

    platform = Platform.detect("cpu")
    if experts is not None:
        cls = get_experts(experts)
        reasons = cls.check(problem, platform)
        if reasons:
            raise UnsupportedError(f"--experts {experts} cannot serve the --ep demo's sharded layer on this CPU",
                                   reasons)
        formats = cls.capabilities.formats
        batched = ActivationFormat.BATCHED in formats and cls.capabilities.output is not OutputKind.REDUCED
        pairs = [("all_to_all", experts)] if ActivationFormat.STANDARD in formats else []
        return pairs + ([("all_to_all_batched", experts)] if batched else []), {}
    checked = {pair: get_experts(pair[1]).check(problem, platform) for pair in DEMO_PAIRS}
    return [pair for pair, reasons in checked.items() if not reasons], {
        pair: reasons for pair, reasons in checked.items() if reasons}


# Activation formats with one scale over the whole tensor (moe/quant/tensor.py's table): a rank
# quantizes the rows it holds, so sharded and unsharded layers round differently, and a float32
# loop over one rank's tokens cannot round as the ranks do.
_SCALED_PER_TENSOR = frozenset({QuantFormat.FP8_TENSOR, QuantFormat.NVFP4})


def _verdict(pair: tuple[str, str], per_rank: list[tuple[float, float, float]],
             problem: MoEProblem) -> tuple[str, bool]:
    """One pair's report line and whether it passed, from each rank's (max |sharded - unsharded|,
    relative sharded vs unsharded, relative sharded vs the float32 loop)."""
    pf, experts = pair
    tolerance = tolerance_for(problem)
    bound, regime = tolerance.bound, tolerance.regime
    max_abs, rel, loop = (max(r[i] for r in per_rank) for i in range(3))
    per_tensor = problem.quant.activation in _SCALED_PER_TENSOR
    exact = pf == "all_to_all" and experts == "reference" and not per_tensor
    sharding_ok = max_abs == 0 if exact else rel <= bound
    sharding = "must be exact" if exact else f"relative {rel:.1e} <= {bound:.0e} ({regime})"
    lines = [f"{pf:<19} + {experts:<14} sharded vs unsharded: max |difference| {max_abs:.3e} ({sharding}) -> "
             f"{'OK' if sharding_ok else 'FAIL'}"]
    if per_tensor:
        lines.append(f"{'':<37}vs float32 loop: no independent check ({problem.quant.activation.value} "
                     "activations are scaled per tensor, and each rank rounds the rows it holds)")
        return "\n".join(lines), sharding_ok
    loop_ok = loop <= bound
    lines.append(f"{'':<37}vs float32 loop: relative {loop:.1e} <= {bound:.0e} ({regime}) -> "
                 f"{'OK' if loop_ok else 'FAIL'}")
    return "\n".join(lines), sharding_ok and loop_ok


def _demo_rank(rank: int, world: int, preset: str, tokens: int, quant: str | None,
               pairs: list[tuple[str, str]]) -> list[tuple[float, float, float]]:
    from moe.tools.demo import CPU_LIMITS, dequantize_then_compute
    from moe.presets import load_preset

    layer = load_preset(preset).scaled(**CPU_LIMITS)
    problem = layer.problem(quant=quant or "bf16", max_tokens=max(tokens * world, 1))
    correction = 0.01 * torch.randn(layer.num_experts, generator=torch.Generator().manual_seed(7)) \
        if layer.has_correction_bias else None
    router = layer.router(correction)
    # the weights and this rank's tokens exactly as compare_on_rank draws them (seed 0; seed 1 + rank)
    hidden, topk = random_tokens(problem, tokens, 1 + rank, router)
    expected = dequantize_then_compute(problem, random_layer(problem, 0), hidden, topk)
    rows = []
    for pf, experts in pairs:
        out, truth = compare_on_rank(rank, world, problem, pf, experts, [tokens] * world, router=router,
                                     truth_experts=experts)
        rows.append(((out.float() - truth.float()).abs().max().item(), relative_error(out, truth),
                     relative_error(out, expected)))
    return rows
