"""``plan()``: every candidate checked, every reason kept, survivors ranked per token bucket.

    plan(problem, platform, policy)
      1. candidates   the registry's Experts and PrepareFinalize classes (decorator + entry points)
      2. checks       each class's ``check`` on the problem and platform, plus the policy's force/deny
      3. pairs        every surviving (prepare/finalize, experts) pair that composes (compose.composition_problems)
      4. ranking      per token bucket, by estimated time (moe.oracle.cost), then policy.prefer
      5. workspace    the max over the plan's kernels, each sized for the largest bucket it serves

A pure function of its inputs, which reads the classes' declarations only: it builds no instance and
touches no device (``moe.build.build`` turns a plan into kernels). It never catches an exception to
filter a candidate (only a plugin's check that raises becomes its reason: registry.checked_reasons), and
a Plan holds every candidate exactly once -- chosen, viable, or rejected with all its reasons.
"""

from __future__ import annotations

import bisect
import dataclasses
from dataclasses import dataclass, field
from typing import Mapping

from moe.compose import activation_quant, composition_problems
from moe.errors import MoEConfigError, UnsupportedError
from moe.oracle.cost import Estimate, SharedEstimate, estimate_experts, estimate_shared, estimate_transport
from moe.oracle.explain import as_json, render, render_table
from moe.oracle.policy import Policy
from moe.oracle.profile import Profile, load_profiles
from moe.platform import Platform
from moe.problem import MoEProblem
from moe.quant import QuantFormat
from moe.registry import checked_reasons, experts_classes, prepare_finalize_classes

EXPERTS, PREPARE_FINALIZE = "experts", "prepare_finalize"


@dataclass(frozen=True, order=True)
class Pair:
    prepare_finalize: str
    experts: str

    def __str__(self) -> str:
        return f"{self.prepare_finalize} + {self.experts}"


@dataclass(frozen=True)
class Scored:
    """One pair's estimate for one bucket: experts time + prepare/finalize time."""

    pair: Pair
    experts: Estimate
    transport: Estimate

    @property
    def us(self) -> float:
        return self.experts.us + self.transport.us


@dataclass(frozen=True)
class Bucket:
    """Token counts ``low..high`` (inclusive), estimated at ``high``; ``ranking`` best first."""

    low: int
    high: int
    ranking: tuple[Scored, ...]
    preferred: bool = False  # the first was moved up by policy.prefer (it is within prefer_margin of the fastest)
    shared: SharedEstimate | None = None  # the layer's shared experts beside every pair (the same for all)

    @property
    def chosen(self) -> Scored:
        return self.ranking[0]

    @property
    def layer_us(self) -> float:
        """The chosen pair's time, with the shared experts (overlapped on a GPU) where the layer has them;
        the ranking is by the routed part alone, which the shared experts do not change."""
        return self.chosen.us if self.shared is None else self.shared.layer_us(self.chosen.us)

    @property
    def runner_up(self) -> Scored | None:
        return self.ranking[1] if len(self.ranking) > 1 else None


@dataclass(frozen=True)
class Candidate:
    """A registered class and every reason it cannot serve (empty: viable)."""

    name: str
    kind: str  # "experts" or "prepare_finalize"
    reasons: tuple[str, ...] = ()


@dataclass(frozen=True)
class Plan:
    """What the oracle decided, and why. ``explain()`` renders it; ``to_json()`` is the CLI's object."""

    problem: MoEProblem
    platform: Platform
    policy: Policy
    buckets: tuple[Bucket, ...]  # in token order; empty when nothing can serve
    candidates: tuple[Candidate, ...]  # every registered class, once
    workspace_bytes: int  # max over the plan's kernels
    shared: MoEProblem | None = None  # the shared experts' dense MLP as a one-expert problem, if any
    classes: Mapping[str, Mapping[str, type]] = field(default_factory=dict, compare=False, repr=False)

    @property
    def rejected(self) -> dict[str, tuple[str, ...]]:
        return {c.name: c.reasons for c in self.candidates if c.reasons}

    def pairs(self) -> tuple[Pair, ...]:
        """The distinct pairs the plan uses, in order of their first bucket."""
        return tuple(dict.fromkeys(b.chosen.pair for b in self.buckets))

    def bucket_for(self, num_tokens: int) -> Bucket:
        """The bucket serving M=``num_tokens`` (M=0 goes to the first)."""
        if not self.buckets:
            raise UnsupportedError("this plan has no backend to run", [])
        highs = [b.high for b in self.buckets]
        index = bisect.bisect_left(highs, num_tokens)
        if index == len(highs):
            raise UnsupportedError(f"M={num_tokens} exceeds the plan's max_tokens={highs[-1]}", [])
        return self.buckets[index]

    def max_tokens_of(self, pair: Pair) -> int:
        return max(b.high for b in self.buckets if b.chosen.pair == pair)

    def member_problem(self, pair: Pair) -> MoEProblem:
        """The problem a member kernel is built for: max_tokens = the largest bucket it serves."""
        return dataclasses.replace(self.problem, max_tokens=self.max_tokens_of(pair))

    def replanned(self, problem: MoEProblem | None = None, platform: Platform | None = None) -> "Plan":
        """The plan of another problem or platform with this plan's policy and candidates (empty
        allowed): what `moe.oracle.slow_path` asks when it looks for a way out of a slow path."""
        return plan(problem or self.problem, platform or self.platform, self.policy, experts=self.classes.get(EXPERTS),
                    prepare_finalize=self.classes.get(PREPARE_FINALIZE), allow_empty=True, shared=self.shared)

    def explain(self) -> str:
        return render(self)

    def table(self) -> str:
        return render_table(self)

    def to_json(self) -> dict:
        return as_json(self)


# --- plan ------------------------------------------------------------------------------------------
def plan(problem: MoEProblem, platform: Platform | None = None, policy: Policy | None = None, *,
         experts: Mapping[str, type] | None = None, prepare_finalize: Mapping[str, type] | None = None,
         allow_empty: bool = False, shared: MoEProblem | None = None) -> Plan:
    """The best (prepare/finalize, experts) pair per token bucket for ``problem`` on ``platform``.

    ``shared``: the layer's shared experts as a one-expert problem (`moe.SharedExpertsConfig.problem`);
    each bucket then also estimates the layer with them (``Bucket.layer_us``, moe/oracle/cost.py).

    ``platform`` defaults to ``Platform.detect()``, ``policy`` to ``Policy.from_env()``; ``experts`` and
    ``prepare_finalize`` (name -> class) default to the registry. Raises UnsupportedError, with every
    reason, when a forced backend cannot serve, or when nothing can (unless ``allow_empty``).
    With redundant experts the plan is for ``problem.physical()``: the cost model, the capacity and the
    workspace count physical experts per rank.
    """
    # inputs: platform, policy, candidates, profiles
    _check_types(problem, platform, policy, shared)
    problem = problem.physical()  # redundant experts (EPLB): the kernels serve E + N physical experts
    platform = Platform.detect() if platform is None else platform
    policy = Policy.from_env() if policy is None else policy
    classes = {EXPERTS: dict(experts_classes() if experts is None else experts),
               PREPARE_FINALIZE: dict(prepare_finalize_classes() if prepare_finalize is None else prepare_finalize)}
    policy.check_names(set(classes[EXPERTS]), set(classes[PREPARE_FINALIZE]))
    profile = load_profiles(policy.profiles)
    # checks: every candidate's own reasons, then the policy's
    own = {kind: {n: tuple(checked_reasons(c, problem, platform)) for n, c in table.items()} for kind, table in classes.items()}
    _raise_if_forced_unusable(policy, own, platform)
    reasons = {kind: {n: _policy_reasons(n, table, policy) + r for n, r in own[kind].items()} for kind, table in own.items()}
    # pairs: survivors that compose; a survivor without a partner is rejected, saying why
    pairs, unpaired = _compose(problem, classes, reasons)
    _raise_if_forced_unpaired(policy, unpaired, platform)
    for kind, found in unpaired.items():
        reasons[kind].update(found)
    # ranking: per bucket, estimated time, then prefer
    edges = policy.bucket_edges(problem.max_tokens) if pairs else ()
    lows = (1,) + tuple(e + 1 for e in edges[:-1])
    buckets = tuple(_rank(lo, hi, pairs, problem, platform, policy, profile) for lo, hi in zip(lows, edges))
    if shared is not None:
        buckets = tuple(dataclasses.replace(b, shared=estimate_shared(shared, platform, b.high, profile))
                        for b in buckets)
    candidates = tuple(Candidate(n, kind, r) for kind in (EXPERTS, PREPARE_FINALIZE) for n, r in reasons[kind].items())
    result = Plan(problem, platform, policy, buckets, candidates, 0, shared, classes)
    # workspace: the max over the members, computed without allocating
    result = dataclasses.replace(result, workspace_bytes=_workspace_bytes(result))
    if not buckets and not allow_empty:
        raise UnsupportedError(f"no (prepare/finalize, experts) pair can serve this problem on {platform.name}",
                               [f"{c.kind} {c.name}: {'; '.join(c.reasons)}" for c in candidates])
    return result


def _check_types(problem: object, platform: object, policy: object, shared: object) -> None:
    for name, value, wanted, example in (
        ("shared", shared, (MoEProblem, type(None)), "SharedExpertsConfig(I).problem(problem) or None"),
        ("problem", problem, MoEProblem, "MoEProblem.create(...)"),
        ("platform", platform, (Platform, type(None)), "Platform.detect() or Platform.preset('h100')"),
        ("policy", policy, (Policy, type(None)), "Policy(...) or Policy.from_file(path)"),
    ):
        if not isinstance(value, wanted):
            raise MoEConfigError(f"plan: {name} must be a {example} (got {type(value).__name__} {value!r})")


def _policy_reasons(name: str, kind_table: Mapping[str, tuple], policy: Policy) -> tuple[str, ...]:
    if name in policy.deny:
        return (f"denied by policy ({policy.source})",)
    forced = [n for n in policy.force if n in kind_table]
    if forced and name not in forced:
        return (f"policy ({policy.source}) forces {forced[0]}",)
    return ()


def _raise_if_forced_unusable(policy: Policy, own: dict, platform: Platform) -> None:
    for kind, table in own.items():
        for name in policy.force:
            if table.get(name):
                raise UnsupportedError(
                    f"policy ({policy.source}) forces {kind} {name!r}, which cannot serve this problem on "
                    f"{platform.name}", table[name])


def _raise_if_forced_unpaired(policy: Policy, unpaired: dict, platform: Platform) -> None:
    for kind, table in unpaired.items():
        for name in policy.force:
            if name in table:
                raise UnsupportedError(
                    f"policy ({policy.source}) forces {kind} {name!r}, which has no partner on {platform.name}",
                    table[name])


def _compose(problem: MoEProblem, classes: dict, reasons: dict) -> tuple[dict[Pair, tuple], dict]:
    """{pair: (prepare/finalize class, experts class)} for survivors that compose, and
    {kind: {name: reasons}} for survivors left without a partner."""
    alive = {kind: [n for n, r in reasons[kind].items() if not r] for kind in reasons}
    experts = {n: classes[EXPERTS][n] for n in alive[EXPERTS]}
    pfs = {n: classes[PREPARE_FINALIZE][n] for n in alive[PREPARE_FINALIZE]}
    # each class was checked on the platform already: the pairs are checked for their declarations only
    problems = {Pair(f, e): composition_problems(pfs[f], experts[e], problem, None) for e in experts for f in pfs}
    pairs = {pair: (pfs[pair.prepare_finalize], experts[pair.experts]) for pair, found in problems.items() if not found}
    unpaired: dict[str, dict[str, tuple[str, ...]]] = {EXPERTS: {}, PREPARE_FINALIZE: {}}
    for kind, names, other in ((EXPERTS, experts, "prepare/finalize"), (PREPARE_FINALIZE, pfs, "experts")):
        for name in names:
            mine = {p: f for p, f in problems.items() if name == (p.experts if kind == EXPERTS else p.prepare_finalize)}
            if any(not f for f in mine.values()):
                continue
            if not mine:
                unpaired[kind][name] = (f"no {other} can serve this problem (see their reasons)",)
            else:
                unpaired[kind][name] = tuple(f"does not compose: {'; '.join(f)}" for f in mine.values())
    return pairs, unpaired


def _rank(low: int, high: int, pairs: dict[Pair, tuple], problem: MoEProblem, platform: Platform, policy: Policy,
          profile: Profile) -> Bucket:
    scored = [_score(pair, *classes, problem, platform, high, profile) for pair, classes in pairs.items()]
    order = {pair: i for i, pair in enumerate(pairs)}  # registration order breaks ties
    ranking = sorted(scored, key=lambda s: (s.us, order[s.pair]))
    best = ranking[0].us
    for name in policy.prefer:
        pick = next((s for s in ranking if name in (s.pair.experts, s.pair.prepare_finalize)), None)
        if pick is not None and pick.us <= best * (1 + policy.prefer_margin):
            moved = pick is not ranking[0]
            return Bucket(low, high, (pick,) + tuple(s for s in ranking if s is not pick), preferred=moved)
    return Bucket(low, high, tuple(ranking))


def _score(pair: Pair, pf_cls: type, experts_cls: type, problem: MoEProblem, platform: Platform, tokens: int,
           profile: Profile) -> Scored:
    quantizes = activation_quant(experts_cls, problem) is not QuantFormat.NONE  # prepare quantizes the activations
    computes = experts_cls.capabilities.modes[problem.quant].activation_format(problem.quant, platform)  # weight-only?
    return Scored(
        pair,
        estimate_experts(pair.experts, problem, platform, tokens, profile, experts_classes(), computes),
        estimate_transport(pair.prepare_finalize, pf_cls.transport.format, quantizes, problem, platform, tokens,
                           profile),
    )


def _workspace_bytes(result: Plan) -> int:
    return max((_member_workspace_bytes(result, pair) for pair in result.pairs()), default=0)


def _member_workspace_bytes(result: Plan, pair: Pair) -> int:
    """Bytes of one member kernel's workspace, from the classes' declared workspaces (nothing built).

    The prepare/finalize declares what it dispatches for the member's max_tokens and its own scratch
    (under expert parallelism: every rank's max_tokens arriving here, its own buffers not counted); the
    experts declare theirs for that dispatch.
    """
    sub = result.member_problem(pair)
    pf_cls, experts_cls = result.classes[PREPARE_FINALIZE][pair.prepare_finalize], result.classes[EXPERTS][pair.experts]
    dispatch, own = pf_cls.declared_workspace(sub)
    return own.nbytes + experts_cls.declared_workspace(sub, dispatch).nbytes
