"""Every reference to the plugin's code in its docstrings and docs resolves to something that exists.

Checked: dotted names ``fairseq_deepinit.x.y`` anywhere in a docstring, README.md or docs/*.md; Sphinx
roles in docstrings (:mod:, :func:, :class:, :meth:, :data:, :attr:, :exc:), with their ``~`` form and
their relative ``.x`` form (relative to the docstring's package, as in this code base), and
role targets outside the plugin (``fairseq.``, ``torch.``) by import; file paths
``fairseq_deepinit/...`` (and ``modules/x.py`` etc. inside the package) in the docs and docstrings.
"""

from __future__ import annotations

import ast
import importlib
import re
from pathlib import Path

import pytest

import fairseq_deepinit  # noqa: F401  (registers everything, as a resolution would need)
from conftest import REPO

ROOT = REPO / "fairseq_deepinit"
DOCS = [REPO / "README.md", *sorted((REPO / "docs").rglob("*.md"))]
DOTTED = re.compile(r"(?<![\w./-])fairseq_deepinit(?:\.[A-Za-z_]\w*)+")
ROLE = re.compile(r":(mod|func|class|meth|data|attr|exc):`([^`]+)`")
PATH = re.compile(r"(?<![\w./-])fairseq_deepinit/[\w/]*\w(?:\.py)?")
# a path inside the package written from the package (``modules/stacks.py``)
SUBPATH = re.compile(r"(?<![\w./-])(?:modules|methods|admin|matt|diagnostics|checkpoints|training|lm)/\w+\.py")


def resolve(name: str) -> bool:
    """Whether ``a.b.c`` is a module or an attribute chain of one."""
    parts = name.split(".")
    for i in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:i]))
        except ImportError:
            continue
        for attr in parts[i:]:
            if not hasattr(obj, attr):
                return False
            obj = getattr(obj, attr)
        return True
    return False


def module_name(path: Path) -> str:
    parts = list(path.relative_to(REPO).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def docstrings(path: Path):
    """``(owner class name or None, docstring)`` of the module, its classes and functions."""
    tree = ast.parse(path.read_text())
    out = [(None, ast.get_docstring(tree))]
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef):
            out.append((node.name, ast.get_docstring(node)))
            for sub in node.body:
                if isinstance(sub, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    out.append((node.name, ast.get_docstring(sub)))
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            out.append((None, ast.get_docstring(node)))
    return [(owner, doc) for owner, doc in out if doc]


def role_candidates(target: str, module: str, is_package: bool, owner: str | None) -> list:
    target = target.lstrip("~").rstrip("()")
    if target.startswith("."):
        package = module if is_package else module.rsplit(".", 1)[0]
        return [package + target, module + target]
    if "." in target.split(".", 1)[0] or target.startswith(("fairseq", "torch")):
        return [target]
    names = [f"{module}.{target}"]
    if owner:
        names.insert(0, f"{module}.{owner}.{target}")
    return names + [f"{module}.{o}.{target}" for o in _classes(module)] + [target]


def _classes(module: str) -> list:
    obj = importlib.import_module(module)
    return [k for k, v in vars(obj).items() if isinstance(v, type)]


def docstring_refs():
    for path in sorted(ROOT.rglob("*.py")):
        module = module_name(path)
        for owner, doc in docstrings(path):
            for name in DOTTED.findall(doc):
                yield f"{path.relative_to(REPO)}: {name}", [name.rstrip(".")]
            for _role, target in ROLE.findall(doc):
                yield (
                    f"{path.relative_to(REPO)}: :{_role}:`{target}`",
                    role_candidates(target, module, path.name == "__init__.py", owner),
                )


def doc_refs():
    for path in DOCS:
        text = path.read_text()
        for name in DOTTED.findall(text):
            yield f"{path.relative_to(REPO)}: {name}", [name.rstrip(".")]


REFS = list(docstring_refs()) + list(doc_refs())


@pytest.mark.parametrize("where, candidates", REFS, ids=[w for w, _ in REFS])
def test_reference_resolves(where, candidates):
    assert any(resolve(c) for c in candidates), f"{where} resolves to nothing (tried {candidates})"


def test_paths_in_docs_and_docstrings_exist():
    missing = []
    for path in DOCS + sorted(ROOT.rglob("*.py")):
        text = path.read_text()
        refs = [REPO / r for r in PATH.findall(text)] + [ROOT / r for r in SUBPATH.findall(text)]
        missing += [f"{path.relative_to(REPO)}: {r.relative_to(REPO)}" for r in refs if not r.exists()]
    assert not missing, missing


def test_the_check_catches_a_wrong_reference():
    assert resolve("fairseq_deepinit.modules.layers.DeepInitEncoderLayer")
    assert not resolve("fairseq_deepinit.residual.Residual")  # a module that no longer exists
    assert not resolve("fairseq_deepinit.modules.layers.NoSuchLayer")
