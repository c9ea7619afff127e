"""Offline supervised pretraining of the shared reranker (RMM, Tan et al., ACL 2025, §4.2:
"the reranker can be initialised by supervised training on labelled retrieval data").

Listwise softmax cross-entropy (:func:`rmm_jax.core.losses.listwise_loss`) of the reranker's
scores over the base retriever's K candidates against the normalised multi-hot gold
vector; Adam; a validation split by user; early stopping on validation Recall@M of the
reranked top-M. The best parameters become every user's initial online policy.
``PretrainConfig(loss="logistic")`` fits each candidate on its own instead, gold or not, with
``realistic``'s online loss, read against the query's best score
(:func:`rmm_jax.core.losses.citation_logistic_loss`, every candidate shown and the gold ones
cited), the per-example loss a pointwise learner such as Vowpal
Wabbit's ``--loss_function logistic`` fits; ``"balanced_logistic"`` weighs a row's gold
candidates as much as its others (:func:`rmm_jax.core.losses.pointwise_loss`;
``benchmarks/learn_sweep.py start_loss`` measures both against the listwise loss).
One epoch is one jitted ``lax.scan`` over shuffled minibatches, each gathering its candidates'
embeddings from one bank of every user's memories (:func:`labelled_queries`).
"""
from __future__ import annotations

import copy
import dataclasses
import functools
from typing import Any, Iterator, NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax

from rmm_jax.core import checks
from rmm_jax.core import metrics as rmetrics
from rmm_jax.core.losses import listwise_loss, pointwise_loss
from rmm_jax.core.reranker import score_batch
from rmm_jax.core.sampling import top_m
from rmm_jax.errors import InputError


@dataclasses.dataclass(frozen=True)
class PretrainConfig:
    epochs: int = 30
    lr: float = 1e-3
    batch_size: int = 32
    weight_decay: float = 1e-2  # AdamW; the linear adapters have 2·d² parameters
    tau: float = 0.05           # listwise softmax temperature on cosine-scale scores
    patience: int = 4           # epochs without validation improvement before stopping
    val_fraction: float = 0.2   # of users (at least one when there are two or more)
    m: int = 5                  # validation metric: Recall@m of the reranked top-m
    loss: str = "listwise"      # or "logistic", "balanced_logistic": each candidate alone (pointwise_loss)

    def __post_init__(self):
        checks.check_positive(self.lr, "lr")          # optax takes NaN, negative or inf without a word
        checks.check_nonnegative(self.weight_decay, "weight_decay")
        checks.check_tau(self.tau)


LOSSES = {"listwise": listwise_loss, "logistic": pointwise_loss,
          "balanced_logistic": functools.partial(pointwise_loss, balanced=True)}


# The recipe for dialogue labels (``rmm-jax pretrain --labels dialogue``,
# :func:`rmm_jax.online.streams.load_dialogue_streams`): 2 epochs at the gold recipe's rate, no
# validation split (the last epoch is kept). Chosen on LoCoMo 26 and 30 among 2, 5 and 10 epochs
# by the worst citation model's gain with the default of the time (``realistic``) online after it
# (benchmarks/results/learn_sweep_dialogue.json; docs/method.md).
DIALOGUE_RECIPE = PretrainConfig(epochs=2, val_fraction=0.0)


def split_users(user_ids: Sequence[str], val_fraction: float, seed: int = 0) -> tuple[list, list]:
    """Deterministic train/validation split of users (no user in both); a ``val_fraction``
    that would hold out every user is refused, naming ``val_fraction``."""
    ids = sorted(user_ids)
    if len(ids) < 2 or val_fraction <= 0:
        return ids, []
    rng = np.random.default_rng(seed)
    n_val = max(1, int(round(val_fraction * len(ids))))
    if n_val >= len(ids):
        raise InputError(f"{val_fraction:g} of {len(ids)} users holds out all {len(ids)} for validation, leaving "
                         f"none to train on; give less than {(len(ids) - 0.5) / len(ids):g}",
                         arg="val_fraction")
    val = set(rng.permutation(ids)[:n_val].tolist())
    return [u for u in ids if u not in val], [u for u in ids if u in val]


def check_labelled(streams, who: str = "training") -> None:
    """``ValueError`` unless some query of ``streams`` is labelled (valid, with a gold memory
    among its candidates: a row of :func:`labelled_queries`), saying which is missing: the
    questions themselves, or their gold. The CLI checks every stream before it starts a
    run-state, so the error is its only line."""
    if any((s.valid & (s.num_gold > 0)).any() for s in streams):
        return
    if not any(s.queries.shape[0] for s in streams):             # not a matter of gold: say so
        names = ", ".join(sorted(s.user_id for s in streams))
        raise ValueError(f"pretrain: the {who} users ({names[:120]}) have no questions")
    raise ValueError(f"pretrain: no query of the {who} users has a gold memory among its candidates")


def labelled_queries(streams) -> dict:
    """The streams' queries that have at least one gold memory (others carry no listwise
    signal) as rows over one memory bank: ``bank`` (B, d) every stream's memories once, and
    per row ``q`` (N, d), ``cand`` (N, K) indices into ``bank``, ``mask``, ``gold``,
    ``num_gold``. Candidates are gathered per minibatch, so memory grows with B·d + N·K,
    not with the N·K·d of every row's candidate embeddings.

    Examples:
        >>> import numpy as np
        >>> from rmm_jax.online.streams import Stream
        >>> from rmm_jax.online.pretrain import labelled_queries
        >>> def stream(u, bank, cand, gold):
        ...     n = len(cand)
        ...     return Stream(u, bank=np.asarray(bank, np.float32), queries=np.ones((n, 2), np.float32),
        ...                   cand=np.asarray(cand), cand_mask=np.ones((n, 2), bool), cand_gold=np.asarray(gold),
        ...                   num_gold=np.asarray(gold).sum(1).astype(np.int32), valid=np.ones(n, bool))
        >>> d = labelled_queries([stream("a", [[1, 0], [0, 1]], [[1, 0]], [[True, False]]),
        ...                       stream("b", [[2, 0], [0, 2], [1, 1]], [[2, 1], [0, 1]],
        ...                              [[False, False], [False, True]])])
        >>> d["bank"].shape, d["cand"].tolist()     # b's memories follow a's; b's first query has no gold
        ((5, 2), [[1, 0], [2, 3]])
    """
    bank, q, cand, mask, gold, num_gold = [], [], [], [], [], []
    offset = 0
    for s in streams:
        keep = s.valid & (s.num_gold > 0)
        bank.append(s.bank)
        q.append(s.queries[keep])
        cand.append(np.asarray(s.cand[keep], np.int32) + offset)
        mask.append(s.cand_mask[keep])
        gold.append(s.cand_gold[keep])
        num_gold.append(s.num_gold[keep])
        offset += s.bank.shape[0]
    cat = lambda xs: np.concatenate(xs) if xs else np.zeros((0,))
    return {"bank": cat(bank), "q": cat(q), "cand": cat(cand), "mask": cat(mask), "gold": cat(gold),
            "num_gold": cat(num_gold)}


def _rows(data: dict) -> dict:
    return {k: v for k, v in data.items() if k != "bank"}


def _pad_rows(data: dict, multiple: int) -> dict:
    """The per-row arrays padded with empty rows (no candidate, no gold) to a multiple of
    ``multiple``; the bank as it is."""
    n = data["q"].shape[0]
    extra = (-n) % multiple
    return {k: (v if k == "bank" else np.concatenate([v, np.zeros((extra,) + v.shape[1:], v.dtype)]))
            for k, v in data.items()}


def _batches(rows: dict, size: int) -> dict:
    n = rows["q"].shape[0]
    return jax.tree.map(lambda x: x.reshape((n // size, size) + x.shape[1:]), rows)


@functools.partial(jax.jit, static_argnames=("m",))
def eval_per_query(params, data, m: int):
    """Per-query (Recall@m, NDCG@m) of the reranked top-m."""
    scores = score_batch(params, data["q"], data["m"], data["mask"])
    top = jax.vmap(lambda s, mk: top_m(s, m, mk))(scores, data["mask"])
    rel = rmetrics.gold_at(top, data["gold"])
    return rmetrics.recall_at_k(rel, data["num_gold"], m), rmetrics.ndcg_at_k(rel, data["num_gold"], m)


@functools.partial(jax.jit, static_argnames=("m", "chunk", "n"))
def eval_recall(params, data, m: int, chunk: int, n: int):
    """Mean Recall@m of the reranked top-m over the rows with gold among the first ``n``,
    scored ``chunk`` rows at a time (``data`` as :func:`labelled_queries` gives it, its rows
    padded to a multiple of ``chunk``; the mean is reduced over ``n`` rows, so that padding
    for the chunks does not change its float32 rounding)."""
    bank, rows = data["bank"], _rows(data)

    def recall(b):
        return eval_per_query(params, {**b, "m": bank[b["cand"]]}, m)[0]

    r = jax.lax.map(recall, _batches(rows, chunk)).reshape(-1)[:n]
    has = rows["num_gold"][:n] > 0
    return jnp.sum(jnp.where(has, r, 0.0)) / jnp.maximum(jnp.sum(has), 1)


def make_epoch(cfg: PretrainConfig, optimizer):
    """``epoch(params, opt_state, data, key) -> (params, opt_state, mean loss)``, jitted;
    ``data`` as :func:`labelled_queries` gives it, its rows a multiple of the batch size."""

    if cfg.loss not in LOSSES:
        raise ValueError(f"PretrainConfig.loss must be one of {tuple(LOSSES)}, got {cfg.loss!r}")
    loss = LOSSES[cfg.loss]

    def loss_fn(params, bank, batch):
        scores = score_batch(params, batch["q"], bank[batch["cand"]], batch["mask"])
        return loss(scores, batch["gold"], batch["mask"], cfg.tau)

    @jax.jit
    def epoch(params, opt_state, data, key):
        bank, rows = data["bank"], _rows(data)
        perm = jax.random.permutation(key, rows["q"].shape[0])
        batches = _batches(jax.tree.map(lambda x: x[perm], rows), cfg.batch_size)

        def body(carry, batch):
            params, opt_state = carry
            loss, grads = jax.value_and_grad(loss_fn)(params, bank, batch)
            updates, opt_state = optimizer.update(grads, opt_state, params)
            return (optax.apply_updates(params, updates), opt_state), loss

        (params, opt_state), losses = jax.lax.scan(body, (params, opt_state), batches)
        return params, opt_state, jnp.mean(losses)

    return epoch


class PretrainState(NamedTuple):
    """Where pretraining stands after ``epoch`` epochs (what a checkpoint holds)."""
    epoch: int
    params: Any
    opt_state: Any
    best_params: Any
    best: float               # best validation (or, without validation users, training) Recall@m
    since: int                # epochs since ``best`` improved
    history: dict             # per-epoch loss, train_recall, val_recall; best_epoch


class EpochDone(NamedTuple):
    """Epoch ``state.epoch`` finished (epoch 0: the initial parameters, evaluated)."""
    state: PretrainState
    row: dict                 # {epoch, loss (None at epoch 0: no training yet), train_recall, val_recall}


class PretrainDone(NamedTuple):
    """Training stopped: the best parameters (host arrays) and the history."""
    params: Any
    history: dict


def pretrain_epochs(params, train_streams, val_streams, cfg: PretrainConfig = PretrainConfig(), *,
                    seed: int = 0, resume: PretrainState | None = None) -> Iterator[EpochDone | PretrainDone]:
    """Supervised listwise pretraining with early stopping, one event per epoch.

    Epoch 0 is the initial parameters (the base retriever), so early stopping can keep
    them. ``resume`` (a yielded state) continues with the same result, bit for bit, as
    a run that was never stopped (epoch e always shuffles with ``fold_in(key(seed), e)``).
    The last event is a :class:`PretrainDone`; without validation users it holds the
    last epoch's parameters (nothing to select on).
    """
    check_labelled(train_streams)
    train = labelled_queries(train_streams)
    val = labelled_queries(val_streams) if val_streams else None
    if val is not None and val["q"].shape[0] == 0:
        val = None
    optimizer = optax.adamw(cfg.lr, weight_decay=cfg.weight_decay)
    data = jax.device_put(_pad_rows(train, cfg.batch_size))
    val_dev = jax.device_put(_pad_rows(val, cfg.batch_size)) if val is not None else None
    epoch_fn = make_epoch(cfg, optimizer)

    def evaluate(params, loss, history):   # training rows as the epochs see them, validation rows as they are
        tr = float(eval_recall(params, data, cfg.m, cfg.batch_size, data["q"].shape[0]))
        vr = (float(eval_recall(params, val_dev, cfg.m, cfg.batch_size, val["q"].shape[0]))
              if val_dev is not None else None)
        history["loss"].append(loss)
        history["train_recall"].append(tr)
        history["val_recall"].append(vr)
        row = {"epoch": len(history["loss"]) - 1, "loss": loss, "train_recall": tr, "val_recall": vr}
        return (vr if vr is not None else tr), row

    if resume is None:
        history = {"loss": [], "train_recall": [], "val_recall": [], "best_epoch": 0}
        best, row = evaluate(params, None, history)
        state = PretrainState(0, params, optimizer.init(params), params, best, 0, history)
        yield EpochDone(state, row)
    else:
        state = resume._replace(history=copy.deepcopy(resume.history))
    key = jax.random.key(seed)
    while state.epoch < cfg.epochs and not (val_dev is not None and state.since >= cfg.patience):
        e = state.epoch + 1
        params, opt_state, loss = epoch_fn(state.params, state.opt_state, data, jax.random.fold_in(key, e))
        history = state.history
        score_e, row = evaluate(params, float(loss), history)
        if score_e > state.best:
            history["best_epoch"] = e
            state = state._replace(best=score_e, best_params=params, since=0)
        else:
            state = state._replace(since=state.since + 1)
        state = state._replace(epoch=e, params=params, opt_state=opt_state, history=history)
        yield EpochDone(state, row)
    if val_dev is None:  # nothing to select on: keep the last epoch
        state.history["best_epoch"] = len(state.history["loss"]) - 1
        yield PretrainDone(jax.device_get(state.params), state.history)
    else:
        yield PretrainDone(jax.device_get(state.best_params), state.history)


def pretrain(params, train_streams, val_streams, cfg: PretrainConfig = PretrainConfig(), *, seed: int = 0):
    """Run :func:`pretrain_epochs` to the end; returns ``(best_params, history)``.

    History has per-epoch ``loss`` (None at epoch 0, the untrained start: it has no
    training loss), ``train_recall``, ``val_recall`` (None without validation users) and
    ``best_epoch``.
    """
    *_, done = pretrain_epochs(params, train_streams, val_streams, cfg, seed=seed)
    return done.params, done.history


def untrained_kept(history: dict, m: int) -> str | None:
    """Why early stopping kept the untrained start (epoch 0, the base retriever's ranking),
    or None when it kept a trained epoch. Only with validation users: without them the
    last epoch is kept."""
    if history["best_epoch"] != 0 or history["val_recall"][0] is None:
        return None
    start, trained = history["val_recall"][0], history["val_recall"][1:]
    best = f" (best trained: {max(trained):.4f})" if trained else ""
    epochs = f"{len(trained)} epoch" + ("" if len(trained) == 1 else "s")
    return (f"validation Recall@{m} never improved on the base retriever's {start:.4f} in {epochs}{best}; "
            "the untrained start was kept")


def split_streams(streams, val_fraction: float, seed: int = 0) -> tuple[list, list, dict]:
    """``(train streams, validation streams, {"train": ids, "validation": ids})``, split by user."""
    train_ids, val_ids = split_users([s.user_id for s in streams], val_fraction, seed)
    by_id = {s.user_id: s for s in streams}
    return [by_id[u] for u in train_ids], [by_id[u] for u in val_ids], {"train": train_ids, "validation": val_ids}
