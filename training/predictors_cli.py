"""``kvpilot train predictors`` and ``kvpilot predictors eval``: typer sub-apps, mounted by training/cli.py.

``train_app`` has the command ``predictors`` (mount as ``kvpilot train``) and
``predictors_app`` the command ``eval`` (mount as ``kvpilot predictors``). LightGBM
and pandas are imported inside the commands.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console

train_app = typer.Typer(help="Train kvpilot's models.", no_args_is_help=True, pretty_exceptions_enable=False)
predictors_app = typer.Typer(help="Inspect and evaluate trained predictors.", no_args_is_help=True,
                             pretty_exceptions_enable=False)
console = Console(stderr=True)


@train_app.callback()
def _train_group() -> None:
    """Train kvpilot's models."""


@predictors_app.callback()
def _predictors_group() -> None:
    """Inspect and evaluate trained predictors."""


def _fail(message: str, code: int = 2) -> typer.Exit:
    console.print(f"[bold red]error:[/] {message}", markup=True, highlight=False)
    return typer.Exit(code)


def _steps(text: str | None) -> list[int] | None:
    if not text:
        return None
    out: list[int] = []
    for part in text.split(","):
        part = part.strip()
        if "-" in part:
            a, b = part.split("-", 1)
            out.extend(range(int(a), int(b) + 1))
        elif part:
            out.append(int(part))
    return out


def _load(logs: list[Path]):
    from data.errors import DataValidationError
    from predictors.logs import load_logs

    missing = [str(p) for p in logs if not p.exists()]
    if missing:
        raise _fail(f"no such log: {', '.join(missing)}")
    try:
        return load_logs(logs)
    except (DataValidationError, ValueError, OSError) as err:
        raise _fail(str(err)) from None


@train_app.command("predictors")
def train_predictors(
    logs: Annotated[list[Path], typer.Option("--logs", help="Telemetry run directories (or workload files); repeat.")],
    out: Annotated[Path, typer.Option("-o", "--out", help="Model directory to write.")],
    test_steps: Annotated[str | None, typer.Option(
        "--test-steps", help="Held-out RL steps, e.g. '6-7' or '2'; default: the last quarter of the steps.")] = None,
    horizon_s: Annotated[float, typer.Option("--horizon", help="Reuse horizon H in seconds.")] = 10.0,
    num_trees: Annotated[int, typer.Option("--trees", help="Boosting rounds per model.")] = 100,
    threads: Annotated[int, typer.Option("--threads", help="LightGBM training threads.")] = 2,
    no_reuse: Annotated[bool, typer.Option("--no-reuse", help="Skip the reuse model.")] = False,
    no_session: Annotated[bool, typer.Option("--no-session", help="Skip the session models (tool latency, "
                                                                  "continuation, turns left, next use).")] = False,
    as_json: Annotated[bool, typer.Option("--json", help="Print the report as one JSON object.")] = False,
) -> None:
    """Train the length, reuse and session predictors, holding out whole RL steps, and print each model's metrics
    beside its baselines."""
    from predictors.pipeline import render_report, train_bundle

    df = _load(logs)
    try:
        bundle = train_bundle(df, test_steps=_steps(test_steps), horizon_s=horizon_s, num_trees=num_trees,
                              num_threads=threads, reuse=not no_reuse, session=not no_session)
    except ValueError as err:
        raise _fail(str(err)) from None
    bundle.save(out)
    if as_json:
        typer.echo(json.dumps(bundle.report, indent=2, default=float))
    else:
        typer.echo(render_report(bundle.report))
    console.print(f"model written to {out}", highlight=False)


@predictors_app.command("eval")
def eval_predictors(
    model: Annotated[Path, typer.Option("--model", help="Model directory from `kvpilot train predictors`.")],
    logs: Annotated[list[Path], typer.Option("--logs", help="Telemetry run directories (or workload files).")],
    steps: Annotated[str | None, typer.Option("--steps", help="Evaluate these RL steps only.")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print the report as one JSON object.")] = False,
) -> None:
    """Evaluate saved predictors beside their saved baselines on logs (a directory without reuse or session
    models reports the others)."""
    from predictors.model_io import ModelSchemaError
    from predictors.pipeline import Bundle, evaluate_bundle, render_report

    if not model.is_dir():
        raise _fail(f"no such model directory: {model}")
    try:
        bundle = Bundle.load(model)
    except ModelSchemaError as err:
        raise _fail(str(err)) from None
    df = _load(logs)
    try:
        report = evaluate_bundle(bundle, df, _steps(steps))
    except ValueError as err:
        raise _fail(str(err)) from None
    if as_json:
        typer.echo(json.dumps(report, indent=2, default=float))
    else:
        typer.echo(render_report(report))
