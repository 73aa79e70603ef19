"""The package's rooms and the direction of their imports: each room imports only from rooms below
it (or from itself), and no module imports itself back through others. Read from the source with
``ast`` (every import, those inside functions and type-checking blocks included), so a new arrow
that points up fails here, in CI, before anyone has to read the code to find it."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "snapkv_rag"
LAYERS = [
    {"config"},
    {"methods", "models"},
    {"kv", "request"},
    {"runtime"},
    {"documents"},
    {"engine"},
    {"frameworks", "server"},
    {"cli"},
    {"__init__"},
]
"""Rooms from the bottom up (``__init__``: the package's lazily loaded public names). A room may
import from its own layer's rooms only if it is the same room."""
RANK = {room: i for i, rooms in enumerate(LAYERS) for room in rooms}


def module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _nodes(tree: ast.AST, typing_too: bool):
    """Every node of ``tree``; without ``typing_too``, not those under ``if TYPE_CHECKING:``."""
    for node in ast.iter_child_nodes(tree):
        if not typing_too and isinstance(node, ast.If) and getattr(node.test, "id", None) == "TYPE_CHECKING":
            continue
        yield node
        yield from _nodes(node, typing_too)


def imports(path: Path, typing_too: bool = True) -> set[str]:
    """The ``snapkv_rag`` modules (or packages) that ``path`` imports (``typing_too``: with those
    imported for type annotations only)."""
    name, package = module_name(path), path.name == "__init__.py"
    found = set()
    for node in _nodes(ast.parse(path.read_text()), typing_too):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = name.split(".") if package else name.split(".")[:-1]
                target = ".".join(base[: len(base) - node.level + 1] + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            for alias in node.names:
                sub = f"{target}.{alias.name}"
                exists = (PACKAGE.parent / Path(*sub.split("."))).with_suffix(".py").exists() or (
                    PACKAGE.parent / Path(*sub.split("."))
                ).is_dir()
                found.add(sub if exists else target)
        elif isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
    return {m for m in found if m == "snapkv_rag" or m.startswith("snapkv_rag.")}


def room(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


GRAPH = {module_name(p): imports(p) for p in PACKAGE.rglob("*.py")}
RUNTIME = {module_name(p): imports(p, typing_too=False) for p in PACKAGE.rglob("*.py")}


def test_every_room_has_a_layer():
    assert {room(m) for m in GRAPH} <= set(RANK), sorted({room(m) for m in GRAPH} - set(RANK))


def test_imports_point_down():
    upward = sorted(
        f"{a} -> {b}"
        for a, targets in GRAPH.items()
        for b in targets
        if room(a) != room(b) and RANK[room(b)] >= RANK[room(a)]
    )
    assert upward == [], "imports that do not point down:\n" + "\n".join(upward)


def test_no_import_cycle():
    """Between modules, at run time (imports for type annotations only are not run; a package's
    ``__init__`` that re-exports its own modules is not a cycle)."""
    graph = {
        a: {b for b in targets if b in RUNTIME and not a.startswith(b + ".") and b != a}
        for a, targets in RUNTIME.items()
    }
    state: dict[str, int] = {}
    cycles = []

    def visit(node: str, path: list[str]) -> None:
        state[node] = 1
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                cycles.append(" -> ".join(path[path.index(nxt) :] + [nxt]) if nxt in path else f"{node} -> {nxt}")
            elif nxt not in state:
                visit(nxt, path + [nxt])
        state[node] = 2

    for module in sorted(graph):
        if module not in state:
            visit(module, [module])
    assert cycles == [], "import cycles:\n" + "\n".join(cycles)
