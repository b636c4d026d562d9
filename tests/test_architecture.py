"""The package's plan holds: imports run one way between the stage folders, no module is part
of an import cycle, and only the generation folder (and the tiny-checkpoint builder) imports
MLX. Every import counts: at module level, inside functions, under TYPE_CHECKING."""

from __future__ import annotations

import ast
import re
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "batchgen"

# The folders each folder may import (besides itself): ARCHITECTURE.md's diagram, arrow for arrow.
ALLOWED = {
    "core": set(),
    "input": {"core"},
    "media": {"core"},
    "generate": {"core"},
    "output": {"core", "input"},
    "execution": {"core", "input", "media", "generate", "output"},
    "tools": {"core", "input", "media", "output"},
    "serve": {"core", "input", "generate", "output", "execution", "tools"},
    "cli": {"core", "input", "generate", "output", "execution", "tools", "serve"},
    # batchgen/*.py
    "": {"core", "input", "media", "generate", "output", "execution", "tools", "serve", "cli"},
}
MLX = ("mlx", "mlx_lm", "mlx_vlm")
# generate/'s rooms, top floor first ("": generate/*.py, the seam the executors call): a module
# imports its own room or those below it.
ROOMS = ("", "lanes", "decode", "load", "chat", "base")


def _modules() -> dict[str, Path]:
    return {
        ".".join(p.relative_to(PACKAGE.parent).with_suffix("").parts).removesuffix(".__init__"): p
        for p in PACKAGE.rglob("*.py")
    }


def _imports(name: str, path: Path) -> list[tuple[str, int]]:
    """(absolute module, line) of every import in the file, wherever it stands."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found += [(a.name, node.lineno) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                module = ".".join([*base, node.module] if node.module else base)
            else:
                module = node.module or ""
            found.append((module, node.lineno))
            found += [(f"{module}.{a.name}", node.lineno) for a in node.names]  # `from . import x`
    return found


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        graph[name] = {m for m, _ in _imports(name, path) if m in modules and m != name}
    return graph


def _folder(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 2 or (len(parts) == 2 and (PACKAGE / parts[1]).is_dir()) else ""


def test_imports_run_one_way_between_the_stage_folders():
    modules = _modules()
    wrong = []
    for name, path in modules.items():
        here = _folder(name)
        for target, line in _imports(name, path):
            if target not in modules or not target.startswith("batchgen."):
                continue
            there = _folder(target)
            if there not in (here, "") and there not in ALLOWED[here]:
                wrong.append(f"{path.relative_to(PACKAGE.parent)}:{line} imports {target} ({here} → {there})")
    assert not wrong, "\n".join(wrong)


def test_no_import_cycles():
    graph = _graph()
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles: list[list[str]] = []

    def visit(v: str) -> None:  # Tarjan's strongly connected components
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
                cycles.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    # A package's __init__ importing its own modules is how packages work, not a cycle.
    cycles = [c for c in cycles if not any(m == "batchgen" or m.endswith("__init__") for m in c)]
    assert not cycles, cycles


def test_only_generation_and_the_tiny_builder_import_mlx():
    importers = set()
    for name, path in _modules().items():
        if any(m.split(".")[0] in MLX for m, _ in _imports(name, path)):
            importers.add(name)
    outside = {m for m in importers if not m.startswith(("batchgen.generate.", "batchgen.tools.tiny."))}
    assert not outside, outside
    assert (
        "batchgen.generate.load.loading" in importers
    )  # the walk sees function-level imports (mlx_vlm.load)


def test_the_architecture_note_names_every_module():
    text = (PACKAGE / "ARCHITECTURE.md").read_text()
    missing = [
        str(p.relative_to(PACKAGE))
        for p in PACKAGE.rglob("*.py")
        if p.name not in ("__init__.py", "__main__.py") and not re.search(rf"[`/]{p.stem}`", text)
    ]
    assert not missing, missing


def test_every_module_opens_with_a_one_line_docstring():
    """A module says what it is in one line; its reasons, where it has them, below a blank line."""
    wrong = []
    for path in PACKAGE.rglob("*.py"):
        doc = ast.get_docstring(ast.parse(path.read_text()), clean=False)
        if path.name != "__init__.py" and (
            not doc or doc.startswith(" ") or doc.partition("\n")[2][:1] not in ("", "\n")
        ):
            wrong.append(str(path.relative_to(PACKAGE)))
    assert not wrong, wrong


def test_the_readme_families_table_and_the_tiny_builders_follow_the_families_record():
    from batchgen.core.families import FAMILIES
    from batchgen.tools.tiny.builder import KINDS
    from batchgen.tools.tiny.families import VISION_KINDS

    readme = (PACKAGE.parent / "README.md").read_text()
    table = [line for line in readme.splitlines() if line.startswith("| ") and "lane" not in line]
    lanes = {"mrope": "mRoPE positions", "offset": "cache-offset positions", "single": "one row at a time"}
    for f in FAMILIES.values():
        rows = [line for line in table if re.search(rf"\b{f.model_type}\b", line.split("|")[1])]
        assert rows and lanes[f.lane] in rows[0].split("|")[2], (f.model_type, rows)
        assert f.tiny is None or f.tiny in KINDS
    offset_tiny = {f.tiny for f in FAMILIES.values() if f.lane == "offset"}
    assert offset_tiny == set(VISION_KINDS)  # each offset family has its builder, and no other


def _room(module: str) -> str:
    parts = module.split(".")
    return parts[2] if len(parts) > 3 or (len(parts) == 3 and parts[2] in ROOMS) else ""


def test_generates_rooms_import_one_way_down():
    modules = _modules()
    assert {_room(m) for m in modules if m.startswith("batchgen.generate.")} == set(ROOMS)
    wrong = []
    for name, path in modules.items():
        if not name.startswith("batchgen.generate."):
            continue
        here = ROOMS.index(_room(name))
        for target, line in _imports(name, path):
            if (
                target in modules
                and target.startswith("batchgen.generate.")
                and ROOMS.index(_room(target)) < here
            ):
                wrong.append(f"{path.relative_to(PACKAGE.parent)}:{line} imports {target} (a room above)")
    assert not wrong, "\n".join(wrong)
