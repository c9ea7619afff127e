"""Pictures that show every row: learning curves beside a reference curve, and the
``--plot`` of ``simulate``/``replay``.

A curve is visible when its colour is in the image: two identical curves drawn on one
axis leave only the colour of the one drawn last, so the test of "every row shows" is that
every curve's colour is present.
"""
from __future__ import annotations

import matplotlib.colors
import matplotlib.image
import numpy as np
import pytest
from conftest import make_fake_store, run_cli

from rmm_jax.online.plot import plot_curves

SIM = ["--k", "8", "--m", "3", "--lr", "0.01", "--users-per-chunk", "2", "--checkpoint-every", "0"]


def pixels_of(png, color: str, tol: float = 0.06) -> int:
    """How many pixels of ``png`` are within ``tol`` (per RGB channel) of matplotlib colour ``color``."""
    img = matplotlib.image.imread(png)[..., :3]
    rgb = np.asarray(matplotlib.colors.to_rgb(color))
    return int((np.abs(img - rgb) <= tol).all(axis=-1).sum())


def test_identical_curves_beside_a_reference_each_show(tmp_path):
    base = list(np.linspace(0.5, 0.6, 40))
    same = list(np.linspace(0.7, 0.8, 40))
    curves = {"base": base, "pretrain": same, "online": list(np.linspace(0.5, 0.7, 40)), "pretrain+online": same}
    png = tmp_path / "curves.png"
    plot_curves(curves, png, title="t", ylabel="Recall@5", reference="base")
    for i in range(3):   # panels draw their curve in C0, C1, C2
        assert pixels_of(png, f"C{i}") > 100, f"curve C{i} does not show"
    # One axis, as before: the first of two identical curves is hidden under the last.
    one = tmp_path / "one.png"
    plot_curves({"pretrain": same, "pretrain+online": same}, one, title="t", ylabel="r")
    assert pixels_of(one, "C1") > 100 and pixels_of(one, "C0") < 0.2 * pixels_of(one, "C1")


def test_reference_must_be_a_curve(tmp_path):
    with pytest.raises(ValueError, match="reference 'base'"):
        plot_curves({"a": [0.1]}, tmp_path / "x.png", title="t", ylabel="r", reference="base")
    assert not (tmp_path / "x.png").exists()


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    return make_fake_store(tmp_path_factory.mktemp("plots") / "store", users=3, sessions=4, dim=16)


def test_simulate_and_replay_plot_the_learning_curve(capsys, tmp_path, store):
    png, log = tmp_path / "figs" / "sim.png", tmp_path / "log.jsonl"
    code, _, err = run_cli(capsys, "simulate", store, "--policies", tmp_path / "p", *SIM, "--log-out", log,
                           "--plot", png)
    assert code == 0, err
    assert f"wrote {png}" in err
    assert pixels_of(png, "0.45") > 100 and pixels_of(png, "C0") > 100   # base (grey) and the run's curve
    png2 = tmp_path / "replay.png"
    code, _, err = run_cli(capsys, "replay", store, "--log", log, "--policies", tmp_path / "p2", *SIM,
                           "--plot", png2)
    assert code == 0, err
    assert matplotlib.image.imread(png2).shape[0] > 100
    # the same log again: nothing to learn, so no figure, and the run says so
    png3 = tmp_path / "again.png"
    code, _, err = run_cli(capsys, "replay", store, "--log", log, "--policies", tmp_path / "p2", *SIM,
                           "--plot", png3)
    assert code == 0 and not png3.exists(), err
    assert f"no plot: nothing was learned, so --plot {png3} was not written" in err.splitlines(), err


@pytest.mark.parametrize("verb", ["simulate", "replay"])
def test_plot_must_be_a_png_before_any_work(capsys, tmp_path, store, verb):
    extra = ["--log", tmp_path / "missing.jsonl"] if verb == "replay" else []
    code, out, err = run_cli(capsys, verb, store, "--policies", tmp_path / "p", *extra, *SIM,
                             "--plot", tmp_path / "curve.pdf")
    assert code == 2 and out == ""
    assert err.strip().splitlines() == [f"error: --plot: must name a .png file, got '{tmp_path / 'curve.pdf'}'"]
    assert not (tmp_path / "p").exists() and not (tmp_path / "curve.pdf").exists()


def test_pretrain_plots_its_epochs(capsys, tmp_path, store):
    """``pretrain --plot``: the figure draws exactly the history the run reports (the loss of
    every trained epoch, train and validation Recall@m from the untrained start) and marks the
    epoch it kept on both panels; the PNG is written after the policy store."""
    import json

    from rmm_jax.online.plot import epochs_figure

    png = tmp_path / "figs" / "pretrain.png"
    code, out, err = run_cli(capsys, "pretrain", store, "--out", tmp_path / "pre", "--k", "8", "--m", "3",
                             "--epochs", "4", "--patience", "4", "--val-fraction", "0.34", "--plot", png, "--json")
    assert code == 0, err
    summary = json.loads(out)
    assert summary["plot"] == str(png) and f"wrote {png}" in err
    assert pixels_of(png, "C1") > 100 and pixels_of(png, "C2") > 100 and pixels_of(png, "0.45") > 50
    history = {"loss": [None, 2.0, 1.5, 1.4], "train_recall": [0.3, 0.5, 0.6, 0.7],
               "val_recall": [0.3, 0.4, 0.45, 0.42], "best_epoch": 2}
    fig = epochs_figure(history, m=3, title="t")
    loss_ax, rec_ax = fig.axes
    (loss_line,) = [ln for ln in loss_ax.get_lines() if ln.get_label() == "training loss"]
    assert list(loss_line.get_xdata()) == [1, 2, 3] and list(loss_line.get_ydata()) == [2.0, 1.5, 1.4]
    by = {ln.get_label(): ln for ln in rec_ax.get_lines()}
    assert list(by["train Recall@3"].get_ydata()) == history["train_recall"]
    assert list(by["validation Recall@3"].get_ydata()) == history["val_recall"]
    for ax in (loss_ax, rec_ax):
        (kept,) = [ln for ln in ax.get_lines() if ln.get_label() == "kept: epoch 2"]
        assert list(kept.get_xdata()) == [2, 2]


def test_pretrain_plot_without_validation_draws_no_validation_line(capsys, tmp_path, store, monkeypatch):
    """With no validation (``--labels dialogue``, ``--val-fraction 0``) every validation
    Recall is None: the legend listed a validation line that had no point, and the title said
    "validation on 0: best epoch 2" of an epoch that nothing selected (the last is kept)."""
    import rmm_jax.cli.pretrain as cli_pretrain
    from rmm_jax.online.plot import epochs_figure

    history = {"loss": [None, 2.0, 1.5], "train_recall": [0.3, 0.5, 0.6], "val_recall": [None, None, None],
               "best_epoch": 2}
    fig = epochs_figure(history, m=3, title="t")
    for ax in fig.axes:
        labels = [t.get_text() for t in ax.get_legend().get_texts()]
        assert not any("validation Recall" in x for x in labels), labels
        assert "kept: epoch 2 (the last: no validation)" in labels, labels
    titles = []
    monkeypatch.setattr(cli_pretrain, "plot_epochs", lambda h, path, *, m, title: titles.append(title))
    code, _, err = run_cli(capsys, "pretrain", store, "--out", tmp_path / "pre", "--k", "8", "--m", "3",
                           "--epochs", "2", "--val-fraction", "0", "--plot", tmp_path / "e.png")
    assert code == 0, err
    assert titles and "validation on" not in titles[0] and "no validation: the last epoch kept" in titles[0], titles


def test_pretrain_plot_must_be_a_png_before_any_work(capsys, tmp_path, store):
    code, out, err = run_cli(capsys, "pretrain", store, "--out", tmp_path / "pre", "--plot", tmp_path / "e.svg")
    assert code == 2 and out == ""
    assert err.strip().splitlines() == [f"error: --plot: must name a .png file, got '{tmp_path / 'e.svg'}'"]
    assert not (tmp_path / "pre").exists()
