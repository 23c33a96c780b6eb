"""Asynchronous RL (simulator/async_rl.py): the throughput bound holds over random workloads, policies and weight-sync
modes; a saturated uniform case comes within 10 % of it; staleness never exceeds eta; the same seed gives the same
summary; bad settings are named errors (CLI exit 2); the synchronous trainer prices the same work."""

from __future__ import annotations

import dataclasses
import json
import math
import random
from pathlib import Path
from typing import Any

import pyarrow as pa
import pytest
from typer.testing import CliRunner

from data.io import write_workload
from data.schemas import WORKLOAD
from data.synth import SynthConfig, generate
from policy.vllm_default import VllmDefaultPolicy
from simulator.config import AsyncRL, SimulationError, Trainer
from simulator.simulation import Simulation, run_simulation
from simulator.workload import prepare_workload

pytestmark = pytest.mark.vllm

_VOLATILE = ("wall_s", "scheduler_s", "hook_s", "router_s", "simulator_overhead", "setup_s")


def _tiny(seed: int, steps: int = 3, prompts: int = 2, group: int = 2) -> pa.Table:
    """A few groups of the short mix (math / agentic search, multi-turn), code outputs cut short."""
    cfg = SynthConfig(steps=steps, prompts_per_step=prompts, group_size=group, seed=seed)
    d = {k: v for k, v in SynthConfig.preset("short").domains.items()}
    d["code"] = dataclasses.replace(d["code"], output_tokens=dataclasses.replace(d["code"].output_tokens, median=120),
                                    max_tokens=600)
    return generate(dataclasses.replace(cfg, domains=d))


def _uniform(steps: int, groups: int, group: int, prompt: int = 64, output: int = 32) -> pa.Table:
    """Single-turn requests of one length, no tools, no verifier."""
    rows = []
    for s in range(steps):
        for g in range(groups):
            gid = f"s{s}g{g}"
            for i in range(group):
                rows.append({"request_id": f"{gid}-{i}", "kind": "rollout", "step": s, "prompt_id": gid,
                             "group_id": gid, "group_size": group, "sample_index": i, "session_id": f"{gid}-{i}",
                             "turn": 0, "domain": "math", "paradigm": "math_verifier", "prompt_tokens": prompt,
                             "output_tokens": output, "max_tokens": output, "finish_reason": "length",
                             "block_size": 16, "block_hashes": [10_000 * (s + 1) + 10 * g + b for b in range(4)],
                             "arrival_s": None, "verify_latency_s": None})
    return pa.Table.from_pylist(rows, schema=WORKLOAD.schema)


def _growing(groups: int = 2, group: int = 2, turns: int = 4, first: tuple[int, ...] = ()) -> pa.Table:
    """One RL step of multi-turn sessions: each turn writes 32 tokens and its 1 s tool appends 32, so a session's
    context grows by 64 a turn, from ``first[g]`` tokens in group g (default 64)."""
    rows = []
    for g in range(groups):
        gid = f"s0g{g}"
        for i in range(group):
            sid = f"{gid}-{i}"
            for k in range(turns):
                prompt = (first[g] if g < len(first) else 64) + 64 * k
                last = k == turns - 1
                rows.append({"request_id": f"{sid}-t{k}", "kind": "rollout", "step": 0, "prompt_id": gid,
                             "group_id": gid, "group_size": group, "sample_index": i, "session_id": sid,
                             "turn": k, "domain": "math", "paradigm": "search_tool", "prompt_tokens": prompt,
                             "output_tokens": 32, "max_tokens": 32, "finish_reason": "stop" if last else "tool_call",
                             "block_size": 16,
                             "block_hashes": [100_000 * (g + 1) + 1_000 * i + b for b in range(prompt // 16)],
                             "tool": None if last else "python", "tool_latency_s": None if last else 1.0,
                             "tool_tokens": None if last else 32, "arrival_s": None, "verify_latency_s": None})
    return pa.Table.from_pylist(rows, schema=WORKLOAD.schema)


def _short_and_long(steps: int = 6) -> pa.Table:
    """Per step a group of short requests and a group of long ones."""
    rows = [r | ({"output_tokens": 200, "max_tokens": 200} if r["group_id"].endswith("g1") else {})
            for r in _uniform(steps=steps, groups=2, group=2).to_pylist()]
    return pa.Table.from_pylist(rows, schema=WORKLOAD.schema)


@pytest.mark.slow
def test_the_throughput_bound_holds_on_random_workloads(vllm_engine: Any) -> None:
    """20 random workloads, each under a policy and an async admission rule (cycled) and every weight-sync mode at a
    random eta, plus the synchronous trainer: no run beats its bound, and staleness never exceeds eta."""
    policies = ["vllm-default", "continuum", "infercept", "sjf-predicted", "working-set"]
    rng = random.Random(7)
    for i in range(20):
        prepared = prepare_workload(_tiny(seed=100 + i, steps=rng.choice([2, 3]), prompts=rng.choice([1, 2])))
        policy = policies[i % len(policies)]
        replicas = rng.choice([1, 1, 2])
        common = dict(replicas=replicas, router=rng.choice(["round-robin", "fewest-sessions"]),
                      kv_fraction=rng.choice([1.0, 2.0]), decode_stride=8, progress=False,
                      trainer=Trainer(mfu=rng.choice([0.05, 0.35]), train_batch=rng.choice([None, 1])))
        runs = [run_simulation(prepared, policy, **common).summary]
        eta = rng.choice([0, 1, 2, 4])
        admission = ("staleness", "kv-pressure", "working-set")[i % 3]
        for mode in ("abort", "recompute", "keep"):
            s = run_simulation(prepared, policy, driver="async", async_rl=AsyncRL(eta, mode, admission),
                               **common).summary
            assert s.trained.max_staleness <= eta, (i, mode)
            assert sum(s.trained.staleness_counts.values()) == s.metrics.trajectories == len(prepared.sessions)
            runs.append(s)
        for s in runs:
            bound = s.throughput_bound
            assert s.trained.trajectories_per_s <= bound.throughput_bound_trajectories_per_s * (1 + 1e-9), \
                (i, policy, s.driver)
            assert 0 < bound.throughput_over_bound <= 1 + 1e-9


def test_a_trainer_bound_uniform_run_comes_within_10_percent_of_the_bound(vllm_engine: Any) -> None:
    """A slow trainer and ample KV: with eta 2 the trainer never waits after the first batch."""
    trainer = Trainer(mfu=0.02, gpus=1, fixed_s=0.5)
    s = run_simulation(_uniform(steps=12, groups=2, group=4), "vllm-default", driver="async",
                       async_rl=AsyncRL(2, "keep"), trainer=trainer, kv_fraction=2.0, progress=False).summary
    assert s.throughput_bound.throughput_bound_binding == "trainer"
    assert s.throughput_bound.throughput_over_bound >= 0.9
    assert s.trained.trainer_idle_share < 0.1


def test_staleness_bound_and_versions(vllm_engine: Any) -> None:
    """A short group and a long one per batch: eta 0 waits like synchronous steps, eta 1 runs ahead by one
    version and never further; each trajectory spans the versions from its start to its end."""
    w = _short_and_long()
    for eta in (0, 1, 3):
        sim = Simulation(w, "vllm-default", driver="async", async_rl=AsyncRL(eta, "keep"), kv_fraction=2.0,
                         progress=False, trainer=Trainer(train_batch=2))
        result = sim.run()
        s = result.summary
        assert s.trained.max_staleness <= eta and s.driver.weight_updates == 6
        assert (s.trained.max_staleness == eta) if eta < 3 else s.trained.max_staleness >= 1
        for t in result.trajectories:
            assert 0 <= t.version_start <= t.version_end
        versions = [r.version for r in sim.driver.train_records]
        assert versions == list(range(6))


def test_weight_sync_modes_reprefill(vllm_engine: Any) -> None:
    """keep re-prefills nothing at an update; abort and recompute re-prefill the in-flight KV, and abort's
    resubmitted requests finish with exactly their tokens."""
    w = prepare_workload(_short_and_long())
    summaries = {}
    for mode in ("abort", "recompute", "keep"):
        sim = Simulation(w, "vllm-default", driver="async", async_rl=AsyncRL(2, mode), kv_fraction=2.0,
                         progress=False, trainer=Trainer(fixed_s=0.05, sync_fixed_s=0.05))
        result = sim.run()
        summaries[mode] = result.summary
        assert sim.finished == [1] * w.num_rows
        out = sum(result.requests.column("output_tokens").to_pylist())
        assert out == sum(w.output_tokens)  # abort's two attempts of a request sample its tokens once in all
    assert summaries["keep"].driver.reprefill_tokens_per_update == 0
    assert summaries["abort"].driver.reprefill_tokens_per_update > 0
    assert summaries["recompute"].driver.reprefill_tokens_per_update > 0
    assert summaries["keep"].prefix_cache_resets == 0
    assert summaries["abort"].prefix_cache_resets == summaries["abort"].driver.weight_updates


@pytest.mark.parametrize("mode", ["abort", "recompute", "keep"])
def test_a_weight_update_shorter_than_a_step_loses_no_request(vllm_engine: Any, mode: str) -> None:
    """A weight update acts on a busy replica at its step's end. When the update is over first (a long step at a
    large decode stride, a fast weight transfer), abort's requests come back at once: before, they waited for a
    sync end that had passed, and the run ended with the rows of many sessions of several steps unfinished."""
    w = prepare_workload(_tiny(7, steps=3, prompts=4, group=4))
    instant = Trainer(fixed_s=0.05, sync_fixed_s=0.0, link_bytes_per_s=1e18)  # the update ends within a step
    sim = Simulation(w, "vllm-default", driver="async", async_rl=AsyncRL(1, mode), kv_fraction=0.3, decode_stride=64,
                     progress=False, trainer=instant)
    result = sim.run()
    assert sim.finished == [1] * w.num_rows
    assert result.summary.driver.weight_updates >= 2
    out = sum(result.requests.column("output_tokens").to_pylist())
    assert out == sum(w.output_tokens)


def test_evaluate_sweeps_each_policy_and_kv_size_sync_and_async(vllm_engine: Any, tmp_path: Path) -> None:
    """``evaluate --driver async``: per policy (as listed, vllm-default first) and KV size, the synchronous run
    with the trainer and every (eta, mode) asynchronous run, each into its own folder; its rows and tables."""
    from training.cli import app

    path = tmp_path / "w.parquet"
    write_workload(_tiny(3, steps=2), path)
    out = tmp_path / "ev"
    res = CliRunner().invoke(app, ["evaluate", "-w", str(path), "-o", str(out), "--policies", "sortedrl",
                                   "--driver", "async", "--staleness", "1", "--weight-sync", "abort,keep",
                                   "--kv-fractions", "0.6,1.0", "--decode-stride", "16", "--no-progress"])
    assert res.exit_code == 0, res.output
    rows = json.loads((out / "async_summary.json").read_text())
    assert [(r["policy"], r["kv_fraction"], r["run"]) for r in rows] == [
        (p, k, run) for p in ("vllm-default", "sortedrl") for k in (0.6, 1.0)
        for run in ("sync", "async-eta1-abort", "async-eta1-keep")]
    assert all(r["error"] is None and r["trajectories_per_s"] > 0 for r in rows)
    assert all(r["ratio_vs_sync"] == 1.0 for r in rows if r["run"] == "sync")
    assert (out / "sortedrl-kv1-r1" / "async-eta1-keep" / "summary.json").is_file()


def test_same_seed_same_summary(vllm_engine: Any) -> None:
    w = prepare_workload(_tiny(seed=9))
    a, b = (run_simulation(w, "continuum", driver="async", async_rl=AsyncRL(1, "abort"), kv_fraction=0.8,
                           progress=False).summary for _ in range(2))
    a, b = a.to_dict(), b.to_dict()
    assert {k: v for k, v in a.items() if k not in _VOLATILE} == {k: v for k, v in b.items() if k not in _VOLATILE}


def test_sync_trainer_prices_the_same_work(vllm_engine: Any) -> None:
    """--trainer adds a training step and a weight update after each synchronous step, and nothing else."""
    w = prepare_workload(_tiny(seed=11))
    plain = run_simulation(w, "vllm-default", kv_fraction=1.0, progress=False).summary
    trained = run_simulation(w, "vllm-default", kv_fraction=1.0, progress=False, trainer=Trainer()).summary
    assert plain.driver.weight_updates == 0 and trained.driver.weight_updates == len(w.steps)
    assert trained.metrics.prefix_hit_rate == plain.metrics.prefix_hit_rate
    assert trained.metrics.makespan_per_step_s == pytest.approx(plain.metrics.makespan_per_step_s)
    assert trained.trained.run_s > plain.trained.run_s == pytest.approx(plain.metrics.simulated_s)
    assert trained.trained.max_staleness == 0


@pytest.mark.parametrize("options, match", [
    ({"async_rl": AsyncRL(1)}, "async_rl settings need driver='async'"),
    ({"driver": "asynchronous"}, "unknown driver"),
])
def test_bad_settings_are_named_errors(options: dict[str, Any], match: str) -> None:
    with pytest.raises(SimulationError, match=match):
        Simulation(_uniform(1, 1, 1), **options)


@pytest.mark.parametrize("make, match", [
    (lambda: AsyncRL(-1), "staleness"), (lambda: AsyncRL(1.5), "staleness"),
    (lambda: AsyncRL(1, "flush"), "weight-sync mode"), (lambda: AsyncRL(1, admission="x"), "admission"),
    (lambda: Trainer(mfu=0), "mfu"), (lambda: Trainer(train_batch=0), "train_batch"),
    (lambda: Trainer(link_bytes_per_s=-1), "link_bytes_per_s"),
])
def test_bad_values(make: Any, match: str) -> None:
    with pytest.raises(SimulationError, match=match):
        make()


@pytest.mark.parametrize("args, match", [
    (["--driver", "async", "--staleness", "-1"], "staleness"),
    (["--driver", "async", "--weight-sync", "flush"], "unknown weight-sync mode 'flush'"),
    (["--driver", "async", "--train-batch", "0"], "train_batch must be an integer >= 1"),
    (["--train-batch", "2"], "--train-batch needs --trainer"),
    (["--driver", "async", "--admission", "fifo"], "unknown async admission 'fifo'"),
    (["--driver", "async", "--max-groups", "0"], "Invalid value for '--max-groups'"),
    (["--max-groups", "2"], "--max-groups needs --driver async"),
    (["--admission", "working-set"], "--admission needs --driver async"),
    (["--staleness", "2"], "--staleness needs --driver async"),
    (["--weight-sync", "abort"], "--weight-sync needs --driver async"),
    (["--driver", "bogus"], "unknown driver 'bogus'"),
])
def test_cli_bad_async_settings_exit_2(tmp_path: Path, args: list[str], match: str) -> None:
    from training.cli import app

    path = tmp_path / "w.parquet"
    write_workload(_uniform(1, 1, 1), path)
    out = tmp_path / "out"
    res = CliRunner().invoke(app, ["simulate", "-w", str(path), "-o", str(out), "--no-progress", *args])
    assert res.exit_code == 2, res.output
    assert match in res.output
    assert not out.exists() or not any(out.iterdir())


def _group_spans(result: Any) -> list[list[float]]:
    """Each GRPO group's [first start, last end] (its sessions are ``<group>-<i>``), in start order."""
    groups: dict[str, list[float]] = {}
    for t in result.trajectories:
        g = groups.setdefault(t.session_id.rsplit("-", 1)[0], [math.inf, -math.inf])
        g[0], g[1] = min(g[0], t.start_s), max(g[1], t.end_s)
    return sorted(groups.values())


def _overlap(spans: list[list[float]]) -> bool:
    """Whether some group started before the one started before it had ended."""
    return any(b[0] < a[1] for a, b in zip(spans, spans[1:]))


def test_max_groups_caps_the_groups_in_flight(vllm_engine: Any, tmp_path: Path) -> None:
    """``--max-groups 1``: each group starts once the one before it has ended (AReaL's rule alone runs several at
    once); the CLI's run is the library's with ``max_concurrent_groups``."""
    import json

    from training.cli import app

    w = _uniform(steps=2, groups=2, group=2)

    def spans(cap):
        res = Simulation(w, "vllm-default", driver="async", kv_fraction=2.0, progress=False, trainer=Trainer(),
                         async_rl=AsyncRL(2, "keep", max_concurrent_groups=cap)).run()
        return _group_spans(res), res.summary.to_dict()["trajectories_per_s"]

    capped, tps = spans(1)
    assert not _overlap(capped)
    free, _ = spans(None)
    assert _overlap(free)
    path = tmp_path / "w.parquet"
    write_workload(w, path)
    res = CliRunner().invoke(app, ["simulate", "-w", str(path), "-o", str(tmp_path / "o"), "--no-progress", "--json",
                                   "--driver", "async", "--staleness", "2", "--kv-fraction", "2", "--max-groups", "1"])
    assert res.exit_code == 0, res.output
    rows = json.loads(res.output[res.output.index("["):res.output.rindex("]") + 1])
    assert [r["trajectories_per_s"] for r in rows if r["run"] != "sync"] == [pytest.approx(tps)]


@pytest.mark.slow
def test_every_policy_and_router_runs_async(vllm_engine: Any) -> None:
    """Every baseline (rollpacker's tail batching, a synchronous driver of its own, is a named error) and every
    router runs under the async driver and trains every trajectory."""
    from simulator.routers import ROUTERS
    from training.grid import resolve_policies

    w = prepare_workload(_tiny(seed=3, steps=2, prompts=1))
    opts: dict[str, Any] = dict(driver="async", async_rl=AsyncRL(1, "keep"), kv_fraction=1.0, decode_stride=8,
                                progress=False)
    for name in resolve_policies("all") + ["version-aware"]:
        if name == "rollpacker":
            with pytest.raises(SimulationError, match="tail batching"):
                Simulation(w, name, **opts)
            continue
        assert run_simulation(w, name, **opts).summary.metrics.trajectories == len(w.sessions), name
    for router in ROUTERS:
        s = run_simulation(w, "vllm-default", replicas=2, router=router, **opts).summary
        assert s.metrics.trajectories == len(w.sessions), router


def test_version_aware_eviction_lists_dead_versions_first() -> None:
    from data.records import CachedPrefix, Event, EventKind, OwnerState, RequestMeta
    from policy.catalog import create_policy

    p = create_policy("version-aware")
    meta = {v: RequestMeta(session_id=f"s{v}", weight_version=v) for v in (0, 1)}
    for v in (0, 1):
        p.on_event(Event(EventKind.ARRIVED, 0.0, f"r{v}", meta[v]))
    p.on_event(Event(EventKind.FINISHED, 1.0, "r0", meta[0], finish_reason="stop"))  # version 0: no live session
    p.on_event(Event(EventKind.FINISHED, 1.0, "r1", meta[1], finish_reason="tool_call"))  # still live
    prefixes = [CachedPrefix(f"r{v}", f"r{v}", OwnerState.FINISHED, meta[v], (v,), (v,), 1.0) for v in (1, 0)]
    decision = p.evict(prefixes, 1, None)
    assert p.live_versions() == {1} and list(decision.order) == ["r0"]
    unversioned = [CachedPrefix("x", "x", OwnerState.FINISHED, RequestMeta(session_id="x"), (5,), (5,), 0.0)]
    assert p.evict(unversioned, 1, None) is None  # synchronous runs: LRU


def test_fewest_sessions_router() -> None:
    """A new session goes to the replica with the fewest live sessions; an ended session frees its place."""
    from simulator.routers import ReplicaLoad, RouteRequest, make_router

    r = make_router("fewest-sessions")
    loads = [ReplicaLoad(0, 5), ReplicaLoad(1, 0)]
    req = lambda s: RouteRequest(f"{s}-0", [], 16, 16, s, s)  # noqa: E731
    assert [r.route(req(s), loads) for s in ("a", "b", "c")] == [1, 0, 1]  # ties by load, then sessions
    r.on_session_end("a")
    r.on_session_end("c")
    assert r.route(req("d"), loads) == 1 and r.active_sessions(0) == 1


class _WithPrior(VllmDefaultPolicy):
    """vLLM's own behaviour, carrying a logged prior of session contexts as kvpilot's learned policy does."""

    def __init__(self, mean_peak: float) -> None:
        super().__init__()
        self.session_contexts = {"math": {"mean_peak": mean_peak, "sessions": 64.0}}


def test_working_set_admission_fits_the_predicted_working_set_in_memory(vllm_engine: Any) -> None:
    """working-set starts a group only while the predicted peak contexts of the sessions in flight and its own
    fit in GPU KV: at 256 tokens of KV, groups of two 96-token sessions run one at a time (AReaL's rule runs
    them together); with ample KV, or a prior that predicts small sessions, they overlap. ``auto`` is
    working-set for a policy with a prior and AReaL's rule otherwise."""
    w = prepare_workload(_uniform(steps=2, groups=2, group=2))  # 96 tokens per session at its end

    def run(policy: Any, admission: str, **kv: Any) -> tuple[list[list[float]], str]:
        sim = Simulation(w, policy, driver="async", progress=False, trainer=Trainer(),
                         async_rl=AsyncRL(2, "keep", admission), **kv)
        return _group_spans(sim.run()), sim.driver.spec.admission

    tight = {"kv_blocks": 17}  # 16 blocks of 16 tokens beside vLLM's null block
    spans, resolved = run("vllm-default", "working-set", **tight)
    assert not _overlap(spans) and resolved == "working-set"  # no prior: a session may reach the largest request
    assert run("vllm-default", "working-set", **tight) == (spans, resolved)  # the same run twice
    assert run("vllm-default", "auto", **tight) == run("vllm-default", "staleness", **tight)
    assert _overlap(run("vllm-default", "staleness", **tight)[0])
    assert _overlap(run("vllm-default", "working-set", kv_fraction=4.0)[0])
    spans, resolved = run(lambda: _WithPrior(10.0), "auto", **tight)
    assert _overlap(spans) and resolved == "working-set"  # the first two groups' prompts (4 x 64) fit


def test_working_set_holds_the_younger_groups_turns_while_the_older_contexts_do_not_fit(vllm_engine: Any,
                                                                                        tmp_path: Path) -> None:
    """A prior that predicts small sessions starts two groups of growing sessions together in 512 tokens of KV.
    As their contexts outgrow it, working-set holds the younger group's next turns (never the older group's) until
    a session's end makes room: the older group then ends sooner, with less recomputed, than under AReaL's rule,
    which starts the same two groups and holds nothing. With ample KV nothing is held."""
    import pyarrow.parquet as pq

    w = prepare_workload(_growing())

    def run(admission: str, **kv: Any) -> tuple[Any, list[list[float]], dict[str, float]]:
        out = tmp_path / f"{admission}-{len(list(tmp_path.iterdir()))}"
        sim = Simulation(w, lambda: _WithPrior(10.0), driver="async", progress=False, trainer=Trainer(),
                         async_rl=AsyncRL(2, "keep", admission), out_dir=out, **kv)
        result = sim.run()
        r = pq.read_table(out / "telemetry" / "requests").sort_by([("session_id", "ascending"), ("turn", "ascending")])
        held: dict[str, float] = {}  # per group: the seconds its turns arrived after their tool had returned
        rows = r.to_pylist()
        for prev, req in zip(rows, rows[1:]):
            if req["session_id"] == prev["session_id"]:
                g = req["group_id"]
                held[g] = held.get(g, 0.0) + req["arrival_s"] - (prev["finish_s"] + 1.0)
        return result.summary, _group_spans(result), held

    tight = {"kv_blocks": 33}  # 32 blocks of 16 tokens: two growing groups' contexts outgrow it at their third turn
    held, spans, waits = run("working-set", **tight)
    free, free_spans, free_waits = run("staleness", **tight)
    assert held.driver.held_turns > 0 and free.driver.held_turns == 0
    assert held.driver.held_turn_s > 0 and waits["s0g1"] == pytest.approx(held.driver.held_turn_s)  # younger only
    assert waits["s0g0"] == pytest.approx(0.0, abs=1e-6) and max(free_waits.values()) == pytest.approx(0.0, abs=1e-6)
    assert spans[0][0] == spans[1][0] == free_spans[0][0] == free_spans[1][0]  # both groups started at once
    assert spans[0][1] < free_spans[0][1]  # the older group ends sooner
    assert held.metrics.recomputed_tokens < free.metrics.recomputed_tokens
    assert run("working-set", kv_fraction=4.0)[0].driver.held_turns == 0


def test_the_hooks_width_holds_the_younger_groups_turns_in_the_engine_and_never_idles_it(vllm_engine: Any,
                                                                                         tmp_path: Path) -> None:
    """The width in the serving hook: with the learned policy (no trained network) and AReaL's rule alone in the
    client, the younger group's turns wait in vLLM's queue (the steps telemetry counts them, each request's
    ``held_s`` says how long), the older group's never. Unlike the async driver's own working-set holds, which keep
    the engine idle while the older group waits on its tools (the same spans as the hook's first version, and less
    throughput than no holds at all), the hook's are work-conserving: an idle engine takes a held turn, so the run
    keeps the throughput of no holds while recomputing less."""
    import pyarrow.parquet as pq

    from policy.learned.policy import LearnedPolicy
    from policy.learned.scorer import build_scorer

    state = {k: v.detach().numpy() for k, v in build_scorer().state_dict().items()}
    w = prepare_workload(_growing())

    def run(width: bool, admission: str) -> tuple[dict[str, Any], list[list[float]], Any, Any]:
        def policy() -> LearnedPolicy:
            p = LearnedPolicy(state, None, width=width)
            p.session_contexts = {"math": {"mean_peak": 10.0, "sessions": 64.0}}  # both groups start at once
            return p

        out = tmp_path / f"{width}-{admission}"
        result = Simulation(w, policy, driver="async", progress=False, trainer=Trainer(), kv_blocks=33,
                            async_rl=AsyncRL(2, "keep", admission), out_dir=out).run()
        return (result.summary.to_dict(), _group_spans(result), pq.read_table(out / "telemetry" / "requests"),
                result.steps)

    hook, hook_spans, requests, steps = run(True, "staleness")
    driver, driver_spans, _, _ = run(False, "working-set")
    free, free_spans, free_requests, _ = run(False, "staleness")
    assert driver["held_turns"] > 0 and hook["held_turns"] == 0 and sum(steps["held"].to_pylist()) > 0
    held = {r: s for r, s in zip(requests["request_id"].to_pylist(), requests["held_s"].to_pylist()) if s > 0}
    assert held and {r.split("-")[0] for r in held} == {"s0g1"}  # the younger group's turns only
    assert max(free_requests["held_s"].to_pylist()) == 0.0
    assert hook_spans[0][0] == hook_spans[1][0] == driver_spans[1][0]  # both groups started at once
    assert driver["trajectories_per_s"] < 0.9 * free["trajectories_per_s"]  # idling behind the tools costs
    assert hook["trajectories_per_s"] >= 0.99 * free["trajectories_per_s"]
    assert hook["recomputed_tokens"] < free["recomputed_tokens"] and hook_spans[0][1] <= free_spans[0][1]


def test_a_younger_groups_turn_that_fits_goes_while_an_older_groups_turn_waits(vllm_engine: Any,
                                                                               tmp_path: Path) -> None:
    """Backfill: three groups start together, the middle one's sessions long and the youngest one's short. The
    middle group's second session waits at once (two running contexts and their host copies do not fit); the
    youngest group's short turns, which do fit, go meanwhile (holding them behind it measured slower); the
    oldest group's turns never wait."""
    import pyarrow.parquet as pq

    from policy.baselines.offload_tier import VllmOffloadPolicy

    class OffloadWithPrior(VllmOffloadPolicy):
        session_contexts = {"math": {"mean_peak": 10.0, "sessions": 64.0}}

    w = prepare_workload(_growing(groups=3, turns=4, first=(16, 608, 16)))
    # 1,024 tokens of GPU KV, 1,024 of tier: the long group's second session waits at once (two running contexts
    # and their host copies), where the short group's turns, started beside it, would fit
    sim = Simulation(w, OffloadWithPrior, driver="async", progress=False, trainer=Trainer(),
                     async_rl=AsyncRL(2, "keep", "working-set"), out_dir=tmp_path / "o", kv_blocks=65,
                     offload_gib=64 * 16 * 57_344 / 2**30)
    assert sim.offload_blocks == 64
    summary = sim.run().summary
    rows = pq.read_table(tmp_path / "o" / "telemetry" / "requests").sort_by(
        [("session_id", "ascending"), ("turn", "ascending")]).to_pylist()
    start = {}  # a group's start: its first arrival
    for r in rows:
        start[r["group_id"]] = min(start.get(r["group_id"], math.inf), r["arrival_s"])
    ready = [start[r["group_id"]] if r["turn"] == 0 else prev["finish_s"] + 1.0  # its tool returned
             for prev, r in zip([None, *rows], rows)]
    held = [(r["group_id"], t, r["arrival_s"]) for r, t in zip(rows, ready) if r["arrival_s"] > t + 1e-6]
    assert summary.driver.held_turns > 0 and "s0g0" not in {g for g, _, _ in held}
    since, sent = next((since, sent) for g, since, sent in held if g == "s0g1")
    assert any(r["group_id"] == "s0g2" and since <= r["arrival_s"] < sent for r in rows)

