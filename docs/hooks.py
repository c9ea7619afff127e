"""mkdocs hooks: result tables rendered from ``benchmarks/results/*.json``, so no number in the
docs can drift from the file that holds it.

A page writes a marker where a table (or one number) goes::

    {{ results_table("peer_vw.json", rows="results.oracle", only=["rmm_jax", "vw"],
                     columns=[("learner", "label"), ("held-out Recall@5", "held_out_recall", ".3f")]) }}
    the gain is {{ result("quality_locomo.json", "rows.online:hybrid.gain_held_out", "interval") }}

* ``rows`` is a dotted path to a dict (one row per item, in file order, or in the order of
  ``only``) or a list (``key="name"`` names its rows by a field); ``"@key"`` in a column is
  the item's key (``labels`` renames keys).
* a column is ``(header, path)`` or ``(header, path, format)``; a path may also be a list of
  keys (for keys holding dots); a path ending in ``?`` renders ``–`` when absent. Any other
  missing key is an error, so ``mkdocs build --strict`` fails rather than print a stale table.
* a format is a Python format spec (``".3f"``, ``"+.3f"``, ``",.0f"``), or ``KIND:SPEC`` with
  KIND ``interval`` (``{mean, lo, hi}`` → ``+0.040 [+0.012, +0.068]``, with ``, n.s.`` when
  the interval holds 0), ``spread`` (``{median, min, max}`` → ``5.48 [5.03, 5.52]``),
  ``ratio`` (the same with ``×``), ``pass`` (a boolean → met / missed) or ``str``.
* ``optional=True`` lets a table name a result file that a benchmark run has not committed
  yet; it renders as a note until the file exists, then as the table (its keys checked).

Under each table the hook names the file (linked: the result files are published with the
site under ``results/``) and the command that wrote it (``command`` or ``provenance.command``
in the file). ``tests/test_docs.py`` renders every marker of every page without mkdocs.
"""
from __future__ import annotations

import ast
import json
import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "benchmarks" / "results"
MARKER = re.compile(r"\{\{\s*(results_table|result)\((.*?)\)\s*\}\}", re.S)
MISSING = object()
KINDS = ("interval", "spread", "ratio", "pass", "str")


class ResultError(ValueError):
    """A marker names a file, key or format that does not exist."""


def load(name: str) -> dict:
    path = RESULTS / name
    if not path.is_file():
        raise ResultError(f"no result file {path.relative_to(REPO)}")
    return json.loads(path.read_text())


def command_of(data: dict) -> str | None:
    """The command line that wrote a result file, as the file records it."""
    if isinstance(data.get("command"), str):
        return data["command"]
    prov = data.get("provenance")
    if isinstance(prov, dict) and isinstance(prov.get("command"), str):
        return prov["command"]
    runs = data.get("runs")
    if isinstance(runs, list) and runs and isinstance(runs[-1], dict):
        return command_of(runs[-1])
    return None


def _picks(row, key: str) -> bool:
    field, _, value = key.partition("=")
    return isinstance(row, dict) and str(row.get(field)) == value


def get(data, path, name: str = "?"):
    """Follow a dotted path (or a list of keys; ``field=value`` picks the one row of a list
    whose field is that value, so a row added to a file moves no reference); ``MISSING`` for an
    optional path that is absent."""
    optional = isinstance(path, str) and path.endswith("?")
    keys = [k for k in path.rstrip("?").split(".") if k] if isinstance(path, str) else list(path)  # "": the row
    node = data
    for k in keys:
        if isinstance(node, dict) and str(k) in node:
            node = node[str(k)]
        elif isinstance(node, list) and str(k).lstrip("-").isdigit() and -len(node) <= int(k) < len(node):
            node = node[int(k)]
        elif isinstance(node, list) and "=" in str(k) and sum(_picks(r, str(k)) for r in node) == 1:
            node = next(r for r in node if _picks(r, str(k)))   # "name=X": the one row whose name is X
        elif optional:
            return MISSING
        else:
            raise ResultError(f"{name}: no key {k!r} of {path!r}")
    return node


def fmt(value, spec: str = "", name: str = "?") -> str:
    """One cell: a number by a format spec, or an interval, spread, ratio, pass or string."""
    if value is MISSING or value is None:
        return "–"
    kind, _, sub = spec.partition(":")
    if kind not in KINDS:
        kind, sub = "", spec
    try:
        if kind == "interval":
            s = sub or "+.3f"
            lo, hi = value["lo"], value["hi"]
            ns = ", n.s." if lo <= 0 <= hi else ""
            return f"{value['mean']:{s}} [{lo:{s}}, {hi:{s}}]{ns}"
        if kind in ("spread", "ratio"):
            s, x = sub or ".2f", "×" if kind == "ratio" else ""
            return f"{value['median']:{s}}{x} [{value['min']:{s}}, {value['max']:{s}}]"
        if kind == "pass":
            return "met" if value else "**missed**"
        if kind == "str":
            return str(value)
        return format(value, sub) if sub else (f"{value:.4g}" if isinstance(value, float) else str(value))
    except (KeyError, TypeError, ValueError) as e:
        raise ResultError(f"{name}: cannot format {str(value)[:60]!r} as {spec!r}: {e}") from e


def caption(name: str, data: dict) -> str:
    cmd = command_of(data)
    prov = data.get("provenance") if isinstance(data.get("provenance"), dict) else {}
    when = ", ".join(f"{k} {prov[k]}" for k in ("commit", "date") if prov.get(k))
    by = f", written by `{cmd}`" if cmd else " (the file records no command)"
    return f"*From [`benchmarks/results/{name}`](results/{name}){by}{f' ({when})' if when else ''}.*"


def results_table(name: str, rows: str, columns, only=None, labels=None, key=None, optional=False) -> str:
    """A markdown table with one row per item under ``rows`` of ``benchmarks/results/NAME``
    (``key``: for a list of rows, the field that names a row, so ``only`` can name rows;
    ``optional``: a file not yet committed renders as a note saying so, not as an error)."""
    if optional and not (RESULTS / name).is_file():
        return f"*(`benchmarks/results/{name}` is not in this checkout yet: this table appears once it is.)*"
    data = load(name)
    node = get(data, rows, name)
    if key is not None and isinstance(node, list):
        node = {str(get(r, key, name)): r for r in node}
    if isinstance(node, dict):
        keys = list(node) if only is None else list(only)
    elif isinstance(node, list):
        keys = list(range(len(node))) if only is None else list(only)
    else:
        raise ResultError(f"{name}: {rows!r} is neither a dict nor a list")
    labels = labels or {}
    head = [c[0] for c in columns]
    out = ["| " + " | ".join(c.replace("|", "\\|") for c in head) + " |", "|" + "---|" * len(head)]
    for key in keys:
        row = get(node, [key], name)
        cells = [str(labels.get(key, key)) if col[1] == "@key"
                 else fmt(get(row, col[1], name), col[2] if len(col) > 2 else "", name) for col in columns]
        out.append("| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |")
    return "\n".join(out) + "\n\n" + caption(name, data)


def result(name: str, path, spec: str = "") -> str:
    """One number from ``benchmarks/results/NAME``, formatted in place."""
    return fmt(get(load(name), path, name), spec, name)


def render(markdown: str, where: str = "?") -> str:
    """Expand every marker of a page (raises :class:`ResultError` naming the page)."""
    def one(m):
        call = ast.parse(f"f({m.group(2)})", mode="eval").body
        args = [ast.literal_eval(a) for a in call.args]
        kwargs = {k.arg: ast.literal_eval(k.value) for k in call.keywords}
        try:
            return (results_table if m.group(1) == "results_table" else result)(*args, **kwargs)
        except ResultError as e:
            raise ResultError(f"{where}: {e}") from None
    return MARKER.sub(one, markdown)


# ---------------------------------------------------------------- mkdocs entry points

def on_config(config):
    """The CLI reference (mkdocs-click) reads the click group ``rmm_jax.cli.main.cli``; its verbs
    add themselves to it when their modules are imported, as ``rmm-jax`` does at start."""
    from rmm_jax.cli.main import register_commands
    register_commands()
    return config


def on_page_markdown(markdown, page, config, files):
    return render(markdown, page.file.src_uri)


def on_files(files, config):
    """Publish benchmarks/results/* (JSON and PNG) with the site under results/."""
    from mkdocs.structure.files import File
    for path in sorted(RESULTS.iterdir()):
        if path.suffix in (".json", ".png"):
            files.append(File.generated(config, f"results/{path.name}", abs_src_path=str(path)))
    return files
