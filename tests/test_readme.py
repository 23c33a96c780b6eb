"""The user's guide holds: its quick commands run as written, no link in README.md or docs/ is broken or leaves the
repository, and every study in docs/results/ is dated, with its commands and the commit it ran on.

Quick commands are the fenced blocks tagged ```` ```bash quick ```` in README.md. They run in order, in one
temporary folder, with ``kvpilot`` on ``PATH`` as a shim for ``python -m training.cli`` of the repository
under test (so a stale ``kvpilot`` script of another checkout cannot answer for it).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import unicodedata
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
GUIDE_MAX_LINES = 250

FENCE = re.compile(r"^(```+|~~~+)(.*)$")
INLINE_LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(\s*<?([^)\s>]*)>?(?:\s+\"[^\"]*\")?\s*\)")
REFERENCE_DEF = re.compile(r"^\s{0,3}\[[^\]]+\]:\s*<?(\S+?)>?(?:\s|$)")
HTML_LINK = re.compile(r"""(?:href|src)\s*=\s*["']([^"']+)["']""", re.IGNORECASE)
BARE_URL = re.compile(r"(?<![\w/])(?:https?|ftp)://\S+|(?<![\w/])www\.\S+", re.IGNORECASE)
CODE_SPAN = re.compile(r"(`+)(?:.|\n)*?\1")
HTML_COMMENT = re.compile(r"<!--.*?-->", re.DOTALL)
SCHEME = re.compile(r"^[a-zA-Z][a-zA-Z0-9+.-]*:")


def markdown_files() -> list[Path]:
    return [README, *sorted((ROOT / "docs").rglob("*.md"))]


def split_fences(text: str) -> tuple[str, list[tuple[str, str]]]:
    """The text with fenced blocks blanked (line count kept), and each block's (info string, body)."""
    prose, blocks = [], []
    fence, info, body = None, "", []
    for line in text.splitlines():
        m = FENCE.match(line.strip()) if len(line) - len(line.lstrip()) < 4 else None
        if fence is None and m:
            fence, info, body = m.group(1), m.group(2).strip(), []
            prose.append("")
        elif fence is not None and m and m.group(1).startswith(fence[0]) and len(m.group(1)) >= len(fence) \
                and not m.group(2).strip():
            blocks.append((info, "\n".join(body)))
            fence = None
            prose.append("")
        elif fence is not None:
            body.append(line)
            prose.append("")
        else:
            prose.append(line)
    return "\n".join(prose), blocks


def quick_blocks(text: str) -> list[str]:
    """The bodies of the fenced blocks whose info string is ``bash quick``, in order."""
    return [body for info, body in split_fences(text)[1] if info.split() == ["bash", "quick"]]


def links(text: str) -> list[str]:
    """Every link target in markdown prose (inline, reference definitions, HTML href / src, bare URLs)."""
    prose = HTML_COMMENT.sub("", split_fences(text)[0])
    prose = CODE_SPAN.sub("", prose)
    found = [m.group(1) for m in INLINE_LINK.finditer(prose)]
    found += [m.group(1) for line in prose.splitlines() if (m := REFERENCE_DEF.match(line))]
    found += [m.group(1) for m in HTML_LINK.finditer(prose)]
    found += [m.group(0) for m in BARE_URL.finditer(INLINE_LINK.sub("", prose))]
    return found


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading).strip().lower()
    kept = "".join(c for c in text if c in " -_" or unicodedata.category(c)[0] in "LN")
    return kept.replace(" ", "-")


def anchors(text: str) -> set[str]:
    """The anchors of a markdown file's headings, duplicates numbered as GitHub does."""
    seen: dict[str, int] = {}
    out = set()
    for line in split_fences(text)[0].splitlines():
        m = re.match(r"^\s{0,3}#{1,6}\s+(.*?)\s*#*\s*$", line)
        if not m:
            continue
        base = slug(m.group(1))
        n = seen.get(base, 0)
        seen[base] = n + 1
        out.add(base if n == 0 else f"{base}-{n}")
    return out


def link_problems(md: Path) -> list[str]:
    """What is wrong with one file's links: a target outside the repository, missing, or a missing anchor."""
    problems = []
    for target in links(md.read_text()):
        where = f"{md.relative_to(ROOT)}: {target!r}"
        if SCHEME.match(target) or target.startswith(("//", "www.")):
            problems.append(f"{where} leaves the repository")
            continue
        path_part, _, fragment = target.partition("#")
        dest = (md.parent / path_part).resolve() if path_part else md
        if not dest.is_relative_to(ROOT):
            problems.append(f"{where} points outside the repository")
        elif not dest.exists():
            problems.append(f"{where} points to a missing file")
        elif fragment and dest.suffix == ".md" and fragment not in anchors(dest.read_text()):
            problems.append(f"{where}: no heading #{fragment} in {dest.relative_to(ROOT)}")
    return problems


def test_guide_is_short_and_has_quick_commands():
    text = README.read_text()
    assert len(text.splitlines()) < GUIDE_MAX_LINES
    commands = [ln for block in quick_blocks(text) for ln in block.splitlines() if ln.startswith("kvpilot ")]
    assert len(commands) >= 3, f"the guide tags too few quick kvpilot commands: {commands}"


def test_guide_keeps_the_two_setup_commands():
    _, blocks = split_fences(README.read_text())
    setup = [body for _, body in blocks if "make demo" in body and "make test" in body]
    assert setup, "README.md lost its two set-up commands (make demo, make test)"
    makefile = (ROOT / "Makefile").read_text()
    assert re.search(r"^demo:", makefile, re.M) and re.search(r"^test:", makefile, re.M)


@pytest.mark.slow
def test_quick_commands_run_as_written(tmp_path):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    shim = bin_dir / "kvpilot"
    shim.write_text(f'#!/bin/sh\nexec "{sys.executable}" -m training.cli "$@"\n')
    shim.chmod(0o755)
    work = tmp_path / "work"
    work.mkdir()
    env = {**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}",
           "PYTHONPATH": os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)}
    blocks = quick_blocks(README.read_text())
    assert blocks, "README.md has no ```bash quick block"
    for block in blocks:
        proc = subprocess.run(["bash", "-euo", "pipefail", "-c", block], cwd=work, env=env,
                              capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, f"quick block failed ({proc.returncode}):\n{block}\n--- stderr:\n{proc.stderr}"
    assert list(work.glob("*.parquet")), "the quick commands wrote no workload"


def test_every_link_stays_in_the_repository_and_resolves():
    problems = [p for md in markdown_files() for p in link_problems(md)]
    assert not problems, "\n".join(problems)


def test_link_checker_catches_bad_links(tmp_path, monkeypatch):
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "a.md").write_text("# Title here\n")
    md = tmp_path / "README.md"
    md.write_text(
        "[ok](docs/a.md#title-here) [gone](docs/missing.md) [up](../shared/DESIGN.md) [web](https://example.org)\n"
        "[anchor](docs/a.md#nope) see http://example.com `[code](nowhere.md)`\n"
        "```\n[fenced](nowhere.md)\n```\n<!-- [comment](nowhere.md) -->\n")
    problems = link_problems(md)
    assert len(problems) == 5, problems
    for word in ("docs/missing.md", "../shared/DESIGN.md", "https://example.org", "#nope", "http://example.com"):
        assert any(word in p for p in problems), (word, problems)


def test_quick_blocks_are_read_from_tagged_fences_only():
    text = "```bash\nkvpilot simulate x\n```\n```bash quick\nkvpilot --help\n```\n````bash quick\nkvpilot bound\n````\n"
    assert quick_blocks(text) == ["kvpilot --help", "kvpilot bound"]


@pytest.mark.parametrize("heading, anchor", [
    ("Set-up: two commands", "set-up-two-commands"),
    ("The `kvpilot` command's options", "the-kvpilot-commands-options"),
    ("0.2 of the step's KV in all", "02-of-the-steps-kv-in-all"),
])
def test_slug_matches_github(heading, anchor):
    assert slug(heading) == anchor


def test_results_are_dated_with_commands_and_commit():
    index = (ROOT / "docs" / "results" / "README.md").read_text()
    studies = sorted(p for p in (ROOT / "docs" / "results").glob("*.md") if p.name != "README.md")
    assert studies, "docs/results/ holds no study"
    for study in studies:
        text = study.read_text()
        assert re.fullmatch(r"\d{4}-\d{2}-\d{2}-[a-z0-9-]+\.md", study.name), f"{study.name}: not YYYY-MM-DD-topic.md"
        assert any(info.split()[:1] == ["bash"] for info, _ in split_fences(text)[1]), f"{study.name}: no commands"
        assert re.search(r"`[0-9a-f]{7,40}`", text), f"{study.name}: no commit it ran on"
        assert f"]({study.name})" in index, f"{study.name} is not listed in docs/results/README.md"
