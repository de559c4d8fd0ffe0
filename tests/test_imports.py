"""The package's shape, checked from outside: what ``import zoo`` loads and registers, and what evaluating a run
loads (in fresh interpreters, so nothing this test session imported hides a heavy import), that figures never switch
matplotlib's backend, and the layering of docs/design.md read from the source with ``ast``: arrows run downward
only, no import cycle, a few small modules at the top, Lightning used and not rewritten (no subclass of its classes
but the public LightningModule, no private attribute of it or torchmetrics read), and every subpackage says what it
holds."""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
ZOO = REPO / "zoo"
HEAVY = ("lightning", "pytorch_lightning", "torchmetrics", "matplotlib")


def run_python(code: str, **env_changes: str | None) -> dict:
    """Run ``code`` in a fresh interpreter on this checkout's zoo; it prints one JSON object, returned here."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    for key, value in env_changes.items():
        if value is None:
            env.pop(key, None)
        else:
            env[key] = value
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


IMPORT_ZOO = f"""
import json, sys
heavy = lambda: [m for m in {HEAVY!r} if m in sys.modules]
import zoo
from zoo import CBAM, MultiHeadAttention
after_import = heavy()
import timm
registered, expected = timm.list_models("zoo_*"), ["zoo_" + n for n in zoo.list_models()]
explain_loaded_early = "zoo.explain" in sys.modules
listed = "record_attention" in dir(zoo)
record_attention = zoo.record_attention
from zoo.explain import attention_rollout, record_attention as direct
try:
    zoo.no_such_name
    missing = "no error"
except AttributeError as err:
    missing = str(err)
print(json.dumps(dict(after_import=after_import, registered=registered, expected=expected,
                      explain_loaded_early=explain_loaded_early, listed=listed,
                      lazy_is_direct=record_attention is direct and zoo.attention_rollout is attention_rollout,
                      after_explain=heavy(), missing=missing)))
"""


@pytest.fixture(scope="module")
def fresh_import() -> dict:
    return run_python(IMPORT_ZOO)


def test_import_zoo_loads_no_training_or_plotting_library(fresh_import):
    assert fresh_import["after_import"] == []


def test_import_zoo_registers_every_model_in_timm(fresh_import):
    assert fresh_import["registered"] == fresh_import["expected"] and len(fresh_import["expected"]) >= 6


def test_explaining_names_load_on_first_use(fresh_import):
    assert not fresh_import["explain_loaded_early"] and fresh_import["listed"]
    assert fresh_import["lazy_is_direct"]
    assert fresh_import["after_explain"] == []  # recording and rollout need neither Lightning nor matplotlib
    assert fresh_import["missing"] == "module 'zoo' has no attribute 'no_such_name'"


FIGURES_BACKEND = """
import importlib, json
import matplotlib
before = matplotlib.get_backend()
import zoo.explain.figures as figures
after = matplotlib.get_backend()
matplotlib.use("svg")  # a user's choice, made before the module runs again
importlib.reload(figures)
print(json.dumps(dict(before=before, after=after, chosen=matplotlib.get_backend())))
"""


def test_figures_never_choose_a_matplotlib_backend():
    seen = run_python(FIGURES_BACKEND, MPLBACKEND=None)
    assert seen["after"] == seen["before"]
    assert seen["chosen"] == "svg"


def test_matplotlib_only_in_figures_and_never_pyplot():
    """(get_backend() itself loads pyplot to resolve the default backend, so this is read from the source.)"""
    users = {module_name(p): sorted(m for m in imported_modules(p) if m.split(".")[0] == "matplotlib")
             for p in MODULES}
    assert {name for name, found in users.items() if found} == {"zoo.explain.figures"}
    assert not any(m.startswith("matplotlib.pyplot") for m in users["zoo.explain.figures"])


# ------------------------------------------------------------------------------------------------- layering

def module_name(path: Path) -> str:
    parts = path.relative_to(REPO).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def runtime_nodes(tree: ast.AST):
    """Every node of ``tree`` but those under ``if TYPE_CHECKING:`` (imports for annotations only: no dependency
    at run time)."""
    stack = [tree]
    while stack:
        node = stack.pop()
        yield node
        if isinstance(node, ast.If) and dotted(node.test).endswith("TYPE_CHECKING"):
            stack.extend(node.orelse)
            continue
        stack.extend(ast.iter_child_nodes(node))


def imported_modules(path: Path) -> set[str]:
    """Every module ``path`` imports (at the top or inside functions), relative imports resolved."""
    name = module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in runtime_nodes(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            if node.level == 0:
                found.add(node.module)
                continue
            base = ".".join(package.split(".")[:len(package.split(".")) - node.level + 1])
            if node.module:
                found.add(f"{base}.{node.module}")
            else:  # from . import a, b: each name may be a module
                found |= {f"{base}.{alias.name}" for alias in node.names}
    return found


def part(module: str) -> str:
    """The layer a zoo module belongs to: its subpackage or top-level module ("zoo" for the package itself)."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "zoo"


# what each part may import from zoo, itself included; the front ends train.py / eval.py: never
ALLOWED = {
    "zoo": {"layers", "models", "interop", "masks"},  # the package's __init__ (explain is loaded lazily by name)
    "interop": {"models"},
    "masks": {"layers"},
    "atomic": set(),
    "runtime": {"runtime", "atomic"},
    "data": {"data", "atomic"},
    "layers": {"layers"},
    "models": {"models", "layers"},
    "train": {"train", "data", "runtime", "models", "layers", "atomic"},
    "bench": {"bench", "data", "runtime", "models", "layers", "atomic"},
    "explain": {"explain", "bench", "data", "runtime", "models", "layers", "atomic"},  # eval's report times models
}
MODULES = sorted(ZOO.rglob("*.py"))


def test_every_module_belongs_to_a_known_part():
    assert {part(module_name(p)) for p in MODULES} <= set(ALLOWED)


@pytest.mark.parametrize("path", MODULES, ids=lambda p: str(p.relative_to(REPO)))
def test_imports_run_downward_only(path):
    name = module_name(path)
    imports = imported_modules(path)
    front_ends = sorted(m for m in imports if m.split(".")[0] in ("train", "eval"))
    assert front_ends == [], f"{name} imports the front end(s) {front_ends}"
    upward = sorted(m for m in imports if m.split(".")[0] == "zoo" and part(m) not in ALLOWED[part(name)])
    assert upward == [], f"{name} ({part(name)}) may import only {sorted(ALLOWED[part(name)])}, imports {upward}"


def test_the_layering_check_sees_relative_and_function_level_imports():
    """The checker itself: relative imports at any depth and imports inside functions are resolved."""
    path = ZOO / "bench" / "suite.py"
    found = imported_modules(path)
    assert {"zoo.bench.timing", "zoo.layers.attention", "zoo.models", "zoo.data"} <= found
    assert "zoo.interop" in imported_modules(ZOO / "__init__.py")


def test_few_modules_at_the_top():
    top = sorted(p.name for p in ZOO.glob("*.py") if p.name != "__init__.py")
    assert len(top) <= 3, top


def test_no_import_cycle():
    """The graph of zoo's module imports (top-level and inside functions alike) has no cycle: a deferred import is
    never needed to break one. A package's ``__init__`` re-exporting its own modules is not an edge back."""
    graph = {module_name(p): {m for m in imported_modules(p) if m.startswith("zoo")} for p in MODULES}
    names, packages = set(graph), {module_name(p) for p in MODULES if p.name == "__init__.py"}

    def target(imported: str) -> str | None:  # "zoo.train.loop.fit" -> "zoo.train.loop"
        while imported and imported not in names:
            imported = imported.rpartition(".")[0]
        return imported or None

    # a package's __init__ importing its own modules, and a module importing from its own package, are not edges
    edges = {name: {t for m in imports if (t := target(m)) and t != name and not name.startswith(t + ".")
                    and not (name in packages and t.startswith(name + "."))}
             for name, imports in graph.items()}
    done, path = set(), []

    def visit(node: str) -> None:
        if node in path:
            raise AssertionError("import cycle: " + " -> ".join(path[path.index(node):] + [node]))
        if node in done:
            return
        path.append(node)
        for nxt in sorted(edges[node]):
            visit(nxt)
        path.pop()
        done.add(node)

    for node in sorted(edges):
        visit(node)


def lightning_names(tree: ast.AST) -> set[str]:
    """The local names a module binds to Lightning's or torchmetrics' objects (``import lightning.pytorch as pl``,
    ``from lightning.fabric import Fabric``)."""
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] in ("lightning", "torchmetrics"):
            found |= {alias.asname or alias.name for alias in node.names}
        elif isinstance(node, ast.Import):
            found |= {alias.asname or alias.name.split(".")[0] for alias in node.names
                      if alias.name.split(".")[0] in ("lightning", "torchmetrics")}
    return found


def dotted(node: ast.AST) -> str:
    return f"{dotted(node.value)}.{node.attr}" if isinstance(node, ast.Attribute) else getattr(node, "id", "")


@pytest.mark.parametrize("path", MODULES, ids=lambda p: str(p.relative_to(REPO)))
def test_lightning_is_used_not_rewritten(path):
    """No class of the zoo subclasses one of Lightning's but the public LightningModule ``ImageClassifier``; no
    private name of Lightning or torchmetrics is imported; and a module that uses them reads no private attribute
    (``x._name``) of anything but its own objects (``self``)."""
    tree = ast.parse(path.read_text())
    names = lightning_names(tree)
    subclasses = [node.name for node in ast.walk(tree) if isinstance(node, ast.ClassDef)
                  for base in node.bases if dotted(base).split(".")[0] in names]
    assert subclasses in ([], ["ImageClassifier"]), subclasses
    private_imports = [alias.name for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)
                       and (node.module or "").split(".")[0] in ("lightning", "torchmetrics")
                       for alias in node.names if alias.name.startswith("_")]
    private_imports += [node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)
                        and (node.module or "").split(".")[0] in ("lightning", "torchmetrics")
                        and any(part.startswith("_") for part in node.module.split("."))]
    assert private_imports == []
    if names:
        private = sorted({dotted(node) for node in ast.walk(tree) if isinstance(node, ast.Attribute)
                          and node.attr.startswith("_") and not node.attr.startswith("__")
                          and dotted(node.value) != "self"})
        assert private == [], private


def test_loading_a_run_for_evaluation_loads_no_training_module(tiny_run, tmp_path):
    """``zoo.load_run`` and eval.py --checkpoint (its metrics and figures) leave no module of training (the loop,
    its optimizers, the compiled step, the LightningModule) in ``sys.modules``."""
    code = f"""
import json, sys
import zoo
model, meta = zoo.load_run({str(tiny_run)!r})
after_load = sorted(m for m in sys.modules if m.startswith("zoo.train"))
from zoo.explain.cli import main
code = main(["--checkpoint", {str(tiny_run)!r}, "--out", {str(tmp_path / "eval")!r}, "--device", "cpu",
             "--max-test-images", "16"])
after_eval = sorted(m for m in sys.modules if m.startswith("zoo.train"))
print(json.dumps(dict(code=code, after_load=after_load, after_eval=after_eval)))
"""
    seen = run_python(code)
    assert seen["code"] == 0 and seen["after_load"] == [] and seen["after_eval"] == []


@pytest.mark.parametrize("init", sorted(ZOO.rglob("__init__.py")), ids=lambda p: str(p.relative_to(REPO)))
def test_every_package_says_what_it_holds(init):
    docstring = ast.get_docstring(ast.parse(init.read_text()))
    assert docstring and len(docstring.split()) >= 8, f"{init.relative_to(REPO)} needs a docstring"
