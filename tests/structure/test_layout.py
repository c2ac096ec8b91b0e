"""The house's rules, read from the code's own imports: the common ground imports nothing of ours, the
rooms import only downwards, nothing imports the front door, there are no import cycles, and no source
file is over 400 lines."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("swarm_common", "rewards", "broadcast", "model_builders", "trainer", "inference_nodes", "swarm")
# Who may import whom (besides itself). The front door may import every room; nothing imports it.
ALLOWED = {
    "swarm_common": set(),
    "rewards": {"swarm_common"},
    "broadcast": {"swarm_common"},
    "model_builders": {"swarm_common"},
    "trainer": {"swarm_common", "rewards", "broadcast", "model_builders"},
    "inference_nodes": {"swarm_common", "rewards", "broadcast", "model_builders"},
    "swarm": {"swarm_common", "rewards", "broadcast", "model_builders", "trainer", "inference_nodes"},
}
MAX_LINES = 400


def _modules() -> dict[str, Path]:
    out = {}
    for pkg in PACKAGES:
        for path in (ROOT / pkg).rglob("*.py"):
            rel = path.relative_to(ROOT).with_suffix("")
            parts = rel.parts[:-1] if rel.name == "__init__" else rel.parts
            out[".".join(parts)] = path
    return out


def _imports(name: str, path: Path, known: set[str]) -> set[str]:
    """The modules of ours that `name` imports (anywhere in the file: a lazy import counts too)."""
    found = set()
    pkg_parts = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
    for node in _runtime_nodes(ast.parse(path.read_text(), str(path))):
        targets = []
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(pkg_parts[: len(pkg_parts) - node.level + 1] + ([base] if base else []))
            # `from pkg import mod` imports pkg.mod; `from pkg.mod import name` imports pkg.mod.
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in known else base for a in node.names]
        for t in targets:
            while t and t not in known:
                t = t.rpartition(".")[0]
            if t and t != name:
                found.add(t)
    return found


def _runtime_nodes(tree: ast.AST):
    """Every node, except what sits under `if TYPE_CHECKING:` (imports for type hints only run no code)."""
    stack = [tree]
    while stack:
        node = stack.pop()
        yield node
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and getattr(child.test, "id", None) == "TYPE_CHECKING":
                stack.extend(child.orelse)
                continue
            stack.append(child)


def _graph() -> dict[str, set[str]]:
    mods = _modules()
    return {name: _imports(name, path, set(mods)) for name, path in mods.items()}


def test_imports_only_run_downwards():
    bad = []
    for mod, deps in _graph().items():
        room = mod.split(".")[0]
        for dep in deps:
            other = dep.split(".")[0]
            if other != room and other not in ALLOWED[room]:
                bad.append(f"{mod} imports {dep}")
    assert not bad, "imports against the house's direction:\n" + "\n".join(sorted(bad))


def test_no_import_cycles():
    graph = _graph()
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    cycles = []

    def visit(mod: str, path: list[str]) -> None:
        state[mod] = 1
        for dep in sorted(graph.get(mod, ())):
            if state.get(dep) == 1:
                cycles.append(" -> ".join(path[path.index(dep):] + [dep]))
            elif dep not in state:
                visit(dep, path + [dep])
        state[mod] = 2

    for mod in sorted(graph):
        if mod not in state:
            visit(mod, [mod])
    assert not cycles, "import cycles:\n" + "\n".join(cycles)


@pytest.mark.parametrize("folder", [*PACKAGES, "bench"])
def test_no_source_file_over_the_limit(folder):
    long = [f"{p.relative_to(ROOT)}: {n}" for p in (ROOT / folder).rglob("*.py")
            if (n := len(p.read_text().splitlines())) > MAX_LINES]
    assert not long, f"files over {MAX_LINES} lines: {long}"


def test_the_checker_sees_a_wrong_import(tmp_path, monkeypatch):
    """The rules above can fail: a common-ground module that imports the trainer is reported."""
    mods = _modules()
    bad = tmp_path / "bad.py"
    bad.write_text("from trainer.config import RunConfig\nfrom . import keys\n")
    deps = _imports("swarm_common.bad", bad, set(mods) | {"swarm_common.bad"})
    assert deps == {"trainer.config", "swarm_common.keys"}
