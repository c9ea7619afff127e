"""The package has no upward import: cli → online → data → {core, persist} → errors.

Every ``import`` of an ``rmm_jax`` module, at any depth of any module, is read with
``ast`` and checked against the layer order in the README's Layout section.
"""
import ast
from pathlib import Path

PKG = Path(__file__).resolve().parents[1] / "rmm_jax"
# layer -> the layers it may import (itself included); version/errors are the floor.
ALLOWED = {
    "cli": {"cli", "online", "data", "core", "persist"},
    "online": {"online", "data", "core", "persist"},
    "data": {"data", "core", "persist"},
    "core": {"core"},
    "persist": {"persist", "core.types", "core.scope", "core.reranker"},
}
FLOOR = {"errors", "version"}


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
