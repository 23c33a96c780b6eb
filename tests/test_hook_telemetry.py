"""The telemetry a hooked run writes reads back through data/'s validating readers.

The run uses every lever (an explicit vLLM-default policy that also protects
tool-turn prefixes with a TTL), under enough KV pressure to preempt and evict,
so all four tables get rows: requests, decisions (admit, preempt, retain),
steps and kv_events.
"""

from __future__ import annotations

import json

import pyarrow.parquet as pq
import pytest

from policy.interface import FEATURE_NAMES, Retention, RetentionAction, RetentionDecision
from policy.vllm_default import VllmDefaultPolicy
from simulator import fake_runner

pytestmark = pytest.mark.vllm


class ProtectToolTurns(VllmDefaultPolicy):
    name = "test-protect-tool-turns"

    def __init__(self):
        super().__init__(explicit=True)

    def retain(self, prefixes, state):
        return RetentionDecision(
            actions={
                p.prefix_id: Retention(RetentionAction.PROTECT, ttl_s=5.0)
                for p in prefixes
                if p.owner_state.value == "paused_tool" and p.protected_until_s is None
            }
        )


def test_telemetry_reads_back(vllm_engine, tmp_path):
    from data.io import read_telemetry
    from serving_hook import KVPilotScheduler, with_policy
    from serving_hook.config import HookConfig

    engine = vllm_engine
    cfg = HookConfig(telemetry_dir=str(tmp_path), decision_budget_s=10.0, max_pinned_fraction=0.5, replica=3)
    cls = with_policy(KVPilotScheduler, ProtectToolTurns, cfg)
    s = engine.make_scheduler(cls, num_blocks=41, max_num_seqs=16, max_num_batched_tokens=256)
    t = [100.0]
    s.kvpilot_clock = lambda: t[0]
    ids = []
    for g in range(3):
        prompt = fake_runner.prompt_tokens(f"tel-{g}", 80)
        for k in range(4):
            rid = f"g{g}s{k}"
            ids.append(rid)
            extra = {"kvpilot_group_id": f"g{g}", "kvpilot_group_size": 4, "kvpilot_domain": "math", "kvpilot_step": 7}
            if g == 0:
                extra.update({"kvpilot_session_id": rid, "kvpilot_turn": 0, "kvpilot_tool": "search"})
            s.add_request(engine.make_request(rid, prompt, 20 + 15 * k, arrival_time=t[0], extra_args=extra))
    runner = fake_runner.FakeRunner()
    steps = 0
    preempted = 0
    while s.has_requests() and steps < 500:
        out = runner.step(s)
        preempted += len(out.preempted_req_ids or ())
        steps += 1
        t[0] += 0.01
    assert not s.has_requests()
    assert preempted > 0
    dropped = s.kvpilot_telemetry.dropped
    s.shutdown()  # flushes and stops the writer
    assert s.kvpilot_telemetry is None
    assert dropped == 0

    requests = read_telemetry(tmp_path, "requests")
    assert sorted(requests.column("request_id").to_pylist()) == sorted(ids)
    rows = {r["request_id"]: r for r in requests.to_pylist()}
    assert rows["g1s2"]["output_tokens"] == 50 and rows["g1s2"]["finish_reason"] == "length"
    assert rows["g0s0"]["finish_reason"] == "tool_call"
    assert rows["g1s0"]["group_id"] == "g1" and rows["g1s0"]["step"] == 7 and rows["g1s0"]["replica"] == 3
    assert sum(r["preemptions"] for r in rows.values()) == preempted
    assert sum(r["cached_tokens"] for r in rows.values()) > 0  # siblings hit the shared prompt
    assert all(len(r["block_hashes"]) == 5 for r in rows.values())  # 80 prompt tokens + output, full blocks
    assert all(r["first_scheduled_s"] <= r["first_token_s"] <= r["finish_s"] for r in rows.values())

    steps_t = read_telemetry(tmp_path, "steps")
    assert steps_t.num_rows == steps
    assert sum(steps_t.column("preemptions").to_pylist()) == preempted
    assert sum(steps_t.column("evictions").to_pylist()) > 0
    assert sum(steps_t.column("prefix_hits").to_pylist()) == s.kvpilot_stats.prefix_hits
    assert max(steps_t.column("pinned_blocks").to_pylist()) > 0
    assert not any(steps_t.column("hook_fallback").to_pylist())
    assert steps_t.column("model_failures").null_count == steps  # no registry policy: nothing to count
    assert sum(steps_t.column("prefill_tokens").to_pylist()) + sum(steps_t.column("decode_tokens").to_pylist()) > 0

    decisions = read_telemetry(tmp_path, "decisions")
    kinds = set(decisions.column("kind").to_pylist())
    assert kinds == {"admit", "preempt", "retain"}
    retained = [d for d in decisions.to_pylist() if d["kind"] == "retain"]
    assert {d["action"] for d in retained} == {"protect", "keep"} or {d["action"] for d in retained} == {"protect"}
    assert all(d["ttl_s"] == 5.0 for d in retained if d["action"] == "protect")
    for d in decisions.to_pylist():
        width = len(FEATURE_NAMES[d["kind"]])
        assert all(len(v) == width for v in d["features"])
        assert d["policy"] == "test-protect-tool-turns"
    # the feature names travel in the file metadata
    part = next((tmp_path / "decisions").glob("*.parquet"))
    md = pq.read_schema(part).metadata
    assert json.loads(md[b"kvpilot.feature_names"])["admit"] == list(FEATURE_NAMES["admit"])

    kv = read_telemetry(tmp_path, "kv_events")
    events = kv.column("event").to_pylist()
    assert "stored" in events and "removed" in events
    # a stored hash is the same int64 as in the requests' hash chains
    stored = {h for row in kv.to_pylist() if row["event"] == "stored" for h in row["block_hashes"]}
    assert set(rows["g1s0"]["block_hashes"][:5]) <= stored


def test_no_telemetry_dir_means_no_writer(vllm_engine, monkeypatch):
    from serving_hook import KVPilotScheduler

    monkeypatch.delenv("KVPILOT_TELEMETRY_DIR", raising=False)
    s = vllm_engine.make_scheduler(KVPilotScheduler, num_blocks=16)
    assert s.kvpilot_telemetry is None


def test_telemetry_dir_from_env(vllm_engine, monkeypatch, tmp_path):
    from serving_hook import KVPilotScheduler

    monkeypatch.setenv("KVPILOT_TELEMETRY_DIR", str(tmp_path))
    s = vllm_engine.make_scheduler(KVPilotScheduler, num_blocks=16)
    s.add_request(vllm_engine.make_request("one", fake_runner.prompt_tokens("one", 20), 3))
    runner = fake_runner.FakeRunner()
    while s.has_requests():
        runner.step(s)
    s.shutdown()
    from data.io import read_telemetry

    assert read_telemetry(tmp_path, "requests").column("request_id").to_pylist() == ["one"]
    assert read_telemetry(tmp_path, "steps").num_rows >= 3
