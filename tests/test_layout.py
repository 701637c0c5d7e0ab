"""The package's layout rules (docs/architecture.md), checked on the source.

- no import cycle between the plugin's modules, function-level imports included, and counting the
  package ``__init__`` an import runs on the way (importing ``a.b`` from outside ``a`` runs ``a``);
- ``modules/`` imports nothing above it (only torch, fairseq, ``errors`` and itself); ``methods/``
  imports only ``modules/``, ``matt/`` (MAtt's layer) and ``errors``;
- no module over 400 lines;
- every method module holds one record that :data:`fairseq_deepinit.methods.METHODS` lists, and
  docs/schemes.md's method table is the one generated from the records.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from conftest import REPO

PACKAGE = "fairseq_deepinit"
ROOT = REPO / PACKAGE
MAX_LINES = 400


def module_name(path: Path) -> str:
    parts = list(path.relative_to(REPO).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def modules() -> dict:
    return {module_name(p): p for p in sorted(ROOT.rglob("*.py"))}


def _resolve(current: str, is_package: bool, node: ast.ImportFrom) -> str:
    if node.level == 0:
        return node.module or ""
    base = current.split(".") if is_package else current.split(".")[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def imports_of(name: str, path: Path, known: set) -> set:
    """The plugin modules ``name`` imports anywhere in its body (functions included)."""
    out = set()
    tree = ast.parse(path.read_text(), filename=str(path))
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            target = _resolve(name, path.name == "__init__.py", node)
            targets = [f"{target}.{a.name}" if f"{target}.{a.name}" in known else target for a in node.names]
        else:
            continue
        for target in targets:
            if target == PACKAGE or target.startswith(PACKAGE + "."):
                while target not in known:  # an attribute of a module: the module
                    target = target.rsplit(".", 1)[0]
                out.add(target)
    return out


def graph() -> dict:
    """module -> modules it imports, plus the packages whose ``__init__`` such an import runs first
    (those that do not contain the importing module)."""
    mods = modules()
    known = set(mods)
    edges = {}
    for name, path in mods.items():
        targets = set()
        for target in imports_of(name, path, known):
            parts = target.split(".")
            for i in range(2, len(parts) + 1):
                package = ".".join(parts[:i])
                if not (name == package or name.startswith(package + ".")):
                    targets.add(package)
        targets.discard(name)
        edges[name] = targets
    return edges


def find_cycle(edges: dict) -> list | None:
    state: dict = {}
    stack: list = []

    def visit(node):
        state[node] = "open"
        stack.append(node)
        for nxt in sorted(edges.get(node, ())):
            if state.get(nxt) == "open":
                return stack[stack.index(nxt) :] + [nxt]
            if nxt not in state:
                found = visit(nxt)
                if found:
                    return found
        state[node] = "done"
        stack.pop()
        return None

    for node in sorted(edges):
        if node not in state:
            found = visit(node)
            if found:
                return found
    return None


def test_no_import_cycle():
    cycle = find_cycle(graph())
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_cycle_finder_finds_a_cycle():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


@pytest.mark.parametrize(
    "layer, allowed",
    [
        ("modules", ("modules", "errors")),
        ("methods", ("methods", "modules", "matt", "errors")),
        ("matt", ("matt", "modules", "errors")),
    ],
)
def test_building_blocks_import_nothing_above_them(layer, allowed):
    edges = graph()
    prefix = f"{PACKAGE}.{layer}"
    bad = [
        f"{src} -> {dst}"
        for src, targets in edges.items()
        if src == prefix or src.startswith(prefix + ".")
        for dst in targets
        if not any(dst == f"{PACKAGE}.{a}" or dst.startswith(f"{PACKAGE}.{a}.") for a in allowed)
    ]
    assert not bad, f"{layer}/ may import only {', '.join(allowed)}: " + "; ".join(bad)


def test_no_module_over_400_lines():
    long = {name: n for name, path in modules().items() if (n := len(path.read_text().splitlines())) > MAX_LINES}
    assert not long, f"split by responsibility (at most {MAX_LINES} lines): {long}"


def test_every_method_module_is_one_listed_record():
    import importlib

    from fairseq_deepinit.methods import METHODS
    from fairseq_deepinit.methods.record import Method

    files = sorted(p.stem for p in (ROOT / "methods").glob("*.py") if p.stem not in ("__init__", "record", "table"))
    listed = []
    for stem in files:
        module = importlib.import_module(f"{PACKAGE}.methods.{stem}")
        assert isinstance(getattr(module, "METHOD", None), Method), f"methods/{stem}.py holds no METHOD record"
        listed.append(module.METHOD.name)
    assert sorted(listed) == sorted(METHODS), "every record is in METHODS, and METHODS holds only those"


def test_docs_method_table_is_generated_from_the_records():
    from fairseq_deepinit.methods import table

    text = (REPO / "docs" / "schemes.md").read_text()
    assert table.current(text) == table.render(), (
        "docs/schemes.md's method table differs from the records: run python -m fairseq_deepinit.methods.table --write"
    )
