"""The built wheel ships exactly kvpilot's six top-level packages and its console script."""

from __future__ import annotations

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = {"data", "predictors", "policy", "training", "serving_hook", "simulator"}


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("wheel")
    # Built from the files git would clone (a stale kvpilot.egg-info here lists files a fresh clone's build misses).
    src = tmp_path_factory.mktemp("src")
    listed = subprocess.run(["git", "ls-files", "-co", "--exclude-standard"], cwd=ROOT, check=True,
                            capture_output=True, text=True).stdout.split("\n")
    for name in filter(None, listed):
        if (ROOT / name).is_file():
            (src / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / name, src / name)
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(out), str(src)],
        check=True,
        capture_output=True,
    )
    (whl,) = out.glob("kvpilot-*.whl")
    return whl


def test_wheel_contains_exactly_the_packages(wheel: Path) -> None:
    names = zipfile.ZipFile(wheel).namelist()
    top = {n.split("/", 1)[0] for n in names if not n.split("/", 1)[0].endswith(".dist-info")}
    assert top == PACKAGES
    assert "data/default_workload.toml" in names, "the default synth config must ship with the package"
    assert not any("/tests/" in n or n.startswith("tests/") for n in names)


def test_wheel_ships_every_package_of_the_tree(wheel: Path) -> None:
    """A package inside the six (policy/baselines, policy/learned, ...) left out of the wheel breaks an install that
    is not editable, as the rollout server's is."""
    names = set(zipfile.ZipFile(wheel).namelist())
    tree = sorted(str(init.relative_to(ROOT)) for top in PACKAGES for init in (ROOT / top).rglob("__init__.py"))
    assert "policy/baselines/__init__.py" in tree and "policy/learned/__init__.py" in tree
    assert [p for p in tree if p not in names] == []


def test_wheel_declares_console_script_and_pins(wheel: Path) -> None:
    zf = zipfile.ZipFile(wheel)
    dist_info = next(n.split("/")[0] for n in zf.namelist() if n.endswith(".dist-info/METADATA"))
    entry_points = zf.read(f"{dist_info}/entry_points.txt").decode()
    assert "kvpilot = training.cli:main" in entry_points
    metadata = zf.read(f"{dist_info}/METADATA").decode()
    assert "Requires-Dist: vllm==0.33.0" in metadata
    for dep in ("torch", "lightgbm", "scikit-learn", "pandas", "pyarrow", "mlflow", "typer", "rich", "matplotlib"):
        assert f"Requires-Dist: {dep}" in metadata, dep
