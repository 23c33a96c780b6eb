"""Training the CPU tier's next-use model by replaying the logged workloads (imitation of hindsight, DAgger-style).

Where memory binds, what the CPU tier keeps decides most of the learned policy's gain, and the hindsight order
(``oracle-offload``) keeps far more than the session-state rule does. The rule's estimate of when an owner is
next used (:class:`policy.session_reuse.SessionStateNextUse`) is often far off: a queued long turn waits past
its place in the queue under shortest-first admission, a running turn's tool call starts only when its
generation ends. The logs hold the workloads they came from, so the policy's own tier decisions can be replayed
on vLLM's real scheduler and each one labelled with what happened next:

1. replay every logged workload under the bundle with the rule ordering the tier; record, at each tier decision,
   each owner's features (:func:`policy.session_reuse.tier_features`: the rule's estimate, the session's state,
   times in admissions) and, once the run ends, the time its session was next scheduled (the label);
2. fit the LightGBM model (:class:`predictors.tier_reuse.TierReuseModel`) on every snapshot so far;
3. replay again with the model ordering the tier (``reuse_predictor="session-trained"``): its makespans are the
   model's score on the logs, and its snapshots (the states the model leads to) join the next fit; repeat.

The model with the shortest mean makespan over the rule's is kept if it beats the rule by
:attr:`TierConfig.min_gain`; otherwise the bundle keeps the rule. Replays run on the logs' own engine, in
parallel on a process pool or as Ray tasks (the policy search's runner). Hyper-parameters: :class:`TierConfig`.

Every logged workload is replayed at each of :attr:`TierConfig.time_scales` (its tool latencies scaled). The
model's times are in admissions, which carries it across engine speeds only while a tool's pause is as many
admissions long as on the logs' engine; a bundle served on a faster engine (a smaller model: H200-7B decodes
about 4x faster than H200-32B) or with slower tools meets pauses several times longer. Replays with tools 3x
slower show the model that regime (measured in docs/results/2026-12-07-tier-model-across-engines.md).
"""

from __future__ import annotations

import bisect
import os
import shutil
import tempfile
from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from predictors.tier_reuse import DEFAULT_TREES, LEARNING_RATE, TierReuseModel

RULE, TRAINED = "session-state", "session-trained"
#: Fewer labelled owner snapshots than this in the rule's replays: nothing to fit (the tier hardly ever evicts).
MIN_SNAPSHOTS = 200


class TierTrainingError(ValueError):
    """Settings or logs the tier training cannot use, raised before anything runs."""


@dataclass(frozen=True)
class TierConfig:
    """The tier training's hyper-parameters."""

    rounds: int = 2  # fits; each is replayed on the logs, and its snapshots join the next fit (0: no tier model)
    num_trees: int = DEFAULT_TREES
    learning_rate: float = LEARNING_RATE
    min_gain: float = 0.005  # keep a model only if its mean makespan ratio to the rule is below 1 - min_gain
    #: each logged workload is replayed with its tool latencies scaled by each of these (module docstring)
    time_scales: tuple[float, ...] = (1.0, 3.0)
    jobs: int = 2
    backend: str = "process"  # or "ray"
    address: str | None = None  # Ray cluster address (backend "ray"); None: a local Ray

    def __post_init__(self) -> None:
        if not (self.rounds >= 0 and self.num_trees >= 1 and self.jobs >= 1 and self.min_gain >= 0
                and self.learning_rate > 0):
            raise TierTrainingError(f"tier training needs rounds >= 0, num_trees >= 1, jobs >= 1, min_gain >= 0 and "
                                    f"learning_rate > 0, got {self.rounds}, {self.num_trees}, {self.jobs}, "
                                    f"{self.min_gain}, {self.learning_rate}")
        if not self.time_scales or not all(isinstance(t, (int, float)) and 0 < t < float("inf")
                                               for t in self.time_scales):
            raise TierTrainingError(f"tier training needs one or more time scales, each > 0, got "
                                    f"{list(self.time_scales)}")
        if self.backend not in ("process", "ray"):
            raise TierTrainingError(f"tier training backend must be 'process' or 'ray', got {self.backend!r}")


@dataclass
class TierResult:
    kept: bool  # the bundle orders its tier by the model (else by the rule)
    ratio: float  # the kept order's mean makespan over the rule's on the logs (1.0: the rule)
    history: list[dict[str, Any]] = field(default_factory=list)  # one row per replay round

    def metrics(self) -> dict[str, float]:
        """MLflow metrics: the kept ratio, whether a model was kept, and each round's ratio."""
        return {"tier.makespan_ratio_vs_rule": self.ratio, "tier.model_kept": float(self.kept),
                **{f"tier.round{h['round']}.makespan_ratio_vs_rule": h["ratio"] for h in self.history}}


class TierRecorder:
    """Wraps the policy's tier predictor: answers as it does, and records each tier decision's owners (their
    features, who, when, at which admission rate) and every scheduling of a session, for the labels."""

    def __init__(self, served: Any) -> None:
        from policy.session_reuse import SessionStateNextUse

        self.served = served
        self._rule = SessionStateNextUse.next_use_s  # the rule's estimate, whatever ``served`` answers
        self._same = type(served) is SessionStateNextUse
        self.rows: list[np.ndarray] = []
        self.keys: list[tuple[str, float, float]] = []  # (owner key, time, admission rate) per recorded row
        self.scheduled: dict[str, list[float]] = defaultdict(list)

    def observe(self, event: Any) -> None:
        from policy.interface import EventKind

        self.served.observe(event)
        if event.kind is EventKind.SCHEDULED:
            self.scheduled[event.meta.session_id or event.request_id].append(event.time_s)

    def next_use_s(self, prefixes: Sequence[Any], now_s: float) -> list[float]:
        from policy.session_reuse import tier_features

        out = self.served.next_use_s(prefixes, now_s)
        rate = self.served.admission_rate(now_s)
        if rate:
            rule = out if self._same else self._rule(self.served, prefixes, now_s)
            X, idx = tier_features(self.served, prefixes, now_s, rule, rate)
            self.rows.append(X)
            self.keys += [(prefixes[i].meta.session_id or prefixes[i].owner_request_id, now_s, rate) for i in idx]
        return out

    def snapshots(self) -> tuple[np.ndarray, np.ndarray]:
        """(X, admissions until the owner's session was next scheduled); owners never scheduled again are left
        out (censored)."""
        from policy.session_reuse import TIER_FEATURES

        X = np.concatenate(self.rows) if self.rows else np.empty((0, TIER_FEATURES))
        y = np.full(len(self.keys), np.nan)
        for j, (key, now, rate) in enumerate(self.keys):
            times = self.scheduled.get(key, ())
            i = bisect.bisect_right(times, now)
            if i < len(times):
                y[j] = (times[i] - now) * rate
        seen = ~np.isnan(y)
        return X[seen], y[seen]


def _replay(policy_dir: str, runtime: dict[str, Any], workload: str, options: dict[str, Any]) -> dict[str, Any]:
    """One logged workload replayed under POLICY_DIR with ``runtime`` options, its tier decisions recorded (a
    worker's task): the makespan and the snapshots."""
    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    from policy.learned.policy import LearnedPolicy
    from simulator.simulation import run_simulation
    from simulator.workload import load_workload

    policy = LearnedPolicy.load(policy_dir, **runtime)
    recorder = TierRecorder(policy.reuse)
    policy.use_reuse(recorder)
    res = run_simulation(load_workload(workload), policy, progress=False, **options)
    X, y = recorder.snapshots()
    return {"makespan_s": float(res.summary.metrics.makespan_s), "X": X, "y": y}


def train_tier(policy_dir: Path, log_dirs: Sequence[Path], cfg: TierConfig | None = None,
               progress: Callable[[str], None] | None = None) -> TierResult:
    """Fit POLICY_DIR's tier model on replays of the logs' workloads and keep it where it wins (module docstring).

    Writes ``predictors/tier_reuse`` and the runtime option ``reuse_predictor`` into the bundle when a model is
    kept; leaves the bundle as it was otherwise."""
    from policy.learned.bundle import TIER_REUSE_DIR, read_manifest, update_runtime
    from training.policy_search import SearchError, parallel_runner, replays

    cfg = cfg or TierConfig()
    if not cfg.rounds:
        return TierResult(False, 1.0)
    policy_dir = Path(policy_dir).resolve()
    try:
        plays = replays(log_dirs)
    except SearchError as err:
        raise TierTrainingError(str(err)) from None
    manifest = read_manifest(policy_dir)
    runtime = manifest.get("config", {}).get("runtime", {})
    if not (runtime.get("offload") and runtime.get("host_eviction", True)):
        raise TierTrainingError(f"{policy_dir}: the bundle has no CPU tier ordered by its policy (runtime offload "
                                "and host_eviction): nothing to train")
    say = progress or (lambda _: None)
    run = parallel_runner(cfg, _replay)
    target = policy_dir / "predictors" / TIER_REUSE_DIR

    cases = [(p, t) for p in plays for t in cfg.time_scales]

    def replay(order: str) -> list[dict[str, Any]]:
        return run([(str(policy_dir), {"reuse_predictor": order}, str(p.workload), {**p.options, "time_scale": t})
                    for p, t in cases])

    got = replay(RULE)
    base = [g["makespan_s"] for g in got]
    Xs, ys = [g["X"] for g in got], [g["y"] for g in got]
    say(f"tier: the rule's order: {', '.join(f'{b:.1f} s' for b in base)} on {len(plays)} logged workload(s) at "
        f"time scale(s) {', '.join(f'{t:g}' for t in cfg.time_scales)}, {sum(len(y) for y in ys):,} owner snapshots")
    if sum(len(y) for y in ys) < MIN_SNAPSHOTS:
        raise TierTrainingError(f"the tier chose what to evict for only {sum(len(y) for y in ys)} owner(s) in the "
                                f"replays (fewer than {MIN_SNAPSHOTS}): the logs' tier holds their working set, so "
                                "there is no order to learn")
    history: list[dict[str, Any]] = []
    best_ratio, kept = 1.0, None
    with tempfile.TemporaryDirectory(prefix="kvpilot-tier-") as tmp:
        for r in range(1, cfg.rounds + 1):
            model = TierReuseModel.fit(np.concatenate(Xs), np.concatenate(ys), num_trees=cfg.num_trees,
                                       params={"learning_rate": cfg.learning_rate}, num_threads=cfg.jobs)
            if target.exists():
                shutil.rmtree(target)
            model.save(target)
            got = replay(TRAINED)
            ratio = float(np.mean([g["makespan_s"] / b for g, b in zip(got, base)]))
            history.append({"round": r, "ratio": ratio, "rows": int(sum(len(y) for y in ys)),
                            "makespans_s": [g["makespan_s"] for g in got]})
            say(f"tier: round {r}/{cfg.rounds}: the model fitted on {history[-1]['rows']:,} snapshots runs "
                f"{ratio:.4f}x the rule's makespan")
            if ratio < best_ratio:
                best_ratio, kept = ratio, Path(tmp) / f"round{r}"
                shutil.copytree(target, kept)
            Xs += [g["X"] for g in got]
            ys += [g["y"] for g in got]
        shutil.rmtree(target)
        keep = kept is not None and best_ratio < 1.0 - cfg.min_gain
        if keep:
            shutil.copytree(kept, target)
    was = runtime.get("reuse_predictor", RULE)
    update_runtime(policy_dir, {"reuse_predictor": TRAINED if keep else (RULE if was == TRAINED else was)})
    if not keep:
        say(f"tier: no model beat the rule by {cfg.min_gain:.1%} on the logs: the rule orders the tier")
        return TierResult(False, 1.0, history)
    return TierResult(True, best_ratio, history)
