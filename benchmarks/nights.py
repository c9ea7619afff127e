"""Night after night: the same users back, and whether learning holds up.

    python benchmarks/nights.py --synthetic-store STORE --json benchmarks/results/nights.json \
        --plot benchmarks/results/nights.png
    python benchmarks/nights.py --synthetic-store STORE --presets anchored,anchored_calibrated --evaluate \
        --json benchmarks/results/nights_evaluate.json --plot benchmarks/results/nights_evaluate.png

The daily loop (docs/lifecycle.md) serves a user's questions, learns from the citations, and
serves the next day's with what it learned. Here every synthetic user
(``_common.SYNTHETIC``, the first ``--users``) asks its questions again on each of ``--nights``
nights, one stream of all nights, online from the retriever (identity), with the
class-calibrated citations (``simulate``'s default), K = 20, M = 5, all users side by side in
one chunk (one shared part in scopes shared and hybrid). Per night:

* ``gain``: Recall@5 of the policy's own top 5 (prequential: before the call's update), minus the
  retriever's, over users and queries, the mean over ``--seeds`` with its 95% interval over
  seeds and queries;
* ``log_prob``: the mean log-probability of the shown selection under the policy that drew it
  (an ordered draw of 5 of 20 at the start is about −13; 0 is a draw that no longer explores);

and at the end ``logit``: the median, over the first 50 users of each seed's run, of the largest
|score| / τ over a user's candidates, the scale the draw sees.

With ``--evaluate``, what the last night's log lets ``rmm-jax evaluate`` estimate
(:func:`rmm_jax.online.ope.evaluate_calls`, the function behind it, on every user's calls of
that night as one log, each call's ``log_prob`` that of the policy that drew it; Recall@5 of
``--m`` shown): per seed, two targets, ``tomorrow`` (each user's policy after the last night,
what a nightly deployment ships next) and ``retriever`` (the identity reranker, a rollback),
each with SNIPS's value, effective sample size, weights' mean and whether ``evaluate`` gives it
(``reliable``; ``reason`` if not),
beside the target's exact expected Recall on those calls (``direct``, no sampling error). A
draw that explores less leaves a policy far from the one that drew it less to go on.

Written down before it first ran: the logistic loss anchored at the best current score (the
``default`` preset then, ``realistic`` today) leaves the best candidate's gradient at (σ(offset) − its citation rate)/τ
whatever its score, so under Adam the scores' scale grows with the updates, and a shared
part, which takes an update per batch of every user, grows fastest. The ``anchored`` preset
(``reference="retriever"``, chosen on LoCoMo 26 and 30 by ``defaults_sweep.py``'s rule, the
default since) should keep the scale bounded and the gain from falling. Nothing here was tuned.
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import _common  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import rmm_jax as rj  # noqa: E402
from rmm_jax.core.config import describe  # noqa: E402
from rmm_jax.online.ope import Calls, Target, evaluate_calls  # noqa: E402
from rmm_jax.online.streams import Stream, repeat_passes  # noqa: E402

SCOPES = ("user", "shared", "hybrid")


def nightly(s: Stream, nights: int) -> Stream:
    """``s``'s queries asked again on each of ``nights`` nights, as one stream whose every night
    counts (``repeat_passes`` counts the first pass only)."""
    return dataclasses.replace(repeat_passes(s, nights), valid=np.concatenate([s.valid] * nights), passes=1)


def logit_scale(params, s: Stream, tau: float) -> float:
    """The largest |score| / τ over a user's valid candidates."""
    sc = rj.score_batch(params, jnp.asarray(s.queries), jnp.asarray(s.bank[s.cand]), jnp.asarray(s.cand_mask))
    return float(jnp.max(jnp.where(jnp.asarray(s.cand_mask), jnp.abs(sc), 0.0))) / tau


def last_night_calls(streams, run, target, nights: int, tau: float) -> Calls:
    """Every user's calls of the last night as one log: what the run drew, cited and logged
    (each call's log P under the policy of its time), with ``target(user id)``'s logits."""
    parts = {f: [] for f in ("t", "sel", "cited", "lp", "mask", "gold", "ng", "valid")}
    uids, qids = [], []
    for s in streams:
        o, t = run.outputs[s.user_id], len(s.query_ids)
        last = slice((nights - 1) * t, nights * t)
        sc = rj.score_batch(target(s.user_id), jnp.asarray(s.queries), jnp.asarray(s.bank[s.cand]),
                            jnp.asarray(s.cand_mask))
        parts["t"].append(np.where(s.cand_mask, np.asarray(sc) / tau, 0.0).astype(np.float32))
        parts["sel"].append(np.asarray(o["selected"], np.int32)[last])
        parts["cited"].append(np.asarray(o["cited"], bool)[last])
        parts["lp"].append(np.asarray(o["log_prob"], np.float64)[last])
        parts["mask"].append(np.asarray(s.cand_mask, bool))
        parts["gold"].append(np.asarray(s.cand_gold, bool))
        parts["ng"].append(np.asarray(s.num_gold, np.int32))
        parts["valid"].append(np.asarray(s.valid, bool))
        uids += [s.user_id] * t
        qids += [f"{s.user_id}/{q}" for q in s.query_ids]
    c = {f: np.concatenate(v) for f, v in parts.items()}
    return Calls(user_ids=uids, query_ids=qids, target_logits=c["t"], behaviour_logits=None, mask=c["mask"],
                 selected=c["sel"], cited=c["cited"], log_prob=c["lp"], cand_gold=c["gold"], num_gold=c["ng"],
                 valid=c["valid"], own_policy=dict.fromkeys(uids, True))


def evaluable(streams, runs, params, nights: int, program, m: int) -> dict:
    """Per target (``tomorrow``, ``retriever``), per seed: SNIPS's Recall@M estimate on the last
    night's calls, its effective sample size, its weights' mean, whether ``evaluate`` gives it
    and if not why (``reason``), and the exact expected value (``direct``)."""
    tau, k = program.estimator.tau, program.layout.k
    out = {}
    for name in ("tomorrow", "retriever"):
        rows = []
        for r in runs:
            target = (lambda u, r=r: r.finals[u]) if name == "tomorrow" else (lambda u: params)
            rep = evaluate_calls(last_night_calls(streams, r, target, nights, tau), Target(k, m, tau))
            est = rep["estimates"]["recall"]
            keep = ("value", "ess", "reliable", "weight_mean", "reason")
            rows.append({"snips": {f: est["snips"].get(f) for f in keep},
                         "direct": est["direct"]["value"]})
        out[name] = {"seeds": rows, "reliable": sum(bool(x["snips"]["reliable"]) for x in rows),
                     "ess_median": float(np.median([x["snips"]["ess"] for x in rows]))}
    return out


def run_cell(streams, nights: int, program, params, seeds, m: int, evaluate: bool = False) -> dict:
    """One preset in one scope: per night the gain over the retriever and the mean log P of the
    shown draw; at the end the median logit scale (over the first 50 users, each seed) and,
    with ``evaluate``, :func:`evaluable`."""
    users = [s.user_id for s in streams]
    base = _common.retriever_recall(streams, m)
    runs = [_common.run_chunk([nightly(s, nights) for s in streams], program, params, seed) for seed in seeds]
    size = {s.user_id: len(s.query_ids) for s in streams}               # one night's queries, per user
    night = lambda x, u, n: np.asarray(x)[n * size[u]:(n + 1) * size[u]]  # noqa: E731
    out = {"nights": []}
    for n in range(nights):
        per_seed = [{u: night(r.outputs[u]["recall"], u, n) for u in users} for r in runs]
        lp = np.mean([np.mean(night(r.outputs[u]["log_prob"], u, n)) for r in runs for u in users])
        out["nights"].append({"night": n + 1, **_common.pooled_gain(per_seed, base, streams, users),
                              "log_prob": float(lp)})
    tau = program.estimator.tau
    out["logit"] = float(np.median([logit_scale(r.finals[s.user_id], s, tau) for r in runs for s in streams[:50]]))
    if evaluate:
        out["evaluate"] = evaluable(streams, runs, params, nights, program, m)
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0], formatter_class=_common.HelpFormatter)
    ap.add_argument("--synthetic-store", type=Path, default=None,
                    help=f"store of `rmm-jax embed {_common.SYNTHETIC.format(users=300, seed=0)}` to reuse (built "
                         "there when absent; default: a temporary one)")
    ap.add_argument("--users", type=_common.positive_int, default=300, help="synthetic users, side by side")
    ap.add_argument("--nights", type=_common.positive_int, default=8, help="nights each user asks its questions")
    ap.add_argument("--seeds", type=_common.int_list, default="0,1,2", help="comma-separated seeds")
    ap.add_argument("--presets", type=_common.choice_list(*rj.PRESETS), default="realistic,anchored",
                    help="comma-separated presets (anchored is the default's setting; realistic the default before)")
    ap.add_argument("--scopes", type=_common.choice_list(*SCOPES), default="user,shared,hybrid",
                    help="comma-separated policy scopes")
    ap.add_argument("--evaluate", action="store_true",
                    help="also what evaluate can estimate from the last night's calls (tomorrow's policy, the "
                         "retriever)")
    _common.result_options(ap, "PNG of the gain and of log P(shown) by night")
    args = ap.parse_args(argv)
    if _common.redrawn(ap, args, plot):
        return None
    log = lambda msg: print(msg, file=sys.stderr, flush=True)  # noqa: E731
    t0 = time.perf_counter()
    k, m = 20, 5
    cite, cite_info = _common.citation_model("oracle")
    log(f"{args.users} synthetic users: their store ({args.synthetic_store or 'a temporary one'})")
    streams = _common.synthetic_population(args.users, k, args.synthetic_store)
    params = rj.init_reranker(jax.random.key(0), streams[0].bank.shape[1])
    out = {"synthetic": _common.SYNTHETIC.format(users=args.users, seed=0), "users": args.users,
           "nights": args.nights, "queries_per_night": len(streams[0].query_ids), "seeds": args.seeds,
           "citations": cite_info, "k": k, "m": m, "cells": {}}
    for name in args.presets:
        for scope in args.scopes:
            setting = rj.preset(name, k=k, m=m, scope=scope)
            cell = run_cell(streams, args.nights, rj.make_run(*setting, cite_fn=cite), params, args.seeds, m,
                            args.evaluate)
            out["cells"][f"{name}/{scope}"] = {"preset": name, "scope": scope, "setting": describe(*setting), **cell}
            first, last = cell["nights"][0]["gain"], cell["nights"][-1]["gain"]
            log(f"  {name:<9} {scope:<7} night 1 {_common.format_interval(first)}  night {args.nights} "
                f"{_common.format_interval(last)}  log P {cell['nights'][-1]['log_prob']:.2f}  "
                f"logit {cell['logit']:.1f}" + ("" if not args.evaluate else "  evaluate (reliable seeds, median ESS): "
                + ", ".join(f"{t} {e['reliable']}/{len(e['seeds'])} {e['ess_median']:.0f}"
                            for t, e in cell["evaluate"].items())))
    out["seconds"] = round(time.perf_counter() - t0, 1)
    _common.save_outputs(args, out, plot)
    return out


def plot(out: dict, path) -> None:
    """Gain over the retriever (left) and mean log P of the shown draw (right) by night, one
    line per preset and scope."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    styles = {"user": "-", "shared": "--", "hybrid": ":"}
    presets = list(dict.fromkeys(["realistic", "anchored", *(c["preset"] for c in out["cells"].values())]))
    for key, c in out["cells"].items():
        color = f"C{presets.index(c['preset'])}"
        xs = [r["night"] for r in c["nights"]]
        g = [r["gain"] for r in c["nights"]]
        a.plot(xs, [x["mean"] for x in g], styles[c["scope"]], color=color, marker="o", ms=3, label=key)
        a.fill_between(xs, [x["lo"] for x in g], [x["hi"] for x in g], color=color, alpha=0.12)
        b.plot(xs, [r["log_prob"] for r in c["nights"]], styles[c["scope"]], color=color, marker="o", ms=3,
               label=f"{key} (logit at the end {c['logit']:.0f})")
    for ax in (a, b):
        ax.xaxis.set_major_locator(matplotlib.ticker.MaxNLocator(integer=True))
    a.axhline(0, color="grey", lw=0.8)
    a.set_xlabel("night")
    a.set_ylabel("Recall@5 gain over the retriever")
    a.set_title(f"{out['users']} synthetic users, seeds {out['seeds']}, 95% interval", fontsize=9)
    b.set_xlabel("night")
    b.set_ylabel("mean log P(shown selection)")
    b.set_title("how far the draw still explores (0: not at all)", fontsize=9)
    a.legend(fontsize=7)
    b.legend(fontsize=7)
    fig.tight_layout()
    _common.save_figure(fig, path)
    print(f"wrote {path}", file=sys.stderr)


if __name__ == "__main__":
    main()
