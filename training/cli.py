"""The ``kvpilot`` command line.

Heavy imports (vLLM, torch, LightGBM, MLflow) happen inside the commands that
need them, so ``kvpilot workload ...`` starts in well under a second.
"""

from __future__ import annotations

import dataclasses
import json
import time
from enum import Enum
from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.console import Console

from data.errors import DataValidationError

app = typer.Typer(
    help="kvpilot: a learned, KV-cache-aware scheduler for vLLM rollout servers.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
)
workload_app = typer.Typer(help="Generate, import, validate and describe workloads.", no_args_is_help=True)
app.add_typer(workload_app, name="workload")

console = Console(stderr=True)


class ImportFormat(str, Enum):
    """Trace formats that `kvpilot workload import` understands."""

    mooncake = "mooncake"
    polytrace_multiturn = "polytrace-multiturn"
    polytrace_lengths = "polytrace-lengths"


def _fail(message: str, code: int = 2) -> typer.Exit:
    console.print(f"[bold red]error:[/] {message}", markup=True, highlight=False)
    return typer.Exit(code)


@workload_app.command("synth")
def workload_synth(
    out: Annotated[Path, typer.Option("-o", "--out", help="Output Parquet file.")],
    config: Annotated[Optional[Path], typer.Option("--config", help="TOML config; defaults are built in.")] = None,
    seed: Annotated[Optional[int], typer.Option("--seed", help="Override the config's seed.")] = None,
) -> None:
    """Generate a seeded synthetic mixed-domain RL workload."""
    from data.io import write_workload
    from data.synth import SynthConfig, generate

    try:
        cfg = SynthConfig.from_file(config) if config else SynthConfig()
        if seed is not None:
            cfg = dataclasses.replace(cfg, seed=seed)
        t0 = time.perf_counter()
        table = generate(cfg)
        write_workload(table, out)
    except (DataValidationError, ValueError, OSError) as err:
        raise _fail(str(err)) from None
    console.print(f"wrote {table.num_rows:,} requests to {out} in {time.perf_counter() - t0:.2f} s")


@workload_app.command("import")
def workload_import(
    inputs: Annotated[list[Path], typer.Argument(help="Trace files (JSONL).")],
    fmt: Annotated[ImportFormat, typer.Option("--format", help="Input format.")],
    out: Annotated[Path, typer.Option("-o", "--out", help="Output Parquet file.")],
    skip_bad: Annotated[bool, typer.Option("--skip-bad", help="Skip malformed lines, then report them.")] = False,
) -> None:
    """Import a public trace into kvpilot's workload format, keeping its prefix structure."""
    from data import importers
    from data.io import write_workload

    readers = {
        ImportFormat.mooncake: importers.import_mooncake,
        ImportFormat.polytrace_multiturn: importers.import_polytrace_multiturn,
        ImportFormat.polytrace_lengths: importers.import_polytrace_lengths,
    }
    missing = [str(p) for p in inputs if not p.is_file()]
    if missing:
        raise _fail(f"no such file: {', '.join(missing)}")
    try:
        result = readers[fmt](inputs, skip_bad=skip_bad)
        write_workload(result.table, out)
    except (DataValidationError, ValueError, OSError) as err:
        raise _fail(str(err)) from None
    for file, line, reason in result.skipped[:20]:
        console.print(f"[yellow]skipped[/] {file}:{line}: {reason}", highlight=False)
    if result.skipped:
        console.print(f"[yellow]skipped {len(result.skipped)} bad line(s) in all[/]")
    if result.repaired:
        first_file, first_line, first_reason = result.repaired[0]
        console.print(
            f"repaired {len(result.repaired)} inconsistent value(s) in the trace, "
            f"e.g. {first_file}:{first_line}: {first_reason}",
            highlight=False,
        )
    console.print(f"wrote {result.table.num_rows:,} requests to {out}")


@workload_app.command("stats")
def workload_stats(
    path: Annotated[Path, typer.Argument(help="Workload Parquet file or directory.")],
    as_json: Annotated[bool, typer.Option("--json", help="Print one JSON object.")] = False,
) -> None:
    """Describe a workload: counts, token percentiles per domain, and prefix sharing."""
    from data.io import read_workload
    from data.stats import render_stats, workload_stats as compute

    try:
        stats = compute(read_workload(path))
    except (DataValidationError, ValueError, OSError) as err:
        raise _fail(str(err)) from None
    if as_json:
        typer.echo(json.dumps(stats, indent=2))
    else:
        typer.echo(render_stats(stats))


@workload_app.command("validate")
def workload_validate(path: Annotated[Path, typer.Argument(help="Workload Parquet file or directory.")]) -> None:
    """Check a workload against the schema and its structural rules."""
    from data.io import read_workload

    try:
        table = read_workload(path)
    except (DataValidationError, ValueError, OSError) as err:
        raise _fail(str(err)) from None
    console.print(f"{path}: valid, {table.num_rows:,} requests")


@app.command("demo")
def demo(
    out_dir: Annotated[Path, typer.Option("-o", "--out-dir", help="Where the demo writes its files.")] = Path(
        "kvpilot-demo"
    ),
) -> None:
    """Run the main job end to end on embedded defaults."""
    from data.io import read_workload, write_workload
    from data.stats import render_stats, workload_stats as compute
    from data.synth import SynthConfig, generate

    out_dir.mkdir(parents=True, exist_ok=True)
    workload_path = out_dir / "workload.parquet"
    console.rule("1. generate the default synthetic workload")
    t0 = time.perf_counter()
    write_workload(generate(SynthConfig()), workload_path)
    console.print(f"{workload_path} in {time.perf_counter() - t0:.2f} s")
    console.rule("2. validate it")
    table = read_workload(workload_path)
    console.print(f"valid: {table.num_rows:,} requests")
    console.rule("3. summary")
    typer.echo(render_stats(compute(table)))


def main() -> None:
    """Console-script entry point."""
    app()


if __name__ == "__main__":
    main()
