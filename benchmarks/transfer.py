"""What a reranker learned from one conversation's citations does for another, on LoCoMo.

    python benchmarks/transfer.py --json benchmarks/results/transfer.json \\
        --plot benchmarks/results/transfer.png
    python benchmarks/transfer.py --no-speakers --json benchmarks/results/transfer_no_speakers.json \\
        --plot benchmarks/results/transfer_no_speakers.png

Issue 26 asks why a shared part that sees every user's citations learns less than each
user alone on LoCoMo (``learn_sweep_heldout.json``: `shared` and `hybrid` trail `user` by
0.017), and why a late joiner is served worse by the shared part the others learned than
by the retriever (``sharing.json``). A shared part can only help a user with what the
other users' data teaches about *this* user's questions. This script measures that
directly, on the two conversations the defaults were tuned on (26 and 30; nothing here
is chosen, and 41–43 are not read):

1. **Learn on A.** A reranker learns from conversation A alone, by one of the learners
   below, from the retriever (identity adapters).
2. **Score it on B, frozen.** Recall@M of its top M on every question of the *other*
   conversation B, paired per question with the retriever's (the *transfer*); and on A's
   own questions (*in-sample*: the questions it learned from).

Both directions (26 → 30, 30 → 26), ``--seeds`` seeds; a gain's 95% interval resamples
conversations, seeds and questions (:func:`rmm_jax.online.stats.gain_interval`). The
learners:

* **online**: the library's online loop (``rmm-jax simulate``), the default preset, one
  pass over A's questions in order, citations from the class-calibrated simulator
  (``simulate``'s default: P(cite | useful) 0.911, P(cite | other) 0.154) or a perfect
  one (exactly the shown gold memories are cited); with the default sampling temperature
  (τ 0.1) and with τ 1 (more exploration). Its prequential gain on A is reported beside,
  split by question: those whose gold memory was already gold for an earlier question of
  A, and those with a new gold memory among the candidates.
* **gold, listwise**: the library's supervised pretraining recipe
  (:func:`rmm_jax.online.pretrain.pretrain`: listwise over the K candidates, AdamW lr
  1e-3) on A's gold labels, for 1, 3 and 30 epochs, no early stopping (there is no other
  user to stop on).
* **gold among the retriever's top M (or 2M) only**: the same, with the candidates cut
  to the retriever's first M (2M): what gold labels teach when they cover only the
  memories a policy near the retriever shows.
* **A's dialogue pairs** (``rmm-jax pretrain --labels dialogue``): each turn of A that asks,
  with the next turn as its answer, learned by the library's dialogue recipe
  (:data:`rmm_jax.online.pretrain.DIALOGUE_RECIPE`, 2 epochs); no gold and no question of A.
  Its transfer is what a start pretrained on the other users' dialogue gives a newcomer.
* **A's online log as labels**: the calls the online loop logged on A (its shown
  memories and their citations) taken as listwise labels by the same recipe: the cited
  memories are the targets, against the shown ones or against all K candidates. This is
  the same data the online update saw, learned from by another rule.

**Speakers** (``--no-speakers``). Every LoCoMo memory begins with its speaker's name
(``"Caroline: …"``), and each conversation has its own two speakers. The names are what is
most plainly user-specific in the memories, and a reranker learned on A's could spend itself on
them. With ``--no-speakers`` every memory is embedded without its name (the questions as they
are), and the same learners run, but for the dialogue pairs, which need the names.

Gold never reaches the online, dialogue and log learners except through the simulated citations.
``logs`` records what the online runs' logs hold: the share of cited memories that are
gold, and the shares of calls that showed a gold memory and that cited anything.

LoCoMo is read from ``--data`` (default ``$RMM_LOCOMO_DIR``, else
``../shared/data/locomo``); when absent the script says so and exits 0, or 1 under
``CI=true``.
"""
from __future__ import annotations

import argparse
import dataclasses
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
from rmm_jax.data.citations import answer_oracle, oracle  # noqa: E402
from rmm_jax.online.pretrain import DIALOGUE_RECIPE, PretrainConfig, pretrain  # noqa: E402
from rmm_jax.online.streams import Stream  # noqa: E402

CITATIONS = {"class-calibrated": oracle(), "perfect": answer_oracle()}

# (name, kind, options): kind "online" (options: citations, tau), "gold" (epochs) or
# "log" (citations of the online run whose log is learned from, epochs, negatives).
ROWS = [
    ("online, class-calibrated citations", "online", {"citations": "class-calibrated", "tau": None}),
    ("online, perfect citations", "online", {"citations": "perfect", "tau": None}),
    ("online, perfect citations, τ 1", "online", {"citations": "perfect", "tau": 1.0}),
    ("gold, listwise, 1 epoch", "gold", {"epochs": 1}),
    ("gold, listwise, 3 epochs", "gold", {"epochs": 3}),
    ("gold, listwise, 30 epochs", "gold", {"epochs": 30}),
    ("gold among the retriever's top M only, 30 epochs", "gold", {"epochs": 30, "top": "m"}),
    ("gold among the retriever's top 2M only, 30 epochs", "gold", {"epochs": 30, "top": "2m"}),
    ("dialogue pairs, the dialogue recipe", "dialogue", {"epochs": DIALOGUE_RECIPE.epochs}),
    ("log of perfect citations, against shown, 30 epochs", "log",
     {"citations": "perfect", "epochs": 30, "negatives": "shown"}),
    ("log of perfect citations, against all K, 30 epochs", "log",
     {"citations": "perfect", "epochs": 30, "negatives": "all"}),
    ("log of class-calibrated citations, against shown, 30 epochs", "log",
     {"citations": "class-calibrated", "epochs": 30, "negatives": "shown"}),
    ("log of class-calibrated citations, against all K, 30 epochs", "log",
     {"citations": "class-calibrated", "epochs": 30, "negatives": "all"}),
]


def top_only(s: Stream, n: int) -> Stream:
    """``s`` with its candidates cut to the retriever's first ``n`` (gold among them only;
    a question without gold there carries no listwise signal)."""
    mask = s.cand_mask.copy()
    mask[:, n:] = False
    gold = s.cand_gold & mask
    return dataclasses.replace(s, cand_mask=mask, cand_gold=gold, num_gold=gold.sum(1).astype(np.int32),
                               valid=gold.any(1), cite_gold=None)


def seen_gold(s: Stream) -> np.ndarray:
    """Per valid question: whether one of its gold candidates was gold for an earlier
    question of the same conversation (None for a question with no gold candidate)."""
    seen, flag = set(), []
    for t in range(s.queries.shape[0]):
        ids = set(s.cand[t][s.cand_gold[t]].tolist())
        flag.append(bool(ids & seen) if ids else None)
        seen |= ids
    return np.array(flag, object)[np.asarray(s.valid, bool)]


def log_precision(outputs: list[dict], by_id: dict) -> dict:
    """What the online runs' logs hold, over seeds and users: the share of cited memories
    that are gold, and the share of calls that showed a gold memory, or cited anything."""
    cited_gold = cited = calls = gold_shown = citing = 0
    for out in outputs:
        for u, o in out.items():
            sel, c = np.asarray(o["selected"]), np.asarray(o["cited"], bool)
            valid = np.asarray(by_id[u].valid, bool)
            gold = np.take_along_axis(np.asarray(by_id[u].cand_gold), np.maximum(sel, 0), 1) & (sel >= 0)
            c, gold = c[valid], gold[valid]
            cited_gold, cited = cited_gold + int((c & gold).sum()), cited + int(c.sum())
            calls, gold_shown = calls + len(c), gold_shown + int(gold.any(1).sum())
            citing += int(c.any(1).sum())
    return {"cited_that_are_gold": cited_gold / max(cited, 1), "calls_showing_gold": gold_shown / max(calls, 1),
            "calls_citing": citing / max(calls, 1), "calls": calls}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=_common.HelpFormatter)
    _common.locomo_options(ap)
    ap.add_argument("--seeds", type=_common.positive_int, default=5,
                    help="seeds: citation draws, sampling and shuffles")
    ap.add_argument("--no-speakers", dest="speakers", action="store_false",
                    help="embed every memory without its speaker's name (the dialogue row is left out); "
                         "default: the names are kept")
    _common.result_options(ap, "transfer and in-sample gain per learner, PNG")
    args = ap.parse_args(argv)
    if _common.redrawn(ap, args, plot):
        return
    data = _common.require_data(args.data)
    t0 = time.perf_counter()
    loco = _common.locomo_streams(data, args.k, model=args.model, dialogue=args.speakers,
                                  users=list(_common.TUNED_ON), speakers=args.speakers)
    streams = loco.streams
    by_id, pairs_of = {s.user_id: s for s in streams}, {s.user_id: s for s in loco.dialogue or ()}
    rows_run = [r for r in ROWS if args.speakers or r[1] != "dialogue"]
    pairs = [(a, b) for a in _common.TUNED_ON for b in _common.TUNED_ON if a != b]
    start = rj.init_reranker(jax.random.key(0), streams[0].bank.shape[1])
    frozen = lambda params, u: _common.frozen_recall(params, by_id[u], args.m, valid_only=True)  # noqa: E731
    # the retriever's (the start's) recall in float64: a float32 recall less it is computed in float64
    base = {u: np.asarray(frozen(start, u), np.float64) for u in by_id}
    seeds = list(range(args.seeds))
    keys = dict.fromkeys((o["citations"], o.get("tau")) for _, kind, o in rows_run if kind in ("online", "log"))
    tau_of = lambda tau: {} if tau is None else {"tau": tau}  # noqa: E731  (None: the preset's)
    programs = {(c, tau): rj.make_run(*rj.preset("default", k=args.k, m=args.m, **tau_of(tau)), cite_fn=CITATIONS[c])
                for c, tau in keys}
    runs = {(key, seed): _common.run_chunk(streams, prog, start, seed)
            for key, prog in programs.items() for seed in seeds}

    def learned(kind: str, o: dict, a: str, seed: int):
        if kind == "online":
            return runs[(o["citations"], o["tau"]), seed].finals[a]
        if kind == "dialogue":
            return pretrain(start, [pairs_of[a]], [], dataclasses.replace(DIALOGUE_RECIPE, m=args.m), seed=seed)[0]
        if kind == "log":
            data_a = _common.log_as_labels(by_id[a], runs[(o["citations"], None), seed].outputs[a], o["negatives"])
        elif "top" in o:
            data_a = top_only(by_id[a], {"m": args.m, "2m": 2 * args.m}[o["top"]])
        else:
            data_a = by_id[a]
        return pretrain(start, [data_a], [], PretrainConfig(m=args.m, epochs=o["epochs"]), seed=seed)[0]

    logs = {c: log_precision([runs[(c, None), seed].outputs for seed in seeds], by_id)
            for c, tau in keys if tau is None}
    rows = []
    groups = np.concatenate([np.full(base[b].shape[0], i) for i, (_, b) in enumerate(pairs)])
    own_groups = np.concatenate([np.full(base[a].shape[0], i) for i, (a, _) in enumerate(pairs)])
    for name, kind, o in rows_run:
        transfer, own, preq = [], [], []
        for seed in seeds:
            params = {a: learned(kind, o, a, seed) for a, _ in pairs}
            transfer.append(np.concatenate([frozen(params[a], b) - base[b] for a, b in pairs]))
            own.append(np.concatenate([frozen(params[a], a) - base[a] for a, _ in pairs]))
            if kind == "online":
                out = runs[(o["citations"], o["tau"]), seed].outputs
                preq.append(np.concatenate([_common.pooled({a: out[a]["recall"]}, streams, [a]) - base[a]
                                            for a, _ in pairs]))
        row = {"name": name, "learner": kind, **o,
               "transfer": _common.gain_interval(np.stack(transfer), groups=groups),
               "in_sample": _common.gain_interval(np.stack(own), groups=own_groups)}
        if preq:
            row["prequential"] = _common.gain_interval(np.stack(preq), groups=own_groups)
            flag = np.concatenate([seen_gold(by_id[a]) for a, _ in pairs])
            preq = np.stack(preq)
            row["prequential_by_question"] = {
                "gold memory gold before": _common.gain_interval(preq[:, flag == True]),  # noqa: E712
                "new gold memory among the candidates": _common.gain_interval(preq[:, flag == False])}  # noqa: E712
        rows.append(row)
        print(f"  {name:<62} transfer {_common.format_interval(row['transfer'])}  in-sample "
              f"{_common.format_interval(row['in_sample'])}", file=sys.stderr, flush=True)
    result = {"dataset": f"locomo:{data}", "speakers": args.speakers, "conversations": list(_common.TUNED_ON),
              "directions": pairs,
              "k": args.k, "m": args.m, "granularity": "turn", "model": args.model, "seeds": seeds,
              "preset": "default", "setting": setting_record("default", rj.preset("default", k=args.k, m=args.m)),
              "pretrain": dataclasses.asdict(PretrainConfig(m=args.m)),
              "base": {u: float(v.mean()) for u, v in base.items()}, "logs": logs,
              "rows": {r["name"]: r for r in rows}, "order": [r["name"] for r in rows],
              "seconds": round(time.perf_counter() - t0, 1)}
    _common.save_outputs(args, result, plot)
    return result


def plot(result: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    rows = [result["rows"][name] for name in result.get("order", result["rows"])]   # the file's keys are sorted
    colors = {"online": "tab:blue", "gold": "tab:green", "dialogue": "tab:purple", "log": "tab:orange"}
    fig, ax = plt.subplots(figsize=(9, 0.42 * len(rows) + 1.4))
    y = np.arange(len(rows))[::-1]
    for yi, r in zip(y, rows):
        for key, off, marker in (("transfer", 0.12, "o"), ("in_sample", -0.12, "s")):
            g = r[key]
            ax.errorbar(g["mean"], yi + off, xerr=[[g["mean"] - g["lo"]], [g["hi"] - g["mean"]]], fmt=marker,
                        color=colors[r["learner"]], alpha=1.0 if key == "transfer" else 0.45, capsize=3)
    ax.axvline(0, color="grey", lw=0.8)
    ax.set_yticks(y)
    ax.set_yticklabels([r["name"] for r in rows], fontsize=8)
    ax.set_xlabel(f"Recall@{result['m']} gain over the retriever, frozen (o: on the other conversation; "
                  "faint s: on its own)", fontsize=8)
    names = "" if result.get("speakers", True) else ", memories without their speakers' names"
    ax.set_title(f"What one LoCoMo conversation teaches another (26 ↔ 30{names})", fontsize=10)
    fig.tight_layout()
    _common.save_figure(fig, path)


if __name__ == "__main__":
    main()
