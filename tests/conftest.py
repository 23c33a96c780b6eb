"""Shared fixtures. vLLM is imported once per session (imports take ~15-50 s and
the first ModelConfig ~20 s), and every vLLM test reuses one tiny model config.

Tests that drive vLLM are marked ``vllm`` (registered in pyproject.toml);
``-m "not vllm"`` skips them.
"""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")


@pytest.fixture(scope="session")
def vllm_engine():
    """The ``simulator.engine`` module after one vLLM import and one tiny ModelConfig."""
    pytest.importorskip("vllm")
    from simulator import engine

    engine.make_vllm_config()  # pays the first-ModelConfig cost once
    engine.block_hasher()
    return engine


@pytest.fixture(scope="session")
def tiny_model_dir(vllm_engine):
    return vllm_engine.tiny_model_dir()
