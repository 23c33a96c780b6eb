"""What policies ask of predictors: a response length and a prefix's next use.

Policies hold predictor objects and never know where the numbers come from:
the hindsight oracle (true values from the workload, for reference runs), the
per-domain running mean (a no-training baseline), or the LightGBM models of
:mod:`predictors` (a later issue) that implement the same two protocols.

Requests and prefixes are identified for oracles by ``(session_id, turn)`` from
their metadata, the key a workload row has too (``data.schemas.WORKLOAD``).
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional, Protocol

import pyarrow as pa

from policy.interface import CachedPrefix, CandidateRequest, Event, EventKind, RequestMeta

#: Returned when nothing is known; sorts last for shortest-first policies.
UNKNOWN = math.inf


def row_key(meta: RequestMeta) -> Optional[tuple[str, int]]:
    """The workload row a request's metadata points at, or None without a session."""
    if meta.session_id is None:
        return None
    return meta.session_id, meta.turn or 0


class LengthPredictor(Protocol):
    """Predicts a request's total response length in tokens (p50 and p90)."""

    def predict(self, requests: Sequence[CandidateRequest]) -> list[tuple[float, float]]: ...

    def observe(self, event: Event) -> None: ...


class ReusePredictor(Protocol):
    """Predicts when a cached prefix will next be used (absolute seconds; inf = never)."""

    def next_use_s(self, prefixes: Sequence[CachedPrefix], now_s: float) -> list[float]: ...

    def observe(self, event: Event) -> None: ...


class OracleLengthPredictor:
    """True output lengths from the workload: the hindsight reference, not deployable."""

    def __init__(self, lengths: Mapping[tuple[str, int], int]) -> None:
        self.lengths = dict(lengths)

    @classmethod
    def from_workload(cls, workload: pa.Table) -> "OracleLengthPredictor":
        cols = workload.select(["session_id", "turn", "output_tokens"]).to_pydict()
        return cls({(s, t): o for s, t, o in zip(cols["session_id"], cols["turn"], cols["output_tokens"])})

    def predict(self, requests: Sequence[CandidateRequest]) -> list[tuple[float, float]]:
        out = []
        for r in requests:
            key = row_key(r.meta)
            n = self.lengths.get(key) if key is not None else None
            out.append((float(n), float(n)) if n is not None else (UNKNOWN, UNKNOWN))
        return out

    def observe(self, event: Event) -> None:
        return None


class DomainMeanLengthPredictor:
    """The running mean (and p90 as mean + 1.28 sd) of finished lengths per domain.

    Needs no training and no workload; before a domain has finished anything it
    answers the mean over all domains, or ``prior`` tokens.
    """

    def __init__(self, prior: float = 512.0) -> None:
        self.prior = float(prior)
        self._n: dict[Optional[str], int] = defaultdict(int)
        self._sum: dict[Optional[str], float] = defaultdict(float)
        self._sq: dict[Optional[str], float] = defaultdict(float)

    def _stats(self, domain: Optional[str]) -> tuple[float, float]:
        key = domain if self._n.get(domain) else "__all__"
        n = self._n.get(key, 0)
        if not n:
            return self.prior, self.prior
        mean = self._sum[key] / n
        sd = math.sqrt(max(0.0, self._sq[key] / n - mean * mean))
        return mean, mean + 1.2816 * sd

    def predict(self, requests: Sequence[CandidateRequest]) -> list[tuple[float, float]]:
        return [self._stats(r.meta.domain) for r in requests]

    def observe(self, event: Event) -> None:
        if event.kind is not EventKind.FINISHED or event.finish_reason == "abort":
            return
        x = float(event.num_output_tokens)
        for key in (event.meta.domain, "__all__"):
            self._n[key] += 1
            self._sum[key] += x
            self._sq[key] += x * x


class OracleReusePredictor:
    """When each cached prefix is next used, from the workload: the hindsight reference, not deployable.

    **What "next use" means.** A prefix owned by the request of workload row
    ``(session, turn)`` is next used by the first request still to be
    scheduled whose hash chain (in the workload's own hash space) starts with
    the same leading block: a later turn of the same session (its context
    extends this one), a GRPO sibling (same prompt), or a reward-model scoring
    request of the trajectory (its prompt is the trajectory's context). The
    answer is the earliest estimated time among those requests, in the
    engine's clock; ``inf`` when none is left (or the prefix has no session
    metadata, or its row is not in the workload).

    **Estimating when a future request comes** (what can be known at
    decision time, with hindsight about the workload but not about the
    schedule):

    * already arrived and waiting (an ``ARRIVED`` or ``PREEMPTED`` event
      seen, not yet ``SCHEDULED`` again): *now*;
    * a session's turn ``j > 0``: its previous turn's finish time (from the
      ``FINISHED`` event) plus that turn's ``tool_latency_s`` from the
      workload, the exact moment the simulated tool returns. When the
      previous turn has not finished yet, the same estimate is chained from
      the last finished (or arrived) turn, counting only tool latencies:
      generation and queueing time are unknown in advance (they depend on the
      schedule), so this is a lower bound and far turns look nearer than they
      are;
    * a turn 0 not yet arrived: ``arrival_s`` from the workload when set
      (trace replay), else *now* (it is released with its RL step);
    * a scoring request: when the scored trajectory's last turn finishes
      (chained as above while it runs); the verifier's latency is ignored.

    Sharing is judged on the leading block only: a sibling that shares the
    prompt counts as a use of the whole prefix, although it hits only the
    prompt blocks. :meth:`observe` must see the hook's events (the policy
    forwards them), or every future request looks not yet arrived.
    """

    def __init__(self, rows: Mapping[tuple[str, int], Mapping]) -> None:
        #: (session, turn) -> {"lead", "kind", "tool_latency_s", "arrival_s", "scores"}
        self.rows: dict[tuple[str, int], Mapping] = dict(rows)
        self._sharers: dict[object, list[tuple[str, int]]] = defaultdict(list)
        self._last_turn: dict[str, int] = {}
        self._scorers: dict[str, list[tuple[str, int]]] = defaultdict(list)
        for key, r in self.rows.items():
            lead = r.get("lead")
            if lead is not None:
                self._sharers[lead].append(key)
            s, t = key
            if t > self._last_turn.get(s, -1):
                self._last_turn[s] = t
            if r.get("scores") is not None:
                self._scorers[r["scores"]].append(key)
        for keys in self._sharers.values():
            keys.sort(key=lambda k: (k[1], k[0]))
        #: lead -> the sharers not scheduled yet (scheduled ones leave, preempted ones come back),
        #: so a look-up scans only requests still to come
        self._pending: dict[object, list[tuple[str, int]]] = {k: list(v) for k, v in self._sharers.items()}
        self._waiting: set[tuple[str, int]] = set()  # arrived (or preempted), not scheduled
        self._scheduled: set[tuple[str, int]] = set()
        self._finished_at: dict[tuple[str, int], float] = {}

    @classmethod
    def from_workload(cls, workload: pa.Table) -> "OracleReusePredictor":
        names = set(workload.column_names)
        cols = workload.select(
            [c for c in ("session_id", "turn", "kind", "block_hashes", "tool_latency_s", "arrival_s",
                         "scores_session_id") if c in names]
        ).to_pydict()
        n = len(cols["session_id"])
        none = [None] * n
        rows = {}
        for i, (s, t) in enumerate(zip(cols["session_id"], cols["turn"])):
            hashes = cols.get("block_hashes", none)[i]
            rows[(s, int(t or 0))] = {
                "lead": hashes[0] if hashes else None,
                "kind": cols.get("kind", none)[i],
                "tool_latency_s": cols.get("tool_latency_s", none)[i],
                "arrival_s": cols.get("arrival_s", none)[i],
                "scores": cols.get("scores_session_id", none)[i],
            }
        return cls(rows)

    # ------------------------------------------------------------- estimates
    def _ready(self, key: tuple[str, int], now_s: float, depth: int = 0) -> float:
        """Estimated time the request of row ``key`` is (or was) ready to run."""
        if key in self._waiting:
            return now_s
        fin = self._finished_at.get(key)
        r = self.rows.get(key)
        if r is None or depth > 64:
            return now_s
        if r.get("scores") is not None:  # scoring: after the trajectory's last turn
            s2 = r["scores"]
            last = (s2, self._last_turn.get(s2, 0))
            f = self._finished_at.get(last)
            if f is not None:
                return max(now_s, f)
            return self._done(last, now_s, depth + 1)
        s, t = key
        if t == 0:
            a = r.get("arrival_s")
            return max(now_s, float(a)) if a is not None and math.isfinite(a) else now_s
        prev = (s, t - 1)
        pr = self.rows.get(prev)
        lat = float(pr.get("tool_latency_s") or 0.0) if pr is not None else 0.0
        f = self._finished_at.get(prev)
        if f is not None:
            return max(now_s, f + lat)
        if fin is not None:
            return now_s
        return self._done(prev, now_s, depth + 1) + lat

    def _done(self, key: tuple[str, int], now_s: float, depth: int) -> float:
        """Lower bound of when row ``key`` finishes (generation time unknown: counted as 0)."""
        f = self._finished_at.get(key)
        if f is not None:
            return f
        if key in self._scheduled:
            return now_s
        return self._ready(key, now_s, depth)

    def next_use_key(self, key: Optional[tuple[str, int]], now_s: float) -> float:
        """Next use (absolute seconds) of the prefix owned by workload row ``key``."""
        if key is None:
            return math.inf
        r = self.rows.get(key)
        if r is None:
            return math.inf
        lead = r.get("lead")
        users = self._pending.get(lead, ()) if lead is not None else ()
        best = math.inf
        for k2 in users:
            if k2 == key:
                continue
            t = self._ready(k2, now_s)
            if t < best:
                best = t
                if best <= now_s:
                    break
        return best

    def next_use_s(self, prefixes: Sequence[CachedPrefix], now_s: float) -> list[float]:
        """:meth:`next_use_key` of each prefix; the sharers of a leading block are scanned once per call."""
        soonest: dict[object, tuple[float, Optional[tuple[str, int]], float]] = {}
        out: list[float] = []
        for p in prefixes:
            key = row_key(p.meta)
            r = self.rows.get(key) if key is not None else None
            lead = r.get("lead") if r is not None else None
            if lead is None:
                out.append(math.inf)
                continue
            m = soonest.get(lead)
            if m is None:
                m = soonest[lead] = self._two_soonest(lead, now_s)
            out.append(m[2] if m[1] == key else m[0])
        return out

    def _two_soonest(self, lead: object, now_s: float) -> tuple[float, Optional[tuple[str, int]], float]:
        """(soonest ready time, its row, the next soonest time) among the pending sharers of ``lead``."""
        t1, k1, t2 = math.inf, None, math.inf
        for k2 in self._pending.get(lead, ()):
            t = self._ready(k2, now_s)
            if t < t1:
                t1, k1, t2 = t, k2, t1
            elif t < t2:
                t2 = t
            if t2 <= now_s:
                break
        return t1, k1, t2

    def observe(self, event: Event) -> None:
        key = row_key(event.meta)
        if key is None:
            return
        k = event.kind
        if k is EventKind.ARRIVED:
            if key not in self._scheduled:
                self._waiting.add(key)
        elif k is EventKind.SCHEDULED:
            self._waiting.discard(key)
            self._mark_scheduled(key)
        elif k is EventKind.PREEMPTED:  # it will need its prefix again
            self._waiting.add(key)
            if key in self._scheduled:
                self._scheduled.discard(key)
                r = self.rows.get(key)
                if r is not None and r.get("lead") is not None:
                    self._pending.setdefault(r["lead"], []).append(key)
        elif k is EventKind.FINISHED:
            self._waiting.discard(key)
            self._mark_scheduled(key)
            self._finished_at[key] = event.time_s

    def _mark_scheduled(self, key: tuple[str, int]) -> None:
        if key in self._scheduled:
            return
        self._scheduled.add(key)
        r = self.rows.get(key)
        if r is not None and r.get("lead") is not None:
            pend = self._pending.get(r["lead"])
            if pend is not None:
                try:
                    pend.remove(key)
                except ValueError:
                    pass


def _trained_length(d: Path) -> Any:
    from predictors.length import LengthModel  # LightGBM: only when a trained model is given

    return LengthModel.load(d)


def _trained_reuse(d: Path) -> Any:
    from predictors.reuse import ReuseModel

    return ReuseModel.load(d, num_threads=1)


@dataclass(frozen=True)
class PredictorOption:
    """What a policy option that names a predictor accepts (``length_predictor``, ``reuse_predictor``)."""

    option: str  # the option's name
    method: str  # the method a predictor object must have
    signature: str  # that method as a user writes it, for errors
    builders: Mapping[str, Callable[[Any], Any]]  # name -> build(workload); the workload is None in production
    hindsight: Mapping[str, str]  # names that read the future from the workload -> what they read from it
    production: str  # what to use in production instead of a hindsight name
    model: str = ""  # the trained model's directory name in a predictors directory ("" for none)
    load: Optional[Callable[[Path], Any]] = None  # loads that trained model from its directory


LENGTH_PREDICTOR = PredictorOption(
    option="length_predictor",
    method="predict",
    signature="predict(requests)",
    builders={"oracle": OracleLengthPredictor.from_workload, "domain-mean": lambda _: DomainMeanLengthPredictor()},
    hindsight={"oracle": "true output lengths; needs columns session_id, turn, output_tokens"},
    production="length_predictor='domain-mean' or a trained length model's directory",
    model="length",
    load=_trained_length,
)


class OnlineNextUse:
    """The online reuse model (:class:`predictors.online_reuse.OnlineReuseLearner`) as a reuse predictor that needs
    no workload: it learns from the run's events and from the prefixes it is asked about (LRB's online labels);
    before its first model every next use is ``inf`` (the policy's ties, LRU, decide)."""

    def __init__(self, **options: Any) -> None:
        from predictors.online_reuse import OnlineReuseLearner  # LightGBM: only when this predictor is used

        self.learner = OnlineReuseLearner(**options)

    def observe(self, event: Event) -> None:
        self.learner.observe(event)

    def next_use_s(self, prefixes: Sequence[CachedPrefix], now_s: float) -> list[float]:
        from data.records import tail_starts

        self.learner.observe_candidates(prefixes, tail_starts(prefixes), now_s)
        return self.learner.next_use_s(prefixes, now_s)


def _session_state(_: Any) -> Any:
    """``"session-state"``: :class:`policy.session_reuse.SessionStateNextUse` (imported when asked for, as the
    other predictors' models are)."""
    from policy.session_reuse import SessionStateNextUse

    return SessionStateNextUse()


def _auto_reuse(workload: Any) -> Any:
    """``"auto"``: the hindsight oracle where a simulated workload is given, else the online reuse model."""
    return OracleReusePredictor.from_workload(workload) if workload is not None else OnlineNextUse()


REUSE_PREDICTOR = PredictorOption(
    option="reuse_predictor",
    method="next_use_s",
    signature="next_use_s(prefixes, now_s)",
    builders={"auto": _auto_reuse, "oracle": OracleReusePredictor.from_workload, "online": lambda _: OnlineNextUse(),
              "session-state": _session_state},
    hindsight={"oracle": "future requests; needs columns session_id, turn, block_hashes"},
    production="reuse_predictor='online' (the default without a workload) or a trained reuse model's directory",
    model="reuse",
    load=_trained_reuse,
)


def _load_trained(kind: PredictorOption, d: Path, policy: str) -> Any:
    """The trained model in ``d``, or in ``d/<model>`` (a ``kvpilot train predictors`` or POLICY_DIR/predictors)."""
    if (d / kind.model).is_dir():
        d = d / kind.model
    try:
        return kind.load(d)
    except Exception as e:  # noqa: BLE001 - ModelSchemaError, missing or corrupt model files
        raise ValueError(f"{policy}: {kind.option} {str(d)!r}: cannot load a trained {kind.model} model: {e}") from e


def resolve_predictor(kind: PredictorOption, spec: Any, workload: Any = None, *, policy: str = "policy") -> Any:
    """The predictor an option names (or gives): a name of ``kind.builders``, or an object with ``kind.method``.

    A hindsight name (``"oracle"``) is built from ``workload``, the simulated workload table, and fails without
    one: in production nothing knows the future. Errors name the policy, the option and what it accepts.
    """
    names = ", ".join(kind.builders)
    if isinstance(spec, (str, Path)):
        name = str(spec).strip().lower()
        build = kind.builders.get(name)
        if build is None and kind.load is not None and Path(spec).is_dir():
            return _load_trained(kind, Path(spec), policy)
        if build is None:
            raise ValueError(f"{policy}: unknown {kind.option} {str(spec)!r}; use one of {names}, the directory of a "
                             f"trained {kind.model} model (or of the predictors holding it), or a predictor object")
        reads = kind.hindsight.get(name)
        if reads is None:
            return build(workload)
        if workload is None:
            raise ValueError(f"{policy}: {kind.option}={name!r} needs the simulated workload ({reads.split(';')[0]}), "
                             f"and none was given; in production use {kind.production}")
        try:
            return build(workload)
        except Exception as e:  # a table without the columns, or not a table
            raise ValueError(f"{policy}: cannot build the {name} {kind.option.replace('_', ' ')} from the workload "
                             f"({reads}): {e}") from e
    if spec is None or not callable(getattr(spec, kind.method, None)):
        raise TypeError(f"{policy}: {kind.option} must be one of {names} or an object with {kind.signature}, "
                        f"got {type(spec).__name__}")
    return spec

