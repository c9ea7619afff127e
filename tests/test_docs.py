"""Docs that cannot go stale: every command and example in README.md and docs/*.md runs.

* Every shell block (```bash, ```sh, ```console: its ``$ `` lines) runs with ``bash -e`` in one
  temporary workspace per page, in page order, with ``examples/`` copied in and ``rmm-jax`` on
  the PATH: a page's blocks build on each other as a reader's would.
* A ```console block's other lines are the output a reader relies on, and are checked
  (:func:`expected_output`, :func:`missing_lines`): each must appear in the commands' output
  (stdout and stderr), in order, with runs of spaces equal and ``...`` standing for any text.
* Every ```python block runs, in the same workspace, after the page's blocks above it.
* A marker on the line before a block changes that:
  ``<!-- test: ci-only -->`` runs it only under ``CI=true`` (LoCoMo, or more than seconds);
  ``<!-- test: skip (reason) -->`` never runs it (multi-host commands, ``make`` itself);
  ``<!-- test: write FILE -->`` writes the block to FILE in the workspace (a schema example
  a later command reads).
* Every ``{{ results_table(...) }}`` and ``{{ result(...) }}`` marker renders from its
  result file (``docs/hooks.py``, the mkdocs hook) and names the file.
* The README's headline table is plain markdown: each of its numbers is checked against the
  result file and key listed in ``HEADLINE`` below, formatted as the hook formats it.
"""
from __future__ import annotations

import importlib.util
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import NamedTuple

import pytest
from conftest import REPO

PAGES = [REPO / "README.md"] + sorted((REPO / "docs").glob("*.md"))
SHELL, PYTHON = {"bash", "sh", "shell", "console"}, {"python", "py"}
FENCE = re.compile(r"^(```|~~~)\s*([\w+-]*)")
MARK = re.compile(r"^<!--\s*test:\s*(.*?)\s*-->$")
CI = os.environ.get("CI") == "true"
TAIL = 3000  # characters of a failing block's output in the report


class Block(NamedTuple):
    page: Path
    line: int      # 1-based line of the opening fence
    lang: str
    text: str
    mode: str      # run | ci-only | skip | write
    arg: str       # the skip reason or the file to write


def parse(path: Path) -> list[Block]:
    """The fenced blocks of a markdown page with the test marker before each (if any)."""
    lines, out, i = path.read_text().splitlines(), [], 0
    while i < len(lines):
        m = FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        start, fence, lang = i, m.group(1), m.group(2).lower()
        j = i + 1
        while j < len(lines) and not lines[j].startswith(fence):
            j += 1
        prev = next((lines[k].strip() for k in range(start - 1, -1, -1) if lines[k].strip()), "")
        mark = MARK.match(prev)
        mode, arg = "run", ""
        if mark:
            word, _, rest = mark.group(1).partition(" ")
            mode, arg = word, rest.strip()
        out.append(Block(path, start + 1, lang, "\n".join(lines[start + 1:j]) + "\n", mode, arg))
        i = j + 1
    return out


def name(b: Block) -> str:
    return f"{b.page.relative_to(REPO)}:{b.line}"


BLOCKS = [b for p in PAGES for b in parse(p)]
RUNNABLE = [b for b in BLOCKS if b.lang in SHELL | PYTHON or b.mode == "write"]


def test_markers_are_well_formed():
    """Every marker is one this file knows, sits right above a block, and a skip says why."""
    for page in PAGES:
        lines = page.read_text().splitlines()
        for n, line in enumerate(lines):
            m = MARK.match(line.strip())
            if not m:
                continue
            where = f"{page.relative_to(REPO)}:{n + 1}"
            word, _, rest = m.group(1).partition(" ")
            assert word in ("ci-only", "skip", "write"), f"{where}: unknown marker {word!r}"
            assert word != "skip" or re.fullmatch(r"\(.+\)", rest.strip()), f"{where}: skip needs a (reason)"
            assert word != "write" or rest.strip(), f"{where}: write needs a file name"
            nxt = next((x for x in lines[n + 1:] if x.strip()), "")
            assert FENCE.match(nxt), f"{where}: a marker must stand right above a fenced block"
    assert any(b.lang in SHELL for b in BLOCKS) and any(b.page.name == "README.md" for b in RUNNABLE)


# ------------------------------------------------------------------------- running the blocks

class Workspace:
    """One page's temporary directory; runs the page's blocks in order, each at most once."""

    def __init__(self, root: Path, page: Path):
        self.root, self.page, self.done, self.failed = root, page, set(), None
        shutil.copytree(REPO / "examples", root / "examples")
        bindir = str(Path(sys.executable).parent)
        self.env = {**os.environ, "PATH": bindir + os.pathsep + os.environ.get("PATH", ""),
                    "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""),
                    "RMM_LOCOMO_DIR": os.environ.get("RMM_LOCOMO_DIR") or str(REPO.parent / "shared" / "data"
                                                                              / "locomo"),
                    "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "MPLBACKEND": "Agg"}

    def run(self, block: Block) -> None:
        if block.line in self.done:
            return
        self.done.add(block.line)
        if block.mode == "write":
            (self.root / block.arg).write_text(block.text)
        elif block.lang in PYTHON:
            self._python(block)
        else:
            self._shell(block)

    def _shell(self, block: Block) -> None:
        text, want = block.text, []
        if block.lang == "console":
            text, want = expected_output(text)
        proc = subprocess.run(["bash", "-e", "-o", "pipefail", "-c", text], cwd=self.root, env=self.env,
                              capture_output=True, text=True)
        out = proc.stdout + proc.stderr
        if proc.returncode:
            raise AssertionError(f"{name(block)}: exit {proc.returncode}\n{text}\n--- output (tail) ---\n{out[-TAIL:]}")
        missing = missing_lines(want, out)
        if missing:
            raise AssertionError(f"{name(block)}: the output lacks, in order, {missing[0]!r}\n{text}\n"
                                 f"--- output (tail) ---\n{out[-TAIL:]}")

    def _python(self, block: Block) -> None:
        here = os.getcwd()
        os.chdir(self.root)
        try:
            exec(compile(block.text, name(block), "exec"), {"__name__": "__docs__"})
        finally:
            os.chdir(here)


def expected_output(block_text: str) -> tuple[str, list[str]]:
    """``(script, expected lines)`` of a console block: ``$ `` lines are commands (a command
    line ending in a backslash continues on the next line), every other non-blank line is
    output the reader relies on."""
    script, want, cont = [], [], False
    for line in block_text.splitlines():
        if cont or line.startswith("$ "):
            script.append(line if cont else line[2:])
            cont = line.rstrip().endswith("\\")
        elif line.strip():
            want.append(line)
    return "\n".join(script) + "\n", want


def _normal(line: str) -> str:
    return " ".join(line.split())


def missing_lines(want: list[str], output: str) -> list[str]:
    """The expected lines from the first one not found on: each must match a whole line of
    ``output`` after the previous match, runs of whitespace equal and ``...`` matching any
    text (a line of only ``...`` matches anything, so it only marks an elision)."""
    lines = [_normal(x) for x in output.splitlines()]
    i = 0
    for n, w in enumerate(want):
        if _normal(w) == "...":
            continue
        pattern = re.compile(".*".join(re.escape(part) for part in _normal(w).split("...")))
        while i < len(lines) and not pattern.fullmatch(lines[i]):
            i += 1
        if i == len(lines):
            return want[n:]
        i += 1
    return []


def test_console_output_is_checked_in_order_with_ellipses():
    """A console block's expected lines are found in order, spaces and ``...`` as documented,
    and a wrong, missing or reordered line is reported."""
    script, want = expected_output("$ echo a \\\n  b\nout  1\n...\n$ true\nend... 3\n")
    assert script == "echo a \\\n  b\ntrue\n" and want == ["out  1", "...", "end... 3"]
    out = "noise\nout 1\nmore\nend: 0.25 of 3\n"
    assert missing_lines(want, out) == []
    assert missing_lines(["end... 3", "out 1"], out) == ["out 1"]            # order matters
    assert missing_lines(["out 2"], out) == ["out 2"]                          # exact text
    assert missing_lines(["out"], out) == ["out"]                              # whole lines, not parts
    assert missing_lines(["...of 3"], out) == []


@pytest.fixture(scope="module")
def workspaces(tmp_path_factory):
    made = {}

    def get(page: Path) -> Workspace:
        if page not in made:
            made[page] = Workspace(tmp_path_factory.mktemp(page.stem.lower()), page)
        return made[page]
    return get


def _runs(b: Block) -> bool:
    return b.mode in ("run", "write") or (b.mode == "ci-only" and CI)


@pytest.mark.parametrize("block", RUNNABLE, ids=name)
def test_block_runs(block, workspaces):
    if block.mode == "skip":
        pytest.skip(f"marked skip {block.arg}")
    if block.mode == "ci-only" and not CI:
        pytest.skip("marked ci-only: runs when CI=true")
    ws = workspaces(block.page)
    if ws.failed:
        pytest.fail(f"an earlier block of this page failed: {ws.failed}")
    earlier = [b for b in RUNNABLE if b.page == block.page and b.line < block.line and _runs(b)]
    try:
        for b in earlier + [block]:   # a block selected alone still gets what the page built before it
            ws.run(b)
    except BaseException:
        ws.failed = name(block)
        raise


# ------------------------------------------------------------------------- result tables

def _hooks():
    spec = importlib.util.spec_from_file_location("docs_hooks", REPO / "docs" / "hooks.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.parametrize("page", [p for p in PAGES if p.parent.name == "docs"], ids=lambda p: p.name)
def test_result_markers_render(page):
    """Every marker of a docs page renders from a file that holds its keys, under a caption
    that names the file; none is left unexpanded."""
    hooks, text = _hooks(), page.read_text()
    out = hooks.render(text, page.name)
    assert "{{" not in out, f"{page.name}: a marker was not expanded"
    for m in re.finditer(r'results_table\(\s*"([^"]+)"', text):
        if (hooks.RESULTS / m.group(1)).is_file():
            assert f"benchmarks/results/{m.group(1)}`](results/{m.group(1)})" in out
        else:
            assert f"`benchmarks/results/{m.group(1)}` is not in this checkout yet" in out


# Cited result files written before write_result recorded whether the tree was clean (their
# provenance has a commit, or nothing). Re-running one from a clean tree removes it from
# this set (the test below then insists that it be removed): the set only shrinks.
BEFORE_CLEAN_FLAG = frozenset({"learn_sweep_heldout_first.json"})


def cited_results() -> set[str]:
    """The result files (JSON) that the README and the docs pages cite, by link or marker."""
    names = set()
    for page in PAGES:
        text = page.read_text()
        names |= set(re.findall(r"results/([A-Za-z0-9_.-]+\.json)", text))
        names |= set(re.findall(r'result(?:s_table)?\(\s*"([^"]+\.json)"', text))
    return names


def test_cited_results_come_from_a_clean_tree():
    """A result file the README or a page cites records the commit that wrote it and a clean
    tree ("clean": true); one from uncommitted code ("clean": false) fails. Files from before
    the flag existed are named in BEFORE_CLEAN_FLAG, which may only lose names."""
    import json

    hooks = _hooks()
    dirty, unflagged, stale = [], [], []
    for name in sorted(cited_results()):
        path = hooks.RESULTS / name
        if not path.is_file():
            continue                        # test_result_markers_render says how a missing file renders
        prov = json.loads(path.read_text()).get("provenance") or {}
        if prov.get("clean") is False:
            dirty.append(f"{name} (commit {prov.get('commit')}, uncommitted {prov.get('uncommitted', [])[:3]})")
        elif "clean" not in prov and name not in BEFORE_CLEAN_FLAG:
            unflagged.append(name)
        elif "clean" in prov and name in BEFORE_CLEAN_FLAG:
            stale.append(name)
    assert not dirty, f"cited result files written from uncommitted code: {dirty}"
    assert not unflagged, f"cited result files that do not record whether the tree was clean: {unflagged}"
    assert not stale, f"re-run from a clean tree: remove from BEFORE_CLEAN_FLAG: {stale}"


def test_a_dirty_result_file_is_caught(tmp_path, monkeypatch):
    """The check above on a hand-made results folder: "clean": false fails, true passes."""
    import json

    hooks = _hooks()
    monkeypatch.setattr(hooks, "RESULTS", tmp_path)
    monkeypatch.setattr(sys.modules[__name__], "_hooks", lambda: hooks)
    name = next(iter(sorted(cited_results() - BEFORE_CLEAN_FLAG)))
    for clean, fails in ((True, False), (False, True)):
        (tmp_path / name).write_text(json.dumps({"provenance": {"commit": "abc1234", "clean": clean}}))
        if fails:
            with pytest.raises(AssertionError, match="uncommitted code"):
                test_cited_results_come_from_a_clean_tree()
        else:
            test_cited_results_come_from_a_clean_tree()


def test_hook_formats_and_refuses():
    """The hook's cells on hand-made rows, and a missing key fails rather than print."""
    h = _hooks()
    assert h.fmt({"mean": 0.04, "lo": 0.012, "hi": 0.068}, "interval") == "+0.040 [+0.012, +0.068]"
    assert h.fmt({"mean": 0.01, "lo": -0.01, "hi": 0.03}, "interval") == "+0.010 [-0.010, +0.030], n.s."
    assert h.fmt({"median": 5.4765, "min": 5.0322, "max": 5.5214}, "ratio:.2f") == "5.48× [5.03, 5.52]"
    assert h.fmt(1387.9, ",.0f") == "1,388" and h.fmt(True, "pass") == "met"
    assert h.get({"a": [{"b": 1}]}, "a.0.b") == 1 and h.get({"a": 1}, "b?") is h.MISSING
    with pytest.raises(h.ResultError, match="no key 'c'"):
        h.get({"a": {"b": 1}}, "a.c")
    rows = {"r": [{"name": "x", "v": 1}, {"name": "y + z", "v": 2}, {"name": "w", "v": 3}, {"name": "w", "v": 4}]}
    assert h.get(rows, "r.name=y + z.v") == 2 and h.get(rows, "r.name=x.v") == 1
    for bad in ("r.name=w.v", "r.name=q.v"):            # two rows, or none: an error, not a guess
        with pytest.raises(h.ResultError, match="no key 'name="):
            h.get(rows, bad)
    assert h.command_of({"provenance": {"command": "python x.py"}}) == "python x.py"
    assert h.command_of({"runs": [{"provenance": {"command": "python y.py"}}]}) == "python y.py"


def test_a_docs_figure_copied_from_a_result_is_the_committed_result():
    """docs/img holds copies of some result plots (mkdocs serves only docs/): each copy is
    byte-for-byte the file under benchmarks/results, so a re-run benchmark cannot leave the
    site showing its old figure."""
    copies = [p for p in (REPO / "docs" / "img").glob("*.png") if (REPO / "benchmarks" / "results" / p.name).exists()]
    assert {p.name for p in copies} >= {"sharing.png", "nights.png"}
    stale = [p.name for p in copies if p.read_bytes() != (REPO / "benchmarks" / "results" / p.name).read_bytes()]
    assert not stale, f"docs/img copies that differ from benchmarks/results: {stale} (copy them over)"


# ------------------------------------------------------------------------- the README's headline table

# README row (the cell under "measure") → (the text of its "result" cell with a {} for each
# number, the numbers: result file, key path, format as the hook formats it). A path segment
# "name=X" picks the element of a list whose "name" is X. The test renders the cell and
# compares it whole, so a swapped or stale number fails; after a benchmark is re-run, update
# the README until this passes (the failure prints the expected cell).
HEADLINE = {
    "Recall@5 gain, held-out LoCoMo, online from the retriever, default preset": (
        "{}", [("learn_sweep_heldout.json", "rows.name=anchored.gain", "interval")]),
    "The same under the other citation models: precision/recall; answer": (
        "{}; {}", [("learn_sweep_heldout.json", "rows.name=anchored [precision_recall].gain", "interval"),
                   ("learn_sweep_heldout.json", "rows.name=anchored [answer].gain", "interval")]),
    "`--preset calibrated` (`realistic` corrected for the judge's rates, at lr 2e-4 in scope user) minus "
    "`--preset realistic`, held-out, paired: class-calibrated; precision/recall; answer": (
        "{}; {}; {}", [("learn_sweep_heldout.json", f"pairs.{i}.a_minus_b", "interval") for i in range(3)]),
    "A generator that cites 90% of the useful memories shown and 30% of the others: held-out gain of the default "
    "corrected for those rates (`--p-useful 0.9 --p-other 0.3`, what `cite-rates` advises there); uncorrected": (
        "{}; {}", [("citation_noise_default_matched.json", "cells.6.3.held_out", "interval"),
                   ("citation_noise.json", "cells.6.3.held_out", "interval")]),
    "The same generator, its rates measured by `rmm-jax cite-rates` on 100 labelled calls and the advice taken: "
    "held-out gain; minus the default, paired": (
        "{}; {}", [("labelled_calls.json", "rows.2.gain", "interval"),          # rows: N = 25, 50, 100, ...
                   ("labelled_calls.json", "rows.2.over_default", "interval")]),
    "Hybrid minus user, held-out LoCoMo, paired: the default; `realistic`": (
        "{}; {}", [("learn_sweep_heldout.json", "pairs.36.a_minus_b", "interval"),     # anchored hybrid − anchored
                   ("learn_sweep_heldout.json", "pairs.9.a_minus_b", "interval")]),    # default hybrid − default
    "The default (each logit against the retriever's best score: scores stay bounded) minus `--preset realistic` "
    "(against the policy's own best, lr 1e-4: the default until stop 52), held-out, paired: class-calibrated; "
    "precision/recall; answer; hybrid": (
        "{}; {}; {}; {}", [("learn_sweep_heldout.json", f"pairs.{i}.a_minus_b", "interval")     # anchored − default
                           for i in (31, 32, 33, 35)]),
    "`--preset anchored_calibrated` (the default corrected for the paper's judge, chosen over LoCoMo 26+30 and two "
    "synthetic populations) minus the default, held-out, paired: class-calibrated; answer; gain on 1,000 synthetic "
    "vector users in hybrid under precision/recall citations (3 seeds), it and the default": (
        "{}; {}; {}; {}", [("learn_sweep_heldout.json", "pairs.40.a_minus_b", "interval"),
                           ("learn_sweep_heldout.json", "pairs.42.a_minus_b", "interval"),
                           ("defaults_sweep_populations.json", "rows.name=anchored calibrated offset -1 lr 3e-4.cells."
                            "vectors, 100 questions/precision_recall/hybrid.gain", "interval"),
                           ("defaults_sweep_populations.json", "rows.name=anchored offset 2 lr 3e-4.cells."
                            "vectors, 100 questions/precision_recall/hybrid.gain", "interval")]),
    "300 synthetic users asking again for 8 nights (3 seeds), Recall@5 gain on night 8: `realistic` in hybrid; the "
    "default in hybrid": (
        "{}; {}", [("nights.json", "cells.realistic/hybrid.nights.-1.gain", "interval"),
                   ("nights.json", "cells.anchored/hybrid.nights.-1.gain", "interval")]),
    "Recall@5 gain, held-out LoCoMo, gold pretrain + online, default preset": (
        "{}", [("learn_sweep_heldout.json", "rows.name=gold pretrain + anchored online.gain", "interval")]),
    "Recall@5 gain, held-out LoCoMo, a start pretrained on the users' own dialogue (`pretrain --labels dialogue`, "
    "no gold) + online under `realistic`: class-calibrated; precision/recall; answer": (
        "{}; {}; {}", [("learn_sweep_dialogue.json", f"rows.name=dialogue start + default [{cm}].held_out.gain",
                        "interval") for cm in ("oracle", "precision_recall", "answer")]),
    "The same minus `realistic` online from the retriever, held-out, paired: class-calibrated; precision/recall; "
    "answer": (
        "{}; {}; {}", [("learn_sweep_dialogue.json", f"pairs.{i}.held_out", "interval") for i in range(3)]),
    "The same reranker learning online from complete labels (every candidate's gold) instead of citations, "
    "held-out: lr 1e-4; lr 3e-4": (
        "{}; {}", [("learn_sweep_bound.json", "rows.6.held_out.gain", "interval"),   # full information user 1e-4
                   ("learn_sweep_bound.json", "rows.7.held_out.gain", "interval")]),      # ... and 3e-4
    "LoCoMo deployment, nightly learning, Recall@5 of: what `rerank --explore` drew and showed; the policy's own "
    "top 5; the retriever": (
        "{}; {}; {}", [("deploy.json", "final.recall@5_served", ".3f"), ("deploy.json", "final.recall@5", ".3f"),
                       ("deploy.json", "final.recall@5_retriever", ".3f")]),
    "Drawing the shown memories at 0.02 or 0.01 instead of τ (`--draw-tau`) under `realistic`, held-out, paired "
    "with it at τ: the policy's top-5 gain; what the generator was shown": (
        "0.02: {}; {}. 0.01: {}; {}", [("learn_sweep_heldout.json", "pairs.19.a_minus_b", "interval"),  # draw tau 0.02
                                       ("learn_sweep_heldout.json", "pairs.19.shown_a_minus_b", "interval"),
                                       ("learn_sweep_heldout.json", "pairs.25.a_minus_b", "interval"),  # draw tau 0.01
                                       ("learn_sweep_heldout.json", "pairs.25.shown_a_minus_b", "interval")]),
    "The same deployment drawn at 0.02 or 0.01: what was drawn and shown; the policy's own top 5; days `evaluate` "
    "withheld SNIPS": (
        "0.02: {}; {}; {} of {}. 0.01: {}; {}; {} of {} ({} drawn at τ)", [
            ("deploy_draw.json", "final.recall@5_served", ".3f"), ("deploy_draw.json", "final.recall@5", ".3f"),
            ("deploy_draw.json", "ope_coverage.tomorrow.snips.withheld", ""),
            ("deploy_draw.json", "ope_coverage.tomorrow.snips.days", ""),
            ("deploy_draw_001.json", "final.recall@5_served", ".3f"), ("deploy_draw_001.json", "final.recall@5", ".3f"),
            ("deploy_draw_001.json", "ope_coverage.tomorrow.snips.withheld", ""),
            ("deploy_draw_001.json", "ope_coverage.tomorrow.snips.days", ""),
            ("deploy.json", "ope_coverage.tomorrow.snips.withheld", "")]),
    "Against Vowpal Wabbit (online, Recall@5 difference, all five conversations: the default; `realistic`; the "
    "default's speed)": (
        "{}; {}; {} the queries/s", [("peer_vw_anchored.json", "ratios.oracle.rmm_jax_minus_vw_all", "interval"),
                                     ("peer_vw.json", "ratios.oracle.rmm_jax_minus_vw_all", "interval"),
                                     ("peer_vw_anchored.json", "ratios.oracle.rmm_jax_over_vw_queries_per_s",
                                      "ratio:.0f")]),
    "Against VW with a dialogue start (both from the same pairs, class-calibrated, all five conversations): "
    "the default from its start minus VW from zero; minus VW from the same start": (
        "{}; {}", [("peer_vw_anchored.json", "ratios.oracle.rmm_jax_dialogue_minus_vw_all", "interval"),
                   ("peer_vw_anchored.json", "ratios.oracle.rmm_jax_dialogue_minus_vw_dialogue_all", "interval")]),
    "Off-policy estimates: coverage of the 95% interval (SNIPS, cited)": (
        "logging policy fixed {}, {} seeds of {} withheld, {} counting them as misses; "
        "adaptive {}, {} withheld, {} counting them as misses", [
            ("ope_validation.json", "scenarios.fixed.summary.cited.snips.coverage", ".2f"),
            ("ope_validation.json", "scenarios.fixed.summary.cited.snips.withheld", ""),
            ("ope_validation.json", "setup.seeds", ""),
            ("ope_validation.json", "scenarios.fixed.summary.cited.snips.coverage_all", ".2f"),
            ("ope_validation.json", "scenarios.adaptive.summary.cited.snips.coverage", ".2f"),
            ("ope_validation.json", "scenarios.adaptive.summary.cited.snips.withheld", ""),
            ("ope_validation.json", "scenarios.adaptive.summary.cited.snips.coverage_all", ".2f")]),
    "Throughput, one user, paper shapes, the same REINFORCE step: rmm-jax / torch.compile": (
        "{}", [("throughput.json", "configs.paper.ratios.vs_torch_compile", "ratio:.1f")]),
    "Sharing, synthetic users, the default (3 seeds): Recall@5 gain of 1,000 learning side by side in hybrid; of "
    "each alone; a newcomer after 900, hybrid minus a fresh policy": (
        "{}; {}; {}", [("sharing_curves_anchored.json", "curves.synthetic.hybrid/1000.gain", "interval"),
                       ("sharing_curves_anchored.json", "curves.synthetic.user/1.gain", "interval"),
                       ("sharing_late_anchored.json", "late.synthetic/900.over_fresh_user.hybrid", "interval")]),
    "100,000 users × 100 queries, scope hybrid: wall time; peak memory; prequential Recall@5": (
        "{} s; {} MiB; {}", [("scale_100k.json", "rows.0.seconds", ",.0f"), ("scale_100k.json", "peak_rss_mb", ",.0f"),
                             ("scale_100k.json", "rows.0.prequential_recall@5", ".3f")]),
    "Serving from a 100,000-user hybrid store: one query, p50 of a user not cached, its row read from disk; cached": (
        "{} ms; {} ms",
        [("serve.json", "cold_disk_p50_ms.median", ".1f"), ("serve.json", "warm_p50_ms.median", ".2f")]),
}


def _headline_table() -> tuple[list[str], dict[str, dict[str, str]]]:
    """The README's headline table: its column names, and each row's cells by column name,
    keyed by the row's first cell."""
    lines = (REPO / "README.md").read_text().splitlines()
    start = next(i for i, x in enumerate(lines) if x.strip() == "<!-- headline: tests/test_docs.py -->")
    first = next(i for i in range(start + 1, len(lines)) if lines[i].startswith("|"))
    end = next((i for i in range(first, len(lines)) if not lines[i].startswith("|")), len(lines))
    split = lambda x: [c.strip() for c in x.strip().strip("|").split("|")]  # noqa: E731
    header = split(lines[first])
    rows = {}
    for x in lines[first + 2:end]:   # the header and the --- line aside
        cells = split(x)
        rows[cells[0]] = dict(zip(header, cells))
    return header, rows


def _pick(data, path: str):
    """The hook's ``get``, where a segment ``name=X`` selects the list element named X."""
    node = data
    for seg in path.split("."):
        key, eq, want = seg.partition("=")
        if eq and isinstance(node, list):
            hits = [x for x in node if isinstance(x, dict) and x.get(key) == want]
            assert len(hits) == 1, f"{path}: {len(hits)} elements with {key}={want!r}"
            node = hits[0]
        else:
            node = _hooks().get(node, [seg])
    return node


def test_readme_headline_numbers_are_the_files():
    """Every "result" cell of the README's headline table is its template filled with its
    files' numbers, as the hook formats them, compared whole (so a stale or swapped number
    fails), and the row's "from" cell links those files."""
    h, (header, rows) = _hooks(), _headline_table()
    assert {"measure", "result", "from"} <= set(header), header
    assert _pick(h.load("labelled_calls.json"), "rows.2.labelled_calls") == 100     # the row its label names
    assert set(HEADLINE) <= set(rows), sorted(set(HEADLINE) - set(rows))
    wrong = []   # every stale cell at once, so one run tells what to write
    for label, (template, sources) in HEADLINE.items():
        want = template.format(*(h.fmt(_pick(h.load(file), path), spec, file) for file, path, spec in sources))
        if rows[label]["result"] != want:
            wrong.append(f"{label!r}: the result cell should read {want!r}, it reads {rows[label]['result']!r}")
        for file in {f for f, _, _ in sources}:
            if f"benchmarks/results/{file}" not in rows[label]["from"]:
                wrong.append(f"{label!r}: the from cell does not link {file}")
    assert not wrong, "README headline:\n" + "\n".join(wrong)
    extra = sorted(set(rows) - set(HEADLINE))
    assert not extra, f"headline rows without a source in HEADLINE: {extra}"


def test_readme_links_resolve():
    """Every relative link of the README names a file of the repository (the site checks its own)."""
    text = (REPO / "README.md").read_text()
    links = re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", text)
    local = [x for x in links if "://" not in x]
    assert local, "the README links no file"
    missing = [x for x in local if not (REPO / x).exists()]
    assert not missing, f"README links missing files: {missing}"


def test_readme_is_a_quickstart():
    """The README stays short, starts with the two make targets, and lists every page of the site."""
    text = (REPO / "README.md").read_text()
    assert len(text.splitlines()) <= 200
    first = next(b for b in parse(REPO / "README.md") if b.lang in SHELL)
    assert [x.split("#")[0].strip() for x in first.text.splitlines() if x.strip()] == ["make demo", "make test"]
    pages = sorted(p.name for p in (REPO / "docs").glob("*.md"))
    assert pages and all(f"(docs/{p})" in text for p in pages), "a page of the site the README does not list"


# ------------------------------------------------------------------------- the README's production day

def test_running_a_walkthrough_day_twice_changes_nothing(tmp_path, monkeypatch, capsys):
    """The README's second day (the night's replay of day 1's log, then day 2's serving) run
    twice: the policy store is bit for bit the same and the served file byte for byte (the
    replay learns nothing twice, and the same policies serve the same draws). Run in process."""
    import shlex

    from conftest import run_cli

    days = [b for b in parse(REPO / "README.md") if b.lang == "console" and "--explore" in b.text]
    assert len(days) == 2 and "requests_day1" in days[0].text and "calls_day1" in days[1].text
    shutil.copytree(REPO / "examples", tmp_path / "examples")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("MPLBACKEND", "Agg")

    def run(block):
        for cmd in expected_output(block.text)[0].splitlines():
            words = shlex.split(cmd)
            assert words[0] == "rmm-jax", cmd
            code, _, err = run_cli(capsys, *words[1:])
            assert code == 0, f"{cmd}\n{err}"

    def state() -> dict:
        files = sorted(p for p in (tmp_path / "policies").rglob("*") if p.is_file() and p.name != ".lock")
        return {**{str(p.relative_to(tmp_path)): p.read_bytes() for p in files},
                "served": (tmp_path / "served_day2.jsonl").read_bytes()}

    run(days[0])
    run(days[1])
    before = state()
    run(days[1])
    after = state()
    assert after.keys() == before.keys() and all(after[k] == before[k] for k in before), \
        [k for k in before if after.get(k) != before[k]]


def test_the_verbs_table_names_every_verb():
    """docs/index.md's table of verbs lists every command the CLI has (it had left out
    cite-rates, policies rollback and version)."""
    import click

    from rmm_jax.cli.main import cli, register_commands
    register_commands()
    verbs = []
    for name, cmd in cli.commands.items():
        subs = cmd.commands if isinstance(cmd, click.Group) else {}
        verbs += [f"{name} {sub}" for sub in subs] or [name]
    rows = [line for line in (REPO / "docs" / "index.md").read_text().splitlines() if line.startswith("| `")]
    named = " ".join(row.split("|")[1] for row in rows)
    missing = [v for v in verbs if not re.search(rf"`{v.split()[0]}[ `]", named)
               or (" " in v and v.split()[1] not in named)]
    assert not missing, missing
