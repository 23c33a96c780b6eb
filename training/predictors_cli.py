"""``kvpilot train predictors`` and ``kvpilot predictors eval``: command functions, mounted by training/cli.py.

LightGBM and pandas are imported inside the commands.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console

from training.cli_errors import reported

console = Console(stderr=True)

#: What the libraries raise on a user's bad input: a missing or unreadable log or model (named in the message),
#: bad steps, a split that leaves nothing (``DataValidationError`` and ``ModelSchemaError`` are ``ValueError``\ s).
_INPUT_ERRORS: tuple[type[Exception], ...] = (ValueError, OSError)


def train_predictors(
    logs: Annotated[list[Path], typer.Option("--logs", help="Telemetry run directories (or workload files); repeat.")],
    out: Annotated[Path, typer.Option("-o", "--out", help="Model directory to write.")],
    test_steps: Annotated[str | None, typer.Option(
        "--test-steps", help="Held-out RL steps, e.g. '6-7' or '2'; default: the last quarter of the steps.")] = None,
    horizon_s: Annotated[float, typer.Option("--horizon", help="Reuse horizon H in seconds.")] = 10.0,
    num_trees: Annotated[int, typer.Option("--trees", min=1, help="Boosting rounds per model.")] = 100,
    threads: Annotated[int, typer.Option("--threads", min=1, help="LightGBM training threads.")] = 2,
    no_reuse: Annotated[bool, typer.Option("--no-reuse", help="Skip the reuse model.")] = False,
    no_session: Annotated[bool, typer.Option("--no-session", help="Skip the session models (tool latency, "
                                                                  "continuation, turns left, next use).")] = False,
    as_json: Annotated[bool, typer.Option("--json", help="Print the report as one JSON object.")] = False,
) -> None:
    """Train the length, reuse and session predictors, holding out whole RL steps, and print each model's metrics
    beside its baselines."""
    from predictors.logs import load_logs, parse_steps
    from predictors.pipeline import render_report, train_bundle

    with reported(*_INPUT_ERRORS):
        bundle = train_bundle(load_logs(logs), test_steps=parse_steps(test_steps), horizon_s=horizon_s,
                              num_trees=num_trees, num_threads=threads, reuse=not no_reuse, session=not no_session)
    bundle.save(out)
    if as_json:
        typer.echo(json.dumps(bundle.report, indent=2, default=float))
    else:
        typer.echo(render_report(bundle.report))
    console.print(f"model written to {out}", highlight=False)


def eval_predictors(
    model: Annotated[Path, typer.Option("--model", help="Model directory from `kvpilot train predictors`.")],
    logs: Annotated[list[Path], typer.Option("--logs", help="Telemetry run directories (or workload files).")],
    steps: Annotated[str | None, typer.Option("--steps", help="Evaluate these RL steps only.")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print the report as one JSON object.")] = False,
) -> None:
    """Evaluate saved predictors beside their saved baselines on logs (a directory without reuse or session
    models reports the others)."""
    from predictors.logs import load_logs, parse_steps
    from predictors.pipeline import Bundle, evaluate_bundle, render_report

    with reported(*_INPUT_ERRORS):
        report = evaluate_bundle(Bundle.load(model), load_logs(logs), parse_steps(steps))
    if as_json:
        typer.echo(json.dumps(report, indent=2, default=float))
    else:
        typer.echo(render_report(report))
