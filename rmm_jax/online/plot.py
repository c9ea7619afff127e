"""Learning-curve plots (matplotlib, Agg backend: no display needed)."""
from __future__ import annotations

from pathlib import Path

from rmm_jax.persist.atomic import atomic_file


def plot_curves(curves: dict, path, *, title: str, ylabel: str, xlabel: str = "query in stream (per user)") -> None:
    """Write a PNG with one line per named curve, atomically."""
    import matplotlib  # lazy: slow to import, and Agg must be chosen before pyplot loads

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.2), dpi=120)
    for name, ys in curves.items():
        ax.plot(range(1, len(ys) + 1), ys, label=name, lw=1.8)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    with atomic_file(Path(path), "wb") as f:
        fig.savefig(f, format="png")
    plt.close(fig)


def plot_gains(gains: dict, path, *, title: str) -> None:
    """Write a PNG of named gains as points with their intervals (``gain_interval`` dicts)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

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
    with atomic_file(Path(path), "wb") as f:
        fig.savefig(f, format="png")
    plt.close(fig)
