"""``kvpilot promote``: the promotion gate that moves the ``champion`` alias of the registered model ``kvpilot``.

:func:`promote` simulates the candidate version and the current champion (both
loaded from the registry as learned policies, serving) beside vLLM default on
one held-out workload with :func:`training.evaluate.evaluate`, on the engine the
candidate's training evaluated it on unless given (:func:`trained_engine`), and
moves the alias only if the candidate is no worse on both the mean RL-step
makespan and the recomputed tokens, within :data:`MAKESPAN_TOLERANCE` and
:data:`RECOMPUTE_TOLERANCE` of the champion, and no slower than its own prior
(``learned-prior``: the same bundle with no trained network), simulated beside them. The first version (no champion
yet) becomes champion directly; ``force`` skips the gate.
"""

from __future__ import annotations

import dataclasses
import logging
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from training.train import (
    ENGINE_FIELDS,
    HELDOUT_MIX_ARTIFACT,
    HeldoutParams,
    heldout_workload,
    register_policy_dir,
)

log = logging.getLogger(__name__)

#: The candidate may be at most this much slower than the champion (relative mean RL-step makespan).
MAKESPAN_TOLERANCE = 0.01
#: The candidate may recompute at most this much more than the champion (relative), plus one KV block's tokens.
RECOMPUTE_TOLERANCE = 0.05
RECOMPUTE_SLACK_TOKENS = 16
#: The metrics of the comparison table.
COLUMNS = ("makespan_s", "makespan_ratio_vs_default", "recomputed_tokens", "preemptions", "prefix_hit_rate",
           "trajectory_p99_s")


class PromotionError(ValueError):
    """No such version, or a simulation of the gate failed."""


@dataclass
class GateResult:
    version: str
    champion_before: str | None
    promoted: bool
    reason: str
    rows: list[dict[str, Any]] = field(default_factory=list)  # the evaluation's rows (empty when not evaluated)
    engine: str = ""  # the evaluation's engine in words (HeldoutParams.engine), when evaluated


def passes_gate(candidate: dict[str, Any], champion: dict[str, Any]) -> tuple[bool, str]:
    """Whether ``candidate``'s row is no worse than ``champion``'s on makespan and recompute, and why."""
    c_m, h_m = float(candidate["makespan_s"]), float(champion["makespan_s"])
    c_r, h_r = float(candidate["recomputed_tokens"]), float(champion["recomputed_tokens"])
    makespan_ok = c_m <= h_m * (1 + MAKESPAN_TOLERANCE)
    recompute_ok = c_r <= h_r * (1 + RECOMPUTE_TOLERANCE) + RECOMPUTE_SLACK_TOKENS
    what = (f"makespan {c_m:.2f} s vs {h_m:.2f} s (x{c_m / h_m if h_m else float('nan'):.3f}, allowed "
            f"x{1 + MAKESPAN_TOLERANCE:g}); recomputed tokens {c_r:,.0f} vs {h_r:,.0f} (allowed "
            f"x{1 + RECOMPUTE_TOLERANCE:g} + {RECOMPUTE_SLACK_TOKENS})")
    if makespan_ok and recompute_ok:
        return True, f"no worse: {what}"
    worse = [w for w, ok in (("makespan", makespan_ok), ("recompute", recompute_ok)) if not ok]
    return False, f"worse on {' and '.join(worse)}: {what}"


def passes_prior(candidate: dict[str, Any], prior: dict[str, Any]) -> bool:
    """Whether ``candidate``'s makespan is no worse than its prior's (the same bundle with no trained network)."""
    return float(candidate["makespan_s"]) <= float(prior["makespan_s"]) * (1 + MAKESPAN_TOLERANCE)


def promote(
    version: int | str,
    *,
    force: bool = False,
    heldout: HeldoutParams | None = None,
    out_dir: Path | None = None,
    progress: bool = True,
) -> GateResult:
    """Run the gate for ``version`` of ``kvpilot`` and move ``champion`` when it passes (see the module docstring).

    ``heldout``: the gate's workload and engine (None: the defaults); its ``follow``: the settings taken from the
    held-out evaluation that trained ``version`` (:func:`trained_engine`), in place of ``heldout``'s; ``out_dir``
    keeps the evaluation (a temporary folder by default)."""
    from training import registry

    heldout = heldout or HeldoutParams()
    version = str(version)
    client = registry.client()
    try:
        client.get_model_version(registry.MODEL_NAME, version)
    except Exception as e:  # noqa: BLE001 - MLflow raises its own exception types for a missing version
        if registry.is_not_found(e):
            raise PromotionError(f"no version {version} of the registered model {registry.MODEL_NAME!r} in "
                                 f"{registry.tracking_uri()}: {e}") from None
        raise PromotionError(f"the registry at {registry.tracking_uri()} could not be read ({e})") from None
    if heldout.follow:
        taken = {k: v for k, v in trained_engine(version).items() if k in heldout.follow}
        heldout = dataclasses.replace(heldout, **taken)
    champion = registry.get_champion()
    before = str(champion.version) if champion is not None else None
    if before == version:
        return GateResult(version, before, False, f"version {version} is already the champion")
    if before is None or force:  # no gate simulation loads it: load it here, as every server would
        _check_serves(version)
    if before is None:
        return _move(version, None, "first version: it becomes champion without a comparison")
    if force:
        return _move(version, before, f"--force: the gate was skipped (champion was version {before})")
    with tempfile.TemporaryDirectory(prefix="kvpilot-promote-") as tmp:
        rows = compare(version, before, heldout, Path(out_dir) if out_dir is not None else Path(tmp),
                       progress=progress)
    cand, champ = rows_by_version(rows, version), rows_by_version(rows, before)
    ok, reason = passes_gate(cand, champ)
    prior = next((r for r in rows if r["policy"] == policy_name(version) + PRIOR_SUFFIX), None)
    if ok and prior is not None and not passes_prior(cand, prior):
        ok, reason = False, (f"slower than its own prior (learned-prior, no trained network): makespan "
                             f"{cand['makespan_s']:.2f} s vs {prior['makespan_s']:.2f} s (allowed "
                             f"x{1 + MAKESPAN_TOLERANCE:g}); against the champion: {reason}")
    result = _move(version, before, reason) if ok else GateResult(version, before, False, reason)
    result.rows = rows
    result.engine = heldout.engine()
    return result


def trained_engine(version: str) -> dict[str, Any]:
    """The held-out engine settings (:data:`training.train.ENGINE_FIELDS`) that ``kvpilot train`` evaluated
    ``version`` on (its MLflow run's ``heldout.*`` params); empty for a version registered some other way."""
    from training import registry

    client = registry.client()
    try:
        run_id = client.get_model_version(registry.MODEL_NAME, version).run_id
        params = client.get_run(run_id).data.params
    except Exception:  # noqa: BLE001 - no run (registered by hand): nothing to follow
        return {}
    out: dict[str, Any] = {}
    for k in ENGINE_FIELDS:
        v = params.get(f"heldout.{k}")
        if v is not None and k != "mix":  # (MLflow keeps params as text)
            out[k] = v if k == "preset" else None if v == "None" else float(v)
    if params.get("heldout.mix") == "True":
        import mlflow

        from data.synth import SynthConfig

        try:
            out["mix"] = SynthConfig.from_dict(mlflow.artifacts.load_dict(f"runs:/{run_id}/{HELDOUT_MIX_ARTIFACT}"))
        except Exception as e:  # noqa: BLE001 - MLflow raises its own types; the gate then runs the default mix
            log.warning("version %s: its training's held-out mix (%s) does not load (%s); the gate runs the "
                        "default mix", version, HELDOUT_MIX_ARTIFACT, e)
    return out


def _check_serves(version: str) -> None:
    """``version`` downloads and loads as the serving hook loads it, else :class:`PromotionError` (the champion
    unchanged): a champion no server can load would put every server on vLLM's own decisions."""
    from serving_hook.model_source import learned_loader
    from training import registry

    with tempfile.TemporaryDirectory(prefix="kvpilot-promote-") as tmp:
        try:
            policy_dir, _ = registry.fetch_policy_dir(f"models:/{registry.MODEL_NAME}/{version}", Path(tmp) / "v")
            learned_loader(policy_dir)
        except Exception as e:  # noqa: BLE001 - a download, schema or load failure: each named
            raise PromotionError(f"version {version} cannot be served ({type(e).__name__}: {e}); the champion is "
                                 "unchanged") from None


def _move(version: str, before: str | None, reason: str) -> GateResult:
    """Make ``version`` the champion, if the champion is still ``before`` (another promotion may have moved it while
    this one's gate ran: then :class:`PromotionError`, nothing changed)."""
    from training import registry

    now = registry.get_champion()
    now = str(now.version) if now is not None else None
    if now != before:
        raise PromotionError(f"the champion moved from {_label(before)} to {_label(now)} while the gate for version "
                             f"{version} ran (another promotion); run `kvpilot promote --version {version}` again "
                             "to compare it with the new champion")
    registry.set_champion(version)
    registry.client().set_model_version_tag(registry.MODEL_NAME, version, "promotion", reason)
    return GateResult(version, before, True, reason)


def _label(version: str | None) -> str:
    return f"version {version}" if version is not None else "none"


def policy_name(version: str) -> str:
    """The evaluation's policy name of a registry version."""
    return f"kvpilot-v{version}"


#: The evaluation's name of a version's prior (``learned-prior``): its policy name with this suffix.
PRIOR_SUFFIX = "-prior"


def rows_by_version(rows: list[dict[str, Any]], version: str) -> dict[str, Any]:
    return next(r for r in rows if r["policy"] == policy_name(version))


def compare(candidate: str, champion: str, heldout: HeldoutParams, out: Path, *,
            progress: bool = True) -> list[dict[str, Any]]:
    """Simulate both versions (downloaded from the registry into ``out``), the candidate's prior and vLLM default on
    the held-out workload."""
    from training import registry

    out.mkdir(parents=True, exist_ok=True)
    names = []
    for version in (champion, candidate):
        policy_dir, _ = registry.fetch_policy_dir(f"models:/{registry.MODEL_NAME}/{version}", out / "models" / version)
        if version == candidate:
            register_policy_dir(policy_name(version) + PRIOR_SUFFIX, policy_dir, "learned-prior")
            names.append(policy_name(version) + PRIOR_SUFFIX)
        register_policy_dir(policy_name(version), policy_dir)
        names.append(policy_name(version))
    workload = heldout_workload(heldout, out)
    result = heldout.run(workload, names, out / "evaluation", progress)
    failed = [r for r in result.rows if r.get("error")]
    if failed:
        raise PromotionError("gate simulation failed: " + "; ".join(f"{r['policy']}: {r['error']}" for r in failed))
    return result.rows


def render_table(rows: list[dict[str, Any]], labels: dict[str, str] | None = None) -> str:
    """Evaluation rows as a Markdown table of :data:`COLUMNS` (``labels`` renames policies)."""
    labels = labels or {}
    lines = ["| policy | " + " | ".join(COLUMNS) + " |", "|---|" + "---|" * len(COLUMNS)]
    for row in rows:
        lines.append(f"| {labels.get(row['policy'], row['policy'])} | "
                     + " | ".join(_fmt(row.get(c)) for c in COLUMNS) + " |")
    if not any(r.get("preemptions") for r in rows if r["policy"] == "vllm-default"):
        lines.append("warning: vLLM default did not preempt on this workload: no KV pressure to win on")
    return "\n".join(lines)


def render_comparison(result: GateResult) -> str:
    """The comparison table (when the gate ran) and the verdict."""
    lines = []
    if result.rows:
        labels = {policy_name(result.version): f"candidate v{result.version}",
                  policy_name(result.version) + PRIOR_SUFFIX: f"learned-prior v{result.version}"}
        if result.champion_before is not None:
            labels[policy_name(result.champion_before)] = f"champion v{result.champion_before}"
        lines += [f"held-out evaluation on {result.engine}", render_table(result.rows, labels), ""]
    verdict = "promoted" if result.promoted else "not promoted"
    lines.append(f"version {result.version}: {verdict} ({result.reason}); champion is now version "
                 f"{result.version if result.promoted else result.champion_before}")
    return "\n".join(lines)


def _fmt(v: Any) -> str:
    if v is None:
        return ""
    if isinstance(v, float):
        return f"{v:,.4g}" if abs(v) < 1e4 else f"{v:,.0f}"
    if isinstance(v, int):
        return f"{v:,}"
    return str(v)
