"""``kvpilot replay --driver async``: the async driver's rollout controller as a real client of a real server.

It runs the workload's GRPO groups as :mod:`simulator.async_rl` does, against a vLLM OpenAI server:

* **Admission** is AReaL's capacity rule, FCFS over groups: with ``started`` groups so far and weight version
  ``v``, a group starts while ``started < (eta + v + 1) x B`` (``B``: the trainer's batch, by default the
  workload's groups per RL step). Nothing else is held in the client: the width is the hook's
  (:class:`policy.group_width.WidthHolds`), which sees each request's ``kvpilot_weight_version``.
* **The trainer** takes a batch as the simulated one does (:func:`simulator.async_rl.next_batch`: the lowest
  start versions first, never a batch that would push a group past ``eta``), sleeps its priced training time
  (:class:`simulator.config.Trainer`, on its roofline ``preset``, times ``time_scale``), then updates the weights.
* **A weight update** goes through the server's own endpoints (``VLLM_SERVER_DEV_MODE=1``): ``POST /pause``,
  the update's priced time slept, ``POST /resume``. ``keep``: ``/pause?mode=keep&clear_cache=false``, and every
  request carries ``cache_salt`` of its group's start version (a session keeps hitting its own blocks, other
  versions cannot share them); ``recompute``: ``/pause?mode=keep&clear_cache=true`` (vLLM preempts the running
  requests and drops the prefix cache); ``abort``: ``/pause?mode=abort``, and each aborted request is sent again
  after the resume with its prompt plus the tokens it had sampled (request id ``<id>#a<n>``).

``reprefill_tokens`` counts what updates throw away as the client sees it: for ``abort`` and ``recompute`` the
tokens of the requests in flight at the pause (prompt and the tokens streamed so far) and the context of the
sessions between turns (their cached blocks go with the cache); none for ``keep``.
"""

from __future__ import annotations

import asyncio
import functools
import time
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any, Optional

import httpx

from simulator.async_rl import grpo_groups, next_batch
from simulator.config import WEIGHT_SYNC_MODES, Trainer
from simulator.cost_model import CostModel
from training.replay import Replayer, ReplayError, Streamed, base_url

__all__ = ["AsyncReplay", "DEFAULT_TRAINER_PRESET", "TrainedReplayer", "trained_replayer"]

#: The roofline preset that prices the trainer of a replay (a training step, a weight update).
DEFAULT_TRAINER_PRESET = "H200-7B"


@dataclass(frozen=True)
class AsyncReplay:
    """A replay's RL controller: the trainer (None: synchronous steps without one; its ``preset`` defaults to
    :data:`DEFAULT_TRAINER_PRESET`) and, for ``driver`` "async", the staleness bound and weight-update mode."""

    driver: str = "sync"
    trainer: Optional[Trainer] = None
    staleness: int = 2
    weight_sync: str = "keep"

    def __post_init__(self) -> None:
        if self.driver not in ("sync", "async"):
            raise ReplayError(f"--driver must be sync or async, got {self.driver!r}")
        if self.driver == "async" and self.trainer is None:
            object.__setattr__(self, "trainer", Trainer())
        if self.trainer is not None and self.trainer.preset is None:
            object.__setattr__(self, "trainer", replace(self.trainer, preset=DEFAULT_TRAINER_PRESET))
        if not isinstance(self.staleness, int) or self.staleness < 0:
            raise ReplayError(f"--staleness must be an integer >= 0, got {self.staleness!r}")
        if self.weight_sync not in WEIGHT_SYNC_MODES:
            raise ReplayError(f"--weight-sync must be one of {', '.join(WEIGHT_SYNC_MODES)}, got {self.weight_sync!r}")

    def cost(self) -> CostModel:
        """The roofline cost model that prices the trainer."""
        return CostModel.preset(self.trainer.preset)


class _Group:
    """One GRPO group of the replay: its sessions, start version, finish order."""

    __slots__ = ("finish_seq", "index", "sessions", "version")

    def __init__(self, index: int, sessions: list[Any]) -> None:
        self.index, self.sessions, self.version, self.finish_seq = index, sessions, -1, 0


class TrainedReplayer(Replayer):
    """A replay with a trainer: synchronous steps each followed by a priced training step and weight update, or
    (``spec.driver`` "async") the asynchronous controller of the module docstring."""

    def __init__(self, *args: Any, spec: AsyncReplay) -> None:
        super().__init__(*args)
        if spec.driver == "async" and not self.cfg.stream:
            raise ReplayError("the async driver streams its answers (a weight update cuts them off): stream=True")
        self.spec = spec
        self.cost = spec.cost()
        w = self.w
        groups, first_step = grpo_groups(w, list(w.sessions))
        self.groups = [_Group(i, sessions) for i, sessions in enumerate(groups)]
        self.group_of = {s.session_id: g for g in self.groups for s in g.sessions}
        self.batch = spec.trainer.train_batch or first_step
        self.version = 0
        self.started = self.running = self._finished = 0
        self.ready: list[_Group] = []
        self.unconsumed: dict[int, _Group] = {}
        self.busy = False
        self.done = asyncio.Event()
        self.resumed = asyncio.Event()
        self.resumed.set()
        self.tasks: set[asyncio.Task] = set()
        self.live: dict[int, tuple[int, Streamed]] = {}  # row -> (its prompt's tokens, its answer so far)
        self.between: dict[str, int] = {}  # a session between turns -> its context
        self.last_turns = {s.turns[-1] for s in w.sessions}
        self.staleness: list[int] = []
        self.updates = self.reprefill_tokens = 0
        self.trained = 0
        self.train_s = 0.0

    # ------------------------------------------------------------------ requests
    def body(self, row: int) -> dict[str, Any]:
        body = super().body(row)
        if self.spec.driver == "async":
            v = self.group_of[self.w.session_id[row]].version if self.w.kind[row] == "rollout" else self.version
            body["vllm_xargs"]["kvpilot_weight_version"] = v
            if self.spec.weight_sync == "keep":
                body["cache_salt"] = f"kvpilot-v{v}"
        return body

    async def request(self, row: int) -> bool:
        """Send one row; under ``abort``, a request the update aborted is sent again after it with its tokens."""
        w = self.w
        out, sid = w.output_tokens[row], w.session_id[row]
        sampled: list[int] = []
        first: Optional[float] = None
        async with self.sem:
            t0 = time.perf_counter()
            self.between.pop(sid, None)
            for attempt in range(self.spec.staleness + len(self.groups) + 2):
                body = self.body(row)
                if sampled:
                    body["prompt"] = body["prompt"] + sampled
                    body["max_tokens"] = body["min_tokens"] = out - len(sampled)
                rid = w.request_id[row] + (f"#a{attempt}" if attempt else "")
                got = Streamed()
                self.live[row] = (len(body["prompt"]), got)
                updates = self.updates
                try:
                    await self.stream(body, {"X-Session-ID": sid, "X-Request-Id": rid}, got)
                except Exception as e:  # noqa: BLE001 -- one request's failure is counted, the replay goes on
                    self.fail(row, f"{type(e).__name__}: {e}")
                    return False
                finally:
                    self.live.pop(row, None)
                first = first if first is not None else got.first
                sampled += got.ids
                # cut off by an update: the stream says abort, or (cut before its first chunk) ended short while an
                # abort update came
                cut = got.finish_reason == "abort" or (self.spec.weight_sync == "abort" and (
                    self.updates != updates or not self.resumed.is_set()))
                if len(sampled) >= out or not cut:
                    break
                await self.resumed.wait()  # the update that aborted it ends first
            t1 = time.perf_counter()
        done = Streamed(sampled, first, got.finish_reason, got.usage)
        ok = self.record(row, done, t0, t1)
        if ok and row not in self.last_turns and w.kind[row] == "rollout":  # its session's next turn will come
            self.between[sid] = w.prompt_tokens[row] + out
        return ok

    # ------------------------------------------------------------------ the controller
    async def all_steps(self) -> None:
        if self.spec.driver == "sync":
            await super().all_steps()
            return
        self._admit()
        await self.done.wait()
        await asyncio.gather(*self.tasks)

    async def step_done(self, sessions: list) -> None:
        """Synchronous steps: the step's training and weight update (nothing in flight then)."""
        self.staleness += [0] * len(sessions)
        await self._train(sessions)
        await self.wait(self.spec.trainer.sync_s(self.cost))
        self.updates += 1

    def _spawn(self, coro: Any) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

    def _admit(self) -> None:
        """Start groups while AReaL's capacity rule allows, in workload order."""
        cap = min(len(self.groups), (self.spec.staleness + self.version + 1) * self.batch)
        while self.started < cap:
            g = self.groups[self.started]
            self.started += 1
            self.running += 1
            g.version = self.version
            self.unconsumed[g.index] = g
            self._spawn(self._group(g))

    async def _group(self, g: _Group) -> None:
        t0 = time.perf_counter()
        await asyncio.gather(*(self.trajectory(s.turns, s.scoring, t0) for s in g.sessions))
        self.running -= 1
        self._finished += 1
        g.finish_seq = self._finished
        self.ready.append(g)
        self._admit()
        self._try_train()

    def _try_train(self) -> None:
        """Start a training step if the trainer is free and a batch is ready; mark the end when all is trained."""
        if self.busy:
            return
        last = self.started == len(self.groups) and self.running == 0
        batch = next_batch(self.ready, list(self.unconsumed.values()), self.batch, self.spec.staleness,
                           self.version, last)
        if batch is None:
            if last and not self.unconsumed:
                self.done.set()
            return
        self.busy = True
        taken = {g.index for g in batch}
        self.ready = [g for g in self.ready if g.index not in taken]
        for i in taken:
            del self.unconsumed[i]
        self.staleness += [self.version - g.version for g in batch for _ in g.sessions]
        self._spawn(self._train_and_update([s for g in batch for s in g.sessions]))

    async def _train(self, sessions: list[Any]) -> None:
        """The training step's priced time on ``sessions`` (each trains on its last turn's prompt and output)."""
        w = self.w
        tokens = sum(w.prompt_tokens[s.turns[-1]] + w.output_tokens[s.turns[-1]] for s in sessions)
        seconds = self.spec.trainer.train_s(tokens, self.cost, 1)
        self.train_s += seconds
        self.trained += len(sessions)
        await self.wait(seconds)

    async def _train_and_update(self, sessions: list[Any]) -> None:
        await self._train(sessions)
        await self._update()
        self.version += 1
        self.busy = False
        self._admit()
        self._try_train()

    async def _update(self) -> None:
        """A weight update through the server's endpoints (see the module docstring)."""
        mode = self.spec.weight_sync
        self.updates += 1
        self.resumed.clear()
        query = {"keep": "mode=keep&clear_cache=false", "recompute": "mode=keep&clear_cache=true",
                 "abort": "mode=abort&clear_cache=true"}[mode]
        if mode != "keep":
            self.reprefill_tokens += sum(n + len(got.ids) for n, got in self.live.values())
            self.reprefill_tokens += sum(self.between.values())
        base = base_url(self.cfg.url)
        try:
            await self._post(f"{base}/pause?{query}")
            await self.wait(self.spec.trainer.sync_s(self.cost))
        finally:
            await self._post(f"{base}/resume")
            self.resumed.set()

    async def _post(self, url: str) -> None:
        try:
            resp = await self.client.post(url)
        except httpx.HTTPError as e:
            raise ReplayError(f"{url}: {type(e).__name__}: {e}") from None
        if resp.status_code != 200:
            raise ReplayError(f"{url}: HTTP {resp.status_code} ({resp.text[:200]}); the server needs "
                              "VLLM_SERVER_DEV_MODE=1 for its weight-update endpoints")

    def extra_summary(self, wall: float) -> dict[str, Any]:
        """The async summary keys the simulator reports, as this client measured them."""
        st = self.staleness
        out = {
            "driver": self.spec.driver,
            "staleness_eta": self.spec.staleness if self.spec.driver == "async" else None,
            "weight_sync": self.spec.weight_sync if self.spec.driver == "async" else None,
            "trainer_preset": self.spec.trainer.preset,
            "trained_trajectories": self.trained,
            "trajectories_per_s": self.trained / wall if wall > 0 else 0.0,
            "max_staleness": max(st, default=0),
            "mean_staleness": sum(st) / len(st) if st else 0.0,
            "weight_updates": self.updates,
            "reprefill_tokens": self.reprefill_tokens,
            "reprefill_tokens_per_update": self.reprefill_tokens / self.updates if self.updates else 0.0,
            "train_s": self.train_s * self.cfg.time_scale,
        }
        out["trainer_line"] = _describe(out)
        return out


def trained_replayer(spec: AsyncReplay) -> Any:
    """The replayer class argument of :func:`training.replay.replay` for ``spec``'s trainer and driver."""
    return functools.partial(TrainedReplayer, spec=spec)


def _describe(summary: Mapping[str, Any]) -> str:
    """The trainer's line of the rendered summary."""
    async_part = (f", eta {summary['staleness_eta']} {summary['weight_sync']}: max staleness "
                  f"{summary['max_staleness']}, {summary['reprefill_tokens_per_update']:.0f} tokens re-prefilled per "
                  "update" if summary["driver"] == "async" else "")
    return (f"trained             {summary['trained_trajectories']} trajectories, "
            f"{summary['trajectories_per_s']:.4g}/s ({summary['driver']}{async_part})")
