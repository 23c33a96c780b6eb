"""The synthetic RL workload: deterministic, valid, structured like GRPO rollouts, calibrated to real traces."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pytest

from data.errors import DataValidationError
from data.schemas import WORKLOAD
from data.synth import SynthConfig, generate
from data.validate import validate_table

ROOT = Path(__file__).resolve().parents[1]
TRACES = Path(__file__).resolve().parents[2] / "shared" / "traces" / "polytrace"
DEFAULT_TOML = ROOT / "data" / "default_workload.toml"
AGENTIC = SynthConfig().domains["agentic"]
#: The calibrated short-context domains (the swe domain has its own tests below).
LARGE = dataclasses.replace(SynthConfig.preset("short"), steps=20, prompts_per_step=512)


@pytest.fixture(scope="module")
def default() -> pa.Table:
    return generate(SynthConfig())


@pytest.fixture(scope="module")
def large_table() -> pa.Table:
    """A large sample: 20 steps x 512 prompts."""
    return generate(LARGE)


@pytest.fixture(scope="module")
def large(large_table: pa.Table) -> dict[str, np.ndarray]:
    """The large sample as numpy columns."""
    return {name: large_table.column(name).to_numpy(zero_copy_only=False) for name in large_table.column_names}


def _rollout(cols: dict[str, np.ndarray], domain: str) -> np.ndarray:
    return (cols["kind"] == "rollout") & (cols["domain"] == domain)


def _session_log_totals(
    cols: dict[str, np.ndarray], domain: str
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Per rollout session of a domain: its group id, prompt id, log of its total output, and step."""
    mask = _rollout(cols, domain)
    _, inverse = np.unique(cols["session_id"][mask], return_inverse=True)
    total = np.bincount(inverse, weights=cols["output_tokens"][mask])
    first = np.unique(inverse, return_index=True)[1]
    rows = np.flatnonzero(mask)[first]
    return cols["group_id"][rows], cols["prompt_id"][rows], np.log(total), cols["step"][rows]


def _icc(groups: np.ndarray, values: np.ndarray) -> float:
    """One-way ANOVA intra-class correlation of values in equal-size groups."""
    _, inverse, counts = np.unique(groups, return_inverse=True, return_counts=True)
    k = counts[0]
    assert (counts == k).all()
    means = np.bincount(inverse, weights=values) / k
    msb = k * np.var(means, ddof=1)
    msw = np.sum((values - means[inverse]) ** 2) / (len(values) - len(means))
    return float((msb - msw) / (msb + (k - 1) * msw))


# ---------------------------------------------------------------- determinism and shape


def test_same_seed_same_table_other_seed_other_table(default: pa.Table) -> None:
    assert generate(SynthConfig()).equals(default)
    other = generate(dataclasses.replace(SynthConfig(), seed=1))
    assert not other.equals(default)
    assert other.column("output_tokens") != default.column("output_tokens")


def test_default_workload_shape_and_validity(default: pa.Table) -> None:
    assert default.schema == WORKLOAD.schema
    validate_table(default, WORKLOAD, "synth-default")
    cols = {name: default.column(name).to_numpy(zero_copy_only=False) for name in default.column_names}
    rollout = cols["kind"] == "rollout"
    assert set(cols["step"]) == {0, 1}
    for step in (0, 1):
        groups = np.unique(cols["group_id"][rollout & (cols["step"] == step)])
        assert len(groups) >= 64
    _, counts = np.unique(cols["group_id"][rollout & (cols["turn"] == 0)], return_counts=True)
    assert (counts == 8).all() and (cols["group_size"] == 8).all()
    assert {"math", "code", "agentic", "reward"} <= set(cols["domain"])
    assert (cols["finish_reason"] == "tool_call").any() and (cols["finish_reason"] == "length").any()
    assert (cols["kind"] == "scoring").sum() > 0
    assert set(cols["paradigm"][cols["kind"] == "scoring"]) == {"reward_model"}
    # the same prompt recurs across steps
    step0 = set(cols["prompt_id"][cols["step"] == 0])
    step1 = set(cols["prompt_id"][cols["step"] == 1])
    assert 0 < len(step0 & step1) < len(step1)


def test_large_workload_validates(large_table: pa.Table) -> None:
    validate_table(large_table, WORKLOAD, "synth-large")


# ---------------------------------------------------------------- prefix structure


def test_siblings_share_prompt_blocks_and_steps_do_not(default: pa.Table) -> None:
    rows = default.filter(pc.equal(default.column("turn"), 0)).to_pylist()
    rollout = [r for r in rows if r["kind"] == "rollout"]
    by_group: dict[str, set[tuple[int, ...]]] = {}
    for r in rollout:
        by_group.setdefault(r["group_id"], set()).add(tuple(r["block_hashes"]))
    assert all(len(chains) == 1 for chains in by_group.values())
    by_prompt: dict[str, dict[int, set[int]]] = {}
    for r in rollout:
        by_prompt.setdefault(r["prompt_id"], {}).setdefault(r["step"], set()).update(r["block_hashes"])
    repeated = [steps for steps in by_prompt.values() if len(steps) == 2]
    assert repeated and all(not (steps[0] & steps[1]) for steps in repeated)


def test_blocks_past_the_prompt_belong_to_one_trajectory(default: pa.Table) -> None:
    cols = default.to_pydict()
    prompt_blocks: dict[str, set[int]] = {}
    for chain, group, turn, kind in zip(cols["block_hashes"], cols["group_id"], cols["turn"], cols["kind"]):
        if turn == 0 and kind == "rollout":
            prompt_blocks.setdefault(group, set()).update(chain)
    owners: dict[int, set[str]] = {}
    columns = (cols["block_hashes"], cols["session_id"], cols["scores_session_id"], cols["group_id"])
    for chain, session, scored, group in zip(*columns):
        for h in set(chain) - prompt_blocks[group]:
            owners.setdefault(h, set()).add(scored or session)  # a scorer reuses its trajectory's blocks
    assert owners and all(len(o) == 1 for o in owners.values())


def test_scoring_request_extends_the_final_context(default: pa.Table) -> None:
    rows = default.to_pylist()
    last = {}
    for r in rows:
        if r["kind"] == "rollout":
            last[r["session_id"]] = r
    scoring = [r for r in rows if r["kind"] == "scoring"]
    assert scoring
    for r in scoring:
        traj = last[r["scores_session_id"]]
        context = traj["prompt_tokens"] + traj["output_tokens"]
        assert r["prompt_tokens"] == context + SynthConfig().scoring.template_tokens
        n_full = traj["prompt_tokens"] // r["block_size"]
        assert r["block_hashes"][:n_full] == traj["block_hashes"][:n_full]
        assert r["output_tokens"] <= r["max_tokens"] and r["group_id"] == traj["group_id"]


def test_partial_block_differs_from_the_full_block_it_grows_into(default: pa.Table) -> None:
    rows = default.to_pylist()
    seen = 0
    for a, b in zip(rows, rows[1:]):
        if a["session_id"] == b["session_id"] and a["prompt_tokens"] % a["block_size"]:
            j = a["prompt_tokens"] // a["block_size"]
            assert a["block_hashes"][j] != b["block_hashes"][j]
            seen += 1
    assert seen


# ---------------------------------------------------------------- calibration


def _implied(cfg: SynthConfig, domain: str, q: float) -> float:
    dom = cfg.domains[domain]
    return min(dom.output_tokens.quantile(q), dom.max_tokens)


@pytest.mark.parametrize("domain", ["math", "code", "agentic"])
def test_output_percentiles_match_the_config(large: dict[str, np.ndarray], domain: str) -> None:
    out = large["output_tokens"][_rollout(large, domain)]
    for q in (0.5, 0.9):
        assert np.percentile(out, 100 * q) == pytest.approx(_implied(LARGE, domain, q), rel=0.10), q


def test_tool_percentiles_match_the_config(large: dict[str, np.ndarray]) -> None:
    tool = LARGE.domains["agentic"].tool
    has_tool = ~np.isnan(large["tool_latency_s"].astype(float))
    for q in (0.5, 0.9):
        tokens = large["tool_tokens"][has_tool]
        assert np.percentile(tokens, 100 * q) == pytest.approx(tool.tokens.quantile(q), rel=0.10)
        assert np.percentile(large["tool_latency_s"][has_tool], 100 * q) == pytest.approx(
            tool.latency_s.quantile(q), rel=0.10
        )


def _jsonl(pattern: str) -> list[dict]:
    return [json.loads(line) for path in sorted(TRACES.glob(pattern)) for line in path.open()]


@pytest.fixture(scope="module")
def traces() -> dict[str, np.ndarray]:
    """The real samples the defaults are calibrated to."""
    if not TRACES.is_dir():
        pytest.skip(f"real traces not found at {TRACES} (../shared/traces relative to the repo root)")
    dapo, coder = _jsonl("dapo_math/packed_lengths_step_*.jsonl"), _jsonl("deepcoder/packed_lengths_step_*.jsonl")
    search = _jsonl("search_r1/multiturn_workload_step_*.jsonl")
    turns = [t["turns"] for t in search]
    return {
        "math output": np.concatenate([r["output"] for r in dapo]),
        "math prompt": np.array([r["input"] for r in dapo]),
        "code output": np.concatenate([r["output"] for r in coder]),
        "code prompt": np.array([r["input"] for r in coder]),
        "agentic output": np.array([u["completion_tokens"] for ts in turns for u in ts]),
        "agentic prompt": np.array([t["prompt_len"] for t in search]),
        "agentic turns": np.array([len(ts) for ts in turns]),
        "tool tokens": np.array(
            [b["prompt_tokens"] - a["prompt_tokens"] - a["completion_tokens"]
             for ts in turns for a, b in zip(ts, ts[1:])]
        ),
        "tool latency": np.array([c["latency_s"] for t in search for c in t["tool_calls"]]),
    }


def _generated(cols: dict[str, np.ndarray], what: str) -> np.ndarray:
    has_tool = ~np.isnan(cols["tool_latency_s"].astype(float))
    if what == "tool tokens":
        return cols["tool_tokens"][has_tool]
    if what == "tool latency":
        return cols["tool_latency_s"][has_tool]
    domain, column = what.split()
    mask = _rollout(cols, domain) & ((cols["turn"] == 0) if column == "prompt" else True)
    return cols[f"{column}_tokens"][mask]


@pytest.mark.parametrize(
    "what",
    [
        "math output", "math prompt", "code output", "code prompt",
        "agentic output", "agentic prompt", "tool tokens", "tool latency",
    ],
)
def test_defaults_match_the_real_traces(large: dict[str, np.ndarray], traces: dict[str, np.ndarray], what: str) -> None:
    for q in (50, 90):
        real = np.percentile(traces[what], q)
        assert np.percentile(_generated(large, what), q) == pytest.approx(real, rel=0.15), f"p{q}: trace {real}"


def test_agentic_turn_counts_match_search_r1(large: dict[str, np.ndarray], traces: dict[str, np.ndarray]) -> None:
    _, counts = np.unique(large["session_id"][_rollout(large, "agentic")], return_counts=True)
    real = traces["agentic turns"]
    assert counts.mean() == pytest.approx(real.mean(), rel=0.05)  # Search-R1: 2.63 turns per trajectory
    assert counts.max() == real.max() == 5


def test_code_is_often_cut_at_the_cap(large: dict[str, np.ndarray]) -> None:
    code = _rollout(large, "code")
    cut = (large["finish_reason"][code] == "length").mean()
    assert cut == pytest.approx(0.15, abs=0.03)  # DeepCoder: 15% at the 16k cap
    assert (large["output_tokens"][code][large["finish_reason"][code] == "length"] == 16000).all()


# ---------------------------------------------------------------- signal for a length predictor


def test_lengths_correlate_within_groups(large: dict[str, np.ndarray]) -> None:
    iccs = {}
    for domain in ("math", "code", "agentic"):
        groups, _, log_total, _ = _session_log_totals(large, domain)
        iccs[domain] = _icc(groups, log_total)
    assert iccs["math"] > 0.04  # DAPO: weak but real (normal-score ICC 0.094)
    assert iccs["agentic"] > 0.1
    assert iccs["code"] > 0.5  # DeepCoder: groups are nearly all long or all short
    groups, _, log_total, _ = _session_log_totals(large, "math")
    ratio = [np.exp(v.max() - np.median(v)) for v in np.split(log_total[np.argsort(groups)], len(set(groups)))]
    assert np.median(ratio) == pytest.approx(2.3, rel=0.2)  # DAPO: a group's longest is ~2.3x its median


def test_a_prompt_keeps_its_length_across_steps(large: dict[str, np.ndarray]) -> None:
    earlier, later = [], []
    for domain in ("math", "code", "agentic"):
        groups, prompts, log_total, steps = _session_log_totals(large, domain)
        keys, inverse = np.unique(groups, return_inverse=True)
        mean = np.bincount(inverse, weights=log_total) / np.bincount(inverse)
        prompt_of = dict(zip(groups, prompts))
        step_of = dict(zip(groups, steps))
        history: dict[str, float] = {}
        pairs = []
        for g in sorted(keys, key=lambda g: step_of[g]):
            value = mean[np.searchsorted(keys, g)]
            if prompt_of[g] in history:
                pairs.append((history[prompt_of[g]], value))
            history[prompt_of[g]] = value
        a, b = np.array(pairs).T
        assert np.corrcoef(a, b)[0, 1] > 0.3, domain
        earlier.append(a - a.mean())
        later.append(b - b.mean())
    assert np.corrcoef(np.concatenate(earlier), np.concatenate(later))[0, 1] > 0.5


# ---------------------------------------------------------------- config files


def test_default_toml_equals_the_defaults() -> None:
    assert SynthConfig.from_file(DEFAULT_TOML) == SynthConfig()


def test_a_file_overrides_only_what_it_names(tmp_path: Path) -> None:
    path = tmp_path / "small.toml"
    path.write_text("steps = 3\n[domains.code]\nmax_tokens = 8192\n")
    cfg = SynthConfig.from_file(path)
    assert cfg.steps == 3 and cfg.domains["code"].max_tokens == 8192
    assert cfg.domains["math"] == SynthConfig().domains["math"]
    assert dataclasses.replace(cfg, steps=2, domains=SynthConfig().domains) == SynthConfig()


@pytest.mark.parametrize(
    ("text", "key"),
    [
        ("stepz = 3\n", "'stepz'"),
        ("[domains.math]\nsigma = 0.5\n", "'domains.math.sigma'"),
        ("[domains.math.output_tokens]\nmedain = 400\n", "'domains.math.output_tokens.medain'"),
        ("[domains.code]\nmax_tokens = 'many'\n", "'domains.code.max_tokens'"),
        ("[domains.agentic]\ngroup_icc = 1.5\n", "'domains.agentic'"),
    ],
)
def test_bad_key_names_the_file_and_the_key(tmp_path: Path, text: str, key: str) -> None:
    path = tmp_path / "bad.toml"
    path.write_text(text)
    with pytest.raises(DataValidationError) as err:
        SynthConfig.from_file(path)
    assert str(path) in str(err.value) and key in str(err.value)


def test_config_rejects_bad_values() -> None:
    with pytest.raises(ValueError, match="group_size"):
        SynthConfig(group_size=0)
    for seed in (-1, 2**63):  # a seed the 64-bit block hashes cannot take is named, not an OverflowError later
        with pytest.raises(ValueError, match=r"seed must be in \[0, 2\*\*63\)"):
            SynthConfig(seed=seed)
    assert generate(SynthConfig(seed=2**63 - 1, steps=1, prompts_per_step=1, group_size=1)).num_rows > 0


@pytest.mark.parametrize(
    "change",
    [
        {"group_size": 1, "block_size": 1, "steps": 3, "repeat_fraction": 1.0},
        {"prompts_per_step": 3, "block_size": 512},
        {"domains": {"agentic": dataclasses.replace(AGENTIC, score_fraction=0.5, max_tokens=40)}},
    ],
)
def test_unusual_configs_still_validate(change: dict) -> None:
    table = generate(dataclasses.replace(SynthConfig(), **change))
    validate_table(table, WORKLOAD, "synth-unusual")
    assert table.num_rows > 0
