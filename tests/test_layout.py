"""The package's shape: imports go one way (cli -> decoding/training/bench -> modeling/checkpoints -> kernels) with no
circle, the kernels import only JAX, functions stay short enough to read at once, and the public API is documented."""

from __future__ import annotations

import ast
import inspect
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("specformer_jax", "pallas_kernels")
# Layers, lowest first: a module may import its own layer and the ones below it.
LAYERS = [
    ("pallas_kernels",),
    ("specformer_jax.errors", "specformer_jax.checks", "specformer_jax.files", "specformer_jax.config",
     "specformer_jax.defaults", "specformer_jax.assets", "specformer_jax.parallel", "specformer_jax.distributed"),
    ("specformer_jax.modeling", "specformer_jax.checkpoints"),
    ("specformer_jax.decoding",),
    ("specformer_jax.training", "specformer_jax.bench", "specformer_jax.serving"),
    ("specformer_jax.cli",),
]
APART = [("specformer_jax.modeling", "specformer_jax.checkpoints"),  # checkpoints load into modeling, not back
         ("specformer_jax.training", "specformer_jax.bench"), ("specformer_jax.bench", "specformer_jax.training"),
         ("specformer_jax.serving", "specformer_jax.training"), ("specformer_jax.serving", "specformer_jax.bench")]
# Layers inside a package, lowest first, the same rule: the package's own modules (its API) sit above them all.
SUBLAYERS = {
    "specformer_jax.decoding": ["acceptance", "engine", "drafts", "tuning"],
    "specformer_jax.training": ["data"],
}
MAX_FOLDER_MODULES = 12  # modules in one folder, its __init__ not counted
LONG_FUNCTIONS: set[tuple[str, str]] = set()  # (module, function) allowed past MAX_FUNCTION_LINES
MAX_FUNCTION_LINES = 70


def modules() -> dict[str, Path]:
    out = {}
    for pkg in PACKAGES:
        for f in (ROOT / pkg).rglob("*.py"):
            parts = list(f.relative_to(ROOT).with_suffix("").parts)
            out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = f
    return out


def imported(name: str, path: Path, known: dict) -> set[str]:
    """Our modules that `name` imports anywhere (inside functions too). `from package import submodule` counts as
    the submodule; a submodule's own package is not counted (Python imports it first anyway)."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                package = name.split(".")[: len(name.split(".")) - node.level + (path.name == "__init__.py")]
                base = ".".join(package + [base] * bool(base))
            subs = {f"{base}.{a.name}" for a in node.names if f"{base}.{a.name}" in known}
            out |= subs or {base}
    return {m for m in out if m in known and m != name and not name.startswith(m + ".")}


@pytest.fixture(scope="module")
def graph():
    known = modules()
    return {name: imported(name, path, known) for name, path in known.items()}


def layer(module: str) -> int:
    for i, names in enumerate(LAYERS):
        if any(module == n or module.startswith(n + ".") for n in names):
            return i
    return len(LAYERS)  # the package's own __init__: the public API, above everything


def within(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


def test_imports_go_one_way(graph):
    wrong = [f"{m} imports {i}" for m, deps in graph.items() for i in deps
             if layer(i) > layer(m) or any(within(m, a) and within(i, b) for a, b in APART)]
    assert not wrong


def sublayer(module: str, package: str) -> int:
    subs = SUBLAYERS[package]
    rest = module[len(package) + 1:].split(".")[0]
    return subs.index(rest) if rest in subs else len(subs)


def test_imports_go_one_way_inside_decoding_and_training(graph):
    wrong = [f"{m} imports {i}" for pkg in SUBLAYERS for m, deps in graph.items() for i in deps
             if within(m, pkg) and within(i, pkg) and m != pkg and sublayer(i, pkg) > sublayer(m, pkg)]
    assert not wrong


def test_no_folder_holds_too_many_modules():
    full = {}
    for pkg in PACKAGES:
        for folder in [ROOT / pkg, *(p for p in (ROOT / pkg).rglob("*") if p.is_dir() and p.name != "__pycache__")]:
            count = len([f for f in folder.glob("*.py") if f.name != "__init__.py"])
            if count > MAX_FOLDER_MODULES:
                full[str(folder.relative_to(ROOT))] = count
    assert not full


def test_no_import_circle(graph):
    state: dict[str, int] = {}
    circles = []

    def visit(node, stack):
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                circles.append(" -> ".join(stack[stack.index(nxt):] + [nxt]))
            elif nxt not in state:
                visit(nxt, stack)
        stack.pop()
        state[node] = 2

    for node in sorted(graph):
        if node not in state:
            visit(node, [])
    assert not circles


def test_decoding_does_not_import_the_loaders(graph):
    """The engine sees loaded models (modeling/loaded.py) and the cache directory (files.py), never the file formats;
    only names.py, which loads the drafter a string names (`generate(drafter="default")`), calls a loader."""
    importers = {m for m, deps in graph.items() for i in deps
                 if within(m, "specformer_jax.decoding") and within(i, "specformer_jax.checkpoints")}
    assert importers == {"specformer_jax.decoding.names"}


def test_the_draft_vocabulary_key_is_file_format_only():
    """A drafter's draft vocabulary is a typed field (DrafterParams.vocab); its key string belongs to the files."""
    where = {name for name, path in modules().items() for node in ast.walk(ast.parse(path.read_text()))
             if isinstance(node, ast.Constant) and node.value == "draft_vocab"}
    assert where == {"specformer_jax.checkpoints.drafter_io"}


def test_the_kernels_import_only_jax():
    allowed = set(sys.stdlib_module_names) | {"jax", "pallas_kernels", "__future__"}
    for path in (ROOT / "pallas_kernels").glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module] if isinstance(node, ast.ImportFrom) and not node.level else [])
            assert all(n.split(".")[0] in allowed for n in names), (path.name, names)


def test_functions_are_short_enough_to_read_at_once():
    long = []
    for name, path in modules().items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and (name, node.name) not in LONG_FUNCTIONS:
                if node.end_lineno - node.lineno + 1 > MAX_FUNCTION_LINES:
                    long.append(f"{name}.{node.name}: {node.end_lineno - node.lineno + 1} lines")
    assert not long


def test_the_public_api_is_documented():
    import specformer_jax

    assert specformer_jax.__all__ == sorted(specformer_jax.__all__)
    for name in specformer_jax.__all__:
        doc = inspect.getdoc(getattr(specformer_jax, name)) or ""
        assert doc and not doc.startswith(f"{name}("), f"specformer_jax.{name} has no docstring of its own"
