"""The `kvpilot` command line: workload commands end to end, and errors in the user's words."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from training.cli import app

ROOT = Path(__file__).resolve().parents[1]
TRACES = ROOT.parent / "shared" / "traces"
runner = CliRunner()


def test_synth_then_stats_json(tmp_path: Path) -> None:
    out = tmp_path / "w.parquet"
    res = runner.invoke(app, ["workload", "synth", "-o", str(out)])
    assert res.exit_code == 0, res.output
    res = runner.invoke(app, ["workload", "stats", str(out), "--json"])
    assert res.exit_code == 0, res.output
    stats = json.loads(res.stdout)
    assert stats["requests"] > 2 * 64 * 8
    assert {"math", "code", "agentic", "reward"} <= set(stats["domains"])
    assert 0.0 < stats["unlimited_cache_hit_fraction"] < 1.0


def test_seed_changes_the_workload(tmp_path: Path) -> None:
    a, b = tmp_path / "a.parquet", tmp_path / "b.parquet"
    assert runner.invoke(app, ["workload", "synth", "-o", str(a), "--seed", "1"]).exit_code == 0
    assert runner.invoke(app, ["workload", "synth", "-o", str(b), "--seed", "2"]).exit_code == 0
    assert a.read_bytes() != b.read_bytes()


def test_stats_on_missing_file_is_a_clear_error(tmp_path: Path) -> None:
    res = runner.invoke(app, ["workload", "stats", str(tmp_path / "nope.parquet")])
    assert res.exit_code == 2
    assert "nope.parquet" in res.output


def test_validate_names_the_file_and_column_of_a_bad_workload(tmp_path: Path) -> None:
    import pyarrow.parquet as pq

    good = tmp_path / "good.parquet"
    assert runner.invoke(app, ["workload", "synth", "-o", str(good)]).exit_code == 0
    table = pq.read_table(good)
    bad = tmp_path / "bad.parquet"
    pq.write_table(table.drop_columns(["prompt_tokens"]), bad)
    res = runner.invoke(app, ["workload", "validate", str(bad)])
    assert res.exit_code == 2
    assert "bad.parquet" in res.output and "prompt_tokens" in res.output


def test_import_of_missing_traces_names_each(tmp_path: Path) -> None:
    res = runner.invoke(app, ["workload", "import", "--format", "mooncake", str(tmp_path / "a.jsonl"),
                              str(tmp_path / "b.jsonl"), "-o", str(tmp_path / "t.parquet")])
    assert res.exit_code == 2 and "no such file" in res.output and "a.jsonl" in res.output and "b.jsonl" in res.output


def test_an_import_that_yields_no_request_fails_and_writes_nothing(tmp_path: Path) -> None:
    empty, bad, out = tmp_path / "empty.jsonl", tmp_path / "bad.jsonl", tmp_path / "t.parquet"
    empty.write_text("")
    bad.write_text("{not json\n")
    res = runner.invoke(app, ["workload", "import", "--format", "mooncake", str(empty), "-o", str(out)])
    assert res.exit_code == 2 and "norequesttoimport" in "".join(res.output.split()) and not out.exists(), res.output
    res = runner.invoke(app, ["workload", "import", "--format", "mooncake", "--skip-bad", str(bad), "-o", str(out)])
    said = "".join(res.output.split())  # (the console wraps long paths)
    assert res.exit_code == 2 and "everylinewasskipped" in said and not out.exists(), res.output
    binary = tmp_path / "w.parquet"
    binary.write_bytes(b"PAR1\xe0\x00\xff\n")
    res = runner.invoke(app, ["workload", "import", "--format", "mooncake", str(binary), "-o", str(out)])
    said = "".join(res.output.split())
    assert res.exit_code == 2 and "w.parquet" in said and "line1:notUTF-8text" in said and not out.exists(), \
        res.output


@pytest.mark.skipif(not TRACES.is_dir(), reason="../shared/traces is absent")
def test_import_with_skip_bad_reports_the_skipped_line(tmp_path: Path) -> None:
    lines = (TRACES / "mooncake" / "synthetic_trace.jsonl").read_text().splitlines()[:50]
    lines.insert(10, "{not json")
    src = tmp_path / "trace.jsonl"
    src.write_text("\n".join(lines) + "\n")
    out = tmp_path / "t.parquet"
    res = runner.invoke(app, ["workload", "import", "--format", "mooncake", str(src), "-o", str(out)])
    assert res.exit_code == 2 and "trace.jsonl" in res.output and "11" in res.output
    res = runner.invoke(app, ["workload", "import", "--format", "mooncake", "--skip-bad", str(src), "-o", str(out)])
    assert res.exit_code == 0, res.output
    assert "skipped 1 bad line" in res.output
    stats = json.loads(runner.invoke(app, ["workload", "stats", str(out), "--json"]).stdout)
    assert stats["requests"] == 50


def test_console_script_is_installed() -> None:
    exe = ROOT / ".venv" / "bin" / "kvpilot"
    if not exe.exists():
        pytest.skip("kvpilot is not installed into .venv (run `make test`)")
    res = subprocess.run([str(exe), "workload", "--help"], capture_output=True, text=True, timeout=60)
    assert res.returncode == 0
    assert "synth" in res.stdout and "import" in res.stdout and "stats" in res.stdout


def test_the_command_line_runs_under_a_fixed_hash_seed(monkeypatch: pytest.MonkeyPatch) -> None:
    """vLLM iterates sets of request ids, so a simulation repeats only under a fixed string-hash seed: without
    PYTHONHASHSEED the entry point re-runs the same command line under ``HASH_SEED``; with one, it runs as given."""
    import os
    import sys

    import training.cli as cli

    calls: list = []
    monkeypatch.setattr(cli.os, "execv", lambda exe, argv: calls.append((exe, argv, os.environ["PYTHONHASHSEED"])))
    monkeypatch.setattr(cli, "app", lambda: calls.append("app"))
    monkeypatch.setenv("PYTHONHASHSEED", "7")  # so that the teardown restores the caller's environment
    cli.main()
    assert calls == ["app"]
    calls.clear()
    monkeypatch.delenv("PYTHONHASHSEED")
    cli.main()  # the real execv does not return; the stub does, and app() follows
    assert calls == [(sys.executable, [sys.executable, *sys.orig_argv[1:]], cli.HASH_SEED), "app"]


def test_a_path_the_command_cannot_create_is_an_error_not_a_traceback(tmp_path: Path) -> None:
    """An output path that is a file: the entry point names it and why, exit 2, and writes nothing there."""
    cfg, wl, taken = tmp_path / "w.toml", tmp_path / "w.parquet", tmp_path / "taken"
    cfg.write_text("steps = 1\nprompts_per_step = 1\ngroup_size = 2\n")
    assert runner.invoke(app, ["workload", "synth", "--config", str(cfg), "-o", str(wl)]).exit_code == 0
    taken.write_text("mine")
    res = subprocess.run([sys.executable, "-m", "training.cli", "simulate", "-w", str(wl), "-o", str(taken / "run"),
                          "--no-progress"], capture_output=True, text=True, timeout=300,
                         env={**os.environ, "PYTHONHASHSEED": "0"}, cwd=ROOT)
    said = "".join(res.stderr.split())  # (the console wraps long paths)
    assert res.returncode == 2 and "Traceback" not in res.stderr, res.stderr[-2000:]
    assert f"{taken}/run:" in said and taken.read_text() == "mine", said


def test_a_simulation_replaces_no_earlier_output(tmp_path: Path) -> None:
    """`simulate -o DIR` where DIR holds a run's telemetry or any summary.json: exit 2, naming it, nothing changed."""
    cfg, wl = tmp_path / "w.toml", tmp_path / "w.parquet"
    cfg.write_text("steps = 1\nprompts_per_step = 1\ngroup_size = 2\n")
    assert runner.invoke(app, ["workload", "synth", "--config", str(cfg), "-o", str(wl)]).exit_code == 0
    run = ["simulate", "-w", str(wl), "--no-progress", "--decode-stride", "32", "-o"]
    assert runner.invoke(app, [*run, str(tmp_path / "a")]).exit_code == 0
    first = (tmp_path / "a" / "summary.json").read_text()
    res = runner.invoke(app, [*run, str(tmp_path / "a")])
    assert res.exit_code == 2 and "already holds telemetry" in res.output, res.output
    other = tmp_path / "b"
    other.mkdir()
    (other / "summary.json").write_text("[]")  # e.g. an evaluation's
    res = runner.invoke(app, [*run, str(other)])
    assert res.exit_code == 2 and "summary.json already exists" in " ".join(res.output.split()), res.output
    assert (other / "summary.json").read_text() == "[]" and not (other / "telemetry").exists()
    assert (tmp_path / "a" / "summary.json").read_text() == first


def test_a_workload_says_what_made_it_and_a_simulation_reports_it(tmp_path: Path) -> None:
    """`workload synth` records its whole generator config in the file, `workload import` its format and files;
    `workload stats` and a simulation's summary report it, and a directory of parts made differently keeps each
    part's."""
    import dataclasses

    import pyarrow.parquet as pq

    from data.io import SOURCE_KEY, read_workload, source_of
    from data.synth import SynthConfig

    cfg = tmp_path / "w.toml"
    cfg.write_text("steps = 1\nprompts_per_step = 1\n")
    out = tmp_path / "w.parquet"
    assert runner.invoke(app, ["workload", "synth", "--preset", "agentic", "--config", str(cfg), "--seed", "77",
                               "-o", str(out)]).exit_code == 0
    src = json.loads(pq.read_schema(out).metadata[SOURCE_KEY])
    want = dataclasses.replace(SynthConfig.from_file(cfg, SynthConfig.preset("agentic")), seed=77)
    assert src == {"generator": "kvpilot workload synth", "config": json.loads(json.dumps(dataclasses.asdict(want)))}
    res = runner.invoke(app, ["workload", "stats", str(out)])
    assert "made by kvpilot workload synth, seed 77, 1 step(s) x 1 prompts" in res.output
    res = runner.invoke(app, ["simulate", "-w", str(out), "-o", str(tmp_path / "run"), "--no-progress",
                              "--kv-fraction", "0.5", "--decode-stride", "32"])
    assert res.exit_code == 0, res.output
    assert json.loads((tmp_path / "run" / "summary.json").read_text())["workload_source"] == src

    if (TRACES / "mooncake" / "synthetic_trace.jsonl").exists():
        lines = (TRACES / "mooncake" / "synthetic_trace.jsonl").read_text().splitlines()[:20]
        trace = tmp_path / "trace.jsonl"
        trace.write_text("\n".join(lines) + "\n")
        imported = tmp_path / "t.parquet"
        assert runner.invoke(app, ["workload", "import", "--format", "mooncake", str(trace), "-o",
                                   str(imported)]).exit_code == 0
        assert source_of(read_workload(imported)) == {"generator": "kvpilot workload import", "format": "mooncake",
                                                      "files": ["trace.jsonl"]}

    table = read_workload(out)
    parts = tmp_path / "parts"
    parts.mkdir()
    half = table.num_rows // 2
    pq.write_table(table.slice(0, half), parts / "a.parquet")
    other = {"generator": "elsewhere"}
    from data.io import with_source

    pq.write_table(with_source(table.slice(half), other), parts / "b.parquet")
    assert source_of(read_workload(parts)) == {"parts": [src, other]}
