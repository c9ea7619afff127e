"""Vowpal Wabbit as a peer: the same citation-driven reranking, learned by VW as its users would.

    python benchmarks/peer_vw.py --json benchmarks/results/peer_vw.json --plot benchmarks/results/peer_vw.png
    python benchmarks/peer_vw.py --ablation ...             # also the cb_explore_adf rows (about 4x VW's time)
    python benchmarks/peer_vw.py --synthetic --quick          # seconds, no LoCoMo data needed
    python benchmarks/peer_vw.py --start-check --tuned benchmarks/results/peer_vw.json \
        --json benchmarks/results/peer_vw_start_check.json    # the dialogue starts, read on 26+30

Vowpal Wabbit is what practitioners reach for to learn online from bandit feedback. This
script runs it on the LoCoMo streams of ``benchmarks/quality_locomo.py`` (turn memories,
all-MiniLM-L6-v2, K = 20 base-retriever candidates, M = 5 shown), against the same
citation simulators and with the same prequential Recall@5 as rmm-jax, and reports both
side by side. A peer is configured as its best users would configure it, so one that ends
below the retriever it reranks (no learning at all) is a bug in the benchmark: the script
then exits 1 with the reason (after writing its JSON, so the evidence is kept).

**VW's learner** (the ``vw`` rows): per user one workspace
``--loss_function logistic -q QM -b 22 -l η --power_t p``, a logistic regression per shown
memory, anchored at the retriever.

* features: the query embedding in namespace ``Q``, the memory's in ``M``; ``-q QM`` adds
  all d² products, so VW's score contains the bilinear qᵀWm of rmm-jax's linear reranker
  (q'ᵀm' = qᵀ(I+W_q)ᵀ(I+W_m)m), plus VW's linear terms in q and m and its constant.
* the anchor: with s = qᵀm the retriever's score and τ rmm-jax's temperature (0.1), a
  candidate's logit is z = s/τ + f, f = VW's raw prediction (w·x). Learning passes s/τ as
  the example's ``base`` (VW text format ``label importance base |Q … |M …``: the
  prediction starts there, so the logistic loss is taken at σ(s/τ + f)); ranking predicts
  f without it and adds s/τ. f starts at exactly 0, so an untrained workspace ranks as the
  retriever (``tests/test_bench_references.py`` checks this, and that learning sees the
  base).
* acting: the M shown memories are the Gumbel-top-M of z (an ordered Plackett–Luce
  sample at rmm-jax's temperature: before learning, both draw from the same law).
* labels: every shown memory is one example, +1 cited, −1 not (importance 1), learned
  after the query is scored; VW learns after every query, rmm-jax after every batch of 4.
* tuning: ``-l`` × ``--power_t`` (the knobs a VW user tunes first; VW's default adaptive,
  normalised updates stay on) on conversations 26 and 30 only, over
  ``--tune-seeds``, separately for each citation model; 41–43 are the held-out report.

**Ablation** (the ``vw_cb`` rows, with ``--ablation``; exempt from the floor): the setting this benchmark used
before, ``--cb_explore_adf --softmax --lambda 10 --cb_type dm -l 0.1 -q QM`` (the best of
its 12-setting grid), one contextual-bandit example per shown slot over the actions not
yet shown, the retriever's score qᵀm as a feature in namespace ``B``. It ranks by VW's
pmf, whose scores start at zero for every action: the retriever's score is one feature
among ~148k and never gets weight (in this benchmark's earlier runs, leaving it out changed
Recall@5 in no digit), so it ends below the retriever. It shows what a contextual-bandit reduction without an
anchor costs here.

**rmm-jax** (the ``rmm_jax`` rows): the library's online loop (``make_run`` + ``drive``,
:func:`rmm_jax_online`), the ``--preset`` (default ``default``: the citations as labels,
chosen by ``benchmarks/defaults_sweep.py``), every user from the identity reranker (the
``online`` row of ``quality_locomo.py``; VW has no pretraining either), on the same
streams and seeds, scope user (each user alone, as each VW workspace). ``rmm_jax_hybrid``:
a lever VW lacks, the same preset in scope hybrid (a reranker shared by the users plus a
low-rank one per user), all users side by side.

**A dialogue start** (the ``*_dialogue`` rows; LoCoMo only, since it needs the memories'
text): both learners start from the users' own dialogue pairs (``rmm-jax pretrain --labels
dialogue``: each turn that asks, with the next turn as its answer; no gold). rmm-jax pretrains
with the library's recipe (``DIALOGUE_RECIPE``, chosen by ``learn_sweep.py dialogue``) on every
conversation's pairs and runs the default preset from there. VW's workspace learns the same
pairs as logistic examples (:func:`vw_dialogue_start`); how (``-l``, passes, the answer weighted
as its K − 1 negatives) is tuned on 26 and 30 by the frozen Recall@5 of their questions, and
VW's online ``-l`` × ``--power_t`` is tuned again from that start, on 26 and 30, since a start
may want a smaller step. ``rmm_jax_dialogue - vw`` is the lever VW lacks as shipped;
``rmm_jax_dialogue - vw_dialogue`` is the two learners given the same start. Each start is
also scored frozen on the held-out questions (``*.dialogue_start.frozen_held_out``), so that
what online learning adds to it, or takes away, can be read beside the rows.

**Paired comparison.** Every learner runs on the same streams with the same seeds (VW,
rmm-jax and hybrid back to back per seed), and ``ratios`` holds the per-query differences
pooled over all five conversations (``*_all``: 26 and 30 are where both were tuned) and over
the held-out ones, with 95% intervals that resample conversations, seeds and queries
(:func:`rmm_jax.online.stats.gain_interval` with the conversation as group), as do the
gains over the retriever.

**Citations.** Both models of the library, each the same for every learner: ``oracle``
is the class-calibrated :func:`rmm_jax.data.citations.oracle` (``rmm-jax simulate``'s
default: a useful memory cited at 0.911, another at 0.154, each memory of a call that
shows nothing useful at 0.154); ``precision_recall`` is
:func:`rmm_jax.data.citations.precision_recall_oracle` at (0.876, 0.858). VW's slates are cited
by the NumPy transcriptions in ``ref_numpy`` (``class_cite``, ``oracle_cite``), checked
against the library's by ``tests/test_bench_references.py``. Recall@5 is prequential:
|gold ∩ top-5| / gold in the bank, each query scored before the update that uses it,
averaged over valid queries (query weighted), as in :mod:`rmm_jax.online.summary`. A
gain is the mean over seeds and queries of the per-query difference with its 95%
interval (:func:`rmm_jax.online.stats.gain_interval`).

**Timing.** queries/s = all queries / wall seconds of one online pass over every user.
VW: per user a fresh workspace, the memories formatted as VW text once, then per query
the retriever logits, K predicts, the ranking, the Gumbel draw, the citations and M learn
calls, single-threaded as VW runs (``vw_core_seconds``: inside predict and learn only).
rmm-jax: ``drive`` (host padding, the compiled run over one chunk of all users, results
copied back) after compile (``compile_s``: its first pass, compile included), XLA's CPU
backend with its own threads, all users at once; a pass takes well under a second, so each
is the median of ``--jax-timing-runs`` identical passes. Per seed VW and rmm-jax run back
to back (interleaved); the ratio is taken per seed and summarised as median [min, max].
``timing.load_avg_1min``: the 1-minute load average at the start and after each seed;
``timing.load``: the same with one at the end (:class:`_common.LoadWatch`: ``noisy`` above
2.5, and ``others_cpu``, the share of the machine's CPU other processes used meanwhile).
"""
from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import os
import sys
import tempfile
import time
import zlib
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import _common  # noqa: E402
import _ref_numpy as ref_numpy  # noqa: E402
import jax  # noqa: E402
import numpy as np  # noqa: E402

import rmm_jax as rj  # noqa: E402
from rmm_jax.core.config import describe  # noqa: E402
from rmm_jax.data.citations import (  # noqa: E402
    DEFAULT_PRECISION,
    DEFAULT_RECALL,
    P_OTHER,
    P_USEFUL,
    SPURIOUS,
    oracle,
    precision_recall_oracle,
)
from rmm_jax.online.pretrain import DIALOGUE_RECIPE, pretrain  # noqa: E402
from rmm_jax.online.streams import Stream  # noqa: E402

try:
    from vowpalwabbit import pyvw
except ImportError:  # the tests skip with a reason; main() exits with one line
    pyvw = None

TUNED_ON = ("26", "30")
LEARNERS = {"vw": "VW logistic, anchored", "rmm_jax": "rmm-jax (default preset)",
            "rmm_jax_hybrid": "rmm-jax hybrid (a lever VW lacks)",
            "rmm_jax_dialogue": "rmm-jax from a dialogue start", "vw_dialogue": "VW from a dialogue start",
            "vw_cb": "VW cb_explore_adf (ablation)"}


def learner_label(name: str, preset: str) -> str:
    """A learner's label in the results: rmm-jax's names the preset it ran."""
    return f"rmm-jax ({preset} preset)" if name == "rmm_jax" else LEARNERS[name]


DIALOGUE_LEARNERS = ("rmm_jax_dialogue", "vw_dialogue")     # LoCoMo only: they need the memories' text
FLOORED = ("vw", "rmm_jax", *DIALOGUE_LEARNERS)  # must end above the retriever; the ablation is reported only


# --------------------------------------------------------------------------- citation models

@dataclasses.dataclass(frozen=True)
class Citations:
    """One citation model: the library's cite function (rmm-jax) and its NumPy transcription (VW)."""
    name: str
    what: str
    library: object                  # () -> cite_fn(key, is_gold, filled), jittable
    numpy: object                    # (is_gold (1, M), filled (1, M), rng) -> cited (1, M)


CITATIONS = {
    "oracle": Citations(
        "oracle", f"class-calibrated, rmm_jax.data.citations.oracle() (simulate's default): p_useful {P_USEFUL}, "
        f"p_other {P_OTHER}, spurious {SPURIOUS}", oracle,
        lambda g, f, rng: ref_numpy.class_cite(g, f, rng, P_USEFUL, P_OTHER, SPURIOUS)),
    "precision_recall": Citations(
        "precision_recall", f"rmm_jax.online.run.precision_recall_oracle({DEFAULT_PRECISION}, {DEFAULT_RECALL})",
        lambda: precision_recall_oracle(DEFAULT_PRECISION, DEFAULT_RECALL),
        lambda g, f, rng: ref_numpy.oracle_cite(g, f, rng, DEFAULT_PRECISION, DEFAULT_RECALL)),
}


# --------------------------------------------------------------------------- VW, anchored at the retriever

@dataclasses.dataclass(frozen=True)
class VWSetting:
    """VW's logistic regression per shown memory: learning rate ``-l``, ``--power_t``, ``--l2``."""
    lr: float = 0.5
    power_t: float = 0.5
    l2: float = 0.0
    bits: int = 22

    def args(self, seed: int = 0) -> str:
        return (f"--loss_function logistic -q QM -b {self.bits} -l {self.lr:g} --power_t {self.power_t:g}"
                + (f" --l2 {self.l2:g}" if self.l2 else "") + f" --random_seed {seed} --quiet")


def features(x: np.ndarray) -> str:
    """Dense vector → VW ``index:value`` text."""
    return " ".join(f"{i}:{v:.6g}" for i, v in enumerate(x.tolist()))


def retriever_logits(stream: Stream, t: int, cand: np.ndarray, tau: float) -> np.ndarray:
    """s/τ for query t's candidates, s = qᵀm in float32 as the retriever scored them."""
    return (stream.bank[cand] @ stream.queries[t]).astype(np.float64) / tau


def vw_logits(ws, base: np.ndarray, q_text: str, mem_text) -> np.ndarray:
    """z = s/τ + f: VW's raw prediction f (no base in the example) added to the retriever's logits."""
    return base + np.array([ws.predict(q_text + m) for m in mem_text], np.float64)


def vw_learn(ws, base: np.ndarray, q_text: str, mem_text, shown, cited) -> None:
    """One logistic example per shown memory: label ±1 (cited or not), importance 1, base s/τ."""
    for i, c in zip(shown, cited):
        ws.learn(f"{1 if c else -1} 1 {base[i]:.9g} {q_text}{mem_text[i]}")


def rank(z: np.ndarray, m: int) -> np.ndarray:
    """Top-m positions by z, ties in retriever order."""
    return np.argsort(-z, kind="stable")[:m]


def gumbel_top(z: np.ndarray, m: int, rng: np.random.Generator) -> np.ndarray:
    """Gumbel-top-m of z: an ordered Plackett–Luce sample of m positions (rmm-jax's act step)."""
    return rank(z + rng.gumbel(size=z.size), m)


def user_rng(seed: int, user_id: str) -> np.random.Generator:
    return np.random.default_rng([seed, zlib.crc32(user_id.encode())])


def run_vw_user(stream: Stream, vw: VWSetting, cite, *, m: int, tau: float, seed: int,
                init: Path | None = None) -> dict:
    """One user's online pass with anchored VW: per query score prequentially, draw, cite, learn;
    from the model saved at ``init`` (:func:`vw_dialogue_start`), or from zero weights.

    Returns per-query ``recall`` (T,), ``cite_rate`` and the seconds spent (``seconds``:
    all of it; ``vw_seconds``: inside VW's predict and learn calls).
    """
    t_start = time.perf_counter()
    rng = user_rng(seed, stream.user_id)
    ws = pyvw.Workspace(vw.args(seed) + ("" if init is None else f" -i {init}"))
    mem_text = [f"|M {features(v)}" for v in stream.bank]               # each memory formatted once
    t_vw, n_cited, n_shown = 0.0, 0, 0
    recalls = np.zeros(stream.queries.shape[0])
    try:
        for t in range(stream.queries.shape[0]):
            ok = stream.cand_mask[t]
            cand = stream.cand[t][ok]
            useful = (stream.cand_gold if stream.cite_gold is None else stream.cite_gold)[t][ok]
            base = retriever_logits(stream, t, cand, tau)
            q_text, mems = f"|Q {features(stream.queries[t])} ", [mem_text[j] for j in cand]
            t0 = time.perf_counter()
            z = vw_logits(ws, base, q_text, mems)
            t_vw += time.perf_counter() - t0
            k_m = min(m, cand.size)
            recalls[t] = _common.recall_at(stream.cand_gold[t][ok][rank(z, k_m)], int(stream.num_gold[t]))
            shown = gumbel_top(z, k_m, rng)
            cited = cite(useful[shown][None], np.ones((1, k_m), bool), rng)[0]
            n_cited, n_shown = n_cited + int(cited.sum()), n_shown + k_m
            t0 = time.perf_counter()
            vw_learn(ws, base, q_text, mems, shown, cited)
            t_vw += time.perf_counter() - t0
    finally:
        ws.finish()
    return {"recall": recalls, "cite_rate": n_cited / max(n_shown, 1), "seconds": time.perf_counter() - t_start,
            "vw_seconds": t_vw}


@dataclasses.dataclass(frozen=True)
class VWStart:
    """How VW's workspace learns the dialogue pairs: ``-l`` and passes, and whether each list's
    answering turn is weighted as all its other candidates together (importance K − 1)."""
    lr: float
    passes: int
    balanced: bool

    @property
    def name(self) -> str:
        return f"-l {self.lr:g}, {self.passes} pass{'es' if self.passes > 1 else ''}" + (
            ", balanced" if self.balanced else "")


# VW's dialogue start is tuned like VW's online knobs: on 26 and 30 only, every setting learning
# their pairs and scored frozen on their questions (Recall@M, the retriever's s/τ as anchor).
VW_START_GRID = [VWStart(lr, passes, balanced) for balanced in (False, True) for lr in (0.3, 1.0, 3.0)
                 for passes in (1, 2, 4)]


def vw_dialogue_start(dialogue: list[Stream], start: VWStart, *, bits: int, tau: float, path: Path) -> Path:
    """VW's workspace trained on the dialogue pairs (:func:`rmm_jax.online.streams.dialogue_stream`)
    as VW learns: each candidate of a pair one logistic example, +1 the answering turn, −1 the
    others (the answer at importance K − 1 when ``start.balanced``), anchored at the retriever's
    s/τ like every online example; ``start.passes`` passes over all users' pairs in a shuffled
    order (seed 0). Saved at ``path`` for :func:`run_vw_user`'s ``init``, which goes on with the
    online setting's own ``-l`` and ``--power_t``."""
    ws = pyvw.Workspace(VWSetting(start.lr, 0.0, 0.0, bits).args(0))
    order = [(s, t) for s in dialogue for t in range(s.queries.shape[0])]
    rng = np.random.default_rng(0)
    try:
        for _ in range(start.passes):
            for i in rng.permutation(len(order)):
                s, t = order[i]
                cand = s.cand[t][s.cand_mask[t]]
                base, q_text = retriever_logits(s, t, cand, tau), f"|Q {features(s.queries[t])} "
                for j, c in enumerate(cand):
                    gold = bool(s.cand_gold[t][j])
                    weight = cand.size - 1 if gold and start.balanced else 1
                    ws.learn(f"{1 if gold else -1} {weight} {base[j]:.9g} {q_text}|M {features(s.bank[c])}")
        ws.save(str(path))
    finally:
        ws.finish()
    return path


def vw_frozen_recall(init: Path, streams: list[Stream], *, bits: int, tau: float, m: int) -> float:
    """Recall@m of a saved VW model ranking ``streams``' valid questions, learning nothing."""
    ws = pyvw.Workspace(VWSetting(bits=bits).args(0) + f" -i {init}")
    out = []
    try:
        for s in streams:
            mem_text = [f"|M {features(v)}" for v in s.bank]
            for t in np.flatnonzero(s.valid):
                cand = s.cand[t][s.cand_mask[t]]
                z = vw_logits(ws, retriever_logits(s, t, cand, tau), f"|Q {features(s.queries[t])} ",
                              [mem_text[j] for j in cand])
                shown = s.cand_gold[t][s.cand_mask[t]][rank(z, min(m, cand.size))]
                out.append(_common.recall_at(shown, int(s.num_gold[t])))
    finally:
        ws.finish()
    return float(np.mean(out))


def tune_vw_start(dialogue, streams, *, bits: int, tau: float, m: int, folder: Path, log):
    """Each of ``VW_START_GRID`` learning ``dialogue`` and scored frozen on ``streams``; returns
    (the best, rows)."""
    rows = []
    for st in VW_START_GRID:
        path = vw_dialogue_start(dialogue, st, bits=bits, tau=tau, path=folder / "tune.vw")
        rows.append({**dataclasses.asdict(st), "name": st.name,
                     "recall": vw_frozen_recall(path, streams, bits=bits, tau=tau, m=m)})
        log(f"  VW's dialogue start {st.name}: frozen Recall@{m} {rows[-1]['recall']:.4f}")
    return VW_START_GRID[int(np.argmax([r["recall"] for r in rows]))], rows


def frozen_mean(params, streams, m: int) -> float:
    """Recall@m of rmm-jax's reranker ``params`` ranking ``streams``' valid questions, learning
    nothing (the mean over the questions, as :func:`vw_frozen_recall` takes VW's)."""
    return float(np.concatenate([_common.frozen_recall(params, s, m, valid_only=True) for s in streams]).mean())


def start_check(streams, dialogue, start: VWStart, *, bits: int, tau: float, m: int, seeds, folder: Path,
                log) -> dict:
    """Why VW's start does less on 41–43 than on the conversations it was tuned on, read on 26 and
    30 only: each learner's start learned from 26+30's pairs (as VW's was tuned) and from every
    conversation's (as both starts are for the report), each scored frozen on 26+30's questions.
    VW's start (``start``: its chosen setting) is deterministic; rmm-jax's recipe runs at each
    of ``seeds``."""
    tune = [s for s in streams if s.user_id in TUNED_ON]
    dim, recipe = int(streams[0].bank.shape[1]), dataclasses.replace(DIALOGUE_RECIPE, m=m)
    rows = []
    for name, pairs in (("26+30's pairs", [d for d in dialogue if d.user_id in TUNED_ON]),
                        ("every conversation's pairs", list(dialogue))):
        vw = vw_frozen_recall(vw_dialogue_start(pairs, start, bits=bits, tau=tau, path=folder / "check.vw"), tune,
                              bits=bits, tau=tau, m=m)
        ours = []
        for seed in seeds:
            warm = pretrain(rj.init_reranker(jax.random.key(0), dim), pairs, [], recipe, seed=seed)[0]
            ours.append(frozen_mean(warm, tune, m))
        rows.append({"learned_from": name, "pairs": int(sum(d.queries.shape[0] for d in pairs)), "vw": vw,
                     "rmm_jax": {"values": ours, "mean": float(np.mean(ours)), "min": min(ours), "max": max(ours)}})
        log(f"  starts learned from {name}: frozen Recall@{m} on {'+'.join(TUNED_ON)}: VW {vw:.4f}, "
            f"rmm-jax {np.mean(ours):.4f} [{min(ours):.4f}, {max(ours):.4f}]")
    return {"vw_start": {**dataclasses.asdict(start), "name": start.name}, "scored_on": list(TUNED_ON),
            "base": float(np.concatenate([v[s.valid] for s, v in zip(tune, base_recall(tune, m).values())]).mean()),
            "rows": rows, "seeds": list(seeds), "reads": "nothing of 41-43 but their pairs (no gold, no questions)"}


# --------------------------------------------------------------------------- the ablation: VW's contextual bandit

CB_ARGS = "--cb_explore_adf --softmax --lambda 10 --cb_type dm -q QM -b 22 -l 0.1 --no_predict"


def det_top_m(pmf: np.ndarray, m: int) -> np.ndarray:
    """Deterministic top-m positions: highest probability first, ties in retriever order."""
    return np.lexsort((np.arange(pmf.size), -pmf))[:m]


def sample_slate(pmf: np.ndarray, m: int, rng: np.random.Generator):
    """Draw m positions from ``pmf`` without replacement (Plackett–Luce via Gumbel-top-m).

    Returns (positions (m,), p (m,)): p_j = pmf[a_j] / Σ_{k not drawn before j} pmf[k],
    the probability of draw j given the earlier ones (what slot j's CB example logs).
    """
    pmf = np.asarray(pmf, np.float64)
    with np.errstate(divide="ignore"):
        keys = np.log(pmf) + rng.gumbel(size=pmf.size)
    order = np.argsort(-keys, kind="stable")[:m]
    left = pmf.sum() - np.concatenate([[0.0], np.cumsum(pmf[order])[:-1]])
    return order, pmf[order] / np.maximum(left, 1e-300)


def run_cb_user(stream: Stream, cite, *, m: int, seed: int) -> dict:
    """The ablation: ``CB_ARGS``, one CB example per shown slot over the actions not yet shown,
    the shown memory's cost −1 if cited else 0 with its slot probability."""
    t_start = time.perf_counter()
    rng = user_rng(seed, stream.user_id)
    ws = pyvw.Workspace(f"{CB_ARGS} --random_seed {seed} --quiet")
    mem_text = [f"|M {features(v)}" for v in stream.bank]
    t_vw = 0.0
    recalls = np.zeros(stream.queries.shape[0])
    try:
        for t in range(stream.queries.shape[0]):
            ok = stream.cand_mask[t]
            cand = stream.cand[t][ok]
            useful = (stream.cand_gold if stream.cite_gold is None else stream.cite_gold)[t][ok]
            shared = f"shared |Q {features(stream.queries[t])}"
            base = stream.bank[cand] @ stream.queries[t]
            actions = [f"{mem_text[j]} |B s:{b:.6g}" for j, b in zip(cand, base)]
            t0 = time.perf_counter()
            pmf = np.asarray(ws.predict([shared] + actions), np.float64)
            t_vw += time.perf_counter() - t0
            k_m = min(m, cand.size)
            recalls[t] = _common.recall_at(stream.cand_gold[t][ok][det_top_m(pmf, k_m)], int(stream.num_gold[t]))
            shown, probs = sample_slate(pmf, k_m, rng)
            cited = cite(useful[shown][None], np.ones((1, k_m), bool), rng)[0]
            left = list(range(cand.size))
            t0 = time.perf_counter()
            for a, p, c in zip(shown, probs, cited):                 # slot j over the actions still unshown
                ws.learn([shared] + [(f"0:{-1.0 if c else 0.0:g}:{p:.6g} " if i == a else "") + actions[i]
                                     for i in left])
                left.remove(a)
            t_vw += time.perf_counter() - t0
    finally:
        ws.finish()
    return {"recall": recalls, "seconds": time.perf_counter() - t_start, "vw_seconds": t_vw}


def run_users(run_user, streams) -> dict:
    """All users one after the other, each with its own workspace: per-user recall and timing."""
    t0 = time.perf_counter()
    per_user, vw_s = {}, 0.0
    for s in streams:
        r = run_user(s)
        per_user[s.user_id] = r["recall"]
        vw_s += r["vw_seconds"]
    return {"recall": per_user, "seconds": time.perf_counter() - t0, "vw_core_seconds": vw_s}


# --------------------------------------------------------------------------- rmm-jax, same streams

def rmm_jax_online(streams, setting: rj.Setting, cite_fn, params=None):
    """rmm-jax's online loop, built once: ``run(seed) -> {user: (T,) prequential Recall@M}``.

    Every user starts from ``params`` (default: the identity reranker); all users run in one
    chunk. The only place this benchmark calls the library's online loop.
    """
    layout = setting.layout
    if params is None:
        params = rj.init_reranker(jax.random.key(0), streams[0].bank.shape[1], layout.kind, layout.hidden)
    program = rj.make_run(*setting, cite_fn=cite_fn)

    def run(seed: int) -> dict:
        result = rj.run_online(streams, program, params, seed=seed, users_per_chunk=len(streams))
        return {uid: np.asarray(r) for uid, r in result.recall.items()}

    return run


def timed_rmm_jax(run, seed: int, repeats: int) -> dict:
    """``repeats`` identical passes (deterministic given the seed): recall of the last, median seconds."""
    secs = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        per_user = run(seed)
        secs.append(time.perf_counter() - t0)
    return {"recall": per_user, "seconds": float(np.median(secs)), "timing_runs_s": secs}


# --------------------------------------------------------------------------- data

def synthetic_streams(n_users: int, t: int, n: int, d: int, k: int, seed: int = 0, rank_: int = 2,
                      planted: float = 3.0) -> list[Stream]:
    """Users whose one gold memory per query is the candidate with the highest
    qᵀm + planted · qᵀW*m (W* a random rank-``rank_`` matrix of unit spectral scale): the
    retriever ranks candidates by qᵀm alone (best first), so it finds the gold part of the
    time, and a learner that picks up the planted query × memory interaction finds it more often."""
    rng = np.random.default_rng(seed)
    out = []
    for u in range(n_users):
        w = rng.standard_normal((d, rank_)) @ rng.standard_normal((rank_, d)) / np.sqrt(d * rank_)
        bank = rng.standard_normal((n, d)).astype(np.float32)
        bank /= np.linalg.norm(bank, axis=1, keepdims=True)
        q = rng.standard_normal((t, d)).astype(np.float32)
        q /= np.linalg.norm(q, axis=1, keepdims=True)
        cand = np.argsort(-(q @ bank.T), axis=1, kind="stable")[:, :k].astype(np.int32)
        s = np.einsum("td,tkd->tk", q, bank[cand]) + planted * np.einsum("td,de,tke->tk", q, w, bank[cand])
        cand_gold = np.zeros((t, k), bool)
        cand_gold[np.arange(t), s.argmax(1)] = True
        out.append(Stream(f"syn{u}", bank, q, cand, np.ones((t, k), bool), cand_gold, np.ones(t, np.int32),
                          np.ones(t, bool)))
    return out


# --------------------------------------------------------------------------- summaries

def base_recall(streams, m: int) -> dict:
    """The retriever's Recall@m per query (its first m candidates)."""
    out = {}
    for s in streams:
        rel = s.cand_gold[:, :m] & s.cand_mask[:, :m]
        out[s.user_id] = np.where(s.num_gold > 0, rel.sum(1) / np.maximum(s.num_gold, 1), 0.0)
    return out


def floor_failures(out: dict) -> list[str]:
    """One line per floored learner and citation model whose held-out gain over the retriever is not positive."""
    bad = []
    for cm, res in out["results"].items():
        for name in (n for n in FLOORED if n in res):
            g = res[name]["gain_held_out"]
            if not g["mean"] > 0:
                bad.append(f"{res[name]['label']} under citations {cm!r}: held-out Recall@{out['m']} "
                           f"{res[name]['held_out_recall']['mean']:.4f} is not above the retriever's "
                           f"{out['base']['held_out']:.4f} (gain {_common.format_interval(g)})")
    return bad


# --------------------------------------------------------------------------- main

def tune_vw(streams, grid, cite, *, m, tau, seeds, log, init: Path | None = None):
    """Each setting on ``streams`` over ``seeds``, from the model saved at ``init`` (default: zero
    weights); returns (best setting, rows)."""
    rows = []
    ids = [s.user_id for s in streams]
    for st in grid:
        r = [_common.pooled(run_users(lambda s: run_vw_user(s, st, cite, m=m, tau=tau, seed=seed, init=init), streams)
                          ["recall"], streams, ids).mean() for seed in seeds]
        rows.append({**dataclasses.asdict(st), "recall": float(np.mean(r)), "per_seed": [float(x) for x in r]})
        log(f"  {st.args()}: Recall@{m} {rows[-1]['recall']:.4f}")
    return grid[int(np.argmax([r["recall"] for r in rows]))], rows


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0], formatter_class=_common.HelpFormatter)
    _common.add_data_option(ap)
    ap.add_argument("--synthetic", action="store_true", help="planted-bilinear synthetic users instead of LoCoMo")
    ap.add_argument("--quick", action="store_true", help="tiny run (with --synthetic: seconds)")
    ap.add_argument("--seeds", type=_common.int_list, default=None,
                    help="comma-separated seeds (default 0,1,2,3,4; quick 0,1)")
    ap.add_argument("--tune-seeds", type=_common.int_list, default=None,
                    help="seeds each tuning setting runs (default 0,1; quick 0)")
    ap.add_argument("--citations", type=_common.choice_list(*CITATIONS), default=",".join(CITATIONS),
                    help=f"comma-separated citation models (default {','.join(CITATIONS)})")
    ap.add_argument("--k", type=_common.positive_int, default=20)
    ap.add_argument("--m", type=_common.positive_int, default=5)
    ap.add_argument("--bits", type=int, default=22, help="VW hash bits (-b)")
    ap.add_argument("--lr", type=float, default=None, help="VW -l for every citation model; skips the tuning")
    ap.add_argument("--power-t", type=float, default=0.5, help="VW --power_t with --lr (default 0.5)")
    ap.add_argument("--tuned", type=_common.existing_path, default=None,
                    help="take each citation model's VW setting from this earlier result JSON; skips the tuning")
    ap.add_argument("--ablation", action=argparse.BooleanOptionalAction, default=False,
                    help="also run the cb_explore_adf ablation rows (about 4x VW's time)")
    ap.add_argument("--preset", default="default", choices=list(rj.PRESETS),
                    help="rmm-jax's preset (default: default, anchored at the retriever's best score; realistic: the "
                         "default until stop 52, which peer_vw.json ran)")
    ap.add_argument("--jax-timing-runs", type=int, default=5,
                    help="rmm-jax passes per seed, timed (median; a pass takes well under a second)")
    ap.add_argument("--start-check", action="store_true",
                    help="only the dialogue starts learned from 26+30's pairs and from every conversation's, scored "
                         "frozen on 26+30 (VW's start as --tuned chose it); see start_check")
    ap.add_argument("--json", type=Path, default=None, help="write the results here")
    ap.add_argument("--plot", type=Path, default=None, help="PNG of the held-out gains with their 95%% intervals")
    args = ap.parse_args(argv)
    if pyvw is None:
        sys.exit("error: vowpalwabbit is not installed (pip install vowpalwabbit, or the `bench` extra)")
    if args.start_check:
        return main_start_check(args)
    cms = args.citations
    seeds = args.seeds or ([0, 1] if args.quick else [0, 1, 2, 3, 4])
    tune_seeds = args.tune_seeds or ([0] if args.quick else [0, 1])
    log = lambda msg: print(msg, file=sys.stderr, flush=True)  # noqa: E731
    t_start = time.perf_counter()
    if args.synthetic:
        k, m = (6, 2) if args.quick else (args.k, args.m)
        # quick: 1,200 queries a user, since at realistic's lr 1e-4 a few hundred (75 updates)
        # move the reranker too little to rank differently, and the floor below would fail
        streams = synthetic_streams(3 if args.quick else 5, 1200 if args.quick else 400, 60 if args.quick else 400,
                                    8 if args.quick else 32, k)
        tuned_on, dataset, dialogue = (streams[0].user_id,), "synthetic", None
    else:
        k, m = args.k, args.m
        loco = _common.locomo_streams(_common.require_data(args.data), k, dialogue=True)
        streams, dialogue = loco.streams, loco.dialogue
        tuned_on, dataset = TUNED_ON, f"locomo:{args.data}"
    users = [s.user_id for s in streams]
    held = [u for u in users if u not in tuned_on]
    setting = rj.preset(args.preset, k=k, m=m)
    tau = setting.estimator.tau
    tune_streams = [s for s in streams if s.user_id in tuned_on]
    n_queries = sum(s.queries.shape[0] for s in streams)

    settings, tuning = {}, {}
    grid = None
    for cm in cms:
        if args.tuned is not None:
            try:
                prev = json.loads(args.tuned.read_text())["vw"]["setting"][cm]
                settings[cm] = VWSetting(float(prev["lr"]), float(prev["power_t"]), float(prev["l2"]), args.bits)
            except (OSError, ValueError, KeyError, TypeError) as e:
                sys.exit(f"error: --tuned {args.tuned}: no VW setting for citations {cm!r} ({type(e).__name__}: {e})")
        elif args.lr is not None:
            settings[cm] = VWSetting(args.lr, args.power_t, 0.0, args.bits)
        else:
            lrs, pts = ((0.3, 1.0), (0.5,)) if args.quick else ((0.1, 0.3, 1.0, 3.0), (0.5, 0.0))
            grid = [VWSetting(lr, pt, 0.0, args.bits) for pt, lr in itertools.product(pts, lrs)]
            log(f"tuning VW on {','.join(tuned_on)} under citations {cm!r} (seeds {tune_seeds}) ...")
            settings[cm], tuning[cm] = tune_vw(tune_streams, grid, CITATIONS[cm].numpy, m=m, tau=tau,
                                               seeds=tune_seeds, log=log)
        log(f"VW under {cm!r}: {settings[cm].args()}")

    base = base_recall(streams, m)
    runs = {cm: {name: [] for name in LEARNERS if not (name == "vw_cb" and not args.ablation)
                 and not (name in DIALOGUE_LEARNERS and dialogue is None)} for cm in cms}
    compile_s = {}
    load = _common.LoadWatch()       # the 1-minute load average at the start and after each seed's runs
    dim = int(streams[0].bank.shape[1])
    hybrid_setting = rj.preset(args.preset, k=k, m=m, scope="hybrid",
                               rank=min(rj.Scope.named("hybrid").rank, dim - 1))   # the default rank, below d
    vw_start = vw_start_rows = None
    settings_warm, tuning_warm = {}, {}
    if dialogue is not None:     # one start for every seed and citation model, both learners on the same pairs
        warm = rj.init_reranker(jax.random.key(0), dim, setting.layout.kind, setting.layout.hidden)
        warm = pretrain(warm, dialogue, [], dataclasses.replace(DIALOGUE_RECIPE, m=m), seed=0)[0]
        vw_warm_dir = tempfile.TemporaryDirectory()
        log(f"tuning VW's dialogue start on {','.join(tuned_on)} ...")
        vw_start, vw_start_rows = tune_vw_start([d for d in dialogue if d.user_id in tuned_on], tune_streams,
                                                bits=args.bits, tau=tau, m=m, folder=Path(vw_warm_dir.name), log=log)
        t0 = time.perf_counter()
        vw_init = vw_dialogue_start(dialogue, vw_start, bits=args.bits, tau=tau,
                                    path=Path(vw_warm_dir.name) / "start.vw")
        log(f"VW's dialogue start: {vw_start.name} ({time.perf_counter() - t0:.0f} s on every conversation's pairs)")
        held_streams = [s for s in streams if s.user_id in held]     # both starts ranking alone, learning nothing
        start_frozen = {"rmm_jax": frozen_mean(warm, held_streams, m),
                        "vw": vw_frozen_recall(vw_init, held_streams, bits=args.bits, tau=tau, m=m)}
        log(f"the starts frozen, held-out Recall@{m}: rmm-jax {start_frozen['rmm_jax']:.4f}, "
            f"VW {start_frozen['vw']:.4f}")
        # VW's online knobs again, now from its start (learned on the tuning conversations' pairs)
        tune_init = vw_dialogue_start([d for d in dialogue if d.user_id in tuned_on], vw_start, bits=args.bits,
                                      tau=tau, path=Path(vw_warm_dir.name) / "tune_start.vw")
        for cm in cms:
            if grid is None:                     # --lr or --tuned: no tuning, the same setting as from zero
                settings_warm[cm] = settings[cm]
                continue
            log(f"tuning VW from its dialogue start on {','.join(tuned_on)} under citations {cm!r} ...")
            settings_warm[cm], tuning_warm[cm] = tune_vw(tune_streams, grid, CITATIONS[cm].numpy, m=m, tau=tau,
                                                         seeds=tune_seeds, log=log, init=tune_init)
            log(f"VW from its dialogue start under {cm!r}: {settings_warm[cm].args()}")
    for cm in cms:
        cit = CITATIONS[cm]
        rmm = rmm_jax_online(streams, setting, cit.library())
        hybrid = rmm_jax_online(streams, hybrid_setting, cit.library())
        t0 = time.perf_counter()
        rmm(seeds[0])                                                # compile + first pass
        compile_s[cm] = time.perf_counter() - t0
        hybrid(seeds[0])
        if dialogue is not None:
            rmm_warm = rmm_jax_online(streams, setting, cit.library(), warm)
            rmm_warm(seeds[0])                                       # its compile, not timed
        for seed in seeds:                                           # interleaved: VW, rmm-jax, ablation per seed
            got = {"vw": run_users(lambda s: run_vw_user(s, settings[cm], cit.numpy, m=m, tau=tau, seed=seed),
                                   streams),
                   "rmm_jax": timed_rmm_jax(rmm, seed, args.jax_timing_runs),
                   "rmm_jax_hybrid": timed_rmm_jax(hybrid, seed, 1)}
            if dialogue is not None:
                got["rmm_jax_dialogue"] = timed_rmm_jax(rmm_warm, seed, 1)
                got["vw_dialogue"] = run_users(lambda s: run_vw_user(s, settings_warm[cm], cit.numpy, m=m, tau=tau,
                                                                     seed=seed, init=vw_init), streams)
            if "vw_cb" in runs[cm]:
                got["vw_cb"] = run_users(lambda s: run_cb_user(s, cit.numpy, m=m, seed=seed), streams)
            load.sample()
            for name, r in got.items():
                runs[cm][name].append({
                    "seed": seed, "recall": r["recall"], "seconds": r["seconds"],
                    "queries_per_s": n_queries / r["seconds"],
                    **{x: r[x] for x in ("vw_core_seconds", "timing_runs_s") if x in r}})
            log(f"  {cm} seed {seed}: held-out Recall@{m} " + ", ".join(
                f"{name} {_common.pooled(runs[cm][name][-1]['recall'], streams, held).mean():.4f} "
                f"({runs[cm][name][-1]['queries_per_s']:.0f} q/s)" for name in runs[cm]))

    def recalls(name, cm):
        return [r["recall"] for r in runs[cm][name]]

    def per_query(name, cm, us):
        return np.stack([_common.pooled(r, streams, us) for r in recalls(name, cm)])

    def paired(a, b, cm, us):
        """Learner a − learner b per query and seed, with an interval that resamples conversations, seeds and
        queries."""
        return _common.paired_gain(recalls(a, cm), recalls(b, cm), streams, us, by_user=True)

    load_1min = _common.spread(load.samples)          # the samples the timings ran between, as before
    load_watch = load.result()                        # + one at the end, whether it was noisy, others' CPU
    base_held, base_all = _common.pooled(base, streams, held), _common.pooled(base, streams, users)
    results, ratios = {}, {}
    for cm in cms:
        results[cm] = {}
        for name in runs[cm]:
            ph, pa = per_query(name, cm, held), per_query(name, cm, users)
            results[cm][name] = {
                "label": learner_label(name, args.preset),
                "held_out_recall": {"mean": float(ph.mean()), **_common.spread(ph.mean(1))},
                "all_recall": {"mean": float(pa.mean()), **_common.spread(pa.mean(1))},
                "gain_held_out": _common.paired_gain(recalls(name, cm), [base], streams, held, by_user=True),
                "gain_all": _common.paired_gain(recalls(name, cm), [base], streams, users, by_user=True),
                "per_user": {u: float(per_query(name, cm, [u]).mean()) for u in users},
                "queries_per_s": _common.spread([r["queries_per_s"] for r in runs[cm][name]]),
                "runs": [{k_: v for k_, v in r.items() if k_ != "recall"} for r in runs[cm][name]]}
        ratios[cm] = {
            "rmm_jax_minus_vw_all": paired("rmm_jax", "vw", cm, users),
            "rmm_jax_minus_vw_held_out": paired("rmm_jax", "vw", cm, held),
            "rmm_jax_hybrid_minus_vw_all": paired("rmm_jax_hybrid", "vw", cm, users),
            "rmm_jax_hybrid_minus_rmm_jax_all": paired("rmm_jax_hybrid", "rmm_jax", cm, users),
            **({"rmm_jax_dialogue_minus_vw_all": paired("rmm_jax_dialogue", "vw", cm, users),
                "rmm_jax_dialogue_minus_vw_held_out": paired("rmm_jax_dialogue", "vw", cm, held),
                "rmm_jax_dialogue_minus_vw_dialogue_all": paired("rmm_jax_dialogue", "vw_dialogue", cm, users),
                "rmm_jax_dialogue_minus_rmm_jax_all": paired("rmm_jax_dialogue", "rmm_jax", cm, users),
                "vw_dialogue_minus_vw_all": paired("vw_dialogue", "vw", cm, users)}
               if dialogue is not None else {}),
            "rmm_jax_over_vw_queries_per_s": _common.spread(
                [a["queries_per_s"] / b["queries_per_s"] for a, b in zip(runs[cm]["rmm_jax"], runs[cm]["vw"])])}
    out = {"dataset": dataset, "k": k, "m": m, "d": int(streams[0].bank.shape[1]), "tau": tau, "queries": n_queries,
           "users": users, "held_out": held, "tuned_on": list(tuned_on), "seeds": seeds,
           "citations": {cm: CITATIONS[cm].what for cm in cms},
           "base": {"held_out": float(base_held.mean()), "all": float(base_all.mean()),
                    "tuning_users": float(_common.pooled(base, streams, list(tuned_on)).mean())},
           "vw": {"args": {cm: settings[cm].args().replace(" --random_seed 0", "") for cm in cms},
                  "setting": {cm: dataclasses.asdict(settings[cm]) for cm in cms},
                  "tuning": tuning, "tune_seeds": tune_seeds if tuning else None,
                  **({"dialogue_start": {"chosen": dataclasses.asdict(vw_start), "name": vw_start.name,
                                         "tuning": vw_start_rows,
                                         "online_args": {cm: settings_warm[cm].args().replace(" --random_seed 0", "")
                                                         for cm in cms},
                                         "online_tuning": tuning_warm,
                                         "frozen_held_out": start_frozen["vw"],
                                         "rule": "the best frozen Recall@M on the tuning conversations' questions, "
                                                 "each setting learning their pairs only"}}
                     if vw_start is not None else {}),
                  "version": _vw_version()},
           "vw_cb": {"args": CB_ARGS, "ablation": True},
           "rmm_jax": {"preset": args.preset, "config": describe(*setting),
                       "init": "identity (the online row of quality_locomo.py)", "compile_s": compile_s,
                       "hybrid_config": describe(*hybrid_setting),
                       **({"dialogue_start": {
                           "recipe": {**dataclasses.asdict(DIALOGUE_RECIPE), "m": m, "seed": 0},
                           "pairs": int(sum(s.queries.shape[0] for s in dialogue)),
                           "frozen_held_out": start_frozen["rmm_jax"],
                           "what": "rmm-jax pretrain --labels dialogue on all five conversations' memories (no gold, "
                                   "no questions); one start for every seed and citation model; VW's workspace "
                                   "learns the same pairs (vw_dialogue_start), its -l, passes and weighting tuned "
                                   "on 26 and 30 (vw.dialogue_start)"}}
                          if dialogue is not None else {})},
           "intervals": "gains and paired differences resample conversations, seeds and queries",
           "results": results, "ratios": ratios,
           "timing": {"vw": "one pass: per user a fresh workspace and its memories as VW text, then per query the "
                            "retriever logits, K predicts, ranking, Gumbel draw, citations and M learns "
                            "(vw_core_seconds: predict and learn calls only); single-threaded",
                      "rmm_jax": "drive(): host padding, the compiled run over one chunk of all users, results back; "
                                 "after compile (compile_s: first pass with compile); median of "
                                 f"{args.jax_timing_runs} identical passes per seed",
                      "rmm_jax_hybrid": "as rmm_jax in scope hybrid, one pass per seed",
                      "rmm_jax_dialogue": "as rmm_jax from the dialogue start, one pass per seed (pretraining "
                                          "not timed)",
                      "vw_dialogue": "as vw from the dialogue start's saved model (its training not timed)",
                      "vw_cb": "as vw, with CB_ARGS",
                      "order": "per seed: vw, rmm_jax, rmm_jax_hybrid, rmm_jax_dialogue, vw_dialogue, vw_cb back "
                               "to back",
                      "load_avg_1min": load_1min, "load": load_watch, "backend": jax.default_backend(),
                      "jax": jax.__version__},
           "seconds": round(time.perf_counter() - t_start, 1)}
    if dialogue is not None:
        vw_warm_dir.cleanup()
    failures = floor_failures(out)
    out["targets"] = [{"name": f"{results[cm][n]['label']} above the retriever on held-out Recall@{m}, citations {cm}",
                       "value": results[cm][n]["gain_held_out"]["mean"], "target": "> 0",
                       "pass": results[cm][n]["gain_held_out"]["mean"] > 0} for cm in cms for n in FLOORED
                      if n in results[cm]]
    print(report(out))
    if args.json:
        _common.write_result(args.json, out)
    if args.plot:
        plot(out, args.plot)
    if failures:
        sys.exit("error: a learner ends below the retriever (a bug in the benchmark, not a result):\n  "
                 + "\n  ".join(failures))
    return out


def main_start_check(args) -> dict:
    """``--start-check``: :func:`start_check` with VW's start as ``--tuned`` recorded it."""
    if args.tuned is None:
        sys.exit("error: --start-check needs --tuned FILE (a peer_vw.json that chose VW's dialogue start)")
    try:
        chosen = json.loads(args.tuned.read_text())["vw"]["dialogue_start"]["chosen"]
        start = VWStart(float(chosen["lr"]), int(chosen["passes"]), bool(chosen["balanced"]))
    except (OSError, ValueError, KeyError, TypeError) as e:
        sys.exit(f"error: --tuned {args.tuned}: no VW dialogue start ({type(e).__name__}: {e})")
    log = lambda msg: print(msg, file=sys.stderr, flush=True)  # noqa: E731
    t0 = time.perf_counter()
    loco = _common.locomo_streams(_common.require_data(args.data), args.k, dialogue=True)
    seeds = args.seeds or [0, 1, 2, 3, 4]
    tau = rj.preset(args.preset, k=args.k, m=args.m).estimator.tau
    with tempfile.TemporaryDirectory() as folder:
        out = start_check(loco.streams, loco.dialogue, start, bits=args.bits, tau=tau, m=args.m, seeds=seeds,
                          folder=Path(folder), log=log)
    out = {"dataset": f"locomo:{args.data}", "k": args.k, "m": args.m, "tau": tau, "tuned": str(args.tuned), **out,
           "seconds": round(time.perf_counter() - t0, 1)}
    if args.json:
        _common.write_result(args.json, out)
    return out


def plot(out: dict, path) -> None:
    """The held-out gains over the retriever with their 95% intervals, one row per learner and citation model."""
    from rmm_jax.online.plot import plot_gains

    plot_gains({f"{r['label'].replace(' (ablation)', ' (abl.)')} [{cm}]": r["gain_held_out"]
                for cm, res in out["results"].items() for n, r in res.items()}, path,
               title=f"{out['dataset'].split(':')[0]}: held-out Recall@{out['m']} gain over the retriever\n"
                     f"{len(out['seeds'])} seeds, 95% interval (grey: contains 0)")


def _vw_version():
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("vowpalwabbit")
    except PackageNotFoundError:  # pragma: no cover
        return None


def report(out: dict) -> str:
    m = out["m"]
    f = lambda iv, p=4: f"{iv['median']:.{p}f} [{iv['min']:.{p}f}, {iv['max']:.{p}f}]"  # noqa: E731
    la = out["timing"]["load_avg_1min"]
    lines = [f"Peer comparison on {out['dataset']} ({out['queries']} queries, {len(out['users'])} users, d={out['d']}, "
             f"K={out['k']}, M={m}, tau={out['tau']}); held out: {','.join(out['held_out'])}; seeds {out['seeds']}; "
             f"load avg {la['min']:.2f}-{la['max']:.2f}" + (" (noisy)" if out["timing"]["load"]["noisy"] else ""),
             f"  retriever held-out Recall@{m}: {out['base']['held_out']:.4f}"]
    for cm, res in out["results"].items():
        lines += [f"citations {cm}: {out['citations'][cm]}",
                  f"  {'learner':<30} {'held-out R@%d' % m:>13} {'gain over retriever [95%]':>30} "
                  f"{'queries/s median [min, max]':>30}"]
        for name, r in res.items():
            lines.append(f"  {r['label']:<30} {r['held_out_recall']['mean']:>13.4f} "
                         f"{_common.format_interval(r['gain_held_out']):>30} {f(r['queries_per_s'], 1):>30}")
        ra = out["ratios"][cm]
        lines += [f"  rmm-jax - VW, all users: {_common.format_interval(ra['rmm_jax_minus_vw_all'])}; "
                  f"held-out: {_common.format_interval(ra['rmm_jax_minus_vw_held_out'])}; hybrid - VW: "
                  f"{_common.format_interval(ra['rmm_jax_hybrid_minus_vw_all'])}; hybrid - rmm-jax: "
                  f"{_common.format_interval(ra['rmm_jax_hybrid_minus_rmm_jax_all'])}",
                  *([f"  from a dialogue start: rmm-jax - VW, all users: "
                     f"{_common.format_interval(ra['rmm_jax_dialogue_minus_vw_all'])}; held-out: "
                     f"{_common.format_interval(ra['rmm_jax_dialogue_minus_vw_held_out'])}; rmm-jax - VW, both from "
                     f"it: {_common.format_interval(ra['rmm_jax_dialogue_minus_vw_dialogue_all'])}; VW from it - VW: "
                     f"{_common.format_interval(ra['vw_dialogue_minus_vw_all'])}"]
                    if "rmm_jax_dialogue_minus_vw_all" in ra else []),
                  f"  "
                  f"rmm-jax / VW queries/s: {f(ra['rmm_jax_over_vw_queries_per_s'], 1)} "
                  f"(rmm-jax compile + first pass {out['rmm_jax']['compile_s'][cm]:.1f} s)",
                  f"  VW: {out['vw']['args'][cm]}"]
    for t in out["targets"]:
        lines.append(f"  {'PASS' if t['pass'] else 'FAIL'}  {t['name']}: {t['value']:+.4f} (target {t['target']})")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
