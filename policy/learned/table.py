"""The learned policies' per-request input table: a row is computed when its request changes, not in every step.

Reading ~20 values of each of hundreds of candidate objects into numpy in every
engine step cost more than vLLM's ``schedule()`` itself. :class:`FeatureTable`
keeps one row per request instead: its :func:`policy.learned.features.row_features`
(and length predictions) are computed when the request is first seen and again
only after an event marks it changed (it was scheduled or preempted, or a
sibling of its group was scheduled, preempted or finished: the group counters
and the length prediction change then). Per step it fills, vectorised, only the
columns that change in every step (wait time, engine state, RL step phase) and
the candidate-set columns, so the scorer's input equals
``model_features(candidate_raw(...))`` (a test checks it through the real
scheduler). An order by predicted remaining output alone (the learned policy's default admission, the
exploring policy's) reads that one column through :meth:`FeatureTable.remaining`, which refreshes changed rows
without their other features (they are recomputed when :meth:`FeatureTable.features` next needs them).

Until the table has received an event (a policy used outside the hook), and for
running candidates (their tokens change in every step), every row is refreshed
from the candidates in each call. It also keeps the starvation clock (when each
waiting request (re-)entered the queue) and which waiting requests were preempted: both go before the scored
order (:meth:`FeatureTable.first`).

A :class:`policy.interface.CandidateView` (the hook's candidates built on demand) is read by its ids; only
the candidates whose rows are new or changed are built. At a hot swap :meth:`FeatureTable.export_state`
hands the event-derived part (which requests have rows, their groups, RL steps and starvation clocks) to the
successor's table (:meth:`FeatureTable.import_state`), which recomputes every row's features with its own
predictor when the request is next offered.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Optional

import numpy as np

from policy.interface import CandidateRequest, CandidateView, EngineState, Event, EventKind
from policy.learned.features import (
    FEATURES,
    USAGE_X,
    WAIT_X,
    R,
    light_values,
    log_remaining,
    row_features,
    set_features,
    step_features,
)
from policy.learned.group_age import GroupAges
from policy.learned.shortest_first import MAX_TAKE, compiled_shortest_first
from policy.learned.sorting import first_come

_WAIT, _RUNNING, _P50, _P90 = R["wait_s"], R["is_running"], R["pred_p50"], R["pred_p90"]
_PREEMPTIONS = R["preemptions"]
# (plain names: cheaper)
_SCHEDULED, _PREEMPTED, _FINISHED = EventKind.SCHEDULED, EventKind.PREEMPTED, EventKind.FINISHED
_ARRIVED = EventKind.ARRIVED
#: The per-row arrays that start as NaN (unknown).
_NAN_COLUMNS = ("p50", "p90", "since_step", "since_s")
#: Column offsets of one row of ``FeatureTable.x`` in its flat view.
_COLUMNS = np.arange(len(FEATURES))
#: Rows beyond which a table that receives no FINISHED events starts afresh.
MAX_ROWS = 1 << 17


@dataclass(frozen=True)
class TableState:
    """A table's event-derived part (:meth:`FeatureTable.export_state`): row ids, groups, RL steps, clocks."""

    rows: dict[str, int]
    members: dict[str, set[str]]
    group: dict[str, Optional[str]]
    free: list[int]
    arrival: np.ndarray
    running: np.ndarray
    step: np.ndarray
    since_step: np.ndarray
    since_s: np.ndarray
    steps: dict[Optional[int], int]
    tracking: bool
    age: np.ndarray
    ages: GroupAges


def engine_raw(state: EngineState) -> tuple[float, float, int, int]:
    """The engine-state inputs shared by every row (kv_usage, pinned fraction, running, waiting), before
    :func:`policy.learned.features.step_features` transforms them."""
    return (state.kv_usage, state.num_pinned_blocks / max(state.num_total_blocks, 1), state.num_running,
            state.num_waiting)


def _take(cands: Sequence[CandidateRequest], positions: list[int]) -> Sequence[CandidateRequest]:
    """The candidates at ``positions`` (a view builds them in one pass)."""
    return cands.take(positions) if isinstance(cands, CandidateView) else [cands[i] for i in positions]


def _ids_of(cands: Sequence[CandidateRequest]) -> tuple:
    """The candidates' request ids: a view's tuple is the same object while the requests are (then no comparison
    at all)."""
    return tuple(cands.request_ids) if isinstance(cands, CandidateView) else tuple([c.request_id for c in cands])


class FeatureTable:
    """Rows of per-request features keyed by request id; :meth:`features` assembles one decision's scorer input."""

    def __init__(self, raw_of: Callable[[Sequence[CandidateRequest], EngineState], np.ndarray],
                 phase_of: Callable[[Optional[int]], float], max_wait_steps: Optional[float],
                 max_wait_s: Optional[float], resume_preempted: bool = True, capacity: int = 256,
                 preds_of: Optional[Callable[[Sequence[CandidateRequest]], list]] = None) -> None:
        #: (candidates, state) -> their raw matrix (length predictions included)
        self.raw_of = raw_of
        #: candidates -> their (p50, p90) length predictions, as ``raw_of`` puts them in; with it, :meth:`remaining`
        #: refreshes rows without the raw matrix (:func:`policy.learned.features.light_values`)
        self.preds_of = preds_of
        self.phase_of = phase_of
        self.max_wait_steps = math.inf if max_wait_steps is None else float(max_wait_steps)
        self.max_wait_s = math.inf if max_wait_s is None else float(max_wait_s)
        self.resume_preempted = bool(resume_preempted)
        self.tracking = False  # set by the first event: from then on, rows change only on events
        self._shortest_first = compiled_shortest_first()  # (None without numba: shortest() answers None)
        self._alloc(capacity)

    def _alloc(self, cap: int) -> None:
        self.rows: dict[str, int] = {}
        self.members: dict[str, set[str]] = {}  # group id -> request ids with a row
        self.group: dict[str, Optional[str]] = {}  # request id -> group id
        self.free: list[int] = list(range(cap - 1, -1, -1))
        self.x = np.zeros((cap, len(FEATURES)))  # row_features
        self.lr = np.zeros(cap)  # log1p(predicted remaining output)
        self.arrival = np.zeros(cap)
        self.running = np.zeros(cap, dtype=bool)
        self.preempted = np.zeros(cap, dtype=bool)  # waiting again after a preemption
        self.sibling = np.zeros(cap, dtype=bool)  # a request of its GRPO group runs (group_running_frac > 0)
        # Per-row values live in 1-d arrays: numpy gathers and scatters rows of a 2-d array with the GIL released
        # (policy.learned.sorting says what that costs inside vLLM's engine core), and 1-d ones with it kept.
        self.p50 = np.full(cap, math.nan)  # length predictions
        self.p90 = np.full(cap, math.nan)
        self.step = np.zeros(cap, dtype=np.int64)  # index into self.steps
        self.age = np.zeros(cap)  # its group's rank in start order under async RL, else 0 (policy.learned.group_age)
        self.ages: GroupAges = getattr(self, "ages", None) or GroupAges()  # (kept when the table starts afresh)
        self.aged_rows = 0  # rows with a group age: their requests carry weight versions (asynchronous RL)
        self.since_step = np.full(cap, math.nan)  # the engine step and the time it (re-)entered the queue
        self.since_s = np.full(cap, math.nan)
        self.dirty = np.zeros(cap, dtype=bool)
        self.light = np.zeros(cap, dtype=bool)  # filled by :meth:`remaining`: ``x`` not computed
        self._light = False  # a row may be light since :meth:`features` last looked
        self.steps: dict[Optional[int], int] = {}  # RL step -> index
        self._ids: Optional[tuple] = None  # the last call's candidates' ids, and their rows
        self._idx = np.empty(0, dtype=np.int64)
        self.request_ids: tuple = ()  # the last call's candidates' ids
        self._x_idx: Optional[np.ndarray] = None  # the rows of the last assembled input (see _assemble)
        self._clock_idx: Optional[np.ndarray] = None  # the rows whose oldest queue entry is cached
        self._none = self._preempted = np.empty(0, dtype=np.int64)  # positions of the last input's preempted rows
        self._rem: Optional[tuple[np.ndarray, np.ndarray]] = None  # :meth:`remaining`'s last rows and answer
        self.youngest = -math.inf

    @property
    def aged(self) -> bool:
        """Some live row has a group age: its request carries a weight version (asynchronous RL)."""
        return self.aged_rows > 0

    def _grow(self) -> None:
        cap = len(self.x)
        for name in ("x", "lr", "arrival", "running", "preempted", "sibling", "p50", "p90", "step", "age", "since_step",
                     "since_s", "dirty", "light"):
            a = getattr(self, name)
            b = np.full((2 * cap,) + a.shape[1:], math.nan) if name in _NAN_COLUMNS else \
                np.zeros((2 * cap,) + a.shape[1:], dtype=a.dtype)
            b[:cap] = a
            setattr(self, name, b)
        self.free.extend(range(2 * cap - 1, cap - 1, -1))

    # ------------------------------------------------------------------ events
    def observe(self, event: Event) -> None:
        """Mark the rows an event changes: the request's own, and its group's (counters, length prediction)."""
        self.tracking = True
        kind = event.kind
        if kind is _ARRIVED:  # a group's age counts from its first arrival (admitted or not, offered or not)
            if event.meta.weight_version is not None:
                self.ages.rank(event.meta)
            return
        if kind is not _SCHEDULED and kind is not _PREEMPTED and kind is not _FINISHED:
            return
        rid = event.request_id
        row = self.rows.get(rid)
        self._ids = None  # the next call looks for dirty rows among its candidates
        if kind is _FINISHED:
            if row is not None:
                self._drop(rid, row)
        elif row is not None:
            self.dirty[row] = True
            if kind is _SCHEDULED:
                self.since_step[row] = self.since_s[row] = math.nan
                self._clock_idx = None
        gid = event.meta.group_id
        if gid is not None:
            rows = self.rows
            for sib in self.members.get(gid, ()):
                self.dirty[rows[sib]] = True

    def _drop(self, rid: str, row: int) -> None:
        del self.rows[rid]
        if self.age[row]:
            self.age[row] = 0.0
            self.aged_rows -= 1
        gid = self.group.pop(rid)
        if gid is not None:
            m = self.members[gid]
            m.discard(rid)
            if not m:
                del self.members[gid]
        self.free.append(row)

    # ------------------------------------------------------------------ rows
    def _rows(self, cands: Sequence[CandidateRequest], ids: tuple) -> np.ndarray:
        """Each candidate's row (new rows are allocated, marked dirty); ``ids``: the candidates' request ids."""
        if len(self.rows) + len(ids) > MAX_ROWS:
            self._alloc(len(self.x))
        rows = self.rows
        get = rows.get
        idx = [get(rid, -1) for rid in ids]
        # the new requests, found by scans in C (most calls have one or two among hundreds)
        i = idx.index(-1) if -1 in idx else -1
        while i >= 0:
            c = cands[i]
            if not self.free:
                self._grow()
            r = idx[i] = rows[c.request_id] = self.free.pop()
            meta = c.meta
            gid = meta.group_id
            self.group[c.request_id] = gid
            if gid is not None:
                self.members.setdefault(gid, set()).add(c.request_id)
            age = self.age[r] = self.ages.rank(meta)
            self.aged_rows += age > 0
            self.dirty[r] = True
            self.light[r] = False
            self.since_step[r] = self.since_s[r] = math.nan
            try:
                i = idx.index(-1, i + 1)
            except ValueError:
                break
        self._ids = ids
        self._idx = np.asarray(idx, dtype=np.int64)
        self.request_ids = ids
        return self._idx

    def _fill(self, cands: Sequence[CandidateRequest], rows: np.ndarray, state: EngineState,
              light: bool = False) -> Optional[np.ndarray]:
        """Recompute ``rows`` from ``cands``; ``light``: all but their feature columns (:meth:`remaining`). Their raw
        matrix, None when a light refill read the candidates directly."""
        raw = None
        if light and self.preds_of is not None:
            preds = self.preds_of(cands)
            lr, running, preempted = light_values(cands, preds)
            self.running[rows] = running
            self.preempted[rows] = preempted
            self.p50[rows] = [p[0] for p in preds]
            self.p90[rows] = [p[1] for p in preds]
        else:
            raw = self.raw_of(cands, state)
            if light:
                lr = log_remaining(raw)
            else:
                x, lr = row_features(raw)
                # one 1-d scatter: numpy scatters rows of a 2-d array with the GIL released (policy.learned.sorting)
                self.x.reshape(-1)[(np.asarray(rows)[:, None] * len(FEATURES) + _COLUMNS).ravel()] = x.ravel()
            self.running[rows] = raw[:, _RUNNING] > 0
            # a waiting request with a preemption was preempted in this turn (only a preemption sends one back)
            self.preempted[rows] = (raw[:, _PREEMPTIONS] > 0) & ~self.running[rows]
            self.p50[rows] = raw[:, _P50]
            self.p90[rows] = raw[:, _P90]
        self.sibling[rows] = [c.group_running > 0 and (c.meta.group_size or 0) > 0 for c in cands]
        self._light |= light
        self.light[rows] = light
        self.lr[rows] = lr
        self.arrival[rows] = [c.arrival_s for c in cands]
        steps = self.steps
        self.step[rows] = [steps.setdefault(c.meta.step, len(steps)) for c in cands]
        self.dirty[rows] = False
        self._x_idx = self._clock_idx = self._rem = None
        return raw

    def features(self, cands: Sequence[CandidateRequest], state: EngineState,
                 refresh: bool = False) -> tuple[np.ndarray, np.ndarray]:
        """The (n, len(FEATURES)) float32 scorer input of a decision (valid until the next call), and the rows.

        ``refresh``: refill every row from the candidates (running candidates change in every step).
        """
        ids = _ids_of(cands)
        prev = self._ids
        cached = prev is not None and (prev is ids or prev == ids)  # no event since: the same rows, none dirty
        idx = self._idx if cached else self._rows(cands, ids)
        if refresh or not self.tracking:
            raw = self._fill(cands, idx, state)
            wait = raw[:, _WAIT]
        else:
            if not cached or self._light:  # (no event since the last call: its rows are clean, unless light)
                need = np.flatnonzero(self.dirty[idx] | self.light[idx])
                self._light = False
                if need.size:
                    self._fill(_take(cands, need.tolist()), idx[need], state)
            wait = None
        if idx is not self._x_idx:  # rows and set columns of the last call are no longer valid
            self._assemble(idx)
        x = self._x
        if wait is None:
            # step_features' wait column, in place (no temporaries: this runs in every engine step)
            buf = self._wait
            np.subtract(state.time_s, self._arrival, out=buf)  # -inf (clipped to 0) for running requests
            np.fmax(buf, 0.0, out=buf)
            np.log1p(buf, out=x[:, WAIT_X])
        eng = engine_raw(state)
        last = self._eng
        if eng != last and last is not None and eng[2:] == last[2:]:
            # only the usage fractions changed (the usual step): step_features' fmax(v, 0) on two scalars
            x[:, USAGE_X] = tuple(v if v >= 0.0 else 0.0 for v in eng[:2])
            last = eng
        phases = [self.phase_of(s) for s in self.steps]
        # the columns of the cached input that did not change since the last call are left as they are
        step_features(x, wait, eng if eng != last else None,
                      np.array(phases)[self._step] if phases != self._phases else None)
        self._eng, self._phases = eng, phases
        return x, idx

    def remaining(self, cands: Sequence[CandidateRequest], state: EngineState,
                  refresh: bool = False) -> tuple[np.ndarray, np.ndarray]:
        """Each candidate's predicted remaining output (valid until the next call), and the rows.

        The value :meth:`features`' ``log_pred_remaining`` column gives (float32, as the scorer reads it), with no
        other column computed: an order by predicted remaining needs no scorer input (rows refreshed here are
        marked light, and :meth:`features` recomputes them when it needs them). ``refresh`` as for :meth:`features`.
        """
        idx = self._refreshed(cands, state, refresh)
        last = self._rem
        if last is None or last[0] is not idx:
            last = self._rem = (idx, np.expm1(self.lr[idx].astype(np.float32).astype(np.float64)))
            self._preempted = np.flatnonzero(self.preempted[idx]) if self.resume_preempted else self._none
            self._x_idx = None  # (features' cached input assumes its own rows' preempted positions)
        return last[1], idx

    def _refreshed(self, cands: Sequence[CandidateRequest], state: EngineState, refresh: bool = False) -> np.ndarray:
        """The candidates' rows, the new and changed ones refilled light (see :meth:`remaining`)."""
        ids = _ids_of(cands)
        prev = self._ids
        cached = prev is not None and (prev is ids or prev == ids)
        idx = self._idx if cached else self._rows(cands, ids)
        if refresh or not self.tracking:
            self._fill(cands, idx, state, light=True)
        elif not cached:
            need = np.flatnonzero(self.dirty[idx])
            if need.size:
                self._fill(_take(cands, need.tolist()), idx[need], state, light=True)
        return idx

    def shortest(self, cands: Sequence[CandidateRequest], state: EngineState, take: int,
                 by_age: bool = False) -> Optional[list[int]]:
        """The places of the ``take`` waiting candidates with the least predicted remaining output, least first, the
        queue's order breaking ties: the order :meth:`remaining`, :meth:`first` and a sort give when nobody goes
        first, in one compiled pass (:mod:`policy.learned.shortest_first`). None where a preempted or starved candidate
        goes first, where ``by_age`` and a row has a group age (:attr:`aged`: the oldest group goes first), or
        where the order is long: the caller takes the numpy path (the rows are refreshed, the clocks kept)."""
        idx = self._refreshed(cands, state)
        take = min(take, len(idx))
        kernel = self._shortest_first
        if kernel is None or take > MAX_TAKE or (by_age and self.aged):
            return None
        top, oldest = np.empty(take, np.int64), np.empty(2)
        got = kernel(idx, self.lr, self.preempted, self.since_step, self.since_s, float(state.engine_step),
                     state.time_s, self.max_wait_steps, self.max_wait_s, self.resume_preempted, top, np.empty(take),
                     oldest)
        self._rem = self._x_idx = None  # (what remaining() keeps for its next call, and features' cached input)
        if got < 0:
            self._clock_idx = None  # (first() reads every clock again)
            return None
        self._clock_idx, self._oldest = idx, (float(oldest[0]), float(oldest[1]))
        self._preempted = self._none
        return top[:got].tolist()

    def unchanged(self, cands: Sequence[CandidateRequest]) -> bool:
        """True when the last :meth:`features` call's rows stand for ``cands``: the same requests, no event since,
        rows tracked by events; then only its step columns (wait times, engine state) would change."""
        prev = self._ids
        if prev is None or not self.tracking or self._x_idx is not self._idx:
            return False
        ids = _ids_of(cands)
        return prev is ids or prev == ids

    def _assemble(self, idx: np.ndarray) -> None:
        """Cache what stays fixed while the rows do: their features, set columns, arrival times and RL steps."""
        x = self.x[idx]
        set_features(x, self.lr[idx])
        self._x = x.astype(np.float32)
        self._x_idx = idx
        self._arrival = np.where(self.running[idx], math.inf, self.arrival[idx])
        #: the latest arrival among the waiting rows (the row whose wait feature moves fastest), -inf if none
        self.youngest = float(np.max(self._arrival, where=~self.running[idx], initial=-math.inf))
        self._step = self.step[idx]
        self._preempted = np.flatnonzero(self.preempted[idx]) if self.resume_preempted else self._none
        self._wait = np.empty(len(idx))  # features' buffer for the wait times
        self._eng = self._phases = None  # step columns not filled yet
        self._rem = None  # (remaining's preempted positions are no longer set)

    def predictions(self, idx: np.ndarray) -> list[tuple[float, float]]:
        """(p50, p90) of each row."""
        return list(zip(self.p50[idx].tolist(), self.p90[idx].tolist()))

    # ------------------------------------------------------------------ hot swap
    def export_state(self) -> TableState:
        """The event-derived part, for a successor's table (this table is not used afterwards)."""
        return TableState(self.rows, self.members, self.group, self.free, self.arrival, self.running, self.step,
                          self.since_step, self.since_s, self.steps, self.tracking, self.age, self.ages)

    def import_state(self, st: TableState) -> None:
        """Take a predecessor's rows over; their features are recomputed (this table's predictor) when next offered."""
        if not isinstance(st, TableState):
            raise TypeError(f"expected a TableState, got {type(st).__name__}")
        cap = len(st.since_step)
        self._alloc(cap)
        self.rows, self.members, self.group, self.free = st.rows, st.members, st.group, st.free
        self.arrival, self.running, self.step = st.arrival, st.running, st.step
        self.since_step, self.since_s = st.since_step, st.since_s
        self.steps, self.tracking = st.steps, st.tracking
        self.age, self.ages = st.age, st.ages
        self.aged_rows = int(np.count_nonzero(st.age))  # (freed rows' ages are zeroed)
        self.dirty[:] = True

    # ------------------------------------------------------------------ precedence
    def first(self, idx: np.ndarray, state: EngineState) -> list[int]:
        """Positions (in ``idx``, the last :meth:`features` call's rows) that go before the scored order.

        The preempted requests first, as vLLM puts them back at the head of its queue (a learned order that let
        one wait behind fresh work until the starvation bound stretched its session by minutes), then the
        starved ones; each FCFS by the time it (re-)entered the queue.
        """
        starved = self._starved(idx, state)
        pre = self._preempted
        if not pre.size:
            return starved
        rows = idx[pre]
        first = first_come(pre, self.since_step[rows], self.since_s[rows])
        if starved:
            taken = set(first)
            first += [p for p in starved if p not in taken]
        return first

    def _starved(self, idx: np.ndarray, state: EngineState) -> list[int]:
        """Positions (in ``idx``) of the requests waiting for ``max_wait_steps`` steps or ``max_wait_s`` seconds
        since they (re-)entered the queue, FCFS by that time; the clock of a request starts at its first sight."""
        now = (state.engine_step, state.time_s)
        if idx is not self._clock_idx:
            self._start_clocks(idx, now)
        step0, t0 = self._oldest
        if now[0] - step0 < self.max_wait_steps and now[1] - t0 < self.max_wait_s:
            return []
        steps, times = self.since_step[idx], self.since_s[idx]
        pos = np.flatnonzero((now[0] - steps >= self.max_wait_steps) | (now[1] - times >= self.max_wait_s))
        return first_come(pos, steps[pos], times[pos])

    def _start_clocks(self, idx: np.ndarray, now: tuple[int, float]) -> None:
        """Start the clock of the rows that have none; cache the oldest start of ``idx``."""
        steps, times = self.since_step[idx], self.since_s[idx]
        unset = np.isnan(steps)
        if unset.any():
            steps[unset], times[unset] = now
            rows = idx[unset]
            self.since_step[rows], self.since_s[rows] = now
        self._oldest = (steps.min(initial=math.inf), times.min(initial=math.inf))
        self._clock_idx = idx
