"""The package has no upward import: cli → online → data → {core, persist} → errors.

Every ``import`` of an ``rmm_jax`` module, at any depth of any module, is read with
``ast`` and checked against the layer order in docs/index.md's "Layout of the code".
"""
import ast
import re
from pathlib import Path

import pytest

PKG = Path(__file__).resolve().parents[1] / "rmm_jax"
# layer -> the layers it may import (itself included); version/errors are the floor.
ALLOWED = {
    "cli": {"cli", "online", "data", "core", "persist"},
    "online": {"online", "data", "core", "persist"},
    "data": {"data", "core", "persist"},
    "core": {"core"},
    "persist": {"persist", "core.types", "core.scope", "core.reranker", "core.checks"},   # checks: input contracts
}
FLOOR = {"errors", "version", "deprecated"}


def layer_of(module: str) -> str:
    parts = module.split(".")[1:]  # drop "rmm_jax"
    return parts[0] if parts else ""


def imports_of(path: Path):
    tree = ast.parse(path.read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            yield from (a.name for a in node.names if a.name.startswith("rmm_jax"))
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("rmm_jax"):
            if node.module == "rmm_jax":  # from rmm_jax import x: the curated top level (above cli)
                yield "rmm_jax"
            else:
                yield node.module


def test_imports_follow_the_layers():
    checked, bad = 0, []
    for path in sorted(PKG.rglob("*.py")):
        rel = path.relative_to(PKG.parent).with_suffix("")
        layer = rel.parts[1] if len(rel.parts) > 2 else None
        if layer not in ALLOWED:  # rmm_jax/__init__.py, errors.py, version.py
            continue
        for target in imports_of(path):
            checked += 1
            t = target.split(".")[1:]
            if not t:
                bad.append(f"{rel}: imports the top-level package")
            elif t[0] in FLOOR or t[0] in ALLOWED[layer] or ".".join(t[:2]) in ALLOWED[layer]:
                continue
            else:
                bad.append(f"{rel} ({layer}) imports {target}")
    assert checked > 50  # the walk really saw the package's imports
    assert not bad, "\n".join(bad)


def test_the_top_level_names_its_exports_once_and_loads_them_lazily():
    """``rmm_jax/__init__.py`` imports its names on first use (PEP 562): the table it loads
    them from, the ``TYPE_CHECKING`` imports that readers and the API docs see, and
    ``__all__`` name the same things, each name is its module's object, and importing the
    package loads no JAX (a child process: this one has JAX already)."""
    import importlib
    import subprocess
    import sys

    import rmm_jax

    tree = ast.parse((PKG / "__init__.py").read_text())
    guarded = next(n for n in tree.body if isinstance(n, ast.If) and getattr(n.test, "id", "") == "TYPE_CHECKING")
    typed = {a.name: node.module for node in guarded.body for a in node.names}
    assert typed == rmm_jax._WHERE and len(typed) > 40
    assert set(rmm_jax.__all__) == {*typed, "__version__"}
    for name, module in typed.items():
        assert getattr(rmm_jax, name) is getattr(importlib.import_module(module), name), name
    out = subprocess.run([sys.executable, "-c", "import sys, rmm_jax; print(sorted(m for m in sys.modules"
                          " if m.split('.')[0] in ('jax', 'chex', 'optax')))"], capture_output=True, text=True)
    assert out.returncode == 0 and out.stdout.strip() == "[]", out.stdout + out.stderr


def test_a_name_of_another_room_asked_of_the_top_level_says_where_it_is():
    """``rmm_jax.Reranker`` was "module 'rmm_jax' has no attribute 'Reranker'", with no word of
    rmm_jax.online.serve: each pointer names the module that holds the name, and none is a top-level name."""
    import importlib

    import rmm_jax

    assert rmm_jax._ELSEWHERE and not set(rmm_jax._ELSEWHERE) & set(rmm_jax.__all__)
    for name, module in rmm_jax._ELSEWHERE.items():
        assert hasattr(importlib.import_module(module), name), (name, module)
        with pytest.raises(AttributeError, match=rf"no attribute '{name}' \(it is {re.escape(module)}\.{name}\)$"):
            getattr(rmm_jax, name)


# packages of one private module per concern, curated in their __init__ (optax style)
CURATED = sorted(str(d.relative_to(PKG.parent)).replace("/", ".") for d in PKG.glob("*/*")
                 if d.is_dir() and any(d.glob("_[a-z]*.py")))


def test_the_curated_packages_are_found():
    assert {"rmm_jax.online.ope", "rmm_jax.online.streams", "rmm_jax.data.store",
            "rmm_jax.data.citation_log"} <= set(CURATED), CURATED


@pytest.mark.parametrize("name", CURATED)
def test_a_package_of_private_modules_exports_each_public_name_once(name):
    """A package of one private module per concern, curated in its ``__init__``: every
    public name a private module defines (not one it imports) is in ``__all__``, is the
    package's attribute, and is defined in exactly one of them; a name of ``__all__``
    defined nowhere in the package (re-exported from a sibling) still resolves."""
    import importlib

    pkg = importlib.import_module(name)
    defined: dict[str, str] = {}
    for path in sorted((PKG.parent / name.replace(".", "/")).glob("_[a-z]*.py")):
        tree = ast.parse(path.read_text())
        names = [n.name for n in tree.body if isinstance(n, (ast.FunctionDef, ast.ClassDef))]
        names += [t.id for n in tree.body if isinstance(n, (ast.Assign, ast.AnnAssign))
                  for t in ast.walk(n.targets[0] if isinstance(n, ast.Assign) else n.target)
                  if isinstance(t, ast.Name)]
        module = importlib.import_module(f"{name}.{path.stem}")
        for public in names:
            if public.startswith("_"):
                continue
            assert public not in defined, f"{public} in {defined[public]} and {path.stem}"
            defined[public] = path.stem
            assert getattr(pkg, public) is getattr(module, public), public
    assert defined
    assert set(defined) <= set(pkg.__all__), sorted(set(defined) - set(pkg.__all__))
    assert all(hasattr(pkg, n) for n in pkg.__all__), [n for n in pkg.__all__ if not hasattr(pkg, n)]
    assert len(pkg.__all__) == len(set(pkg.__all__))
