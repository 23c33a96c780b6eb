"""The fake model runner: the workload's own output tokens, and what each engine step costs.

Outputs
-------
The fake runner emits the workload's own output ids
(:meth:`simulator.tokens.WorkloadTokens.output_ids`), ending a response that
finishes ``stop`` / ``tool_call`` with an EOS (a stop token) at its target
length, and a ``length`` one at ``max_tokens``; the request keeps the
workload's ``max_tokens``, so a policy never sees the true length. vLLM never
computes the last sampled token, so the EOS changes no cached block, and a next
turn (previous prompt + output + tool tokens) hits the cache exactly as in
production. A request still inside a partial prefill chunk samples nothing.

Cost: each step lasts the cost model's
:meth:`~simulator.cost_model.CostModel.step_time` of what it scheduled (prefill
tokens and their attention pairs, decode sequences and their context). The run's
GPU time is split by cause (:meth:`ScriptedRunner.breakdown`, the summary's
:class:`~simulator.summary.GpuSeconds`): each step's decode iterations priced alone are decode; what its
prefill chunks add to them is prefill, split into new tokens, recompute after
preemption and recompute after eviction by their token counts; the rest of
replicas x the run is idle (waiting on tools, verifiers or arrivals, or held
back with nothing runnable).

Decode stride
-------------
With ``decode_stride`` k > 1 the fake runner returns up to k sampled tokens per
request per step (never past its script: the EOS or ``max_tokens``), as a model
runner does with accepted speculative tokens: vLLM's ``update_from_output``
appends them all and checks each for a stop, and the next ``schedule()`` gives
the request those k uncomputed tokens as one chunk, allocating their KV. One
simulated step so stands for k engine iterations, and a run makes about k times
fewer scheduler calls (the cost of a run is almost all vLLM's own
``schedule()`` / ``update_from_output()``, one call per decoded token at k = 1).

* Cost: :meth:`~simulator.cost_model.CostModel.strided_step_time`: the step's
  prefill once, plus one decode iteration per sampled token, each with its own
  context (:meth:`ScriptedRunner.output`). A request of L output tokens is
  charged its prefill and L - 1 decode iterations, as at k = 1.
* Token budget: vLLM gets ``k x max_num_batched_tokens``
  (:func:`simulator.replica.build_replicas`). k iterations would each have had
  the budget, so prefill gets ``k x (budget - decoding sequences)`` tokens per
  step, the same admission rate per simulated second as at k = 1 (with the
  plain budget, k x the decode tokens would eat it and starve prefill).
  Policies see this budget in ``EngineState``.
* Telemetry: the hook's ``kvpilot_decode_stride`` is k, so ``steps`` rows
  count a decode chunk's tokens (not its sequences) in ``decode_tokens``.
* What is approximate: the scheduler (and a policy) decides once per k
  iterations, so preemption, admission and eviction happen at step
  granularity; a request's KV grows in chunks of k tokens; events inside a
  step (a finish, a tool's return, an arrival) take effect at its end, up to
  one step late instead of one iteration (k iterations; the default workload's
  iterations average 10.4 ms on H200-7B, so ~0.17 s per event at k = 16 and
  ~0.33 s at k = 32, against tool latencies of 0.17 s median and makespans of
  minutes); a request's last sampled batch (up to k tokens) is never computed,
  so a next turn's prompt can miss the one block holding it, and a preempted
  request's recompute is counted up to k - 1 tokens short.
  (These figures were measured on the default mix before the swe domain and the weight-sync reset.)
  ``benchmarks/bench_stride.py`` measures the effect on makespan, preemptions,
  hit rate and policy ratios. ``simulate`` defaults to k = 1 (exact: a single
  run's numbers should not carry this approximation), ``evaluate`` to
  :data:`training.grid.DEFAULT_DECODE_STRIDE` (32: a grid of many runs; on
  the default workload vllm-default's makespan is within 0.2 % of the exact one,
  and five measured policy ratios to it within 1.7 % of theirs, 2.2 % at k = 16).

Like a model runner, it reads the progress of vLLM's requests (computed,
prompt and output token counts); it calls nothing in vLLM.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from simulator.cost_model import prefill_attention_pairs
from simulator.engine import EOS_TOKEN_ID
from simulator.fitted_cost import StepCost
from simulator.summary import GpuSeconds
from simulator.workload import PreparedWorkload

__all__ = ["ScriptedRunner", "StepOutput"]

#: What one step sampled and how long it took: request ids, their sampled tokens, seconds.
StepOutput = tuple[list[str], list[list[int]], float]


class ScriptedRunner:
    """Plays each request's script (its output ids) and prices each step."""

    def __init__(self, workload: PreparedWorkload, cost: StepCost, stride: int) -> None:
        self.workload = workload
        self.cost = cost
        self.stride = stride
        self.scripts: dict[str, list[int]] = {}  # request id -> the tokens it samples, in order
        #: Where the GPU time went: the steps' decode iterations alone, and what their prefill added to them.
        self.decode_s = 0.0
        self.prefill_s = 0.0
        self.prefill_tokens = 0  # tokens computed by prefill (recomputation included)

    def script(self, request_id: str, row: int) -> None:
        """Script request ``request_id`` (workload row ``row``): its output ids, ending with an EOS unless it runs
        to ``max_tokens``."""
        w = self.workload
        out = w.tokens.output_ids(row).tolist()
        if w.finish_reason[row] != "length" or w.output_tokens[row] < w.max_tokens[row]:
            out[-1] = EOS_TOKEN_ID  # the model stops here
        self.scripts[request_id] = out

    def forget(self, request_id: str) -> None:
        self.scripts.pop(request_id, None)

    def output(self, requests: Mapping[str, Any], scheduled: Mapping[str, int]) -> StepOutput:
        """The fake model's output for the tokens ``scheduled`` per request id, and the step's cost, in one pass.

        At k = 1 a request samples one token, and the step costs its prefill chunks and one decode iteration.
        At decode stride k > 1 it samples up to k (never past its script): a request whose scheduled chunk is
        at most k tokens past its prompt is decoding: it computes the tokens it sampled last step and samples
        e more, one per iteration. A prefill chunk that completes samples its first token in iteration 1 and
        decodes the other e - 1 in iterations 2 .. e. So a request of L output tokens is charged its prefill
        and L - 1 decode iterations, each reading the context it reads at k = 1 (a lone request takes exactly
        as long as at k = 1).
        """
        k = self.stride
        strided = k > 1
        scripts = self.scripts
        pairs_of = prefill_attention_pairs
        req_ids = []
        sampled = []
        prefill = pairs = decode = context = 0  # decode and context: k = 1
        ends = [0] * (k + 1)  # requests decoding through iteration e
        bases = [0] * (k + 1)  # their context base: iteration j reads base + j
        late = late_base = 0  # prefill completers, which do not decode in iteration 1
        empty: list = []
        for rid, n in scheduled.items():
            req_ids.append(rid)
            r = requests[rid]
            computed = r.num_computed_tokens  # schedule() already advanced it by n
            before = computed - n
            if computed < r.num_tokens:  # inside a partial prefill chunk: no token
                prefill += n
                pairs += pairs_of(n, before)
                sampled.append(empty)
                continue
            if not strided:
                if n == 1 and before >= r.num_prompt_tokens:
                    decode += 1
                    context += computed
                else:
                    prefill += n
                    pairs += pairs_of(n, before)
                sampled.append([scripts[rid][r.num_output_tokens]])
                continue
            script = scripts[rid]
            pos = r.num_output_tokens
            e = min(k, len(script) - pos)
            sampled.append(script[pos:pos + e])
            # Sampling output token m reads prompt + m - 1 tokens, as at k = 1: iteration j reads computed - 1 + j.
            ends[e] += 1
            bases[e] += computed - 1
            if n > k or before < r.num_prompt_tokens:  # a prefill chunk: its iteration 1 samples the first token
                prefill += n
                pairs += pairs_of(n, before)
                late += 1
                late_base += computed - 1
        cost = self.cost
        if not strided:
            dt = cost.step_time(prefill, pairs, decode, context)
            decode_s = cost.step_time(0, 0, decode, context) if prefill else dt
            self._account(dt, decode_s, prefill)
            return req_ids, sampled, dt
        seqs = [0] * k
        ctx = [0] * k
        s = b = 0
        for j in range(k, 0, -1):
            s += ends[j]
            b += bases[j]
            seqs[j - 1] = s
            ctx[j - 1] = b + j * s
        seqs[0] -= late
        ctx[0] -= late_base + late
        dt = cost.strided_step_time(prefill, pairs, seqs, ctx)
        self._account(dt, cost.strided_step_time(0, 0, seqs, ctx) if prefill else dt, prefill)
        return req_ids, sampled, dt

    def _account(self, step_s: float, decode_s: float, prefill_tokens: int) -> None:
        """A step's time split: its decode iterations alone, and the rest (what its prefill chunks added)."""
        self.decode_s += decode_s
        self.prefill_s += step_s - decode_s
        self.prefill_tokens += prefill_tokens

    def breakdown(self, recomputed_preemption: int, recomputed_eviction: int, gpu_s: float,
                  offload_wait_s: float = 0.0) -> GpuSeconds:
        """GPU seconds by cause: decode, prefill of new tokens, recompute after preemption and after eviction (the
        prefill time split by the tokens' shares), waits for the CPU offload tier's blocking transfers
        (:mod:`simulator.offload`), and idle (``gpu_s``, replicas x the run, less the rest)."""
        total = self.prefill_tokens
        share = (lambda n: self.prefill_s * min(n, total) / total) if total else (lambda n: 0.0)  # noqa: E731
        preempt = share(recomputed_preemption)
        evict = min(share(recomputed_eviction), self.prefill_s - preempt)
        return GpuSeconds(gpu_decode_s=self.decode_s, gpu_prefill_new_s=self.prefill_s - preempt - evict,
                          gpu_recompute_preemption_s=preempt, gpu_recompute_eviction_s=evict,
                          gpu_offload_wait_s=offload_wait_s,
                          gpu_idle_s=max(0.0, gpu_s - self.decode_s - self.prefill_s - offload_wait_s))
