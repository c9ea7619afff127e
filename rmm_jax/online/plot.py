"""Learning-curve plots (matplotlib, Agg backend: no display needed)."""
from __future__ import annotations

import textwrap
from pathlib import Path

from rmm_jax.persist.atomic import atomic_file


def _pyplot():
    import matplotlib  # lazy: slow to import, and Agg must be chosen before pyplot loads

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def _beside(ax, reference: str, ref, name: str, ys, color: str, title: str) -> None:
    """One panel: curve ``name`` drawn beside the ``reference`` curve (grey, dashed)."""
    ax.plot(range(1, len(ref) + 1), ref, label=reference, lw=1.5, ls="--", color="0.45")
    ax.plot(range(1, len(ys) + 1), ys, label=name, lw=1.8, color=color)
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=8, loc="lower right")


def _save(fig, path) -> None:
    plt = _pyplot()
    with atomic_file(Path(path), "wb") as f:
        fig.savefig(f, format="png")
    plt.close(fig)


def plot_curves(curves: dict, path, *, title: str, ylabel: str, xlabel: str = "query in stream (per user)",
                reference: str | None = None, notes: dict | None = None) -> None:
    """Write a PNG of named curves (one value per query position), atomically.

    Without ``reference``, one panel with a line per curve. With ``reference`` (a name in
    ``curves``), one panel per other curve, side by side on a shared y axis, each drawn
    beside the reference (grey, dashed): two curves that coincide (a pretrained policy
    and the same policy trained on online) stay visible, each in its own panel. ``notes``
    adds a text to a curve's panel title (e.g. its overall gain).
    """
    plt = _pyplot()
    if reference is not None and reference not in curves:
        raise ValueError(f"reference {reference!r} is not one of the curves {sorted(curves)}")
    panels = [n for n in curves if n != reference] if reference is not None else [None]
    fig, axes = plt.subplots(1, len(panels), figsize=(min(4.2 * len(panels), 12.6) if reference else 7, 4.2),
                             dpi=120, sharey=True, squeeze=False)
    for i, (ax, name) in enumerate(zip(axes[0], panels)):
        if name is None:
            for j, (n, ys) in enumerate(curves.items()):
                ax.plot(range(1, len(ys) + 1), ys, label=n, lw=1.8, color=f"C{j}")
            ax.legend()
        else:
            note = (notes or {}).get(name)
            _beside(ax, reference, curves[reference], name, curves[name], f"C{i}", f"{name}: {note}" if note else name)
        ax.set_xlabel(xlabel)
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel(ylabel)
    if reference is None:
        axes[0][0].set_title(title)
    else:
        fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    _save(fig, path)


def plot_learning(summary: dict, base: dict, path, *, m: int, label: str, title: str) -> None:
    """Write the prequential learning curves of one online run (``summary``, an
    :class:`rmm_jax.online.run.OnlineResult`'s) beside the base retriever's on the same
    calls (``base``), one panel per measure the run has: Recall@``m`` when some query has
    gold, and cited-recall@``m`` when some call has a citation (docs/lifecycle.md,
    "Measures without gold"). Each curve is the moving average of the per-call value over
    the call's position in its user's stream, among the calls the measure counts (with
    gold; with a citation), averaged over the users that reach it."""
    panels = []
    for key, curve, what in ((f"recall@{m}", "curve", f"Recall@{m}"),
                             (f"cited_recall@{m}", "cited_curve", f"cited-recall@{m} (no gold)")):
        if summary.get(key) is not None and base.get(key) is not None:
            panels.append((what, curve, summary[curve], base[curve],
                           f"{what} {summary[key]:.3f}, {summary[key] - base[key]:+.3f} vs base"))
    if not panels:
        raise ValueError("nothing to plot: no call has gold or a citation")
    plt = _pyplot()
    fig, axes = plt.subplots(1, len(panels), figsize=(5.6 * len(panels), 4.2), dpi=120, squeeze=False)
    for i, (ax, (what, curve, ys, ref, note)) in enumerate(zip(axes[0], panels)):
        _beside(ax, "base retriever", ref, label, ys, f"C{i}", note)
        ax.set_xlabel("call with gold, in stream (per user)" if curve == "curve"
                      else "call with a citation, in stream (per user)")
        ax.set_ylabel(f"{what} (moving average)")
        ax.grid(alpha=0.3)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    _save(fig, path)


def epochs_figure(history: dict, *, m: int, title: str):
    """The figure of a pretraining run's epochs (:func:`rmm_jax.online.pretrain.pretrain`'s
    ``history``): the training loss per epoch (epoch 0, the untrained start, has none), and
    the train and validation Recall@``m`` per epoch from the untrained start, with the epoch
    early stopping kept (``best_epoch``) as a dashed line on both panels. Without validation
    (every ``val_recall`` None) there is no validation line, and the kept epoch is the last."""
    plt = _pyplot()
    from matplotlib.ticker import MaxNLocator

    fig, (loss_ax, rec_ax) = plt.subplots(1, 2, figsize=(10, 4.0), dpi=120, sharex=True)
    epochs = range(len(history["val_recall"]))
    trained = [(e, x) for e, x in zip(epochs, history["loss"]) if x is not None]
    loss_ax.plot([e for e, _ in trained], [x for _, x in trained], marker="o", ms=3, color="C0", label="training loss")
    loss_ax.set_ylabel("listwise loss (train)")
    rec_ax.plot(list(epochs), history["train_recall"], marker="o", ms=3, color="C1", label=f"train Recall@{m}")
    validated = any(v is not None for v in history["val_recall"])
    if validated:
        rec_ax.plot(list(epochs), history["val_recall"], marker="o", ms=3, color="C2", label=f"validation Recall@{m}")
    rec_ax.set_ylabel(f"Recall@{m}")
    kept = f"kept: epoch {history['best_epoch']}" + ("" if validated else " (the last: no validation)")
    for ax in (loss_ax, rec_ax):
        ax.axvline(history["best_epoch"], color="0.45", ls="--", lw=1.2, label=kept)
        ax.set_xlabel("epoch (0: the untrained start, the base retriever)")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    return fig


def plot_epochs(history: dict, path, *, m: int, title: str) -> None:
    """Write :func:`epochs_figure` as a PNG, atomically."""
    _save(epochs_figure(history, m=m, title=title), path)


def plot_gains(gains: dict, path, *, title: str) -> None:
    """Write a PNG of named gains as points with their intervals (``gain_interval`` dicts)."""
    plt = _pyplot()
    names = list(gains)
    fig, ax = plt.subplots(figsize=(7, 0.45 * len(names) + 1.4), dpi=120)
    for i, n in enumerate(names):
        g = gains[n]
        ax.errorbar(g["mean"], i, xerr=[[g["mean"] - g["lo"]], [g["hi"] - g["mean"]]], fmt="o", capsize=3,
                    color="C0" if g["significant"] else "C7")
    ax.axvline(0, color="k", lw=0.8)
    ax.set_yticks(range(len(names)), names)
    ax.invert_yaxis()
    ax.set_xlabel("gain over the retriever")
    ax.set_title(title, fontsize=10)
    ax.grid(alpha=0.3, axis="x")
    fig.tight_layout()
    _save(fig, path)


def _unreliable_column(ax, i: int) -> None:
    ax.axvspan(i - 0.35, i + 0.35, facecolor="none", edgecolor="C3", hatch="///", lw=0, alpha=0.35,
               label="unreliable: no value (reason in the report)")
    ax.text(i, 0.5, "unreliable", rotation=90, ha="center", va="center", color="C3", fontsize=9,
            transform=ax.get_xaxis_transform(), bbox={"facecolor": "white", "edgecolor": "none"})


def plot_estimates(estimates: dict, ranges: dict, path, *, title: str, labels: dict | None = None,
                   verdict: dict | None = None) -> None:
    """Write a PNG of off-policy estimates (the ``estimates`` and ``ranges`` of an
    :func:`rmm_jax.online.ope.evaluate_log` report), one column per metric, atomically.

    Top row: each estimator is a point with its 95% interval (dashed where the interval
    was cut at the metric's range); the ``logged`` value is a dashed horizontal reference
    line; the y axis spans the metric's range. Bottom row (when the estimates carry
    gains): each estimator's paired gain over the logging policy with its 95% interval,
    beside a line at 0; the ``verdict``'s estimate is drawn in green when it ships. An
    unreliable estimate has no value: its column is a hollow hatched band over the whole
    height, labelled "unreliable", never a point at a number.
    """
    plt = _pyplot()
    labels = labels or {}
    metrics = list(estimates)
    gains = any(est.get("gain") is not None for per in estimates.values() for est in per.values())
    rows = 2 if gains else 1
    fig, axes = plt.subplots(rows, len(metrics), figsize=(3.6 * len(metrics) + 0.6, 4.2 * rows), dpi=120,
                             squeeze=False)
    for ax, metric in zip(axes[0], metrics):
        per = estimates[metric]
        lo, hi = ranges[metric]
        pad = 0.06 * (hi - lo) if hi > lo else 0.05
        names = [n for n in per if n != "logged"]
        logged = per.get("logged")
        if logged is not None and logged["value"] is not None:
            ax.axhline(logged["value"], ls="--", color="k", lw=1, label="logged (logging policy)")
        for i, name in enumerate(names):
            est = per[name]
            if est["value"] is None:
                _unreliable_column(ax, i)
                continue
            v, (a, b) = est["value"], est["ci95"]
            bars = ax.errorbar(i, v, yerr=[[v - a], [b - v]], fmt="o", capsize=4,
                               color="C2" if name == "direct" else "C0",
                               label="estimate, 95% interval (dashed: cut at the range)")
            if est.get("ci95_clipped"):
                bars[2][0].set_linestyle("--")
        ax.set_xticks(range(len(names)), names)
        ax.set_xlim(-0.6, len(names) - 0.4)
        ax.set_ylim(lo - pad, hi + pad)
        ax.set_title(labels.get(metric, metric), fontsize=9)
        ax.grid(alpha=0.3, axis="y")
    for ax, metric in zip(axes[1] if gains else (), metrics):
        names = [n for n in estimates[metric] if n != "logged"]
        ax.axhline(0.0, color="k", lw=1)
        for i, name in enumerate(names):
            est = estimates[metric][name]
            if est["value"] is None:
                _unreliable_column(ax, i)
                continue
            g = est.get("gain")
            if g is None:
                continue
            v, (a, b) = g["value"], g["ci95"]
            ships = verdict is not None and verdict["ship"] and (metric, name) == (verdict["metric"],
                                                                                  verdict["estimator"])
            ax.errorbar(i, v, yerr=[[v - a], [b - v]], fmt="s", capsize=4, color="C2" if ships else "C1",
                        label="gain over logged, paired 95% interval")
        ax.set_xticks(range(len(names)), names)
        ax.set_xlim(-0.6, len(names) - 0.4)
        ax.set_title(f"gain over the logging policy: {metric}", fontsize=9)
        ax.grid(alpha=0.3, axis="y")
    handles = {}
    for ax in axes.ravel():
        for h, lab in zip(*ax.get_legend_handles_labels()):
            handles.setdefault(lab, h)
    fig.legend(handles.values(), handles.keys(), loc="lower center", ncol=min(len(handles), 3), fontsize=8,
               frameon=False)
    if verdict is not None:   # wrapped to the figure: the decision is what the plot is for
        from rmm_jax.online.ope import decision
        width = int(fig.get_figwidth() * 72 / 10 * 1.6)    # characters of a 10-point line across the figure
        title += "\n" + "\n".join(textwrap.wrap(f"verdict: {decision(verdict)} ({verdict['reason']})", width))
    fig.suptitle(title, fontsize=10)
    fig.tight_layout(rect=(0, 0.07 / rows, 1, 1))
    _save(fig, path)
