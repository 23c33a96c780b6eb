"""Fit the learned policy offline from logged decisions: imitation warm start, then doubly robust / IPS.

The logged decisions are read by :mod:`policy.learning.data`, the scorer fitted and the greedy policy's value
estimated by :mod:`policy.learning.fit`, with the hyper-parameters of :class:`policy.learning.config.OfflineConfig`.

**Held-out evaluation.** The last log directory (or, with one log, the last
``holdout_fraction`` of its decisions by time; with one log of a single RL step,
the decisions acting on the last ``holdout_fraction`` of its GRPO groups) is held
out (``trained_on.split`` in the manifest says which); :mod:`policy.learning.ope`
estimates the greedy policy's value there (IPS, SNIPS, DR with bootstrap CIs).
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path

import numpy as np
import pandas as pd

from policy.learned.bundle import read_predictor
from policy.learned.policy import RUNTIME_DEFAULTS, LearnedPolicy
from policy.learned.scorer import NumpyScorer
from policy.learning.config import OfflineConfig
from policy.learning.data import KINDS, Decisions, decision_telemetry, load_decisions
from policy.learning.fit import RidgeQ, evaluate_policy_on, fit_scorer
from predictors.logs import existing_logs

__all__ = ["SPLITS", "heldout_split", "heldout_mask", "logged_levers", "ope_on_log", "train_policy"]


def ope_on_log(policy_dir: str | Path, log_dir: str | Path, config: OfflineConfig | None = None,
               n_boot: int = 500) -> dict[str, float]:
    """OPE of the greedy policy in ``policy_dir`` on one held-out log (``ope.*`` keys and ``behaviour.value``).

    The DR reward model is fitted on the log itself (ridge on the logged actions' features).
    """
    policy = LearnedPolicy.load(policy_dir)
    config = config or OfflineConfig()
    data = load_decisions(log_dir, policy.predictor, config)
    return evaluate_policy_on(policy.scorer, RidgeQ(config.ridge).fit(data), data, config, n_boot=n_boot)


#: How :func:`train_policy` holds decisions out (its manifest's ``trained_on.split``), as printed.
SPLITS = {"log": "log (the last log directory)", "time": "time (the last decisions of the log)",
          "group": "GRPO group (the logs hold one RL step; the groups of the logged actions)"}


def heldout_split(data: Decisions, n_logs: int) -> str:
    """How to hold decisions out: by ``log`` with several logs; with one, by ``time`` when it spans several RL
    steps, else by ``group`` (a clear error when the one step's decisions all act on one GRPO group)."""
    if n_logs > 1:
        return "log"
    if len(np.unique(data.step)) > 1:
        return "time"
    groups = np.unique(data.group.astype(str))
    if len(groups) < 2:
        raise ValueError(f"the logs hold one RL step ({int(data.step[0])}) whose decisions all act on one GRPO group "
                         f"({groups[0]}): a held-out split needs 2 groups or 2 steps (requests column group_id)")
    return "group"


def heldout_mask(data: Decisions, split: str, holdout_fraction: float, n_logs: int) -> np.ndarray:
    """The held-out decisions of ``split``: the last of ``n_logs`` logs, the last ``holdout_fraction`` by time, or
    the decisions acting on the last ``holdout_fraction`` of the groups (by their first decision)."""
    if split == "log":
        return data.log == n_logs - 1
    if split == "time":
        return data.time > np.quantile(data.time, 1.0 - holdout_fraction)
    g = data.group.astype(str)
    first = pd.Series(data.time).groupby(g).min().sort_values(kind="stable")
    k = max(1, round(holdout_fraction * len(first)))
    return np.isin(g, first.index[-k:].to_numpy())


def logged_levers(log_dirs: Sequence[Path], data: "Decisions") -> dict[str, bool]:
    """Which levers the logs exercised: ``preempt`` (preemption decisions to learn from), ``offload`` (a CPU
    offload tier: some ``steps`` row stored blocks to it) and ``async`` (some log is a simulation under
    asynchronous RL: its ``summary.json`` says ``driver`` async)."""
    from data.io import read_telemetry

    levers = {"preempt": bool(np.any(data.kind == KINDS["preempt"])),
              "async": any(_driver(log) == "async" for log in log_dirs)}
    tier = False
    for log in log_dirs:
        try:
            steps = read_telemetry(decision_telemetry(log), "steps", ["offload_stored_blocks"])
        except Exception:  # noqa: BLE001 - logs from before the tier's columns: no tier
            continue
        if steps.num_rows and sum(v or 0 for v in steps.column("offload_stored_blocks").to_pylist()) > 0:
            tier = True
            break
    return {**levers, "offload": tier}


def _driver(log: Path) -> str | None:
    """The simulation driver of a log (its ``summary.json``'s ``driver``), None where it has none."""
    path = Path(log) / "summary.json"  # (where training.train.logs_engine reads the logs' engine)
    try:
        summary = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return summary.get("driver") if isinstance(summary, dict) else None


def logged_session_contexts(log_dirs: Sequence[Path]) -> dict[str, dict[str, float]]:
    """Per domain, the mean peak context of the sessions the logs hold and their count (the prior of the async
    rollout's ``working-set`` admission, :mod:`policy.group_width`), pooled over the log directories."""
    from data.io import read_telemetry
    from policy.group_width import fit_session_contexts

    pooled: dict[str, list[float]] = {}
    for log in log_dirs:
        fit = fit_session_contexts(read_telemetry(decision_telemetry(log), "requests",
                                                  ["session_id", "domain", "prompt_tokens", "output_tokens"]))
        for domain, s in fit.items():
            acc = pooled.setdefault(domain, [0.0, 0.0])
            acc[0] += s["mean_peak"] * s["sessions"]
            acc[1] += s["sessions"]
    return {d: {"mean_peak": total / n, "sessions": n} for d, (total, n) in sorted(pooled.items())}


def train_policy(
    log_dirs: Sequence[Path],
    predictors_dir: Path,
    out_dir: Path,
    config: OfflineConfig | None = None,
    progress: bool = True,
) -> dict[str, float]:
    """Fit the learned policy from ``log_dirs`` and write POLICY_DIR ``out_dir``; returns flat metrics."""
    t0 = time.perf_counter()
    config = config or OfflineConfig()
    log_dirs = existing_logs(log_dirs)
    if not log_dirs:
        raise ValueError("no logs given")
    predictors_dir = Path(predictors_dir)
    length_model = read_predictor(predictors_dir)
    rng = np.random.default_rng(config.seed)
    parts = [load_decisions(p, length_model, config, i, rng) for i, p in enumerate(log_dirs)]
    data = Decisions.concat(parts)
    if len(data) == 0:
        raise ValueError(f"no usable decisions (admit/preempt with >= 2 candidates) in {[str(p) for p in log_dirs]}")
    split = heldout_split(data, len(log_dirs))
    test_mask = heldout_mask(data, split, config.holdout_fraction, len(log_dirs))
    if test_mask.all() or not test_mask.any():
        test_mask = np.zeros(len(data), bool)
        test_mask[int(len(data) * (1 - config.holdout_fraction)):] = True
    train, test = data.subset(np.nonzero(~test_mask)[0]), data.subset(np.nonzero(test_mask)[0])
    t_load = time.perf_counter() - t0
    scorer, _, metrics = fit_scorer(train, config, progress=progress)
    state = {k: v.detach().cpu().numpy() for k, v in scorer.state_dict().items()}
    fn = NumpyScorer(state)
    q_train = RidgeQ(config.ridge).fit(train)  # DR's reward model in raw units, fitted on the training split
    metrics.update(evaluate_policy_on(fn, q_train, test, config))
    cfg = asdict(config)
    cfg["hidden"] = list(config.hidden)
    levers = logged_levers(log_dirs, data)
    runtime = {**RUNTIME_DEFAULTS, **config.runtime, "temperature": config.temperature,
               "preempt": levers["preempt"] if config.preempt is None else config.preempt,
               "offload": levers["offload"] if config.offload is None else config.offload}
    if config.gpu_eviction is not None:
        runtime["gpu_eviction"] = config.gpu_eviction
    elif levers["async"]:  # the GPU's evictions by group age too, under asynchronous RL only
        runtime["gpu_eviction"] = "async"
    cfg["preempt"], cfg["offload"], cfg["gpu_eviction"] = (runtime["preempt"], runtime["offload"],
                                                           runtime["gpu_eviction"])
    cfg["runtime"] = runtime
    trained_on = {"logs": [str(p) for p in log_dirs], "predictors": str(predictors_dir), "split": split,
                  "decisions_train": int(len(train)), "decisions_test": int(len(test)),
                  "candidate_rows": int(len(data.x)), "session_contexts": logged_session_contexts(log_dirs)}
    policy = LearnedPolicy(state, length_model, manifest={"config": cfg, "trained_on": trained_on},
                           predictors_dir=predictors_dir, **runtime)
    policy.save(out_dir)
    metrics.update({"data.decisions_train": float(len(train)), "data.decisions_test": float(len(test)),
                    "data.load_s": t_load, "train.total_s": time.perf_counter() - t0})
    (Path(out_dir) / "metrics.json").write_text(json.dumps({**metrics, "split": split}, indent=2, default=float))
    return {k: (float(v) if v is not None and not (isinstance(v, float) and math.isnan(v)) else float("nan"))
            for k, v in metrics.items()}
