"""What an evaluation simulates: the :class:`Grid` of cases (policy x KV size x replica count x router x CPU tier
size) over one base :class:`simulator.config.SimConfig`, checked when made, and the policy and router names it
resolves. :mod:`training.evaluate` runs a grid; :mod:`training.reports` tabulates and plots its rows."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from policy.catalog import LEARNED_ABLATIONS
from simulator.config import SimConfig

DEFAULT = "vllm-default"
#: The learned policy's prior (no trained network), evaluated beside ``learned`` whenever that is listed.
PRIOR = "learned-prior"
#: The router the issue's criterion compares against (``makespan_ratio_vs_round_robin_default``).
ROUND_ROBIN = "round-robin"
#: The simulator's decode stride for evaluations: 32, because a stride's error is as large at 16 and the
#: default grid (78 cases) needs 32 to finish in under 20 minutes on 2 cores (vLLM's own work alone is about
#: 19.5 min at 16). Makespan ratio to vllm-default at the same stride, default workload, KV 0.4, one replica
#: (exact k = 1 / k = 16 / k = 32): seer 1.025 / 1.003 / 1.031, heddle 1.030 / 1.035 / 1.012, sjf-predicted
#: 1.040 / 1.041 / 1.041; vllm-default's makespan 250.0 / 250.2 / 250.0 s, its hit rate 0.741 / 0.736 / 0.732.
#: At KV 0.1 (benchmarks/bench_stride.py, an older tree): oracle 1.031 / 1.029 / 1.032, sjf-predicted
#: 1.015 / 1.028 / 1.014. Over the whole default grid, k = 32 moves a ratio from its k = 16 value by 0.3 % or
#: less in 63 of 77 cells and by 1-2.8 % in 9 (seer, heddle, rolloutpipe, sjf-predicted: admission-ordering
#: policies, whose tail moves with the step at which a long decode is admitted), for 0.71x the CPU of k = 16.
DEFAULT_DECODE_STRIDE = 32
#: KV fractions per replica of a grid that gives neither fractions nor fleet totals.
DEFAULT_KV_FRACTIONS = (0.1, 0.2, 0.4)
#: Registered policies that ``--policies all`` leaves out, so that ``all`` is the baselines (the field's thirteen,
#: InferCept, the working set and vLLM native offload, and the CPU-tier variants of continuum, kvflow, infercept
#: and working-set):
#: those that need a trained model (``learned`` and its ablations, :data:`policy.learned.policy.ABLATIONS`:
#: ``model=POLICY_DIR``; ``registry``: the MLflow champion),
#: the exploring behaviour policy (``logging``), which is for collecting logs, not for comparison, and
#: ``lrb-online`` (learned eviction that trains as it runs; still runnable by name).
#: ``version-aware`` (asynchronous ``keep`` runs only: LRU on synchronous steps) is left out too.
NOT_IN_ALL = frozenset({"learned", *LEARNED_ABLATIONS, "registry", "logging", "lrb-online", "version-aware"})


class EvaluationError(ValueError):
    """A bad evaluation request (unknown policy, bad grid), raised before anything runs."""


@dataclass(frozen=True)
class Case:
    """One simulation of the grid: a router exactly when there are several replicas (one replica never asks)."""

    policy: str
    kv_fraction: float | None  # None: the preset GPU's own KV capacity
    replicas: int
    router: str | None = None
    #: The CPU offload tier's GiB per replica, when the grid sweeps it (``offload_gibs``; only for policies that
    #: use the tier); None: the run's one tier size (``sim_options["offload_gib"]``).
    tier_gib: float | None = None

    def __post_init__(self) -> None:
        if (self.router is None) != (self.replicas == 1):
            raise ValueError(f"a case has a router exactly when it has several replicas, got {self.replicas} "
                             f"replica(s) and router {self.router!r}")

    @property
    def name(self) -> str:
        kv = "gpu" if self.kv_fraction is None else f"{self.kv_fraction:g}"
        tier = f"-off{self.tier_gib:g}" if self.tier_gib is not None else ""
        return f"{self.policy}-kv{kv}{tier}-r{self.replicas}" + (f"-{self.router}" if self.router else "")

    def row(self) -> dict[str, Any]:
        """The grid keys a row of this case starts with, and ``error`` (``None``: it ran)."""
        return {"policy": self.policy, "kv_fraction": self.kv_fraction, "replicas": self.replicas,
                "router": self.router, "tier_gib": self.tier_gib, "error": None}


def evaluation_config(**options: Any) -> SimConfig:
    """The base run of an evaluation: :class:`SimConfig`'s ``options`` at the evaluation's decode stride
    (:data:`DEFAULT_DECODE_STRIDE` unless given); bad options raise :class:`simulator.config.SimulationError`."""
    return SimConfig(**{"decode_stride": DEFAULT_DECODE_STRIDE, "progress": False, **options})


@dataclass(frozen=True, eq=False)
class Grid:
    """Every case of an evaluation, checked when made: each policy x KV size x replica count x router (at several
    replicas) x CPU tier size (for the policies that use the tier), each a run of ``base`` with those set
    (:meth:`config`: ``dataclasses.replace``).

    ``policies`` and ``routers``: names or comma lists (``all`` expands; :func:`resolve_policies` adds
    vllm-default, for the ratios, and ``learned-prior`` beside ``learned``). ``kv_fractions``: KV per replica
    (None in it: the preset GPU's own capacity; the whole field None: :data:`DEFAULT_KV_FRACTIONS`), or
    ``kv_totals``: KV of the whole fleet, the same at every replica count (:func:`build_cases`). ``tier_gibs``:
    CPU offload tier sizes (GiB per replica) swept for the policies that use the tier; one size is ``base``'s.
    ``policy_options``: per-policy keyword options, by name (``learned`` needs ``model``). ``full_telemetry``:
    also write each run's ``decisions`` (every candidate's features at every decision: what training and OPE
    read) and ``kv_events`` (every block stored or removed); the comparison needs neither.
    """

    policies: str | Sequence[str]
    base: SimConfig = field(default_factory=evaluation_config)
    kv_fractions: Sequence[float | None] | None = None
    kv_totals: Sequence[float] | None = None
    replicas: Sequence[int] = (1,)
    routers: str | Sequence[str] = (ROUND_ROBIN,)
    tier_gibs: Sequence[float] | None = None
    policy_options: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)
    full_telemetry: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.base, SimConfig):
            raise EvaluationError(f"a grid's base must be a simulator.config.SimConfig, got {type(self.base).__name__}")
        fields = {"policies": tuple(resolve_policies(self.policies)), "routers": tuple(resolve_routers(self.routers)),
                  "replicas": tuple(self.replicas),
                  "kv_fractions": None if self.kv_fractions is None else tuple(self.kv_fractions),
                  "kv_totals": None if self.kv_totals is None else tuple(self.kv_totals),
                  "policy_options": {k: dict(v) for k, v in self.policy_options.items()}}
        if self.tier_gibs is not None:
            tiers = tier_sizes(self.tier_gibs)
            if len(tiers) == 1:  # one size: every run's (the base's)
                fields["base"] = dataclasses.replace(self.base, offload_gib=tiers[0])
            fields["tier_gibs"] = tuple(tiers) if len(tiers) > 1 else None
        for name, value in fields.items():  # frozen: the fields are normalised once, here
            object.__setattr__(self, name, value)
        self.cases()  # a bad grid fails now

    def cases(self, tier_users: Iterable[str] = ()) -> list[Case]:
        """The cases (:func:`build_cases`); the tier's sizes a dimension for ``tier_users`` only."""
        return build_cases(self.policies, self.kv_fractions, self.replicas, self.routers, kv_totals=self.kv_totals,
                           tier_gibs=self.tier_gibs, tier_users=tier_users)

    def config(self, case: Case, out_dir: Path | None = None) -> SimConfig:
        """The run of ``case``: ``base`` with the case's policy (its options added), KV, replicas, router (one
        replica never asks its router: round-robin stands in) and tier set."""
        options = {**(self.base.policy_options or {}), **self.policy_options.get(case.policy, {})}
        return dataclasses.replace(
            self.base, policy=case.policy, policy_options=options or None, kv_fraction=case.kv_fraction,
            kv_blocks=None, replicas=case.replicas, router=case.router or ROUND_ROBIN,
            offload_gib=case.tier_gib if case.tier_gib is not None else self.base.offload_gib, out_dir=out_dir,
            progress=False, decision_log=self.full_telemetry, kv_event_log=self.full_telemetry)

    def tier_users(self, workload: Any) -> list[str]:
        """The policies (by name) that run over the CPU offload tier (``Policy.uses_offload``), built once each."""
        out = []
        for p in self.policies:
            try:
                probe = SimConfig(p, policy_options=self.policy_options.get(p)).policy_factory(workload)()
            except Exception as e:  # noqa: BLE001 - a bad policy fails in its own case, with its error in the row
                del e
                continue
            if probe.uses_offload:
                out.append(p)
        return out


def resolve_policies(policies: str | Sequence[str]) -> list[str]:
    """Policy names from a comma list or a sequence (``all``: see :data:`NOT_IN_ALL`); vllm-default first.

    ``all`` expands in place, so names beside it are added to it (``all,learned`` runs the baselines and the
    learned policy); ``learned`` brings ``learned-prior`` before it. Unknown names raise :class:`EvaluationError`
    naming the known ones."""
    import serving_hook  # noqa: F401 - registers the policy "registry" (the hook serving the MLflow champion)
    from policy.baselines import BASELINES
    from policy.catalog import known_policies

    known = known_policies()
    # the built-in baselines only: a policy registered at run time (training's candidate, a user's) is run by name
    every = [p for p in known if p in BASELINES and p not in NOT_IN_ALL]
    names = _expand_names(policies, every, known, ("policy", "policies"))
    out = [DEFAULT]
    for p in names:
        if p == "learned" and PRIOR not in names and PRIOR not in out:
            out.append(PRIOR)  # the trained network's value is always shown beside the rules it starts from
        if p not in out:
            out.append(p)
    return out


def resolve_routers(routers: str | Sequence[str]) -> list[str]:
    """Router names from a comma list or a sequence, each once (``all``: every name in
    :data:`simulator.routers.ROUTERS`, in its order). Unknown names raise :class:`EvaluationError` naming the
    known ones."""
    from simulator.routers import ROUTERS

    return list(dict.fromkeys(_expand_names(routers, list(ROUTERS), list(ROUTERS), ("router", "routers"))))


def _expand_names(given: str | Sequence[str], every: Sequence[str], known: Sequence[str],
                  noun: tuple[str, str]) -> list[str]:
    """Names from a comma list or a sequence, ``all`` expanded in place to ``every``; none, or an unknown one,
    raises :class:`EvaluationError` naming the ``known`` ones (``noun``: singular and plural)."""
    if isinstance(given, str):
        given = given.split(",")
    names = [q for p in (x.strip() for x in given) if p for q in (every if p == "all" else [p])]
    if not names:
        raise EvaluationError(f"no {noun[1]} given")
    unknown = [p for p in names if p not in known]
    if unknown:
        raise EvaluationError(f"unknown {noun[0] if len(unknown) == 1 else noun[1]} {', '.join(map(repr, unknown))}; "
                              f"known {noun[1]}: {', '.join(known)}")
    return names


def build_cases(policies: Sequence[str], kv_fractions: Iterable[float | None] | None,
                replicas: Iterable[int], routers: Sequence[str] = (ROUND_ROBIN,), *,
                kv_totals: Iterable[float] | None = None, tier_gibs: Iterable[float] | None = None,
                tier_users: Iterable[str] = ()) -> list[Case]:
    """The grid; a KV fraction of ``None`` is the preset GPU's own capacity (listed last). Each router is a case
    only with several replicas; at one replica there is one case per policy and KV fraction. ``tier_gibs``: CPU
    offload tier sizes (GiB per replica), a dimension for the policies in ``tier_users`` only (the others run
    once; a tier they do not use changes nothing).

    ``kv_totals`` instead of ``kv_fractions``: KV fractions of the whole fleet, each split evenly over each replica
    count's replicas (0.2 at 4 replicas: 0.05 per replica; at 8: 0.025), so that every replica count has the same
    KV in all."""
    reps = sorted({int(r) for r in replicas})
    if not reps or any(r < 1 for r in reps):
        raise EvaluationError(f"replica counts must be >= 1, got {reps}")
    if not routers:
        raise EvaluationError("no routers given")
    if kv_totals is not None:
        if kv_fractions is not None:
            raise EvaluationError("give KV fractions per replica or KV totals for the fleet, not both")
        totals = sorted({float(t) for t in kv_totals})
        if not totals or any(not (t > 0 and math.isfinite(t)) for t in totals):
            raise EvaluationError(f"KV totals must be positive numbers, got {sorted(set(kv_totals), key=str)}")
        per_replica = {r: sorted({float(f"{t / r:.12g}") for t in totals}) for r in reps}
    else:
        given = set(kv_fractions if kv_fractions is not None else DEFAULT_KV_FRACTIONS)
        kvs: list[float | None] = sorted({float(k) for k in given if k is not None})
        if not given or any(not (k > 0 and math.isfinite(k)) for k in kvs):
            raise EvaluationError(f"KV fractions must be positive numbers, got {sorted(given, key=str)}")
        if None in given:
            kvs.append(None)
        per_replica = {r: kvs for r in reps}
    tiers: list[float | None] = [None] if tier_gibs is None else list(tier_sizes(tier_gibs))
    users = set(tier_users)
    return [Case(p, k, r, rt, g) for r in reps for k in per_replica[r] for rt in (routers if r > 1 else [None])
            for p in policies for g in (tiers if p in users else [None])]


def tier_sizes(tier_gibs: Iterable[float]) -> list[float]:
    """CPU offload tier sizes (GiB per replica), sorted, each once; none, or one below 0, raises
    :class:`EvaluationError`."""
    from simulator.config import SimulationError, check_offload_gib

    try:
        tiers = sorted({check_offload_gib(g) for g in tier_gibs})
    except SimulationError as e:
        raise EvaluationError(f"CPU tier sizes: {e}") from None
    if not tiers:
        raise EvaluationError("no CPU tier size (offload_gib) given")
    return tiers
