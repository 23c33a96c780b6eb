"""The layers import only downward: data < predictors < policy < serving_hook < simulator < training.

Read from the source with ``ast`` (nothing is imported): every ``import`` statement, at module level or inside a
function, and every string literal that names one of our modules (``"pkg.module"`` or ``"pkg.module:attr"``, as
lazy factories and ``importlib`` take them). vLLM is imported only by the serving hook and the simulator's engine.
Inside a layer, modules import each other without a cycle (function-local and type-only imports count), and a
module whose name starts with ``_`` is imported only from its own package.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
LAYERS = ("data", "predictors", "policy", "serving_hook", "simulator", "training")
RANK = {name: i for i, name in enumerate(LAYERS)}
#: Where vLLM may be imported: the one adapter, and the simulator's engine module.
VLLM_ALLOWED = ("serving_hook/", "simulator/engine.py")
#: The one computed import: the catalog's lazy factories, whose ``"module:attr"`` targets are string literals
#: (checked by the string rule where they are written).
COMPUTED_ALLOWED = ("policy/catalog.py",)
#: ``vllm:name`` alone is a Prometheus metric of vLLM's (``vllm:num_preemptions``), not a module: vLLM's modules
#: are named dotted.
_MODULE_STRING = re.compile(rf"^(({'|'.join(LAYERS)})((\.[A-Za-z_]\w*)+(:[A-Za-z_]\w*)?|:[A-Za-z_]\w*)"
                            r"|vllm(\.[A-Za-z_]\w*)+(:[A-Za-z_]\w*)?)$")


def _docstrings(tree: ast.AST) -> set[int]:
    """ids of the string constants that are docstrings (they may name any module)."""
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
                out.add(id(first.value))
    return out


def references(source: str, filename: str) -> list[tuple[int, str]]:
    """(line, top-level package) of every module this source imports or names in a string; ``"?"`` for an
    import whose module is computed at run time (it cannot be checked, so it is not allowed)."""
    tree = ast.parse(source, filename)
    docs = _docstrings(tree)
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(node.lineno, alias.name.split(".")[0]) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative: the package of the file itself, or above it
                out.append((node.lineno, "."))
            elif node.module:
                out.append((node.lineno, node.module.split(".")[0]))
        elif (isinstance(node, ast.Call) and getattr(node.func, "attr", getattr(node.func, "id", None))
              in ("import_module", "__import__") and not (node.args and isinstance(node.args[0], ast.Constant))):
            out.append((node.lineno, "?"))
        elif (isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docs
              and _MODULE_STRING.match(node.value)):
            out.append((node.lineno, re.split(r"[.:]", node.value)[0]))
    return out


def violations(root: Path = ROOT) -> list[str]:
    """Every reference against the layer order, or to vLLM outside the adapter, as ``file:line: message``."""
    bad = []
    for layer in LAYERS:
        for path in sorted((root / layer).rglob("*.py")):
            rel = path.relative_to(root).as_posix()
            for line, pkg in references(path.read_text(), rel):
                if pkg == "?" and rel in COMPUTED_ALLOWED:
                    continue
                if pkg in (".", "?"):
                    bad.append(f"{rel}:{line}: a {'relative' if pkg == '.' else 'computed'} import (name the module)")
                elif pkg in RANK and RANK[pkg] > RANK[layer]:
                    bad.append(f"{rel}:{line}: {layer} reaches up to {pkg}")
                elif pkg == "vllm" and not rel.startswith(VLLM_ALLOWED):
                    bad.append(f"{rel}:{line}: imports vllm outside {', '.join(VLLM_ALLOWED)}")
    return bad


def _modules(root: Path) -> dict[str, Path]:
    """Our modules by dotted name (a package by its own name) -> file."""
    out = {}
    for layer in LAYERS:
        for path in (root / layer).rglob("*.py"):
            parts = path.relative_to(root).with_suffix("").parts
            out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


def _imported(node: ast.AST, modules: dict[str, Path]) -> list[str]:
    """The modules of ours an import statement loads (``from pkg import name``: ``pkg.name`` where that is a
    module, else ``pkg``); an unknown dotted name counts as its nearest known parent."""
    if isinstance(node, ast.Import):
        names = [a.name for a in node.names]
    elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
        names = [f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in modules else node.module
                 for a in node.names]
    else:
        return []
    out = []
    for name in names:
        while name not in modules and "." in name:
            name = name.rsplit(".", 1)[0]
        if name in modules:
            out.append(name)
    return out


def import_graph(root: Path = ROOT) -> tuple[dict[str, set[str]], list[str]]:
    """(module -> the modules of ours it imports, the imports of another package's ``_private`` modules as
    ``file:line: message``)."""
    modules = _modules(root)
    graph: dict[str, set[str]] = {m: set() for m in modules}
    private = []
    for mod, path in sorted(modules.items()):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            for target in _imported(node, modules):
                if target == mod:
                    continue
                graph[mod].add(target)
                package, _, last = target.rpartition(".")
                if last.startswith("_") and not last.startswith("__") and not (mod + ".").startswith(package + "."):
                    rel = path.relative_to(root).as_posix()
                    private.append(f"{rel}:{node.lineno}: imports {target}, private to {package}")
    return graph, private


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The import cycles of ``graph``: its strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_no_import_runs_against_the_layer_order() -> None:
    assert violations() == []


def test_no_import_cycle_and_no_other_package_s_private_module() -> None:
    graph, private = import_graph()
    assert cycles(graph) == []
    assert private == []


def test_the_check_finds_a_cycle_and_a_private_import(tmp_path: Path) -> None:
    for name in LAYERS:
        (tmp_path / name).mkdir()
    (tmp_path / "policy" / "baselines").mkdir()
    (tmp_path / "policy" / "a.py").write_text("from policy.b import B\n")
    (tmp_path / "policy" / "b.py").write_text("def f():\n    from policy.c import C\n")  # function-local
    (tmp_path / "policy" / "c.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
                                              "    from policy.a import A\n")  # type-only
    (tmp_path / "policy" / "baselines" / "_helpers.py").write_text("X = 1\n")
    (tmp_path / "policy" / "baselines" / "mine.py").write_text("from policy.baselines._helpers import X\n")
    (tmp_path / "policy" / "learned").mkdir()
    (tmp_path / "policy" / "learned" / "policy.py").write_text("from policy.baselines._helpers import X\n")
    graph, private = import_graph(tmp_path)
    assert cycles(graph) == [["policy.a", "policy.b", "policy.c"]]
    assert private == ["policy/learned/policy.py:1: imports policy.baselines._helpers, private to policy.baselines"]


@pytest.mark.parametrize(
    "layer, source, found",
    [
        ("predictors", "from policy.interface import Event\n", "predictors reaches up to policy"),
        ("policy", "def f():\n    import serving_hook.config\n", "policy reaches up to serving_hook"),
        ("policy", 'TARGET = "serving_hook.model_source:RegistryPolicy"\n', "policy reaches up to serving_hook"),
        ("serving_hook", "from training.registry import ModelRef\n", "serving_hook reaches up to training"),
        ("simulator", "from vllm.v1.request import Request\n", "imports vllm outside"),
        ("policy", "import vllm\n", "imports vllm outside"),
        ("training", 'LOADER = "vllm.v1.core.sched.scheduler:Scheduler"\nMETRIC = "vllm:num_preemptions"\n',
         "imports vllm outside"),  # a module path counts; a Prometheus metric name does not
        ("data", 'TARGET = "training:main"\n', "data reaches up to training"),
        ("predictors", "from .interface import Event\n", "a relative import"),
        ("policy", "import importlib\nm = importlib.import_module(name)\n", "a computed import"),
    ],
)
def test_the_check_finds_an_upward_reference(tmp_path: Path, layer: str, source: str, found: str) -> None:
    for name in LAYERS:
        (tmp_path / name).mkdir()
    (tmp_path / layer / "bad.py").write_text('"""A docstring may name training.cli freely."""\n' + source)
    (tmp_path / "data" / "ok.py").write_text("import json\nfrom data.records import Event\n")
    got = violations(tmp_path)
    assert len(got) == 1 and found in got[0] and got[0].startswith(f"{layer}/bad.py:"), got


#: An issue tracker's number in the library's code or comments (``issue #7``, ``(#30)``, ``Issue 4's``): the why
#: belongs in the code's own words, and measured results in docs/results/.
_ISSUE_REFERENCE = re.compile(r"\b[Ii]ssues? #?\d+|\(#\d+\)")


def issue_references(root: Path = ROOT) -> list[str]:
    """``file:line`` of every issue number in the layers' source (another project's, named with it, is a citation)."""
    out = []
    for layer in LAYERS:
        for path in sorted((root / layer).rglob("*.py")):
            for i, line in enumerate(path.read_text().splitlines(), 1):
                m = _ISSUE_REFERENCE.search(line)
                if m and "/" not in line[max(0, m.start() - 20):m.start()]:  # "NeMo/RL issue 3663" cites
                    out.append(f"{path.relative_to(root).as_posix()}:{i}")
    return out


def test_no_issue_numbers_in_the_library(tmp_path: Path) -> None:
    assert issue_references() == []
    for name in LAYERS:
        (tmp_path / name).mkdir()
    (tmp_path / "policy" / "a.py").write_text("X = 1  # as issue #7 measured\nY = 2  # (NeMo/RL issue 3663)\n")
    assert issue_references(tmp_path) == ["policy/a.py:1"]


#: The command functions whose bodies ``kvpilot``'s settings pass through, and the most lines each may have (its
#: options are module-level ``Annotated`` aliases; the settings cross into the library as typed records).
COMMAND_LINES = {"simulate": 60, "evaluate_cmd": 60}
MAX_PARAMETERS = 10


def long_signatures(root: Path = ROOT) -> list[str]:
    """Functions in ``training/`` with more than :data:`MAX_PARAMETERS` parameters (a typer command's are its
    options, and are not counted), and the commands of :data:`COMMAND_LINES` longer than their bound."""
    out = []
    for path in sorted((root / "training").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if not isinstance(node, ast.FunctionDef):
                continue
            where = f"{path.relative_to(root).as_posix()}:{node.lineno} {node.name}"
            command = any(isinstance(d, ast.Call) and isinstance(d.func, ast.Attribute)
                          and d.func.attr in ("command", "callback") for d in node.decorator_list)
            a = node.args
            bound = bool(a.args) and a.args[0].arg in ("self", "cls")
            n = len(a.posonlyargs) + len(a.args) + len(a.kwonlyargs) - int(bound)
            if n > MAX_PARAMETERS and not command:
                out.append(f"{where}: {n} parameters")
            if node.name in COMMAND_LINES and node.end_lineno - node.lineno + 1 > COMMAND_LINES[node.name]:
                out.append(f"{where}: {node.end_lineno - node.lineno + 1} lines")
    return out


def test_settings_cross_as_records_not_long_argument_lists(tmp_path: Path) -> None:
    assert long_signatures() == []
    (tmp_path / "training").mkdir()
    args = ", ".join(f"a{i}" for i in range(11))
    (tmp_path / "training" / "a.py").write_text(
        f"def f({args}):\n    pass\n\n\n@app.command('x')\ndef g({args}):\n    pass\n\n\n"
        "def simulate():\n" + "    x = 1\n" * 60)
    assert long_signatures(tmp_path) == ["training/a.py:1 f: 11 parameters", "training/a.py:10 simulate: 61 lines"]
