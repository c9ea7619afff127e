"""Validate the off-policy estimators of ``rmm-jax evaluate`` against the truth, on LoCoMo.

    python benchmarks/ope_validation.py --seeds 20 --json benchmarks/results/ope_validation.json

Set-up (turn granularity, MiniLM, K=20, M=5, τ=0.1, oracle citations with the default
precision/recall 0.876/0.858, as ``rmm-jax simulate``):

* **target** π: a reranker pretrained on conversations 26 and 30 (listwise, 10 epochs),
  sampling Plackett–Luce at τ; its value is estimated on the calls of 41, 42 and 43.
* **truth**: π's exact expected value on those same queries under the same citation
  model: cited count and cite rate from the exact distribution of the shown set
  (:func:`rmm_jax.online.ope.shown_set_probs`; the oracle's expected citations depend
  only on how many shown memories are gold), Recall@M from the exact slot marginals. An
  on-policy simulation of π (the library's act-and-cite step, 200 replicates) is
  reported next to it as a check.
* scenario ``fixed``: the logging policy μ is the base retriever (identity reranker) at
  τ; each seed draws its selections and citations with the library's act-and-cite step
  (:func:`rmm_jax.core.update.simulated_batch`, what ``simulate`` runs per batch) and
  logs the behaviour's ``logits`` and ``log_prob``: every estimator applies.
* scenario ``adaptive``: the log of ``simulate --log-out`` itself
  (:func:`rmm_jax.online.run.run_online` with ``want_log=True``): μ starts at the base
  retriever and learns online, so each record's ``log_prob`` is that of the policy of
  its time; only ``log_prob`` is logged, so only IPS and SNIPS apply (both stay valid
  under adaptive logging).

Every seed's log is written as JSONL and read back by
:func:`rmm_jax.online.ope.evaluate_log`, the function behind ``rmm-jax evaluate``.
Reported per scenario, metric and estimator over the seeds: bias (mean of estimate −
truth), RMSE, coverage of the bootstrap 95% interval, mean interval width and mean ESS.
"""
from __future__ import annotations

import argparse
import functools
import json
import os
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from rmm_jax.core.reranker import init_reranker, score_batch  # noqa: E402
from rmm_jax.core.types import QueryBatch  # noqa: E402
from rmm_jax.core.update import Config, simulated_batch  # noqa: E402
from rmm_jax.data import load_locomo  # noqa: E402
from rmm_jax.data.citation_log import write_log  # noqa: E402
from rmm_jax.data.citations import DEFAULT_PRECISION, DEFAULT_RECALL  # noqa: E402
from rmm_jax.data.embed import Embedder  # noqa: E402
from rmm_jax.data.store import open_store, write_store  # noqa: E402
from rmm_jax.online.ope import evaluate_log, shown_set_probs, slot_marginals_exact  # noqa: E402
from rmm_jax.online.pretrain import PretrainConfig, pretrain  # noqa: E402
from rmm_jax.online.run import precision_recall_oracle, run_online  # noqa: E402
from rmm_jax.online.streams import load_streams  # noqa: E402
from rmm_jax.persist.atomic import write_json  # noqa: E402
from rmm_jax.persist.policy_store import PolicyStore  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
METRICS = ("cited", "cite_rate", "recall")


def call_arrays(streams, params):
    """Scores of every query's K candidates under ``params``, with the masks and gold."""
    scores, mask, gold, ng, valid, cand, uid, qid = [], [], [], [], [], [], [], []
    for s in streams:
        m = s.bank[s.cand]
        scores.append(np.asarray(score_batch(params, jnp.asarray(s.queries), jnp.asarray(m),
                                             jnp.asarray(s.cand_mask))))
        mask.append(s.cand_mask)
        gold.append(s.cand_gold)
        ng.append(s.num_gold)
        valid.append(s.valid)
        cand.append(s.cand)
        uid += [s.user_id] * len(s.query_ids)
        qid += list(s.query_ids)
    cat = np.concatenate
    return {"scores": cat(scores).astype(np.float32), "mask": cat(mask), "gold": cat(gold), "num_gold": cat(ng),
            "valid": cat(valid), "cand": cat(cand), "user": uid, "query": qid}


def exact_values(logits, mask, gold, num_gold, valid, m, precision, recall, chunk=40):
    """The exact expected cited count, cite rate and Recall@M of PL(logits) under the oracle
    citation model, per call (recall: NaN where the call has no gold)."""
    assert mask.sum(1).min() >= m, "every call needs at least M candidates"
    cited = np.zeros(len(logits))
    for s in range(0, len(logits), chunk):
        part = slice(s, s + chunk)
        members, probs = shown_set_probs(logits[part], mask[part], m)            # (C, K), (n, C)
        g = members.astype(np.float64) @ gold[part].T.astype(np.float64)        # (C, n) gold shown
        ng = m - g
        q = np.clip(recall * g * (1 - precision) / (precision * np.maximum(ng, 1)), 0, 1)
        cited[part] = (probs * (recall * g + q * ng).T).sum(1)
    incl = slot_marginals_exact(logits, mask, m).sum(1)
    rec = np.where(valid, (incl * gold).sum(1) / np.maximum(num_gold, 1), np.nan)
    return {"cited": cited, "cite_rate": cited / m, "recall": rec}


def on_policy_simulation(scores, mask, gold, cfg, cite, replicates, seed):
    """Mean cited count of the policy that samples PL(scores/τ), simulated ``replicates``
    times on every call with the library's act-and-cite step."""
    step = act_and_cite(cfg, cite)
    args = (jnp.asarray(scores), jnp.asarray(mask), jnp.asarray(gold))
    per = np.stack([np.asarray(step(*args, jax.random.fold_in(jax.random.key(seed), r))[1]).sum(1)
                    for r in range(replicates)])
    means = per.mean(1)
    return float(means.mean()), float(means.std(ddof=1) / np.sqrt(replicates))


@functools.lru_cache(maxsize=2)
def act_and_cite(cfg, cite):
    """The act-and-cite step of ``simulate`` (one jitted call for all queries):
    ``(scores, mask, gold, key) -> (selected, cited, log_prob)``."""
    def run(scores, mask, gold, key):
        n, k = scores.shape
        qb = QueryBatch(q=jnp.zeros((n, 1)), m=jnp.zeros((n, k, 1)), mask=mask, valid=jnp.ones(n, bool), gold=gold)
        b = simulated_batch(cfg, cite, scores, qb, key)
        return b.selected, b.cited, b.logged_log_prob
    return jax.jit(run)


def fixed_log(arrays, memory_ids, cfg, cite, seed, path):
    """One log of the base-retriever policy (identity reranker at τ), with its logits."""
    n, k = arrays["scores"].shape
    out = act_and_cite(cfg, cite)(jnp.asarray(arrays["scores"]), jnp.asarray(arrays["mask"]),
                                  jnp.asarray(arrays["gold"]), jax.random.key(seed))
    sel, cited, lp = (np.asarray(x) for x in out)
    logits = arrays["scores"] / np.float32(cfg.tau)
    records = []
    for i in range(n):
        ids = memory_ids[arrays["user"][i]]
        cand = [ids[j] for j in arrays["cand"][i]]
        shown = [p for p in sel[i] if p >= 0]
        records.append({"user_id": arrays["user"][i], "query_id": arrays["query"][i], "candidates": cand,
                        "selected": [cand[p] for p in shown], "cited": [cand[p] for p, c in zip(shown, cited[i]) if c],
                        "log_prob": float(lp[i]), "logits": [float(x) for x in logits[i]]})
    write_log(path, records)


def adaptive_log(streams, cfg, cite, seed, path):
    """The log ``simulate --log-out`` writes: the online learner from the base retriever."""
    p0 = init_reranker(jax.random.key(seed), streams[0].bank.shape[1])
    res = run_online(streams, p0, cfg, cite_fn=cite, seed=seed, want_log=True, users_per_chunk=len(streams))
    write_log(path, res.records)


def summarise(runs: list[dict], truth: dict) -> dict:
    out = {}
    for metric in METRICS:
        per = {}
        names = [n for n in runs[0]["estimates"].get(metric, {}) if n not in ("logged", "direct")]
        for name in names + (["direct"] if metric == "recall" else []):
            est = np.array([r["estimates"][metric][name]["value"] for r in runs])
            lo = np.array([r["estimates"][metric][name]["ci95"][0] for r in runs])
            hi = np.array([r["estimates"][metric][name]["ci95"][1] for r in runs])
            t = truth[metric]
            row = {"mean": float(est.mean()), "bias": float((est - t).mean()),
                   "rmse": float(np.sqrt(((est - t) ** 2).mean())),
                   "coverage": float(((lo <= t) & (t <= hi)).mean()), "mean_width": float((hi - lo).mean())}
            if "ess" in runs[0]["estimates"][metric][name]:
                row["mean_ess"] = float(np.mean([r["estimates"][metric][name]["ess"] for r in runs]))
            per[name] = row
        logged = np.array([r["estimates"][metric]["logged"]["value"] for r in runs])
        per["logged"] = {"mean": float(logged.mean())}
        out[metric] = per
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seeds", type=int, default=20)
    ap.add_argument("--json", default=str(REPO / "benchmarks" / "results" / "ope_validation.json"),
                    help="where to write the results")
    ap.add_argument("--locomo", default=os.environ.get("RMM_LOCOMO_DIR") or str(REPO.parent / "shared" / "data" /
                                                                               "locomo"))
    ap.add_argument("--train", default="26,30")
    ap.add_argument("--eval", default="41,42,43")
    ap.add_argument("--tau", type=float, default=0.1)
    ap.add_argument("--bootstrap", type=int, default=1000)
    ap.add_argument("--replicates", type=int, default=200, help="on-policy simulation replicates (the check)")
    ap.add_argument("--scenarios", default="fixed,adaptive")
    args = ap.parse_args(argv)
    t0 = time.perf_counter()
    cfg = Config(k=20, m=5, tau=args.tau)
    cite = precision_recall_oracle(DEFAULT_PRECISION, DEFAULT_RECALL)
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        emb = Embedder(progress=False)
        try:
            write_store(tmp / "store", load_locomo(args.locomo), "turn", emb, spec=f"locomo:{args.locomo}")
        finally:
            emb.close()
        st = open_store(tmp / "store")
        streams = {s.user_id: s for s in load_streams(st, cfg.k)}
        train, ev = args.train.split(","), args.eval.split(",")
        p0 = init_reranker(jax.random.key(0), st.dim)
        target, hist = pretrain(p0, [streams[u] for u in train], [], PretrainConfig(epochs=10))
        ps = PolicyStore.create(tmp / "target", {"kind": "linear", "dim": st.dim, "hidden": None,
                                                 "config": {"pretrained": True, "model": st.model}}, target)
        ev_streams = [streams[u] for u in ev]
        memory_ids = {s.user_id: s.memory_ids for s in ev_streams}
        behaviour = call_arrays(ev_streams, p0)
        tgt = call_arrays(ev_streams, target)
        t_setup = time.perf_counter() - t0
        per_call = exact_values(tgt["scores"] / cfg.tau, tgt["mask"], tgt["gold"], tgt["num_gold"], tgt["valid"],
                                cfg.m, DEFAULT_PRECISION, DEFAULT_RECALL)
        truth = {k: float(np.nanmean(v)) for k, v in per_call.items()}
        beh_call = exact_values(behaviour["scores"] / cfg.tau, behaviour["mask"], behaviour["gold"],
                                behaviour["num_gold"], behaviour["valid"], cfg.m, DEFAULT_PRECISION, DEFAULT_RECALL)
        sim_mean, sim_se = on_policy_simulation(tgt["scores"], tgt["mask"], tgt["gold"], cfg, cite,
                                                args.replicates, seed=10_000)
        print(f"set-up {t_setup:.1f}s; {len(tgt['user'])} calls; truth {truth}; on-policy simulation of the cited "
              f"count {sim_mean:.4f} ± {sim_se:.4f}", file=sys.stderr)
        scenarios = {}
        for name in args.scenarios.split(","):
            runs, t1 = [], time.perf_counter()
            for seed in range(args.seeds):
                log = tmp / f"{name}-{seed}.jsonl"
                if name == "fixed":
                    fixed_log(behaviour, memory_ids, cfg, cite, seed, log)
                else:
                    adaptive_log(ev_streams, cfg, cite, seed, log)
                runs.append(evaluate_log(st, log, ps, cfg, bootstrap=args.bootstrap, seed=seed))
                log.unlink()
                print(f"{name} seed {seed}: " + ", ".join(
                    f"{k} {v['value']:.3f}" for k, v in runs[-1]["estimates"]["cited"].items()), file=sys.stderr)
            scenarios[name] = {"summary": summarise(runs, truth), "seconds": round(time.perf_counter() - t1, 1),
                               "marginals": runs[0]["marginals"], "notes": runs[0]["notes"],
                               "per_seed": [{m: {k: {"value": v["value"], "ci95": v["ci95"]}
                                                 for k, v in r["estimates"][m].items()}
                                             for m in r["estimates"]} for r in runs]}
    fixed = scenarios.get("fixed", {}).get("summary", {}).get("cited", {})
    result = {
        "setup": {"data": "LoCoMo", "granularity": "turn", "model": st.model, "k": cfg.k, "m": cfg.m, "tau": cfg.tau,
                  "precision": DEFAULT_PRECISION, "recall": DEFAULT_RECALL, "train": train, "eval": ev,
                  "calls": len(tgt["user"]), "calls_with_gold": int(tgt["valid"].sum()), "seeds": args.seeds,
                  "bootstrap": args.bootstrap, "pretrain_epochs": 10,
                  "pretrain_train_recall": hist["train_recall"][-1]},
        "truth": {"target": truth, "behaviour_base_retriever": {k: float(np.nanmean(v)) for k, v in beh_call.items()},
                  "target_cited_on_policy_simulation": {"mean": sim_mean, "se": sim_se,
                                                        "replicates": args.replicates}},
        "scenarios": scenarios,
        "targets": {"coverage_snips_cited>=0.9": fixed.get("snips", {}).get("coverage", 0) >= 0.9,
                    "coverage_rips_cited>=0.9": fixed.get("rips", {}).get("coverage", 0) >= 0.9},
        "seconds": round(time.perf_counter() - t0, 1),
        "machine": f"{os.cpu_count()} CPUs, jax {jax.__version__} ({jax.default_backend()})",
    }
    write_json(Path(args.json), result)
    print(json.dumps({k: result[k] for k in ("truth", "targets", "seconds")}, indent=1))
    for sc, res in scenarios.items():
        print(f"\n{sc}:")
        for metric, per in res["summary"].items():
            for est, row in per.items():
                if est == "logged":
                    continue
                print(f"  {metric:<10} {est:<7} bias {row['bias']:+.4f}  rmse {row['rmse']:.4f}  "
                      f"coverage {row['coverage']:.2f}  width {row['mean_width']:.4f}"
                      + (f"  ess {row['mean_ess']:.0f}" if "mean_ess" in row else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
