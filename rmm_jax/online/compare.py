"""The comparison table of the README and the demo: base retriever, pretrained policy,
online from identity, online from pretrained, and the paper preset, all evaluated
prequentially on the same streams."""
from __future__ import annotations

from typing import Callable, Sequence

import jax

from rmm_jax.core.reranker import init_reranker
from rmm_jax.core.update import Config
from rmm_jax.data.citations import DEFAULT_PRECISION, DEFAULT_RECALL
from rmm_jax.online.pretrain import PretrainConfig, pretrain, split_streams
from rmm_jax.online.run import simulate
from rmm_jax.online.streams import Stream
from rmm_jax.online.summary import base_summary, static_summary

ROWS = ("base", "pretrain", "online", "pretrain+online", "paper")


def compare(train_streams: Sequence[Stream], eval_streams: Sequence[Stream], cfg: Config, pcfg: PretrainConfig, *,
            rows: Sequence[str] = ROWS[:4], seed: int = 0, precision: float = DEFAULT_PRECISION,
            recall: float = DEFAULT_RECALL, users_per_chunk: int = 8,
            progress: Callable[[str], None] | None = None) -> dict:
    """Row name → prequential summary on ``eval_streams`` (plus ``_pretrain`` details).

    Pretraining uses ``train_streams`` only (with its own validation split by user).
    ``progress(row)`` is told which row starts.
    """
    unknown = [r for r in rows if r not in ROWS]
    if unknown:
        raise ValueError(f"rows: unknown row {unknown[0]!r}")
    dim = eval_streams[0].bank.shape[1]
    identity = init_reranker(jax.random.key(seed), dim, cfg.kind, cfg.hidden)
    out, pretrained = {}, None
    if any(r.startswith("pretrain") for r in rows):
        train, val, split = split_streams(train_streams, pcfg.val_fraction, seed)
        pretrained, history = pretrain(identity, train, val, pcfg, seed=seed)
        out["_pretrain"] = {"best_epoch": history["best_epoch"], "split": split,
                            "val_recall": history["val_recall"][history["best_epoch"]]}
    sim = lambda p, c: simulate(eval_streams, p, c, precision=precision, recall=recall, seed=seed,
                                users_per_chunk=users_per_chunk).summary
    for row in rows:
        if progress:
            progress(row)
        if row == "base":
            out[row] = base_summary(eval_streams, cfg.m)
        elif row == "pretrain":
            out[row] = static_summary(eval_streams, pretrained, cfg.m)
        elif row == "online":
            out[row] = sim(identity, cfg)
        elif row == "pretrain+online":
            out[row] = sim(pretrained, cfg)
        elif row == "paper":
            out[row] = sim(identity, Config.preset("paper", k=cfg.k, m=cfg.m))
    return out
