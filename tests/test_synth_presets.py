"""The swe domain (long-horizon coding agents) and the named workload presets of ``workload synth``."""

from __future__ import annotations

import dataclasses
import hashlib
import subprocess
import sys
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pytest

from data.errors import DataValidationError
from data.schemas import WORKLOAD
from data.stats import render_stats, workload_stats
from data.synth import PRESETS, SynthConfig, generate, swe_domain
from data.validate import validate_table

SWE = swe_domain(share=1.0)
#: Only swe sessions, enough of them for percentiles: 2 steps x 48 prompts x 8 samples.
SWE_ONLY = SynthConfig(domains={"swe": SWE}, steps=2, prompts_per_step=48)


@pytest.fixture(scope="module")
def swe_stats() -> dict:
    table = generate(SWE_ONLY)
    validate_table(table, WORKLOAD, "swe workload")
    return workload_stats(table)["domains"]["swe"]


def test_swe_turns_match_the_configured_distribution(swe_stats: dict) -> None:
    turns = swe_stats["turns"]
    assert turns["p50"] == pytest.approx(SWE.turns.quantile(0.5), rel=0.15)
    # The tail runs towards ~100 turns, cut where the context cap ends a session first.
    assert 60 <= turns["p99"] <= SWE.turns.max


def test_swe_contexts_grow_into_the_32k_64k_range_and_respect_the_cap(swe_stats: dict) -> None:
    context = swe_stats["last_turn_context_tokens"]
    assert 16_000 <= context["p50"] <= 40_000
    assert 32_000 <= context["p90"] <= SWE.max_context_tokens
    assert context["p99"] <= SWE.max_context_tokens


def test_swe_tool_latency_and_output_per_turn_match_the_config(swe_stats: dict) -> None:
    for q, rel in ((50, 0.10), (99, 0.25)):
        assert swe_stats["tool_latency_s"][f"p{q}"] == pytest.approx(SWE.tool.latency_s.quantile(q / 100), rel=rel)
        assert swe_stats["output_tokens"][f"p{q}"] == pytest.approx(SWE.output_tokens.quantile(q / 100), rel=rel)


def test_swe_turn_counts_are_shared_within_a_group() -> None:
    table = generate(SWE_ONLY)
    sessions = pc.value_counts(table.column("session_id"))
    counts = dict(zip(sessions.field("values").to_pylist(), sessions.field("counts").to_pylist()))
    group_of = dict(zip(table.column("session_id").to_pylist(), table.column("group_id").to_pylist()))
    by_group: dict[str, list[int]] = {}
    for session, n in counts.items():
        by_group.setdefault(group_of[session], []).append(n)
    logs = np.log([v for v in by_group.values()])
    between = logs.mean(axis=1).var()
    within = logs.var(axis=1).mean()
    assert between > 0.5 * within  # a task's difficulty sets its sessions' lengths together


def test_context_cap_ends_a_session_before_it_overflows() -> None:
    small = dataclasses.replace(SWE, max_context_tokens=12_000)
    table = generate(SynthConfig(domains={"swe": small}, steps=1, prompts_per_step=8))
    context = table.column("prompt_tokens").to_numpy() + table.column("output_tokens").to_numpy()
    first = table.column("turn").to_numpy() == 0
    assert context[~first].max() <= 12_000
    assert table.num_rows < generate(SynthConfig(domains={"swe": SWE}, steps=1, prompts_per_step=8)).num_rows


def test_workload_stats_prints_the_multi_turn_table(swe_stats: dict) -> None:
    text = render_stats(workload_stats(generate(dataclasses.replace(SWE_ONLY, prompts_per_step=2, steps=1))))
    assert "multi-turn" in text and "turns_p99" in text and "context_last_p50" in text and "tool_s_p99" in text


def test_short_preset_reproduces_the_mix_before_the_swe_domain() -> None:
    """Digest of every column of the default workload at 8f6f79e (before the swe domain): earlier results hold.

    Float columns enter at 9 significant digits: numpy's AVX-512 and AVX2 paths for the lognormal tool and verify
    latencies differ in the last bits (reproduced with ``NPY_DISABLE_CPU_FEATURES``), and nothing else does."""
    table = generate(SynthConfig.preset("short"))
    h = hashlib.sha256()
    for name in table.column_names:
        column = table.column(name)
        values = column.to_pylist()
        if pa.types.is_floating(column.type):
            values = [None if v is None else float(f"{v:.9g}") for v in values]
        h.update(name.encode())
        h.update(repr(values).encode())
    assert table.num_rows == 1698
    assert h.hexdigest() == "e27ec6afee39cd9a962094008de0a9a694b619ee6b12a7d405de5ac8ee32b010"


def test_presets_differ_where_they_should() -> None:
    assert set(PRESETS) == {"default", "short", "agentic"}
    assert SynthConfig.preset("default") == SynthConfig()
    assert "swe" in SynthConfig().domains and "swe" not in SynthConfig.preset("short").domains
    agentic = SynthConfig.preset("agentic")
    shares = {name: d.share for name, d in agentic.domains.items()}
    assert set(shares) == {"swe", "agentic"} and shares["swe"] > shares["agentic"]
    with pytest.raises(ValueError, match="unknown workload preset 'nope'.*agentic"):
        SynthConfig.preset("nope")


def test_cli_preset_and_config_over_it(tmp_path: Path) -> None:
    cfg = tmp_path / "small.toml"
    cfg.write_text("steps = 1\nprompts_per_step = 2\n")
    out = tmp_path / "w.parquet"
    cli = [sys.executable, "-m", "training.cli", "workload", "synth"]
    done = subprocess.run([*cli, "--preset", "agentic", "--config", str(cfg), "-o", str(out)], capture_output=True,
                          text=True)
    assert done.returncode == 0, done.stderr
    import pyarrow.parquet as pq

    table: pa.Table = pq.read_table(out)
    assert set(table.column("domain").to_pylist()) <= {"swe", "agentic", "reward"}
    assert pc.max(table.column("step")).as_py() == 0
    bad = subprocess.run([*cli, "--preset", "nope", "-o", str(out)], capture_output=True, text=True)
    assert bad.returncode == 2 and "unknown workload preset 'nope'" in bad.stdout + bad.stderr


# ---------------------------------------------------------------- a config's alternatives over a preset's

#: A TOML value for each field of :data:`data.synth.ALTERNATIVES`, and the most turns it allows.
_ALT_VALUES = {
    "turns": ("{ median = 3, sigma = 0.4, min = 2, max = 4 }", 4),
    "turn_probs": ("[0.5, 0.5]", 2),
}


def _alternative_cases() -> list[tuple[str, str, str]]:
    """(domain of the default preset, the field its preset uses, the config's alternative), each pair both ways."""
    from data.synth import ALTERNATIVES, DomainConfig

    unset = {f.name: f.default for f in dataclasses.fields(DomainConfig)}
    cases = []
    for a, b in ALTERNATIVES[DomainConfig]:
        for preset_uses, config_gives in ((a, b), (b, a)):
            dom = next(n for n, d in SynthConfig().domains.items() if getattr(d, preset_uses) != unset[preset_uses])
            cases.append((dom, preset_uses, config_gives))
    return cases


def test_every_alternative_has_a_test_value() -> None:
    from data.synth import ALTERNATIVES

    assert {f for pairs in ALTERNATIVES.values() for pair in pairs for f in pair} == set(_ALT_VALUES)


@pytest.mark.parametrize(("domain", "preset_uses", "config_gives"), _alternative_cases())
def test_a_config_alternative_replaces_the_presets(tmp_path: Path, domain: str, preset_uses: str,
                                                  config_gives: str) -> None:
    """A config that picks the other alternative replaces the preset's choice instead of failing with 'not both'."""
    value, most = _ALT_VALUES[config_gives]
    path = tmp_path / "alt.toml"
    path.write_text(f"[domains.{domain}]\n{config_gives} = {value}\n")
    cfg = SynthConfig.from_file(path, SynthConfig.preset("default")).domains[domain]
    preset = SynthConfig().domains[domain]
    unset = {f.name: f.default for f in dataclasses.fields(preset)}[preset_uses]
    assert getattr(cfg, preset_uses) == unset and getattr(cfg, preset_uses) != getattr(preset, preset_uses)
    assert cfg.max_turns == most
    assert dataclasses.replace(cfg, turns=preset.turns, turn_probs=preset.turn_probs) == preset  # nothing else moved
    path.write_text(f"[domains.{domain}]\n{config_gives} = {value}\n{preset_uses} = {_ALT_VALUES[preset_uses][0]}\n")
    with pytest.raises(DataValidationError, match="not both"):  # a config that gives both is still an error
        SynthConfig.from_file(path, SynthConfig())


@pytest.mark.parametrize("config_gives", ["turn_probs", "turns"])
def test_cli_config_alternative_over_the_agentic_preset(tmp_path: Path, config_gives: str) -> None:
    """``workload synth --preset agentic --config``: the config's turn distribution wins in each domain."""
    value, most = _ALT_VALUES[config_gives]
    cfg = tmp_path / "alt.toml"
    cfg.write_text(f"steps = 1\nprompts_per_step = 4\n[domains.swe]\n{config_gives} = {value}\n"
                   f"[domains.agentic]\n{config_gives} = {value}\n")
    out = tmp_path / "w.parquet"
    done = subprocess.run([sys.executable, "-m", "training.cli", "workload", "synth", "--preset", "agentic",
                           "--config", str(cfg), "-o", str(out)], capture_output=True, text=True)
    assert done.returncode == 0, done.stdout + done.stderr
    import pyarrow.parquet as pq

    table = pq.read_table(out, columns=["domain", "turn"]).to_pandas()
    turns = table[table.domain != "reward"].groupby("domain").turn.max()
    assert set(turns.index) == {"swe", "agentic"} and (turns < most).all()
