"""``kvpilot replay`` without a server: its checks, its prompts, its /metrics parsing, and its CLI errors.
(Against a real server: tests/test_engine_server.py.)"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from typer.testing import CliRunner

from training.replay import ReplayConfig, Replayer, ReplayError, ServerInfo, check_fits, parse_counters

METRICS = """\
# HELP kvpilot_hook_info The kvpilot scheduler hook runs in this server's engine
# TYPE kvpilot_hook_info gauge
kvpilot_hook_info{policy="working-set"} 1.0
# TYPE vllm:prefix_cache_queries_total counter
vllm:prefix_cache_queries_total{engine="0",model_name="m"} 100.0
vllm:prefix_cache_queries_total{engine="1",model_name="m"} 20.0
# TYPE vllm:prefix_cache_hits_total counter
vllm:prefix_cache_hits_total{engine="0",model_name="m"} 64.0
# TYPE vllm:num_preemptions_total counter
vllm:num_preemptions_total{engine="0",model_name="m"} 3.0
# TYPE vllm:inter_token_latency_seconds histogram
vllm:inter_token_latency_seconds_bucket{engine="0",le="0.01",model_name="m"} 30.0
vllm:inter_token_latency_seconds_bucket{engine="0",le="+Inf",model_name="m"} 40.0
vllm:inter_token_latency_seconds_count{engine="0",model_name="m"} 40.0
vllm:inter_token_latency_seconds_sum{engine="0",model_name="m"} 0.6
"""


@pytest.fixture(scope="module")
def workload():
    from data.synth import SynthConfig, generate
    from simulator.workload import prepare_workload

    base = SynthConfig.preset("short")
    domains = {k: dataclasses.replace(d, max_tokens=24) for k, d in base.domains.items()}
    return prepare_workload(generate(dataclasses.replace(base, steps=1, prompts_per_step=8, group_size=2, seed=2,
                                                         domains=domains)))


def test_counters_sum_over_engines_and_find_the_hook():
    counters, hook = parse_counters(METRICS)
    assert counters == {"prefix_cache_queries": 120.0, "prefix_cache_hits": 64.0, "preemptions": 3.0,
                        "inter_token_sum": 0.6, "inter_token_count": 40.0}  # the buckets are not summed in
    assert hook == {"policy": "working-set"}
    assert parse_counters(METRICS.split("# TYPE vllm:prefix")[0].replace("kvpilot", "other"))[1] is None


@pytest.mark.parametrize("kwargs, match", [
    ({"concurrency": 0}, "--concurrency"), ({"time_scale": -1.0}, "--time-scale"),
    ({"time_scale": float("nan")}, "--time-scale"), ({"timeout_s": 0.0}, "--timeout"),
    ({"timeout_s": float("nan")}, "--timeout"), ({"url": "http://127.0.0.1:99999"}, "--url .*range"),
    ({"url": "localhost:8000"}, r"--url .*http\(s\)://HOST"), ({"url": "http://[::1"}, "--url")])
def test_config_refuses_bad_values(kwargs, match):
    with pytest.raises(ReplayError, match=match):
        ReplayConfig(**{"url": "http://x", **kwargs})


def test_a_request_longer_than_the_model_is_named(workload):
    need = np.asarray(workload.prompt_tokens) + np.asarray(workload.output_tokens)
    check_fits(workload, int(need.max()), "http://s")
    with pytest.raises(ReplayError) as err:
        check_fits(workload, int(need.max()) - 1, "http://s")
    longest = workload.request_id[int(np.argmax(need))]
    assert f"request {longest} needs {need.max()} tokens" in str(err.value)
    assert "max_model_len" in str(err.value) and "http://s" in str(err.value)


def test_prompts_carry_what_the_stream_generated(workload):
    """A later request of a stream reads the tokens its predecessors really generated, where the workload has
    their outputs; the rest is the workload's expansion, so prefix sharing stays exact."""
    w = workload
    rep = Replayer(w, ReplayConfig("http://x"), None, ServerInfo("m", 4096, None, {}), None)
    sessions = [s for s in w.sessions if s.scoring or len(s.turns) > 1]
    assert sessions
    s = sessions[0]
    first = s.turns[0]
    later = (s.turns[1:] + s.scoring)[0]
    start, n = w.prompt_tokens[first], w.output_tokens[first]
    assert rep.prompt(later) == w.tokens.prompt_ids(later).tolist()  # nothing generated yet
    generated = [7] * n
    rep.generated[int(w.tokens.stream[first])] = [(start, generated)]
    ids = rep.prompt(later)
    expected = w.tokens.prompt_ids(later)
    expected[start : start + n] = generated[: len(expected) - start]
    assert ids == expected.tolist() and ids[start] == 7 and ids[:start] == w.tokens.prompt_ids(first).tolist()
    body = rep.body(later)
    assert body["max_tokens"] == body["min_tokens"] == w.output_tokens[later] and body["ignore_eos"] is True
    assert body["vllm_xargs"]["kvpilot_session_id"] == w.session_id[later]
    assert all(v is not None for v in body["vllm_xargs"].values())
    assert body["stream"] is True and body["stream_options"] == {"include_usage": True}
    plain = Replayer(w, ReplayConfig("http://x", stream=False), None, ServerInfo("m", 4096, None, {}), None)
    body = plain.body(later)
    assert body["stream"] is False and "stream_options" not in body  # one JSON answer, its usage in it


def test_requests_a_failure_leaves_unsent_are_counted(workload):
    """A failed turn loses its trajectory: the later turns and scoring requests never sent are counted (and the
    progress bar reaches its total), so every row is a completed, failed or unsent request."""
    import asyncio

    import httpx

    from training.replay import _summary, render_replay

    class Bar:
        n = 0

        def update(self, k):
            self.n += k

    async def run():
        transport = httpx.MockTransport(lambda request: httpx.Response(500, text="down"))
        async with httpx.AsyncClient(transport=transport) as client:
            rep = Replayer(workload, ReplayConfig("http://x", time_scale=0.0), client,
                            ServerInfo("m", 4096, None, {}), bar)
            await rep.all_steps()
            return rep.run

    bar = Bar()
    r = asyncio.run(run())
    assert r.completed == 0 and len(r.failed) == len(workload.sessions)  # each trajectory's first turn
    assert r.not_sent == workload.num_rows - len(workload.sessions) > 0
    assert bar.n == workload.num_rows
    s = _summary(r, ServerInfo("m", 4096, None, {"prefix_cache_queries": 0.0, "prefix_cache_hits": 0.0,
                                                "preemptions": 0.0}), None, 1.0)
    assert s["not_sent"] == r.not_sent and f"{r.not_sent} never sent" in render_replay(s)


def test_cli_exits_2_on_a_missing_workload(tmp_path):
    from training.cli import app

    result = CliRunner().invoke(app, ["replay", "--url", "http://127.0.0.1:9", "-w", str(tmp_path / "none.parquet"),
                                      "--no-progress"])
    assert result.exit_code == 2
    assert "none.parquet" in result.output
    both = CliRunner().invoke(app, ["replay", "--url", "http://127.0.0.1:9", "-w", str(tmp_path / "none.parquet"),
                                    "--driver", "async", "--no-stream"])
    assert both.exit_code == 2 and "--driver async streams its answers" in both.output


def _server(metrics: str):
    """An httpx transport standing for a vLLM server whose /metrics page is ``metrics``."""
    import httpx

    def handle(request):
        if request.url.path == "/v1/models":
            return httpx.Response(200, json={"data": [{"id": "m", "max_model_len": 4096}]})
        return httpx.Response(200, text=metrics)

    return httpx.MockTransport(handle)


def test_a_probe_that_cannot_read_the_server_is_a_replay_error():
    """A malformed URL, or a /metrics page that is not Prometheus text: named errors, not tracebacks."""
    import asyncio

    import httpx

    from training.replay import probe

    async def run(url: str, metrics: str):
        async with httpx.AsyncClient(transport=_server(metrics)) as client:
            return await probe(client, url)

    assert asyncio.run(run("http://s", METRICS)).hook == {"policy": "working-set"}
    with pytest.raises(ReplayError, match="no Prometheus text"):
        asyncio.run(run("http://s", "<html>hello{</html>\n"))
    with pytest.raises(ReplayError, match=r"cannot reach the server at http://\[::1"):
        asyncio.run(run("http://[::1", METRICS))


def test_a_replay_whose_last_probe_failed_keeps_its_measurements():
    """The counters after the run unknown (the last /metrics probe failed): the summary keeps everything the client
    measured, the server's counters as None, and says why."""
    from training.replay import _Run, _summary, render_replay

    run = _Run()
    run.completed, run.turns, run.steps, run.output_tokens = 4, 4, [2.5], 40
    run.warnings.append("the server's counters after the replay are unknown: ...")
    s = _summary(run, ServerInfo("m", 4096, {}, {"prefix_cache_queries": 1.0, "prefix_cache_hits": 0.0,
                                                  "preemptions": 0.0}), None, 3.0)
    assert s["requests"] == 4 and s["makespan_s"] == 2.5 and s["output_tokens"] == 40
    assert s["preemptions"] is None and s["prefix_cache_hits"] is None and s["prefix_hit_rate"] is None
    assert s["engine_inter_token_s"] is None
    text = render_replay(s)
    assert "hit rate unknown" in text and "preemptions         unknown" in text and "counters after" in text
    assert "inter-token time unknown" in text
    # with both probes: the engine's mean inter-token time over the replay alone (the histogram's deltas)
    before = {"prefix_cache_queries": 1.0, "prefix_cache_hits": 0.0, "preemptions": 0.0, "inter_token_sum": 2.0,
              "inter_token_count": 100.0}
    after = {**before, "inter_token_sum": 2.5, "inter_token_count": 120.0}
    s = _summary(run, ServerInfo("m", 4096, {}, before), after, 3.0)
    assert s["engine_inter_token_s"] == pytest.approx(0.025) and "inter-token time 25.0 ms" in render_replay(s)


def _fake_server(log: list):
    """An httpx transport standing for a vLLM server with the weight-update endpoints: every completion streams
    its ``max_tokens`` ids; each call is logged as (path, query, body)."""
    import json

    import httpx

    def handle(request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content) if request.content else None
        log.append((request.url.path, request.url.query.decode(), body))
        if request.url.path != "/v1/completions":
            return httpx.Response(200, json={"status": "ok"})
        n = body["max_tokens"]
        chunks = [{"choices": [{"token_ids": [7] * n, "finish_reason": "length"}]},
                  {"choices": [], "usage": {"prompt_tokens": len(body["prompt"]), "completion_tokens": n}}]
        text = "".join(f"data: {json.dumps(c)}\n\n" for c in chunks) + "data: [DONE]\n\n"
        return httpx.Response(200, text=text, headers={"content-type": "text/event-stream"})

    return httpx.MockTransport(handle)


@pytest.mark.parametrize("eta, mode", [(0, "keep"), (1, "recompute"), (2, "abort")])
def test_the_async_replay_trains_within_the_staleness_bound_and_updates_through_the_servers_endpoints(eta, mode):
    """``replay --driver async``'s controller against a stand-in server: every trajectory trained once, none past
    eta; each weight update a /pause in the mode's way then a /resume; every request carries its group's start
    version (and, for keep, the cache salt of it); later groups start at later versions."""
    import asyncio

    import httpx

    from data.synth import SynthConfig, generate
    from simulator.workload import prepare_workload
    from training.replay import ServerInfo
    from training.replay_async import AsyncReplay, TrainedReplayer

    w = prepare_workload(generate(dataclasses.replace(SynthConfig.preset("short"), steps=3, prompts_per_step=2,
                                                      group_size=2, seed=5)))
    log: list = []
    spec = AsyncReplay("async", None, eta, mode)

    async def run():
        async with httpx.AsyncClient(transport=_fake_server(log)) as client:
            info = ServerInfo("m", 1 << 20, None, {})
            rep = TrainedReplayer(w, ReplayConfig("http://x", time_scale=0.0), client, info, None, spec=spec)
            await rep.all_steps()
            return rep

    rep = asyncio.run(run())
    s = rep.extra_summary(1.0)
    assert rep.run.failed == [] and rep.run.completed == w.num_rows
    assert s["trained_trajectories"] == len(w.sessions) and s["max_staleness"] <= eta
    assert s["weight_updates"] == 3  # one per batch of the first step's 2 groups
    pauses = [q for path, q, _ in log if path == "/pause"]
    expected = {"keep": "mode=keep&clear_cache=false", "recompute": "mode=keep&clear_cache=true",
                "abort": "mode=abort&clear_cache=true"}[mode]
    assert pauses == [expected] * 3 and sum(path == "/resume" for path, _, _ in log) == 3
    sent = [b for path, _, b in log if path == "/v1/completions"]
    versions = {b["vllm_xargs"]["kvpilot_session_id"]: b["vllm_xargs"]["kvpilot_weight_version"] for b in sent
                if "kvpilot_session_id" in b["vllm_xargs"]}
    assert sorted(set(versions.values())) == list(range(3 if eta == 0 else 2 if eta == 1 else 1))
    assert all(("cache_salt" in b) == (mode == "keep") for b in sent)
    assert all(b["cache_salt"] == f"kvpilot-v{b['vllm_xargs']['kvpilot_weight_version']}" for b in sent
               if mode == "keep")


def test_a_connection_dropped_before_any_answer_is_tried_once_more(workload):
    """The server closing an idle keep-alive connection as the client reuses it costs no trajectory: a request
    that got nothing back is sent once more (counted in ``retried``); one that fails again is lost."""
    import asyncio

    import httpx

    log: list = []
    ok = _fake_server(log)
    calls: dict[str, int] = {}

    def flaky(request: httpx.Request) -> httpx.Response:
        rid = request.headers.get("X-Request-Id", "")
        calls[rid] = calls.get(rid, 0) + 1
        if request.url.path == "/v1/completions" and (calls[rid] == 1 or rid.endswith("-0-t0")):
            raise httpx.ReadError("connection closed")
        return ok.handle_request(request)

    async def run():
        async with httpx.AsyncClient(transport=httpx.MockTransport(flaky)) as client:
            rep = Replayer(workload, ReplayConfig("http://x", time_scale=0.0), client, ServerInfo("m", 4096, None, {}),
                           None)
            await rep.all_steps()
            return rep.run

    r = asyncio.run(run())
    always = [rid for rid in calls if rid.endswith("-0-t0")]
    assert always and len(r.failed) == len(always) and all(calls[rid] == 2 for rid in always)
    assert r.retried == len(calls) and r.completed + len(r.failed) + r.not_sent == workload.num_rows
