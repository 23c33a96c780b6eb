"""Session features at the time a rollout turn finishes, with the labels of the session models.

One row per finished rollout turn (a request with a ``session_id``, domain other
than ``reward``, not aborted) of a prepared requests frame
(:func:`predictors.features.prepare_requests`). The decision time ``t`` is the
turn's ``finish_s``: everything in a row's features was known at ``t``.

Labels (from the ``requests`` telemetry alone; the next turn is the row of the
same ``session_id`` with ``turn + 1``):

* ``cont``: the session has a next turn; ``remaining``: turns after this one
  (the session's logged turn count - 1 - ``turn``);
* ``latency_s``: next turn's ``arrival_s`` - this turn's ``finish_s`` (the tool
  call this turn ends with); ``queue_s``: next turn's ``first_scheduled_s`` - its
  ``arrival_s``; ``next_use_s``: next turn's ``first_scheduled_s`` - ``finish_s``
  (when the paused session's blocks are used again). NaN on last turns.

The tool key. Telemetry has no tool column; ``tool`` comes from the workload
when a run directory has one (``prepare_requests`` joins it: the tool this turn
calls). Where it is unknown, the **tool key** of the baseline is the
``paradigm`` (then the ``domain``): :func:`tool_key`.

Features (:data:`SESSION_FEATURES`): ``domain``, ``paradigm``, ``tool``
(categorical codes); ``turn``; ``prompt_tokens`` (context this turn started
with), ``output_tokens`` (this turn), ``out_total`` (output tokens of the
session so far, this turn included), ``context_growth`` (prompt tokens beyond
the session's first prompt); ``group_size``; this session's earlier tool calls
(only those before this turn; log1p seconds): ``lat_mean``, ``lat_last``; the
group's completed tool calls by ``t``, every session of the group:
``grp_lat_n``, ``grp_lat_mean``; siblings (other sessions of the group) that
ended strictly before ``t``: ``sib_done_n``, ``sib_done_turns_mean``,
``sib_done_turns_min``, ``sib_done_turns_max`` (their turn counts); the group's
progress: ``grp_turn_mean`` (turns of the group arrived by ``t`` per session
started); this prompt in earlier RL steps (sessions ended by ``t``):
``hist_n``, ``hist_turns_mean``. A session **ends** when its last logged turn
finishes, unless that turn's ``finish_reason`` is ``tool_call`` (the hook writes
it where it knows the tool: the session is paused, not over). Without tool
metadata every turn finishes ``stop`` and this is the offline approximation of
"the sibling had ended": online a policy sees it when no next turn comes.

``finish_reason`` is deliberately not a feature: where the RL framework passes
``kvpilot_tool``, the hook writes ``tool_call`` for a turn that calls a tool, and
whether the session continues is then known (the models are for when it is not).
"""

from __future__ import annotations

import numpy as np
import pandas as pd

from predictors.features import Vocab, _cum_before, _keys, _mean

SESSION_CATEGORICAL: tuple[str, ...] = ("domain", "paradigm", "tool")
SESSION_FEATURES: tuple[str, ...] = (
    *SESSION_CATEGORICAL, "turn", "prompt_tokens", "output_tokens", "out_total", "context_growth", "group_size",
    "lat_mean", "lat_last", "grp_lat_n", "grp_lat_mean", "sib_done_n", "sib_done_turns_mean", "sib_done_turns_min",
    "sib_done_turns_max", "grp_turn_mean", "hist_n", "hist_turns_mean",
)
#: Label columns of :func:`session_rows`.
SESSION_LABELS: tuple[str, ...] = ("cont", "remaining", "latency_s", "queue_s", "next_use_s")
#: Columns of the prepared requests frame that :func:`session_rows` reads.
REQUIRED_COLUMNS: tuple[str, ...] = (
    "request_id", "session_id", "group_id", "pkey", "step", "turn", "domain", "paradigm", "tool", "group_size",
    "arrival_s", "first_scheduled_s", "finish_s", "prompt_tokens", "output_tokens", "finish_reason", "done",
)


def _known(v) -> bool:
    return v is not None and v == v


def tool_key(tool, paradigm, domain) -> list[str]:
    """The tool each latency is keyed by: the tool name when known, else the paradigm, else the domain."""
    return [str(t) if _known(t) else f"paradigm:{p}" if _known(p) else f"domain:{d}" if _known(d) else "unknown"
            for t, p, d in zip(tool, paradigm, domain)]


def check_columns(df: pd.DataFrame, required: tuple[str, ...], where: str) -> None:
    """Raise ValueError naming every column of ``required`` that ``df`` lacks."""
    missing = [c for c in required if c not in df.columns]
    if missing:
        raise ValueError(f"{where} lacks column(s): {', '.join(missing)}")


def session_rows(df: pd.DataFrame, vocab: Vocab | None = None) -> pd.DataFrame:
    """Features and labels of every finished rollout turn of ``df`` (see the module docstring).

    Returns :data:`SESSION_FEATURES` (floats), :data:`SESSION_LABELS`, and beside
    them ``t``, ``step``, ``domain_name``, ``tool_key``, ``session_id`` and ``request_id``.
    """
    check_columns(df, REQUIRED_COLUMNS, "requests frame")
    vocab = vocab or Vocab.fit(df, SESSION_CATEGORICAL)
    roll = df[df["session_id"].notna() & (df["domain"].astype(str) != "reward")]
    # the next turn of each turn (any logged row, aborted or not)
    nxt = roll[["session_id", "turn", "arrival_s", "first_scheduled_s"]].copy()
    nxt["turn"] = nxt["turn"] - 1
    nxt = nxt.drop_duplicates(subset=["session_id", "turn"]).rename(
        columns={"arrival_s": "next_arrival_s", "first_scheduled_s": "next_sched_s"})
    rows = roll[roll["done"]].merge(nxt, on=["session_id", "turn"], how="left")
    rows = rows.sort_values(["finish_s", "request_id"], kind="stable").reset_index(drop=True)
    t = rows["finish_s"].to_numpy(float)
    sess = rows["session_id"].to_numpy(object)
    turns = rows["turn"].to_numpy(int)
    n_turns = rows.groupby("session_id")["turn"].transform("max").to_numpy(int) + 1
    cont = ~np.isnan(rows["next_arrival_s"].to_numpy(float))
    latency = rows["next_arrival_s"].to_numpy(float) - t
    out = pd.DataFrame(index=rows.index)
    for c in SESSION_CATEGORICAL:
        out[c] = vocab.encode(c, rows[c])
    out["turn"] = turns.astype(float)
    out["prompt_tokens"] = rows["prompt_tokens"].astype(float)
    out["output_tokens"] = rows["output_tokens"].astype(float)
    by_turn = rows.sort_values(["session_id", "turn"], kind="stable")
    out["out_total"] = by_turn.groupby("session_id")["output_tokens"].cumsum().astype(float)
    first = roll[roll["turn"] == 0].drop_duplicates("session_id").set_index("session_id")["prompt_tokens"]
    out["context_growth"] = out["prompt_tokens"] - rows["session_id"].map(first).astype(float)
    out["group_size"] = rows["group_size"].astype(float)
    # this session's earlier calls: a call completes when the next turn arrives (before this turn's finish)
    lat_log = np.log1p(np.where(cont, latency, 0.0))
    call_t = np.where(cont, rows["next_arrival_s"].to_numpy(float), np.inf)
    c, s = _cum_before(sess, call_t, lat_log, sess, t)
    out["lat_mean"] = _mean(c, s)
    prev = pd.Series(np.where(cont, lat_log, np.nan), index=rows.index).loc[by_turn.index]
    out["lat_last"] = prev.groupby(by_turn["session_id"].to_numpy()).shift(1).reindex(rows.index)
    grp = rows["group_id"].to_numpy(object)
    c, s = _cum_before(grp, call_t, lat_log, grp, t)
    out["grp_lat_n"], out["grp_lat_mean"] = c, _mean(c, s)
    # siblings that ended strictly before t: at their last logged turn, unless it ended in a tool call
    last = (turns == n_turns - 1) & (rows["finish_reason"].to_numpy(object) != "tool_call")
    end_t = np.where(last, t, np.inf)
    before = np.nextafter(t, -np.inf)
    c, s, mx = _cum_before(grp, end_t, n_turns.astype(float), grp, before, want_max=True)
    _, _, mn = _cum_before(grp, end_t, -n_turns.astype(float), grp, before, want_max=True)
    out["sib_done_n"], out["sib_done_turns_mean"] = c, _mean(c, s)
    out["sib_done_turns_min"], out["sib_done_turns_max"] = -mn, mx
    gall = roll["group_id"].to_numpy(object)
    c_turns, _ = _cum_before(gall, roll["arrival_s"].to_numpy(float), np.zeros(len(roll)), grp, t)
    starts = roll[roll["turn"] == 0]
    c_sess, _ = _cum_before(starts["group_id"].to_numpy(object), starts["arrival_s"].to_numpy(float),
                            np.zeros(len(starts)), grp, t)
    out["grp_turn_mean"] = _mean(c_sess, c_turns)
    # this prompt's sessions in earlier RL steps: all ended sessions of the prompt minus those of this step
    pk = rows["pkey"].to_numpy(object)
    pks = _keys(rows["pkey"], rows["step"])
    c1, s1 = _cum_before(pk, end_t, n_turns.astype(float), pk, t)
    c2, s2 = _cum_before(pks, end_t, n_turns.astype(float), pks, t)
    out["hist_n"], out["hist_turns_mean"] = c1 - c2, _mean(c1 - c2, s1 - s2)
    out = out[list(SESSION_FEATURES)].astype(float)
    out["cont"] = cont.astype(float)
    out["remaining"] = (n_turns - 1 - turns).astype(float)
    out["latency_s"] = np.where(cont, latency, np.nan)
    out["queue_s"] = rows["next_sched_s"].to_numpy(float) - rows["next_arrival_s"].to_numpy(float)
    out["next_use_s"] = rows["next_sched_s"].to_numpy(float) - t
    out["t"] = t
    out["step"] = rows["step"].to_numpy()
    out["domain_name"] = rows["domain"].astype(str).to_numpy()
    out["tool_key"] = np.asarray(tool_key(rows["tool"], rows["paradigm"], rows["domain"]), dtype=object)
    out["session_id"] = sess
    out["request_id"] = rows["request_id"].to_numpy(object)
    return out
