"""The framework recipes (docs/recipes/) name only what kvpilot has: its scheduler classes, the environment
variables the hook reads, the request keys it parses and their defaults; and each cites the framework's commit and
the source files it was read from (the frameworks themselves are not installed here)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

import serving_hook
from serving_hook import config, metadata

RECIPES = Path(__file__).resolve().parents[1] / "docs" / "recipes"
FRAMEWORKS = {"verl": "verl", "skyrl": "SkyRL", "prime-rl": "prime-rl", "areal": "AReaL", "trl": "trl"}
#: The variables the hook and its plugin read.
HOOK_ENV = set(re.findall(r"KVPILOT_[A-Z_]+", Path(config.__file__).read_text())) | {"KVPILOT_ENABLE"}


def _text(name: str) -> str:
    path = RECIPES / f"{name}.md"
    assert path.is_file(), f"docs/recipes/{name}.md is missing"
    return path.read_text()


@pytest.mark.parametrize("name", sorted(FRAMEWORKS))
def test_a_recipe_cites_the_frameworks_commit_and_source_files(name: str) -> None:
    text = _text(name)
    commit = re.search(rf"github\.com/[\w.-]+/{re.escape(FRAMEWORKS[name])}/tree/([0-9a-f]{{40}})", text, re.I)
    assert commit, f"{name}.md names no commit of its framework's repository"
    sources = set(re.findall(r"`([\w./-]+\.(?:py|toml|yaml|md))(?:#L\d+(?:-L\d+)?)?`", text))
    assert len(sources) >= 3, f"{name}.md cites {len(sources)} source file(s)"
    for section in ("Session identity", "Weight sync", "Not verified"):
        assert section.lower() in text.lower(), f"{name}.md has no '{section}' part"


@pytest.mark.parametrize("name", sorted(FRAMEWORKS))
def test_what_a_recipe_names_of_kvpilot_exists(name: str) -> None:
    text = _text(name)
    for cls in set(re.findall(r"serving_hook\.(KVPilot\w+)", text)):
        assert hasattr(serving_hook, cls), f"{name}.md names serving_hook.{cls}, which does not exist"
    for var in set(re.findall(r"KVPILOT_[A-Z_]+", text)):
        assert var in HOOK_ENV, f"{name}.md names {var}, which the hook does not read"
    keys = set(metadata._KEYS) | {"kvpilot_hook_info"}
    for key in set(re.findall(r"\bkvpilot_[a-z_]+", text)):
        assert key in keys, f"{name}.md names the request key {key}, which the hook does not read"
    for said in re.findall(r"KVPILOT_MAX_HOLD_S`? \((?:default )?(\d+(?:\.\d+)?) s\)", text):
        assert float(said) == config.DEFAULT_MAX_HOLD_S, f"{name}.md says KVPILOT_MAX_HOLD_S is {said} s by default"
