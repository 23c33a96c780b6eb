"""The vLLM internals ``serving_hook`` overrides or calls have the same signatures in every vLLM it supports:
0.33 (the project's pin, this venv) and 0.32's CPU build (``.venv-engine``, the real-server tests' engine)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.engine_server import ROOT, engine_python

SCRIPT = Path(__file__).with_name("vllm_surface.py")


def _surface(python: Path | str) -> dict:
    out = subprocess.run([str(python), str(SCRIPT)], cwd=str(ROOT), capture_output=True, text=True, timeout=600,
                         env={"PATH": "/usr/bin:/bin", "VLLM_TARGET_DEVICE": "cpu", "PYTHONPATH": str(ROOT)})
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout)


@pytest.mark.vllm
@pytest.mark.engine
@pytest.mark.slow
def test_hook_surface_is_the_same_in_0_32_cpu_and_0_33():
    pinned = _surface(sys.executable)
    cpu = _surface(engine_python())
    assert pinned["version"].startswith("0.33") and cpu["version"].startswith("0.32")
    missing = {k: v for d in (pinned, cpu) for k, v in d["surface"].items() if "missing" in v}
    assert not missing
    differ = {k: (pinned["surface"][k], cpu["surface"][k]) for k in pinned["surface"]
              if pinned["surface"][k] != cpu["surface"][k]}
    assert not differ
