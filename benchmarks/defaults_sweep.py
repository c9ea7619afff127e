"""The sweep that chose the default preset (README, "Choosing the defaults").

    python benchmarks/defaults_sweep.py --json benchmarks/results/defaults_sweep.json

Seven settings of credit × τ × lr, each run online from identity on LoCoMo conversations
26 and 30 only (the conversations the defaults were tuned on; 41, 42, 43 stay held out),
scope user, oracle citations (precision/recall 0.876/0.858), all-MiniLM-L6-v2, turn
granularity, K=20, M=5. Each setting reports the gain in prequential Recall@5 over the
base retriever on the queries of 26 and 30 pooled: the mean over ``--seeds`` and its 95%
interval over seeds and a bootstrap over queries (:mod:`rmm_jax.online.stats`).
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import jax  # noqa: E402
import numpy as np  # noqa: E402
from quality_locomo import build_store  # noqa: E402  (the sibling benchmark's LoCoMo store builder)

from rmm_jax import Config, init_reranker  # noqa: E402
from rmm_jax.data.citations import DEFAULT_PRECISION, DEFAULT_RECALL  # noqa: E402
from rmm_jax.online.run import simulate  # noqa: E402
from rmm_jax.online.stats import format_interval, gain_interval  # noqa: E402
from rmm_jax.online.streams import load_streams  # noqa: E402
from rmm_jax.online.summary import base_values  # noqa: E402
from rmm_jax.persist.atomic import write_json  # noqa: E402

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
TUNED_ON = ("26", "30")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    default = Path(os.environ.get("RMM_LOCOMO_DIR", Path(__file__).resolve().parents[2] / "shared/data/locomo"))
    ap.add_argument("--data", type=Path, default=default, help="LoCoMo file or directory (env RMM_LOCOMO_DIR)")
    ap.add_argument("--model", default="all-MiniLM-L6-v2")
    ap.add_argument("--granularity", default="turn", choices=["turn", "session", "segment"])
    ap.add_argument("--k", type=int, default=20)
    ap.add_argument("--m", type=int, default=5)
    ap.add_argument("--seeds", default="0,1,2", help="comma-separated seeds")
    ap.add_argument("--json", type=Path, default=None, help="write the results as one JSON object")
    args = ap.parse_args(argv)

    if not args.data.exists():
        sys.exit(f"error: {args.data}: LoCoMo data not found (set --data or RMM_LOCOMO_DIR)")
    t0 = time.perf_counter()
    seeds = [int(x) for x in args.seeds.split(",")]
    m = args.m
    log = lambda msg: print(f"  {msg}", file=sys.stderr, flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        store = build_store(args.data, args.model, args.granularity, Path(tmp) / "store")
        missing = [u for u in TUNED_ON if u not in store.user_ids]
        if missing:
            sys.exit(f"error: {args.data}: conversation(s) {', '.join(missing)} not found")
        streams = load_streams(store, args.k, list(TUNED_ON))
    users = [s.user_id for s in streams]
    valid = {s.user_id: np.asarray(s.valid, bool) for s in streams}
    pooled = lambda per_user: np.concatenate([np.asarray(per_user[u], np.float64)[valid[u]] for u in users])
    base = pooled({s.user_id: np.asarray(base_values(s, m)[0]) for s in streams})

    rows = []
    for credit, tau, lr in SETTINGS:
        cfg = Config.preset("default", k=args.k, m=m, credit=credit, tau=tau, lr=lr)
        online = []
        for seed in seeds:
            log(f"credit {credit}, tau {tau}, lr {lr:g}: seed {seed}")
            identity = init_reranker(jax.random.key(seed), streams[0].bank.shape[1])
            res = simulate(streams, identity, cfg, precision=DEFAULT_PRECISION, recall=DEFAULT_RECALL, seed=seed,
                           users_per_chunk=len(streams))
            online.append(pooled(res.recall))
        online = np.stack(online)
        rows.append({"credit": credit, "tau": tau, "lr": lr, "default": cfg == Config.preset("default", k=args.k, m=m),
                     f"recall@{m}": float(online.mean()), f"base_recall@{m}": float(base.mean()),
                     "per_seed_gain": [float(x) for x in (online - base).mean(axis=1)],
                     "gain": gain_interval(online - base[None])})

    out = {"rows": rows,
           "config": {"preset": dataclasses.asdict(Config.preset("default", k=args.k, m=m)), "model": args.model,
                      "granularity": args.granularity, "k": args.k, "m": m, "seeds": seeds, "users": users,
                      "queries": int(base.size), "scope": "user", "start": "identity",
                      "citations": {"precision": DEFAULT_PRECISION, "recall": DEFAULT_RECALL}},
           "command": "python benchmarks/defaults_sweep.py " + " ".join(sys.argv[1:] if argv is None else argv)}
    out["seconds"] = round(time.perf_counter() - t0, 1)

    print(f"ΔRecall@{m} over the retriever on conversations {'+'.join(users)} ({base.size} queries; base "
          f"{base.mean():.4f}; {args.granularity}, K={args.k}, M={m}; seeds {args.seeds}; online from identity):")
    print(f"{'credit':<14}{'tau':>6}{'lr':>8}  gain [95% interval]")
    for r in rows:
        mark = "  (default)" if r["default"] else ""
        print(f"{r['credit']:<14}{r['tau']:>6g}{r['lr']:>8g}  {format_interval(r['gain'])}{mark}")
    print(f"({out['seconds']} s)")
    if args.json:
        write_json(args.json, out)


if __name__ == "__main__":
    main()
