"""``kvpilot replay``: a workload's RL steps against a running OpenAI-compatible vLLM server, as a rollout client.

It drives the server as :mod:`simulator.drivers` drives the simulated engine: each RL step released at once
(every trajectory's first turn), each session's next turn sent after its turn's ``tool_latency_s``, a
trajectory's verifier and reward-model scoring requests after its last turn, each scoring request parsed for
its own ``verify_latency_s``, and the next step released when the last trajectory of this one is verified
(the step barrier). Waits scale by ``time_scale`` (0: none).

Prompts are token ids: the workload's hash chains expanded (:class:`simulator.tokens.WorkloadTokens`), with
the tokens each earlier request of the stream really generated put where the workload has its output, as an
agent framework builds the next turn's context; so the server sees exactly the workload's prefix sharing. The
output length is forced (``max_tokens`` = ``min_tokens`` = the workload's ``output_tokens``, ``ignore_eos``).
Each request names its session the ways frameworks do: the ``X-Session-ID`` header and ``vllm_xargs`` with the
``kvpilot_*`` keys the hook reads (:mod:`serving_hook.metadata`).

Before anything is sent the server is checked (reachable, its model's ``max_model_len`` fits every request,
the kvpilot hook present unless ``require_hook`` is off): a failure raises :class:`ReplayError` naming it.
"""

from __future__ import annotations

import asyncio
import json
import math
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Optional
from urllib.parse import urlsplit

import httpx
import numpy as np

from simulator.workload import PreparedWorkload

__all__ = ["ReplayConfig", "ReplayError", "Replayer", "Streamed", "base_url", "probe", "replay", "render_replay"]

#: The /metrics line the kvpilot plugin adds in a server that runs the hook (serving_hook.plugin).
HOOK_METRIC = "kvpilot_hook_info"
_COUNTERS = {
    "prefix_cache_queries": "vllm:prefix_cache_queries",
    "prefix_cache_hits": "vllm:prefix_cache_hits",
    "preemptions": "vllm:num_preemptions",
}
#: vLLM's histograms whose sums and counts a replay reads: the engine's time between a request's consecutive tokens
#: (engine-core timestamps, so one engine step while the request runs), stock vLLM's and the hook's alike.
_HISTOGRAMS = {"inter_token": "vllm:inter_token_latency_seconds"}


class ReplayError(ValueError):
    """A replay that cannot start: the server, its model or the workload (the message names which)."""


@dataclass(frozen=True)
class ReplayConfig:
    """How to replay: the server, the client's concurrency and time scale, the RL framework's cache reset."""

    url: str
    concurrency: int = 64
    time_scale: float = 1.0
    timeout_s: float = 600.0
    require_hook: bool = True
    #: Reset the server's prefix cache before every step after the first (weight sync), as `simulate` does by
    #: default; needs the server's ``/reset_prefix_cache`` (``VLLM_SERVER_DEV_MODE=1``), else a warning.
    reset_between_steps: bool = True
    progress: bool = True
    #: Stream each answer (server-sent events, one per token): the client measures TTFT and TPOT. Off: one JSON
    #: answer per request, as RL frameworks' rollout clients ask, and no per-token work in the API server or client
    #: beside the engine (``--no-stream``; the synchronous driver only: the async one resumes aborted streams).
    stream: bool = True

    def __post_init__(self) -> None:
        if self.concurrency < 1:
            raise ReplayError(f"--concurrency must be >= 1, got {self.concurrency}")
        if not math.isfinite(self.time_scale) or self.time_scale < 0:
            raise ReplayError(f"--time-scale must be >= 0, got {self.time_scale}")
        if not math.isfinite(self.timeout_s) or self.timeout_s <= 0:
            raise ReplayError(f"--timeout must be a number of seconds > 0, got {self.timeout_s}")
        try:
            parts = urlsplit(self.url)
            parts.port  # noqa: B018 - raises for a port out of range
        except ValueError as e:
            raise ReplayError(f"--url {self.url}: {e}") from None
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ReplayError(f"--url {self.url}: expected http(s)://HOST[:PORT], the vLLM server's address")


@dataclass
class ServerInfo:
    """What the replay learned of the server before sending anything."""

    model: str
    max_model_len: int
    hook: Optional[dict[str, str]]  # the hook's labels in /metrics, None without it
    counters: dict[str, float]


@dataclass
class _Run:
    """Per-run records: request timings and counts, trajectory and step spans."""

    ttft: list[float] = field(default_factory=list)
    tpot: list[float] = field(default_factory=list)
    cached_tokens: Optional[int] = 0
    prompt_tokens: int = 0
    output_tokens: int = 0
    completed: int = 0
    turns: int = 0
    failed: list[str] = field(default_factory=list)
    not_sent: int = 0  # the later turns and scoring requests of trajectories a failed request lost
    trajectories: list[float] = field(default_factory=list)
    steps: list[float] = field(default_factory=list)
    resets: int = 0
    retried: int = 0  # requests sent again after the server closed the connection before answering
    warnings: list[str] = field(default_factory=list)


@dataclass
class Streamed:
    """One streamed answer: its generated ids, when the first came, its finish reason and usage."""

    ids: list[int] = field(default_factory=list)
    first: Optional[float] = None
    finish_reason: Optional[str] = None
    usage: Mapping[str, Any] = field(default_factory=dict)


def base_url(url: str) -> str:
    return url.rstrip("/").removesuffix("/v1")


def parse_counters(text: str) -> tuple[dict[str, float], Optional[dict[str, str]]]:
    """The replay's counters and histograms' ``_sum`` and ``_count`` (each summed over label sets), and the hook's
    labels, from a /metrics page."""
    from prometheus_client.parser import text_string_to_metric_families

    totals = dict.fromkeys([*_COUNTERS, *(f"{k}_{end}" for k in _HISTOGRAMS for end in ("sum", "count"))], 0.0)
    hook = None
    names = {v: k for k, v in _COUNTERS.items()}
    histograms = {v: k for k, v in _HISTOGRAMS.items()}
    for fam in text_string_to_metric_families(text):
        if fam.name == HOOK_METRIC:
            hook = dict(fam.samples[0].labels) if fam.samples else {}
        if fam.name in histograms:
            for s in fam.samples:
                end = s.name.rsplit("_", 1)[-1]
                if end in ("sum", "count"):
                    totals[f"{histograms[fam.name]}_{end}"] += s.value
            continue
        key = names.get(fam.name)
        if key is None:
            continue
        for s in fam.samples:
            if s.name.endswith("_total"):
                totals[key] += s.value
    return totals, hook


async def probe(client: httpx.AsyncClient, url: str) -> ServerInfo:
    """The server's model, its max_model_len, the hook and the counters now; :class:`ReplayError` if unreachable."""
    base = base_url(url)
    try:
        models = await client.get(f"{base}/v1/models")
        models.raise_for_status()
        metrics = await client.get(f"{base}/metrics")
        metrics.raise_for_status()
    except httpx.HTTPStatusError as e:
        raise ReplayError(f"the server at {url} answered {e.response.status_code} to {e.request.url}: "
                          "is it a vLLM OpenAI server?") from None
    except (httpx.HTTPError, httpx.InvalidURL) as e:  # (an InvalidURL is no HTTPError)
        raise ReplayError(f"cannot reach the server at {url} ({type(e).__name__}: {e})") from None
    try:
        card = models.json()["data"][0]
        model, max_len = str(card["id"]), int(card["max_model_len"])
    except (ValueError, KeyError, IndexError, TypeError):
        raise ReplayError(f"the server at {url} lists no model with a max_model_len on /v1/models") from None
    try:
        counters, hook = parse_counters(metrics.text)
    except ValueError as e:  # the Prometheus parser's error on a page that is not its text format
        raise ReplayError(f"the server at {url} answered /metrics with no Prometheus text ({e})") from None
    return ServerInfo(model, max_len, hook, counters)


def check_fits(workload: PreparedWorkload, max_model_len: int, url: str) -> None:
    """Every request's prompt plus forced output within the served model's max_model_len, else ReplayError."""
    need = np.asarray(workload.prompt_tokens) + np.asarray(workload.output_tokens)
    over = np.flatnonzero(need > max_model_len)
    if over.size:
        r = int(over[np.argmax(need[over])])
        raise ReplayError(
            f"request {workload.request_id[r]} needs {need[r]} tokens (prompt {workload.prompt_tokens[r]} + output "
            f"{workload.output_tokens[r]}), more than the max_model_len {max_model_len} of the model served at "
            f"{url}; {over.size} request(s) do not fit: start the server with a larger --max-model-len")


class Replayer:
    """One replay: the HTTP client, the workload's streams as sent so far, the records."""

    def __init__(self, workload: PreparedWorkload, cfg: ReplayConfig, client: httpx.AsyncClient, info: ServerInfo,
                 bar: Any) -> None:
        self.w = workload
        self.cfg = cfg
        self.client = client
        self.info = info
        self.bar = bar
        self.sem = asyncio.Semaphore(cfg.concurrency)
        self.run = _Run()
        #: per stream: (start position, generated ids) of its requests' outputs, in the order they finished
        self.generated: dict[int, list[tuple[int, list[int]]]] = {}
        self.url = f"{base_url(cfg.url)}/v1/completions"
        self.outputs: Optional[dict[str, list[int]]] = None  # request id -> generated ids, when recorded

    def prompt(self, row: int) -> list[int]:
        """The row's prompt ids, with the outputs its stream's earlier requests generated in their places."""
        ids = self.w.tokens.prompt_ids(row)
        n = len(ids)
        for start, out in self.generated.get(int(self.w.tokens.stream[row]), ()):
            if start < n:
                ids[start : min(n, start + len(out))] = out[: n - start]
        return ids.tolist()

    def body(self, row: int) -> dict[str, Any]:
        w = self.w
        out = w.output_tokens[row]
        return {
            "model": self.info.model,
            "prompt": self.prompt(row),
            "max_tokens": out,
            "min_tokens": out,
            "ignore_eos": True,
            "temperature": 0.0,
            "stream": self.cfg.stream,
            **({"stream_options": {"include_usage": True}} if self.cfg.stream else {}),
            "return_token_ids": True,
            # the output's length is forced through max_tokens; the hook reads the rollout's own from here
            "vllm_xargs": {**w.xargs(row), "kvpilot_max_tokens": w.max_tokens[row]},
        }

    async def stream(self, body: Mapping[str, Any], headers: Mapping[str, str],
                     got: Optional[Streamed] = None) -> Streamed:
        """POST one completion and stream its answer into ``got`` (a new one by default); raises on an HTTP error
        or a broken stream. A connection the server closed before any answer (an idle keep-alive connection it
        dropped as the client reused it) is tried once more."""
        got = Streamed() if got is None else got
        try:
            return await self._stream(body, headers, got)
        except (httpx.ReadError, httpx.RemoteProtocolError, httpx.WriteError):
            if got.ids or got.usage:
                raise
            self.run.retried += 1
            return await self._stream(body, headers, got)

    async def _stream(self, body: Mapping[str, Any], headers: Mapping[str, str], got: Streamed) -> Streamed:
        if not body.get("stream"):
            resp = await self.client.post(self.url, json=body, headers=headers)
            if resp.status_code != 200:
                raise RuntimeError(f"HTTP {resp.status_code}: {resp.text[:500]}")
            answer = resp.json()
            for choice in answer.get("choices") or ():
                got.ids.extend(choice.get("token_ids") or ())
                got.finish_reason = choice.get("finish_reason") or got.finish_reason
            got.usage = answer.get("usage") or got.usage
            return got
        async with self.client.stream("POST", self.url, json=body, headers=headers) as resp:
            if resp.status_code != 200:
                text = (await resp.aread()).decode(errors="replace")[:500]
                raise RuntimeError(f"HTTP {resp.status_code}: {text}")
            async for line in resp.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                for choice in chunk.get("choices") or ():
                    ids = choice.get("token_ids") or ()
                    if ids and got.first is None:
                        got.first = time.perf_counter()
                    got.ids.extend(ids)
                    got.finish_reason = choice.get("finish_reason") or got.finish_reason
                got.usage = chunk.get("usage") or got.usage
        return got

    async def request(self, row: int) -> bool:
        """Send one row and stream its answer; records its timings and generated ids. False if it failed."""
        w = self.w
        headers = {"X-Session-ID": w.session_id[row], "X-Request-Id": w.request_id[row]}
        async with self.sem:
            t0 = time.perf_counter()
            try:
                got = await self.stream(self.body(row), headers)
            except Exception as e:  # noqa: BLE001 -- one request's failure is counted, the replay goes on
                self.fail(row, f"{type(e).__name__}: {e}")
                return False
            t1 = time.perf_counter()
        return self.record(row, got, t0, t1)

    def record(self, row: int, got: Streamed, t0: float, t1: float) -> bool:
        """Count a row's answer (its generated ids in ``got``); False, counted as failed, if it is short."""
        w, ids = self.w, got.ids
        if len(ids) != w.output_tokens[row]:
            self.fail(row, f"generated {len(ids)} tokens, expected {w.output_tokens[row]}")
            return False
        r = self.run
        r.completed += 1
        r.turns += w.kind[row] == "rollout"
        r.prompt_tokens += w.prompt_tokens[row]
        r.output_tokens += len(ids)
        details = got.usage.get("prompt_tokens_details") or {}
        cached = details.get("cached_tokens")
        r.cached_tokens = r.cached_tokens + cached if cached is not None and r.cached_tokens is not None else None
        if got.first is not None:
            r.ttft.append(got.first - t0)
            if len(ids) > 1:
                r.tpot.append((t1 - got.first) / (len(ids) - 1))
        self.generated.setdefault(int(w.tokens.stream[row]), []).append((w.prompt_tokens[row], ids))
        if self.outputs is not None:
            self.outputs[w.request_id[row]] = ids
        if self.bar is not None:
            self.bar.update(1)
        return True

    def fail(self, row: int, why: str) -> None:
        self.run.failed.append(f"{self.w.request_id[row]}: {why}")
        if self.bar is not None:
            self.bar.update(1)

    async def wait(self, seconds: Optional[float]) -> None:
        if seconds and self.cfg.time_scale > 0:
            await asyncio.sleep(seconds * self.cfg.time_scale)

    async def scoring(self, row: int) -> None:
        """A reward-model request, then its answer parsed."""
        if await self.request(row):
            await self.wait(self.w.verify_latency_s[row])

    async def trajectory(self, turns: tuple[int, ...], scoring: tuple[int, ...], start: float) -> None:
        """A session's turns with their tool calls between, then its verifier beside its scoring requests."""
        w = self.w
        for i, row in enumerate(turns):
            if not await self.request(row):  # the trajectory is lost; its later requests are never sent
                lost = len(turns) - i - 1 + len(scoring)
                self.run.not_sent += lost
                if self.bar is not None and lost:
                    self.bar.update(lost)
                return
            if i + 1 < len(turns):
                await self.wait(w.tool_latency_s[row])
        await asyncio.gather(self.wait(w.verify_latency_s[turns[-1]]), *(self.scoring(s) for s in scoring))
        self.run.trajectories.append(time.perf_counter() - start)

    async def reset_cache(self) -> None:
        """Weight sync between steps: the server's prefix cache reset (warned once where it cannot be)."""
        try:
            resp = await self.client.post(f"{base_url(self.cfg.url)}/reset_prefix_cache")
            ok = resp.status_code == 200
        except httpx.HTTPError:
            ok = False
        if ok:
            self.run.resets += 1
        elif not self.run.warnings:
            self.run.warnings.append("the server has no /reset_prefix_cache (start it with VLLM_SERVER_DEV_MODE=1): "
                                     "the prefix cache was kept across steps")

    def extra_summary(self, wall: float) -> dict[str, Any]:
        """Summary keys of a replayer with more to report (a trainer's: :mod:`training.replay_async`)."""
        return {}

    async def all_steps(self) -> None:
        w = self.w
        by_step: dict[int, list] = {s: [] for s in w.steps}
        for s in w.sessions:
            by_step[s.step].append(s)
        for i, step in enumerate(w.steps):
            if i and self.cfg.reset_between_steps:
                await self.reset_cache()
            t0 = time.perf_counter()
            await asyncio.gather(*(self.trajectory(s.turns, s.scoring, t0) for s in by_step[step]))
            self.run.steps.append(time.perf_counter() - t0)
            await self.step_done(by_step[step])

    async def step_done(self, sessions: list) -> None:
        """After an RL step's last trajectory (``sessions``: its sessions); a trainer trains here."""


def _pct(values: list[float], q: float) -> float:
    return float(np.percentile(values, q)) if values else 0.0


async def _replay(workload: PreparedWorkload, cfg: ReplayConfig, bar_factory: Any, outputs: bool,
                  replayer: Any) -> dict[str, Any]:
    limits = httpx.Limits(max_connections=cfg.concurrency + 4, max_keepalive_connections=cfg.concurrency + 4)
    timeout = httpx.Timeout(cfg.timeout_s, connect=10.0)
    async with httpx.AsyncClient(timeout=timeout, limits=limits) as client:
        info = await probe(client, cfg.url)
        if cfg.require_hook and info.hook is None:
            raise ReplayError(f"the server at {cfg.url} does not run the kvpilot hook (no {HOOK_METRIC} in its "
                              "/metrics): start it with --scheduler-cls serving_hook.KVPilotScheduler, or "
                              "replay with --no-require-hook")
        check_fits(workload, info.max_model_len, cfg.url)
        bar = bar_factory(workload.num_rows) if bar_factory is not None else None
        rep = replayer(workload, cfg, client, info, bar)
        if outputs:
            rep.outputs = {}
        t0 = time.perf_counter()
        try:
            await rep.all_steps()
        finally:
            if bar is not None:
                bar.close()
        wall = time.perf_counter() - t0
        try:
            after: Optional[dict[str, float]] = (await probe(client, cfg.url)).counters
        except ReplayError as e:  # the run is measured: keep it, without the server's counters
            after = None
            rep.run.warnings.append(f"the server's counters after the replay are unknown: {e}")
    summary = {**_summary(rep.run, info, after, wall), "streamed": cfg.stream, **rep.extra_summary(wall)}
    if not cfg.stream:  # one answer per request: no first token seen apart from the last
        summary.update(dict.fromkeys(("ttft_p50_s", "ttft_p99_s", "tpot_p50_s", "tpot_p99_s")))
    if outputs:
        summary["outputs"] = rep.outputs
    return summary


def _summary(r: _Run, info: ServerInfo, after: Optional[dict[str, float]], wall: float) -> dict[str, Any]:
    """The simulator's summary keys that a client measures, plus the server's counters over the replay (None each
    where ``after`` is: the last probe failed)."""
    delta = {k: (int(round(after[k] - info.counters[k])) if after is not None else None) for k in _COUNTERS}
    tokens = after["inter_token_count"] - info.counters.get("inter_token_count", 0.0) if after is not None else 0
    engine_itl = (after["inter_token_sum"] - info.counters.get("inter_token_sum", 0.0)) / tokens if tokens else None
    if r.cached_tokens is not None and r.prompt_tokens:
        hit_rate = r.cached_tokens / r.prompt_tokens
    else:
        q = delta["prefix_cache_queries"]
        hit_rate = delta["prefix_cache_hits"] / q if q else (None if after is None else 0.0)
    return {
        "requests": r.completed,
        "failed": len(r.failed),
        "not_sent": r.not_sent,
        "failures": r.failed[:10],
        "turns": r.turns,
        "trajectories": len(r.trajectories),
        "makespan_s": float(np.mean(r.steps)) if r.steps else 0.0,
        "makespan_per_step_s": r.steps,
        "replay_s": wall,
        "output_tokens": r.output_tokens,
        "tokens_per_s": r.output_tokens / wall if wall > 0 else 0.0,
        "prompt_tokens": r.prompt_tokens,
        "cached_tokens": r.cached_tokens,
        "prefix_hit_rate": hit_rate,
        **delta,
        "trajectory_p50_s": _pct(r.trajectories, 50),
        "trajectory_p99_s": _pct(r.trajectories, 99),
        "ttft_p50_s": _pct(r.ttft, 50),
        "ttft_p99_s": _pct(r.ttft, 99),
        "tpot_p50_s": _pct(r.tpot, 50),
        "tpot_p99_s": _pct(r.tpot, 99),
        "engine_inter_token_s": engine_itl,  # vLLM's own, over the replay: its engine's step while a request runs
        "cache_resets": r.resets,
        "retried": r.retried,
        "model": info.model,
        "hook": info.hook,
        "warnings": r.warnings,
    }


def replay(workload: PreparedWorkload, cfg: ReplayConfig, bar_factory: Any = None,
           outputs: bool = False, replayer: Any = None) -> dict[str, Any]:
    """Replay a prepared workload's RL steps against ``cfg.url``; the summary. :class:`ReplayError` before any
    request is sent when the server or the workload is unfit. ``bar_factory(total)``: a progress bar, or None.
    ``outputs``: add ``outputs``, each completed request's generated token ids by request id. ``replayer``: the
    client's class (default: synchronous steps; :func:`training.replay_async.trained_replayer` adds a trainer)."""
    if workload.trace:
        raise ReplayError("the workload is a trace (arrival_s set): replay drives RL steps only")
    return asyncio.run(_replay(workload, cfg, bar_factory, outputs, replayer or Replayer))


def _known(v: Any, fmt: str = "") -> str:
    """``v`` formatted, or ``unknown`` (a server counter the last probe could not read)."""
    return "unknown" if v is None else format(v, fmt)


def render_replay(s: Mapping[str, Any]) -> str:
    """The summary as a short table."""
    streamed = s.get("streamed", True)
    lines = [
        f"requests            {s['requests']} ({s['failed']} failed"
        + (f", {s['not_sent']} never sent: the rest of the trajectories they lost" if s["not_sent"] else "")
        + f"), {s['turns']} turns, {s['trajectories']} trajectories",
        f"makespan            {s['makespan_s']:.2f} s mean over {len(s['makespan_per_step_s'])} step(s): "
        + ", ".join(f"{m:.2f}" for m in s["makespan_per_step_s"]),
        f"trajectory p50/p99  {s['trajectory_p50_s']:.2f} / {s['trajectory_p99_s']:.2f} s",
        (f"TTFT p50/p99        {s['ttft_p50_s'] * 1e3:.0f} / {s['ttft_p99_s'] * 1e3:.0f} ms" if streamed else
         "TTFT, TPOT          not measured (--no-stream: one answer per request)"),
        (f"TPOT p50/p99        {s['tpot_p50_s'] * 1e3:.1f} / {s['tpot_p99_s'] * 1e3:.1f} ms; " if streamed else
         "inter-token time    ")
        + f"the engine's mean inter-token time "
        f"{_known(s['engine_inter_token_s'] and s['engine_inter_token_s'] * 1e3, '.1f')} ms (/metrics)",
        f"output tokens       {s['output_tokens']} ({s['tokens_per_s']:.0f}/s)",
        f"prefix cache        hit rate {_known(s['prefix_hit_rate'], '.3f')}; /metrics: "
        f"{_known(s['prefix_cache_hits'])} hits of {_known(s['prefix_cache_queries'])} queried tokens",
        f"preemptions         {_known(s['preemptions'])}",
    ]
    if "trained_trajectories" in s:
        lines.append(s["trainer_line"])
    return "\n".join(lines + [f"warning: {w}" for w in s["warnings"]] + [f"failed: {f}" for f in s["failures"]])
