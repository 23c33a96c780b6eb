"""A physics lower bound of each RL step's makespan: no schedule beats it under the same cost model.

Every result is read beside it: a policy's ``makespan_over_bound`` and the share of vLLM default's gap to
it that the policy closes (``gap_closed``). It is computed from the workload alone, with the cost model of
:mod:`simulator.cost_model` (``c`` below is its ``step_time``), for ``R`` replicas of ``K`` KV blocks each.
Notation per request: prompt ``p`` tokens, output ``L`` tokens; sampling output token ``m`` reads ``p + m - 1``
tokens of context (token 1 is sampled by the prefill step, tokens 2..L by one decode iteration each, as the
simulator prices them at every decode stride).

**Chain bound** (a trajectory's critical path). A session's turns run one after the other: turn k+1 arrives
``tool_latency_s`` after turn k finishes; after the last turn its verifier runs (``verify_latency_s``) and
its reward-model scoring requests are sent, each then parsed for its own ``verify_latency_s``; the
trajectory ends when all of these are done. A request alone takes at least:

* its prefill step, ``c(n, pairs(n, p - n), 0, 0)``, where ``n`` (at least 1: vLLM always computes the last
  prompt token) is the tokens of its full blocks that no other request of the workload holds, less those the
  previous request of its stream computed (its prompt and all but its last sampled token, whose KV a
  session's next turn or scoring request can find cached): nothing else can have cached them, so this
  request computes them (more if chunked or recomputed; a step that also runs others only costs more, since
  ``c`` is monotone in every argument);
* ``L - 1`` decode iterations, each at least the iteration of that sequence alone,
  ``c(0, 0, 1, ctx) = overhead + max(GEMMs of one token, weight read) + max(attention, KV read of ctx)``
  (a batch reads the weights once but every member waits for the whole iteration).

The chain bound of an RL step is its longest trajectory: the sum of its turns' request bounds and tool
latencies, plus the longer of its verifier and its slowest scoring request (that request's bound plus its
parse). In a trace replay (every row has ``arrival_s``), a request cannot start before it arrives: the step's
chain bound is its latest ``arrival - step start + request bound (+ verification)``.

**Iteration floor and KV-area bound** (the replica's busy time). Every decode iteration reads the weights and
pays the step overhead once, and the KV its sequences hold fits in the cache: at most ``C = (K - 1) x 16``
tokens (vLLM's null block excluded; at decode stride k the last k - 1 tokens of each sequence are allocated
one step late, so ``C + (k - 1) x min(max_num_seqs, requests)``). Prefix caching lets sequences share
blocks (GRPO siblings hold one copy of their prompt), so each request is charged only its share of the
blocks it holds. A stream (a session's turns and the requests scoring it) runs one request at a time, so a
full prompt block that ``n`` streams of the workload hold counts ``1 / n`` of its tokens for each request
holding it: at most ``n`` holders run at once, so the running sequences' shares never exceed what the cache
holds. A request's partial block and its own output count whole. With ``A'`` the step's shared-context
token-iterations (sum over requests of ``sum_m (share of prompt + m - 1)``), a replica set runs at least
``N = max(A' / C, max L - 1)`` decode iterations, and with ``A`` the contexts it reads (``sum_m (p + m - 1)``:
each sequence reads all of its own), its GPU time summed over replicas is at least::

    N x overhead + max(GEMMs of the prefill and decode tokens, N x weight read) + max(attention, KV read of A)

(``sum_i max(a_i, b) >= max(sum_i a_i, n b)``: per-iteration maxima summed are at least the maximum of the
sums). **Prefill** enters through the GEMMs: at least the step's distinct full-block tokens that no earlier
step held, less the outputs that later prompts contain (those tokens' KV is written by decode), at the
compute roofline; its attention is left out (a valid under-estimate).

**Replicas.** The bound of a step on ``R`` replicas is ``max(chain, busy / R)``: the relaxation lets work split
freely across replicas (any session on any replica, any request split), so it stays below every real
placement. One replica is the same formula with ``R = 1``.

Workloads hashed in blocks of other than vLLM's 16 tokens (imported traces) share sub-blocks their chains do
not show; for them every prompt token counts as shareable and cacheable, a looser bound that stays valid.

**CPU offload tier.** The bound charges no recompute and no transfer at all (every token's KV is computed
once, and a paused session's KV is free to keep anywhere while it waits: the KV-area term counts only the
token-iterations of running sequences), so it stays a lower bound for policies with the tier; their loads
over PCIe are a cost the bound does not have.

What it does not cover: policies that change which work an RL step holds (tail batching re-runs cut prompts
in later long rounds, over-provisioning aborts trajectories) can end a step below its bound; compare their
whole runs (``simulated_s`` against ``bound_total_s``) only as a guide.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from simulator.cost_model import prefill_attention_pairs
from simulator.fitted_cost import StepCost, engine_limits, load_cost
from simulator.sizing import blocks_for_fraction, min_blocks_for
from simulator.tokens import VLLM_BLOCK_SIZE
from simulator.workload import PreparedWorkload

__all__ = ["StepBound", "Bound", "ThroughputBound", "makespan_bound", "throughput_bound", "workload_bound",
           "render_bound"]



@dataclass(frozen=True)
class StepBound:
    """One RL step's lower bound and its terms (seconds)."""

    step: int
    requests: int
    chain_s: float  # the longest trajectory's critical path
    busy_s: float  # GPU time of all replicas together (iteration floor, KV area, prefill)
    decode_iterations: float  # the iteration floor N
    bound_s: float  # max(chain_s, busy_s / replicas)
    binding: str  # "chain" or "busy"
    start_s: float = 0.0  # a trace replay's step: its first arrival, from the trace's first


@dataclass(frozen=True)
class Bound:
    """The bound of a whole workload: per step, their mean (beside ``makespan_s``), and of the whole run (beside
    ``simulated_s``): the steps' sum for RL steps, which run one after the other; for a trace replay, whose
    steps are overlapping windows, the latest step's start plus its bound."""

    steps: list[StepBound]
    replicas: int
    kv_blocks: int
    preset: str
    decode_stride: int
    trace: bool = False
    mean_s: float = field(init=False)
    total_s: float = field(init=False)

    def __post_init__(self) -> None:
        bounds = [s.bound_s for s in self.steps]
        total = max((s.start_s + s.bound_s for s in self.steps), default=0.0) if self.trace else float(sum(bounds))
        object.__setattr__(self, "total_s", float(total))
        object.__setattr__(self, "mean_s", float(sum(bounds)) / len(bounds) if bounds else 0.0)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self) | {"mean_s": self.mean_s, "total_s": self.total_s}


def makespan_bound(prepared: PreparedWorkload, cost: StepCost, kv_blocks: int, *, replicas: int = 1,
                   preset: str = "", decode_stride: int = 1, max_num_seqs: int = 256) -> Bound:
    """The lower bound of every RL step of a (validated, prepared) workload; see the module docstring."""
    for name, value, low in (("replicas", replicas, 1), ("kv_blocks", kv_blocks, 2),
                             ("decode_stride", decode_stride, 1)):
        if value < low:
            raise ValueError(f"{name} must be >= {low}, got {value}")
    t = _Terms(prepared, cost)
    step, fresh, chain = t.step, t.fresh, t.chain
    arrival = t.col("arrival_s").astype(float) if prepared.trace else None
    steps = []
    for s in np.unique(step):
        rows = step == s
        n_rows = int(rows.sum())
        busy, iterations = t.busy(rows, float(fresh[s]), kv_blocks, decode_stride, max_num_seqs)
        c = float(chain[s])
        b = max(c, busy / replicas)
        start = float(arrival[rows].min() - arrival.min()) if prepared.trace else 0.0
        steps.append(StepBound(int(s), n_rows, c, busy, iterations, b, "chain" if c >= busy / replicas else "busy",
                               start))
    return Bound(steps, replicas, int(kv_blocks), preset, decode_stride, trace=prepared.trace)


class _Terms:
    """Per-request terms of the bound of a workload (module docstring), and the busy term of a set of requests."""

    def __init__(self, prepared: PreparedWorkload, cost: StepCost) -> None:
        self.cost = cost
        workload = prepared.table
        self.col = lambda name: workload.column(name).to_numpy(zero_copy_only=False)  # noqa: E731
        p = self.col("prompt_tokens").astype(np.int64)
        self.out = out = self.col("output_tokens").astype(np.int64)
        self.step = self.col("step").astype(np.int64)
        exclusive, shared_prompt, self.fresh = _block_tokens(workload, self.step)
        # A block no other request holds may still be cached by the decode of the stream's previous request.
        new = np.maximum(1, np.minimum(exclusive, p - _computed_by_predecessor(prepared, p, out)))
        self.service = _request_bounds(cost, p, out, new)
        self.decode_ctx = (out - 1) * p + (out - 1) * out // 2  # sum over m = 2..L of (p + m - 1)
        self.held = (out - 1) * shared_prompt + (out - 1) * out / 2  # the same with each prompt block's share
        self.fed = _feeds_a_later_prompt(prepared)
        self.chain = _chain_bounds(prepared, self.service, self.step)

    def busy(self, rows: np.ndarray, fresh: float, kv_blocks: int, decode_stride: int, max_num_seqs: int
             ) -> tuple[float, float]:
        """GPU seconds (all replicas) of the requests ``rows``, whose new full-block tokens are ``fresh``, and
        their decode iteration floor."""
        cost, out = self.cost, self.out
        n_rows = int(rows.sum())
        capacity = (kv_blocks - 1) * VLLM_BLOCK_SIZE + (decode_stride - 1) * min(max_num_seqs, n_rows)
        area = float(self.decode_ctx[rows].sum())
        decoded = float((out[rows] - 1).sum())
        iterations = max(float(self.held[rows].sum()) / capacity, float((out[rows] - 1).max()))
        prefill = max(0.0, fresh - float(out[rows & self.fed].sum()))
        busy = (iterations * cost.step_overhead_s
                + max(cost.linear_s(prefill + decoded, decoded), iterations * cost.weight_read_s)
                + cost.decode_context_s(area))
        return busy, iterations


@dataclass(frozen=True)
class ThroughputBound:
    """An upper bound of trained trajectories per second (asynchronous or not; :func:`throughput_bound`)."""

    trajectories: int
    rollout_s: float  # the whole workload's busy term over the replicas, plus the last training step
    trainer_s: float  # every training step and weight update, one after the other
    chain_s: float  # the longest trajectory, plus the last training step
    bound_s: float  # the largest of the three: no run finishes sooner
    binding: str
    trajectories_per_s: float


def throughput_bound(prepared: PreparedWorkload, cost: StepCost, kv_blocks: int, *, replicas: int = 1,
                     decode_stride: int = 1, max_num_seqs: int = 256, train_s: float = 0.0, sync_s: float = 0.0,
                     updates: int = 0, last_train_s: float = 0.0) -> ThroughputBound:
    """The least time to roll out and train the whole workload, as trajectories per second.

    The same cost model as :func:`makespan_bound`, with the whole workload as one set of requests (without the
    step barrier, requests of different steps may share decode iterations): its busy term over ``replicas``
    (the KV area and iteration floor over ``kv_blocks`` per replica), the longest trajectory's chain, and the
    trainer: ``train_s`` (every training step), ``updates`` weight updates of ``sync_s`` each, and
    ``last_train_s`` (a lower bound of the training step that must follow the last rollout, with its update).
    The run takes at least the largest of: busy / replicas + last step, chain + last step, trainer total."""
    t = _Terms(prepared, cost)
    rows = np.ones(len(t.out), bool)
    busy, _ = t.busy(rows, float(sum(t.fresh.values())), kv_blocks, decode_stride, max_num_seqs)
    tail = last_train_s + (sync_s if updates else 0.0)
    terms = {"rollout": busy / replicas + tail, "trainer": train_s + updates * sync_s,
             "chain": max(t.chain.values(), default=0.0) + tail}
    binding = max(terms, key=terms.get)
    n = len(prepared.sessions)
    bound = terms[binding]
    return ThroughputBound(n, terms["rollout"], terms["trainer"], terms["chain"], bound, binding,
                           n / bound if bound > 0 else 0.0)


def workload_bound(workload: PreparedWorkload, *, preset: str = "H200-7B", kv_blocks: int | None = None,
                   kv_fraction: float | None = None, replicas: int = 1, decode_stride: int = 1,
                   max_num_seqs: int | None = None) -> Bound:
    """:func:`makespan_bound` with the KV size given as the simulator takes it: ``kv_blocks`` per replica, or
    ``kv_fraction`` of what the largest step needs (:func:`simulator.sizing.blocks_for_fraction`), or neither:
    the preset GPU's capacity. ``preset``: a roofline preset or a fitted preset file
    (:func:`simulator.fitted_cost.load_cost`); ``max_num_seqs`` None: the fitted engine's, else 256."""
    cost = load_cost(preset)
    if max_num_seqs is None:
        max_num_seqs = engine_limits(cost)[0]
    if kv_blocks is not None and kv_fraction is not None:
        raise ValueError("give at most one of kv_blocks and kv_fraction (--kv-blocks, --kv-fraction)")
    if kv_fraction is not None:
        kv_blocks = blocks_for_fraction(workload, kv_fraction)
    elif kv_blocks is None:
        kv_blocks = cost.max_kv_blocks(VLLM_BLOCK_SIZE)
    need = min_blocks_for(workload)
    if kv_blocks < need:  # the simulator refuses such a cache: no schedule exists to bound
        raise ValueError(f"KV cache of {kv_blocks} blocks is smaller than the largest request, which needs {need}")
    return makespan_bound(workload, cost, kv_blocks, replicas=replicas, preset=preset, decode_stride=decode_stride,
                          max_num_seqs=max_num_seqs)


def _block_tokens(workload: pa.Table, step: np.ndarray) -> tuple[np.ndarray, np.ndarray, dict[int, int]]:
    """Per request, the tokens of its full blocks no other request holds, and its prompt's share of the KV
    (each full block over the requests holding it, its partial block whole); per step, the tokens of the
    full blocks that first appear in it (no earlier step held them)."""
    chains = workload.column("block_hashes").combine_chunks()
    size = workload.column("block_size").to_numpy().astype(np.int64)
    if (size != VLLM_BLOCK_SIZE).any():
        # Hash blocks larger than vLLM's (a trace's 512-token blocks) share 16-token sub-blocks that the chains
        # do not show: count every prompt token as shareable and cacheable (a looser, still valid bound).
        steps = np.unique(step)
        zeros = np.zeros(workload.num_rows, np.int64)
        return zeros, zeros.astype(float), {int(s): 0 for s in steps}
    lengths = pc.list_value_length(chains).fill_null(0).to_numpy().astype(np.int64)
    full = np.minimum(lengths, workload.column("prompt_tokens").to_numpy() // size)
    flat = pc.list_flatten(chains).to_numpy()
    row = np.repeat(np.arange(len(lengths)), lengths)
    position = np.arange(flat.size) - np.repeat(np.cumsum(lengths) - lengths, lengths)
    keep = position < full[row]
    flat, row = flat[keep], row[keep]
    _, inverse, counts = np.unique(flat, return_inverse=True, return_counts=True)
    inverse = inverse.ravel()
    exclusive = np.bincount(row[counts[inverse] == 1], minlength=len(lengths)) * size
    stream = pc.dictionary_encode(pc.coalesce(workload.column("scores_session_id"), workload.column("session_id")))
    stream = stream.combine_chunks().indices.to_numpy().astype(np.int64)[row]
    pairs = np.unique(inverse * (int(stream.max()) + 1 if stream.size else 1) + stream)  # distinct (block, stream)
    streams = np.bincount(pairs // (int(stream.max()) + 1 if stream.size else 1), minlength=counts.size)
    prompt = workload.column("prompt_tokens").to_numpy().astype(np.int64)
    shares = np.bincount(row, weights=1.0 / streams[inverse], minlength=len(lengths)) * size
    shared_prompt = shares + (prompt - full * size)
    steps = np.unique(step)
    first_step = np.full(counts.size, np.iinfo(np.int64).max)
    np.minimum.at(first_step, inverse, step[row])
    block_tokens = np.zeros(counts.size, np.int64)
    block_tokens[inverse] = size[row]
    per_step = np.bincount(np.searchsorted(steps, first_step), weights=block_tokens, minlength=len(steps))
    return exclusive, shared_prompt, {int(s): int(t) for s, t in zip(steps, per_step)}


def _computed_by_predecessor(prepared: PreparedWorkload, p: np.ndarray, out: np.ndarray) -> np.ndarray:
    """Per request, the tokens of full vLLM blocks the previous request of its stream computed (its prompt and all
    but its last sampled token): a turn's predecessor is the turn before, a scoring request's the last turn."""
    done = np.zeros(len(p), np.int64)
    for session in prepared.sessions:
        turns = session.turns
        for prev, row in zip(turns, turns[1:]):
            done[row] = p[prev] + out[prev] - 1
        for row in session.scoring:
            done[row] = p[turns[-1]] + out[turns[-1]] - 1
    return done // VLLM_BLOCK_SIZE * VLLM_BLOCK_SIZE


def _request_bounds(cost: StepCost, p: np.ndarray, out: np.ndarray, new: np.ndarray) -> np.ndarray:
    """Per request, the least time it takes alone: its prefill step of ``new`` tokens, its L - 1 decode
    iterations."""
    alone = cost.step_time(0, 0, 1, 0)  # one decode iteration of one sequence, less its KV read
    per_token = cost.step_time(0, 0, 1, 1) - alone  # ... and per context token read (linear in the context)
    decode_ctx = (out - 1) * p + (out - 1) * out // 2
    prefill = np.array([cost.step_time(int(n), prefill_attention_pairs(int(n), int(q - n)), 0, 0)
                        for n, q in zip(new.tolist(), p.tolist())])
    return prefill + (out - 1) * alone + decode_ctx * per_token


def _feeds_a_later_prompt(prepared: PreparedWorkload) -> np.ndarray:
    """Rows whose output later prompts contain: a session's turns but its last, and the last one if scored."""
    fed = np.zeros(prepared.num_rows, bool)
    for session in prepared.sessions:
        fed[list(session.turns[:-1] if not session.scoring else session.turns)] = True
    return fed


def _chain_bounds(prepared: PreparedWorkload, service: np.ndarray, step: np.ndarray) -> dict[int, float]:
    """Per step, the longest trajectory's critical path (or, replaying a trace, the latest arrival's)."""
    verify = np.array([v or 0.0 for v in prepared.verify_latency_s])
    out = {int(s): 0.0 for s in np.unique(step)}
    if prepared.trace:
        t = np.asarray(prepared.arrival_s, float)
        for s in out:
            rows = step == s
            out[s] = float((t[rows] - t[rows].min() + service[rows] + verify[rows]).max())
        return out
    tool = np.array([v or 0.0 for v in prepared.tool_latency_s])  # after each turn but the last
    for session in prepared.sessions:
        turns, last = list(session.turns), session.turns[-1]
        tail = max((service[r] + verify[r] for r in session.scoring), default=0.0)
        path = float(service[turns].sum() + tool[turns[:-1]].sum()) + max(verify[last], tail)
        out[session.step] = max(out[session.step], path)
    return out


def render_bound(bound: Bound) -> str:
    """A per-step table and the totals, for ``kvpilot bound``."""
    lines = [f"lower bound of the makespan: {bound.replicas} replica(s) x {bound.kv_blocks} KV blocks, "
             f"preset {bound.preset or '?'}, decode stride {bound.decode_stride}",
             f"{'step':>5} {'requests':>9} {'chain_s':>10} {'busy_s':>10} {'iterations':>11} {'bound_s':>10}  binding"]
    for s in bound.steps:
        lines.append(f"{s.step:>5} {s.requests:>9} {s.chain_s:>10.2f} {s.busy_s:>10.2f} "
                     f"{s.decode_iterations:>11.0f} {s.bound_s:>10.2f}  {s.binding}")
    lines.append(f"total {bound.total_s:.2f} s, mean {bound.mean_s:.2f} s per step")
    return "\n".join(lines)
