"""``kvpilot train policy``: fit the learned policy from logged decisions (a command function, mounted by
training/cli.py).

torch, pandas and LightGBM are imported inside the command.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.console import Console

from training.cli_errors import reported

console = Console(stderr=True)


def train_policy_cmd(
    logs: Annotated[list[Path], typer.Option("--logs", help="Telemetry run directories with decisions; repeat. "
                                             "The last one is held out for off-policy evaluation.")],
    predictors: Annotated[Path, typer.Option("--predictors", help="MODEL_DIR from `kvpilot train predictors`.")],
    out: Annotated[Path, typer.Option("-o", "--out", help="POLICY_DIR to write.")],
    config: Annotated[Optional[str], typer.Option(
        "--config", help="JSON object of OfflineConfig fields, e.g. '{\"epochs\": 20}'.")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print the metrics as one JSON object.")] = False,
    progress: Annotated[bool, typer.Option("--progress/--no-progress", help="Progress bar on stderr.")] = True,
) -> None:
    """Fit the learned admission / preemption policy (imitation warm start, doubly robust) and write POLICY_DIR."""
    from policy.learning.config import OfflineConfig
    from policy.learning.offline import train_policy

    with reported(ValueError, prefix="--config: "):
        cfg = OfflineConfig.from_json(config)
    with reported(ValueError, OSError):  # PolicyLoadError is a ValueError; a missing log or model is an OSError
        metrics = train_policy(logs, predictors, out, cfg, progress=progress)
    if as_json:
        typer.echo(json.dumps(metrics, indent=2, default=float))
    else:
        for k, v in metrics.items():
            typer.echo(f"{k:<28} {v:.4g}")
    console.print(f"held out by {heldout_note(out)}; policy written to {out}", highlight=False)


def heldout_note(policy_dir: Path) -> str:
    """How the training of POLICY_DIR held decisions out (its manifest's ``trained_on.split``), as printed."""
    from policy.learned.bundle import read_manifest
    from policy.learning.offline import SPLITS

    split = read_manifest(policy_dir).get("trained_on", {}).get("split")
    return SPLITS.get(split, str(split))

