"""A simulation's configuration: every option of a run, its defaults, and its checks before anything runs.

:class:`SimConfig` holds what :func:`simulator.simulation.run_simulation` takes
beside the workload; a bad value raises :class:`SimulationError` when the
configuration is made. What depends on the workload too (the policy, which a
hindsight oracle builds from it; the KV size against its largest request) is
checked by the methods that resolve it, still before anything runs.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from policy.interface import Policy
from simulator.cost_model import CostModel
from simulator.errors import SimulationError
from simulator.fitted_cost import StepCost, engine_limits, load_cost
from simulator.routers import Router, make_router
from simulator.sizing import blocks_for_fraction, min_blocks_for
from simulator.tokens import VLLM_BLOCK_SIZE

if TYPE_CHECKING:
    from simulator.workload import PreparedWorkload

__all__ = ["ADMISSIONS", "DRIVERS", "SIM_DECISION_BUDGET_S", "WEIGHT_SYNC_MODES", "AsyncRL", "Overprovision",
           "PolicySpec", "SimConfig", "SimulationError", "Trainer", "check_choice"]

#: A policy: a catalog name, a zero-argument factory, or (one replica) an instance.
PolicySpec = str | Callable[[], Policy] | Policy

#: The hook's per-step policy budget in simulation. The serving default (5 ms of
#: wall time) would make runs depend on this machine's load and GC pauses; a
#: simulation measures decisions in simulated time, and benchmarks/bench_hook.py
#: measures their wall-clock cost.
SIM_DECISION_BUDGET_S = 1.0


@dataclass(frozen=True)
class Overprovision:
    """Stop each RL step at a quota of done trajectories and abort the rest (RollPacker / APRIL style).

    The workload itself holds the launched (over-provisioned) prompts; the quota is
    ``keep`` trajectories per step, or ``ceil(keep_fraction * launched)``.
    """

    keep_fraction: float = 1.0
    keep: int | None = None

    def __post_init__(self) -> None:
        if self.keep is not None and self.keep < 1:
            raise SimulationError(f"over-provisioning: keep must be >= 1, got {self.keep}")
        if not 0.0 < self.keep_fraction <= 1.0:
            raise SimulationError(f"over-provisioning: keep_fraction must be in (0, 1], got {self.keep_fraction}")

    def quota(self, launched: int) -> int:
        if self.keep is not None:
            return min(self.keep, launched)
        return max(1, min(launched, math.ceil(self.keep_fraction * launched - 1e-9)))


def _positive_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def check_choice(what: str, value: str, known: tuple[str, ...]) -> None:
    """Raise :class:`SimulationError` unless ``value`` is one of ``known`` (``what``: the setting, as named)."""
    if value not in known:
        raise SimulationError(f"unknown {what} {value!r}; known: {', '.join(known)}")


#: RL drivers: synchronous steps (the default) or asynchronous rollouts (:mod:`simulator.async_rl`).
DRIVERS = ("sync", "async")
#: What a weight update does to in-flight requests: ``abort`` them (flush the cache, resubmit prompt + tokens so
#: far), ``recompute`` (vLLM's ``pause_generation(mode="keep", clear_cache=True)``: preempt everything and clear the
#: cache) or ``keep`` their KV (the prefix cache salted by each group's start version, no reset).
WEIGHT_SYNC_MODES = ("abort", "recompute", "keep")
#: Trajectory admission of the asynchronous driver: ``staleness`` (AReaL's capacity rule, FCFS),
#: ``kv-pressure`` (prime-rl's KV-pressure concurrency controller, inside the same staleness rule),
#: ``working-set`` (kvpilot's: groups in flight while their predicted working set fits in GPU KV plus the host
#: tier, inside the staleness rule; :mod:`policy.group_width`) or ``auto``: ``working-set`` for a policy that
#: carries a logged prior of session contexts (kvpilot's learned policy), else ``staleness``.
ADMISSIONS = ("auto", "staleness", "kv-pressure", "working-set")


def _priced_model(cost: StepCost) -> None:
    """A trainer is priced by the preset's model and GPU: a fitted engine has neither (an error that says so)."""
    if cost.model is None:
        raise SimulationError(f"the fitted preset {cost.name} has no model or GPU to price a training step or a "
                              "weight update by; name a roofline preset for the trainer (Trainer.preset, "
                              "--trainer-preset, e.g. H200-7B)")


@dataclass(frozen=True)
class Trainer:
    """The trainer's price: a training step of T tokens takes ``6 x params x T / (gpus x flops x mfu) + fixed_s``;
    the weight update after it pauses rollout for ``model bytes / link_bytes_per_s + sync_fixed_s``.

    ``gpus`` None: as many trainer GPUs as rollout replicas (one GPU each); ``flops`` None: the preset GPU's dense
    BF16 peak. ``preset``: the roofline preset (e.g. ``H200-7B``) whose model and GPU price the trainer; None: the
    run's own, which must then be a roofline preset (a fitted one, e.g. a CPU server's, prices no trainer).
    ``train_batch``: GRPO groups per training step (None: the workload's groups per RL step, so that synchronous
    and asynchronous runs train the same batches). A trajectory's tokens are its last turn's prompt
    and output (the sequence it trains on).
    """

    train_batch: int | None = None
    gpus: int | None = None
    flops: float | None = None
    #: Model FLOPs utilisation of the training step (a common figure for a dense 7-32B model under FSDP).
    mfu: float = 0.35
    #: Per training step: optimizer step, data loading, log-prob recomputation set-up.
    fixed_s: float = 2.0
    #: Trainer to rollout weight transfer: 400 Gb/s (one InfiniBand NDR port) of bf16 weights.
    link_bytes_per_s: float = 50e9
    #: Per weight update: pause, broadcast set-up, resume.
    sync_fixed_s: float = 0.5
    preset: str | None = None

    def __post_init__(self) -> None:
        for name in ("train_batch", "gpus"):
            v = getattr(self, name)
            if v is not None and not _positive_int(v):
                raise SimulationError(f"trainer {name} must be an integer >= 1, got {v!r}")
        if self.flops is not None and not (_number(self.flops) and self.flops > 0):
            raise SimulationError(f"trainer flops must be a number > 0, got {self.flops!r}")
        if not (_number(self.mfu) and 0 < self.mfu <= 1):
            raise SimulationError(f"trainer mfu must be in (0, 1], got {self.mfu!r}")
        if not (_number(self.link_bytes_per_s) and self.link_bytes_per_s > 0):
            raise SimulationError(f"trainer link_bytes_per_s must be a number > 0, got {self.link_bytes_per_s!r}")
        for name in ("fixed_s", "sync_fixed_s"):
            v = getattr(self, name)
            if not (_number(v) and v >= 0):
                raise SimulationError(f"trainer {name} must be a number of seconds >= 0, got {v!r}")
        if self.preset is not None:
            try:
                CostModel.preset(self.preset)
            except ValueError as e:
                raise SimulationError(f"trainer preset: {e}") from None

    def _pricing(self, cost: StepCost) -> StepCost:
        """The cost model that prices the trainer: ``preset``'s, else the run's (which must have a model)."""
        if self.preset is not None:
            return CostModel.preset(self.preset)
        _priced_model(cost)
        return cost

    def train_s(self, tokens: int, cost: StepCost, replicas: int) -> float:
        """Seconds of one training step on ``tokens`` tokens."""
        cost = self._pricing(cost)
        gpus = self.gpus or replicas
        flops = self.flops if self.flops is not None else cost.gpu.peak_flops
        return 6.0 * cost.model.params * tokens / (gpus * flops * self.mfu) + self.fixed_s

    def sync_s(self, cost: StepCost) -> float:
        """Seconds of one weight update (rollout paused)."""
        cost = self._pricing(cost)
        return cost.model.params * cost.model.bytes_per_param / self.link_bytes_per_s + self.sync_fixed_s


@dataclass(frozen=True)
class AsyncRL:
    """The asynchronous driver's settings (:mod:`simulator.async_rl`).

    ``staleness`` (eta): a group started at weight version v is trained at version v + eta at the latest, and
    AReaL's rule admits a group only while ``started < (eta + v + 1) x B``; ``weight_sync``: one of
    :data:`WEIGHT_SYNC_MODES`; ``admission``: one of :data:`ADMISSIONS`; ``max_concurrent_groups``: a hard cap
    on groups in flight (None: none).
    """

    staleness: int = 1
    weight_sync: str = "keep"
    admission: str = "auto"
    max_concurrent_groups: int | None = None
    #: kv-pressure: KV use above which the controller shrinks its concurrency, and below which it grows it.
    kv_high: float = 0.95
    kv_low: float = 0.80

    def resolved(self, session_contexts: Any) -> "AsyncRL":
        """These settings with ``auto`` admission made concrete for a policy whose logged prior of session
        contexts is ``session_contexts`` (:attr:`policy.interface.Policy.session_contexts`)."""
        if self.admission != "auto":
            return self
        return replace(self, admission="working-set" if session_contexts else "staleness")

    def __post_init__(self) -> None:
        eta = self.staleness
        if isinstance(eta, bool) or not isinstance(eta, int) or eta < 0:
            raise SimulationError(f"staleness (eta) must be an integer >= 0, got {eta!r}")
        check_choice("weight-sync mode", self.weight_sync, WEIGHT_SYNC_MODES)
        check_choice("async admission", self.admission, ADMISSIONS)
        if self.max_concurrent_groups is not None and not _positive_int(self.max_concurrent_groups):
            raise SimulationError(f"max_concurrent_groups must be an integer >= 1, got {self.max_concurrent_groups!r}")
        if not (_number(self.kv_low) and _number(self.kv_high) and 0 < self.kv_low < self.kv_high <= 1):
            raise SimulationError(f"kv-pressure watermarks must satisfy 0 < kv_low < kv_high <= 1, got "
                                  f"{self.kv_low!r}, {self.kv_high!r}")


#: GiB of host memory per replica for the CPU offload tier (see :attr:`SimConfig.offload_gib`).
DEFAULT_OFFLOAD_GIB = 64.0


def check_offload_gib(gib: Any) -> float:
    """A CPU offload tier's size, GiB of host memory per replica (``--offload-gib`` wherever it is given: simulate,
    evaluate's grid, the held-out runs of train and promote), as a float; 0 is no tier. Anything else raises
    :class:`SimulationError`."""
    if isinstance(gib, bool) or not isinstance(gib, (int, float)) or not math.isfinite(gib) or gib < 0:
        raise SimulationError(f"offload_gib (--offload-gib) must be a number of GiB >= 0, got {gib!r}")
    return float(gib)


@dataclass(frozen=True, eq=False)
class SimConfig:
    """Every option of a run (see :func:`simulator.simulation.run_simulation`), checked when made."""

    policy: PolicySpec = "vllm-default"
    policy_options: dict[str, Any] | None = None
    replicas: int = 1
    #: A router name (:data:`simulator.routers.ROUTERS`, a fresh one per run) or an instance.
    router: str | Router = "round-robin"
    #: vLLM blocks per replica (its null block included), or ``kv_fraction`` of the workload's need
    #: (:func:`simulator.sizing.blocks_for_fraction`); neither: the preset's GPU capacity.
    kv_blocks: int | None = None
    kv_fraction: float | None = None
    preset: str = "H200-7B"
    out_dir: str | Path | None = None
    overprovision: Overprovision | None = None
    progress: bool = True
    #: vLLM's limits; None: a fitted preset's engine's (:mod:`simulator.fitted_cost`), else 256 and 8192.
    max_num_seqs: int | None = None
    max_num_batched_tokens: int | None = None
    #: A session's later turns and its scoring requests go to the replica of its first turn.
    sticky_sessions: bool = True
    #: Requests carry their session identity (``kvpilot_session_id``, ``kvpilot_turn``, ``kvpilot_tool``); False
    #: sends none, as verl and AReaL do, and the hook infers sessions from the block-hash chain.
    session_ids: bool = True
    decision_budget_s: float | None = SIM_DECISION_BUDGET_S
    #: Simulated length of an engine step that schedules nothing (so that TTLs run out).
    idle_step_s: float = 0.004
    #: Idle steps in a row, with nothing else pending, after which a replica is stalled (an error).
    stall_steps: int = 100_000
    #: Sampled tokens per request per simulated step (:mod:`simulator.runner`).
    decode_stride: int = 1
    #: Log the ``decisions`` table (every candidate's features at every decision): training needs it,
    #: an evaluation that only compares summaries does not.
    decision_log: bool = True
    #: Log the ``kv_events`` table (every block stored or removed); the routers get the events either way.
    kv_event_log: bool = True
    #: RL workloads reset every replica's prefix cache at each RL step boundary (new weights: RL frameworks
    #: call vLLM's ``reset_prefix_cache`` at weight sync); True keeps it (a study of cross-step reuse).
    #: A trace replay never resets.
    keep_cache_across_steps: bool = False
    #: Host memory of the CPU offload tier per replica, GiB of the preset model's KV, for policies that use the
    #: tier (``Policy.uses_offload``: vLLM's native KV offloading, :mod:`simulator.offload`); 0 turns it off.
    #: Default: a quarter of a DGX H200's host memory per GPU (2 TB / 8 GPUs = 256 GB).
    offload_gib: float = DEFAULT_OFFLOAD_GIB
    #: The RL driver: ``sync`` (synchronous steps) or ``async`` (:mod:`simulator.async_rl`, with ``async_rl``).
    driver: str = "sync"
    #: The asynchronous driver's settings (``driver="async"``; None: :class:`AsyncRL`'s defaults).
    async_rl: AsyncRL | None = None
    #: The trainer's price. Synchronous steps: None (the default) trains nothing, so earlier results reproduce;
    #: a :class:`Trainer` prices a training step and a weight update after every RL step. The asynchronous
    #: driver always trains (None: :class:`Trainer`'s defaults).
    trainer: Trainer | None = None
    #: Factor on the workload's tool and verifier latencies (``replay --time-scale``'s meaning; 0: no waits).
    time_scale: float = 1.0
    #: Seconds from the engine finishing a request to the client's next request of that trajectory (the HTTP
    #: response back, the next request in), added to every tool and scoring follow-up; None: draws from a fitted
    #: preset's measured round trip (``kvpilot calibrate --workload``), else 0 (at once).
    round_trip_s: float | None = None
    #: The seed of the run's round-trip draws (several seeds: several runs of one client, as a server's runs).
    round_trip_seed: int = 0
    #: What each run draws its round trips from (:class:`simulator.round_trip.RoundTrip`): ``round_trip_s``, or
    #: the preset's measured quantiles.
    round_trip_quantiles_s: tuple[float, ...] = field(init=False, repr=False)
    #: The preset's step-cost model.
    cost: StepCost = field(init=False, repr=False)

    def __post_init__(self) -> None:
        if not _positive_int(self.replicas):
            raise SimulationError(f"replicas must be an integer >= 1, got {self.replicas!r}")
        try:
            object.__setattr__(self, "cost", load_cost(str(self.preset)))
        except ValueError as e:
            raise SimulationError(str(e)) from None
        seqs, tokens = engine_limits(self.cost)
        if self.max_num_seqs is None:
            object.__setattr__(self, "max_num_seqs", seqs)
        if self.max_num_batched_tokens is None:
            object.__setattr__(self, "max_num_batched_tokens", tokens)
        for name in ("time_scale", "round_trip_s"):
            t = getattr(self, name)
            if (t is not None or name == "time_scale") and (
                    isinstance(t, bool) or not isinstance(t, (int, float)) or not math.isfinite(t) or t < 0):
                raise SimulationError(f"{name} must be a number >= 0, got {t!r}")
        measured = getattr(self.cost, "round_trip_quantiles_s", ())
        fixed = self.round_trip_s
        object.__setattr__(self, "round_trip_quantiles_s", (float(fixed),) if fixed is not None else measured or (0.0,))
        if self.kv_blocks is not None and self.kv_fraction is not None:
            raise SimulationError("give at most one of kv_blocks and kv_fraction (--kv-blocks, --kv-fraction)")
        if self.kv_fraction is not None and not self.kv_fraction > 0:
            raise SimulationError(f"kv fraction must be > 0, got {self.kv_fraction}")
        if self.max_num_seqs < 1 or self.max_num_batched_tokens < 1:
            raise SimulationError("max_num_seqs and max_num_batched_tokens must be >= 1")
        if not _positive_int(self.decode_stride):
            raise SimulationError(f"decode_stride must be an integer >= 1, got {self.decode_stride!r}")
        check_offload_gib(self.offload_gib)
        check_choice("driver", self.driver, DRIVERS)
        if self.trainer is not None and not isinstance(self.trainer, Trainer):
            raise SimulationError(f"trainer must be a simulator.config.Trainer, got {type(self.trainer).__name__}")
        if self.async_rl is not None and not isinstance(self.async_rl, AsyncRL):
            raise SimulationError(f"async_rl must be a simulator.config.AsyncRL, got {type(self.async_rl).__name__}")
        if self.driver == "async":
            if self.async_rl is None:
                object.__setattr__(self, "async_rl", AsyncRL())
            if self.trainer is None:
                object.__setattr__(self, "trainer", Trainer())
            if self.overprovision is not None:
                raise SimulationError("over-provisioning applies to synchronous RL steps, not to the async driver")
        elif self.async_rl is not None:
            raise SimulationError("async_rl settings need driver='async'")
        if self.out_dir is not None:
            object.__setattr__(self, "out_dir", Path(self.out_dir))
        self.make_router()  # an unknown name fails now

    @property
    def router_name(self) -> str:
        return self.router if isinstance(self.router, str) else type(self.router).__name__

    def make_router(self) -> Router:
        """The run's router: a fresh one by name, or the instance given."""
        if not isinstance(self.router, str):
            return self.router
        try:
            return make_router(self.router)
        except ValueError as e:
            raise SimulationError(str(e)) from None

    def policy_factory(self, workload: PreparedWorkload) -> Callable[[], Policy]:
        """A factory of fresh policies (one per replica), built through the serving hook; checked now."""
        from serving_hook.config import HookConfigError, policy_factory

        try:
            return policy_factory(self.policy, self.policy_options, replicas=self.replicas, workload=workload.table)
        except HookConfigError as e:
            raise SimulationError(str(e)) from None

    def offload_blocks(self) -> int:
        """Blocks of the preset model's KV that :attr:`offload_gib` holds (0: a fitted engine has no tier)."""
        if not self.cost.host_tier:
            return 0
        return int(self.offload_gib * 2**30 // self.cost.kv_block_bytes(VLLM_BLOCK_SIZE))

    def kv_blocks_for(self, workload: PreparedWorkload) -> int:
        """vLLM ``num_blocks`` per replica for ``workload``; too few for its largest request is an error."""
        need = min_blocks_for(workload)
        if self.kv_fraction is not None:
            kv_blocks = blocks_for_fraction(workload, self.kv_fraction)
        elif self.kv_blocks is None:
            kv_blocks = self.cost.max_kv_blocks(VLLM_BLOCK_SIZE)
        else:
            kv_blocks = self.kv_blocks
        if kv_blocks < need:
            raise SimulationError(
                f"KV cache of {kv_blocks} blocks is smaller than the largest request, which needs {need} blocks "
                f"of {VLLM_BLOCK_SIZE} tokens (prompt + output, plus vLLM's null block)"
                + (f"; raise --kv-fraction above {self.kv_fraction * need / kv_blocks:.3g}" if self.kv_fraction
                   else ""))
        return int(kv_blocks)
