"""``--scheduler-cls serving_hook.KVPilotAsyncScheduler`` works with vLLM's CLI.

``vllm serve --help`` only parses and prints (it never resolves the scheduler
class: vLLM resolves it in ``EngineCore.__init__`` via
``SchedulerConfig.get_scheduler_cls()`` -> ``resolve_obj_by_qualname``). So the
test (1) runs the help command with the option and checks it succeeds, and
(2) does what the engine does: parses the same options with vLLM's own ``serve``
argument parser, builds the engine config, resolves the class with
``get_scheduler_cls()``, checks it subclasses vLLM's schedulers, and constructs
it with the exact keyword arguments ``EngineCore.__init__`` passes, then runs it.
"""

from __future__ import annotations

import inspect
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from simulator import fake_runner

pytestmark = pytest.mark.vllm

ROOT = Path(__file__).resolve().parents[1]
CLS = "serving_hook.KVPilotAsyncScheduler"


def _vllm_exe() -> str:
    exe = Path(sys.executable).parent / "vllm"
    return str(exe) if exe.exists() else (shutil.which("vllm") or "vllm")


def test_vllm_serve_help_accepts_scheduler_cls():
    env = dict(os.environ)
    env.update(
        VLLM_TARGET_DEVICE="cpu",
        HF_HUB_OFFLINE="1",
        PYTHONPATH=os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]).rstrip(os.pathsep),
    )
    proc = subprocess.run(
        [_vllm_exe(), "serve", "--help=SchedulerConfig", "--scheduler-cls", CLS],
        cwd=str(ROOT),
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "--scheduler-cls" in proc.stdout


def test_engine_resolves_and_builds_the_hook(vllm_engine, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    for var in ("KVPILOT_POLICY", "KVPILOT_POLICY_OPTIONS", "KVPILOT_TELEMETRY_DIR"):
        monkeypatch.delenv(var, raising=False)
    from vllm.engine.arg_utils import EngineArgs
    from vllm.entrypoints.common.cli_args import make_arg_parser
    from vllm.utils.argparse_utils import FlexibleArgumentParser
    from vllm.utils.import_utils import resolve_obj_by_qualname
    from vllm.v1.core.sched.async_scheduler import AsyncScheduler
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.structured_output import StructuredOutputManager

    import serving_hook
    from policy.vllm_default import VllmDefaultPolicy

    parser = make_arg_parser(FlexibleArgumentParser())
    args = parser.parse_args(
        [
            "--model",
            vllm_engine.tiny_model_dir(),
            "--scheduler-cls",
            CLS,
            "--skip-tokenizer-init",
            "--generation-config",
            "vllm",
            "--max-model-len",
            "4096",
        ]
    )
    config = EngineArgs.from_cli_args(args).create_engine_config()
    cls = config.scheduler_config.get_scheduler_cls()
    assert cls is serving_hook.KVPilotAsyncScheduler
    assert issubclass(cls, AsyncScheduler) and issubclass(cls, Scheduler)
    assert resolve_obj_by_qualname("serving_hook.KVPilotScheduler") is serving_hook.KVPilotScheduler
    assert issubclass(serving_hook.KVPilotScheduler, Scheduler)
    assert not issubclass(serving_hook.KVPilotScheduler, AsyncScheduler)

    # EngineCore.__init__ (vllm/v1/engine/core.py) calls the class with these keywords.
    num_blocks = 64
    config.cache_config.num_gpu_blocks = num_blocks
    kwargs = dict(
        vllm_config=config,
        kv_cache_config=vllm_engine.make_kv_cache_config(num_blocks),
        structured_output_manager=StructuredOutputManager(config),
        include_finished_set=False,
        log_stats=True,
        block_size=vllm_engine.BLOCK_SIZE,
        hash_block_size=vllm_engine.BLOCK_SIZE,
    )
    inspect.signature(Scheduler.__init__).bind(None, **kwargs)  # vLLM's own signature accepts them
    sched = cls(**kwargs)
    assert isinstance(sched.kvpilot_policy, VllmDefaultPolicy)
    sched.add_request(vllm_engine.make_request("cli", fake_runner.prompt_tokens("cli", 40), 4))
    runner = fake_runner.FakeRunner()
    for _ in range(10):
        runner.step(sched)
        if not sched.has_requests():
            break
    assert not sched.has_requests()
