"""Weight sync: the simulator resets every replica's prefix cache between RL steps through vLLM's own
``reset_prefix_cache``, so no KV crosses a step; ``keep_cache_across_steps`` keeps it."""

from __future__ import annotations

import pyarrow as pa
import pyarrow.compute as pc
import pytest

from data.schemas import WORKLOAD
from data.synth import SynthConfig, generate
from simulator.simulation import run_simulation

pytestmark = pytest.mark.vllm


def _repeated_step() -> pa.Table:
    """One RL step of math prompts, then the same prompts again as step 1 with the same block hashes: step 1
    could hit everything step 0 cached, if the cache survived the step boundary."""
    cfg = SynthConfig(seed=3, steps=1, prompts_per_step=2, group_size=2,
                      domains={"math": SynthConfig.preset("short").domains["math"]})
    rows = generate(cfg).to_pylist()
    again = [{**r, "step": 1, **{k: f"s1-{r[k]}" for k in ("request_id", "group_id", "session_id")}} for r in rows]
    return pa.Table.from_pylist(rows + again, schema=WORKLOAD.schema)


def _first_request_of_step_1(result) -> dict:
    requests = result.requests.filter(pc.equal(result.requests.column("step"), 1))
    first = pc.sort_indices(requests, [("first_scheduled_s", "ascending"), ("request_id", "ascending")])[0]
    return requests.slice(first.as_py(), 1).to_pylist()[0]


@pytest.mark.parametrize("replicas", [1, 2])
def test_step_boundary_resets_the_prefix_cache(replicas: int) -> None:
    workload = _repeated_step()
    reset = run_simulation(workload, "vllm-default", replicas=replicas, progress=False)
    kept = run_simulation(workload, "vllm-default", replicas=replicas, progress=False, keep_cache_across_steps=True)
    assert reset.summary.prefix_cache_resets == replicas  # one weight sync, every replica
    assert kept.summary.prefix_cache_resets == 0
    assert _first_request_of_step_1(reset)["cached_tokens"] == 0  # step 0's blocks are gone
    first = _first_request_of_step_1(kept)
    assert first["cached_tokens"] >= first["prompt_tokens"] - 16  # all its full blocks hit step 0's
    assert kept.summary.metrics.prefix_hit_rate > reset.summary.metrics.prefix_hit_rate


def test_a_trace_replay_never_resets() -> None:
    workload = _repeated_step()
    half = workload.num_rows // 2
    rows = [{**r, "arrival_s": 0.0 if i < half else 1000.0} for i, r in enumerate(workload.to_pylist())]
    trace = pa.Table.from_pylist(rows, schema=WORKLOAD.schema)
    summary = run_simulation(trace, "vllm-default", progress=False).summary
    assert summary.prefix_cache_resets == 0
    # a trace's whole run is bounded by its latest window: that window's start (1000 s) plus its bound
    assert summary.bound.bound_total_s == pytest.approx(1000.0 + summary.bound.bound_per_step_s[1])
    assert summary.bound.makespan_over_bound >= 1.0
