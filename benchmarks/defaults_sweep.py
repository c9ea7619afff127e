"""The sweep that chose the default preset (README, "Choosing the defaults").

    python benchmarks/defaults_sweep.py --citations precision_recall \\
        --json benchmarks/results/defaults_sweep.json
    python benchmarks/defaults_sweep.py --json benchmarks/results/defaults_sweep_oracle.json

Seven settings of credit × τ × lr, each run online from identity on LoCoMo conversations
26 and 30 only (the conversations the defaults were tuned on; 41, 42, 43 stay held out),
scope user, all-MiniLM-L6-v2, turn granularity, K=20, M=5, against simulated citations
(``--citations``, see ``_common.citation_model``: ``oracle`` is the class-calibrated
simulator ``rmm-jax simulate`` uses; the defaults were chosen under ``precision_recall``,
0.876/0.858). Each setting reports the gain in prequential Recall@5 over the base
retriever on the queries of 26 and 30 pooled: the mean over ``--seeds`` and its 95%
interval over conversations, seeds and queries (:func:`rmm_jax.online.stats.gain_interval`;
with two conversations the conversation level is coarse), with the seed and query one
beside it.
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
from rmm_jax.core.config import describe  # noqa: E402
from rmm_jax.online.summary import base_values  # noqa: E402

# (credit, tau, lr), in the README's order; the first is the default preset.
SETTINGS = (
    ("item", 0.1, 3e-4),
    ("item", 0.05, 3e-4),
    ("item", 0.05, 1e-4),
    ("item", 0.2, 3e-4),
    ("item", 0.1, 1e-3),
    ("reward_to_go", 0.1, 3e-4),
    ("reward_to_go", 0.1, 1e-3),
)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=_common.HelpFormatter)
    _common.add_data_option(ap)
    ap.add_argument("--model", default=_common.MODEL)
    ap.add_argument("--granularity", default="turn", choices=["turn", "session", "segment"])
    ap.add_argument("--k", type=int, default=20)
    ap.add_argument("--m", type=int, default=5)
    ap.add_argument("--citations", default="oracle", choices=_common.CITATIONS, help="simulated generator")
    ap.add_argument("--seeds", default="0,1,2", help="comma-separated seeds")
    ap.add_argument("--json", type=Path, default=None, help="write the results as one JSON object")
    args = ap.parse_args(argv)

    data = _common.require_data(args.data)
    t0 = time.perf_counter()
    seeds = [int(x) for x in args.seeds.split(",")]
    m = args.m
    log = lambda msg: print(f"  {msg}", file=sys.stderr, flush=True)
    locomo = _common.locomo_streams(data, args.k, model=args.model, granularity=args.granularity,
                                    answers=args.citations == "answer", users=list(_common.TUNED_ON))
    streams = locomo.answer_streams() if args.citations == "answer" else locomo.streams
    cite, cite_info = _common.citation_model(args.citations)
    users = [s.user_id for s in streams]
    base = _common.pooled({s.user_id: np.asarray(base_values(s, m)[0]) for s in streams}, streams, users)
    groups = _common.query_groups(streams, users)
    default = rj.preset("default", k=args.k, m=m)

    rows = []
    for credit, tau, lr in SETTINGS:
        setting = rj.preset("default", k=args.k, m=m, credit=credit, tau=tau, lr=lr)
        program = rj.make_run(*setting, cite_fn=cite)
        online = []
        for seed in seeds:
            log(f"credit {credit}, tau {tau}, lr {lr:g}: seed {seed}")
            identity = rj.init_reranker(jax.random.key(seed), streams[0].bank.shape[1])
            online.append(_common.pooled(_common.online_recall(streams, program, identity, seed), streams, users))
        online = np.stack(online)
        rows.append({"credit": credit, "tau": tau, "lr": lr,
                     "default": describe(*setting) == describe(*default),
                     f"recall@{m}": float(online.mean()), f"base_recall@{m}": float(base.mean()),
                     "per_seed_gain": [float(x) for x in (online - base).mean(axis=1)],
                     "gain": _common.gain_interval(online - base[None], groups=groups),
                     "gain_these": _common.gain_interval(online - base[None])})

    out = {"rows": rows,
           "config": {"setting": describe(*default), "model": args.model, "granularity": args.granularity,
                      "k": args.k, "m": m, "seeds": seeds, "users": users, "queries": int(base.size),
                      "scope": "user", "start": "identity", "citations": cite_info}}
    out["seconds"] = round(time.perf_counter() - t0, 1)

    print(f"ΔRecall@{m} over the retriever on conversations {'+'.join(users)} ({base.size} queries; base "
          f"{base.mean():.4f}; {args.granularity}, K={args.k}, M={m}; {args.citations} citations; seeds {args.seeds}; "
          f"online from identity):")
    print(f"{'credit':<14}{'tau':>6}{'lr':>8}  gain [95%: conversation+seed+query] [seed+query]")
    for r in rows:
        mark = "  (default)" if r["default"] else ""
        print(f"{r['credit']:<14}{r['tau']:>6g}{r['lr']:>8g}  {_common.format_interval(r['gain'])}  "
              f"[{r['gain_these']['lo']:+.3f}, {r['gain_these']['hi']:+.3f}]{mark}")
    print(f"({out['seconds']} s)")
    if args.json:
        _common.write_result(args.json, out)


if __name__ == "__main__":
    main()
