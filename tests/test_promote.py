"""`kvpilot promote` on a real MLflow SQLite store with real small simulations: the first version becomes champion,
a deliberately worse candidate is refused, a better one is accepted, --force skips the gate.

The two POLICY_DIRs are real learned-policy bundles whose scorers are wired by hand, so the test does not hang on
how well a tiny training run goes: the better one admits in arrival order and preempts the request with the
least progress (close to vLLM's own choices, and faster than its prior's shortest-first order on this workload,
so the gate's check against its own prior passes); the worse one admits the longest predicted first and preempts
the request with the most progress, which costs both makespan and recompute under KV pressure.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from tests.loop_fixtures import KV, base_policy_dir, mlflow_store, tiny_workload, wired  # noqa: F401 - a fixture
from training.train import HeldoutParams

pytestmark = [pytest.mark.vllm, pytest.mark.slow]


@pytest.fixture(scope="module")
def policies(tmp_path_factory: pytest.TempPathFactory, vllm_engine) -> tuple[Path, Path]:
    """(better POLICY_DIR, worse POLICY_DIR)."""
    root = tmp_path_factory.mktemp("policies")
    base = base_policy_dir(root)
    better = wired(base, root / "better", None, ("log_computed_tokens", -1.0))
    worse = wired(base, root / "worse", ("log_pred_remaining", 1.0), ("log_computed_tokens", 1.0))
    return better, worse


@pytest.fixture(scope="module")
def heldout(tmp_path_factory: pytest.TempPathFactory) -> HeldoutParams:
    return HeldoutParams(workload=tiny_workload(tmp_path_factory.mktemp("heldout") / "w.parquet", seed=77),
                         kv_fraction=KV)


def _register(policy_dir: Path) -> str:
    import mlflow

    from training import registry

    registry.configure("promote-test")
    with mlflow.start_run():
        return str(registry.log_policy_model(policy_dir).version)


def _champion() -> str:
    from training import registry

    return str(registry.get_champion().version)


@pytest.mark.usefixtures("mlflow_store")
def test_gate(policies: tuple[Path, Path], heldout: HeldoutParams, tmp_path: Path) -> None:
    from training.cli import app
    from training.promote import passes_gate, promote, render_comparison

    better_dir, worse_dir = policies
    v1 = _register(worse_dir)
    first = promote(v1, heldout=heldout)
    assert first.promoted and first.champion_before is None and not first.rows  # no comparison for the first
    assert _champion() == v1

    v2 = _register(better_dir)
    better = promote(v2, heldout=heldout, out_dir=tmp_path / "g2", progress=False)
    text = render_comparison(better)
    assert better.promoted, text
    assert _champion() == v2
    assert f"candidate v{v2}" in text and f"champion v{v1}" in text and "vllm-default" in text
    assert f"learned-prior v{v2}" in text  # the candidate beside its own prior

    v3 = _register(worse_dir)
    res = CliRunner().invoke(app, ["promote", "--version", v3, "--workload", str(heldout.workload), "--kv-fraction",
                                   str(KV), "-o", str(tmp_path / "g3"), "--no-progress"])
    assert res.exit_code == 1, res.output  # refused
    assert f"candidate v{v3}" in res.output and f"champion v{v2}" in res.output and "not promoted" in res.output
    assert _champion() == v2
    # what it refused: worse than the champion on the same run's numbers, by more than the tolerance
    rows = json.loads((tmp_path / "g3" / "evaluation" / "summary.json").read_text())
    cand, champ = (next(r for r in rows if r["policy"] == f"kvpilot-v{v}") for v in (v3, v2))
    assert not passes_gate(cand, champ)[0]
    assert cand["makespan_s"] > champ["makespan_s"] or cand["recomputed_tokens"] > champ["recomputed_tokens"]

    forced = promote(v3, force=True, heldout=heldout)
    assert forced.promoted and not forced.rows and _champion() == v3


def test_a_candidate_slower_than_its_prior_is_refused() -> None:
    from training.promote import MAKESPAN_TOLERANCE, passes_prior

    prior = {"makespan_s": 100.0}
    assert passes_prior({"makespan_s": 100.0 * (1 + MAKESPAN_TOLERANCE) - 1e-9}, prior)
    assert not passes_prior({"makespan_s": 100.0 * (1 + MAKESPAN_TOLERANCE) + 1e-6}, prior)


def test_passes_gate_tolerances() -> None:
    from training.promote import MAKESPAN_TOLERANCE, passes_gate

    champ = {"makespan_s": 100.0, "recomputed_tokens": 1000}
    assert passes_gate({"makespan_s": 100.0, "recomputed_tokens": 1000}, champ)[0]  # equal: no worse
    assert passes_gate({"makespan_s": 100.0 * (1 + MAKESPAN_TOLERANCE) - 1e-9, "recomputed_tokens": 0}, champ)[0]
    ok, why = passes_gate({"makespan_s": 102.0, "recomputed_tokens": 900}, champ)
    assert not ok and "worse on makespan" in why
    ok, why = passes_gate({"makespan_s": 90.0, "recomputed_tokens": 2000}, champ)
    assert not ok and "worse on recompute" in why


@pytest.mark.usefixtures("mlflow_store")
def test_a_version_no_server_can_load_is_not_promoted(policies: tuple[Path, Path], tmp_path: Path) -> None:
    """The first version and --force skip the gate's simulation; the version must still load as a server loads it."""
    import shutil

    from training import registry
    from training.promote import PromotionError, promote

    broken = shutil.copytree(policies[0], tmp_path / "broken")
    pt = broken / "policy.pt"
    pt.write_bytes(pt.read_bytes()[:100])  # a truncated model file
    champion = registry.get_champion()
    before = str(champion.version) if champion is not None else None
    v = _register(broken)
    with pytest.raises(PromotionError, match=f"version {v} cannot be served"):
        promote(v, force=True)
    after = registry.get_champion()
    assert (str(after.version) if after is not None else None) == before


@pytest.mark.usefixtures("mlflow_store")
def test_a_champion_moved_by_another_promotion_during_the_gate_is_not_overwritten(
        policies: tuple[Path, Path], heldout: HeldoutParams, monkeypatch: pytest.MonkeyPatch) -> None:
    from training import promote as promote_mod
    from training import registry

    va, vb, vc = (_register(policies[0]) for _ in range(3))
    registry.set_champion(va)

    def gate_while_another_promotes(candidate, champion, *args, **kwargs):
        registry.set_champion(vc)  # another `kvpilot promote` finished meanwhile
        return [{"policy": promote_mod.policy_name(v), "makespan_s": 1.0, "recomputed_tokens": 0}
                for v in (candidate, champion)]

    monkeypatch.setattr(promote_mod, "compare", gate_while_another_promotes)
    with pytest.raises(promote_mod.PromotionError, match=f"moved from version {va} to version {vc}"):
        promote_mod.promote(vb, heldout=heldout, progress=False)
    assert _champion() == vc


@pytest.mark.usefixtures("mlflow_store")
def test_unknown_version_is_a_clear_error() -> None:
    from training.cli import app

    res = CliRunner().invoke(app, ["promote", "--version", "999", "--no-progress"])
    assert res.exit_code == 2 and "no version 999" in res.output


def test_a_store_that_does_not_answer_is_named_unreachable_within_seconds(monkeypatch) -> None:
    """A registry server that refuses connections: exit 2 naming the store as unreadable (it said "no version"),
    after kvpilot's few retries (MLflow's own defaults retried for four minutes)."""
    import socket
    import time

    import mlflow

    from training.cli import app

    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    uri = f"http://127.0.0.1:{port}"
    for k in ("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR"):
        monkeypatch.delenv(k, raising=False)
    before = mlflow.get_tracking_uri() if mlflow.is_tracking_uri_set() else None
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    mlflow.set_tracking_uri(uri)
    try:
        t = time.monotonic()
        res = CliRunner().invoke(app, ["promote", "--version", "1", "--no-progress"])
        took = time.monotonic() - t
    finally:
        mlflow.set_tracking_uri(before or "")
    assert res.exit_code == 2 and "could not be read" in res.output and "no version" not in res.output, res.output
    assert took < 60, took
