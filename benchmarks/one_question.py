"""One question per user (LongMemEval's shape): who can learn from it?

    python benchmarks/one_question.py --json benchmarks/results/one_question.json
    python benchmarks/one_question.py --store STORE     # e.g. `rmm-jax embed longmemeval:FILE --out STORE`
    python benchmarks/one_question.py --ablation --json benchmarks/results/one_question_ablation.json

Each user asks one question. Prequential scoring scores it with the policy *before* the
update its citations make, and that user never asks again, so in scope ``user`` nothing
learnt is ever used: the online score equals the base retriever's exactly. In scope
``shared`` (and ``hybrid``, whose shared part learns from everyone) each update helps the
users who come after. Users run ``--users-per-chunk`` at a time, in order.

Default population: ``--users`` synthetic vector users (:mod:`rmm_jax.online.vectors`,
d = 384, 100 memories, one query each; a distortion shared by all users hides the gold
memory from the base retriever). ``--store`` runs the users of an embedding store instead
(one stream per user, as LongMemEval's loader makes them). Citations: ``--citations``
(``oracle``, the class-calibrated simulator ``rmm-jax simulate`` uses, or
``precision_recall`` at 0.876/0.858; see ``_common.citation_model``), default preset.
Gains: mean ± 95% interval over ``--seeds`` and a bootstrap over users, each user one
query (:func:`rmm_jax.online.stats.gain_interval`; ``resamples`` in the JSON).

``--ablation``: scope shared only, the default's three differences from ``realistic`` (the
anchor, the best memory's logit, the step size) taken apart (``ABLATION``): which one decides
what a shared part learns from one question per user. It chooses nothing.
"""
from __future__ import annotations

import argparse
import time
from pathlib import Path

import _common  # benchmarks/_common.py
import jax
import numpy as np

import rmm_jax as rj
from rmm_jax.core.config import describe
from rmm_jax.data.store import open_store
from rmm_jax.online.streams import load_streams
from rmm_jax.online.vectors import VectorSpec, vector_chunks

SCOPES = ("user", "shared", "hybrid")
# --ablation: (label, preset, overrides): realistic (the best-score anchor, offset 0, lr 1e-4) and the
# default (the retriever's best score, offset +2, lr 3e-4), each of the six settings between them, and
# the default at offset +1
ABLATION = [("realistic: best score, offset 0, lr 1e-4", "realistic", {}),
            ("best score, offset 0, lr 3e-4", "realistic", {"lr": 3e-4}),
            ("best score, offset +2, lr 3e-4", "default", {"reference": "best"}),
            ("best score, offset +2, lr 1e-4", "default", {"reference": "best", "lr": 1e-4}),
            ("retriever, offset 0, lr 1e-4", "default", {"offset": 0.0, "lr": 1e-4}),
            ("retriever, offset 0, lr 3e-4", "default", {"offset": 0.0}),
            ("retriever, offset +2, lr 1e-4", "default", {"lr": 1e-4}),
            ("default: retriever, offset +2, lr 3e-4", "default", {}),
            ("retriever, offset +1, lr 3e-4", "default", {"offset": 1.0})]


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=_common.HelpFormatter)
    ap.add_argument("--users", type=_common.positive_int, default=600, help="synthetic users")
    ap.add_argument("--dim", type=_common.positive_int, default=384, help="embedding dimension of synthetic users")
    ap.add_argument("--store", type=_common.existing_path, default=None,
                    help="an embedding store to use instead of synthetic users")
    ap.add_argument("--k", type=_common.positive_int, default=20, help="candidates per question")
    ap.add_argument("--scopes", type=_common.choice_list(*SCOPES), default=None,
                    help=f"comma-separated [default: {','.join(SCOPES)}]")
    ap.add_argument("--citations", default="oracle", choices=_common.CITATIONS[:2], help="simulated generator")
    ap.add_argument("--users-per-chunk", type=_common.positive_int, default=8, help="users run side by side")
    ap.add_argument("--seeds", type=_common.int_list, default="0,1,2", help="comma-separated seeds")
    ap.add_argument("--ablation", action="store_true",
                    help="scope shared only: the default's anchor, offset and step size taken apart (ABLATION)")
    ap.add_argument("--json", type=Path, default=None, help="write the result here")
    args = ap.parse_args(argv)
    if args.ablation and args.scopes is not None:
        ap.error("--scopes: --ablation runs scope shared only; leave --scopes out")
    t0 = time.perf_counter()
    if args.store:
        streams = load_streams(open_store(args.store), args.k)
        source = f"store {args.store}"
    else:
        spec = VectorSpec(dim=args.dim, memories=100, queries=1, k=args.k)
        streams = [s for c in vector_chunks(spec, 0, args.users, 256) for s in c]
        source = {"synthetic vector users": spec._asdict()}
    q_per_user = [int(s.valid.sum()) for s in streams]
    params = rj.init_reranker(jax.random.key(0), streams[0].bank.shape[1])
    cite, cite_info = _common.citation_model(args.citations)
    out = {"source": source, "users": len(streams),
           "queries_per_user": {"min": min(q_per_user), "max": max(q_per_user)},
           "config": {"preset": "default", "citations": cite_info, "users_per_chunk": args.users_per_chunk},
           "rows": {}}
    seeds = args.seeds
    runs = ([(label, "shared", rj.preset(name, k=args.k, scope="shared", **kw)) for label, name, kw in ABLATION]
            if args.ablation else
            [(scope, scope, rj.preset("default", k=args.k, scope=scope)) for scope in args.scopes or SCOPES])
    if args.ablation:
        out["config"]["preset"] = "ABLATION (scope shared)"
    refs = {}                                # the retriever's Recall@m per query, once per m
    for row, scope, setting in runs:
        program = rj.make_run(*setting, cite_fn=cite)
        m = setting.layout.m
        if m not in refs:
            base = _common.retriever_recall(streams, m)
            refs[m] = np.concatenate([base[s.user_id][s.valid] for s in streams])
        ref = refs[m]
        diffs, online = [], []
        for seed in seeds:
            r = rj.run_online(streams, program, params, seed=seed, users_per_chunk=args.users_per_chunk)
            got = np.concatenate([np.asarray(r.recall[s.user_id])[s.valid] for s in streams])
            diffs.append(got - ref)
            online.append(float(got.mean()))
        g = _common.gain_interval(np.stack(diffs))
        out["rows"][row] = {"setting": describe(*setting), f"base_recall@{m}": float(ref.mean()),
                            f"online_recall@{m}": float(np.mean(online)), "gain": g,
                            "exactly_base": bool(all(np.all(d == 0) for d in diffs))}
        print(f"{row:<8} base {ref.mean():.4f}  online {np.mean(online):.4f}  gain {_common.format_interval(g)}"
              + ("  (identical to the retriever on every query)" if out["rows"][row]["exactly_base"] else ""),
              flush=True)
    out["seconds"] = round(time.perf_counter() - t0, 1)
    if args.json:
        _common.write_result(args.json, out)


if __name__ == "__main__":
    main()
