"""How many labelled calls the judge-rate correction needs, on LoCoMo.

    python benchmarks/labelled_calls.py --json benchmarks/results/labelled_calls.json \\
        --plot benchmarks/results/labelled_calls.png

``--p-useful``/``--p-other`` correct the default's logistic loss for a generator's citation
rates. On the tuning conversations (26 and 30) the correction paid where the generator cites
other memories often (``citation_noise_default_matched_tuned_on.json`` beside
``citation_noise_tuned_on.json``), and ``cite-rates`` advises it there
(:data:`rmm_jax.online.cite_rates.ADVISE_FROM`). A user measures the rates with
``rmm-jax cite-rates`` on the calls they have gold for, and a small sample measures them
with error. This script follows that user, for a generator with P(cite | useful)
``--p-useful`` and P(cite | not useful) ``--p-other`` (default 0.9 and 0.3, a generator
noisier than the paper's judge, inside the region where the correction is advised):

1. **Labelled calls.** N calls drawn at random (with replacement) from the questions of
   the conversations the presets were tuned on (26 and 30), each showing the base
   retriever's top M (the policy of day one), cited by the class-calibrated simulator at
   the generator's rates. Seed s draws its own sample.
2. **The rates, as ``cite-rates`` gives them**
   (:func:`rmm_jax.online.cite_rates.cite_rates`: the pooled rates, with a bootstrap
   interval over conversations, then calls). When the two intervals are apart the user
   takes the advice: the default corrected for the measured rates when ``cite-rates``
   advises it (the intervals apart, the rates in the region), the default uncorrected otherwise.
3. **Online learning** from identity on all five conversations (turn memories, MiniLM,
   K = 20, M = 5), the same generator citing, seed s; reported on the held-out
   conversations (41, 42, 43): the prequential Recall@5 gain over the retriever, and the
   paired difference with the default preset on the same seeds, streams and citations
   draws (95% interval over conversations, seeds and questions,
   :func:`rmm_jax.online.stats.gain_interval`).

Beside each N: the default preset, and the default corrected for the true rates (what an
unlimited sample would give). Nothing here is tuned. The JSON records each learner, preset name
and resolved fields (:func:`rmm_jax.core.config.setting_record`): the uncorrected default as
``config.setting`` and ``default.setting``, the true rates' as ``true_rates.setting``, and
each seed's (corrected for its measured rates when advised) as ``rows[].seeds[].setting``.
Until stop 53 the advice was ``--preset calibrated`` (the loss read against the policy's best
score) with the rates: ``git show e9445bc:benchmarks/results/labelled_calls.json``.

LoCoMo is read from ``--data`` (default ``$RMM_LOCOMO_DIR``, else
``../shared/data/locomo``); when absent the script says so and exits 0, or 1 under
``CI=true``.
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import _common  # noqa: E402  (benchmarks/_common.py)
import jax  # noqa: E402
import numpy as np  # noqa: E402

import rmm_jax as rj  # noqa: E402
from rmm_jax.core.config import setting_record  # noqa: E402
from rmm_jax.data.citations import oracle  # noqa: E402
from rmm_jax.online.cite_rates import CallCounts, call_row, cite_rates, counts_of  # noqa: E402

SIZES = (25, 50, 100, 200, 400, 800)


def labelled_counts(streams, tuned_on, n: int, m: int, p_useful: float, p_other: float,
                    rng: np.random.Generator) -> CallCounts:
    """N labelled calls of ``tuned_on``'s questions, each showing the retriever's top ``m``,
    cited at the generator's rates (spurious = ``p_other``), counted as ``cite-rates`` counts."""
    pool = [(i, t) for i, s in enumerate(streams) if s.user_id in tuned_on for t in np.flatnonzero(s.valid)]
    who, rows = [], []
    for j in rng.integers(0, len(pool), n):
        i, t = pool[j]
        s = streams[i]
        shown = np.asarray(s.cand_mask[t, :m], bool)
        gold = np.asarray(s.cand_gold[t, :m], bool)[shown]
        cited = rng.random(m)[shown] < np.where(gold, p_useful, p_other)
        who.append(i)
        rows.append(call_row(gold, cited))
    which, users = np.unique(who, return_inverse=True)
    return counts_of(users, rows, [streams[i].user_id for i in which], n)


def plot(out: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sizes = [r["labelled_calls"] for r in out["rows"]]
    fig, ax = plt.subplots(figsize=(7.0, 4.4))
    mean = [r["gain"]["mean"] for r in out["rows"]]
    lo = [r["gain"]["lo"] for r in out["rows"]]
    hi = [r["gain"]["hi"] for r in out["rows"]]
    ax.fill_between(sizes, lo, hi, alpha=0.2, color="C0")
    ax.plot(sizes, mean, "o-", color="C0", label="rates measured on N labelled calls (cite-rates' advice)")
    for key, color, label in (("true_rates", "C2", "the default corrected for the true rates"),
                              ("default", "C3", "default preset (no correction)")):
        g = out[key]["gain"]
        ax.axhline(g["mean"], color=color, linestyle="--", label=f"{label}: {_common.format_interval(g)}")
        ax.axhspan(g["lo"], g["hi"], color=color, alpha=0.08)
    ax.axhline(0.0, color="black", linewidth=0.8)
    ax.set_xscale("log")
    ax.minorticks_off()
    ax.set_xticks(sizes, [str(s) for s in sizes])
    ax.set_xlabel("labelled calls (N)")
    ax.set_ylabel("held-out ΔRecall@5 over the retriever")
    g = out["config"]["generator"]
    ax.set_title(f"LoCoMo held-out ({','.join(out['config']['held_out'])}), generator P(cite | useful) "
                 f"{g['p_useful']}, P(cite | not useful) {g['p_other']}\nmean of {len(out['config']['seeds'])} seeds, "
                 "95% interval over conversations, seeds and questions", fontsize=9)
    ax.legend(fontsize=7.5, loc="lower right")
    fig.tight_layout()
    _common.save_figure(fig, path)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=_common.HelpFormatter)
    _common.locomo_options(ap)
    ap.add_argument("--seeds", type=_common.positive_int, default=5,
                    help="seeds: each draws its own labelled sample and run")
    ap.add_argument("--p-useful", type=float, default=0.9, help="the generator's P(cite | useful)")
    ap.add_argument("--p-other", type=float, default=0.3, help="the generator's P(cite | not useful)")
    ap.add_argument("--sizes", type=_common.positive_int_list, default=",".join(map(str, SIZES)),
                    help="comma-separated numbers of labelled calls")
    _common.result_options(ap, "gain against N, PNG")
    args = ap.parse_args(argv)
    if _common.redrawn(ap, args, plot):
        return
    data = _common.require_data(args.data)
    t0 = time.perf_counter()
    sizes = args.sizes
    streams = _common.locomo_streams(data, args.k, model=args.model).streams
    users = [s.user_id for s in streams]
    held = [u for u in users if u not in _common.TUNED_ON]
    seeds = list(range(args.seeds))
    params = rj.init_reranker(jax.random.key(0), streams[0].bank.shape[1])
    base = _common.pooled(_common.retriever_recall(streams, args.m), streams, held)
    groups = _common.query_groups(streams, held)
    cite = oracle(p_useful=args.p_useful, p_other=args.p_other, spurious=args.p_other)
    programs: dict = {}

    def learner(p_useful: float | None, p_other: float | None) -> rj.Setting:
        """The default corrected for these rates, or the default preset (None)."""
        judge = {} if p_useful is None else {"p_useful": p_useful, "p_other": p_other}
        return rj.preset("default", k=args.k, m=args.m, **judge)

    def recorded(p_useful: float | None, p_other: float | None) -> dict:
        """What the result records of that learner: the preset's name and its resolved fields."""
        return setting_record("default", learner(p_useful, p_other))

    def run(p_useful: float | None, p_other: float | None, seed: int) -> np.ndarray:
        """Held-out per-query Recall@M of one run: the correction for these rates, or the
        default preset (None)."""
        key = (p_useful, p_other)
        if key not in programs:
            programs[key] = rj.make_run(*learner(p_useful, p_other), cite_fn=cite)
        return _common.pooled(_common.online_recall(streams, programs[key], params, seed), streams, held)

    default = np.stack([run(None, None, s) for s in seeds])
    true = np.stack([run(args.p_useful, args.p_other, s) for s in seeds])
    print(f"default {_common.format_interval(_common.gain_interval(default - base, groups=groups))}, true rates "
          f"{_common.format_interval(_common.gain_interval(true - base, groups=groups))} "
          f"({time.perf_counter() - t0:.0f} s)", file=sys.stderr, flush=True)
    rows = []
    for n in sizes:
        got, measured = [], []
        for s in seeds:
            rng = np.random.default_rng([n, s])
            rates = cite_rates(labelled_counts(streams, _common.TUNED_ON, n, args.m, args.p_useful, args.p_other, rng),
                               n_boot=1000, seed=s)
            advised = rates["options"] is not None
            judge = (rates["p_useful"]["value"], rates["p_other"]["value"]) if advised else (None, None)
            measured.append({"seed": s, "p_useful": rates["p_useful"], "p_other": rates["p_other"],
                             "advised": advised, "setting": recorded(*judge)})
            got.append(run(*judge, s) if advised else default[s])
        got = np.stack(got)
        pu = np.array([x["p_useful"]["value"] for x in measured], float)
        po = np.array([x["p_other"]["value"] for x in measured], float)
        rows.append({"labelled_calls": n, "advised": int(sum(x["advised"] for x in measured)),
                     "gain": _common.gain_interval(got - base, groups=groups),
                     "over_default": _common.gain_interval(got - default, groups=groups),
                     "behind_true_rates": _common.gain_interval(got - true, groups=groups),
                     "p_useful_error": float(np.mean(np.abs(pu - args.p_useful))),
                     "p_other_error": float(np.mean(np.abs(po - args.p_other))), "seeds": measured})
        r = rows[-1]
        print(f"  N {n:>4}: advised {r['advised']}/{len(seeds)}, gain {_common.format_interval(r['gain'])}, "
              f"over default {_common.format_interval(r['over_default'])} ({time.perf_counter() - t0:.0f} s)",
              file=sys.stderr, flush=True)
    out = {"rows": rows, "default": {"gain": _common.gain_interval(default - base, groups=groups),
                                     "setting": recorded(None, None)},
           "true_rates": {"gain": _common.gain_interval(true - base, groups=groups),
                          "over_default": _common.gain_interval(true - default, groups=groups),
                          "setting": recorded(args.p_useful, args.p_other)},
           "config": {"model": args.model, "granularity": "turn", "k": args.k, "m": args.m, "init": "identity",
                      "setting": recorded(None, None),
                      "generator": {"p_useful": args.p_useful, "p_other": args.p_other, "spurious": args.p_other},
                      "labelled_from": list(_common.TUNED_ON), "conversations": users, "held_out": held,
                      "seeds": seeds, "sizes": sizes,
                      "interval": "rmm_jax.online.stats.gain_interval, 95%, 2000 resamples"},
           "seconds": round(time.perf_counter() - t0, 1)}
    print(f"Held-out ({','.join(held)}) online Recall@{args.m} gain over the retriever, generator "
          f"P(cite | useful) {args.p_useful}, P(cite | not useful) {args.p_other}, {args.seeds} seeds:")
    print(f"  default preset (no correction)       {_common.format_interval(out['default']['gain'])}")
    print(f"  the default corrected for the true rates {_common.format_interval(out['true_rates']['gain'])}")
    for r in rows:
        print(f"  rates from {r['labelled_calls']:>4} labelled calls     {_common.format_interval(r['gain'])}  "
              f"(advised {r['advised']}/{args.seeds}; over default {_common.format_interval(r['over_default'])})")
    print(f"({out['seconds']} s)")
    _common.save_outputs(args, out, plot)


if __name__ == "__main__":
    main()
