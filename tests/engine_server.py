"""A real vLLM OpenAI server for the engine tests: vLLM's CPU build in ``.venv-engine`` (``make install-engine``).

:func:`start_server` runs ``python -m vllm.entrypoints.openai.api_server`` on the shipped config-only model
(``models/tiny-llama``, random weights) on a free loopback port, waits for ``/health`` and yields its URL;
:meth:`Server.stop` sends the API server SIGTERM as an operator would. Without ``.venv-engine`` the tests skip,
except in CI (``CI`` set), where they fail: CI must exercise the real server.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import time
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Optional

import httpx
import pytest

ROOT = Path(__file__).resolve().parents[1]
ENGINE_PY = ROOT / ".venv-engine" / "bin" / "python"
MODEL = ROOT / "models" / "tiny-llama"
HOOK = "serving_hook.KVPilotScheduler"
START_TIMEOUT_S = 420.0


def engine_python() -> Path:
    """The engine venv's python; skips the test where it is missing, fails in CI."""
    if ENGINE_PY.exists():
        return ENGINE_PY
    why = f"no CPU engine venv at {ENGINE_PY.parent.parent}: run `make install-engine`"
    if os.environ.get("CI", "").lower() in ("1", "true", "yes"):
        pytest.fail(why + " (CI must run the real-server tests)")
    pytest.skip(why)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """A running API server process: its URL, log file, and how to stop it."""

    def __init__(self, proc: subprocess.Popen, url: str, log: Path) -> None:
        self.proc = proc
        self.url = url
        self.log = log

    def log_tail(self, n: int = 4000) -> str:
        return self.log.read_text(errors="replace")[-n:] if self.log.exists() else ""

    def metrics(self) -> str:
        return httpx.get(f"{self.url}/metrics", timeout=30).text

    def stop(self, timeout_s: float = 90.0) -> int:
        """SIGTERM to the API server (vLLM's default shutdown), then wait; SIGKILL to its group if it hangs."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(30)
        # the engine core is the API server's child: give its exit path a moment when it outlived the parent
        with contextlib.suppress(ProcessLookupError, PermissionError):
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline:
                os.killpg(self.proc.pid, 0)
                time.sleep(0.2)
            os.killpg(self.proc.pid, signal.SIGKILL)
        return self.proc.returncode


@contextlib.contextmanager
def start_server(tmp: Path, *, hook: bool = True, env: Optional[Mapping[str, str]] = None,
                 args: Sequence[str] = (), model: Path = MODEL) -> Iterator[Server]:
    """Start a CPU server on ``model`` (a config-only folder; default the tiny model), ``hook``: with
    ``--scheduler-cls serving_hook.KVPilotScheduler``; ``args`` come last, so they override the defaults."""
    py = engine_python()
    port = free_port()
    tmp.mkdir(parents=True, exist_ok=True)
    log = tmp / f"server-{port}.log"
    full_env = {k: v for k, v in os.environ.items() if not k.startswith(("KVPILOT_", "VLLM_", "PYTHON"))}
    full_env.update(
        VLLM_HOST_IP="127.0.0.1",
        VLLM_CPU_KVCACHE_SPACE="1",
        VLLM_SERVER_DEV_MODE="1",  # /reset_prefix_cache, which replay calls between RL steps
        VLLM_LOGGING_LEVEL="INFO",
        HF_HUB_OFFLINE="1",
        PYTHONPATH=str(ROOT),
        **(env or {}),
    )
    cmd = [str(py), "-m", "vllm.entrypoints.openai.api_server", "--model", str(model), "--load-format", "dummy",
           "--skip-tokenizer-init", "--host", "127.0.0.1", "--port", str(port), "--max-model-len", "4096",
           "--enable-prompt-tokens-details", "--served-model-name", "tiny-llama", *args]
    if hook:
        cmd += ["--scheduler-cls", HOOK]
    with log.open("w") as out:
        proc = subprocess.Popen(cmd, cwd=str(ROOT), env=full_env, stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True)
    server = Server(proc, f"http://127.0.0.1:{port}", log)
    try:
        _wait_healthy(server)
        yield server
    finally:
        server.stop()


def _wait_healthy(server: Server) -> None:
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        if server.proc.poll() is not None:
            raise RuntimeError(f"the vLLM server exited with {server.proc.returncode}:\n{server.log_tail()}")
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(f"{server.url}/health", timeout=5).status_code == 200:
                return
        time.sleep(1.0)
    raise RuntimeError(f"the vLLM server did not become healthy in {START_TIMEOUT_S:.0f} s:\n{server.log_tail()}")


def complete(url: str, prompt: list[int], max_tokens: int, **extra) -> dict:
    """One non-streaming /v1/completions call with token ids and a forced output length; the JSON answer."""
    body = {"model": "tiny-llama", "prompt": prompt, "max_tokens": max_tokens, "min_tokens": max_tokens,
            "ignore_eos": True, "temperature": 0.0, "return_token_ids": True, **extra}
    resp = httpx.post(f"{url}/v1/completions", json=body, timeout=120)
    resp.raise_for_status()
    return resp.json()
