"""When sharing pays: policy scope × number of users, and users who join later.

    python benchmarks/sharing.py --json benchmarks/results/sharing.json --plot benchmarks/results/sharing.png

Two questions, both online from the retriever (identity) with ``--preset`` (the default preset
unless given; ``sharing.json`` and ``sharing_step*.json`` ran ``realistic``, the default then) and the
class-calibrated citations (``simulate``'s default), prequential Recall@5, K = 20, M = 5:

* **Scope × users** (``curves``). At U users per group the users learn side by side in groups
  of U, each group in its own run (one shared part per group), and every U is scored on the
  same users and queries. Scope ``user`` does not depend on U (each user learns alone). Two
  populations:

  - ``synthetic``: the built-in generator (``synthetic:users=1000,sessions=6,turns=10,seed=0``,
    :mod:`rmm_jax.data.synthetic`: personas whose facts and question templates recur across
    users), 21 queries a user, U in 1, 10, 100, 1,000; the first ``--scored`` (200) users are
    scored at every U (cut into groups of U, or, for U = 1,000, learning beside 800 others);
  - ``locomo``: the five LoCoMo conversations (one user each), U in 1..5 over every subset
    of U conversations (the other conversations left out), each conversation's gain the mean
    over the subsets that hold it.

* **Late joiners** (``late``). A newcomer's first ``--first`` queries, served online by (a) a
  fresh per-user policy (scope ``user`` from the retriever), (b) the shared part that learned
  online from the other users (scope ``shared``, continuing to learn from the newcomer),
  (c) hybrid: that shared part plus the newcomer's own fresh residual (scope ``hybrid``, both
  learning); (b) and (c) minus (a), paired per query and seed. LoCoMo: each conversation
  joins after the other four learned side by side (leave one out); synthetic: users
  900..999 each join after users 0..U−1 (U = 100 and 900) learned. ``late_dialogue``: the
  same LoCoMo newcomers when starts are pretrained on dialogue pairs (``pretrain --labels
  dialogue``, the library's recipe): the newcomer alone from a start on its own pairs (its
  history is in the store when it joins; nothing shared), and hybrid whose shared part started
  from the other four's pairs, or all five's, and learned online from the other four.

* **A newcomer against the earlier users' step** (``step``). The same newcomers join after U
  synthetic users (``--late-sizes``) who learned with a shared step of c times one user's
  (``--step-multiples``). It asked how far a ceiling on the √U_a rule should be, when the
  default's c was √U. Written down before it ran: a ceiling would be the c whose hybrid
  newcomer gains most after 900 users of population 0 (``--synthetic-seed 0``); population 1
  (other personas and questions) judges it against the then default's √900 = 30. It chose 10
  (:data:`rmm_jax.core.update.SHARED_STEP_MAX_USERS`); the runs mean the same c before and
  after the ceiling (each c sets the earlier users' step size through the update's multiple).
  Between 100 and 900 users, written down before it ran: after 300 and after 600 users of
  population 0 (``--late-sizes 300,600 --step-multiples 5,10,17.32,24.49``; 17.32 = √300 and
  24.49 = √600, the rule without a ceiling), the ceiling holds at a size if the hybrid
  newcomer's gain over a fresh policy at c = 10 lies inside the 95% interval of the best c's.

What one LoCoMo conversation's learning teaches another (why sharing does not pay there)
is measured by ``benchmarks/transfer.py``.

A gain is the mean over ``--seeds`` and queries with a 95% interval: on LoCoMo it resamples
conversations, seeds and queries (:func:`rmm_jax.online.stats.gain_interval` with the
conversation as group); on the synthetic population seeds and queries. Nothing here was
tuned: the preset and its step sizes were chosen on LoCoMo 26 and 30
(``benchmarks/defaults_sweep.py``), and 41–43 are measured as they are.
"""
from __future__ import annotations

import argparse
import dataclasses
import itertools
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import _common  # noqa: E402
import jax  # noqa: E402
import numpy as np  # noqa: E402

import rmm_jax as rj  # noqa: E402
from rmm_jax.core.config import describe  # noqa: E402
from rmm_jax.core.update import shared_step_multiple  # noqa: E402
from rmm_jax.online.pretrain import DIALOGUE_RECIPE, pretrain  # noqa: E402
from rmm_jax.online.streams import Stream  # noqa: E402

SCOPES = ("user", "shared", "hybrid")
SYNTHETIC = _common.SYNTHETIC


# --------------------------------------------------------------------------- data

def head(s: Stream, n: int) -> Stream:
    """A stream's first ``n`` queries."""
    cut = lambda x: None if x is None else x[:n]  # noqa: E731
    return dataclasses.replace(s, queries=s.queries[:n], cand=s.cand[:n], cand_mask=s.cand_mask[:n],
                               cand_gold=s.cand_gold[:n], num_gold=s.num_gold[:n], valid=s.valid[:n],
                               query_ids=s.query_ids[:n], cite_gold=cut(s.cite_gold))


# --------------------------------------------------------------------------- runs

def run(streams, program, params, seed: int):
    """Every stream side by side in one chunk from ``params``: (user -> (T,) prequential recall,
    the shared part's params at the end)."""
    r = _common.run_chunk(streams, program, params, seed)
    return {u: np.asarray(o["recall"]) for u, o in r.outputs.items()}, r.shared


def grouped(streams, groups, program, params, seed: int) -> dict:
    """Each group of streams (lists of indices) in its own run; user -> (T,) recall."""
    out = {}
    for g in groups:
        out.update(run([streams[i] for i in g], program, params, seed)[0])
    return out


def curve_synthetic(streams, n_eval: int, sizes, programs, params, seeds, m, log) -> dict:
    """Gain of each scope at each group size U on the first ``n_eval`` of ``streams``: groups of U
    of them, or (U > n_eval) the first U users side by side, scored on the first ``n_eval``."""
    scored = streams[:n_eval]
    users = [s.user_id for s in scored]
    base = _common.retriever_recall(scored, m)
    out = {}
    for scope in SCOPES:
        for u in ([1] if scope == "user" else sizes):
            groups = ([list(range(n_eval))] if scope == "user" else
                      [list(range(lo, min(lo + u, n_eval))) for lo in range(0, n_eval, u)] if u <= n_eval else
                      [list(range(u))])
            per_seed = [grouped(streams, groups, programs[scope], params, seed) for seed in seeds]
            out[f"{scope}/{u}"] = {"scope": scope, "users_per_group": u,
                                   **_common.pooled_gain(per_seed, base, scored, users)}
            log(f"  synthetic {scope:<7} U={u:<5} {_common.format_interval(out[f'{scope}/{u}']['gain'])}")
    return out


def curve_locomo(streams, programs, params, seeds, m, log) -> dict:
    """Gain of each scope with U of the five conversations side by side, every subset of U."""
    users = [s.user_id for s in streams]
    base = _common.retriever_recall(streams, m)
    out = {}
    for scope in SCOPES:
        for u in ([1] if scope == "user" else range(1, len(streams) + 1)):
            subsets = [list(range(len(streams)))] if scope == "user" else \
                list(itertools.combinations(range(len(streams)), u))
            per_seed = []
            for seed in seeds:
                acc = {x: [] for x in users}
                for sub in subsets:
                    got = grouped(streams, [list(sub)] if scope != "user" else [sub], programs[scope], params, seed)
                    for x, r in got.items():
                        acc[x].append(r)
                per_seed.append({x: np.mean(v, axis=0) for x, v in acc.items()})
            out[f"{scope}/{u}"] = {"scope": scope, "users_per_group": u, "subsets": len(subsets),
                                   **_common.pooled_gain(per_seed, base, streams, users, by_user=True)}
            log(f"  locomo    {scope:<7} U={u:<5} {_common.format_interval(out[f'{scope}/{u}']['gain'])}")
    return out


def late_joiners(before: list[list[Stream]], newcomers: list[Stream], first: int, programs, params, seeds, m,
                 by_user: bool, teach=None) -> dict:
    """Newcomer i joins after the streams ``before[i]`` learned side by side: its first ``first``
    queries under a fresh user policy, the learned shared part, and hybrid, paired per query.
    ``teach`` (scope -> program, default ``programs``) is what the earlier users learn with."""
    teach = teach or programs
    heads = [head(s, first) for s in newcomers]
    base = _common.retriever_recall(heads, m)
    rows = {name: [] for name in ("retriever", "fresh user", "shared", "hybrid")}
    for seed in seeds:
        got, learned = {name: {} for name in rows}, {}
        for others, new in zip(before, heads):
            got["retriever"][new.user_id] = base[new.user_id]
            got["fresh user"].update(run([new], programs["user"], params, seed)[0])
            for scope in ("shared", "hybrid"):
                key = (scope, tuple(o.user_id for o in others))
                if key not in learned:                      # the same others learn once per seed
                    learned[key] = run(others, teach[scope], params, seed)[1]
                got[scope].update(run([new], programs[scope], learned[key], seed)[0])
        for name in rows:
            rows[name].append(got[name])
    return summary(rows, heads, first, by_user)


def summary(rows: dict, heads: list[Stream], first: int, by_user: bool) -> dict:
    """Per-seed newcomer recalls (name -> [user -> (first,)]) as recall, gain over the retriever
    and over the fresh user policy, paired per query and seed."""
    users = [s.user_id for s in heads]
    vals = {name: np.stack([_common.pooled(r, heads, users) for r in per]) for name, per in rows.items()}
    groups = _common.query_groups(heads, users) if by_user else None
    iv = lambda d: _common.gain_interval(d, groups=groups)  # noqa: E731
    return {"first": first, "newcomers": users, "queries": int(vals["retriever"].shape[1]),
            "recall": {name: float(v.mean()) for name, v in vals.items()},
            "over_retriever": {name: iv(v - vals["retriever"]) for name, v in vals.items() if name != "retriever"},
            "over_fresh_user": {name: iv(vals[name] - vals["fresh user"]) for name in rows
                                if name not in ("retriever", "fresh user")}}


def late_joiners_dialogue(loco: list[Stream], pairs: dict[str, Stream], first: int, programs, params, seeds,
                          m) -> dict:
    """LoCoMo newcomers (each after the other four) when starts are pretrained on dialogue pairs
    (``pretrain --labels dialogue``, the library's recipe, per seed): the newcomer alone from a
    start on its own pairs (its history is in the store when it joins; no sharing), and hybrid
    whose shared part started from the other four's pairs, or from all five's, and then learned
    online from the other four; beside the retriever and a fresh user policy."""
    def start(users, seed):
        return pretrain(params, [pairs[u] for u in users], [], dataclasses.replace(DIALOGUE_RECIPE, m=m), seed=seed)[0]

    heads = [head(s, first) for s in loco]
    base = _common.retriever_recall(heads, m)
    everyone = [s.user_id for s in loco]
    rows = {name: [] for name in ("retriever", "fresh user", "own dialogue start", "hybrid from the others' dialogue",
                                  "hybrid from everyone's dialogue")}
    for seed in seeds:
        got = {name: {} for name in rows}
        everyones = start(everyone, seed)                  # the same for every newcomer of this seed
        for new in heads:
            others = [s for s in loco if s.user_id != new.user_id]
            got["retriever"][new.user_id] = base[new.user_id]
            got["fresh user"].update(run([new], programs["user"], params, seed)[0])
            got["own dialogue start"].update(run([new], programs["user"], start([new.user_id], seed), seed)[0])
            for name, shared_start in (("hybrid from the others' dialogue", start([o.user_id for o in others], seed)),
                                       ("hybrid from everyone's dialogue", everyones)):
                learned = run(others, programs["hybrid"], shared_start, seed)[1]
                got[name].update(run([new], programs["hybrid"], learned, seed)[0])
        for name in rows:
            rows[name].append(got[name])
    return summary(rows, heads, first, by_user=True)


# --------------------------------------------------------------------------- main

def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0], formatter_class=_common.HelpFormatter)
    _common.add_data_option(ap)
    ap.add_argument("--synthetic-store", type=Path, default=None,
                    help=f"store of `rmm-jax embed {SYNTHETIC.format(users=1000, seed=0)}` to reuse (built there "
                         "when absent; default: a temporary one)")
    ap.add_argument("--synthetic-seed", type=int, default=0,
                    help="the synthetic population's generator seed (another seed: other personas and questions)")
    ap.add_argument("--users", type=int, default=1000, help="synthetic users in the population")
    ap.add_argument("--scored", type=int, default=200,
                    help="synthetic users scored at every U (the first ones; a larger group learns beside them)")
    ap.add_argument("--sizes", type=_common.positive_int_list, default="1,10,100,1000",
                    help="synthetic users per group")
    ap.add_argument("--late-sizes", type=_common.positive_int_list, default="100,900",
                    help="synthetic users learned before the newcomers")
    ap.add_argument("--newcomers", type=int, default=100, help="synthetic late joiners: the population's last ones")
    ap.add_argument("--first", type=int, default=20, help="a late joiner's queries measured")
    ap.add_argument("--step-multiples", type=_common.float_list, default="5,10,15,20,30",
                    help="part step: the earlier users' shared step, as multiples of one user's step (the "
                         "update's is the square root of their number, at most 10)")
    ap.add_argument("--seeds", type=_common.int_list, default="0,1,2", help="comma-separated seeds")
    ap.add_argument("--preset", default="default", choices=list(rj.PRESETS))
    ap.add_argument("--parts", default="curves,late", help="comma-separated: curves, late, step")
    ap.add_argument("--json", type=Path, default=None, help="write the results here")
    ap.add_argument("--plot", type=Path, default=None,
                    help="PNG of gain against users per group (part curves), else of a newcomer's gain against "
                         "the earlier users' step (part step)")
    args = ap.parse_args(argv)
    data = _common.require_data(args.data)
    log = lambda msg: print(msg, file=sys.stderr, flush=True)  # noqa: E731
    t0 = time.perf_counter()
    seeds = args.seeds
    parts = args.parts.split(",")
    k, m = 20, 5
    cite, cite_info = _common.citation_model("oracle")
    settings = {scope: rj.preset(args.preset, k=k, m=m, scope=scope) for scope in SCOPES}
    programs = {scope: rj.make_run(*s, cite_fn=cite) for scope, s in settings.items()}

    sizes, late_sizes = args.sizes, args.late_sizes
    n_syn = max([args.users, args.scored] + sizes + [u + args.newcomers for u in late_sizes])   # newcomers: the last
    log(f"{n_syn} synthetic users: their store ({args.synthetic_store or 'a temporary one'})")
    syn = _common.synthetic_population(n_syn, k, args.synthetic_store, args.synthetic_seed)
    log("LoCoMo: its streams and dialogue pairs (embedded, or read from the embedding cache)")
    loco_all = _common.locomo_streams(data, k, dialogue=True)
    loco, loco_pairs = loco_all.streams, {s.user_id: s for s in loco_all.dialogue}
    params = rj.init_reranker(jax.random.key(0), loco[0].bank.shape[1])
    newcomers = syn[n_syn - args.newcomers:n_syn]         # the late parts' newcomers: the population's last
    out = {"preset": args.preset, "setting": describe(*settings["user"]), "citations": cite_info, "k": k, "m": m,
           "seeds": seeds, "synthetic": SYNTHETIC.format(users=n_syn, seed=args.synthetic_seed),
           "locomo_users": [s.user_id for s in loco]}
    if "curves" in parts:
        log("scope x users")
        out["curves"] = {"synthetic": curve_synthetic(syn, args.scored, sizes, programs, params, seeds, m, log),
                         "locomo": curve_locomo(loco, programs, params, seeds, m, log)}
    if "late" in parts:
        log("late joiners")
        late = {"locomo": late_joiners([[o for o in loco if o is not s] for s in loco], loco, args.first, programs,
                                       params, seeds, m, by_user=True)}
        for u in late_sizes:
            late[f"synthetic/{u}"] = late_joiners([syn[:u]] * len(newcomers), newcomers, args.first, programs,
                                                  params, seeds, m, by_user=False)
        for name, r in late.items():
            log(f"  {name}: " + "; ".join(f"{k_} − fresh user {_common.format_interval(v)}"
                                          for k_, v in r["over_fresh_user"].items()))
        out["late"] = late
        log("late joiners from dialogue starts (LoCoMo)")
        dia = late_joiners_dialogue(loco, loco_pairs, args.first, programs, params, seeds, m)
        log("  " + "; ".join(f"{k_} − fresh user {_common.format_interval(v)}"
                             for k_, v in dia["over_fresh_user"].items()))
        out["late_dialogue"] = {"locomo": dia}
    if "step" in parts:
        log("a newcomer against the earlier users' step")
        lr = rj.PRESETS[args.preset]["lr"]
        out["step"] = {}
        for u in late_sizes:
            rows = []
            for c in args.step_multiples:
                others_lr = lr * c / float(shared_step_multiple(u))   # the shared step is that · others_lr
                taught = {scope: rj.make_run(*rj.preset(args.preset, k=k, m=m, scope=scope, lr=others_lr),
                                             cite_fn=cite) for scope in ("shared", "hybrid")}
                r = late_joiners([syn[:u]] * len(newcomers), newcomers, args.first, programs, params, seeds, m,
                                 by_user=False, teach=taught)
                rows.append({"multiple": c, "others_lr": others_lr, **r})
                gain = _common.format_interval(r["over_fresh_user"]["hybrid"])
                log(f"  synthetic/{u} x{c:g}: hybrid − fresh user {gain}")
            out["step"][f"synthetic/{u}"] = {"default_multiple": float(shared_step_multiple(u)), "rows": rows}
    out["seconds"] = round(time.perf_counter() - t0, 1)
    if args.json:
        _common.write_result(args.json, out)
    if args.plot and "curves" in out:
        plot(out, args.plot)
    elif args.plot and "step" in out:
        plot_step(out, args.plot)
    return out


def plot(out: dict, path) -> None:
    """Gain over the retriever against users per group, one line per scope and population."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for ax, (pop, rows) in zip(axes, out["curves"].items()):
        user = next(r for r in rows.values() if r["scope"] == "user")["gain"]
        xs_all = sorted({r["users_per_group"] for r in rows.values()})
        ax.axhspan(user["lo"], user["hi"], color="C0", alpha=0.15)
        ax.plot(xs_all, [user["mean"]] * len(xs_all), "C0--", label="user (each alone)")
        for c, scope in zip(("C1", "C2"), ("shared", "hybrid")):
            rs = sorted((r for r in rows.values() if r["scope"] == scope), key=lambda r: r["users_per_group"])
            xs = [r["users_per_group"] for r in rs]
            ax.errorbar(xs, [r["gain"]["mean"] for r in rs],
                        yerr=[[r["gain"]["mean"] - r["gain"]["lo"] for r in rs],
                              [r["gain"]["hi"] - r["gain"]["mean"] for r in rs]], fmt="o-", color=c, capsize=3,
                        label=scope)
        if pop == "synthetic":
            ax.set_xscale("log")
        ax.axhline(0, color="grey", lw=0.8)
        ax.set_xlabel("users learning side by side (U)")
        ax.set_ylabel("Recall@5 gain over the retriever")
        ax.set_title(f"{pop}: {out['preset']} preset, {len(out['seeds'])} seeds, 95% interval")
        ax.legend(fontsize=8)
    fig.tight_layout()
    _common.save_figure(fig, path)
    print(f"wrote {path}", file=sys.stderr)


def plot_step(out: dict, path) -> None:
    """A newcomer's gain over a fresh policy against the earlier users' shared step."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for i, (name, block) in enumerate(out["step"].items()):
        rows = block["rows"]
        xs = [r["multiple"] for r in rows]
        g = [r["over_fresh_user"]["hybrid"] for r in rows]    # shared's is in the file, within 0.001 of it
        lo, hi = [x["mean"] - x["lo"] for x in g], [x["hi"] - x["mean"] for x in g]
        ax.errorbar(xs, [x["mean"] for x in g], yerr=[lo, hi],
                    fmt="o-", color=f"C{i}", capsize=3, label=f"hybrid, after {name.split('/')[-1]} users")
        ax.axvline(block["default_multiple"], color=f"C{i}", lw=0.8, ls="--",
                   label=f"the update's step at {name.split('/')[-1]} users")
    ax.axhline(0, color="grey", lw=0.8)
    ax.set_xlabel("earlier users' shared step, in multiples of one user's")
    ax.set_ylabel("newcomer's first queries: Recall@5 − fresh policy's")
    ax.set_title(f"{out['synthetic']}: {out['preset']} preset, {len(out['seeds'])} seeds, 95% interval", fontsize=8)
    ax.legend(fontsize=7)
    fig.tight_layout()
    _common.save_figure(fig, path)
    print(f"wrote {path}", file=sys.stderr)


if __name__ == "__main__":
    main()
