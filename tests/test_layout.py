"""The package's layout rules (docs/architecture.md), checked on the source.

- no import cycle between the plugin's modules, function-level imports included, and counting the
  package ``__init__`` an import runs on the way (importing ``a.b`` from outside ``a`` runs ``a``);
- the layer map (:data:`LAYER_MAP`): which parts of the package each subpackage may import; ``modules/``
  imports nothing above it (only torch, fairseq, ``errors`` and itself); ``methods/`` imports only
  ``modules/``, ``matt/`` (MAtt's layer), ``training/`` (the training hooks) and ``errors``; an import across
  the periphery's rules (:data:`NOT_IMPORTED`) is one of the recorded exceptions (:data:`EXCEPTIONS`);
- no module over 400 lines;
- fairseq's normalize-before flags named at the fairseq boundary only (the spec's placement everywhere else);
  a method's feature looked up by name only by its record and its hooks' modules; nothing assigned into
  fairseq's or torch's objects (their modules and classes, the trainer, the optimizer) outside ``patches.py``;
- every method module holds one record that :data:`fairseq_deepinit.methods.METHODS` lists, and
  docs/schemes.md's method table is the one generated from the records;
- the tools (``deepinit_tools/``): no import cycle, no module over 400 lines, the plugin never imports
  them; ``scripts/*.py`` and ``benchmarks/*.py`` are entry points only (a docstring, imports of the
  tools, the ``__main__`` call); no ``sys.path`` bootstrap in the tools, scripts, benchmarks or tests;
  one builder of fairseq command lines (``deepinit_tools/fairseq_argv.py``).
"""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import REPO

PACKAGE = "fairseq_deepinit"
TOOLS = "deepinit_tools"  # the scripts' and benchmarks' code, above the plugin
ROOT = REPO / PACKAGE
MAX_LINES = 400


def module_name(path: Path) -> str:
    parts = list(path.relative_to(REPO).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def modules(package: str = PACKAGE) -> dict:
    return {module_name(p): p for p in sorted((REPO / package).rglob("*.py"))}


def _resolve(current: str, is_package: bool, node: ast.ImportFrom) -> str:
    if node.level == 0:
        return node.module or ""
    base = current.split(".") if is_package else current.split(".")[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def imports_of(name: str, path: Path, known: set, package: str = PACKAGE) -> set:
    """The modules of ``package`` that ``name`` imports anywhere in its body (functions included)."""
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
            if target == package or target.startswith(package + "."):
                while target not in known:  # an attribute of a module: the module
                    target = target.rsplit(".", 1)[0]
                out.add(target)
    return out


def graph(package: str = PACKAGE) -> dict:
    """module -> modules it imports, plus the packages whose ``__init__`` such an import runs first
    (those that do not contain the importing module)."""
    mods = modules(package)
    known = set(mods)
    edges = {}
    for name, path in mods.items():
        targets = set()
        for target in imports_of(name, path, known, package):
            parts = target.split(".")
            for i in range(2, len(parts) + 1):
                runs = ".".join(parts[:i])  # a package whose __init__ the import runs, or the module itself
                if not (name == runs or name.startswith(runs + ".")):
                    targets.add(runs)
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


@pytest.mark.parametrize("package", [PACKAGE, TOOLS])
def test_no_import_cycle(package):
    cycle = find_cycle(graph(package))
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_cycle_finder_finds_a_cycle():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


# subpackage -> the parts of the package (subpackages and top-level modules) its modules may import; an
# import that this map does not hold is a new upward edge, to be moved down or argued for here
LAYER_MAP = {
    "modules": ("errors",),
    "matt": ("modules", "errors"),
    "methods": ("modules", "matt", "training", "errors"),
    "training": ("modules", "methods", "diagnostics", "errors"),
    "checkpoints": ("options", "model_config", "errors"),
    "diagnostics": ("modules", "training", "checkpoints", "options", "admin", "patches", "errors"),
    "export": ("modules", "methods", "spec", "axes", "resolve", "options", "model_config", "model", "architectures",
               "family_args", "checkpoints", "lm", "errors"),
    "admin": ("modules", "methods", "training", "diagnostics", "export", "errors"),
    "lm": ("modules", "methods", "training", "diagnostics", "admin", "export", "checkpoints", "plan", "decoder",
           "resolve", "options", "model_config", "architectures", "errors"),
    "compare": ("methods", "family_args", "errors"),
}  # fmt: skip
# the periphery's rules: a subpackage never imports these ...
NOT_IMPORTED = {
    "export": ("admin", "lm", "diagnostics"),
    "diagnostics": ("patches", "training", "lm", "export"),
    "training": ("diagnostics", "admin", "lm", "export", "patches"),
    "checkpoints": ("diagnostics", "admin", "lm", "export", "training", "patches"),
}
# ... but for these, each with its reason
EXCEPTIONS = {
    ("export", "lm"): "the exporters read deepinit_lm checkpoints, so they build the language model and its families",
    ("diagnostics", "patches"): "the diagnostics criterion installs its task mixin and optimizer wrapper at fairseq's "
    "boundary",
    ("diagnostics", "training"): "the diagnostics criterion adds the records' loss terms (LossTermsMixin)",
    ("training", "diagnostics"): "QK-Clip's tap takes the batch's real positions and the per-head logit maximum the "
    "depth diagnostics compute",
}


def _edges_between() -> dict:
    """(subpackage, part it imports) -> the module imports that make the edge."""
    out: dict = {}
    for src, targets in graph().items():
        layer = src.split(".")[1] if src.count(".") >= 2 else None
        for dst in targets:
            part = dst.split(".")[1] if dst != PACKAGE else None
            if layer in LAYER_MAP and part is not None and part != layer:
                out.setdefault((layer, part), []).append(f"{src} -> {dst}")
    return out


@pytest.mark.parametrize("layer", sorted(LAYER_MAP))
def test_each_subpackage_imports_only_what_the_layer_map_allows(layer):
    bad = [e for (src, part), edges in _edges_between().items() if src == layer and part not in LAYER_MAP[layer]
           for e in edges]  # fmt: skip
    assert not bad, f"{layer}/ may import only {', '.join(LAYER_MAP[layer])}: " + "; ".join(bad)


def test_the_periphery_crosses_its_rules_only_where_recorded():
    crossing = {(src, part) for src, part in _edges_between() if part in NOT_IMPORTED.get(src, ())}
    assert crossing == set(EXCEPTIONS), f"new: {crossing - set(EXCEPTIONS)}; gone: {set(EXCEPTIONS) - crossing}"
    assert all(part in LAYER_MAP[src] for src, part in EXCEPTIONS)


def test_no_module_over_400_lines():
    long = {name: n for name, path in modules().items() if (n := len(path.read_text().splitlines())) > MAX_LINES}
    assert not long, f"split by responsibility (at most {MAX_LINES} lines): {long}"


def test_every_method_module_is_one_listed_record():
    import importlib

    from fairseq_deepinit.methods import METHODS
    from fairseq_deepinit.methods.record import Method

    # pointwise: DyT's and Derf's shared options; exporting: the records' export declarations; no record
    helpers = ("__init__", "record", "pointwise", "exporting")
    files = sorted(p.stem for p in (ROOT / "methods").glob("*.py") if p.stem not in helpers)
    listed = []
    for stem in files:
        module = importlib.import_module(f"{PACKAGE}.methods.{stem}")
        assert isinstance(getattr(module, "METHOD", None), Method), f"methods/{stem}.py holds no METHOD record"
        listed.append(module.METHOD.name)
    assert sorted(listed) == sorted(METHODS), "every record is in METHODS, and METHODS holds only those"


def test_docs_method_table_is_generated_from_the_records():
    from deepinit_tools import methods_table as table

    text = (REPO / "docs" / "schemes.md").read_text()
    assert table.current(text) == table.render(), (
        "docs/schemes.md's method table differs from the records: run python -m deepinit_tools.methods_table --write"
    )


# --- one path for every method: the placement axis, the training hooks, fairseq patched in one place ------

# where fairseq's --encoder-/--decoder-normalize-before may be named: read once into the spec's placement
# (resolve), written back at the fairseq boundary (resolve.store), its parser default (options), the resume
# check's list of fairseq's model options (config_check), fairseq's forced Pre-LN undone (lm/architectures)
NORMALIZE_BEFORE_BOUNDARY = {"resolve.py", "options.py", "checkpoints/config_check.py", "lm/architectures.py"}


def test_fairseq_normalize_before_is_named_at_the_boundary_only():
    named = {p.relative_to(ROOT).as_posix() for p in ROOT.rglob("*.py") if "normalize_before" in p.read_text()}
    assert named <= NORMALIZE_BEFORE_BOUNDARY, (
        f"fairseq's normalize-before flags named in {sorted(named - NORMALIZE_BEFORE_BOUNDARY)}: read the spec's "
        "Stack.placement (families set norm_placement)"
    )


def _feature_lookups(tree: ast.AST) -> list:
    """``(line, name)`` of every ``<x>.features.get("<name>")`` / ``<x>.features["<name>"]`` (or bare ``features``)."""

    def is_features(node) -> bool:
        return (isinstance(node, ast.Attribute) and node.attr == "features") or (
            isinstance(node, ast.Name) and node.id == "features"
        )

    out = []
    for node in ast.walk(tree):
        key = None
        if isinstance(node, ast.Subscript) and is_features(node.value):
            key = node.slice
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "get":
            key = node.args[0] if is_features(node.func.value) and node.args else None
        if isinstance(key, ast.Constant) and isinstance(key.value, str):
            out.append((node.lineno, key.value))
    return out


def test_a_feature_is_looked_up_by_name_only_by_its_own_record_and_hooks():
    import dataclasses
    import inspect

    from fairseq_deepinit.methods import METHODS

    own = {}
    for m in METHODS.values():
        hooks = [getattr(m, f.name) for f in dataclasses.fields(m) if inspect.isfunction(getattr(m, f.name))]
        own[m.name] = {Path(inspect.getsourcefile(h)).resolve() for h in hooks}
    bad = [
        f"{path.relative_to(REPO)}:{line} looks up {name!r}"
        for path in ROOT.rglob("*.py")
        if path.parent != ROOT / "methods"
        for line, name in _feature_lookups(ast.parse(path.read_text()))
        if path.resolve() not in own.get(name, set())
    ]
    assert not bad, "a training-time method decides from the spec and its record's hooks: " + "; ".join(bad)


FOREIGN = ("fairseq", "torch", "numpy")
FOREIGN_INSTANCES = ("trainer", "optimizer")  # fairseq's Trainer and the optimizers it builds, by their names


def foreign_assignments(tree: ast.AST) -> list:
    """``(line, target)`` of every assignment (``=``, ``setattr``) into an attribute of a name imported from
    fairseq / torch / numpy, or of ``trainer`` / ``optimizer``."""
    imported = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            imported |= {(a.asname or a.name).split(".")[0] for a in node.names if a.name.split(".")[0] in FOREIGN}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").split(".")[0] in FOREIGN:
            imported |= {a.asname or a.name for a in node.names}

    def foreign(target) -> bool:
        while isinstance(target, (ast.Attribute, ast.Subscript)):
            target = target.value
        return isinstance(target, ast.Name) and (target.id in imported or target.id in FOREIGN_INSTANCES)

    out = []
    for node in ast.walk(tree):
        targets = node.targets if isinstance(node, ast.Assign) else []
        targets = [node.target] if isinstance(node, (ast.AugAssign, ast.AnnAssign)) else targets
        for target in (e for t in targets for e in (t.elts if isinstance(t, ast.Tuple) else [t])):
            if isinstance(target, ast.Attribute) and foreign(target):
                out.append((node.lineno, ast.unparse(target)))
        if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "setattr" and foreign(node.args[0]):
            out.append((node.lineno, f"setattr({ast.unparse(node.args[0])}, ...)"))
    return out


def test_fairseq_and_torch_are_assigned_into_by_patches_only():
    bad = [
        f"{path.relative_to(REPO)}:{line} assigns {target}"
        for path in sorted(ROOT.rglob("*.py"))
        if path != ROOT / "patches.py"
        for line, target in foreign_assignments(ast.parse(path.read_text()))
    ]
    assert not bad, "a change to fairseq or torch is a row of patches.PATCHES, with its reason: " + "; ".join(bad)


def test_the_assignment_finder_finds_them():
    code = "import torch\nfrom fairseq.trainer import Trainer\ntorch.x = 1\nTrainer.y = 2\ntrainer.z, a = 3, 4\n"
    code += "setattr(optimizer, 'step', f)\nself.w = 5\nmodel.v = 6\n"
    assert [t for _line, t in foreign_assignments(ast.parse(code))] == [
        "torch.x", "Trainer.y", "trainer.z", "setattr(optimizer, ...)"
    ]  # fmt: skip


def test_training_time_methods_declare_typed_hooks_on_their_records():
    from fairseq_deepinit.methods import METHODS
    from fairseq_deepinit.methods.record import Method

    hooks = {"check_training": "CheckTraining", "param_groups": "ParamGroups", "after_step": "AfterStep",
             "loss_term": "LossTerm"}  # fmt: skip
    assert {name: Method.__dataclass_fields__[name].type for name in hooks} == {
        name: f"{protocol} | None" for name, protocol in hooks.items()
    }
    training = {m.name for m in METHODS.values() if any(getattr(m, name) for name in hooks)}
    assert training == {"depth_mup", "z_loss", "qk_clip"}


# --- the tools: deepinit_tools/, and scripts/ and benchmarks/ as its command lines -----------------

ENTRY_POINTS = sorted([*(REPO / "scripts").glob("*.py"), *(REPO / "benchmarks").glob("*.py")])
# writes the 0.1.0 fixtures with the 0.1.0 release's plugin, from a worktree of that commit: putting that
# copy first on the path is what it is for (its docstring)
SYS_PATH_EXEMPT = {REPO / "tests" / "fixtures" / "make_v010.py"}


def _imported(tree: ast.AST) -> list:
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0:
            out.append(node.module or "")
    return out


def test_the_plugin_never_imports_the_tools():
    bad = [
        f"{name} imports {target}"
        for name, path in modules().items()
        for target in _imported(ast.parse(path.read_text()))
        if target == TOOLS or target.startswith(TOOLS + ".")
    ]
    assert not bad, "the plugin must not depend on its tools: " + "; ".join(bad)


def test_no_tools_module_over_400_lines():
    paths = [*modules(TOOLS).values(), *ENTRY_POINTS]
    long = {str(p.relative_to(REPO)): n for p in paths if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert not long, f"split by responsibility (at most {MAX_LINES} lines): {long}"


BOOTSTRAP = "sys.path.insert(0, str(Path(__file__).resolve().parents[1]))"
"""The one statement an entry point adds to the imports: the checkout first on the path, so that
``python benchmarks/<x>.py`` runs from any folder without ``PYTHONPATH`` and imports this checkout's tools and
plugin (never an installed copy of the plugin)."""


@pytest.mark.parametrize("script", ENTRY_POINTS, ids=lambda p: str(p.relative_to(REPO)))
def test_scripts_and_benchmarks_are_entry_points_of_the_tools(script):
    """A docstring, imports (``sys``, ``pathlib.Path`` and the tools), :data:`BOOTSTRAP` before the tools,
    ``if __name__ == "__main__": main()``: the code is in ``deepinit_tools`` (importable by tests and by the
    other tools)."""
    tree = ast.parse(script.read_text())
    body = tree.body[1:] if ast.get_docstring(tree) else tree.body
    booted = False
    for node in body:
        if isinstance(node, ast.Import):
            assert [a.name for a in node.names] == ["sys"], f"{script.name}: imports {[a.name for a in node.names]}"
        elif isinstance(node, ast.ImportFrom) and node.module == "pathlib":
            assert [a.name for a in node.names] == ["Path"], f"{script.name}: imports {ast.unparse(node)}"
        elif isinstance(node, ast.ImportFrom):
            assert (node.module or "").startswith(TOOLS + "."), f"{script.name}: imports from {node.module}"
            assert booted, f"{script.name}: {node.module} imported before the checkout is on the path"
        elif isinstance(node, ast.Expr) and ast.unparse(node) == BOOTSTRAP:
            booted = True
        else:
            assert isinstance(node, ast.If) and ast.unparse(node.test) == "__name__ == '__main__'", (
                f"{script.name}:{node.lineno}: only imports, the checkout on the path and the __main__ call belong in "
                "an entry point"
            )
    assert booted, f"{script.name}: no {BOOTSTRAP}"


@pytest.mark.slow
@pytest.mark.parametrize("where", ["root", "elsewhere"])
def test_an_entry_point_runs_without_pythonpath(where, tmp_path):
    """``python benchmarks/gpu_session.py --plan`` from the checkout's root (and from another folder) in an
    environment without ``PYTHONPATH``: the tools and the checkout's plugin import."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    cwd = REPO if where == "root" else tmp_path
    script = "benchmarks/gpu_session.py" if where == "root" else str(REPO / "benchmarks" / "gpu_session.py")
    out = subprocess.run(
        [sys.executable, script, "--plan"], cwd=cwd, env=env, capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert "smoke" in out.stdout


def _sys_path_changes(tree: ast.AST) -> list:
    """Lines that change ``sys.path`` (a method call on it, or an assignment to it)."""

    def is_sys_path(node) -> bool:
        return ast.unparse(node) == "sys.path"

    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and is_sys_path(node.func.value):
            if node.func.attr in ("insert", "append", "extend", "pop", "remove", "clear"):
                out.append(node.lineno)
        elif isinstance(node, (ast.Assign, ast.AugAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            if any(is_sys_path(t.value if isinstance(t, ast.Subscript) else t) for t in targets):
                out.append(node.lineno)
    return sorted(out)


def test_no_sys_path_bootstraps():
    """Tools and tests import packages; only the root conftest.py (once, for the tests and the processes they
    start) and the entry points (:data:`BOOTSTRAP`, checked above) put the checkout on the path."""
    files = [*modules(TOOLS).values(), *sorted((REPO / "tests").rglob("*.py"))]
    bad = {
        str(p.relative_to(REPO)): lines
        for p in files
        if p not in SYS_PATH_EXEMPT and (lines := _sys_path_changes(ast.parse(p.read_text())))
    }
    assert not bad, f"sys.path changed (import the package instead): {bad}"
    assert _sys_path_changes(ast.parse("import sys\nsys.path.insert(0, 'x')\nsys.path[:0] = ['y']")) == [2, 3]


def test_one_builder_of_fairseq_command_lines():
    """``python -m fairseq_cli.<tool>`` and the plugin's bf16 flag are spelled in fairseq_argv.py only."""
    own = REPO / TOOLS / "fairseq_argv.py"
    bad = []
    for path in modules(TOOLS).values():
        if path == own:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.List):
                items = [ast.unparse(e) for e in node.elts]
                if "'-m'" in items and any(i.startswith(("'fairseq_cli.", "f'fairseq_cli.")) for i in items):
                    bad.append(f"{path.relative_to(REPO)}:{node.lineno}")
            elif isinstance(node, ast.Constant) and node.value == "--autocast-bf16":
                bad.append(f"{path.relative_to(REPO)}:{node.lineno} (--autocast-bf16)")
    assert not bad, "build fairseq commands with deepinit_tools.fairseq_argv: " + ", ".join(bad)


def test_pip_install_brings_the_plugin_only(monkeypatch):
    """``pip install .`` installs ``fairseq_deepinit`` and its console scripts, never the research tools (they
    run from the checkout, ``PYTHONPATH=$PWD``)."""
    pytest.importorskip("setuptools")  # setup.py's own requirement; it also provides distutils on Python 3.12
    import distutils.core

    monkeypatch.chdir(REPO)
    dist = distutils.core.run_setup(str(REPO / "setup.py"), stop_after="init")
    tops = {p.split(".")[0] for p in dist.packages}
    assert PACKAGE in tops and tops <= {PACKAGE, "hydra_plugins"}, tops  # hydra_plugins: fairseq-hydra-train's errors
    targets = [line.split("=", 1)[1].strip() for line in dist.entry_points["console_scripts"]]
    assert targets and all(t.startswith(PACKAGE + ".") for t in targets), targets


def test_the_test_tiers_name_existing_modules():
    """conftest's module lists (the slow tier, the second kernel pass) name test modules that exist."""
    from conftest import NUMERIC_MODULES, SLOW_MODULES

    have = {p.stem for p in (REPO / "tests").glob("test_*.py")}
    assert (SLOW_MODULES | NUMERIC_MODULES) <= have, sorted((SLOW_MODULES | NUMERIC_MODULES) - have)


def test_the_exporters_name_no_option():
    """``export/`` decides from the spec and the records' export declarations (docs/architecture.md): no option
    of the model (an axis's or a record's) appears in it as a string literal, so a method is taught to every
    exporter on its record, never in an exporter's own table."""
    from fairseq_deepinit.axes import all_options

    names = {option.name for option, _method in all_options()}
    found = []
    for path in sorted((ROOT / "export").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.Constant) and node.value in names:
                found.append(f"{path.relative_to(REPO)}:{node.lineno} {node.value!r}")
    assert not found, "option names in export/ (declare it on the record instead): " + "; ".join(found)
