"""The comparison table of the demo and the docs: base retriever, pretrained policy,
online from identity, online from pretrained, and the paper preset, all evaluated
prequentially on the same streams; and the ceiling, the best order of the retriever's K
candidates (every gold one first), which no reranker of those candidates can pass."""
from __future__ import annotations

from typing import Callable, Sequence

import jax

from rmm_jax.core.config import Setting, preset
from rmm_jax.core.reranker import init_reranker
from rmm_jax.data.citations import DEFAULT_PRECISION, DEFAULT_RECALL, precision_recall_oracle
from rmm_jax.online.loop import make_run
from rmm_jax.online.pretrain import PretrainConfig, pretrain, split_streams
from rmm_jax.online.run import run_online
from rmm_jax.online.streams import Stream
from rmm_jax.online.summary import base_summary, ceiling_values, static_summary

ROWS = ("base", "pretrain", "online", "pretrain+online", "ceiling", "paper")


def compare(train_streams: Sequence[Stream], eval_streams: Sequence[Stream], setting: Setting,
            pcfg: PretrainConfig, *,
            rows: Sequence[str] = ROWS[:5], seed: int = 0, precision: float = DEFAULT_PRECISION,
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
    layout = setting.layout
    identity = init_reranker(jax.random.key(seed), dim, layout.kind, layout.hidden)
    out, pretrained = {}, None
    if any(r.startswith("pretrain") for r in rows):
        train, val, split = split_streams(train_streams, pcfg.val_fraction, seed)
        pretrained, history = pretrain(identity, train, val, pcfg, seed=seed)
        out["_pretrain"] = {"best_epoch": history["best_epoch"], "split": split,
                            "val_recall": history["val_recall"][history["best_epoch"]]}
    cite = precision_recall_oracle(precision, recall)
    # One program per setting, built once (PureJaxRL's make_train) and run from each start:
    # "online" and "pretrain+online" share ``setting``'s, so the second row compiles nothing.
    programs = {}

    def sim(params, name):
        if name not in programs:
            s = setting if name == "setting" else preset("paper", k=layout.k, m=layout.m)
            programs[name] = make_run(*s, cite_fn=cite)
        return run_online(eval_streams, programs[name], params, seed=seed, users_per_chunk=users_per_chunk).summary

    for row in rows:
        if progress:
            progress(row)
        if row == "base":
            out[row] = base_summary(eval_streams, layout.m)
        elif row == "pretrain":
            out[row] = static_summary(eval_streams, pretrained, layout.m)
        elif row == "online":
            out[row] = sim(identity, "setting")
        elif row == "pretrain+online":
            out[row] = sim(pretrained, "setting")
        elif row == "ceiling":
            out[row] = base_summary(eval_streams, layout.m, values=ceiling_values)
        elif row == "paper":
            out[row] = sim(identity, "paper")
    return out
