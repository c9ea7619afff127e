"""Quality on LoCoMo: base retriever vs pretrained vs online vs both vs the paper preset.

    python benchmarks/quality_locomo.py --train ../shared/data/locomo --eval ../shared/data/locomo --json out.json

Pretrains on the conversations under ``--train`` and runs the online loop (oracle
citations, default precision/recall 0.876/0.858) on those under ``--eval``. When both
are the same path, each conversation is evaluated with a reranker pretrained on the
other four (leave one out). Default model all-MiniLM-L6-v2, turn granularity, K=20,
M=5. Every number is prequential Recall@5: each query scored by the policy before any
update that uses it.

Rows: ``base`` (retriever order), ``pretrain`` (pretrained policy, no online update),
``online`` (from identity, default preset), ``pretrain+online``, ``paper`` (the literal
RMM preset from identity). The default preset was chosen on conversations 26 and 30
(``--tuned-on``); the ``held-out`` column averages the others.
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402

from rmm_jax import Config  # noqa: E402
from rmm_jax.data import load_locomo  # noqa: E402
from rmm_jax.data.embed import Embedder  # noqa: E402
from rmm_jax.data.store import open_store, write_store  # noqa: E402
from rmm_jax.online.compare import compare  # noqa: E402
from rmm_jax.online.plot import plot_curves  # noqa: E402
from rmm_jax.online.pretrain import PretrainConfig  # noqa: E402
from rmm_jax.online.streams import load_streams  # noqa: E402
from rmm_jax.persist.atomic import write_json  # noqa: E402

ROWS = ("base", "pretrain", "online", "pretrain+online", "paper")


def build_store(path: Path, model: str, granularity: str, out: Path):
    emb = Embedder(model, progress=False)
    try:
        write_store(out, load_locomo(path), granularity, emb, spec=f"locomo:{path}")
    finally:
        emb.close()
    return open_store(out)


def weighted(rows_per_fold: dict, users, row: str, m: int):
    """Query-weighted mean of a row's Recall@m over ``users``."""
    num = sum(rows_per_fold[u][row]["per_user"][u][f"recall@{m}"] * rows_per_fold[u][row]["per_user"][u]["queries"]
              for u in users)
    den = sum(rows_per_fold[u][row]["per_user"][u]["queries"] for u in users)
    return num / den if den else float("nan")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    default = Path(os.environ.get("RMM_LOCOMO_DIR", Path(__file__).resolve().parents[2] / "shared/data/locomo"))
    ap.add_argument("--train", type=Path, default=default, help="LoCoMo file or directory to pretrain on")
    ap.add_argument("--eval", type=Path, default=default, help="LoCoMo file or directory to evaluate on")
    ap.add_argument("--model", default="all-MiniLM-L6-v2")
    ap.add_argument("--granularity", default="turn", choices=["turn", "session", "segment"])
    ap.add_argument("--k", type=int, default=20)
    ap.add_argument("--m", type=int, default=5)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--rows", default=",".join(ROWS), help="comma-separated rows to run")
    ap.add_argument("--tuned-on", default="26,30", help="conversations the default preset was tuned on")
    ap.add_argument("--json", type=Path, default=None, help="write the results as one JSON object")
    ap.add_argument("--plot", type=Path, default=None, help="PNG of the mean learning curves")
    args = ap.parse_args(argv)

    for p in (args.train, args.eval):
        if not p.exists():
            sys.exit(f"error: {p}: LoCoMo data not found (set --train/--eval or RMM_LOCOMO_DIR)")
    t0 = time.perf_counter()
    rows = tuple(args.rows.split(","))
    cfg = Config.preset("default", k=args.k, m=args.m)
    pcfg = PretrainConfig(m=args.m)
    with tempfile.TemporaryDirectory() as tmp:
        train_store = build_store(args.train, args.model, args.granularity, Path(tmp) / "train")
        same = args.train.resolve() == args.eval.resolve()
        eval_store = train_store if same else build_store(args.eval, args.model, args.granularity, Path(tmp) / "eval")
        train_streams = load_streams(train_store, args.k)
        eval_streams = train_streams if same else load_streams(eval_store, args.k)
        per_fold, pretrain_info = {}, {}
        for s in eval_streams:
            train = [x for x in train_streams if x.user_id != s.user_id] if same else train_streams
            res = compare(train, [s], cfg, pcfg, rows=rows, seed=args.seed,
                               progress=lambda r: print(f"  conversation {s.user_id}: {r}", file=sys.stderr))
            pretrain_info[s.user_id] = res.pop("_pretrain", None)
            per_fold[s.user_id] = res
    users = [s.user_id for s in eval_streams]
    tuned = [u for u in args.tuned_on.split(",") if u in users]
    held = [u for u in users if u not in tuned]
    m = args.m
    out = {"rows": {}, "config": {"preset": cfg.__dict__, "pretrain": pcfg.__dict__, "model": args.model,
                                  "granularity": args.granularity, "k": args.k, "m": m,
                                  "leave_one_out": same, "tuned_on": tuned},
           "pretrain": pretrain_info, "seconds": None}
    for row in rows:
        out["rows"][row] = {f"recall@{m}": weighted(per_fold, users, row, m),
                            f"recall@{m}_held_out": weighted(per_fold, held, row, m) if held else None,
                            "per_user": {u: per_fold[u][row]["per_user"][u][f"recall@{m}"] for u in users}}
    out["seconds"] = round(time.perf_counter() - t0, 1)

    base = out["rows"].get("base", {}).get(f"recall@{m}", float("nan"))
    base_h = out["rows"].get("base", {}).get(f"recall@{m}_held_out") or float("nan")
    head = "".join(f"{u:>8}" for u in users)
    print(f"Prequential Recall@{m} on LoCoMo ({args.granularity}, K={args.k}, M={m}, "
          f"{'leave one conversation out' if same else 'train/eval split'}; tuned on {','.join(tuned) or '-'}):")
    print(f"{'row':<16}{head}{'overall':>9}{'vs base':>9}{'held-out':>10}{'vs base':>9}")
    for row, r in out["rows"].items():
        cells = "".join(f"{r['per_user'][u]:>8.4f}" for u in users)
        h = r[f"recall@{m}_held_out"]
        hs = f"{h:>10.4f}{h - base_h:>+9.4f}" if h is not None else ""
        print(f"{row:<16}{cells}{r[f'recall@{m}']:>9.4f}{r[f'recall@{m}'] - base:>+9.4f}{hs}")
    print(f"({out['seconds']} s)")
    if args.plot:
        curves = {}
        for row in rows:
            cs = [per_fold[u][row]["curve"] for u in users]
            n = min(len(c) for c in cs)
            curves[row] = np.mean([c[:n] for c in cs], axis=0).tolist()
        plot_curves(curves, args.plot, title=f"LoCoMo prequential Recall@{m} (moving average, mean of conversations)",
                    ylabel=f"Recall@{m}")
    if args.json:
        write_json(args.json, out)


if __name__ == "__main__":
    main()
