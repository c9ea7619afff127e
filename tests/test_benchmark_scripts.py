"""The benchmark scripts stay runnable and separate: each imports on today's API, as
``python benchmarks/NAME.py`` sees it (the script's folder first on ``sys.path``, no edits
to it), and none imports another script; what two need lives in ``benchmarks/_common.py``
(or a private ``_ref_*`` module)."""
from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[1] / "benchmarks"
SCRIPTS = sorted(p for p in BENCH.glob("*.py") if not p.name.startswith("_"))
SHARED = {p.stem for p in BENCH.glob("_*.py")}
# Not yet ported to the program object (another helper's remit); drop it from here once it is.
NOT_PORTED = {"ope_validation"}


def imports(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module.split(".")[0])
    return names


def edits_sys_path(path: Path) -> bool:
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Attribute) and node.attr == "path" and getattr(node.value, "id", None) == "sys":
            return True
    return False


def test_no_script_imports_another_or_edits_sys_path():
    scripts = {p.stem for p in SCRIPTS}
    assert {"quality_locomo", "citation_noise", "defaults_sweep"} <= scripts
    for p in SCRIPTS + [BENCH / f"{s}.py" for s in SHARED]:
        assert not imports(p) & scripts, f"{p.name} imports another script: {sorted(imports(p) & scripts)}"
        if p.stem not in NOT_PORTED:
            assert not edits_sys_path(p), f"{p.name} edits sys.path"


def test_every_script_imports_on_the_current_api():
    code = ("import importlib, json, sys\n"
            f"sys.path.insert(0, {str(BENCH)!r})\n"       # what `python benchmarks/NAME.py` puts first
            "bad = {}\n"
            f"for name in {sorted(p.stem for p in SCRIPTS if p.stem not in NOT_PORTED)!r}:\n"
            "    try:\n"
            "        importlib.import_module(name)\n"
            "    except Exception as e:\n"
            "        bad[name] = f'{type(e).__name__}: {e}'\n"
            "print(json.dumps(bad))\n")
    env = {**os.environ, "PYTHONPATH": str(BENCH.parent), "HF_HUB_OFFLINE": "1"}
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    assert json.loads(r.stdout.strip().splitlines()[-1]) == {}


def test_a_result_file_records_its_commit_and_is_refused_from_a_dirty_tree(tmp_path, monkeypatch):
    """``write_result`` records the commit and ``clean``; into ``benchmarks/results/`` a dirty
    tree is refused (exit, nothing written) unless $RMM_ALLOW_DIRTY=1, which marks the file
    ``clean: false``; a scratch path is written, marked."""
    sys.path.insert(0, str(BENCH))
    try:
        import _common
    finally:
        sys.path.remove(str(BENCH))
    results = tmp_path / "results"
    results.mkdir()
    monkeypatch.setattr(_common, "RESULTS", results)
    monkeypatch.delenv(_common.ALLOW_DIRTY_ENV, raising=False)
    monkeypatch.setattr(_common, "uncommitted", lambda: [])
    _common.write_result(results / "ok.json", {"x": 1})
    prov = json.loads((results / "ok.json").read_text())["provenance"]
    assert prov["clean"] is True and prov["commit"]
    monkeypatch.setattr(_common, "uncommitted", lambda: ["rmm_jax/core/update.py"])
    with pytest.raises(SystemExit, match="commit first"):
        _common.write_result(results / "dirty.json", {"x": 1})
    assert not (results / "dirty.json").exists()
    _common.write_result(tmp_path / "scratch.json", {"x": 1})
    assert json.loads((tmp_path / "scratch.json").read_text())["provenance"]["clean"] is False
    monkeypatch.setenv(_common.ALLOW_DIRTY_ENV, "1")
    _common.write_result(results / "dirty.json", {"x": 1})
    prov = json.loads((results / "dirty.json").read_text())["provenance"]
    assert prov["clean"] is False and prov["uncommitted"] == ["rmm_jax/core/update.py"]


def test_uncommitted_ignores_result_files_only(tmp_path):
    """A changed result file (a run writes several) leaves the tree clean; any other change does not."""
    sys.path.insert(0, str(BENCH))
    try:
        import _common
    finally:
        sys.path.remove(str(BENCH))
    git = lambda *a: subprocess.run(["git", "-C", str(tmp_path), *a], check=True, capture_output=True)  # noqa: E731
    git("init", "-q")
    (tmp_path / "benchmarks" / "results").mkdir(parents=True)
    (tmp_path / "code.py").write_text("x = 1\n")
    git("add", ".")
    git("-c", "user.email=t@t", "-c", "user.name=t", "commit", "-qm", "init")
    old = (_common.REPO, _common.RESULTS)
    _common.REPO, _common.RESULTS = tmp_path, tmp_path / "benchmarks" / "results"
    try:
        assert _common.uncommitted() == []
        (tmp_path / "benchmarks" / "results" / "new.json").write_text("{}")
        assert _common.uncommitted() == []
        (tmp_path / "code.py").write_text("x = 2\n")
        assert _common.uncommitted() == ["code.py"]
    finally:
        _common.REPO, _common.RESULTS = old


def test_the_default_and_calibrated_are_what_the_sweep_chooses():
    """Recomputed here from the cells of the committed sweep files: ``preset("default")`` is the
    candidate whose worst mean gain over all nine cells (three citation models x three scopes)
    is best (ties: the earlier row) over ``defaults_sweep.json`` and its anchored candidates
    (``defaults_sweep_anchored.json``, the same seeds and streams: one sweep); within each file,
    its ``chosen`` is its own best. ``calibrated`` is, in each scope, the candidate of
    ``defaults_sweep.json`` whose worst cell over the three citation models is best (ties: the
    better next-worst cell, then the earlier row). The judge rates ``calibrated`` corrects for
    are the paper's (``rmm_jax.data.citations``)."""
    import rmm_jax as rj
    from rmm_jax.core.config import PAPER_JUDGE, describe
    from rmm_jax.data.citations import P_OTHER, P_USEFUL

    assert (PAPER_JUDGE["p_useful"], PAPER_JUDGE["p_other"]) == (P_USEFUL, P_OTHER)
    scopes = ("user", "shared", "hybrid")
    worst_of = lambda row: min(v["gain"]["mean"] for v in row["cells"].values())   # noqa: E731
    union = {}
    for name in ("defaults_sweep.json", "defaults_sweep_anchored.json"):
        sweep = json.loads((BENCH / "results" / name).read_text())
        rows = sweep["rows"]
        assert all(len(row["cells"]) == 9 for row in rows)
        assert sweep["chosen"] == rows[max(range(len(rows)), key=lambda i: (worst_of(rows[i]), -i))]["name"]
        union.update({row["name"]: row for row in rows if row["name"] not in union})
    rows = list(union.values())
    best = rows[max(range(len(rows)), key=lambda i: (worst_of(rows[i]), -i))]
    assert best["fields"].get("reference") == "retriever"
    sweep = json.loads((BENCH / "results" / "defaults_sweep.json").read_text())
    rows = sweep["rows"]
    models = sorted({c.split("/")[0] for row in rows for c in row["cells"]})
    assert len(models) == 3
    for scope in scopes:
        want = describe(*rj.preset("reinforce", scope=scope, **best["fields"]))
        assert describe(*rj.preset("default", scope=scope)) == want, scope
        cells = [sorted(row["cells"][f"{m}/{scope}"]["gain"]["mean"] for m in models) for row in rows]
        pick = rows[max(range(len(rows)), key=lambda i: (cells[i], -i))]   # leximin: worst, next-worst, best
        if "chosen_by_scope" in sweep:                 # files written since the per-scope choice is recorded
            assert sweep["chosen_by_scope"][scope] == pick["name"]
        want = describe(*rj.preset("reinforce", scope=scope, **pick["fields"]))
        assert describe(*rj.preset("calibrated", scope=scope)) == want, (scope, pick["name"])
    realistic = json.loads((BENCH / "results" / "defaults_sweep.json").read_text())["chosen"]
    assert describe(*rj.preset("realistic")) == describe(*rj.preset("reinforce", **union[realistic]["fields"]))


def test_anchored_is_what_its_sweep_chooses_and_was_run_beside_the_default():
    """``preset("anchored")`` is, in every scope, the candidate of ``defaults_sweep_anchored.json``
    whose worst of the nine cells is best (recomputed from the cells); that file ran the earlier
    default's candidate (``realistic``) beside them, and its cells are the ones ``defaults_sweep.json``
    holds (same seeds and streams: the two files are one sweep), and its worst cell is below the chosen one's."""
    import rmm_jax as rj
    from rmm_jax.core.config import describe

    sweep = json.loads((BENCH / "results" / "defaults_sweep_anchored.json").read_text())
    first = {r["name"]: r for r in json.loads((BENCH / "results" / "defaults_sweep.json").read_text())["rows"]}
    rows = sweep["rows"]
    assert all(len(row["cells"]) == 9 for row in rows)
    worst = [min(v["gain"]["mean"] for v in row["cells"].values()) for row in rows]
    best = rows[max(range(len(rows)), key=lambda i: (worst[i], -i))]
    assert sweep["chosen"] == best["name"] and best["fields"].get("reference") == "retriever"
    for scope in ("user", "shared", "hybrid"):
        assert describe(*rj.preset("anchored", scope=scope)) == \
            describe(*rj.preset("reinforce", scope=scope, **best["fields"])), scope
    default = next(r for r in rows if r["name"] == json.loads(
        (BENCH / "results" / "defaults_sweep.json").read_text())["chosen"])
    assert {c: v["gain"]["mean"] for c, v in default["cells"].items()} == \
        {c: v["gain"]["mean"] for c, v in first[default["name"]]["cells"].items()}
    assert min(v["gain"]["mean"] for v in default["cells"].values()) < max(worst)


def test_anchored_calibrated_is_what_the_populations_sweep_chooses():
    """``preset("anchored_calibrated")`` is, in every scope, the candidate of
    ``defaults_sweep_populations.json`` whose worst of its twelve cells (LoCoMo's nine and the
    three vector populations', recomputed from the cells) is best; the default's candidate ran
    beside it (``anchored``), with the LoCoMo cells ``defaults_sweep_anchored.json`` holds for it (same seeds and
    streams), and one of its cells falls below the retriever."""
    import rmm_jax as rj
    from rmm_jax.core.config import describe

    sweep = json.loads((BENCH / "results" / "defaults_sweep_populations.json").read_text())
    rows = sweep["rows"]
    assert all(len(row["cells"]) == 12 and sum(c.startswith("vectors") for c in row["cells"]) == 3 for row in rows)
    worst = [min(v["gain"]["mean"] for v in row["cells"].values()) for row in rows]
    best = rows[max(range(len(rows)), key=lambda i: (worst[i], -i))]
    assert sweep["chosen"] == best["name"]
    for scope in ("user", "shared", "hybrid"):
        assert describe(*rj.preset("anchored_calibrated", scope=scope)) == \
            describe(*rj.preset("reinforce", scope=scope, **best["fields"])), scope
    earlier = json.loads((BENCH / "results" / "defaults_sweep_anchored.json").read_text())["rows"]
    anchored = {r["name"]: r for r in earlier}
    default = next(r for r in rows
                   if describe(*rj.preset("reinforce", **r["fields"])) == describe(*rj.preset("anchored")))
    assert {c: v["gain"]["mean"] for c, v in default["cells"].items() if c in anchored[default["name"]]["cells"]} == \
        {c: v["gain"]["mean"] for c, v in anchored[default["name"]]["cells"].items()}
    assert min(v["gain"]["mean"] for v in default["cells"].values()) < 0
    for row in rows:                              # the worst cell the docs render is the file's own minimum
        means = {c: v["gain"]["mean"] for c, v in row["cells"].items()}
        assert row["worst"] == min(means.values()) and means[row["worst_cell"]] == row["worst"], row["name"]


def test_a_population_cell_pairs_each_users_online_recall_with_its_own_retriever(monkeypatch):
    """A population cell's gain is each query's online recall minus the same query's retriever
    recall: with one question per user in scope ``user``, every question is scored before any
    update, so the online recall is the retriever's query for query and the gain is exactly 0,
    which a cell pairing one user's recall with another's would miss (the users' retriever
    recalls differ: the test checks it has some 0s and some 1s)."""
    sweep = bench_module("defaults_sweep", monkeypatch)
    monkeypatch.setattr(sweep, "POPULATIONS", {"vectors, one question/oracle/user": ({"queries": 1}, 24, "user",
                                                                                     "oracle", (0, 1))})
    fields = sweep.NAMED["anchored calibrated offset -1 lr 3e-4"]
    cell = sweep.population_cells(fields, 20, 2)["vectors, one question/oracle/user"]
    assert 0 < cell["base_recall"] < 1
    assert cell["recall"] == cell["base_recall"]
    assert cell["gain"]["mean"] == 0 and cell["gain"]["lo"] == 0 == cell["gain"]["hi"]
    assert cell["gain"]["seeds"] == 2 and cell["gain"]["queries"] == 24      # the interval's units: the users
    assert cell["gain"]["resamples"] == ["seed", "user"]


@pytest.mark.parametrize("name", ["defaults_sweep.json", "defaults_sweep_anchored.json",
                                  "defaults_sweep_populations.json"])
def test_each_sweep_file_holds_the_candidates_its_command_runs_today(name, monkeypatch):
    """The candidates a sweep file's recorded command would run now are the rows it holds, in
    order: a candidate added to the default set later would change what re-running it chooses."""
    import shlex
    sweep = bench_module("defaults_sweep", monkeypatch)
    data = json.loads((BENCH / "results" / name).read_text())
    ns, _ = parsed("defaults_sweep", shlex.split(data["provenance"]["command"])[2:], monkeypatch)
    names = list(sweep.CANDIDATES) if not ns.candidates else [n.strip() for n in ns.candidates.split(";")]
    assert names == [r["name"] for r in data["rows"]]
    assert all(sweep.NAMED[n] == r["fields"] for n, r in zip(names, data["rows"]))
    if ns.populations:                            # and the populations it runs today are the ones it ran
        assert data["config"]["populations"] == sweep.populations_config(ns.k)


def test_the_one_question_ablation_is_the_whole_grid_between_realistic_and_the_default(monkeypatch):
    """one_question.py --ablation: eight of its rows are the 2 x 2 x 2 grid of anchor x offset x step
    size, each setting what its label says, realistic and the default at the two ends, every other
    field theirs; the ninth is the default at offset +1, between the grid's two offsets."""
    import re

    import rmm_jax as rj
    from rmm_jax.core.config import describe
    oq = bench_module("one_question", monkeypatch)
    got = set()
    for label, name, kw in oq.ABLATION:
        d = describe(*rj.preset(name, **kw))
        anchor, offset, lr = re.search(r"(best score|retriever), offset (\+?\d), lr ([\d.e-]+)$", label).groups()
        assert (d["estimator"]["reference"], d["estimator"]["offset"], d["optimizer"]["lr"]) == (
            "best" if anchor == "best score" else "retriever", float(offset), float(lr)), label
        rest = {k: v for k, v in d["estimator"].items() if k not in ("reference", "offset")}
        assert rest == {k: v for k, v in describe(*rj.preset("default"))["estimator"].items()
                        if k not in ("reference", "offset")}, label
        got.add((anchor, offset, lr))
    grid = {g for g in got if g[1] in ("0", "+2")}
    assert len(grid) == 8 and got - grid == {("retriever", "+1", "3e-4")} and len(got) == len(oq.ABLATION) == 9
    ends = {label.split(":")[0]: describe(*rj.preset(name, **kw)) for label, name, kw in oq.ABLATION if ":" in label}
    assert ends == {"realistic": describe(*rj.preset("realistic")), "default": describe(*rj.preset("default"))}


def test_nights_asks_every_question_again_each_night_and_counts_every_night(monkeypatch):
    """nights.py's stream: the queries in order once a night, every night valid (``repeat_passes``
    counts only its first pass), one pass as far as the loop knows."""
    import numpy as np

    from rmm_jax.online.streams import Stream
    nights = bench_module("nights", monkeypatch)
    s = Stream("u", np.zeros((2, 1), np.float32), np.arange(3, dtype=np.float32)[:, None],
               np.zeros((3, 1), np.int32), np.ones((3, 1), bool), np.ones((3, 1), bool), np.ones(3, np.int32),
               np.array([True, False, True]), query_ids=("a", "b", "c"))
    r = nights.nightly(s, 3)
    assert r.queries[:, 0].tolist() == [0, 1, 2] * 3 and r.query_ids == ("a", "b", "c") * 3
    assert r.valid.tolist() == [True, False, True] * 3 and r.passes == 1


class _Parsed(Exception):
    """Raised in place of running a script once its arguments parsed (:func:`parsed`)."""


def parsed(script: str, argv: list[str], monkeypatch):
    """What ``python benchmarks/SCRIPT.py ARGV`` parses to, without running the benchmark:
    ``main(argv)`` is called with ``parse_args`` (or ``parse_known_args``, which
    demo_result uses) stopping right after parsing: ``(namespace, parser)``; a usage error
    is the script's ``SystemExit``."""
    import argparse
    import importlib

    monkeypatch.syspath_prepend(str(BENCH))
    module = importlib.import_module(script)
    real, real_known = argparse.ArgumentParser.parse_args, argparse.ArgumentParser.parse_known_args
    inside = []

    def stop(self, args=None, namespace=None):
        inside.append(1)
        raise _Parsed(real(self, args, namespace), self)

    def stop_known(self, args=None, namespace=None):
        got = real_known(self, args, namespace)
        if inside:                                  # parse_args' own call: let it check the rest
            return got
        raise _Parsed(got, self)

    monkeypatch.setattr(argparse.ArgumentParser, "parse_args", stop)
    monkeypatch.setattr(argparse.ArgumentParser, "parse_known_args", stop_known)
    try:
        module.main(argv)
    except _Parsed as p:
        return p.args
    raise AssertionError(f"{script}.main({argv}) returned without parsing its arguments")


BAD_ARGUMENTS = [
    ("one_question", ["--store", "/no/such/store"]),
    ("one_question", ["--users", "-1"]),
    ("one_question", ["--seeds", "x"]),
    ("one_question", ["--scopes", "bogus"]),
    ("learn_sweep", ["scope", "--seeds", "abc"]),
    ("defaults_sweep", ["--seeds", "1,x"]),
    ("quality_locomo", ["--k", "0"]),
    ("citation_agreement", ["--k", "-3"]),
    ("citation_noise", ["--seeds", "0"]),
    ("retrieval_locomo", ["--out-dir", "/tmp", "--granularities", "turn,foo"]),
    ("soak", ["--users", "-1"]),
    ("store_scale", ["--users", "-1"]),
    ("scale", ["--users", "-5"]),
    ("serve", ["--repeats", "-1"]),
    ("cli_latency", ["--repeats", "0"]),
    ("throughput", ["--repeats", "0"]),
    ("ope_validation", ["--seeds", "-1"]),
    ("deploy", ["--gate", "--paired-with", "/no/such/result.json"]),
    ("peer_vw", ["--tuned", "/no/such/result.json"]),
]


@pytest.mark.parametrize("script,argv", BAD_ARGUMENTS, ids=[f"{s} {' '.join(a)}" for s, a in BAD_ARGUMENTS])
def test_a_bad_argument_is_a_usage_error_before_anything_runs(script, argv, monkeypatch, capsys):
    """A negative count, a seed that is no int, an unknown name or a missing input path is
    argparse's one-line error (exit 2) at parse time: not a traceback minutes into the run,
    nor a run that starts (or an input read only at its end)."""
    with pytest.raises(SystemExit) as e:
        parsed(script, argv, monkeypatch)
    assert e.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert f": error: argument {argv[-2]}: " in err[-1], err


def test_every_plot_and_copy_is_written_whole():
    """A script's ``--plot`` goes through ``_common.save_figure`` (or ``atomic_output``): a
    direct ``fig.savefig(path)`` or ``shutil.copyfile(src, path)`` leaves a half-written PNG
    under the result's name when the run is killed mid-write."""
    for p in SCRIPTS:
        for node in ast.walk(ast.parse(p.read_text())):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
                shutil_copy = (getattr(node.func.value, "id", None) == "shutil"
                               and node.func.attr in ("copy", "copy2", "copyfile"))
                assert node.func.attr != "savefig" and not shutil_copy, \
                    f"{p.name}:{node.lineno}: {node.func.attr} writes an output in place"


def test_a_figure_that_fails_mid_write_leaves_nothing(tmp_path, monkeypatch):
    """``save_figure`` whose ``savefig`` dies after writing half: neither the target nor a
    temporary file is left, and an existing target keeps its old bytes."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    monkeypatch.syspath_prepend(str(BENCH))
    import _common

    target = tmp_path / "plot.png"
    target.write_bytes(b"old")

    def dies(self, fname, **kw):
        Path(fname).write_bytes(b"\x89PNG half")
        raise KeyboardInterrupt

    monkeypatch.setattr(matplotlib.figure.Figure, "savefig", dies)
    with pytest.raises(KeyboardInterrupt):
        _common.save_figure(plt.figure(), target)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["plot.png"]
    assert target.read_bytes() == b"old"


def test_a_result_is_not_clean_when_rmm_jax_comes_from_another_checkout(tmp_path, monkeypatch):
    """A script of one checkout (a worktree) run without PYTHONPATH imports ``rmm_jax`` from
    wherever the package is installed (editable: another checkout): its clean tree and
    commit say nothing of the code that ran, so the result is not ``clean``, says where the
    code came from, and is refused under ``benchmarks/results/``."""
    monkeypatch.syspath_prepend(str(BENCH))
    import _common

    git = lambda *a: subprocess.run(["git", "-C", str(tmp_path), *a], check=True, capture_output=True)  # noqa: E731
    git("init", "-q")
    (tmp_path / "benchmarks" / "results").mkdir(parents=True)
    (tmp_path / "code.py").write_text("x = 1\n")
    git("add", ".")
    git("-c", "user.email=t@t", "-c", "user.name=t", "commit", "-qm", "init")
    monkeypatch.setattr(_common, "REPO", tmp_path)
    monkeypatch.setattr(_common, "RESULTS", tmp_path / "benchmarks" / "results")
    monkeypatch.delenv(_common.ALLOW_DIRTY_ENV, raising=False)
    assert _common.uncommitted() == []                    # the checkout itself is clean
    prov = _common.provenance()
    assert prov["clean"] is False and prov["rmm_jax_from"] == str(BENCH.parent.resolve())
    with pytest.raises(SystemExit, match="rmm_jax imported from"):
        _common.write_result(tmp_path / "benchmarks" / "results" / "r.json", {"x": 1})


def committed_commands() -> list[tuple[str, str, list[str]]]:
    """(result file, script, argv) of every committed result's ``provenance.command``."""
    import shlex
    out = []
    for f in sorted((BENCH / "results").glob("*.json")):
        words = shlex.split(json.loads(f.read_text())["provenance"]["command"])
        out.append((f.name, Path(words[1]).stem, words[2:]))
    return out


@pytest.mark.parametrize("name,script,argv", committed_commands(), ids=[c[0] for c in committed_commands()])
def test_a_committed_result_is_reproducible_with_todays_options(name, script, argv, monkeypatch):
    """The command in each result file's provenance still parses with its script's options
    (a renamed or dropped option means the result can no longer be reproduced as recorded),
    and that script's ``--help`` shows the default of every option that has one."""
    import argparse
    monkeypatch.setenv("COLUMNS", "10000")                # one line per option: no path wrapped at a '-'
    monkeypatch.setattr(sys, "argv", [str(BENCH / f"{script}.py")])   # prog, as `python benchmarks/X.py`
    ns, parser = parsed(script, argv, monkeypatch)
    assert ns is not None
    help_text = parser.format_help()
    command = json.loads((BENCH / "results" / name).read_text())["provenance"]["command"]
    assert f"  {name}: {command}\n" in help_text, f"{script} --help does not name the command that wrote {name}"
    text = " ".join(help_text.split())
    for a in parser._actions:
        if a.option_strings and a.default not in (None, False, argparse.SUPPRESS) and a.help != argparse.SUPPRESS:
            assert f"default: {a.default}" in text or "default" in (a.help or "").lower(), \
                f"{script} --help: {a.option_strings[0]} shows no default"
        assert text.count(f"(default: {a.default}) (default:") == 0


def bench_module(name: str, monkeypatch):
    """benchmarks/NAME.py imported as ``python benchmarks/NAME.py`` sees its folder."""
    import importlib
    monkeypatch.syspath_prepend(str(BENCH))
    return importlib.import_module(name)


@pytest.mark.parametrize("script,option", [("deploy", "json"), ("ope_validation", "json"), ("store_scale", "out")])
def test_no_result_file_is_written_unless_asked(script, option, monkeypatch):
    """A run without ``--json``/``--out`` writes no file: a default under benchmarks/results/
    let a smoke run overwrite the committed result the docs render."""
    ns, _ = parsed(script, [], monkeypatch)
    assert getattr(ns, option) is None


def test_store_scale_creates_its_workdir_and_writes_nothing_by_default(tmp_path, monkeypatch, capsys):
    """``--workdir D`` that does not exist yet is created (as soak.py does), not a
    FileNotFoundError; without ``--out`` the run writes no result file."""
    store_scale = bench_module("store_scale", monkeypatch)
    written = []
    monkeypatch.setattr(store_scale._common, "write_result", lambda path, doc: written.append(path))
    work = tmp_path / "new" / "dir"
    assert store_scale.main(["--users", "4", "--per-save", "2", "--loads", "1", "--no-rollback",
                             "--workdir", str(work)]) == 0
    assert work.is_dir() and written == []
    assert "4 users in 2 saves" in capsys.readouterr().out


def test_learn_sweep_reuses_a_complete_store_without_the_data(tmp_path, monkeypatch):
    """``--store`` naming a complete embedding store needs no LoCoMo data (it was a skip,
    exit 0, nothing run); the data is required only to build the store."""
    from fake_embedder import FakeEmbedder

    import rmm_jax.online.streams as streams_mod
    from rmm_jax.data import make_synthetic
    from rmm_jax.data.store import write_store

    learn_sweep = bench_module("learn_sweep", monkeypatch)
    store = tmp_path / "store"
    write_store(store, make_synthetic(users=2, sessions=2, turns=4, seed=0), "turn", FakeEmbedder(16), spec="s",
                answers=True)
    monkeypatch.setattr(streams_mod, "load_dialogue_streams", lambda st, k: [])   # synthetic has no dialogue
    monkeypatch.setitem(learn_sweep.LEVERS, "heldout", lambda ctx: {"streams": len(ctx.streams)})
    monkeypatch.delenv("CI", raising=False)
    result = learn_sweep.main(["heldout", "--data", str(tmp_path / "no_data"), "--store", str(store)])
    assert result["streams"] == 2
    with pytest.raises(SystemExit) as e:                 # no store to reuse: the data is needed, a skip
        learn_sweep.main(["heldout", "--data", str(tmp_path / "no_data"), "--store", str(tmp_path / "new")])
    assert e.value.code == 0


@pytest.mark.parametrize("argv,says", [
    (["dialogue", "--rows", "default"], "--rows: the dialogue lever has no named rows to pick"),
    (["dialogue_lr", "--rows", "default"], "--rows: the dialogue_lr lever has no named rows to pick"),
    (["heldout", "--rows", "anchored;no such row"], "--rows: unknown row 'no such row' (choose from: default; "),
    (["anchor", "--rows", "lr 3e-4"], "--rows: unknown row 'lr 3e-4' (choose from: default; lr 3e-4, anchor 0.01;"),
    (["start_loss", "--rows", "logistic"], "--rows: unknown row 'logistic' (choose from: listwise (the recipe);")])
def test_learn_sweep_rows_it_cannot_run_are_refused_before_anything_runs(argv, says, tmp_path, monkeypatch, capsys):
    """``--rows`` was silently ignored by heldout, dialogue, dialogue_lr, start_loss and anchor
    (``heldout --rows anchored`` ran all its rows): a lever without named rows refuses it, and a
    name that is not one of the lever's rows is refused listing them, both a one-line usage
    error before the data is read, nothing written."""
    learn_sweep = bench_module("learn_sweep", monkeypatch)
    monkeypatch.setattr(learn_sweep, "locomo", _stop)
    out = tmp_path / "result.json"
    with pytest.raises(SystemExit) as e:
        learn_sweep.main(argv + ["--json", str(out)])
    assert e.value.code == 2
    assert says in capsys.readouterr().err.strip().splitlines()[-1]
    assert not out.exists()


def test_learn_sweep_heldout_runs_the_rows_named_and_only_their_pairs_and_targets(monkeypatch):
    """``heldout --rows`` runs those rows (online and pretrained) and reports the pairs and
    issue 26's targets that read only them."""
    learn_sweep = bench_module("learn_sweep", monkeypatch)
    ran = []

    def runs(ctx, rows, *a, shown=None):
        ran.extend(r["name"] for r in rows)
        return {r["name"]: r["name"] for r in rows}

    monkeypatch.setattr(learn_sweep, "online_rows", runs)
    monkeypatch.setattr(learn_sweep, "pretrain_rows", runs)
    monkeypatch.setattr(learn_sweep, "record", lambda r: {"name": r["name"]})
    interval = {"mean": 0.1, "lo": 0.05, "hi": 0.15, "significant": True}
    monkeypatch.setattr(learn_sweep, "gain", lambda *a: {"recall": 0.5, "gain": interval})
    monkeypatch.setattr(learn_sweep, "paired", lambda a, b, *x: {**interval, "a": a, "b": b})
    ctx = learn_sweep.Context([], {}, {}, {}, [0], "default hybrid;default;gold pretrain", [1], lambda msg: None)
    out = learn_sweep.lever_heldout(ctx)
    assert ran == ["default", "default hybrid", "gold pretrain"]
    assert [r["name"] for r in out["rows"]] == ran
    assert [(p["a"], p["b"]) for p in out["pairs"]] == [("default hybrid", "default")]
    assert [t["row"] for t in out["targets"]] == ["default", "default hybrid − default"]


def test_soak_refuses_fewer_memories_than_candidates_up_front(monkeypatch, capsys):
    """``--memories`` below ``--k``: simulate logs short candidate lists that replay (same
    --k) refuses; the run is a one-line usage error before anything runs, naming both."""
    soak = bench_module("soak", monkeypatch)
    with pytest.raises(SystemExit) as e:
        soak.main(["--users", "1", "--queries", "2", "--memories", "16"])
    assert e.value.code == 2
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert "--memories 16" in last and "--k 20" in last


REDRAWS = [("deploy", ["--replot", "--json", "{missing}", "--plot", "{png}"], "--json"),
           ("ope_validation", ["--replot", "--json", "{missing}", "--plot", "{png}"], "--json"),
           ("transfer", ["--from-json", "{missing}", "--plot", "{png}"], "--from-json"),
           ("labelled_calls", ["--from-json", "{missing}", "--plot", "{png}"], "--from-json"),
           ("citation_noise", ["--from-json", "{missing}", "--plot", "{png}"], "--from-json")]


@pytest.mark.parametrize("script,argv,option", REDRAWS, ids=[r[0] for r in REDRAWS])
def test_a_redraw_from_a_missing_file_is_one_line_naming_option_and_path(script, argv, option, tmp_path,
                                                                          monkeypatch, capsys):
    missing, png = tmp_path / "no_such.json", tmp_path / "out.png"
    monkeypatch.setattr(sys, "argv", [str(BENCH / f"{script}.py")])   # prog, as `python benchmarks/X.py`
    module = bench_module(script, monkeypatch)
    with pytest.raises(SystemExit) as e:
        module.main([a.format(missing=missing, png=png) for a in argv])
    assert e.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert f"error: {option} {missing}: " in err[-1] and not any("Traceback" in x for x in err), err
    assert err[0].startswith("usage:") and not any("committed results" in x or "took" in x for x in err), err
    assert not png.exists()


@pytest.mark.parametrize("script,argv,needs", [
    ("citation_noise", ["--from-json", str(BENCH / "results" / "citation_noise.json")], "--from-json needs --plot"),
    ("deploy", ["--replot", "--plot", "{png}"], "--replot needs --json and --plot"),
    ("ope_validation", ["--replot", "--plot", "{png}"], "--replot needs --json and --plot")])
def test_a_redraw_with_nothing_to_draw_or_read_is_refused(script, argv, needs, tmp_path, monkeypatch, capsys):
    """``--from-json`` without ``--plot`` did nothing, silently, exit 0; ``--replot``
    without ``--json`` has no result to read (no file is its default any more)."""
    module = bench_module(script, monkeypatch)
    png = tmp_path / "out.png"
    with pytest.raises(SystemExit) as e:
        module.main([a.format(png=png) for a in argv])
    assert e.value.code == 2
    assert needs in capsys.readouterr().err.strip().splitlines()[-1]
    assert not png.exists()


def test_transfer_help_says_the_speakers_are_kept_by_default(monkeypatch):
    """``--no-speakers`` is a store_false option: its default (True) is that of ``speakers``,
    which read as if --no-speakers were on by default."""
    monkeypatch.setenv("COLUMNS", "10000")
    _, parser = parsed("transfer", [], monkeypatch)
    line = next(x for x in parser.format_help().splitlines() if x.strip().startswith("--no-speakers"))
    assert "(default: True)" not in line and "default: the names are kept" in line


def test_help_says_how_long_each_committed_run_took(monkeypatch):
    """Under each committed command, ``--help`` says how long that run took and on how many
    CPUs (the file's ``seconds`` and ``provenance.machine.cpus``); a file that is one CLI
    verb's JSON (retrieval_locomo's: its ``seconds`` are the verb's) says nothing."""
    monkeypatch.setenv("COLUMNS", "10000")
    monkeypatch.setattr(sys, "argv", [str(BENCH / "citation_agreement.py")])
    _, parser = parsed("citation_agreement", [], monkeypatch)
    data = json.loads((BENCH / "results" / "citation_agreement.json").read_text())
    took = f"about {round(data['seconds'])} s on {data['provenance']['machine']['cpus']} CPUs"
    assert f"  citation_agreement.json: {data['provenance']['command']}\n    took {took}\n" in parser.format_help()
    monkeypatch.setattr(sys, "argv", [str(BENCH / "retrieval_locomo.py")])
    _, parser = parsed("retrieval_locomo", ["--out-dir", "x"], monkeypatch)
    assert "retrieval_locomo_turn.json" in parser.format_help() and "    took " not in parser.format_help()


class _Stop(Exception):
    pass


def _stop(*a, **kw):
    raise _Stop


def test_the_long_benchmarks_say_each_stage_before_it_runs(tmp_path, monkeypatch, capsys):
    """retrieval_locomo, ope_validation and sharing were silent for minutes before their first
    line: each stage is named on stderr as it starts (stopped here at the first stage's work)."""
    data = tmp_path / "locomo"
    data.mkdir()
    (data / "locomo10.json").write_text("[]")
    retrieval = bench_module("retrieval_locomo", monkeypatch)
    monkeypatch.setattr(retrieval, "run_cli", _stop)
    with pytest.raises(_Stop):
        retrieval.main(["--data", str(data), "--out-dir", str(tmp_path), "--granularities", "turn"])
    assert capsys.readouterr().err.splitlines() == [
        "turn: rmm-jax embed (from the embedding cache after the first build)"]
    ope = bench_module("ope_validation", monkeypatch)
    monkeypatch.setattr(ope, "Embedder", _stop)
    with pytest.raises(_Stop):
        ope.main(["--data", str(data)])
    assert capsys.readouterr().err.splitlines() == ["set-up: embedding LoCoMo, pretraining the target on 26,30"]
    sharing = bench_module("sharing", monkeypatch)
    monkeypatch.setattr(sharing._common, "synthetic_population", _stop)
    with pytest.raises(_Stop):
        sharing.main(["--data", str(data)])
    assert capsys.readouterr().err.splitlines()[-1].endswith("synthetic users: their store (a temporary one)")


def test_nights_evaluate_reads_the_last_night_and_the_retriever_exactly(monkeypatch):
    """nights.py --evaluate: the calls are the last night's (as the run drew and logged them,
    every user's), and the retriever target's exact Recall@M (``direct``) equals a brute-force
    enumeration of its Plackett–Luce draws at τ over every ordered selection, per call: wrong
    logits (τ left out), another night's slice or misaligned gold would not."""
    import itertools

    import jax
    import numpy as np

    import rmm_jax as rj
    from rmm_jax.data.citations import oracle
    from rmm_jax.online.streams import Stream
    nights = bench_module("nights", monkeypatch)
    rng = np.random.default_rng(0)
    k, m, t, d = 4, 2, 6, 8
    unit = lambda x: (x / np.linalg.norm(x, axis=-1, keepdims=True)).astype(np.float32)  # noqa: E731  (as embeddings)
    streams = []
    for u in range(3):
        bank = unit(rng.normal(size=(7, d)))
        cand = np.stack([rng.permutation(7)[:k] for _ in range(t)]).astype(np.int32)
        gold = rng.random((t, k)) < 0.3
        gold[:, 0] |= ~gold.any(1)
        streams.append(Stream(f"u{u}", bank, unit(rng.normal(size=(t, d))), cand,
                              np.ones((t, k), bool), gold, gold.sum(1).astype(np.int32) + (u == 1),
                              np.ones(t, bool), query_ids=tuple(f"q{i}" for i in range(t))))
    program = rj.make_run(*rj.preset("default", k=k, m=m), cite_fn=oracle())
    params = rj.init_reranker(jax.random.key(0), d)
    run = nights._common.run_chunk([nights.nightly(s, 2) for s in streams], program, params, 0)
    tau = program.estimator.tau
    calls = nights.last_night_calls(streams, run, lambda u: params, 2, tau)
    assert calls.selected.shape == (3 * t, m)
    assert np.array_equal(calls.selected[:t], np.asarray(run.outputs["u0"]["selected"])[t:])
    assert np.array_equal(calls.log_prob[t:2 * t], np.asarray(run.outputs["u1"]["log_prob"], np.float64)[t:])
    want = []
    for s in streams:
        for i in range(t):
            z = np.einsum("d,kd->k", s.queries[i].astype(np.float64), s.bank[s.cand[i]].astype(np.float64)) / tau
            w = np.exp(z - z.max())
            e = 0.0
            for sel in itertools.permutations(range(k), m):
                p, left = 1.0, w.sum()
                for j in sel:
                    p, left = p * w[j] / left, left - w[j]
                e += p * s.cand_gold[i, list(sel)].sum() / s.num_gold[i]
            want.append(e)
    got = nights.evaluable(streams, [run], params, 2, program, m)["retriever"]["seeds"][0]["direct"]
    # float32 scores of unit vectors: |error of s/τ| ≤ γ_d·Σ|q_i m_i|/τ ≤ (d·2⁻²⁴)/0.1 < 5e-6 per logit;
    # a draw's probability moves by at most 2·m times that, relatively: the mean within 1e-4
    assert abs(got - np.mean(want)) < 1e-4, (got, np.mean(want))


# --------------------------------------------------------------------------- the learner each result records
#
# "default" named `realistic` before it named `anchored`: a result that records only a preset's
# name does not say which learner ran. Each script below records the resolved setting
# (rmm_jax.core.config.setting_record: the name and every field) of each learner it runs; each
# test runs the script at a tiny size (or its result-building lever, stubbed where the script
# needs LoCoMo) and checks that what the file records is what ran: the setting of every program
# the run built (``ran``) is one the file records, and each record names the preset's fields.

def _ran(program_or_setting) -> str:
    """The setting of a program (or of a Setting), as a JSON string comparable across runs."""
    from rmm_jax.core.config import describe
    parts = (program_or_setting.layout, program_or_setting.estimator, program_or_setting.optimizer)
    return json.dumps(describe(*parts), sort_keys=True)


def _as_ran(record: dict) -> str:
    """A recorded setting_record, as :func:`_ran` writes what ran (the preset's name left out)."""
    assert set(record) == {"preset", "layout", "estimator", "optimizer"}, record
    return json.dumps({k: v for k, v in record.items() if k != "preset"}, sort_keys=True)


def _recorded(name: str, **fields) -> dict:
    """setting_record of preset ``name`` with ``fields``, as a result file holds it (JSON)."""
    import rmm_jax as rj
    from rmm_jax.core.config import setting_record
    return json.loads(json.dumps(setting_record(name, rj.preset(name, **fields))))


def _tiny_streams(ids, queries: int = 8):
    """Synthetic vector users (d 8, 12 memories, K 4) named ``ids``."""
    import dataclasses

    from rmm_jax.online.vectors import VectorSpec, vector_chunks
    streams = next(vector_chunks(VectorSpec(dim=8, memories=12, queries=queries, k=4), 0, len(ids), len(ids)))
    return [dataclasses.replace(s, user_id=u) for s, u in zip(streams, ids)]


def _locomo_stubbed(module, monkeypatch, ids):
    """``module`` (a LoCoMo script) reading tiny synthetic streams named ``ids`` in place of LoCoMo,
    with each online run the retriever's recall, the program it was given kept in ``ran``."""
    streams = _tiny_streams(ids)
    ran = []
    monkeypatch.setattr(module._common, "require_data", lambda path: path)
    monkeypatch.setattr(module._common, "locomo_streams",
                        lambda data, k, **kw: module._common.LoCoMo(streams, None, None))

    def online_recall(streams, program, params, seed):
        ran.append(_ran(program))
        return module._common.retriever_recall(streams, program.layout.m)

    monkeypatch.setattr(module._common, "online_recall", online_recall)
    return ran


def test_citation_noise_records_the_learner_of_every_cell(tmp_path, monkeypatch):
    """``config.setting`` is the preset's learner (``config.preset`` alone was a name whose
    meaning changed); a ``--matched`` cell records its own learner, corrected for its rates."""
    cn = bench_module("citation_noise", monkeypatch)
    ran = _locomo_stubbed(cn, monkeypatch, ["26", "30", "41"])
    out = tmp_path / "cn.json"
    cn.main(["--data", str(tmp_path), "--k", "4", "--m", "2", "--seeds", "1", "--preset", "realistic", "--matched",
             "--p-useful", "0.5,0.9", "--p-other", "0.1,0.6", "--spurious", "0.1", "--json", str(out)])
    data = json.loads(out.read_text())
    assert data["config"]["preset"] == "realistic"
    base = data["config"]["setting"]
    assert base == _recorded("realistic", k=4, m=2)
    assert base["optimizer"] == {"name": "adam", "lr": 1e-4} and base["estimator"]["loss"] == "logistic"
    cells = [c for row in data["cells"] for c in row]
    for c in cells:
        r = c["rates"]
        if r["matched"]:
            assert c["setting"] == _recorded("realistic", k=4, m=2, p_useful=r["p_useful"], p_other=r["p_other"])
        else:
            assert "setting" not in c and r["p_other"] >= r["p_useful"]
    assert sum(c["rates"]["matched"] for c in cells) == 3
    want = [_as_ran(base)] * (len(data["reference"]) + len(data["spurious_sweep"])) + \
        [_as_ran(c.get("setting", base)) for c in cells]
    assert ran == want                                      # one seed: one run per cell, in the order they ran


def test_labelled_calls_records_the_learner_of_every_run(tmp_path, monkeypatch):
    """The uncorrected default (``config.setting``, ``default.setting``), the default corrected
    for the true rates (``true_rates.setting``) and each seed's learner, corrected for the rates
    it measured where ``cite-rates`` advised it (``rows[].seeds[].setting``)."""
    lc = bench_module("labelled_calls", monkeypatch)
    ran = _locomo_stubbed(lc, monkeypatch, ["26", "30", "41"])
    out = tmp_path / "lc.json"
    lc.main(["--data", str(tmp_path), "--k", "4", "--m", "2", "--seeds", "2", "--sizes", "4,400",
             "--json", str(out)])
    data = json.loads(out.read_text())
    default = _recorded("default", k=4, m=2)
    assert data["config"]["setting"] == data["default"]["setting"] == default
    assert default["estimator"]["reference"] == "retriever" and default["optimizer"]["lr"] == 3e-4
    assert data["true_rates"]["setting"] == _recorded("default", k=4, m=2, p_useful=0.9, p_other=0.3)
    seeds = [s for row in data["rows"] for s in row["seeds"]]
    for s in seeds:
        assert s["setting"] == (_recorded("default", k=4, m=2, p_useful=s["p_useful"]["value"],
                                          p_other=s["p_other"]["value"]) if s["advised"] else default)
    assert any(s["advised"] for s in seeds)
    want = [_as_ran(default)] * 2 + [_as_ran(data["true_rates"]["setting"])] * 2 + \
        [_as_ran(s["setting"]) for s in seeds if s["advised"]]
    assert ran == want


def _programs_built(module, monkeypatch) -> list:
    """The settings (:func:`_ran`) of every program ``module``'s ``make_run`` builds from now on."""
    built = []
    real = module.make_run
    monkeypatch.setattr(module, "make_run", lambda *setting, **kw: built.append(_ran(real(*setting, **kw))) or
                        real(*setting, **kw))
    return built


@pytest.mark.parametrize("preset, loss", [(None, "reinforce"), ("default", "logistic")])
def test_throughput_records_the_learner_it_times(tmp_path, monkeypatch, capsys, preset, loss):
    """``--quick``: each config's ``setting`` (and the fields the references read, with their
    algorithm), ``users_scaling_setting``: the settings of every program the run built. By
    default rmm-jax takes the references' step (reinforce); ``--preset default`` times the CLI's."""
    tp = bench_module("throughput", monkeypatch)
    built = _programs_built(tp, monkeypatch)
    out = tmp_path / "tp.json"
    tp.main(["--quick", "--no-profile", "--json", str(out), *(["--preset", preset] if preset else [])])
    data = json.loads(out.read_text())
    recorded = [c["setting"] for c in data["configs"].values()] + [data["users_scaling_setting"]]
    assert {_as_ran(r) for r in recorded} == set(built)
    for c in data["configs"].values():
        assert c["setting"] == _recorded(preset or "reinforce", kind=c["kind"], hidden=c.get("hidden"), k=c["k"],
                                         m=c["m"], batch=c["batch"], credit="reward_to_go")
        ref = c["reference_setting"]
        assert (ref["tau"], ref["lr"], ref["m"]) == (c["setting"]["estimator"]["tau"],
                                                     c["setting"]["optimizer"]["lr"], c["m"])
        assert ref["algorithm"].startswith("REINFORCE")
    assert data["users_scaling_setting"]["estimator"]["loss"] == loss


def test_scale_records_the_learner_of_every_scope(tmp_path, monkeypatch, capsys):
    """Each row's ``setting`` is its scope's learner (``--preset`` with ``--offset`` over it),
    and ``--throughput`` records one per scope it times."""
    sc = bench_module("scale", monkeypatch)
    built = _programs_built(sc, monkeypatch)
    out = tmp_path / "scale.json"
    sc.main(["--users", "2", "--queries", "4", "--dim", "8", "--rank", "2", "--chunk", "2", "--scopes", "hybrid",
             "--preset", "realistic", "--offset", "1", "--root", str(tmp_path / "root"), "--json", str(out)])
    data = json.loads(out.read_text())
    (row,) = data["rows"]
    assert row["setting"] == _recorded("realistic", k=20, m=5, scope="hybrid", rank=2, offset=1.0)
    assert row["setting"]["optimizer"]["lr"] == 1e-4 and row["setting"]["estimator"]["reference"] == "best"
    assert built == [_as_ran(row["setting"])]
    built.clear()
    monkeypatch.setattr(sc, "drive", lambda *a, **kw: iter(()))    # the settings, not the timing
    sc.main(["--throughput", "--tp-users", "2", "--repeats", "1", "--dim", "8", "--rank", "2", "--chunk", "2",
             "--json", str(out)])
    settings = json.loads(out.read_text())["throughput"]["settings"]
    assert settings == {"user": _recorded("default", k=20, m=5, scope="user"),
                        "hybrid": _recorded("default", k=20, m=5, scope="hybrid", rank=2)}
    assert sorted(built) == sorted(_as_ran(s) for s in settings.values())


@pytest.mark.parametrize("lever", ["dialogue", "dialogue_lr"])
def test_learn_sweep_dialogue_rows_record_their_learner(lever, monkeypatch):
    """learn_sweep's ``dialogue`` rows (``default [...]``, ``dialogue start + default ...``)
    named a preset only in their names: each row records its online learner (None for a frozen
    start) and the start's pretraining; the settings recorded are those of the programs that ran."""
    import numpy as np

    from rmm_jax.online.pretrain import PretrainConfig
    ls = bench_module("learn_sweep", monkeypatch)
    streams = _tiny_streams(list(ls.TUNED_ON) + ls.HELD_OUT)
    ran = []

    class Run:
        def __init__(self, streams):
            self.outputs = {s.user_id: {"recall": np.zeros(len(s.queries))} for s in streams}

    monkeypatch.setattr(ls, "run_loop", lambda streams, program, params, seed: ran.append(_ran(program)) or
                        Run(streams))
    monkeypatch.setattr(ls, "dialogue_start", lambda ctx, users, epochs, seed, **config: None)
    monkeypatch.setattr(ls._common, "frozen_recall", lambda params, s, m: np.zeros(len(s.queries)))
    monkeypatch.setattr(ls, "with_answer_support", lambda s, qa: s)
    interval = {"mean": 0.0, "lo": 0.0, "hi": 0.0, "significant": False}
    monkeypatch.setattr(ls, "gain", lambda *a: {"recall": 0.5, "gain": interval})
    monkeypatch.setattr(ls, "paired", lambda *a: interval)
    ctx = ls.Context(streams, {s.user_id: None for s in streams}, {}, {}, [0], None, [1], lambda msg: None)
    out = ls.LEVERS[lever](ctx)
    rows = out["rows"] + out.get("tuning", {}).get("rows", [])
    assert len(rows) > 10
    for r in rows:
        name, setting = r["name"], r["setting"]
        if name.endswith("frozen"):
            assert setting is None
            continue
        scope = next((sc for sc in ("shared", "hybrid") if f" {sc} [" in name), "user")
        lr = float(name.split("online lr ")[1].split(" ")[0]) if "online lr " in name else None
        assert setting == json.loads(json.dumps(_recorded(
            "realistic", k=ls.K, m=ls.M, **({} if scope == "user" else {"scope": scope}),
            **({} if lr is None else {"lr": lr})))), name
        assert setting["estimator"]["loss"] == "logistic" and setting["optimizer"]["lr"] == (lr or 1e-4), name
    for r in rows:
        if r["name"].startswith("dialogue"):
            word = r["name"].split(" ")[1]                   # "dialogue 5 ep ...": the tuning's epochs
            epochs = (int(word) if word.isdigit() else out["tuning"]["chosen_epochs"] if lever == "dialogue"
                      else ls.DIALOGUE_RECIPE.epochs)
            assert r["pretrain"]["epochs"] == epochs and r["pretrain"]["labels"] == "dialogue", r["name"]
            assert r["pretrain"]["lr"] == PretrainConfig().lr and "val_fraction" not in r["pretrain"]
        else:
            assert "pretrain" not in r
    assert set(ran) == {_as_ran(r["setting"]) for r in rows if r["setting"] is not None}
