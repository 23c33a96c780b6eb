"""The makespan lower bound (simulator/bound.py) against vLLM's real scheduler in the simulator.

The bound must hold for every schedule: no simulated RL step may end before it, whatever the policy, KV size,
replica count or decode stride. And it must not be vacuous: a request alone takes about what it says.
"""

from __future__ import annotations

import dataclasses
import random

import numpy as np
import pytest

from data.synth import SplitLogNormal, SynthConfig, ToolConfig, generate, swe_domain
from simulator.bound import makespan_bound, render_bound
from simulator.cost_model import CostModel
from simulator.simulation import run_simulation
from simulator.sizing import blocks_for_fraction, min_blocks_for
from simulator.workload import prepare_workload

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

COST = CostModel.preset("H200-7B")
POLICIES = ("vllm-default", "continuum", "oracle")


def _pool(rng: random.Random) -> dict:
    """The calibrated domains, shrunk so that a run takes a fraction of a second."""
    short = SynthConfig.preset("short").domains
    math = dataclasses.replace(short["math"], output_tokens=SplitLogNormal(median=rng.choice((40, 120)),
                                                                          sigma=0.8, min=1),
                               max_tokens=600)
    search = dataclasses.replace(short["agentic"], max_tokens=200)
    swe = dataclasses.replace(swe_domain(1.0), turns=SplitLogNormal(median=4, sigma=0.5, min=2, max=8),
                              output_tokens=SplitLogNormal(median=40, sigma=0.5, min=4), max_context_tokens=6000,
                              prompt_tokens=SplitLogNormal(median=600, sigma=0.3, min=100, max=2000),
                              tool=ToolConfig("sandbox", SplitLogNormal(median=0.5, sigma=1.0, max=5.0),
                                              SplitLogNormal(median=200, sigma=0.6, min=16, max=1000)))
    return {"math": math, "agentic": search, "swe": swe}


def _small_domains(rng: random.Random) -> dict:
    """Two or three of the shrunk domains, with random shares."""
    pool = _pool(rng)
    names = rng.sample(sorted(pool), rng.choice((2, 3)))
    return {n: dataclasses.replace(pool[n], share=rng.uniform(0.3, 1.0)) for n in names}


#: Seeds from here on are KV-bound (many long single-turn requests in a small cache): the busy term binds.
BUSY_SEEDS = 15


def _case(seed: int) -> tuple[SynthConfig, int, int]:
    rng = random.Random(seed)
    if seed >= BUSY_SEEDS:
        math = dataclasses.replace(_pool(rng)["math"], share=1.0,
                                   output_tokens=SplitLogNormal(median=300, sigma=0.5, min=1))
        cfg = SynthConfig(seed=seed, steps=1, prompts_per_step=8, group_size=4, domains={"math": math})
    else:
        cfg = SynthConfig(seed=seed, steps=rng.choice((1, 2)), prompts_per_step=rng.choice((2, 3, 4)),
                          group_size=rng.choice((2, 3, 4)), domains=_small_domains(rng))
    return cfg, rng.choice((1, 2)), rng.choice((1, 8))


@pytest.mark.parametrize("seed", range(20))
def test_no_simulated_step_ends_before_its_bound(seed: int) -> None:
    cfg, replicas, stride = _case(seed)
    workload = prepare_workload(generate(cfg))
    for fraction in (0.1, 1.0) if seed >= BUSY_SEEDS else (0.3, 1.0):
        kv_blocks = max(blocks_for_fraction(workload, fraction), min_blocks_for(workload) + 2)
        bound = makespan_bound(workload, COST, kv_blocks, replicas=replicas, decode_stride=stride)
        if seed >= BUSY_SEEDS and fraction < 1:
            assert all(s.binding == "busy" for s in bound.steps)  # the KV-area term is what is tested here
        for policy in POLICIES:
            res = run_simulation(workload, policy, replicas=replicas, router="round-robin", kv_blocks=kv_blocks,
                                 progress=False, decode_stride=stride)
            simulated = res.summary.metrics.makespan_per_step_s
            bounds = [s.bound_s for s in bound.steps]
            assert len(simulated) == len(bounds)
            for got, floor in zip(simulated, bounds):
                assert got >= floor * (1 - 1e-9), (
                    f"seed {seed} {policy} kv {fraction} r{replicas} k{stride}: step took {got:.4f} s, "
                    f"below the bound {floor:.4f} s\n{render_bound(bound)}")


@pytest.mark.parametrize("domain", ["math", "swe"])
def test_a_session_alone_takes_about_its_bound(domain: str) -> None:
    """One request (or one multi-turn session) with nothing else running: within 5% of the simulated makespan."""
    one = dataclasses.replace(_pool(random.Random(0))[domain], share=1.0, score_fraction=0.0)
    workload = prepare_workload(generate(SynthConfig(seed=5, steps=1, prompts_per_step=1, group_size=1,
                                                     domains={domain: one})))
    kv_blocks = COST.max_kv_blocks(16)
    bound = makespan_bound(workload, COST, kv_blocks)
    res = run_simulation(workload, "vllm-default", kv_blocks=kv_blocks, progress=False)
    got = res.summary.metrics.makespan_s
    assert bound.steps[0].binding == "chain"
    assert bound.mean_s <= got <= 1.05 * bound.mean_s, (got, render_bound(bound))
    assert np.isclose(bound.total_s, bound.mean_s)


def test_more_kv_or_more_replicas_never_raise_the_bound() -> None:
    workload = prepare_workload(generate(dataclasses.replace(SynthConfig.preset("short"), prompts_per_step=8)))
    small = blocks_for_fraction(workload, 0.1)
    tight = makespan_bound(workload, COST, small)
    assert makespan_bound(workload, COST, 4 * small).total_s <= tight.total_s
    two = makespan_bound(workload, COST, small, replicas=2)
    assert two.total_s <= tight.total_s
    assert all(s.chain_s == t.chain_s for s, t in zip(two.steps, tight.steps))
    with pytest.raises(ValueError, match="replicas must be >= 1, got 0"):
        makespan_bound(workload, COST, small, replicas=0)
    with pytest.raises(ValueError, match="kv_blocks must be >= 2, got 1"):  # the setting that is wrong, alone
        makespan_bound(workload, COST, 1)
    with pytest.raises(ValueError, match="decode_stride must be >= 1, got 0"):
        makespan_bound(workload, COST, small, decode_stride=0)


def test_cli_prints_the_bound_per_step_and_refuses_a_cache_too_small(tmp_path) -> None:
    import json

    from typer.testing import CliRunner

    from data.io import write_workload
    from training.cli import app

    path = tmp_path / "w.parquet"
    write_workload(generate(_case(3)[0]), path)
    res = CliRunner().invoke(app, ["bound", "-w", str(path), "--kv-fraction", "0.5", "--replicas", "2", "--json"])
    assert res.exit_code == 0, res.output
    got = json.loads(res.output)
    assert got["replicas"] == 2 and len(got["steps"]) >= 1 and got["total_s"] > 0
    assert got["total_s"] == pytest.approx(sum(s["bound_s"] for s in got["steps"]))
    text = CliRunner().invoke(app, ["bound", "-w", str(path)])
    assert text.exit_code == 0 and "binding" in text.output and "total" in text.output
    bad = CliRunner().invoke(app, ["bound", "-w", str(path), "--kv-blocks", "2"])
    assert bad.exit_code == 2 and "smaller than the largest request" in bad.output
    # --time-scale as replay and simulate take it: shorter tool waits never lengthen a step's bound
    waits = json.loads(CliRunner().invoke(app, ["bound", "-w", str(path), "--json"]).output)["steps"]
    none = json.loads(CliRunner().invoke(app, ["bound", "-w", str(path), "--time-scale", "0", "--json"]).output)
    none = none["steps"]
    assert all(a["bound_s"] <= b["bound_s"] for a, b in zip(none, waits))
    assert any(a["chain_s"] < b["chain_s"] for a, b in zip(none, waits))
    neg = CliRunner().invoke(app, ["bound", "-w", str(path), "--time-scale", "-1"])
    assert neg.exit_code == 2 and "--time-scale must be a number >= 0" in neg.output
