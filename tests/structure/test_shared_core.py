"""The relay tree's decisions live once, in broadcast/'s sans-I/O core, and the simulator (bench/simlib)
drives that very code: the core imports no sockets, no asyncio and no clock of its own; the simulator
imports the core's decisions, defines none of its constants again, and swaps no module for another (its
clock is handed to the tracker)."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
# Decision code: fed events and a clock, returns what to do.
CORE = ("config", "sourcing", "piece_race", "tracker", "standing", "bans", "verdicts", "uplink_plan", "turns", "piece_pass",
        "buckets", "layout", "placement", "upload_meter", "receive_meter", "messages")
IO = {"asyncio", "aiohttp", "socket", "time", "threading", "selectors", "subprocess"}
# What the simulator must take from the core rather than model itself.
DECISIONS = {"broadcast.sourcing", "broadcast.piece_race", "broadcast.tracker", "broadcast.verdicts",
             "broadcast.turns", "broadcast.uplink_plan", "broadcast.config"}


def _tree(path: Path) -> ast.Module:
    return ast.parse(path.read_text(), str(path))


def _imported(tree: ast.Module) -> set[str]:
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            out.add(node.module)
    return out


def _constants(tree: ast.Module) -> set[str]:
    """Module-level UPPER_CASE names a file defines."""
    names = set()
    for node in tree.body:
        targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(node, ast.AnnAssign) else []
        names |= {t.id for t in targets if isinstance(t, ast.Name) and t.id.isupper() and len(t.id) > 1}
    return names


def _patches(tree: ast.Module) -> list[str]:
    """Assignments to an attribute of an imported module (`mod.time = fake`): a swapped module."""
    modules = {a.asname or a.name.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    modules |= {a.asname or a.name for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) for a in n.names
                if n.module and (n.module == "broadcast" or n.module.startswith("broadcast."))}
    found = []
    for node in ast.walk(tree):
        targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(node, ast.AugAssign | ast.AnnAssign) else []
        for t in targets:
            if isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name) and t.value.id in modules:
                found.append(f"{t.value.id}.{t.attr}")
    return found


def duplicated_rules(sim_files: dict[str, ast.Module]) -> list[str]:
    core_consts = set().union(*(_constants(_tree(p)) for p in (ROOT / "broadcast").glob("*.py")))
    bad = []
    for name, tree in sim_files.items():
        bad += [f"{name} defines {c} again (broadcast/ has it)" for c in sorted(_constants(tree) & core_consts)]
        bad += [f"{name} swaps {p}" for p in _patches(tree)]
    return bad


def _sim_files() -> dict[str, ast.Module]:
    return {str(p.relative_to(ROOT)): _tree(p) for p in (ROOT / "bench" / "simlib").glob("*.py")}


def test_the_core_does_no_io_and_reads_no_clock():
    bad = {m: sorted(_imported(_tree(ROOT / "broadcast" / f"{m}.py")) & IO) for m in CORE}
    assert not {m: i for m, i in bad.items() if i}, bad


def test_the_simulator_imports_the_cores_decisions_and_defines_none_again():
    files = _sim_files()
    used = set().union(*(_imported(t) for t in files.values()))
    assert DECISIONS <= used, f"the simulator does not use {sorted(DECISIONS - used)}"
    assert not duplicated_rules(files), duplicated_rules(files)


def test_the_check_sees_a_copied_constant_and_a_swapped_module():
    fake = ast.parse("import broadcast.tracker as tr\nAVOID_S = 30.0\nMAX_FAILURES_PER_PIECE = 20\n"
                     "tr.time = object()\n")
    assert duplicated_rules({"fake.py": fake}) == ["fake.py defines AVOID_S again (broadcast/ has it)",
                                                   "fake.py defines MAX_FAILURES_PER_PIECE again (broadcast/ has it)",
                                                   "fake.py swaps tr.time"]
