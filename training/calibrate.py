"""``kvpilot calibrate``: fit the simulator's step-cost model to an engine's measured steps.

The hook's ``steps`` telemetry times every engine step (``duration_s``: from ``schedule()`` to the step's
output) and records what it scheduled: prefill and decode tokens and their attention context
(``prefill_context_tokens``, ``decode_context_tokens``). A non-negative least-squares fit (scikit-learn) of
the duration on those terms, checked on held-out steps, gives :class:`simulator.fitted_cost.FittedCost`; the
engine loop's time between one step's end and the next one's start (the median over busy steps) joins its
fixed overhead, so that the simulator's steps take the engine's wall time. Given the workload the client replayed
(``--workload``, with replay's ``--time-scale``), it also measures the client's round trip: from the engine
finishing a turn to the session's next turn arriving, less the workload's tool wait: its quantiles over the
follow-ups, from which the simulator draws every follow-up's (:mod:`simulator.round_trip`). The same tables come
from a GPU server, so the command works there too. Telemetry of the simulator's decode stride above 1 prices several
iterations per row: calibrate on stride 1 (a real engine always is).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa

from data.io import read_telemetry
from predictors.logs import telemetry_dir
from simulator.fitted_cost import EngineShape, FittedCost

__all__ = ["CalibrateConfig", "Calibration", "CalibrationError", "calibrate", "read_steps", "round_trip"]

#: What one step's duration is fitted on, in FittedCost's order.
TERMS = ("prefill_tokens", "decode_tokens", "prefill_context_tokens", "decode_context_tokens")
ENGINE = ("num_gpu_blocks", "block_size", "max_num_seqs", "max_num_batched_tokens")


class CalibrationError(ValueError):
    """Telemetry that cannot be calibrated on: the message names the folder and what is missing."""


@dataclass(frozen=True)
class CalibrateConfig:
    """Settings of one fit: the held-out share of steps, the split's seed, the fewest steps to fit on."""

    holdout: float = 0.2
    seed: int = 0
    min_steps: int = 50
    name: str | None = None
    #: The workload the telemetry's client replayed, and replay's ``--time-scale``: the round trip is measured
    #: where it is given.
    workload: Path | None = None
    time_scale: float = 1.0

    def __post_init__(self) -> None:
        if not 0 < self.holdout < 1:
            raise CalibrationError(f"--holdout must be in (0, 1), got {self.holdout}")
        if not self.time_scale >= 0:
            raise CalibrationError(f"--time-scale must be >= 0, got {self.time_scale}")
        if self.workload is None and self.time_scale != 1.0:
            raise CalibrationError("--time-scale scales --workload's tool waits: give the workload the client replayed")
        if self.min_steps < 10:
            raise CalibrationError(f"min_steps must be >= 10, got {self.min_steps}")


@dataclass(frozen=True)
class Calibration:
    """A fitted preset and how well it predicts held-out steps."""

    cost: FittedCost
    steps: int  # busy steps fitted and held out
    heldout_steps: int
    r2: float  # of held-out step durations
    median_rel_error: float
    p90_rel_error: float
    loop_gap_s: float  # median time between a busy step's end and the next step's start
    sources: tuple[str, ...]
    follow_ups: int = 0  # follow-up turns the round trip's quantiles are measured on; 0: not measured

    def fit_record(self) -> dict[str, object]:
        """What the preset file's ``[fit]`` section records."""
        return {"steps": self.steps, "heldout_steps": self.heldout_steps, "heldout_r2": self.r2,
                "heldout_median_rel_error": self.median_rel_error, "heldout_p90_rel_error": self.p90_rel_error,
                "loop_gap_s": self.loop_gap_s, "round_trip_follow_ups": self.follow_ups,
                "telemetry": list(self.sources)}

    def to_dict(self) -> dict[str, object]:
        cost = {k: v for k, v in asdict(self.cost).items() if k not in ("gpu", "model", "host_tier")}
        return {**cost, **self.fit_record()}

    def render(self) -> str:
        c = self.cost
        e = c.engine
        return "\n".join([
            f"fitted {self.steps - self.heldout_steps} steps, held out {self.heldout_steps}: R² {self.r2:.3f}, "
            f"relative error median {self.median_rel_error:.1%}, p90 {self.p90_rel_error:.1%}",
            f"step = {c.step_overhead_s * 1e3:.3f} ms (loop gap {self.loop_gap_s * 1e3:.3f} ms included)"
            f" + {c.prefill_token_s * 1e6:.3f} us/prefill token + {c.decode_token_s * 1e6:.3f} us/decode token"
            f" + {c.prefill_pair_s * 1e9:.4f} ns/prefill pair + {c.decode_context_s_per_token * 1e9:.4f} ns/decode"
            " context token",
            f"engine: {e.num_gpu_blocks} blocks of {e.block_size} tokens, max_num_seqs {e.max_num_seqs}, "
            f"max_num_batched_tokens {e.max_num_batched_tokens}",
            f"client round trip: median {c.round_trip_quantiles_s[10] * 1e3:.2f} ms, p90 "
            f"{c.round_trip_quantiles_s[18] * 1e3:.2f} ms, max {c.round_trip_quantiles_s[20] * 1e3:.2f} ms over "
            f"{self.follow_ups} follow-up turns"
            if self.follow_ups else "client round trip: not measured (give --workload, the workload replayed)",
        ])


def read_steps(dirs: Sequence[Path]) -> tuple[pa.Table, tuple[str, ...]]:
    """Every folder's ``steps`` rows (a run folder or its ``telemetry`` folder), with their source's index."""
    tables, sources = [], []
    for i, d in enumerate(dirs):
        tdir = next((c for c in (Path(d) / "telemetry", Path(d)) if (c / "steps").is_dir()), None)
        if tdir is None:
            raise CalibrationError(f"{d}: no steps telemetry (expected {d}/steps or {d}/telemetry/steps)")
        t = read_telemetry(tdir, "steps", ["replica", "engine_step", "time_s", "duration_s", *TERMS, *ENGINE])
        if t.num_rows == 0:
            raise CalibrationError(f"{tdir / 'steps'}: the steps table has no rows")
        for col in (*TERMS[2:], *ENGINE):
            if t.column(col).null_count == t.num_rows:
                raise CalibrationError(f"{tdir / 'steps'}: column {col} is empty (telemetry written before kvpilot "
                                       "recorded the step-cost terms and the engine; record it again)")
        tables.append(t.append_column("source", pa.array(np.full(t.num_rows, i, np.int32))))
        sources.append(str(d))
    return pa.concat_tables(tables), tuple(sources)


def _engine(steps: pa.Table, sources: Sequence[str]) -> EngineShape:
    """The one engine the steps come from; telemetry of engines of different shapes is an error."""
    values = {}
    for col in ENGINE:
        seen = sorted({v for v in steps.column(col).to_pylist() if v is not None})
        if len(seen) > 1:
            raise CalibrationError(f"the telemetry ({', '.join(sources)}) comes from engines with different {col}: "
                                   f"{seen}; calibrate one engine at a time")
        values[col] = int(seen[0])
    return EngineShape(**values)


def round_trip(dirs: Sequence[Path], workload: Path, time_scale: float) -> tuple[tuple[float, ...], int]:
    """(quantiles at 0, 5, ..., 100%, follow-ups) of the seconds from the engine finishing a turn to the session's
    next turn arriving, less the workload's tool wait at ``time_scale``, over the requests telemetry of ``dirs``
    (a session's turns pair in arrival order, turn k with turn k + 1, so the replays of ``workload`` a folder holds
    must not overlap in time: a server's runs one after another, as ``replay`` and ``benchmarks/real_engine.py``
    make them, not several simulations, whose clocks each start at 0)."""
    from simulator.workload import load_workload

    wl = load_workload(workload)
    wait = {(s, t): (x or 0.0) * time_scale for s, t, x, k in zip(wl.session_id, wl.turn, wl.tool_latency_s, wl.kind)
            if k == "rollout"}  # the agent's turns: a scoring request follows no tool
    gaps = []
    for d in dirs:
        tdir = telemetry_dir(Path(d))
        if tdir is None:
            raise CalibrationError(f"{d}: no requests telemetry (expected {d}/requests or {d}/telemetry/requests)")
        q = read_telemetry(tdir, "requests", ["session_id", "turn", "arrival_s", "finish_s"]).to_pylist()
        q.sort(key=lambda r: (r["session_id"] or "", r["arrival_s"]))
        for a, b in zip(q, q[1:]):
            key = (a["session_id"], a["turn"])
            if a["session_id"] is not None and b["session_id"] == a["session_id"] and b["turn"] == a["turn"] + 1 \
                    and key in wait:
                gaps.append(b["arrival_s"] - a["finish_s"] - wait[key])
    if not gaps:
        raise CalibrationError(f"no session of {workload} has two turns in the telemetry ({', '.join(map(str, dirs))}):"
                               " is it the workload these servers replayed, and did the client send session ids "
                               "(kvpilot_session_id, as kvpilot replay does)?")
    return tuple(float(v) for v in np.quantile(np.maximum(gaps, 0.0), np.linspace(0, 1, 21))), len(gaps)


def _loop_gap(steps: pa.Table) -> float:
    """Median seconds between a busy step's end and the next step's start, per source and replica (one folder may
    hold several servers' runs, each counting its steps from 0: only a step and its successor count)."""
    key = np.asarray(steps.column("source")) * 1_000_003 + np.asarray(steps.column("replica"))
    order = np.lexsort((np.asarray(steps.column("time_s")), key))
    t = np.asarray(steps.column("time_s"))[order]
    d = np.asarray(steps.column("duration_s"))[order]
    n = np.asarray(steps.column("engine_step"))[order]
    work = (np.asarray(steps.column("prefill_tokens")) + np.asarray(steps.column("decode_tokens")))[order] > 0
    k = key[order]
    same = (k[1:] == k[:-1]) & (n[1:] == n[:-1] + 1) & work[1:] & work[:-1]
    gaps = (t[1:] - (t[:-1] + d[:-1]))[same]
    return float(max(0.0, np.median(gaps))) if gaps.size else 0.0


def calibrate(dirs: Sequence[Path], cfg: CalibrateConfig = CalibrateConfig()) -> Calibration:
    """Fit a :class:`FittedCost` to the steps of ``dirs`` (one engine's telemetry) and score it on held-out steps."""
    from sklearn.linear_model import LinearRegression
    from sklearn.metrics import r2_score
    from sklearn.model_selection import train_test_split

    if not dirs:
        raise CalibrationError("kvpilot calibrate needs --telemetry DIR (repeatable)")
    steps, sources = read_steps(dirs)
    engine = _engine(steps, sources)
    x = np.column_stack([np.asarray(steps.column(c).fill_null(0), np.float64) for c in TERMS])
    y = np.asarray(steps.column("duration_s"), np.float64)
    busy = (x[:, 0] + x[:, 1] > 0) & (y > 0)
    if busy.sum() < cfg.min_steps:
        raise CalibrationError(f"the telemetry ({', '.join(sources)}) has {int(busy.sum())} steps that scheduled "
                               f"anything; calibrate needs at least {cfg.min_steps}")
    x, y = x[busy], y[busy]
    ones = np.ones((len(y), 1))
    x_fit, x_test, y_fit, y_test = train_test_split(np.hstack([ones, x]), y, test_size=cfg.holdout,
                                                    random_state=cfg.seed)
    # Non-negative coefficients, the intercept among them (a column of ones): every term costs time.
    model = LinearRegression(fit_intercept=False, positive=True).fit(x_fit, y_fit)
    pred = model.predict(x_test)
    rel = np.abs(pred - y_test) / y_test
    gap = _loop_gap(steps)
    c = model.coef_
    name = cfg.name or Path(dirs[0]).name
    trip, follow_ups = round_trip(dirs, cfg.workload, cfg.time_scale) if cfg.workload is not None else ((), 0)
    cost = FittedCost(name=name, engine=engine, step_overhead_s=float(c[0]) + gap, prefill_token_s=float(c[1]),
                      decode_token_s=float(c[2]), prefill_pair_s=float(c[3]), decode_context_s_per_token=float(c[4]),
                      round_trip_quantiles_s=trip)
    return Calibration(cost=cost, steps=len(y), heldout_steps=len(y_test), r2=float(r2_score(y_test, pred)),
                       median_rel_error=float(np.median(rel)), p90_rel_error=float(np.quantile(rel, 0.9)),
                       loop_gap_s=gap, sources=sources, follow_ups=follow_ups)
