"""Decision-time features of the length and reuse predictors, from telemetry (and optionally the workload).

Everything here is computed from what was known at a *decision time* ``t``:
a request's own metadata and prompt (known on arrival), and the outcomes
(output length, finish time, scheduling time) of *other* requests only where
they happened at or before ``t``. :func:`mask_future` builds the log as it
stood at a cut time; the test suite checks that features of decisions taken
before the cut are the same on the masked and on the full log.

Input
-----
A telemetry ``requests`` table (:data:`data.schemas.REQUESTS`, one row per engine
request) as a pandas frame, normalised by :func:`prepare_requests`. Two optional
columns come from the workload when one is given (joined on ``request_id``):
``tool_before`` (the tool whose result this turn's prompt ends with, i.e. the
previous turn's ``tool``) and ``group_size``. Without a workload they are
unknown (NaN), as they are online when the RL framework passes no metadata.

**Prompt identity across RL steps.** The prompt key is ``prompt_id``: the
request metadata key ``kvpilot_prompt_id`` (``RequestMeta.prompt_id`` online),
which the hook writes to telemetry's ``requests.prompt_id``. Only where it is
null (an RL framework that does not pass it) is the key derived from
``group_id`` with the ``s<step>-`` prefix removed (the synthetic workload's
convention, ``group_id = s<step>-<prompt_id>``); a group id without that prefix
is its own prompt key, so such prompts never recur.

Length features (one row per request and decision time)
-------------------------------------------------------
``domain``, ``paradigm``, ``tool_before`` (categorical codes), ``prompt_tokens``,
``turn``, ``context_growth`` (prompt tokens beyond the session's first prompt),
``max_tokens``, ``group_size``; finished siblings of the same group and turn:
``sib_n``, ``sib_mean``, ``sib_max`` (log1p tokens); finished requests of the
group at any turn: ``grp_n``, ``grp_mean``; this session's earlier turns:
``sess_mean``; this prompt in earlier RL steps (finished by ``t``): ``hist_n``,
``hist_mean`` and, same turn only, ``hist_turn_mean`` (log1p tokens).

Decision times: ``arrival`` (first sight) and ``admit`` (first scheduled; a
prediction is refreshed when a sibling finishes, so the model is trained on
both). Evaluation uses ``admit``.

Reuse: the cached-prefix unit and the label
-------------------------------------------
A **cached prefix** is the block chain a finished request leaves in the prefix
cache: its prompt's blocks (telemetry ``block_hashes``), owned by that request
(the hook's :class:`data.records.CachedPrefix` ``prefix_id``). Its
**sharing key** is the owner's ``group_id`` when known, else its first block
hash: every request with that key shares at least the prefix's first block (a
GRPO sibling, a later turn of the trajectory, a reward-model request scoring it).
A **use** (hit) of the prefix is the first scheduling (``first_scheduled_s``) of
another request with the same key. For a snapshot at time ``t`` (the owner's
finish plus an offset in :data:`REUSE_OFFSETS_S`), the **label** is whether the
next use comes within ``(t, t + H]`` (``H`` = the model's horizon) and the
**time to next use** is ``next_use - t`` (censored at the end of the log).

Reuse features, per prefix and ``t``: ``n_blocks``, ``prompt_tokens``,
``turn``, ``domain``, ``finish_reason`` code, ``since_finish``;
``hits`` (uses of the key so far), ``since_use`` (``t`` minus the last use or
the owner's finish, whichever is later), LRB deltas ``gap1..gap3`` between
the last uses, decayed use counters ``edc_10``, ``edc_60``, ``edc_600``
(half-lives in seconds); the owner's state: ``key_waiting`` (requests of the key
that arrived and are not scheduled yet), ``grp_pending`` (sessions of the group
that arrived and have not ended), ``paused_tool`` (the owner turn ended in a
tool call and the next turn has not arrived), ``tool`` code (workload).
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping, Sequence

import numpy as np
import pandas as pd
import pyarrow as pa

LENGTH_FEATURES: tuple[str, ...] = (
    "domain", "paradigm", "tool_before", "prompt_tokens", "turn", "context_growth", "max_tokens", "group_size",
    "sib_n", "sib_mean", "sib_max", "grp_n", "grp_mean", "sess_mean", "hist_n", "hist_mean", "hist_turn_mean",
)
LENGTH_CATEGORICAL: tuple[str, ...] = ("domain", "paradigm", "tool_before")

REUSE_FEATURES: tuple[str, ...] = (
    "domain", "finish_reason", "tool", "n_blocks", "prompt_tokens", "turn", "since_finish", "hits", "since_use",
    "gap1", "gap2", "gap3", "edc_10", "edc_60", "edc_600", "key_waiting", "grp_pending", "paused_tool",
)
REUSE_CATEGORICAL: tuple[str, ...] = ("domain", "finish_reason", "tool")
EDC_HALF_LIVES_S: tuple[float, ...] = (10.0, 60.0, 600.0)
#: Snapshot offsets after the owner's finish at which reuse rows are taken (retention, then eviction times).
REUSE_OFFSETS_S: tuple[float, ...] = (0.0, 1.0, 5.0, 20.0, 60.0)

FINISH_CODES = {"stop": 0, "length": 1, "tool_call": 2, "abort": 3}
_STEP_PREFIX = re.compile(r"^s(\d+)-")

_COLUMNS = ("request_id", "session_id", "group_id", "prompt_id", "step", "turn", "domain", "paradigm", "arrival_s",
            "first_scheduled_s", "finish_s", "prompt_tokens", "output_tokens", "max_tokens", "finish_reason",
            "block_hashes")


# ---------------------------------------------------------------- vocabularies


class Vocab:
    """A stable string -> code mapping for categorical features (saved with a model); unknown -> NaN."""

    def __init__(self, values: Mapping[str, Sequence[str]] | None = None) -> None:
        self.values: dict[str, list[str]] = {k: list(v) for k, v in (values or {}).items()}
        self._index = {k: {s: i for i, s in enumerate(v)} for k, v in self.values.items()}

    @classmethod
    def fit(cls, frame: pd.DataFrame, columns: Iterable[str]) -> Vocab:
        out = {}
        for c in columns:
            vals = frame[c].dropna().astype(str).unique().tolist() if c in frame else []
            out[c] = sorted(vals)
        return cls(out)

    def code(self, column: str, value) -> float:
        if value is None or (isinstance(value, float) and np.isnan(value)):
            return np.nan
        i = self._index.get(column, {}).get(str(value))
        return np.nan if i is None else float(i)

    def encode(self, column: str, series: pd.Series) -> np.ndarray:
        cats = self.values.get(column, [])
        codes = pd.Categorical(series.astype(object).where(series.notna(), None), categories=cats).codes
        return np.where(codes >= 0, codes, np.nan).astype(float)

    def to_json(self) -> dict:
        return self.values


def feature_matrix(X, names: Sequence[str]) -> np.ndarray:
    """``X`` (a DataFrame with columns ``names``, or an array) as an (n, len(names)) float64 matrix; else ValueError."""
    if isinstance(X, pd.DataFrame):
        X = X[list(names)].to_numpy(np.float64)
    X = np.asarray(X, dtype=np.float64)
    if X.ndim != 2 or X.shape[1] != len(names):
        raise ValueError(f"expected an (n, {len(names)}) feature matrix, got {X.shape}")
    return X


def prompt_key(prompt_id, group_id, step=None):
    """The prompt's identity across RL steps (see the module docstring)."""
    if prompt_id is not None and prompt_id == prompt_id:
        return str(prompt_id)
    if group_id is None or group_id != group_id:
        return None
    m = _STEP_PREFIX.match(group_id)
    if m and (step is None or step != step or int(m.group(1)) == int(step)):
        return group_id[m.end():]
    return group_id


# ---------------------------------------------------------------- input preparation


def prepare_requests(requests: pa.Table | pd.DataFrame,
                     workload: pa.Table | pd.DataFrame | None = None) -> pd.DataFrame:
    """A telemetry requests frame with the columns features need, sorted by arrival; workload joined if given."""
    df = requests.to_pandas() if isinstance(requests, pa.Table) else requests.copy()
    missing = [c for c in _COLUMNS if c not in df.columns and c != "block_hashes"]
    if missing:
        raise ValueError(f"requests table lacks column(s): {', '.join(missing)}")
    if "block_hashes" in df.columns:
        df["lead"] = df["block_hashes"].map(lambda h: int(h[0]) if h is not None and len(h) else np.nan)
        df["n_blocks"] = df["block_hashes"].map(lambda h: len(h) if h is not None else 0).astype(float)
        df = df.drop(columns=["block_hashes"])
    else:
        df["lead"], df["n_blocks"] = np.nan, np.nan
    if "tool_before" not in df.columns:
        df["tool_before"] = None
    if "tool" not in df.columns:
        df["tool"] = None
    if "group_size" not in df.columns:
        df["group_size"] = np.nan
    if workload is not None:
        w = workload.to_pandas() if isinstance(workload, pa.Table) else workload
        w = w[["request_id", "session_id", "turn", "prompt_id", "tool", "group_size"]].copy()
        prev = w[["session_id", "turn", "tool"]].rename(columns={"tool": "tool_before"})
        prev["turn"] = prev["turn"] + 1
        w = w.merge(prev, on=["session_id", "turn"], how="left")
        w = w.set_index("request_id")
        ids = df["request_id"]
        df["prompt_id"] = df["prompt_id"].where(df["prompt_id"].notna(), ids.map(w["prompt_id"]))
        df["tool_before"] = ids.map(w["tool_before"])
        df["tool"] = ids.map(w["tool"])
        df["group_size"] = ids.map(w["group_size"]).astype(float)
    for c in ("arrival_s", "first_scheduled_s", "finish_s"):
        df[c] = df[c].astype(float)
    df["first_scheduled_s"] = df["first_scheduled_s"].fillna(df["finish_s"])
    df["turn"] = df["turn"].fillna(0).astype(int)
    df["step"] = df["step"].fillna(0).astype(int)
    df["pkey"] = [prompt_key(p, g, s) for p, g, s in zip(df["prompt_id"], df["group_id"], df["step"])]
    df["rkey"] = [g if g is not None and g == g else (f"h{int(lead)}" if lead == lead else None)
                  for g, lead in zip(df["group_id"], df["lead"])]
    df["y"] = np.log1p(df["output_tokens"].astype(float))
    done = df["finish_s"].notna() & (df["finish_reason"] != "abort")
    df["done"] = done
    return df.sort_values(["arrival_s", "request_id"], kind="stable").reset_index(drop=True)


def workload_as_requests(workload: pa.Table | pd.DataFrame) -> pd.DataFrame:
    """A requests-like frame from a workload alone (no simulation), for length features.

    Pseudo-times, conservative about what is known: within an RL step, turn ``k``
    of every session arrives and is scheduled at ``k`` and finishes at ``k + 0.5``,
    and step ``s`` is offset by ``10**6 * s``. So a request sees its group's earlier
    turns and earlier steps, never a sibling of its own turn (they run together).
    Scoring requests come after every rollout turn of their step.
    """
    w = workload.to_pandas() if isinstance(workload, pa.Table) else workload.copy()
    step = w["step"].astype(float)
    turn = w["turn"].astype(float).where(w["kind"] != "scoring", 100.0)
    t = 1e6 * step + turn
    df = pd.DataFrame({
        "request_id": w["request_id"], "session_id": w["session_id"], "group_id": w["group_id"],
        "prompt_id": w["prompt_id"], "step": w["step"], "turn": w["turn"], "domain": w["domain"],
        "paradigm": w["paradigm"], "arrival_s": t, "first_scheduled_s": t, "finish_s": t + 0.5,
        "prompt_tokens": w["prompt_tokens"], "output_tokens": w["output_tokens"], "max_tokens": w["max_tokens"],
        "finish_reason": w["finish_reason"], "block_hashes": w["block_hashes"],
    })
    return prepare_requests(df, w)


def mask_future(df: pd.DataFrame, cut_s: float, rng: np.random.Generator | None = None) -> pd.DataFrame:
    """The log as it stood at ``cut_s``: later arrivals gone, later outcomes scrambled (for leak tests)."""
    rng = rng or np.random.default_rng(0)
    out = df[df["arrival_s"] <= cut_s].copy()
    late_fin = ~(out["finish_s"] <= cut_s)
    out.loc[late_fin, "finish_s"] = cut_s + 1e6 * (1 + rng.random(int(late_fin.sum())))
    out["output_tokens"] = out["output_tokens"].astype(np.int64)
    out.loc[late_fin, "output_tokens"] = rng.integers(1, 50000, int(late_fin.sum()))
    out.loc[late_fin, "y"] = np.log1p(out.loc[late_fin, "output_tokens"].astype(float))
    out.loc[late_fin, "finish_reason"] = rng.choice(list(FINISH_CODES), int(late_fin.sum()))
    late_sched = ~(out["first_scheduled_s"] <= cut_s)
    out.loc[late_sched, "first_scheduled_s"] = cut_s + 1e6 * (1 + rng.random(int(late_sched.sum())))
    return out


# ---------------------------------------------------------------- "known before t" aggregates


def _cum_before(ev_key: np.ndarray, ev_t: np.ndarray, ev_v: np.ndarray, q_key: np.ndarray, q_t: np.ndarray,
                want_max: bool = False):
    """Per query: count, sum (and max) of event values with the same key and time <= the query's time."""
    nq = len(q_key)
    if nq == 0:
        z = np.zeros(0)
        return (z, z, z) if want_max else (z, z)
    both = np.concatenate([ev_key, q_key])
    valid = both >= 0 if both.dtype.kind in "iu" else pd.notna(both)
    keys = np.where(valid, pd.factorize(both)[0], -1)
    t = np.concatenate([ev_t, q_t]).astype(float)
    kind = np.concatenate([np.zeros(len(ev_key)), np.ones(nq)])
    v = np.concatenate([ev_v.astype(float), np.zeros(nq)])
    order = np.lexsort((kind, t, keys))
    k_s, kind_s, v_s = keys[order], kind[order], v[order]
    is_ev = (kind_s == 0) & (k_s >= 0)
    frame = pd.DataFrame({"k": k_s, "c": is_ev.astype(float), "s": np.where(is_ev, v_s, 0.0)})
    g = frame.groupby("k", sort=False)
    cnt = g["c"].cumsum().to_numpy()
    tot = g["s"].cumsum().to_numpy()
    qpos = np.empty(nq, dtype=np.int64)
    is_q = kind_s == 1
    qpos[order[is_q] - len(ev_key)] = np.nonzero(is_q)[0]
    qvalid = valid[len(ev_key):]
    c_out = np.where(qvalid, cnt[qpos], 0.0)
    s_out = np.where(qvalid, tot[qpos], 0.0)
    if not want_max:
        return c_out, s_out
    frame["m"] = np.where(is_ev, v_s, -np.inf)
    mx = frame.groupby("k", sort=False)["m"].cummax().to_numpy()
    m_out = np.where(qvalid, mx[qpos], -np.inf)
    return c_out, s_out, np.where(np.isfinite(m_out), m_out, np.nan)


def _mean(c: np.ndarray, s: np.ndarray) -> np.ndarray:
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(c > 0, s / np.maximum(c, 1), np.nan)


def _keys(*cols: pd.Series) -> np.ndarray:
    """Integer keys of several columns together (-1 where the first column is null)."""
    code = pd.factorize(cols[0])[0].astype(np.int64)
    for c in cols[1:]:
        c2 = pd.factorize(c)[0].astype(np.int64) + 1
        code = np.where(code >= 0, pd.factorize(code * (int(c2.max()) + 1) + c2)[0], -1)
    return code


# ---------------------------------------------------------------- length features


def length_features(df: pd.DataFrame, at: str = "admit", vocab: Vocab | None = None) -> pd.DataFrame:
    """Length features of every request of ``df`` (from :func:`prepare_requests`) at its decision time.

    ``at`` is ``"arrival"`` or ``"admit"`` (first scheduled). Returns a frame in
    :data:`LENGTH_FEATURES` order with ``t``, ``y`` (log1p output tokens),
    ``output_tokens``, ``step``, ``domain_name``, ``pkey`` and ``request_id`` beside it.
    """
    t = df["arrival_s"].to_numpy(float) if at == "arrival" else df["first_scheduled_s"].to_numpy(float)
    done = df["done"].to_numpy()
    ev_t = np.where(done, df["finish_s"].to_numpy(float), np.inf)
    y = df["y"].to_numpy(float)
    out = pd.DataFrame(index=df.index)
    vocab = vocab or Vocab.fit(df, LENGTH_CATEGORICAL)
    for c in LENGTH_CATEGORICAL:
        out[c] = vocab.encode(c, df[c])
    out["prompt_tokens"] = df["prompt_tokens"].astype(float)
    out["turn"] = df["turn"].astype(float)
    # the session's first prompt arrived before (turns arrive in order), so it is known
    t0 = df.loc[(df["turn"] == 0) & df["session_id"].notna()]
    firsts = dict(zip(t0["session_id"], t0["prompt_tokens"].astype(float)))
    first_prompt = df["session_id"].map(firsts).to_numpy(float)
    out["context_growth"] = np.where(np.isnan(first_prompt), np.nan, df["prompt_tokens"].to_numpy(float) - first_prompt)
    out["max_tokens"] = df["max_tokens"].astype(float)
    out["group_size"] = df["group_size"].astype(float)
    gk = _keys(df["group_id"], df["turn"])
    c, s, m = _cum_before(gk, ev_t, y, gk, t, want_max=True)
    out["sib_n"], out["sib_mean"], out["sib_max"] = c, _mean(c, s), m
    g = df["group_id"].to_numpy(object)
    c, s = _cum_before(g, ev_t, y, g, t)
    out["grp_n"], out["grp_mean"] = c, _mean(c, s)
    sk = df["session_id"].to_numpy(object)
    c, s = _cum_before(sk, ev_t, y, sk, t)
    out["sess_mean"] = _mean(c, s)
    # earlier RL steps of the prompt: all finished uses of the prompt minus those of this step
    pk = df["pkey"].to_numpy(object)
    pks = _keys(df["pkey"], df["step"])
    c1, s1 = _cum_before(pk, ev_t, y, pk, t)
    c2, s2 = _cum_before(pks, ev_t, y, pks, t)
    out["hist_n"], out["hist_mean"] = c1 - c2, _mean(c1 - c2, s1 - s2)
    pkt = _keys(df["pkey"], df["turn"])
    pkts = _keys(df["pkey"], df["turn"], df["step"])
    c1, s1 = _cum_before(pkt, ev_t, y, pkt, t)
    c2, s2 = _cum_before(pkts, ev_t, y, pkts, t)
    out["hist_turn_mean"] = _mean(c1 - c2, s1 - s2)
    out = out[list(LENGTH_FEATURES)].astype(float)
    out["t"] = t
    out["y"] = y
    out["output_tokens"] = df["output_tokens"].to_numpy(float)
    out["step"] = df["step"].to_numpy()
    out["domain_name"] = df["domain"].astype(str).to_numpy()
    out["pkey"] = df["pkey"].to_numpy(object)
    out["request_id"] = df["request_id"].to_numpy(object)
    out["done"] = done
    return out


# ---------------------------------------------------------------- reuse features


def _edc_events(keys: np.ndarray, times: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Order events by (key, time); the decayed counters right after each event (one per half-life)."""
    order = np.lexsort((times, pd.factorize(keys)[0]))
    k, tt = pd.factorize(keys)[0][order], times[order]
    edc = np.zeros((len(k), len(EDC_HALF_LIVES_S)))
    rates = np.log(2) / np.asarray(EDC_HALF_LIVES_S)
    prev_k, prev_t, cur = -2, 0.0, np.zeros(len(rates))
    for i in range(len(k)):
        if k[i] != prev_k:
            cur = np.ones(len(rates))
        else:
            cur = 1.0 + cur * np.exp(-rates * (tt[i] - prev_t))
        edc[i] = cur
        prev_k, prev_t = k[i], tt[i]
    return order, edc, rates


def reuse_rows(df: pd.DataFrame, offsets: Sequence[float] = REUSE_OFFSETS_S, horizon_s: float = 10.0,
               vocab: Vocab | None = None, max_rows: int | None = None, seed: int = 0) -> pd.DataFrame:
    """Reuse snapshots (owner, t = finish + offset) with features, label ``hit`` within ``horizon_s`` and ``tnext``.

    Owners are finished (not aborted) requests with a sharing key; a snapshot at
    ``t`` is kept while ``t`` is before the last event of the log. ``max_rows``
    keeps a seeded random sample of the snapshots (before features are computed).
    """
    vocab = vocab or Vocab.fit(df, REUSE_CATEGORICAL)
    own = df[df["done"] & df["rkey"].notna()]
    end_of_log = float(np.nanmax(df[["arrival_s", "first_scheduled_s", "finish_s"]].to_numpy(float)))
    snaps = []
    for off in offsets:
        s = own.assign(t=own["finish_s"].to_numpy(float) + off)
        snaps.append(s[s["t"] <= end_of_log])
    snap = pd.concat(snaps, ignore_index=True)
    if max_rows is not None and len(snap) > max_rows:
        snap = snap.sample(n=max_rows, random_state=seed).sort_values("t", kind="stable").reset_index(drop=True)
    t = snap["t"].to_numpy(float)
    n = len(snap)
    out = pd.DataFrame(index=snap.index)
    out["domain"] = vocab.encode("domain", snap["domain"])
    out["finish_reason"] = snap["finish_reason"].map(FINISH_CODES).astype(float)
    out["tool"] = vocab.encode("tool", snap["tool"])
    out["n_blocks"] = snap["n_blocks"].astype(float)
    out["prompt_tokens"] = snap["prompt_tokens"].astype(float)
    out["turn"] = snap["turn"].astype(float)
    out["since_finish"] = t - snap["finish_s"].to_numpy(float)
    # uses of the key: first schedulings, sorted per key
    ukeys = df["rkey"].to_numpy(object)
    ut = df["first_scheduled_s"].to_numpy(float)
    ok = pd.notna(ukeys) & np.isfinite(ut)
    ukeys, ut, uid = ukeys[ok], ut[ok], df["request_id"].to_numpy(object)[ok]
    order, edc, rates = _edc_events(ukeys, ut)
    codes, uniq = pd.factorize(ukeys)
    k_sorted, t_sorted = codes[order], ut[order]
    id_sorted = uid[order]
    qk = pd.Index(uniq).get_indexer(snap["rkey"].to_numpy(object))
    # position of the last use <= t within the key's segment (lexicographic search on (key, time))
    seg_start = np.searchsorted(k_sorted, qk, side="left")
    seg_end = np.searchsorted(k_sorted, qk, side="right")
    # search t within each key's segment through a combined (key, time) sort key
    all_t = np.unique(np.concatenate([t_sorted, t]))
    stride = np.int64(len(all_t) + 1)
    comb_sorted = k_sorted.astype(np.int64) * stride + np.searchsorted(all_t, t_sorted)
    comb_q = qk.astype(np.int64) * stride + np.searchsorted(all_t, t)
    pos = np.searchsorted(comb_sorted, comb_q, side="right") - 1  # last use <= t
    has = (pos >= seg_start) & (qk >= 0)
    hits = np.where(has, pos - seg_start + 1, 0)
    out["hits"] = hits.astype(float)
    last = np.where(has, t_sorted[np.clip(pos, 0, None)], -np.inf)
    out["since_use"] = t - np.maximum(last, snap["finish_s"].to_numpy(float))
    prev = t.copy()
    for j in (1, 2, 3):
        p = pos - (j - 1)
        ok_j = has & (p >= seg_start)
        cur = np.where(ok_j, t_sorted[np.clip(p, 0, None)], np.nan)
        out[f"gap{j}"] = prev - cur
        prev = cur
    for i, hl in enumerate(EDC_HALF_LIVES_S):
        e = np.where(has, edc[np.clip(pos, 0, None), i] * np.exp(-rates[i] * (t - last)), 0.0)
        out[f"edc_{int(hl)}"] = e
    # owner state
    ak = df["rkey"].to_numpy(object)
    c_arr, _ = _cum_before(ak, df["arrival_s"].to_numpy(float), np.zeros(len(df)), snap["rkey"].to_numpy(object), t)
    c_sch, _ = _cum_before(ak, df["first_scheduled_s"].to_numpy(float), np.zeros(len(df)),
                           snap["rkey"].to_numpy(object), t)
    out["key_waiting"] = c_arr - c_sch
    rollout = df["domain"].astype(str) != "reward"
    first = df[rollout & (df["turn"] == 0)]
    gq = snap["group_id"].to_numpy(object)
    c_start, _ = _cum_before(first["group_id"].to_numpy(object), first["arrival_s"].to_numpy(float),
                             np.zeros(len(first)), gq, t)
    ends = df[rollout & df["finish_s"].notna() & (df["finish_reason"] != "tool_call")]
    c_end, _ = _cum_before(ends["group_id"].to_numpy(object), ends["finish_s"].to_numpy(float),
                           np.zeros(len(ends)), gq, t)
    out["grp_pending"] = c_start - c_end
    sess = df["session_id"].to_numpy(object)
    c_turns, _ = _cum_before(sess, df["arrival_s"].to_numpy(float), np.zeros(len(df)),
                             snap["session_id"].to_numpy(object), t)
    out["paused_tool"] = ((snap["finish_reason"] == "tool_call").to_numpy()
                          & (c_turns <= snap["turn"].to_numpy(float) + 1)).astype(float)
    out = out[list(REUSE_FEATURES)].astype(float)
    # label: next use by another request strictly after t
    nxt = pos + 1
    tnext = np.full(n, np.inf)
    owner_ids = snap["request_id"].to_numpy(object)
    # skip the owner's own scheduling (it is always <= t, so only later ones matter)
    valid = (qk >= 0) & (nxt < seg_end)
    idx = np.where(valid, nxt, 0)
    same = valid & (id_sorted[idx] == owner_ids)
    idx2 = np.where(same, idx + 1, idx)
    valid2 = valid & ~(same & (idx2 >= seg_end))
    tnext = np.where(valid2, t_sorted[np.clip(idx2, 0, len(t_sorted) - 1)] - t, np.inf)
    out["tnext"] = tnext
    out["hit"] = (tnext <= horizon_s).astype(float)
    out["t"] = t
    out["step"] = snap["step"].to_numpy()
    out["offset"] = out["since_finish"]
    out["request_id"] = owner_ids
    out["rkey"] = snap["rkey"].to_numpy(object)
    return out
