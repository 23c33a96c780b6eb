"""``kvpilot calibrate``: fit the simulator's step-cost model to an engine's measured steps.

The hook's ``steps`` telemetry times every engine step (``duration_s``: from ``schedule()`` to the step's
output) and records what it scheduled: prefill and decode tokens and their attention context
(``prefill_context_tokens``, ``decode_context_tokens``). A non-negative least-squares fit (scikit-learn) of
the duration on those terms, checked on held-out steps, gives :class:`simulator.fitted_cost.FittedCost`; the
engine loop's time between one step's end and the next one's start (the median over busy steps) joins its
fixed overhead, so that the simulator's steps take the engine's wall time. The same table comes from a GPU
server, so the command works there too. Telemetry of the simulator's decode stride above 1 prices several
iterations per row: calibrate on stride 1 (a real engine always is).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa

from data.io import read_telemetry
from simulator.fitted_cost import EngineShape, FittedCost

__all__ = ["CalibrateConfig", "Calibration", "CalibrationError", "calibrate", "read_steps"]

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

    def __post_init__(self) -> None:
        if not 0 < self.holdout < 1:
            raise CalibrationError(f"--holdout must be in (0, 1), got {self.holdout}")
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

    def fit_record(self) -> dict[str, object]:
        """What the preset file's ``[fit]`` section records."""
        return {"steps": self.steps, "heldout_steps": self.heldout_steps, "heldout_r2": self.r2,
                "heldout_median_rel_error": self.median_rel_error, "heldout_p90_rel_error": self.p90_rel_error,
                "loop_gap_s": self.loop_gap_s, "telemetry": list(self.sources)}

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


def _loop_gap(steps: pa.Table) -> float:
    """Median seconds between a busy step's end and the next step's start, per source and replica."""
    key = np.asarray(steps.column("source")) * 1_000_003 + np.asarray(steps.column("replica"))
    order = np.lexsort((np.asarray(steps.column("engine_step")), key))
    t = np.asarray(steps.column("time_s"))[order]
    d = np.asarray(steps.column("duration_s"))[order]
    work = (np.asarray(steps.column("prefill_tokens")) + np.asarray(steps.column("decode_tokens")))[order] > 0
    k = key[order]
    same = (k[1:] == k[:-1]) & work[1:] & work[:-1]
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
    cost = FittedCost(name=name, engine=engine, step_overhead_s=float(c[0]) + gap, prefill_token_s=float(c[1]),
                      decode_token_s=float(c[2]), prefill_pair_s=float(c[3]), decode_context_s_per_token=float(c[4]))
    return Calibration(cost=cost, steps=len(y), heldout_steps=len(y_test), r2=float(r2_score(y_test, pred)),
                       median_rel_error=float(np.median(rel)), p90_rel_error=float(np.quantile(rel, 0.9)),
                       loop_gap_s=gap, sources=sources)
