"""Loading training logs: telemetry run directories (or workload files) into one prepared requests frame, and
the held-out split of that frame (:func:`split_heldout`): whole RL steps, or whole GRPO groups when the logs
hold a single RL step (what a user has after one step of training)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import pandas as pd

from data.io import read_telemetry, read_workload
from predictors.features import prepare_requests, workload_as_requests

#: A workload file looked for inside a run directory and joined to its telemetry (prompt ids, tools, group sizes).
WORKLOAD_NAMES = ("workload.parquet",)
_ID_COLUMNS = ("request_id", "session_id", "group_id", "prompt_id", "pkey", "rkey")


def telemetry_dir(path: Path) -> Path | None:
    """The directory holding ``requests/`` for a run directory (``run/telemetry`` or the run itself)."""
    for cand in (path / "telemetry", path):
        if (cand / "requests").is_dir():
            return cand
    return None


def existing_logs(paths: Sequence[str | Path]) -> list[Path]:
    """The log paths, each of which exists; missing ones raise :class:`FileNotFoundError` naming them all."""
    paths = [Path(p) for p in paths]
    missing = [str(p) for p in paths if not p.exists()]
    if missing:
        raise FileNotFoundError(f"no such log: {', '.join(missing)}")
    return paths


def parse_steps(text: str | None) -> list[int] | None:
    """RL steps from a comma list of steps and ranges (``"2"``, ``"6-7"``, ``"0,4-5"``); None or empty: None."""
    if not text:
        return None
    out: list[int] = []
    try:
        for part in text.split(","):
            part = part.strip()
            if "-" in part:
                a, b = part.split("-", 1)
                out.extend(range(int(a), int(b) + 1))
            elif part:
                out.append(int(part))
    except ValueError:
        raise ValueError(f"RL steps must be integers or ranges like 6-7, comma-separated; got {text!r}") from None
    return out


def load_log(path: str | Path) -> pd.DataFrame:
    """One log: a simulator/hook run directory (its ``workload.parquet`` joined if present) or a workload file."""
    path = Path(path)
    if path.is_file() or (path.is_dir() and telemetry_dir(path) is None and any(path.glob("*.parquet"))):
        return workload_as_requests(read_workload(path))
    tdir = telemetry_dir(path)
    if tdir is None:
        raise FileNotFoundError(f"{path}: no telemetry (expected {path}/telemetry/requests or {path}/requests)")
    workload = None
    for name in WORKLOAD_NAMES:
        for cand in (path / name, tdir / name):
            if cand.is_file():
                workload = read_workload(cand)
                break
        if workload is not None:
            break
    return prepare_requests(read_telemetry(tdir, "requests"), workload)


def load_logs(paths: Sequence[str | Path]) -> pd.DataFrame:
    """Several logs as one frame; ids are prefixed by the log's index when there are several."""
    frames = []
    paths = existing_logs(paths)
    for i, p in enumerate(paths):
        df = load_log(p)
        if len(paths) > 1:
            for c in _ID_COLUMNS:
                df[c] = df[c].map(lambda v, i=i: f"r{i}:{v}" if v is not None and v == v else v)
        frames.append(df)
    if not frames:
        raise ValueError("no logs given")
    return pd.concat(frames, ignore_index=True) if len(frames) > 1 else frames[0]


def split_by_step(df: pd.DataFrame, test_steps: Sequence[int] | None = None, test_fraction: float = 0.25):
    """(train, test) masks: whole RL steps, never rows. Default test: the last ``test_fraction`` of steps (>= 1)."""
    steps = sorted(df["step"].unique().tolist())
    if test_steps is None:
        if len(steps) < 2:
            raise ValueError(f"a split by RL step needs at least 2 steps; the logs have {steps}")
        k = max(1, round(test_fraction * len(steps)))
        test_steps = steps[-k:]
    test = df["step"].isin(list(test_steps))
    if not test.any() or test.all():
        raise ValueError(f"test steps {list(test_steps)} leave an empty train or test set (steps {steps})")
    return ~test, test


def group_keys(df: pd.DataFrame) -> pd.Series:
    """Each request's GRPO group: its ``group_id``, else its session's, else a group of its own."""
    key = df["group_id"].astype(object)
    for fallback, prefix in (("session_id", "session:"), ("request_id", "request:")):
        fill = key.isna() & df[fallback].notna()
        if fill.any():
            key = key.where(~fill, prefix + df[fallback].astype(str))
    return key


def split_by_group(df: pd.DataFrame, test_fraction: float = 0.25) -> tuple[pd.Series, pd.Series]:
    """(train, test) masks: whole GRPO groups (:func:`group_keys`), never rows. Test: the last ``test_fraction``
    of the groups (>= 1) by first arrival, so every sibling of a held-out request is held out with it."""
    keys = group_keys(df)
    first = df.assign(_g=keys).groupby("_g", sort=False)["arrival_s"].min().sort_values(kind="stable")
    if len(first) < 2:
        raise ValueError(f"a split by GRPO group needs at least 2 groups; the logs' requests form "
                         f"{len(first)} ({', '.join(map(str, first.index[:1]))}) (column group_id)")
    k = max(1, round(test_fraction * len(first)))
    test = keys.isin(set(first.index[-k:]))
    return ~test, test


@dataclass(frozen=True)
class Split:
    """A held-out split of a requests frame: the masks, and how it was made (``by``: ``"step"`` or ``"group"``)."""

    train: pd.Series
    test: pd.Series
    by: str

    def describe(self, df: pd.DataFrame) -> str:
        """One line saying how the data was split (printed by the training commands)."""
        if self.by == "step":
            return (f"held out by RL step: train steps {sorted(df.loc[self.train, 'step'].unique().tolist())} -> "
                    f"test steps {sorted(df.loc[self.test, 'step'].unique().tolist())}")
        keys = group_keys(df)
        return (f"held out by GRPO group (the logs hold one RL step, {df['step'].iloc[0]}): "
                f"{keys[self.train].nunique()} train groups -> {keys[self.test].nunique()} test groups")


def split_heldout(df: pd.DataFrame, test_steps: Sequence[int] | None = None,
                  test_fraction: float = 0.25) -> Split:
    """The held-out split: by RL step (:func:`split_by_step`), or by GRPO group (:func:`split_by_group`) when the
    logs hold a single RL step and no ``test_steps`` were asked for."""
    if test_steps is None and df["step"].nunique() == 1:
        return Split(*split_by_group(df, test_fraction), by="group")
    return Split(*split_by_step(df, test_steps, test_fraction), by="step")
