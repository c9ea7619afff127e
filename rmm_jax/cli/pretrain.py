"""``rmm-jax pretrain``: offline supervised pretraining of the shared reranker."""
from __future__ import annotations

from pathlib import Path

import click
import jax

from rmm_jax.cli.common import (
    DEFAULTS,
    begin_run_state,
    check_rank,
    check_store_writable,
    checkpoint_options,
    make_setting,
    raise_option_error,
    scope_options,
    short_bank_note,
)
from rmm_jax.cli.main import cli
from rmm_jax.cli.shell import (
    MAX_INDEX,
    SEED,
    as_options,
    check_output_dir,
    check_output_file,
    emit_json,
    info,
    json_option,
    png_option,
    quiet_option,
    users_option,
)
from rmm_jax.cli.signals import StopSignals
from rmm_jax.core.reranker import KINDS, init_reranker
from rmm_jax.data.store import open_store
from rmm_jax.errors import InputError
from rmm_jax.online.plot import plot_epochs
from rmm_jax.online.pretrain import (
    DIALOGUE_RECIPE,
    EpochDone,
    PretrainConfig,
    PretrainDone,
    PretrainState,
    check_labelled,
    pretrain_epochs,
    split_streams,
    untrained_kept,
)
from rmm_jax.online.streams import load_dialogue_streams, load_streams
from rmm_jax.persist.codec import tree_digest
from rmm_jax.persist.policy_store import PolicyMeta, PolicyStore
from rmm_jax.persist.runstate import RunState, file_digest

PRETRAIN = PretrainConfig()
DIALOGUE = DIALOGUE_RECIPE
CHECKPOINTED = ("params", "opt_state", "best_params")  # PretrainState fields saved as arrays
LABELS = ("gold", "dialogue")


def scope_options_deco(f):
    for o in reversed(scope_options(new_store=True)):
        f = o(f)
    return f


def epoch_line(row: dict, m: int) -> str:
    """One progress line; epoch 0 is the untrained start, which has no training loss ('-')."""
    num = lambda x: f"{'-':>6}" if x is None else f"{x:.4f}"  # noqa: E731
    start = "  (untrained start: the base retriever)" if row["epoch"] == 0 else ""
    return (f"epoch {row['epoch']:3d}  loss {num(row['loss'])}  train R@{m} {num(row['train_recall'])}  "
            f"val R@{m} {num(row['val_recall'])}{start}")


def train_and_checkpoint(rs, streams, params, pcfg: PretrainConfig, *, every: int, seed: int):
    """Pretrain on ``streams`` (split by user), checkpointing every ``every`` epochs (0:
    only on SIGINT/SIGTERM) and resuming from ``rs``; returns ``(best, history, split)``."""
    train, val, split = split_streams(streams, pcfg.val_fraction, seed)
    resume = None
    if rs.restored is not None:
        m, t = rs.restored.meta, rs.restored.trees
        resume = PretrainState(m["epoch"], t["params"], t["opt_state"], t["best_params"], m["best"], m["since"],
                               m["history"])
        info(f"resuming from {rs.restored.path.name}: epoch {m['epoch']}")
    with StopSignals() as stop:
        for event in pretrain_epochs(params, train, val, pcfg, seed=seed, resume=resume):
            match event:
                case PretrainDone(params=best, history=history):
                    return best, history, split
                case EpochDone(state=state, row=h):
                    info(epoch_line(h, pcfg.m))
                    if state.epoch == 0:  # the initial parameters: nothing to checkpoint yet
                        continue
                    if (every and state.epoch % every == 0) or stop.signum is not None:
                        rs.save({k: getattr(state, k) for k in ("epoch", "best", "since", "history")},
                                {k: getattr(state, k) for k in CHECKPOINTED})
                    stop.check()
    raise AssertionError("pretrain_epochs always ends with PretrainDone")


@cli.command()
@click.argument("store", type=click.Path())
@click.option("--out", "out", required=True, type=click.Path(), help="New policy store directory to create.")
@users_option("Train on these users only")
@click.option("--labels", type=click.Choice(LABELS), default="gold", show_default=True,
              help="What the reranker learns to find. gold: the memories the store's questions name. dialogue: "
                   "no gold needed; each turn that asks a question, with the next turn of its session (by the "
                   "other speaker) as its answer, from the users' own memories (a store of single turns).")
@click.option("--epochs", type=int, default=None, show_default=False,
              help=f"Maximum epochs (early stopping on validation users). [default: {PRETRAIN.epochs}; "
                   f"{DIALOGUE.epochs} with --labels dialogue]")
@click.option("--lr", type=float, default=PRETRAIN.lr, help="AdamW learning rate.")
@click.option("--weight-decay", type=float, default=PRETRAIN.weight_decay, help="AdamW weight decay.")
@click.option("--temperature", type=float, default=PRETRAIN.tau, help="Listwise softmax temperature.")
@click.option("--val-fraction", type=float, default=None, show_default=False,
              help=f"Fraction of users held out for early stopping. [default: {PRETRAIN.val_fraction}; "
                   f"{DIALOGUE.val_fraction:g} with --labels dialogue]")
@click.option("--patience", type=int, default=PRETRAIN.patience, help="Epochs without validation gain before stopping.")
@click.option("--k", type=int, default=DEFAULTS.layout.k, help="Candidates from the base retriever.")
@click.option("--m", type=int, default=PRETRAIN.m, help="Validation metric is Recall@m of the reranked top-m.")
@click.option("--kind", type=click.Choice(KINDS), default=DEFAULTS.layout.kind, help="Reranker adapters.")
@click.option("--hidden", type=int, default=None, help="MLP hidden width (default: the embedding dim).")
@click.option("--seed", type=SEED, default=0, help="Seed for initialisation, split and shuffling.")
@scope_options_deco
@checkpoint_options(1, "epochs")
@png_option("Also write a PNG of the epochs: the training loss, and the train and validation Recall@m from "
            "the untrained start, with the epoch early stopping kept marked.")
@quiet_option
@json_option("the run's summary", "policies, split, best_epoch, epochs_run, train_recall@M, val_recall@M and "
             "initial_val_recall@M (null without validation users), untrained_start_kept, "
             "untrained_start_kept_reason, plot (the --plot PNG written, or null)")
def pretrain(store, out, users, labels, epochs, lr, weight_decay, temperature, val_fraction, patience, k, m, kind,
             hidden, seed, scope, rank, checkpoint_every, resume, plot_path, as_json):
    """Pretrain the shared reranker on STORE's labelled queries; write a policy store.

    Listwise softmax cross-entropy over the base retriever's K candidates against the
    gold memories, with a validation split by user and early stopping. With `--labels
    dialogue` the queries are the users' own turns that ask, and the target is the turn that
    answers (no gold; docs/method.md measures what it gains). It pays where a turn that asks
    is answered with a fact (LoCoMo), not where the asking turns are greetings: `evaluate` it
    on a day's log before it serves (docs/own-data.md). The result is every user's starting
    policy for `simulate` or `replay --init pretrained`; in scopes shared and hybrid it is
    the shared part that online runs go on training.

    Epoch 0 is the untrained start (the base retriever's ranking): it has no training
    loss (printed `-`, null in JSON). Early stopping may keep it: when no trained epoch
    beats its validation Recall@m, a note on stderr says so, and --json has
    `untrained_start_kept: true` with the reason.

    \b
    Examples:
      rmm-jax pretrain stores/synthetic --out pretrained --epochs 30 --plot pretrain.png
      rmm-jax pretrain stores/mine --labels dialogue --out warm
    """
    check_output_dir(out, f"--out {out}")
    recipe = DIALOGUE if labels == "dialogue" else PRETRAIN
    epochs = recipe.epochs if epochs is None else epochs
    val_fraction = recipe.val_fraction if val_fraction is None else val_fraction
    # each says its range: "--m: out of range: 30" did not say that --m may not pass --k
    for name, v, ok, rng in [("--epochs", epochs, epochs >= 1, ">= 1"),
                             ("--val-fraction", val_fraction, 0 <= val_fraction < 1, "in [0, 1)"),
                             ("--patience", patience, patience >= 1, ">= 1"),
                             ("--k", k, k >= 1, ">= 1"), ("--k", k, k <= MAX_INDEX, f"<= {MAX_INDEX} (int32 indices)"),
                             ("--m", m, 1 <= m <= k, f"in [1, --k={k}]")]:
        if not ok:
            raise InputError(f"must be {rng}, got {v}", where=name)
    try:
        pcfg = PretrainConfig(epochs=epochs, lr=lr, weight_decay=weight_decay, tau=temperature,
                              patience=patience, val_fraction=val_fraction, m=m)
    except ValueError as e:      # a field's check, as its option's one line (τ is --temperature)
        raise_option_error(ValueError(str(e).replace("tau: ", "temperature: ", 1)))
    layout = make_setting("default", k, m, None, None, None, None, None, None, kind, scope=scope, rank=rank,
                          hidden=hidden).layout
    o = Path(out)  # checked before training (PolicyStore.create checks again when writing)
    # (with --resume, an --out written just before a kill is checked against the result below)
    written = resume and RunState.path_for(o).is_dir()
    if resume and not written and o.is_dir() and any(o.iterdir()):    # as simulate and replay say of theirs
        raise InputError(f"no checkpoint of {out} to resume (the run that wrote it finished); to pretrain again, "
                         "leave out --resume and choose a new --out", where="--resume")
    if o.exists() and (not o.is_dir() or any(o.iterdir())) and not written:
        raise InputError("already exists and is not empty; choose a new policy store path", where=f"--out {out}")
    check_store_writable(o, f"--out {out}")
    check_output_file(plot_path, f"--plot {plot_path}")
    st = open_store(store)
    check_rank(layout, st.dim)
    with as_options("users"):        # the API names its argument, the CLI its option
        streams = (load_dialogue_streams if labels == "dialogue" else load_streams)(st, k, users)
    hint = "; without gold, --labels dialogue pretrains on the users' own chats" if labels == "gold" else ""
    try:
        check_labelled(streams, "selected" if users else "store's")   # before the run-state's notes: one line
    except ValueError as e:
        raise InputError(f"{e}{hint}", where=str(store)) from None
    params = init_reranker(jax.random.key(seed), st.dim, kind, hidden)
    options = {"--users": users, "--labels": labels, "--epochs": epochs, "--lr": lr, "--weight-decay": weight_decay,
               "--temperature": temperature, "--val-fraction": val_fraction, "--patience": patience, "--k": k,
               "--m": m, "--kind": kind, "--hidden": hidden, "--seed": seed, "--scope": scope, "--rank": rank}
    rs = begin_run_state(out, "pretrain", options, resume=resume, checkpoint_every=checkpoint_every,
                         inputs={"STORE": file_digest(store)})
    with rs:
        try:
            with as_options("val_fraction"):
                best, history, split = train_and_checkpoint(rs, streams, params, pcfg, every=checkpoint_every,
                                                            seed=seed)
        except InputError:       # an option's own error, as it is
            raise
        except ValueError as e:
            raise InputError(f"{e}{hint}", where=str(store)) from None
        meta = PolicyMeta.of(layout, st.dim, pretrained=True, model=st.model, embedding_store=str(store),
                             pretrain={**pcfg.__dict__, "seed": seed, "split": split, "labels": labels})
        if o.exists() and (not o.is_dir() or any(o.iterdir())):  # resumed after the final write?
            if tree_digest(PolicyStore.open(out).shared_state().state.params) != tree_digest(best):
                raise InputError("already exists and is not empty; choose a new policy store path",
                                 where=f"--out {out}")
            info(f"{out} was already written by the interrupted run", must_read=True)
        else:
            PolicyStore.create(out, meta, best)
        rs.finish()
    kept = untrained_kept(history, m)
    summary = {"policies": str(out), "best_epoch": history["best_epoch"], "split": split,
               f"val_recall@{m}": history["val_recall"][history["best_epoch"]],
               f"train_recall@{m}": history["train_recall"][history["best_epoch"]],
               f"initial_val_recall@{m}": history["val_recall"][0], "epochs_run": len(history["loss"]) - 1,
               "untrained_start_kept": kept is not None, "untrained_start_kept_reason": kept}
    if kept is not None:
        info(f"note: {kept}")
    short = short_bank_note(st, k, [s.user_id for s in streams] if users else None)
    if short:
        info(short)
    if plot_path is not None:
        checked = (f"validation on {len(split['validation'])}: best epoch {history['best_epoch']}"
                   if history["val_recall"][0] is not None else "no validation: the last epoch kept")
        plot_epochs(history, plot_path, m=m, title=f"pretrain on {len(split['train'])} users, {checked}")
    summary["plot"] = str(plot_path) if plot_path is not None else None   # as simulate, replay and evaluate
    if as_json:
        emit_json(summary)
    else:
        info(f"wrote {out}: best epoch {summary['best_epoch']} of {summary['epochs_run']}",   # the store it created:
             must_read=True)                                                                   # kept under -q
    if plot_path is not None:
        info(f"wrote {plot_path}")
