"""What every benchmark shares: where LoCoMo is, what happens when it is absent, how a
result file is written, and how spread and uncertainty are summarised.

Scripts run as ``python benchmarks/NAME.py``, so Python puts this folder first on
``sys.path`` and ``import _common`` works without touching it; ``rmm_jax`` is the installed
package. No benchmark imports another: what two of them need lives here.

* :class:`HelpFormatter`: the docstring as written and every default in ``--help``.
* :func:`locomo_dir` / :func:`add_data_option`: ``--data`` (default ``$RMM_LOCOMO_DIR``, else
  ``../shared/data/locomo`` beside the repository), and :func:`require_data`: absent data
  is a skip with the reason (exit 0), except under ``CI=true`` where it fails (exit 1).
* :func:`locomo_streams`: the one LoCoMo store builder (granularity, model, and
  ``answers=`` for the question + answer embeddings of ``embed --answers``), and
  :data:`TUNED_ON`: the conversations the defaults were tuned on (the rest are held out).
* :func:`synthetic_population`: the synthetic users of :data:`SYNTHETIC` (``sharing``, ``nights``).
* :func:`citation_model`: the ``--citations`` choices (:data:`CITATIONS`), as cite functions.
* :func:`online_recall`: the one call of the online loop the LoCoMo benchmarks make (every
  stream side by side in one chunk, per-query prequential Recall@M back).
* :func:`frozen_recall` / :func:`retriever_recall`: per-query Recall@M of a fixed reranker,
  and of the retriever's own order (the baseline of every gain); :func:`recall_at`: one
  query's, from whether each shown memory is gold.
* :func:`pooled` / :func:`query_groups`: per-query values of the valid queries of some
  users, side by side, and which user (conversation) each belongs to, for
  :func:`gain_interval`'s ``groups``; :func:`paired_gain`: the interval of one run's values
  minus another's (or a baseline's) on the same queries and seeds, and :func:`pooled_gain`:
  a run's recall and its gain over the base.
* :func:`write_result`: the JSON artifact under ``benchmarks/results/``, written atomically,
  with the command line, date, commit, whether the tree was clean, and machine that produced
  it; refused from a tree with uncommitted changes (:func:`uncommitted`).
* :func:`timed`: wall seconds of one call, its JAX result waited for; :func:`peak_rss_mib`:
  peak resident memory, of this process or a child. :func:`spread`: median,
  min and max of per-repeat values (timings: medians of interleaved repeats).
  :class:`LoadWatch`: the load average around a timing, and whether it was too busy to trust
  (``noisy``). :func:`gain_interval` / :func:`format_interval`: a gain's 95%
  interval, re-exported from :mod:`rmm_jax.online.stats` (the one interval function).
"""
from __future__ import annotations

import argparse
import contextlib
import copy
import dataclasses
import datetime
import json
import os
import platform
import resource
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import NamedTuple, Sequence

import jax
import numpy as np

from rmm_jax.data import citations as cm
from rmm_jax.data import load_locomo
from rmm_jax.data.embed import Embedder
from rmm_jax.data.store import open_store, write_store
from rmm_jax.online.driver import ChunkDone, drive
from rmm_jax.online.pretrain import eval_per_query
from rmm_jax.online.run import run_online
from rmm_jax.online.stats import format_interval, gain_interval  # noqa: F401  (re-exported)
from rmm_jax.online.streams import Stream, load_dialogue_streams, load_streams, with_answer_support
from rmm_jax.online.summary import base_values
from rmm_jax.persist.atomic import write_json

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
RESULTS = HERE / "results"
DATA_ENV = "RMM_LOCOMO_DIR"
CITATIONS = ("oracle", "precision_recall", "answer")
MODEL = "all-MiniLM-L6-v2"       # the packaged offline model (rmm_jax.data.embed.DEFAULT_MODEL)
TUNED_ON = ("26", "30")          # the LoCoMo conversations the defaults were chosen on; the rest are held out


class HelpFormatter(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
    """``--help`` keeps the module docstring's layout and shows every option's default: also
    of an option without a help text (argparse's formatter shows none there), and once (not
    again after a help text that states it)."""

    def _format_action(self, action):
        if not action.help and action.option_strings and action.default not in (None, False, argparse.SUPPRESS):
            action = copy.copy(action)
            action.help = "(default: %(default)s)"
        return super()._format_action(action)

    def _get_help_string(self, action):
        if "default" in (action.help or "").lower():
            return action.help
        return super()._get_help_string(action)

    def format_help(self) -> str:
        """The help, then the command that wrote each committed result of this script (the
        parser's ``prog`` is the script's file name): the README and docs cite those files.
        A usage error's usage (argparse formats it with this method too) stays the usage."""
        runs = committed_runs(self._prog)
        text = super().format_help()
        if runs and len(self._root_section.items) > 1:     # not the usage alone (a usage error's)
            text += ("\ncommitted results (benchmarks/results/) and the commands that wrote them, with how long "
                     "each took where the file records it:\n"
                     + "".join(f"  {name}: {command}\n" + (f"    took {took}\n" if took else "")
                               for name, command, took in runs))
        return text


def committed_runs(script: str) -> list[tuple[str, str, str | None]]:
    """``(result file, command, took)`` of each committed result whose provenance command
    runs benchmarks/``script`` (a file name such as ``throughput.py``); ``took``: the run's
    wall time (the file's ``seconds``) and the CPUs of the machine that ran it, else None."""
    out = []
    for f in sorted(RESULTS.glob("*.json")):
        try:
            data = json.loads(f.read_text())
            command = data["provenance"]["command"]
        except (OSError, ValueError, KeyError, TypeError):
            continue
        words = command.split()
        if len(words) > 1 and Path(words[1]).name == script:
            out.append((f.name, command, took(data)))
    return out


def took(data: dict) -> str | None:
    """How long the run that wrote a result took, from its ``seconds`` and its provenance's
    ``machine.cpus``: "about 3 min on 2 CPUs"; None when the file records no ``seconds``, or
    is one CLI verb's JSON (a top-level ``command``: its ``seconds`` are that verb's, not the run's)."""
    seconds = data.get("seconds")
    if not isinstance(seconds, (int, float)) or isinstance(seconds, bool) or "command" in data:
        return None
    if seconds < 90:
        text = f"about {max(1, round(seconds))} s"
    elif seconds < 90 * 60:
        text = f"about {round(seconds / 60)} min"
    else:
        text = f"about {seconds / 3600:.1f} h"
    cpus = ((data.get("provenance") or {}).get("machine") or {}).get("cpus")
    return f"{text} on {cpus} CPUs" if cpus else text


def positive_int(text: str) -> int:
    """An argparse ``type``: an int >= 1 (a count, a size), else a one-line usage error."""
    try:
        n = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be an int >= 1, got {text!r}") from None
    if n < 1:
        raise argparse.ArgumentTypeError(f"must be an int >= 1, got {text!r}")
    return n


def int_list(text: str) -> list[int]:
    """An argparse ``type``: comma-separated ints >= 0 (seeds), at least one."""
    try:
        out = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        out = None
    if not out or any(x < 0 for x in out):
        raise argparse.ArgumentTypeError(f"must be comma-separated ints >= 0, got {text!r}")
    return out


def positive_int_list(text: str) -> list[int]:
    """An argparse ``type``: comma-separated ints >= 1 (user counts, sizes), at least one."""
    try:
        out = int_list(text)
    except argparse.ArgumentTypeError:
        out = []
    if not out or min(out) < 1:
        raise argparse.ArgumentTypeError(f"must be comma-separated ints >= 1, got {text!r}")
    return out


def float_list(text: str) -> list[float]:
    """An argparse ``type``: comma-separated floats (rates, multiples), at least one."""
    try:
        out = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        out = None
    if not out:
        raise argparse.ArgumentTypeError(f"must be comma-separated numbers, got {text!r}")
    return out


def choice_list(*choices: str):
    """An argparse ``type``: comma-separated names, each one of ``choices``."""
    def parse(text: str) -> list[str]:
        out = [x for x in text.split(",") if x]
        bad = [x for x in out if x not in choices]
        if not out or bad:
            raise argparse.ArgumentTypeError(f"must be comma-separated names of {', '.join(choices)}, got {text!r}")
        return out
    parse.__name__ = "names"
    return parse


def existing_path(text: str) -> Path:
    """An argparse ``type``: a path that exists (an input read only at the end of a long run
    is checked before it starts)."""
    path = Path(text)
    if not path.exists():
        raise argparse.ArgumentTypeError(f"{text}: no such file or directory")
    return path


def rmm_jax_command() -> list[str]:
    """The console script users run (beside this interpreter), else the module: how a
    benchmark that times or drives the CLI runs ``rmm-jax``."""
    script = Path(sys.executable).parent / "rmm-jax"
    return [str(script)] if script.exists() else [sys.executable, "-m", "rmm_jax.cli.main"]


def run_cli(args: Sequence, *, cwd: Path | None = None, env: dict | None = None, ok: Sequence[int] = (0,)) -> str:
    """Run one ``rmm-jax`` command (:func:`rmm_jax_command`) in ``cwd`` with ``env`` added to this
    process's environment; its stdout. An exit status not in ``ok`` ends the benchmark with the
    command and the tail of its stderr."""
    r = subprocess.run(rmm_jax_command() + [str(a) for a in args], cwd=cwd, capture_output=True, text=True,
                       env=None if env is None else {**os.environ, **env})
    if r.returncode not in ok:
        sys.exit(f"error: rmm-jax {' '.join(map(str, args))} exited {r.returncode}:\n{r.stderr[-3000:]}")
    return r.stdout


def du(path: Path) -> int:
    """Bytes of the file ``path``, or of every file under the directory ``path`` (apparent size)."""
    path = Path(path)
    if path.is_file():
        return path.stat().st_size
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def du_allocated(path: Path) -> tuple[int, int]:
    """``(allocated, apparent)`` bytes of every file under the directory ``path``, links not
    followed: the blocks the files hold on the disk (less than apparent where they are sparse,
    more where a block is partly used), and their sizes (:func:`du`'s count, links aside)."""
    alloc = size = 0
    for root, _, names in os.walk(path):
        for n in names:
            st = os.lstat(os.path.join(root, n))
            alloc += st.st_blocks * 512
            size += st.st_size
    return alloc, size


def locomo_dir() -> Path:
    """The LoCoMo directory: ``$RMM_LOCOMO_DIR``, else ``<repo>/../shared/data/locomo``."""
    return Path(os.environ.get(DATA_ENV) or REPO.parent / "shared" / "data" / "locomo")


def add_data_option(ap: argparse.ArgumentParser) -> None:
    """``--data``: the LoCoMo file or directory (default :func:`locomo_dir`)."""
    ap.add_argument("--data", type=Path, default=locomo_dir(),
                    help=f"LoCoMo file or directory (${DATA_ENV}, else ../shared/data/locomo)")


def locomo_options(ap: argparse.ArgumentParser) -> None:
    """The options every LoCoMo run takes: ``--data`` (:func:`add_data_option`), ``--model``,
    ``--k`` candidates and ``--m`` shown."""
    add_data_option(ap)
    ap.add_argument("--model", default=MODEL)
    ap.add_argument("--k", type=positive_int, default=20, help="candidates retrieved per question")
    ap.add_argument("--m", type=positive_int, default=5, help="memories shown per question")


def result_options(ap: argparse.ArgumentParser, plot_help: str) -> None:
    """``--json`` (the result), ``--plot`` (``plot_help``) and ``--from-json`` (redraw only,
    :func:`redrawn`)."""
    ap.add_argument("--json", type=Path, default=None, help="write the results as one JSON object")
    ap.add_argument("--plot", type=Path, default=None, help=plot_help)
    ap.add_argument("--from-json", type=Path, default=None, help="redraw --plot from a saved result; run nothing")


def redrawn(ap: argparse.ArgumentParser, args, plot) -> bool:
    """With ``--from-json``: ``plot(result, --plot)`` from the saved result
    (:func:`saved_result`) and True: the caller runs nothing else. Without ``--plot`` there is
    nothing to redraw: a usage error."""
    if not args.from_json:
        return False
    if not args.plot:
        ap.error("--from-json needs --plot")
    plot(saved_result(ap, args.from_json, "--from-json"), args.plot)
    return True


def replot_result(ap: argparse.ArgumentParser, args) -> dict:
    """``--replot`` (redraw ``--plot`` from ``--json``, run nothing): the saved result
    (:func:`saved_result`); without both options, a usage error."""
    if args.plot is None or args.json is None:
        ap.error("--replot needs --json and --plot")
    return saved_result(ap, args.json, "--json")


def saved_result(ap: argparse.ArgumentParser, path: Path, option: str) -> dict:
    """The saved result a redraw reads (``--from-json``, or ``--json`` under ``--replot``):
    a missing, unreadable or non-JSON file is the parser's one-line error naming ``option``
    and ``path`` (exit 2), not a traceback."""
    try:
        return json.loads(Path(path).read_text())
    except OSError as e:
        ap.error(f"{option} {path}: {e.strerror or e}")
    except ValueError as e:
        ap.error(f"{option} {path}: not a JSON result ({e})")


def save_outputs(args, result: dict, plot) -> None:
    """What ``--plot`` and ``--json`` ask for: ``plot(result, --plot)`` and the result file
    (:func:`write_result`)."""
    if args.plot:
        plot(result, args.plot)
    if args.json:
        write_result(args.json, result)


@contextlib.contextmanager
def atomic_output(path):
    """``with atomic_output(path) as tmp``: write ``tmp`` (a sibling with the same suffix,
    so writers that go by it still do); it replaces ``path`` whole when the block ends, and
    is removed when the block fails: a killed or failed run leaves ``path`` as it was."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}{path.suffix}")
    try:
        yield tmp
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def save_figure(fig, path: Path, dpi: int = 120) -> None:
    """Write a matplotlib figure to ``path`` whole (:func:`atomic_output`) and close it."""
    import matplotlib.pyplot as plt
    try:
        with atomic_output(path) as tmp:
            fig.savefig(tmp, dpi=dpi)
    finally:
        plt.close(fig)


def require_data(path: Path) -> Path:
    """``path`` if it holds LoCoMo; otherwise exit 0 with the reason (exit 1 under ``CI=true``)."""
    path = Path(path)
    if path.is_file() or (path.is_dir() and any(path.glob("*.json"))):
        return path
    msg = f"{path}: LoCoMo data not found (set --data or {DATA_ENV})"
    if os.environ.get("CI", "").lower() == "true":
        sys.exit(f"error: {msg}")
    print(f"skipped: {msg}", file=sys.stderr)
    sys.exit(0)


class LoCoMo(NamedTuple):
    """LoCoMo as the benchmarks use it: one stream per conversation (gold labels from the
    dataset's evidence), and, when built with ``answers=True``, each conversation's
    question + answer embeddings (T, d), in stream order; with ``dialogue=True``, each
    conversation's dialogue pairs (``rmm-jax pretrain --labels dialogue``; one with none is left out)."""
    streams: list[Stream]
    answers: dict[str, np.ndarray] | None
    dialogue: list[Stream] | None = None

    def answer_streams(self) -> list[Stream]:
        """The streams with ``cite_gold`` = answer support at the library's rule
        (:func:`rmm_jax.online.streams.with_answer_support`; never reads gold)."""
        if self.answers is None:
            raise ValueError("answer_streams: built without answers=True")
        return [with_answer_support(s, self.answers[s.user_id]) for s in self.streams]


def without_speakers(dataset):
    """``dataset`` with each turn's text stripped of its leading ``"speaker: "``, the name
    every LoCoMo memory begins with (:func:`rmm_jax.data.locomo.turn_text`); questions as
    they are.

    >>> from rmm_jax.data.types import Dataset, Session, Turn, User
    >>> t = Turn("D1:1", "s1", "Ann", "Ann: Where did you go?")
    >>> d = without_speakers(Dataset("locomo", (User("u", (Session("s1", None, (t,)),), ()),)))
    >>> d.users[0].sessions[0].turns[0].text
    'Where did you go?'
    """
    def turn(t):
        head = f"{t.speaker}: "
        return dataclasses.replace(t, text=t.text[len(head):] if t.text.startswith(head) else t.text)

    return dataclasses.replace(dataset, users=tuple(
        dataclasses.replace(u, sessions=tuple(dataclasses.replace(s, turns=tuple(map(turn, s.turns)))
                                              for s in u.sessions)) for u in dataset.users))


def locomo_streams(data, k: int, *, model: str = MODEL, granularity: str = "turn", answers: bool = False,
                   dialogue: bool = False, users: Sequence[str] | None = None, speakers: bool = True) -> LoCoMo:
    """Embed LoCoMo (``data``: file or directory) into a temporary store, as ``rmm-jax embed
    locomo:DATA --granularity G [--answers]`` would, and load ``users``' streams (all by
    default) with ``k`` candidates each; ``speakers=False`` embeds the memories without the
    speaker's name (:func:`without_speakers`; no dialogue pairs then, which need the names).
    Embeddings come from the embedder's disk cache after the first build. The store is
    deleted; the streams hold their arrays."""
    if dialogue and not speakers:
        raise ValueError("locomo_streams: dialogue pairs need the speakers' names")
    dataset = load_locomo(data) if speakers else without_speakers(load_locomo(data))
    with tempfile.TemporaryDirectory() as tmp:
        emb = Embedder(model, progress=False)
        try:
            write_store(Path(tmp) / "store", dataset, granularity, emb, spec=f"locomo:{data}", answers=answers)
        finally:
            emb.close()
        store = open_store(Path(tmp) / "store")
        streams = load_streams(store, k, users)
        qa = {s.user_id: np.array(store.user_answers(s.user_id), np.float32) for s in streams} if answers else None
        pairs = load_dialogue_streams(store, k, [s.user_id for s in streams]) if dialogue else None
    return LoCoMo(streams, qa, pairs)


def citation_model(name: str):
    """``(cite_fn, description)`` of a ``--citations`` choice:

    * ``oracle`` (``rmm-jax simulate``'s default): the class-calibrated simulator
      (:func:`rmm_jax.data.citations.oracle`): a shown gold memory is cited with P 0.911,
      any other with 0.154, every shown memory with 0.154 when no gold one is shown.
    * ``precision_recall``: the older, more generous simulator at precision/recall
      0.876/0.858 (:func:`rmm_jax.data.citations.precision_recall_oracle`); it never cites
      when no gold memory is shown.
    * ``answer``: cites exactly the shown memories that support the reference answer;
      the streams must carry answer support (:meth:`LoCoMo.answer_streams`).
    """
    if name not in CITATIONS:
        raise ValueError(f"citations: must be one of {CITATIONS}, got {name!r}")
    cite = cm.citation_model(name)
    if name == "oracle":
        return cite, {"model": "oracle (class-calibrated)", "p_useful": cm.P_USEFUL, "p_other": cm.P_OTHER,
                      "spurious": cm.SPURIOUS}
    if name == "precision_recall":
        return cite, {"model": "precision/recall", "precision": cm.DEFAULT_PRECISION, "recall": cm.DEFAULT_RECALL}
    return cite, {"model": "answer (cites exactly the shown memories that support the reference answer)",
                  "top_c": cm.ANSWER_TOP_C, "threshold": cm.ANSWER_THRESHOLD}


SYNTHETIC = "synthetic:users={users},sessions=6,turns=10,seed={seed}"   # the synthetic population's spec


def synthetic_population(users: int, k: int, store: Path | None, seed: int = 0) -> list[Stream]:
    """The first ``users`` users of the synthetic population ``seed`` (:data:`SYNTHETIC`), from
    ``store`` (made by ``rmm-jax embed SPEC``) when it holds them, else embedded into ``store``
    (a temporary one when None; the embeddings are cached on disk)."""
    from rmm_jax.data import load_spec
    from rmm_jax.data.synthetic import parse_synthetic_spec

    if store is not None and (store / "manifest.json").exists():
        st = open_store(store)
        got = parse_synthetic_spec(str(st.manifest.get("spec", "")).removeprefix("synthetic:"))
        want = parse_synthetic_spec(SYNTHETIC.format(users=users, seed=seed).removeprefix("synthetic:"))
        if {key: got.get(key) for key in ("sessions", "turns", "seed")} != \
                {key: want[key] for key in ("sessions", "turns", "seed")}:
            sys.exit(f"error: --synthetic-store {store}: holds {st.manifest.get('spec')!r}, "
                     f"not {SYNTHETIC.format(users='N', seed=seed)!r}")
        held = sorted(st.user_ids, key=lambda u: int(u.removeprefix("user")))
        if len(held) < users:
            sys.exit(f"error: --synthetic-store {store}: {len(held)} users, need {users}")
        return load_streams(st, k, held[:users])
    with tempfile.TemporaryDirectory() as tmp:
        out = store or Path(tmp) / "store"
        emb = Embedder(MODEL, progress=True)
        try:
            spec = SYNTHETIC.format(users=users, seed=seed)
            write_store(out, load_spec(spec), "turn", emb, spec=spec)
        finally:
            emb.close()
        return load_streams(open_store(out), k)


def online_recall(streams: Sequence[Stream], program, params, seed: int) -> dict:
    """User id -> (T,) prequential Recall@M of one run of ``program`` (built once by
    :func:`rmm_jax.make_run`, reused over seeds) with every stream side by side in one
    chunk, each user starting from ``params``."""
    return run_online(streams, program, params, seed=seed, users_per_chunk=len(streams)).recall


class ChunkRun(NamedTuple):
    """One run of :func:`run_chunk`."""
    finals: dict         # user id -> the reranker it ended with (its own part merged with the shared)
    outputs: dict        # user id -> its outputs: recall, ndcg, selected, cited, log_prob per query
    shared: object       # the shared part's params at the end (empty outside shared and hybrid)


def run_chunk(streams: Sequence[Stream], program, params, seed: int) -> ChunkRun:
    """One run of ``program`` with ``streams`` side by side in one chunk, each user starting
    from ``params`` (simulated when the program has a citation model, else replayed from the
    logs the streams carry)."""
    finals, outputs, shared = {}, {}, None
    for ev in drive([list(streams)], program, params, seed=seed, users_per_chunk=len(streams)):
        if isinstance(ev, ChunkDone):
            outputs.update(ev.outputs)
            shared = ev.shared.params
            for i, s in enumerate(ev.streams):
                local = jax.tree.map(lambda x, i=i: x[i], ev.states.params)
                finals[s.user_id] = program.layout.scope.merge(ev.shared.params, local)
    return ChunkRun(finals, outputs, shared)


def recall_at(rel, num_gold: int) -> float:
    """Recall@M of one query from its shown (or top M) memories: ``rel``, whether each is gold,
    summed over the query's ``num_gold`` gold memories (0 when it has none, as
    :func:`rmm_jax.core.metrics.recall_at_k`). One query in plain Python and NumPy, for the
    benchmarks that rank outside the library (a peer, served lines)."""
    return float(np.sum(rel)) / num_gold if num_gold > 0 else 0.0


def frozen_recall(params, s: Stream, m: int, *, valid_only: bool = False) -> np.ndarray:
    """Recall@M per query (T,) of a fixed reranker on a stream: no learning, every query, or
    with ``valid_only`` the valid queries only (those with a gold candidate), in stream
    order. The reranker's float32, as computed: a caller that wants float64 casts (exactly)."""
    r, _ = eval_per_query(params, {"q": s.queries, "m": s.bank[s.cand], "mask": s.cand_mask, "gold": s.cand_gold,
                                   "num_gold": s.num_gold}, m)
    r = np.asarray(r)
    return r[np.asarray(s.valid, bool)] if valid_only else r


def retriever_recall(streams: Sequence[Stream], m: int) -> dict[str, np.ndarray]:
    """User id -> (T,) Recall@M per query of the retriever's own order (its first ``m``
    candidates; :func:`rmm_jax.online.summary.base_values`), every query: the baseline
    every gain is measured against."""
    return {s.user_id: np.asarray(base_values(s, m)[0]) for s in streams}


def log_as_labels(s: Stream, calls: dict, negatives: str = "shown") -> Stream:
    """``s`` with its logged calls (``selected``, ``cited``) as listwise labels and no gold:
    the cited memories are the targets, against the shown ones (``negatives="shown"``) or
    all K candidates (``"all"``); a call that cited nothing carries no listwise signal and
    is dropped."""
    sel = np.asarray(calls["selected"])
    ok = sel >= 0
    rows = np.repeat(np.arange(sel.shape[0])[:, None], sel.shape[1], 1)
    shown = np.zeros(s.cand_mask.shape, bool)
    cited = np.zeros(s.cand_mask.shape, bool)
    shown[rows[ok], sel[ok]] = True
    cited[rows[ok], sel[ok]] = np.asarray(calls["cited"])[ok]
    return dataclasses.replace(s, cand_mask=shown if negatives == "shown" else s.cand_mask, cand_gold=cited,
                               num_gold=cited.sum(1).astype(np.int32), valid=cited.any(1), cite_gold=None)


def pooled(per_user: dict, streams: Sequence[Stream], users: Sequence[str]) -> np.ndarray:
    """``users``' per-query values (user id -> (T,) in stream order), valid queries only,
    concatenated in the order of ``users`` (float64)."""
    by_id = {s.user_id: s for s in streams}
    return np.concatenate([np.asarray(per_user[u], np.float64)[np.asarray(by_id[u].valid, bool)] for u in users])


def query_groups(streams: Sequence[Stream], users: Sequence[str]) -> np.ndarray:
    """Which of ``users`` each value of :func:`pooled` belongs to (its index in ``users``)."""
    by_id = {s.user_id: s for s in streams}
    return np.concatenate([np.full(int(np.asarray(by_id[u].valid, bool).sum()), i) for i, u in enumerate(users)])


def paired_gain(a: Sequence[dict], b: Sequence[dict], streams: Sequence[Stream], users: Sequence[str], *,
                by_user: bool = False) -> dict:
    """The :func:`gain_interval` of ``a`` minus ``b``, per query and seed: per-seed per-user
    values (user id -> (T,)) of two runs on the same seeds and queries, each pooled over
    ``users`` (:func:`pooled`); ``b`` may hold one run (a baseline), set against every seed of
    ``a``. ``by_user``: the interval resamples the users too (:func:`query_groups`)."""
    stack = lambda runs: np.stack([pooled(r, streams, users) for r in runs])  # noqa: E731
    return gain_interval(stack(a) - stack(b), groups=query_groups(streams, users) if by_user else None)


def pooled_gain(per_seed: Sequence[dict], base: dict, streams: Sequence[Stream], users: Sequence[str], *,
                by_user: bool = False, detail: bool = False) -> dict:
    """Recall and gain over ``base`` of per-seed per-user recalls (user id -> (T,)), pooled
    over ``users``: ``{"recall", "base", "gain"}``, the gain a :func:`paired_gain` over the
    base (``by_user``: resampling the users too). ``detail`` adds ``per_seed_gain`` (each
    seed's mean gain) and ``per_user`` (each user's recall, over seeds)."""
    vals = np.stack([pooled(r, streams, users) for r in per_seed])
    b = pooled(base, streams, users)
    out = {"recall": float(vals.mean()), "base": float(b.mean()),
           "gain": paired_gain(per_seed, [base], streams, users, by_user=by_user)}
    if detail:
        out["per_seed_gain"] = [float(x) for x in (vals - b).mean(1)]
        out["per_user"] = {u: float(np.stack([pooled(r, streams, [u]) for r in per_seed]).mean()) for u in users}
    return out


ALLOW_DIRTY_ENV = "RMM_ALLOW_DIRTY"


def _git(*args: str) -> str | None:
    try:
        return subprocess.run(["git", "-C", str(REPO), *args], capture_output=True, text=True,
                              check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return None


def uncommitted() -> list[str] | None:
    """The paths ``git status --porcelain`` lists outside ``benchmarks/results/`` (what a
    result could depend on that no commit holds; the results folder holds outputs, and a
    run writes several), or None outside a git checkout."""
    out = _git("status", "--porcelain", "--untracked-files=all")
    if out is None:
        return None
    results = os.path.relpath(RESULTS, REPO).replace(os.sep, "/") + "/"
    paths = [line[3:].split(" -> ")[-1].strip('"') for line in out.splitlines() if line.strip()]
    return [p for p in paths if not p.startswith(results)]


def code_elsewhere() -> str | None:
    """The folder ``rmm_jax`` was imported from when it is not this checkout's (an editable
    install of another checkout or worktree, site-packages), else None: then this checkout's
    commit does not name the code that ran."""
    import rmm_jax
    root = Path(rmm_jax.__file__).resolve().parent.parent
    return None if root == Path(REPO).resolve() else str(root)


def provenance() -> dict:
    """Who wrote a result: command line, UTC date, commit, whether the tree was clean (no
    uncommitted change outside ``benchmarks/results/``, and ``rmm_jax`` imported from this
    checkout: else ``rmm_jax_from``), machine, load average."""
    commit, dirty, elsewhere = _git("rev-parse", "--short", "HEAD"), uncommitted(), code_elsewhere()
    return {"command": "python " + shlex.join([os.path.relpath(sys.argv[0], REPO)] + sys.argv[1:]),   # re-parses
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "commit": commit.strip() if commit else None, "clean": dirty == [] and elsewhere is None,
            **({"uncommitted": dirty[:20]} if dirty else {}),
            **({"rmm_jax_from": elsewhere} if elsewhere else {}),
            "machine": {"platform": platform.platform(), "cpus": os.cpu_count()},
            "load_average": list(os.getloadavg())}


def write_result(path, result: dict) -> None:
    """Write ``result`` (plus ``provenance``) as JSON, atomically; NumPy scalars become numbers.

    A result under ``benchmarks/results/`` comes from committed code: from a tree with
    uncommitted changes (or outside git) it is refused, with the reason, unless
    ``$RMM_ALLOW_DIRTY=1``, and then it is written marked ``"clean": false`` with a warning.
    Elsewhere (a scratch path) a dirty tree is recorded and warned about."""
    prov = provenance()
    if not prov["clean"]:
        what = (f"{len(prov['uncommitted'])} uncommitted path(s), e.g. {prov['uncommitted'][0]}"
                if prov.get("uncommitted") else
                f"rmm_jax imported from {prov['rmm_jax_from']}, not from {REPO} (set PYTHONPATH)"
                if prov.get("rmm_jax_from") else "no git checkout")
        inside = Path(path).resolve().is_relative_to(RESULTS.resolve())
        if inside and os.environ.get(ALLOW_DIRTY_ENV) != "1":
            sys.exit(f"error: {path}: not written: a result file comes from committed code, and this tree has "
                     f"{what}; commit first (or set {ALLOW_DIRTY_ENV}=1 to write it marked \"clean\": false)")
        print(f"WARNING: {path} is written from a tree with {what}: marked \"clean\": false", file=sys.stderr)
    out = json.loads(json.dumps({**result, "provenance": prov}, default=_plain))
    write_json(Path(path), out)
    print(f"wrote {path}", file=sys.stderr)


def _plain(x):
    if isinstance(x, np.ndarray):
        return x.tolist()
    if isinstance(x, (np.floating, np.integer, np.bool_)):
        return x.item()
    raise TypeError(f"not JSON serialisable: {type(x).__name__}")


NOISY_LOAD = 2.5   # a 1-minute load average above this on the 2-core machine: timings are contended


def drop_page_cache(path: Path) -> int:
    """Drop every file under ``path`` from the OS page cache (``posix_fadvise(DONTNEED)``,
    which needs no root; the files must be clean, i.e. fsynced, as a store's are), so the
    next read comes from the disk; returns how many files."""
    n = 0
    for f in Path(path).rglob("*"):
        if f.is_file():
            fd = os.open(f, os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)
            n += 1
    return n


class LoadWatch:
    """The 1-minute load average around a timed measurement: sampled at the start, at
    :meth:`sample` calls (one per repeat) and at the end. :meth:`result` records every
    sample and ``noisy`` (some sample above :data:`NOISY_LOAD`): such a ratio is re-run in
    a quiet window, or kept marked noisy in its file and in the docs."""

    def __init__(self):
        self.samples = [os.getloadavg()[0]]
        self.start = (time.perf_counter(), _busy_cpu_s(), _own_cpu_s())

    def sample(self) -> float:
        self.samples.append(os.getloadavg()[0])
        return self.samples[-1]

    def result(self) -> dict:
        """:func:`load_summary` of the samples, plus ``others_cpu``: the share of the
        machine's CPU time that other processes used meanwhile (busy time in /proc/stat
        less this process's and its waited children's): a benchmark that runs several
        threads raises the load average itself, and this says whether anything else ran."""
        self.sample()
        out = load_summary(self.samples)
        t0, busy0, own0 = self.start
        busy, wall = _busy_cpu_s(), time.perf_counter() - t0
        if busy is not None and busy0 is not None and wall > 0:
            others = (busy - busy0) - (_own_cpu_s() - own0)
            out["others_cpu"] = round(max(0.0, others) / (wall * (os.cpu_count() or 1)), 3)
        return out


def _busy_cpu_s() -> float | None:
    """Seconds of CPU time every CPU has spent busy since boot (Linux /proc/stat), else None."""
    try:
        fields = [int(x) for x in open("/proc/stat").readline().split()[1:9]]
    except (OSError, ValueError):
        return None
    user, nice, system, _idle, _iowait, irq, softirq, steal = fields
    return (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")


def _own_cpu_s() -> float:
    t = os.times()
    return t.user + t.system + t.children_user + t.children_system


def load_summary(one_minute) -> dict:
    """``{one_minute: samples, max, noisy, noisy_above}`` of 1-minute load averages taken
    during a timing (see :class:`LoadWatch`); says so on stderr when it is noisy."""
    worst = max(one_minute)
    if worst > NOISY_LOAD:
        print(f"note: 1-minute load average reached {worst:.2f} (> {NOISY_LOAD}): timings marked noisy",
              file=sys.stderr)
    return {"one_minute": [round(x, 2) for x in one_minute], "max": round(worst, 2), "noisy": worst > NOISY_LOAD,
            "noisy_above": NOISY_LOAD}


def peak_rss_mib(usage=None) -> float:
    """Peak resident set size in MiB, to 0.1: of this process, or of what ``usage`` (a
    ``resource.struct_rusage``, e.g. a child's from ``os.wait4``) describes. Linux reports
    ``ru_maxrss`` in KiB."""
    return round((resource.getrusage(resource.RUSAGE_SELF) if usage is None else usage).ru_maxrss / 1024, 1)


def timed(fn) -> float:
    """Wall seconds of one call of ``fn`` (no arguments), its result waited for
    (``jax.block_until_ready``: JAX dispatches asynchronously; any other result passes through):
    the one stopwatch of the timing benchmarks."""
    t0 = time.perf_counter()
    jax.block_until_ready(fn())
    return time.perf_counter() - t0


def spread(values) -> dict:
    """``{median, min, max, values}`` of per-repeat values."""
    v = [float(x) for x in values]
    return {"median": float(np.median(v)), "min": min(v), "max": max(v), "values": v}
