"""The hook's model from the MLflow registry: loaded at start-up, polled off the scheduler loop, swapped between steps.

:class:`ModelSource` resolves ``KVPILOT_MODEL_URI`` (default ``models:/kvpilot@champion``) to a registered
version, downloads its POLICY_DIR and builds the policy (which checks its schema versions and features) with
``policy.learned.policy.LearnedPolicy.load(dir, mode="serve")``. A poll (a background thread every
``KVPILOT_MODEL_POLL_S`` seconds, or :meth:`ModelSource.poll_now`) stages a new version when the alias
moved; it never touches the running policy. :class:`RegistryPolicy` is what the hook runs: it delegates
every decision to the current model and, called by the scheduler at the start of ``schedule()``
(:meth:`RegistryPolicy.swap_pending`), replaces that reference in one assignment, so no step mixes versions.
The scheduler then hands the old model's per-session state to the new one (:func:`carry_state`, the
:meth:`policy.interface.Policy.export_state` protocol): a state the new model cannot take is dropped, logged
and counted, and the new model starts afresh.

Every failure (no such model or alias, an unreachable registry, a corrupt or incompatible bundle) is logged
once per distinct cause, counted, and leaves the last good model in place; with none, the hook falls back to
vLLM's own behaviour (counted per step). Nothing here raises into the engine.
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

from policy.interface import (
    AdmissionDecision,
    CachedPrefix,
    CandidateRequest,
    EngineState,
    Event,
    EvictionDecision,
    Policy,
    PreemptionDecision,
    RetentionDecision,
)
from policy.vllm_default import VllmDefaultPolicy
from serving_hook.model_registry import (
    DEFAULT_MODEL_URI,
    ModelRef,
    RegistryError,
    RegistryUnreachable,
    fetch_policy_dir,
    resolve_version,
)

logger = logging.getLogger("kvpilot.hook")

DEFAULT_POLL_S = 60.0

_MLFLOW_HTTP = {"MLFLOW_HTTP_REQUEST_MAX_RETRIES": "1", "MLFLOW_HTTP_REQUEST_TIMEOUT": "10"}

#: Loads a POLICY_DIR into a policy; raises on a bad bundle.
Loader = Callable[[Path], Policy]


def model_uri(env: Optional[dict] = None) -> str:
    """``KVPILOT_MODEL_URI`` or the default ``models:/kvpilot@champion``."""
    env = os.environ if env is None else env
    return (env.get("KVPILOT_MODEL_URI") or "").strip() or DEFAULT_MODEL_URI


def learned_loader(policy_dir: Path) -> Policy:
    """D's ``LearnedPolicy.load(policy_dir, mode="serve")``."""
    from policy.learned.policy import LearnedPolicy

    return LearnedPolicy.load(policy_dir, mode="serve")


class ModelError(Exception):
    """Why a version could not be served; ``kind`` is missing / unreachable / download / schema / load.

    ``key`` names the distinct failure that is logged once: the version for a bad bundle, else the message.
    """

    def __init__(self, kind: str, message: str, key: Optional[str] = None) -> None:
        super().__init__(message)
        self.kind = kind
        self.key = f"{kind}:{key or message}"


@dataclass(frozen=True)
class LoadedModel:
    """A policy built from one registered version; ``policy.version`` is ``label``."""

    policy: Policy
    version: str  # the registry's version number
    label: str  # "kvpilot/3": what decisions telemetry records as policy_version


@dataclass
class SourceStats:
    loads: int = 0  # versions loaded (start-up and polls)
    polls: int = 0
    failures: dict = field(default_factory=dict)  # kind -> count (load and poll failures)
    failed: int = 0  # their sum (an int the engine thread reads while the poll thread counts)


class ModelSource:
    """Loads the registry's current version of ``uri``; stages new versions for the scheduler to take."""

    def __init__(self, uri: Optional[str] = None, loader: Loader = learned_loader) -> None:
        # A dead MLflow server must not hold engine start-up for minutes (MLflow's defaults: 7 retries with
        # back-off, 120 s timeouts); the poll retries anyway. Explicit settings win.
        for var, value in _MLFLOW_HTTP.items():
            os.environ.setdefault(var, value)
        self.uri = uri or model_uri()
        self.loader = loader
        self.stats = SourceStats()
        self._lock = threading.Lock()  # guards _pending
        self._poll_lock = threading.Lock()  # one poll at a time (the thread, poll_now)
        self._pending: Optional[LoadedModel] = None
        self._known: Optional[str] = None  # the newest version loaded (served or staged)
        self._bad: set[str] = set()  # versions that failed to load: immutable, never retried
        self._logged: set[str] = set()
        self._thread: Optional[threading.Thread] = None
        self._stop = threading.Event()

    # ------------------------------------------------------------ loading
    def load(self) -> Optional[LoadedModel]:
        """Resolve and load the version ``uri`` names now; ``None`` (logged once, counted) when it cannot."""
        try:
            version = self._resolve()
            if version == self._known or version in self._bad:
                return None
            loaded = self._build(version)
        except ModelError as e:
            self._failed(e)
            return None
        except Exception as e:  # never into the engine
            self._failed(ModelError("load", f"{self.uri}: {type(e).__name__}: {e}"))
            return None
        self._known = loaded.version
        self.stats.loads += 1
        logger.info("kvpilot: loaded %s (version %s) from the registry", self.uri, loaded.version)
        return loaded

    def _resolve(self) -> str:
        try:
            return str(resolve_version(self.uri).version)
        except RegistryUnreachable as e:
            raise ModelError("unreachable", str(e)) from None
        except RegistryError as e:
            raise ModelError("missing", str(e)) from None

    def _build(self, version: str) -> LoadedModel:
        name = ModelRef.parse(self.uri).name
        label = f"{name}/{version}"
        tmp = Path(tempfile.mkdtemp(prefix="kvpilot-model-"))
        try:
            try:
                policy_dir, _ = fetch_policy_dir(f"models:/{label}", tmp)
            except RegistryError as e:  # may be transient: retried at the next poll
                raise ModelError("download", str(e), key=label) from None
            try:
                policy = self.loader(policy_dir)
            except Exception as e:  # PolicyLoadError (a manifest of another schema, a corrupt file), anything else
                self._bad.add(version)
                msg = str(e)
                kind = "schema" if "this kvpilot" in msg else "load"  # PolicyLoadError's mismatch messages
                raise ModelError(kind, f"{label}: {type(e).__name__}: {msg}", key=label) from None
        finally:
            shutil.rmtree(tmp, ignore_errors=True)  # the policy holds what it needs in memory
        policy.version = label
        return LoadedModel(policy, version, label)

    def _failed(self, e: ModelError) -> None:
        f = self.stats.failures
        f[e.kind] = f.get(e.kind, 0) + 1
        self.stats.failed += 1
        if e.key not in self._logged:
            self._logged.add(e.key)
            logger.warning(
                "kvpilot: cannot serve %s (%s: %s); keeping the last good model, or vLLM's default behaviour "
                "without one. Logged once; repeats are only counted.",
                self.uri,
                e.kind,
                e,
            )

    # ------------------------------------------------------------ polling
    def poll_now(self) -> bool:
        """One poll: stage the version the alias names if it is new and loads; True when one was staged."""
        with self._poll_lock:
            self.stats.polls += 1
            loaded = self.load()
            if loaded is None:
                return False
            with self._lock:
                self._pending = loaded
            return True

    def take(self) -> Optional[LoadedModel]:
        """The staged model, if any (the scheduler calls this between steps)."""
        if self._pending is None:  # unlocked fast path: a stale read only delays the swap by one step
            return None
        with self._lock:
            loaded, self._pending = self._pending, None
        return loaded

    def start(self, interval_s: float) -> None:
        """Poll every ``interval_s`` seconds on a daemon thread (idempotent; 0 or less: no thread)."""
        if interval_s <= 0 or self._thread is not None:
            return
        self._stop.clear()
        self._thread = threading.Thread(target=self._run, args=(float(interval_s),), name="kvpilot-model-poll",
                                        daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        t, self._thread = self._thread, None
        if t is not None and t is not threading.current_thread():
            t.join(timeout=5.0)

    def _run(self, interval_s: float) -> None:
        while not self._stop.wait(interval_s):
            try:
                self.poll_now()
            except Exception as e:  # pragma: no cover - poll_now handles its own failures
                self._failed(ModelError("poll", repr(e)))


def carry_state(old: Policy, new: Policy) -> Optional[bool]:
    """Hand ``old``'s per-session state to ``new`` at a swap: True carried, False dropped (logged), None: none kept.

    Never raises: a failing export or import drops the state (``new`` starts afresh).
    """
    try:
        state = old.export_state()
        if state is None:
            return None
        new.import_state(state)
    except Exception as e:  # StateMismatch, or any bug in a policy's export/import: never into the engine
        logger.warning("kvpilot: the session state of %r was dropped at the swap to %r (%s: %s); the new model "
                       "starts without it", old, new, type(e).__name__, e)
        return False
    return True


class RegistryPolicy(Policy):
    """Serves the registry's model: delegates to the current version, swapped only by the scheduler.

    Declares the levers ``LearnedPolicy`` uses (the hook sets them up once, at start-up); a lever the
    current model does not use answers ``None`` (vLLM's behaviour). Without a model, :attr:`has_model` is
    false and the hook falls back for the step.
    """

    name = "registry"

    def __init__(self, uri: Optional[str] = None, loader: Loader = learned_loader) -> None:
        self.source = ModelSource(uri, loader)
        try:
            ModelRef.parse(self.source.uri)  # a malformed URI is a configuration error: fail at start-up
        except RegistryError as e:
            raise ValueError(f"KVPILOT_MODEL_URI / option uri: {e}") from None
        self.current: Policy = VllmDefaultPolicy()
        self.model_version: Optional[str] = None
        loaded = self.source.load()  # start-up: the first step already runs the champion
        if loaded is not None:
            self._install(loaded)
        # The hook sets its levers up once, at engine start: those LearnedPolicy declares (every version
        # is one), plus any the start-up model declares.
        for flag, on in zip(_LEVERS, _learned_levers()):
            setattr(self, flag, on or getattr(self.current, flag))
        # The CPU offload tier is part of the engine (serving: ``--kv-offloading-size``; the simulator builds it
        # for a policy that asks), and so is kvpilot's cache policy in it: the start-up model decides both, later
        # versions run over whatever the engine has (a version that does not order the tier answers None: LRU).
        self.uses_offload = bool(self.current.uses_offload)
        self.uses_host_eviction = bool(self.current.uses_host_eviction)

    @property
    def has_model(self) -> bool:
        return self.model_version is not None

    @property
    def version(self) -> str:  # type: ignore[override]
        return str(self.current.version)

    @property
    def decision_budget_s(self) -> Optional[float]:  # type: ignore[override]
        return self.current.decision_budget_s

    @property
    def max_eviction_candidates(self) -> Optional[int]:  # type: ignore[override]
        return self.current.max_eviction_candidates

    @property
    def lazy_candidates(self) -> bool:  # type: ignore[override]
        return self.current.lazy_candidates

    @property
    def session_contexts(self) -> Optional[Mapping[str, Mapping[str, float]]]:  # type: ignore[override]
        return self.current.session_contexts

    def swap_pending(self) -> bool:
        """Take a staged version, if any, and make it current (the scheduler calls this between steps)."""
        loaded = self.source.take()
        if loaded is None:
            return False
        self._install(loaded)
        return True

    def _install(self, loaded: LoadedModel) -> None:
        self.current = loaded.policy
        self.model_version = loaded.version
        logger.info("kvpilot: now serving %s", loaded.label)

    # -------------------------------------------------- delegated decisions
    def admit(self, waiting: Sequence[CandidateRequest], state: EngineState) -> Optional[AdmissionDecision]:
        p = self.current
        return p.admit(waiting, state) if p.uses_admission else None

    def preempt(self, running: Sequence[CandidateRequest], state: EngineState) -> Optional[PreemptionDecision]:
        p = self.current
        return p.preempt(running, state) if p.uses_preemption else None

    def retain(self, prefixes: Sequence[CachedPrefix], state: EngineState) -> Optional[RetentionDecision]:
        p = self.current
        return p.retain(prefixes, state) if p.uses_retention else None

    def evict(
        self, prefixes: Sequence[CachedPrefix], num_blocks_needed: int, state: EngineState
    ) -> Optional[EvictionDecision]:
        p = self.current
        return p.evict(prefixes, num_blocks_needed, state) if p.uses_eviction else None

    def evict_host(
        self, prefixes: Sequence[CachedPrefix], num_blocks_needed: int, state: EngineState
    ) -> Optional[EvictionDecision]:
        p = self.current
        return p.evict_host(prefixes, num_blocks_needed, state) if p.uses_host_eviction else None

    def on_event(self, event: Event) -> None:
        p = self.current
        if p.uses_events:
            p.on_event(event)


_LEVERS = ("uses_admission", "uses_preemption", "uses_retention", "uses_eviction", "uses_events")


def _learned_levers() -> tuple[bool, ...]:
    """The levers ``LearnedPolicy`` declares (every decision lever when it cannot be imported)."""
    try:
        from policy.learned.policy import LearnedPolicy
    except Exception:
        return True, True, True, True, False
    return tuple(bool(getattr(LearnedPolicy, f)) for f in _LEVERS)
