"""Arrow schemas of the workload and of the four telemetry tables.

These schemas are kvpilot's contract between the simulator, the serving hook and
training: simulated and production telemetry share them, so training never knows
which it got. Readers and writers live in :mod:`data.io`; semantic checks beyond
types (token counts, turn order, references) live in :mod:`data.validate`.

Block hashes are signed 64-bit integers. A workload's hash chain covers
``ceil(prompt_tokens / block_size)`` blocks of its own ``block_size`` (512 for
Mooncake traces, 16 for synthetic workloads by default); equal hashes at equal
positions mean equal prefixes up to and including that block.
"""

from __future__ import annotations

from dataclasses import dataclass

import pyarrow as pa

#: Bumped whenever a schema below changes incompatibly; saved models record it.
SCHEMA_VERSION = 2

DOMAINS = ("math", "code", "agentic", "reward")
PARADIGMS = ("math_verifier", "unit_test_sandbox", "search_tool", "reward_model")
REQUEST_KINDS = ("rollout", "scoring")
FINISH_REASONS = ("stop", "length", "tool_call", "abort")


@dataclass(frozen=True)
class TableSpec:
    """One table: its Arrow schema and the columns that may hold nulls."""

    name: str
    schema: pa.Schema

    @property
    def required(self) -> tuple[str, ...]:
        return tuple(f.name for f in self.schema if not f.nullable)


def _f(name: str, typ: pa.DataType, nullable: bool = False) -> pa.Field:
    return pa.field(name, typ, nullable=nullable)


# One row per engine request: a rollout turn or a reward-model scoring request.
# Rows of a session are its turns 0..n-1. Turn k+1's prompt is turn k's prompt,
# its output and the tool's appended tokens, so its hash chain starts with every
# full block of turn k's context.
WORKLOAD = TableSpec(
    "workload",
    pa.schema(
        [
            _f("request_id", pa.string()),
            _f("kind", pa.string()),  # REQUEST_KINDS
            _f("step", pa.int32()),  # RL step (policy version); 0 for serving traces
            _f("prompt_id", pa.string()),  # stable across RL steps when the prompt recurs
            _f("group_id", pa.string()),  # GRPO group within a step
            _f("group_size", pa.int32()),
            _f("sample_index", pa.int32()),  # 0..group_size-1 within the group
            _f("session_id", pa.string()),  # one trajectory
            _f("turn", pa.int32()),  # 0-based
            _f("domain", pa.string()),  # DOMAINS, or a trace's own label
            _f("paradigm", pa.string()),  # PARADIGMS
            _f("prompt_tokens", pa.int32()),  # full context of this request
            _f("output_tokens", pa.int32()),  # target response length
            _f("max_tokens", pa.int32()),
            _f("finish_reason", pa.string()),  # FINISH_REASONS
            _f("block_size", pa.int32()),  # tokens per hash block, constant in a workload
            _f("block_hashes", pa.list_(pa.int64())),
            _f("tool", pa.string(), True),  # tool called after this turn; null on a last turn
            _f("tool_latency_s", pa.float64(), True),
            _f("tool_tokens", pa.int32(), True),  # tokens the tool appends to the context
            _f("verify_latency_s", pa.float64(), True),  # on a session's last turn
            _f("scores_session_id", pa.string(), True),  # scoring requests: the trajectory scored
            _f("arrival_s", pa.float64(), True),  # trace replay; null: released with its step
        ]
    ),
)

# One row per finished (or aborted) engine request.
REQUESTS = TableSpec(
    "requests",
    pa.schema(
        [
            _f("request_id", pa.string()),
            _f("session_id", pa.string(), True),
            _f("group_id", pa.string(), True),
            _f("prompt_id", pa.string(), True),
            _f("step", pa.int32(), True),
            _f("turn", pa.int32(), True),
            _f("domain", pa.string(), True),
            _f("paradigm", pa.string(), True),
            _f("replica", pa.int32()),
            _f("arrival_s", pa.float64()),
            _f("first_scheduled_s", pa.float64(), True),
            _f("first_token_s", pa.float64(), True),
            _f("finish_s", pa.float64(), True),
            _f("prompt_tokens", pa.int32()),
            _f("cached_tokens", pa.int32()),
            _f("output_tokens", pa.int32()),
            # tokens the engine computed for it, recomputation after preemption included
            # (the sum of its scheduled tokens over engine steps)
            _f("computed_tokens", pa.int32()),
            _f("max_tokens", pa.int32()),
            _f("finish_reason", pa.string()),
            _f("preemptions", pa.int32()),
            _f("block_hashes", pa.list_(pa.int64())),
            # seconds the policy held it back in the waiting queue (admission holds; absent in older telemetry)
            _f("held_s", pa.float64(), True),
        ]
    ),
)

# One row per decision a policy took. ``features`` holds one vector per candidate,
# in ``candidate_ids`` order; the feature names are in the file's metadata under
# ``kvpilot.feature_names`` (JSON, one list per decision kind).
DECISION_KINDS = ("admit", "preempt", "retain")
DECISIONS = TableSpec(
    "decisions",
    pa.schema(
        [
            _f("decision_id", pa.int64()),
            _f("time_s", pa.float64()),
            _f("replica", pa.int32()),
            _f("engine_step", pa.int64()),
            _f("kind", pa.string()),  # DECISION_KINDS
            _f("candidate_ids", pa.list_(pa.string())),
            _f("features", pa.list_(pa.list_(pa.float32()))),
            _f("chosen", pa.int32()),  # index into candidate_ids; -1 for none
            _f("action", pa.string(), True),  # retain: protect / demote / keep
            _f("ttl_s", pa.float64(), True),
            _f("propensity", pa.float64()),  # 1.0 for deterministic policies
            _f("policy", pa.string()),
            _f("policy_version", pa.string()),
        ]
    ),
)

# One row per engine step.
STEPS = TableSpec(
    "steps",
    pa.schema(
        [
            _f("engine_step", pa.int64()),
            _f("replica", pa.int32()),
            _f("time_s", pa.float64()),
            _f("duration_s", pa.float64()),
            _f("running", pa.int32()),
            _f("waiting", pa.int32()),
            _f("free_blocks", pa.int32()),
            _f("pinned_blocks", pa.int32()),
            _f("kv_usage", pa.float64()),
            _f("prefill_tokens", pa.int32()),
            _f("decode_tokens", pa.int32()),
            _f("prefix_queries", pa.int64()),
            _f("prefix_hits", pa.int64()),
            _f("preemptions", pa.int32()),
            _f("evictions", pa.int32()),
            _f("held", pa.int32(), True),  # waiting requests the policy held back (admission that waits)
            # blocks the CPU offload tier (vLLM's native KV offloading) loaded into / stored from GPU memory
            _f("offload_loaded_blocks", pa.int32(), True),
            _f("offload_stored_blocks", pa.int32(), True),
            _f("offload_loaded_bytes", pa.int64(), True),
            _f("offload_stored_bytes", pa.int64(), True),
            _f("hook_fallback", pa.bool_()),  # this step fell back to vLLM's own behaviour
            _f("dropped_rows", pa.int64()),  # telemetry rows dropped so far (full queue)
            # policy ``registry``: model loads and polls that failed so far (null: no registry policy)
            _f("model_failures", pa.int64(), True),
            # the step-cost model's attention terms (simulator.cost_model): causal query-key pairs of the
            # prefill chunks, and the KV tokens the decode tokens read (null: telemetry older than these columns)
            _f("prefill_context_tokens", pa.int64(), True),
            _f("decode_context_tokens", pa.int64(), True),
            # the engine's fixed facts (kvpilot calibrate's preset): vLLM's num_gpu_blocks (its null block
            # included), block size, max_num_seqs and max_num_batched_tokens
            _f("num_gpu_blocks", pa.int32(), True),
            _f("block_size", pa.int32(), True),
            _f("max_num_seqs", pa.int32(), True),
            _f("max_num_batched_tokens", pa.int32(), True),
            # the hook's own wall seconds in this step's schedule() (its decisions and this row): on a real engine
            # a part of duration_s (the simulator's duration_s is simulated time)
            _f("hook_s", pa.float64(), True),
        ]
    ),
)

# vLLM's KV-cache event stream, one row per event.
KV_EVENT_KINDS = ("stored", "removed", "cleared")
KV_EVENTS = TableSpec(
    "kv_events",
    pa.schema(
        [
            _f("time_s", pa.float64()),
            _f("replica", pa.int32()),
            _f("engine_step", pa.int64()),
            _f("event", pa.string()),  # KV_EVENT_KINDS
            _f("block_hashes", pa.list_(pa.int64())),
            _f("parent_block_hash", pa.int64(), True),
            _f("num_tokens", pa.int32(), True),
            _f("medium", pa.string(), True),
        ]
    ),
)

TELEMETRY_TABLES: dict[str, TableSpec] = {t.name: t for t in (REQUESTS, DECISIONS, STEPS, KV_EVENTS)}
ALL_TABLES: dict[str, TableSpec] = {WORKLOAD.name: WORKLOAD, **TELEMETRY_TABLES}
