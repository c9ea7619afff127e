"""How much citation noise online learning survives, on LoCoMo.

    python benchmarks/citation_noise.py --json benchmarks/results/citation_noise.json \\
        --plot benchmarks/results/citation_noise.png

Sweeps the two rates of the class-calibrated simulator
(:func:`rmm_jax.data.citations.oracle`): P(cite | useful shown) ``p_useful`` over
0.3 .. 1.0 and P(cite | not-useful shown) ``p_other`` over 0 .. 0.5, with the spurious
rate (calls that show no useful memory) equal to ``p_other``: a not-useful memory is
cited at ``p_other`` whatever else is shown. "Useful" is LoCoMo's gold evidence.

Every cell runs the online loop from identity (``--preset``, default: the default preset;
``calibrated`` corrects for fixed judge rates, which the sweep moves away from; with
``--matched`` each cell's learner corrects for that cell's own rates; turn memories, MiniLM,
K = 20, M = 5) on all five conversations at once: online learning from identity needs
no pretraining, so there is nothing to leave out. The JSON records the learner, preset name
and resolved fields (:func:`rmm_jax.core.config.setting_record`), as ``config.setting``, and
a ``--matched`` cell's own as that cell's ``setting``. The reported number is the
prequential Recall@5 gain over the base retriever on the conversations the default
preset was *not* tuned on (``--held-out``, default 41,42,43); the all-conversation
gain is in the JSON too. Each cell runs ``--seeds`` seeds (sampling and citation draws)
through one compiled program. The 95% interval resamples conversations, seeds and
questions (:func:`rmm_jax.online.stats.gain_interval`; ``resamples`` in the JSON); a cell
whose interval excludes 0 is significant. With three held-out conversations that
interval is approximate (see :mod:`rmm_jax.online.stats`).

Reference points, run the same way: the class-calibrated defaults (0.911 / 0.154,
spurious 0.154), the same with spurious 0, the position model (decay 0.9) and the
precision/recall simulator at its old defaults (0.876 / 0.858). And a sweep of the
spurious rate alone (``--spurious``) at the paper's p_useful / p_other.

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
from rmm_jax.data.citations import (  # noqa: E402
    DEFAULT_PRECISION,
    DEFAULT_RECALL,
    P_OTHER,
    P_USEFUL,
    POSITION_DECAY,
    oracle,
    position_oracle,
    precision_recall_oracle,
)

P_USEFUL_GRID = (0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0)
P_OTHER_GRID = (0.0, 0.1, 0.2, 0.3, 0.4, 0.5)
SPURIOUS_GRID = (0.0, 0.05, 0.1, 0.154, 0.2, 0.3)


def plot(out: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    pu, po = out["grid"]["p_useful"], out["grid"]["p_other"]
    mean = np.array([[c["held_out"]["mean"] for c in row] for row in out["cells"]])
    sig = np.array([[c["held_out"]["significant"] for c in row] for row in out["cells"]])
    lim = max(float(np.abs(mean).max()), 1e-3)
    fig, ax = plt.subplots(figsize=(7.2, 6.0))
    im = ax.imshow(mean, origin="lower", cmap="RdBu", vmin=-lim, vmax=lim, aspect="auto",
                   extent=(-0.5, len(po) - 0.5, -0.5, len(pu) - 0.5))
    for i in range(len(pu)):
        for j in range(len(po)):
            txt = f"{mean[i, j]:+.3f}" + ("" if sig[i, j] else "\n(n.s.)")
            ax.text(j, i, txt, ha="center", va="center", fontsize=7.5,
                    color="white" if abs(mean[i, j]) > 0.6 * lim else "black",
                    fontweight="bold" if sig[i, j] else "normal")
    ax.set_xticks(range(len(po)), [f"{x:g}" for x in po])
    ax.set_yticks(range(len(pu)), [f"{x:g}" for x in pu])
    # The paper's class-calibrated rates, on the grid's index scale.
    ref_cell = out["reference"]["class-calibrated (paper judge table)"]
    ref, ref_gain = ref_cell["rates"], ref_cell["held_out"]
    x = np.interp(ref["p_other"], po, range(len(po)))
    y = np.interp(ref["p_useful"], pu, range(len(pu)))
    ax.plot([x], [y], marker="*", markersize=14, color="gold", markeredgecolor="black", linestyle="none",
            label=f"paper judge rates ({ref['p_useful']}, {ref['p_other']}): "
                  f"{_common.format_interval(ref_gain)}")
    ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.11), fontsize=8, frameon=False)
    ax.set_xlabel("P(cite | not-useful memory shown) = spurious rate")
    ax.set_ylabel("P(cite | useful memory shown)")
    held = ",".join(out["config"]["held_out"])
    ax.set_title(f"LoCoMo held-out ({held}) online Recall@{out['config']['m']} gain over the retriever\n"
                 f"mean of {len(out['config']['seeds'])} seeds; bold = 95% interval (conversation, seed, "
                 f"question) excludes 0", fontsize=10)
    fig.colorbar(im, ax=ax, label="ΔRecall@5")
    fig.tight_layout()
    _common.save_figure(fig, path)


def region(out: dict) -> dict:
    """Per p_other: the smallest p_useful from which every cell above is a significant gain."""
    pu = out["grid"]["p_useful"]
    res = {}
    for j, po in enumerate(out["grid"]["p_other"]):
        col = [out["cells"][i][j]["held_out"] for i in range(len(pu))]
        lowest = None
        for i in range(len(pu) - 1, -1, -1):
            if col[i]["significant"] and col[i]["mean"] > 0:
                lowest = pu[i]
            else:
                break
        res[f"{po:g}"] = lowest
    return res


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=_common.HelpFormatter)
    _common.locomo_options(ap)
    ap.add_argument("--seeds", type=_common.positive_int, default=5, help="seeds per cell")
    ap.add_argument("--preset", default="default", choices=tuple(rj.PRESETS), help="the learner of every cell")
    ap.add_argument("--matched", action="store_true",
                    help="each grid cell's learner corrects for that cell's own rates (p_useful, p_other), "
                         "as a user who measured their generator's would; a cell with p_other >= p_useful, "
                         "where no correction exists, runs the preset as it is")
    ap.add_argument("--p-useful", type=_common.float_list, default=P_USEFUL_GRID,
                    help="comma-separated P(cite | useful)")
    ap.add_argument("--p-other", type=_common.float_list, default=P_OTHER_GRID,
                    help="comma-separated P(cite | not useful)")
    ap.add_argument("--spurious", type=_common.float_list, default=SPURIOUS_GRID,
                    help="comma-separated spurious rates swept at the paper's p_useful / p_other")
    ap.add_argument("--held-out", default=None,
                    help=f"conversations the heat map reports (default: all but {','.join(_common.TUNED_ON)})")
    _common.result_options(ap, "heat map PNG")
    args = ap.parse_args(argv)
    if _common.redrawn(ap, args, plot):
        return
    data = _common.require_data(args.data)
    t0 = time.perf_counter()

    streams = _common.locomo_streams(data, args.k, model=args.model).streams
    users = [s.user_id for s in streams]
    held = ([u for u in args.held_out.split(",") if u in users] if args.held_out
            else [u for u in users if u not in _common.TUNED_ON])
    setting = rj.preset(args.preset, k=args.k, m=args.m)
    seeds = list(range(args.seeds))
    params = rj.init_reranker(jax.random.key(0), streams[0].bank.shape[1])
    base = _common.retriever_recall(streams, args.m)

    def cell(cite_fn, rates, own=None):
        """One cell: ``setting`` (config.setting), or ``own`` (a --matched cell's learner,
        recorded in the cell as ``setting``)."""
        program = rj.make_run(*(own or setting), cite_fn=cite_fn)
        runs = [_common.online_recall(streams, program, params, seed) for seed in seeds]
        out = {"rates": rates, **({"setting": setting_record(args.preset, own)} if own else {})}
        for name, us in (("held_out", held), ("all", users)):
            diffs = np.stack([_common.pooled(r, streams, us) for r in runs]) - _common.pooled(base, streams, us)
            out[name] = _common.gain_interval(diffs, groups=_common.query_groups(streams, us))
        return out

    n_cells = len(args.p_useful) * len(args.p_other) + 4 + len(args.spurious)
    done = 0

    def tick(label):
        nonlocal done
        done += 1
        el = time.perf_counter() - t0
        print(f"  [{done}/{n_cells}] {label} ({el:.0f} s, ~{el / done * (n_cells - done):.0f} s left)",
              file=sys.stderr, flush=True)

    reference = {}
    refs = {"class-calibrated (paper judge table)":
            (oracle(), {"p_useful": P_USEFUL, "p_other": P_OTHER, "spurious": P_OTHER}),
            "class-calibrated, spurious 0":
            (oracle(spurious=0.0), {"p_useful": P_USEFUL, "p_other": P_OTHER, "spurious": 0.0}),
            f"position (decay {POSITION_DECAY})":
            (position_oracle(), {"p_useful": P_USEFUL, "p_other": P_OTHER, "spurious": P_OTHER,
                                 "decay": POSITION_DECAY}),
            "precision/recall oracle (old defaults)":
            (precision_recall_oracle(DEFAULT_PRECISION, DEFAULT_RECALL),
             {"precision": DEFAULT_PRECISION, "recall": DEFAULT_RECALL})}
    for name, (fn, rates) in refs.items():
        reference[name] = cell(fn, rates)
        tick(name)
    spurious = []
    for sp in args.spurious:
        spurious.append(cell(oracle(spurious=sp), {"p_useful": P_USEFUL, "p_other": P_OTHER, "spurious": sp}))
        tick(f"spurious {sp:g}: {spurious[-1]['held_out']['mean']:+.4f}")
    cells = []
    for pu in args.p_useful:
        row = []
        for po in args.p_other:
            matched = args.matched and po < pu
            own = rj.preset(args.preset, k=args.k, m=args.m, p_useful=pu, p_other=po) if matched else None
            row.append(cell(oracle(p_useful=pu, p_other=po, spurious=po),
                            {"p_useful": pu, "p_other": po, "spurious": po, "matched": matched}, own))
            tick(f"p_useful {pu:g}, p_other {po:g}: {row[-1]['held_out']['mean']:+.4f}")
        cells.append(row)

    out = {"grid": {"p_useful": list(args.p_useful), "p_other": list(args.p_other)}, "cells": cells,
           "reference": reference, "spurious_sweep": spurious,
           "config": {"model": args.model, "granularity": "turn", "k": args.k, "m": args.m, "preset": args.preset,
                      "setting": setting_record(args.preset, setting), "matched": args.matched,
                      "init": "identity", "conversations": users, "held_out": held, "seeds": seeds,
                      "spurious": "= p_other",
                      "interval": "rmm_jax.online.stats.gain_interval, 95%, 2000 resamples"},
           "seconds": None}
    out["region"] = region(out)
    out["seconds"] = round(time.perf_counter() - t0, 1)

    print(f"Held-out ({','.join(held)}) online Recall@{args.m} gain over the retriever, {args.seeds} seeds per cell "
          f"(* = 95% interval excludes 0):")
    corner = "p_useful \\ p_other"
    print(f"{corner:>18}" + "".join(f"{po:>10g}" for po in args.p_other))
    for pu, row in zip(args.p_useful, cells):
        print(f"{pu:>18g}" + "".join(f"{c['held_out']['mean']:>+9.4f}{'*' if c['held_out']['significant'] else ' '}"
                                     for c in row))
    print("Reference points:")
    for name, c in reference.items():
        h = c["held_out"]
        print(f"  {name:<42}{_common.format_interval(h)}")
    print(f"Spurious rate alone, at p_useful {P_USEFUL} / p_other {P_OTHER}:")
    for c in spurious:
        h = c["held_out"]
        print(f"  spurious {c['rates']['spurious']:<6g}{_common.format_interval(h)}")
    print("Smallest p_useful from which learning significantly beats the retriever, per p_other: "
          + ", ".join(f"{k}: {v}" for k, v in out["region"].items()))
    print(f"({out['seconds']} s)")
    _common.save_outputs(args, out, plot)


if __name__ == "__main__":
    main()
