"""Validate the off-policy estimators of ``rmm-jax evaluate`` against a truth they do not share code with.

    python benchmarks/ope_validation.py --seeds 100 --plot benchmarks/results/ope_validation.png \\
        --json benchmarks/results/ope_validation.json
    python benchmarks/ope_validation.py --replot --plot benchmarks/results/ope_validation.png \\
        --json benchmarks/results/ope_validation.json  # redraw only

Set-up (LoCoMo, turn granularity, MiniLM, K=20, M=5, τ=0.1, oracle citations with the default
precision/recall 0.876/0.858, as ``rmm-jax simulate``):

* **target** π: a reranker pretrained on conversations 26 and 30 (listwise, 10 epochs),
  sampling Plackett–Luce at τ; its value is estimated on the calls of 41, 42 and 43.
* scenario ``fixed``: the logging policy μ is the base retriever (identity reranker) at
  τ; each seed draws its selections and citations with the library's act-and-cite step
  (what ``simulate`` runs per batch) and logs the behaviour's ``logits`` and ``log_prob``:
  every estimator applies.
* scenario ``adaptive``: the log of ``simulate --log-out`` itself: μ starts at the base
  retriever and learns online, so each record's ``log_prob`` is that of the policy of its
  time; only ``log_prob`` is logged, so only IPS and SNIPS apply (both stay valid under
  adaptive logging).

Every seed's log is written as JSONL and read back by
:func:`rmm_jax.online.ope.evaluate_log`, the function behind ``rmm-jax evaluate``.

**Truth.** The estimand is π's expected value averaged over the evaluated calls. Every
row is scored against the *enumerated* truth, computed here with NumPy
only (no code of :mod:`rmm_jax.online.ope`, which the estimators use):

* **enumeration** (:func:`enumerate_pl`): on every call, all K!/(K−M)! = 1,860,480
  ordered selections, in :func:`itertools.permutations` order, each with its
  Plackett–Luce probability Π_j w_{a_j} / Σ_{k ∉ {a_1..a_{j−1}}} w_k, w = exp(s/τ). The
  count g of gold memories shown gives Recall@M = g/|gold| and the oracle's expected
  cited count r·g + q(g)·(M−g), q(g) = min(1, r·g·(1−p) / (p·(M−g))) (the rates of
  :func:`rmm_jax.data.citations.oracle_cite`, :func:`expected_cited`). Its own error is
  float64 rounding: the JSON reports the largest |Σ P − 1| over calls.
* **on-policy Monte Carlo** (the check of the enumeration and of the citation formula):
  π run ``--replicates`` times on every call with the library's act-and-cite step (its
  Gumbel-top-M sampler and its citation draw); the JSON gives the mean, its standard
  error over replicates and the z-score of enumeration − Monte Carlo.

Per scenario, metric and estimator over the seeds: bias (mean of estimate − truth) with
its 95% interval over seeds, RMSE, coverage of the bootstrap 95% interval (with a Wilson
95% interval for the coverage itself), mean interval width and mean ESS. A seed whose
estimate ``evaluate`` reports as unreliable (no value; see "Reliability" in
:mod:`rmm_jax.online.ope`) is left out of that row and counted as ``withheld``, with its
reasons.

**Checks of the library against the enumeration** (no estimator rows; the ``direct``
Recall row of ``evaluate`` is not an estimate: it has no sampling error, and compared
with a truth from the same marginals it was the truth compared with itself): the largest
difference between ``rmm_jax.online.ope.slot_marginals`` (what IIPS uses, here its exact
branch at K=20) and the enumerated marginals on every real call, for π and μ, and
``direct`` minus the enumerated Recall@M.
"""
from __future__ import annotations

import argparse
import functools
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable, NamedTuple

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import _common  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from rmm_jax.core.reranker import init_reranker, score_batch  # noqa: E402
from rmm_jax.core.types import QueryBatch  # noqa: E402
from rmm_jax.data import load_locomo  # noqa: E402
from rmm_jax.data.citation_log import write_log  # noqa: E402
from rmm_jax.data.citations import DEFAULT_PRECISION, DEFAULT_RECALL  # noqa: E402
from rmm_jax.data.embed import Embedder  # noqa: E402
from rmm_jax.data.store import open_store, write_store  # noqa: E402
from rmm_jax.online.pretrain import PretrainConfig, pretrain  # noqa: E402
from rmm_jax.online.streams import load_streams  # noqa: E402
from rmm_jax.persist.policy_store import PolicyMeta, PolicyStore  # noqa: E402

METRICS = ("cited", "cite_rate", "recall")
COVERAGE_TARGET = 0.9


# --------------------------------------------------------------------------- the truth (NumPy only)
@functools.lru_cache(maxsize=4)
def prefix_tree(k: int, m: int) -> tuple[tuple[np.ndarray, np.ndarray, np.ndarray], ...]:
    """Every ordered selection of ``m`` of ``k`` candidates as a prefix tree: per level j,
    ``(free, parent, appended)``: ``free`` (k!/(k−j)!, k) marks the candidates not in each
    prefix of length j, and prefix i of length j+1 is prefix ``parent[i]`` followed by
    candidate ``appended[i]``. The leaves, level m−1, are the k!/(k−m)! selections in
    :func:`itertools.permutations` order."""
    levels, prefixes = [], np.zeros((1, 0), np.int64)
    for _ in range(m):
        free = np.ones((len(prefixes), k), bool)
        np.put_along_axis(free, prefixes, False, axis=1)
        parent, appended = np.nonzero(free)
        levels.append((free, parent, appended))
        prefixes = np.concatenate([prefixes[parent], appended[:, None]], axis=1)
    return tuple(levels)


def enumerate_pl(logits, mask, gold, m: int) -> dict:
    """Exact Plackett–Luce quantities by enumerating every ordered selection of ``m``.

    Per call i (rows of ``logits``/``mask``/``gold``, (n, K)): ``gold_shown`` (n, m+1),
    P(g gold candidates among the m shown); ``marginals`` (n, m, K), P(candidate a is drawn
    j-th); ``mass_error``, the largest |Σ_selections P − 1|. A selection's probability is
    the product over its draws of w_a / Σ_{k not drawn before} w_k, w = exp(logits) (0
    where masked), built one draw at a time along :func:`prefix_tree`.
    """
    logits = np.asarray(logits, np.float64)
    mask, gold = np.asarray(mask, bool), np.asarray(gold, bool) & np.asarray(mask, bool)
    n, k = logits.shape
    if mask.sum(1).min() < m:
        raise ValueError("every call needs at least M valid candidates")
    levels = prefix_tree(k, m)
    gold_shown, marginals, err = np.zeros((n, m + 1)), np.zeros((n, m, k)), 0.0
    for i in range(n):
        z = np.where(mask[i], logits[i], -np.inf)
        w = np.exp(z - z.max())
        p, g = np.ones(1), np.zeros(1, np.int64)
        for j, (free, parent, a) in enumerate(levels):
            left = free @ w                     # a sum of the undrawn weights, not total − drawn:
            p = p[parent] * w[a] / left[parent]  # no cancellation when the drawn ones dominate
            g = g[parent] + gold[i, a]
            marginals[i, j] = np.bincount(a, weights=p, minlength=k)
        gold_shown[i] = np.bincount(g, weights=p, minlength=m + 1)
        err = max(err, abs(p.sum() - 1.0))
    return {"gold_shown": gold_shown, "marginals": marginals, "mass_error": err}


def expected_cited(g, m: int, precision: float, recall: float) -> np.ndarray:
    """E[cited | g gold among m shown] under the precision/recall oracle: gold cited with
    probability r, non-gold with q = min(1, r·g·(1−p) / (p·(m−g)))."""
    g = np.asarray(g, np.float64)
    q = np.minimum(1.0, recall * g * (1 - precision) / (precision * np.maximum(m - g, 1)))
    return recall * g + q * (m - g)


def truth_per_call(enum: dict, num_gold, valid, m: int, precision: float, recall: float) -> dict:
    """Per call: the exact expected cited count, cite rate and Recall@M (NaN without gold)."""
    g = np.arange(m + 1)
    cited = np.where(valid, enum["gold_shown"] @ expected_cited(g, m, precision, recall), 0.0)
    rec = np.where(valid, enum["gold_shown"] @ g / np.maximum(num_gold, 1), np.nan)
    return {"cited": cited, "cite_rate": cited / m, "recall": rec}


def on_policy_mc(act_and_cite, arrays, m: int, replicates: int, seed: int) -> dict:
    """π's value simulated ``replicates`` times on every call with the library's act-and-cite
    step: per metric the mean over replicates and its standard error."""
    args = tuple(jnp.asarray(arrays[x]) for x in ("scores", "mask", "gold", "valid"))
    valid, ng = arrays["valid"], np.maximum(arrays["num_gold"], 1)
    per = {x: [] for x in METRICS}
    for r in range(replicates):
        sel, cited, _ = (np.asarray(x) for x in act_and_cite(*args, jax.random.fold_in(jax.random.key(seed), r)))
        shown_gold = np.take_along_axis(arrays["gold"], np.maximum(sel, 0), axis=1) & (sel >= 0)
        c = cited.sum(1)
        per["cited"].append(c.mean())
        per["cite_rate"].append((c / m).mean())
        per["recall"].append((shown_gold.sum(1) / ng)[valid].mean())
    return {x: {"mean": float(np.mean(v)), "se": float(np.std(v, ddof=1) / np.sqrt(replicates))}
            for x, v in per.items()}


# --------------------------------------------------------------------------- the online loop (one place)
class Loop(NamedTuple):
    act_and_cite: Callable      # (scores, mask, gold, valid, key) -> (selected, cited, log_prob), jitted
    learner_log: Callable       # (streams, seed) -> the records ``simulate --log-out`` writes


def online_loop(k: int, m: int, tau: float, precision: float, recall: float) -> Loop:
    """Every call of this benchmark into the online loop's API (``preset``,
    ``simulated_batch``, ``make_run``, ``run_online``), in one place: the default setting
    at K, M and τ, citations from the precision/recall oracle."""
    from rmm_jax.core.config import preset
    from rmm_jax.core.update import simulated_batch
    from rmm_jax.data.citations import precision_recall_oracle
    from rmm_jax.online.loop import make_run
    from rmm_jax.online.run import run_online

    setting = preset("default", k=k, m=m, tau=tau)
    cite = precision_recall_oracle(precision, recall)
    program = make_run(*setting, cite_fn=cite)

    @jax.jit
    def act_and_cite(scores, mask, gold, valid, key):
        n, kk = scores.shape
        qb = QueryBatch(q=jnp.zeros((n, 1)), m=jnp.zeros((n, kk, 1)), mask=mask, valid=valid, gold=gold)
        b = simulated_batch(setting.estimator, m, cite, scores, qb, key)
        return b.selected, b.cited, b.logged_log_prob

    def learner_log(streams, seed):
        p0 = init_reranker(jax.random.key(seed), streams[0].bank.shape[1])
        return run_online(streams, program, p0, seed=seed, want_log=True, users_per_chunk=len(streams)).records

    return Loop(act_and_cite, learner_log)


# --------------------------------------------------------------------------- logs
def call_arrays(streams, params):
    """Scores of every query's K candidates under ``params``, with the masks and gold."""
    parts: dict[str, list] = {x: [] for x in ("scores", "mask", "gold", "num_gold", "valid", "cand")}
    user, query = [], []
    for s in streams:
        parts["scores"].append(np.asarray(score_batch(params, jnp.asarray(s.queries), jnp.asarray(s.bank[s.cand]),
                                                      jnp.asarray(s.cand_mask))))
        for x, v in (("mask", s.cand_mask), ("gold", s.cand_gold), ("num_gold", s.num_gold), ("valid", s.valid),
                     ("cand", s.cand)):
            parts[x].append(v)
        user += [s.user_id] * len(s.query_ids)
        query += list(s.query_ids)
    out = {x: np.concatenate(v) for x, v in parts.items()}
    out["scores"] = out["scores"].astype(np.float32)
    return {**out, "user": user, "query": query}


def fixed_log(loop: Loop, arrays, memory_ids, tau, seed, path):
    """One log of the base-retriever policy (identity reranker at τ), with its logits."""
    out = loop.act_and_cite(*(jnp.asarray(arrays[x]) for x in ("scores", "mask", "gold", "valid")),
                            jax.random.key(seed))
    sel, cited, lp = (np.asarray(x) for x in out)
    logits = arrays["scores"] / np.float32(tau)
    records = []
    for i in range(len(sel)):
        ids = memory_ids[arrays["user"][i]]
        cand = [ids[j] for j in arrays["cand"][i]]
        shown = [p for p in sel[i] if p >= 0]
        records.append({"user_id": arrays["user"][i], "query_id": arrays["query"][i], "candidates": cand,
                        "selected": [cand[p] for p in shown], "cited": [cand[p] for p, c in zip(shown, cited[i]) if c],
                        "log_prob": float(lp[i]), "logits": [float(x) for x in logits[i]]})
    write_log(path, records)


# --------------------------------------------------------------------------- summaries
def wilson(hits: int, n: int, z: float = 1.96) -> list[float]:
    """Wilson score 95% interval of a proportion ``hits / n`` (Wilson 1927)."""
    p = hits / n
    centre, half = p + z * z / (2 * n), z * np.sqrt(p * (1 - p) / n + z * z / (4 * n * n))
    return [float((centre - half) / (1 + z * z / n)), float((centre + half) / (1 + z * z / n))]


def summarise(runs: list[dict], truth: dict) -> dict:
    """Per metric and estimator, over the seeds whose estimate ``evaluate`` reported as
    reliable: bias (± its 95% interval), RMSE, coverage of the 95% interval (± Wilson),
    mean width and mean ESS, all against ``truth``; ``withheld``: the seeds it reported
    as unreliable (no value), with their reasons; ``coverage_all`` (± Wilson): the
    coverage over every seed, a withheld one counted as a miss (a user who asked got no
    interval that holds the truth)."""
    out = {}
    for metric in METRICS:
        per, t = {}, truth[metric]
        for name in (n for n in runs[0]["estimates"][metric] if n not in ("logged", "direct")):
            every = [r["estimates"][metric][name] for r in runs]
            rows = [x for x in every if x["value"] is not None]
            withheld = sorted({x.get("reason", "") for x in every if x["value"] is None})
            row = {"truth": "enumeration", "seeds": len(rows), "withheld": len(every) - len(rows),
                   **({"withheld_reasons": withheld} if withheld else {})}
            if rows:
                est = np.array([x["value"] for x in rows])
                lo, hi = np.array([x["ci95"][0] for x in rows]), np.array([x["ci95"][1] for x in rows])
                err, hits, s = est - t, int(((lo <= t) & (t <= hi)).sum()), len(rows)
                half = 1.96 * err.std(ddof=1) / np.sqrt(s) if s > 1 else float("nan")
                row.update({"mean": float(est.mean()), "bias": float(err.mean()),
                            "bias_ci95": [float(err.mean() - half), float(err.mean() + half)],
                            "rmse": float(np.sqrt((err ** 2).mean())), "coverage": hits / s,
                            "coverage_ci95": wilson(hits, s), "coverage_all": hits / len(every),
                            "coverage_all_ci95": wilson(hits, len(every)), "mean_width": float((hi - lo).mean())})
                if all(x.get("ess") is not None for x in rows):
                    row["mean_ess"] = float(np.mean([x["ess"] for x in rows]))
            per[name] = row
        per["logged"] = {"mean": float(np.mean([r["estimates"][metric]["logged"]["value"] for r in runs]))}
        out[metric] = per
    return out


def per_seed(runs: list[dict]) -> dict:
    """Every seed's estimate and 95% interval, as columns: ``{metric: {estimator: {value,
    lo, hi}}}``, rounded to 6 decimals (the coverage can be recomputed from them)."""
    def cols(metric, name, pick):   # None: reported unreliable, no value
        return [None if r["estimates"][metric][name]["value"] is None else round(pick(r["estimates"][metric][name]), 6)
                for r in runs]
    return {metric: {name: {"value": cols(metric, name, lambda e: e["value"]),
                            "lo": cols(metric, name, lambda e: e["ci95"][0]),
                            "hi": cols(metric, name, lambda e: e["ci95"][1])}
                     for name in runs[0]["estimates"][metric] if name != "direct"}
            for metric in runs[0]["estimates"]}


def targets(scenarios: dict) -> list[dict]:
    """Coverage ≥ 0.9 against the enumerated truth for SNIPS and RIPS (both metrics with
    distinct rewards; cite rate is cited / M with M fixed, so it covers exactly like cited)."""
    out = []
    for sc, est in (("fixed", "snips"), ("fixed", "rips"), ("adaptive", "snips")):
        for metric in ("cited", "recall"):
            row = scenarios.get(sc, {}).get("summary", {}).get(metric, {}).get(est)
            if row is not None:
                cov = row.get("coverage")       # None: every seed reported unreliable
                out.append({"name": f"{sc} {est} {metric}: coverage of the 95% interval "
                                    f"({row['seeds']} reliable seeds of {row['seeds'] + row['withheld']})",
                            "value": cov, "withheld": row["withheld"], "coverage_all": row.get("coverage_all", 0.0),
                            "target": f">= {COVERAGE_TARGET}", "pass": cov is not None and cov >= COVERAGE_TARGET,
                            "pass_all": row.get("coverage_all", 0.0) >= COVERAGE_TARGET})
    return out


def plot(scenarios: dict, truth: dict, path: Path) -> None:
    """Every seed's 95% interval of the cited count, sorted by estimate, against the
    enumerated truth (red: the interval misses it)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    order = ("ips", "snips", "rips", "snrips", "iips")
    rows = {sc: [est for est in order if est in scenarios[sc]["summary"]["cited"]]
            for sc in sorted(scenarios, key=lambda x: x != "fixed")}
    cols = max(len(v) for v in rows.values())
    fig, axes = plt.subplots(len(rows), cols, figsize=(2.8 * cols, 3.0 * len(rows)), sharey=True, squeeze=False)
    ends = np.array([v for sc, names in rows.items() for est in names for x in ("lo", "hi")
                     for v in scenarios[sc]["per_seed"]["cited"][est][x] if v is not None])
    low, high = np.quantile(ends, [0.005, 0.995])      # a few heavy-tailed intervals would flatten the rest
    pad = 0.05 * (high - low)
    axes[0][0].set_ylim(low - pad, high + pad)
    t = truth["cited"]
    for ax_row, (sc, names) in zip(axes, rows.items()):
        for ax in ax_row[len(names):]:
            ax.set_visible(False)
        for ax, est in zip(ax_row, names):
            col = scenarios[sc]["per_seed"]["cited"][est]
            shown = sorted(x for x in zip(col["value"], col["lo"], col["hi"]) if x[0] is not None)
            for i, (v, lo, hi) in enumerate(shown):
                ax.plot([i, i], [lo, hi], color="tab:blue" if lo <= t <= hi else "tab:red", lw=1)
                ax.plot(i, v, ".", color="k", ms=2)
            ax.axhline(t, color="k", lw=0.8)
            ax.set_title(f"{sc} {est}: coverage {scenarios[sc]['summary']['cited'][est]['coverage']:.2f}", fontsize=8)
            ax.set_xlabel("seed (sorted by estimate)", fontsize=7)
            ax.tick_params(labelsize=7)
        ax_row[0].set_ylabel("cited per call: estimate, 95% interval\n(axis cut at 0.5%/99.5% of ends)", fontsize=7)
    fig.tight_layout()
    _common.save_figure(fig, path)
    print(f"wrote {path}", file=sys.stderr)


# --------------------------------------------------------------------------- main
def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=_common.HelpFormatter)
    ap.add_argument("--seeds", type=_common.positive_int, default=100, help="logs per scenario")
    ap.add_argument("--json", type=Path, default=None, help="write the results here")
    ap.add_argument("--plot", type=Path, default=None, help="PNG of every seed's interval of the cited count")
    ap.add_argument("--replot", action="store_true", help="only redraw --plot from the results in --json")
    _common.add_data_option(ap)
    ap.add_argument("--train", default="26,30")
    ap.add_argument("--eval", default="41,42,43")
    ap.add_argument("--tau", type=float, default=0.1)
    ap.add_argument("--bootstrap", type=_common.positive_int, default=1000)
    ap.add_argument("--replicates", type=_common.positive_int, default=2000,
                    help="on-policy Monte Carlo replicates (the check)")
    ap.add_argument("--scenarios", default="fixed,adaptive")
    args = ap.parse_args(argv)
    if args.replot:
        saved = _common.replot_result(ap, args)
        plot(saved["scenarios"], saved["truth"]["enumeration"]["target"], args.plot)
        return 0
    data = _common.require_data(args.data)
    from rmm_jax.online.ope import Target, evaluate_log, slot_marginals  # the code under test
    t0 = time.perf_counter()
    k, m, precision, recall = 20, 5, DEFAULT_PRECISION, DEFAULT_RECALL
    loop = online_loop(k, m, args.tau, precision, recall)
    target_sampling = Target(k, m, args.tau)
    progress = lambda msg: print(msg, file=sys.stderr, flush=True)  # noqa: E731
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        progress("set-up: embedding LoCoMo, pretraining the target on " + args.train)
        emb = Embedder(progress=False)
        try:
            write_store(tmp / "store", load_locomo(data), "turn", emb, spec=f"locomo:{data}")
        finally:
            emb.close()
        st = open_store(tmp / "store")
        streams = {s.user_id: s for s in load_streams(st, k)}
        train, ev = args.train.split(","), args.eval.split(",")
        p0 = init_reranker(jax.random.key(0), st.dim)
        target, hist = pretrain(p0, [streams[u] for u in train], [], PretrainConfig(epochs=10))
        ps = PolicyStore.create(tmp / "target", PolicyMeta("linear", st.dim, config={"pretrained": True,
                                                                                  "model": st.model}), target)
        ev_streams = [streams[u] for u in ev]
        assert all(s.cite_gold is None for s in ev_streams), "the truth assumes citations see the gold labels"
        memory_ids = {s.user_id: s.memory_ids for s in ev_streams}
        behaviour, tgt = call_arrays(ev_streams, p0), call_arrays(ev_streams, target)
        t_setup = time.perf_counter() - t0

        progress("truth: enumerating every slate of the target and the behaviour")
        t1 = time.perf_counter()
        enum = {name: enumerate_pl(a["scores"] / np.float32(args.tau), a["mask"], a["gold"], m)
                for name, a in (("target", tgt), ("behaviour", behaviour))}
        per_call = {name: truth_per_call(enum[name], a["num_gold"], a["valid"], m, precision, recall)
                    for name, a in (("target", tgt), ("behaviour", behaviour))}
        truth = {x: float(np.nanmean(v)) for x, v in per_call["target"].items()}
        t_enum = time.perf_counter() - t1
        progress(f"check: {args.replicates} on-policy Monte Carlo replicates")
        t1 = time.perf_counter()
        mc = on_policy_mc(loop.act_and_cite, tgt, m, args.replicates, seed=10_000)
        t_mc = time.perf_counter() - t1
        lib_marg = {name: slot_marginals(a["scores"] / np.float32(args.tau), a["mask"], m)
                    for name, a in (("target", tgt), ("behaviour", behaviour))}
        print(f"set-up {t_setup:.0f}s, enumeration {t_enum:.0f}s, Monte Carlo {t_mc:.0f}s; {len(tgt['user'])} calls; "
              f"truth {truth}; Monte Carlo " + ", ".join(f"{x} {v['mean']:.4f} ± {v['se']:.4f}" for x, v in mc.items()),
              file=sys.stderr)

        scenarios = {}
        for name in args.scenarios.split(","):
            runs, t1 = [], time.perf_counter()
            progress(f"scenario {name}: {args.seeds} logs, each evaluated with {args.bootstrap} bootstrap resamples")
            for seed in range(args.seeds):
                log = tmp / f"{name}-{seed}.jsonl"
                if name == "fixed":
                    fixed_log(loop, behaviour, memory_ids, args.tau, seed, log)
                else:
                    write_log(log, loop.learner_log(ev_streams, seed))
                runs.append(evaluate_log(st, log, ps, target_sampling, bootstrap=args.bootstrap, seed=seed))
                log.unlink()
                print(f"{name} seed {seed}: " + ", ".join(
                    f"{x} " + ("withheld" if v["value"] is None else f"{v['value']:.3f}")
                for x, v in runs[-1]["estimates"]["cited"].items()), file=sys.stderr)
            direct = [r["estimates"]["recall"]["direct"]["value"] for r in runs if "direct" in r["estimates"]["recall"]]
            scenarios[name] = {
                "summary": summarise(runs, truth), "seconds": round(time.perf_counter() - t1, 1),
                "marginals": runs[0]["marginals"], "notes": runs[0]["notes"],
                "ope_direct_recall_minus_enumeration": (max(abs(d - truth["recall"]) for d in direct)
                                                        if direct else None),
                "per_seed": per_seed(runs)}

    result = {
        "setup": {"data": "LoCoMo", "granularity": "turn", "model": st.model, "k": k, "m": m, "tau": args.tau,
                  "precision": precision, "recall": recall, "train": train, "eval": ev,
                  "calls": len(tgt["user"]), "calls_with_gold": int(tgt["valid"].sum()), "seeds": args.seeds,
                  "bootstrap": args.bootstrap, "pretrain_epochs": 10,
                  "pretrain_train_recall": hist["train_recall"][-1]},
        "truth": {
            "rows_scored_against": "enumeration",
            "enumeration": {"target": truth,
                            "behaviour_base_retriever": {x: float(np.nanmean(v))
                                                         for x, v in per_call["behaviour"].items()},
                            "selections_per_call": int(np.prod(np.arange(k - m + 1, k + 1))),
                            "max_abs_probability_mass_error": max(e["mass_error"] for e in enum.values()),
                            "seconds": round(t_enum, 1),
                            "uses": "NumPy only (no rmm_jax.online.ope)"},
            "on_policy_monte_carlo": {**{x: {**v, "z_enumeration_minus_mc": (truth[x] - v["mean"]) / v["se"]}
                                         for x, v in mc.items()},
                                      "replicates": args.replicates, "seconds": round(t_mc, 1),
                                      "uses": "the library's act-and-cite step (Gumbel-top-M sampler, oracle_cite)"}},
        "checks": {
            "ope_slot_marginals_max_abs_diff_vs_enumeration": {
                name: {"value": float(np.abs(lib_marg[name][0] - enum[name]["marginals"]).max()), **lib_marg[name][1]}
                for name in lib_marg},
            "ope_direct_recall_max_abs_diff_vs_enumeration": {
                sc: res["ope_direct_recall_minus_enumeration"] for sc, res in scenarios.items()}},
        "scenarios": scenarios,
        "targets": targets(scenarios),
        "seconds": round(time.perf_counter() - t0, 1),
        "backend": f"jax {jax.__version__} ({jax.default_backend()})",
    }
    if args.json:
        _common.write_result(args.json, result)
    if args.plot:
        plot(scenarios, truth, args.plot)
    print(report(result))
    return 0


def report(result: dict) -> str:
    tr = result["truth"]
    lines = ["truth (enumeration): " + ", ".join(f"{x} {v:.4f}" for x, v in tr["enumeration"]["target"].items()),
             "on-policy Monte Carlo: " + ", ".join(f"{x} {tr['on_policy_monte_carlo'][x]['mean']:.4f} ± "
                                                   f"{tr['on_policy_monte_carlo'][x]['se']:.4f} (z "
                                                   f"{tr['on_policy_monte_carlo'][x]['z_enumeration_minus_mc']:+.1f})"
                                                   for x in METRICS),
             f"checks: {result['checks']}"]
    for sc, res in result["scenarios"].items():
        lines.append(f"\n{sc} ({result['setup']['seeds']} seeds):")
        for metric, per in res["summary"].items():
            for est, row in per.items():
                if est != "logged" and "coverage" not in row:
                    lines.append(f"  {metric:<10} {est:<7} every seed withheld: {row.get('withheld_reasons')}")
                elif est != "logged":
                    lines.append(f"  {metric:<10} {est:<7} bias {row['bias']:+.4f} [{row['bias_ci95'][0]:+.4f}, "
                                 f"{row['bias_ci95'][1]:+.4f}]  rmse {row['rmse']:.4f}  coverage {row['coverage']:.2f} "
                                 f"[{row['coverage_ci95'][0]:.2f}, {row['coverage_ci95'][1]:.2f}]  width "
                                 f"{row['mean_width']:.4f}"
                                 + (f"  ess {row['mean_ess']:.0f}" if "mean_ess" in row else "")
                                 + (f"  withheld {row['withheld']} (coverage with them as misses "
                                    f"{row['coverage_all']:.2f})" if row["withheld"] else ""))
    lines += [f"{'PASS' if t['pass'] else 'MISS'} {t['name']} = "
              f"{'none' if t['value'] is None else format(t['value'], '.2f')} (target {t['target']}); "
              f"{t['withheld']} withheld, counted as misses {t['coverage_all']:.2f} "
              f"({'PASS' if t['pass_all'] else 'MISS'})"
              for t in result["targets"]]
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
