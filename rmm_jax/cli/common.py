"""Shared CLI pieces of the verbs that learn, serve or evaluate: the learning setting's options,
the distributed options, progress bars and run-state checkpoints (what needs no JAX is in
:mod:`rmm_jax.cli.shell`)."""
from __future__ import annotations

import contextlib
import sys
from pathlib import Path

import click
import jax
from tqdm import tqdm

from rmm_jax.cli import disk_errors
from rmm_jax.cli.shell import (
    SEED,
    IndexCount,
    IntRange,
    as_options,
    check_writable,
    count,
    explicit_options,
    info,
    note_lines,
    quiet,
)
from rmm_jax.core import checks
from rmm_jax.core import config as settings
from rmm_jax.core.config import (
    PAPER_JUDGE,
    PRESETS,
    Layout,
    Setting,
    describe,
    setting_changes,
    setting_record,
)
from rmm_jax.core.losses import BASELINES, CREDITS, LOSSES, REWARDS
from rmm_jax.core.reranker import KINDS
from rmm_jax.core.scope import DEFAULT_RANK, SCOPES
from rmm_jax.data.citation_log import ReadReport
from rmm_jax.errors import InputError
from rmm_jax.online.setting import LearningSetting, SettingOptions, blamed_change, resolve_setting, shown_value
from rmm_jax.online.sharding import users_mesh
from rmm_jax.persist import runstate
from rmm_jax.persist.policy_checks import check_embedding_store
from rmm_jax.persist.policy_setting import read_setting
from rmm_jax.persist.policy_store import PolicyStore

DEFAULTS = settings.preset("default")
# Bounds of options whose size is memory: each user's stream is padded to a multiple of --batch and
# repeated --passes times before the run, and far beyond these (the paper's batch is 4; passes past
# 3 overfit, docs/method.md) the kernel's out-of-memory killer ended the run, leaving a created
# store and a run-state behind, where the bound is one line before any work.
MAX_BATCH, MAX_PASSES = 4096, 100
PAPER = settings.preset("paper")


def _field(setting: Setting, field: str):
    for part in (setting.layout, setting.estimator, setting.optimizer):
        if hasattr(part, field):
            return getattr(part, field)
    raise AttributeError(field)


def _preset_default(field: str) -> str:
    """'[default: X; paper: Y]' for a setting field the presets set."""
    return f"[default: {_field(DEFAULTS, field)}; paper: {_field(PAPER, field)}]"


def config_options(f=None, *, from_log: bool = False, new_store: bool = False):
    """Options that build a program's :class:`~rmm_jax.core.config.Setting`; unset ones come
    from --preset. ``from_log``: --k and --m default to what the log says (:func:`k_m_from_log`);
    ``new_store``: no policy store gives --scope or --rank a default (:func:`scope_options`)."""
    if f is None:
        return lambda g: config_options(g, from_log=from_log, new_store=new_store)
    k_default = dict(default=None, show_default="the log's") if from_log else dict(default=DEFAULTS.layout.k,
                                                                                   show_default=True)
    m_default = dict(default=None, show_default="the log's") if from_log else dict(default=DEFAULTS.layout.m,
                                                                                   show_default=True)
    opts = [
        click.option("--preset", type=click.Choice(tuple(PRESETS)), default="default",
                     help="Named setting: 'default' (the citations as labels of the shown memories, --loss "
                          "logistic, each logit relative to the retriever's best score with the best at +2, Adam lr "
                          "3e-4: the best worst case over citation models and scopes on 26 and 30, and its scores "
                          "stay bounded night after night, docs/method.md; 'anchored' is the same); "
                          "'anchored_calibrated' (the same loss corrected for the paper's judge rates, the best at -1: "
                          "the best worst case over LoCoMo and two synthetic populations, where the default's +2 "
                          "can fall below the retriever; not distinguishable from it on LoCoMo 41-43); "
                          "'realistic' (the same loss relative to the policy's own best score, lr 1e-4: the default "
                          "before; its scores grow with every update, docs/method.md); 'calibrated' (the logistic loss "
                          "against the policy's best score corrected for the paper's judge rates, lr 2e-4 in scope "
                          "user and 1e-4 in shared and hybrid: better when your citations follow those rates; where "
                          "the generator cites 40% or more of useless memories it falls below the retriever on "
                          "LoCoMo 41-43, docs/citations.md); 'reinforce' (REINFORCE on citation rewards, Adam lr "
                          "3e-4: the default until issue 26); 'paper' (the RMM update as written: top-M of "
                          "s + unit Gumbel, rewards ±1, b=0.5, tau=0.5 in the log-prob only, plain SGD lr 1e-3, "
                          "batch 4); 'tempered_adam' (the same with tau-scaled noise and Adam)."),
        click.option("--k", type=IndexCount(), **k_default, help="Candidates from the base retriever."),
        click.option("--m", type=IndexCount(), **m_default,
                     help="Memories shown to the generator (selected)."),
        click.option("--batch", type=IntRange(min=1, max=MAX_BATCH), default=None,
                     help=f"Queries per update {_preset_default('batch')}."),
        click.option("--tau", type=float, default=None,
                     help=f"Temperature (at least {checks.TAU_MIN:g}) of the loss's logits and, unless --draw-tau is "
                          f"given, of the draw of the shown memories {_preset_default('tau')}."),
        click.option("--draw-tau", type=float, default=None,
                     help=f"Temperature (at least {checks.TAU_MIN:g}) of the draw of the shown memories alone "
                          "(Gumbel top-M, a Plackett–Luce sample): lower shows more of the policy's own top M and "
                          "explores less. The policy store "
                          "records it and `rerank --explore` (whose --tau is this draw's) draws at it; replay "
                          "draws nothing itself [default: --tau]."),
        click.option("--lr", type=float, default=None, help=f"Learning rate {_preset_default('lr')}."),
        click.option("--reward", type=click.Choice(REWARDS), default=None,
                     help=f"Citation reward: binary 1/0 or pm1 ±1 {_preset_default('reward')}."),
        click.option("--baseline", type=click.Choice(BASELINES),
                     default=None, help=f"REINFORCE baseline {_preset_default('baseline')}."),
        click.option("--credit", type=click.Choice(CREDITS), default=None,
                     help=f"Credit assignment over the selection {_preset_default('credit')}."),
        click.option("--loss", type=click.Choice(LOSSES), default=None,
                     help="reinforce: REINFORCE on the citation rewards; logistic: the citations as labels of "
                          "the shown memories (no baseline or credit); pairwise: each cited shown memory over each "
                          "uncited one of the same call (no judge rates); reinforce and pairwise need a preset read "
                          "against the best score (--preset realistic or reinforce) [default: logistic; reinforce: "
                          "reinforce]."),
        click.option("--p-useful", type=float, default=None,
                     help="The citations' correction: your generator's P(cite | a useful memory is shown), "
                          "as measured against a judge (docs/citations.md); the logistic loss models the rates, "
                          "REINFORCE corrects its rewards for them. With the default it paid where the generator "
                          "cites other memories often (`cite-rates` says when) [default: 1 (no correction); "
                          f"calibrated and anchored_calibrated: {PAPER_JUDGE['p_useful']}, the paper's]."),
        click.option("--p-other", type=float, default=None,
                     help="The same for P(cite | a memory that is not useful is shown), below --p-useful "
                          f"[default: 0 (no correction); calibrated and anchored_calibrated: {PAPER_JUDGE['p_other']}, "
                          "the paper's]."),
        click.option("--offset", type=float, default=None,
                     help="The logistic loss's logit of a memory scored at its anchor (the retriever's best "
                          "score under the default, the policy's own best under realistic): memories cited less "
                          "often than sigmoid(offset) are pushed below it. +2 was best on LoCoMo; 0 learned more "
                          "for one question per user and on the scale benchmark's users (docs/scopes.md) "
                          "[default: 2 (default, anchored); 0 (realistic); -1 (calibrated, anchored_calibrated); "
                          "the reinforce and pairwise losses read none]."),
        click.option("--kind", type=click.Choice(KINDS), default=DEFAULTS.layout.kind if new_store else None,
                     show_default=True if new_store else f"{DEFAULTS.layout.kind}, or the store's",
                     help="Reranker adapters (when creating a policy store)."),
        *scope_options(new_store),
        click.option("--seed", type=SEED, default=0, show_default=True,
                     help="Run seed (per-user keys derive from it)."),
    ]
    for o in reversed(opts):
        f = o(f)
    return f


def scope_options(new_store: bool = False) -> list:
    """``--scope`` and ``--rank``: who learns from whose citations (docs/scopes.md).
    ``new_store``: the verb always writes a new policy store (``pretrain``) or none (``demo``),
    so no default comes from an existing one."""
    store = "" if new_store else ", or the store's"
    return [
        click.option("--scope", type=click.Choice(SCOPES), default=None, show_default=f"user{store}",
                     help="user: a private reranker per user; shared: one reranker learns from every user; "
                          "hybrid: shared + a per-user low-rank residual. Stored in the policy store."),
        click.option("--rank", type=int, default=None, show_default=f"{DEFAULT_RANK}{store}",
                     help="Rank r of the per-user residual A Bᵀ, 1 <= r < d: only with --scope hybrid (refused with "
                          "another scope, where nothing would use it)."),
    ]


def distributed_options(f):
    """``--coordinator``, ``--num-processes``, ``--process-id``: one run over several hosts."""
    f = click.option("--process-id", type=int, default=0, show_default=True,
                     help="This process's index in [0, --num-processes).")(f)
    f = click.option("--num-processes", type=int, default=1, show_default=True,
                     help="Processes taking part (one per host or per accelerator set); each runs the same "
                          "command with its own --process-id.")(f)
    f = click.option("--coordinator", default=None, metavar="HOST:PORT",
                     help="Address of process 0 for jax.distributed; with it the users of each chunk are "
                          "sharded over every device of every process, and process 0 writes the results.")(f)
    f = click.option("--shard", is_flag=True,
                     help="Shard each users chunk over all local devices (implied by --coordinator).")(f)
    return f


DISTRIBUTED_OPTIONS = ("coordinator", "num_processes", "process_id", "shard")


def start_distributed(opts: dict, *, users_per_chunk: int, resume: bool):
    """Read the :func:`distributed_options` from ``opts`` (left as they are), join the run's processes
    (``jax.distributed``, gloo collectives on CPU) and return the users mesh, or None for
    a single-device run. Must run before any JAX computation."""
    coordinator, num_processes, process_id, shard = (opts[k] for k in DISTRIBUTED_OPTIONS)
    if num_processes < 1:
        raise InputError(f"must be >= 1, got {num_processes}", where="--num-processes")
    if not 0 <= process_id < num_processes:
        raise InputError(f"must be in [0, {num_processes}), got {process_id}", where="--process-id")
    if num_processes > 1 and not coordinator:
        raise InputError("several processes need the coordinator's HOST:PORT", where="--coordinator")
    if coordinator:
        host, _, port = coordinator.rpartition(":")
        if not host or not port.isdigit():
            raise InputError(f"expected HOST:PORT, got {coordinator!r}", where="--coordinator")
        if resume and num_processes > 1:
            raise InputError("a run over several processes cannot be resumed (only process 0 checkpoints); "
                             "rerun it", where="--resume")
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
        jax.distributed.initialize(coordinator, num_processes=num_processes, process_id=process_id)
    if not (coordinator or shard):
        return None
    mesh = users_mesh()
    if users_per_chunk % mesh.devices.size:
        raise InputError(f"{users_per_chunk} users do not split over {mesh.devices.size} devices; use a multiple",
                         where="--users-per-chunk")
    return mesh


def open_policies_for(path, st, *, keep: int | None = None) -> PolicyStore:
    """The existing policy store at ``path`` (``--policies``), checked against embedding store
    ``st``: the same dimension, and the same embedding model when the policy store records
    one (two models of one dimension embed into different spaces)."""
    ps = PolicyStore.open(path, expect_dim=st.dim, keep=keep)
    try:
        check_embedding_store(ps, st, "policies")
    except InputError as e:
        raise InputError(e.message, where=f"--policies {path}") from None
    return ps


def is_writer() -> bool:
    """Only process 0 of a multi-process run writes policies, logs and run-state."""
    return jax.process_index() == 0


def begin_run_state_if_single(target, command: str, options: dict, **kw):
    """:func:`begin_run_state`, or a context yielding None when several processes run: only
    process 0 writes, and a run over several processes is restarted, not resumed."""
    if jax.process_count() > 1:
        return contextlib.nullcontext()
    return begin_run_state(target, command, options, **kw)


def check_rank(layout: Layout, dim: int) -> None:
    """The per-user residual's rank must be below the embedding dimension."""
    try:
        layout.scope.validate(layout.kind, dim)
    except ValueError as e:
        raise_option_error(e)


def check_tau_option(tau: float | None, option: str = "--tau") -> None:
    """``--tau`` (None: not given) as the core checks a temperature, as the one line of
    ``option`` (rerank's and evaluate's ``--draw-tau``)."""
    if tau is not None:
        try:
            checks.check_tau(tau)
        except ValueError as e:
            raise_option_error(e, option)


def short_bank_note(st, k: int, users=None) -> str | None:
    """The stderr note of a run whose ``--k`` exceeds some users' memory banks (``users``:
    the ids it runs, None all): their calls rank every memory they hold. ``retrieve``
    refuses such a K (its Recall@K would count every memory); a learner just ranks fewer."""
    sizes = st.bank_sizes
    short = [sizes[u] for u in (users if users is not None else sizes) if sizes[u] < k]
    if not short:
        return None
    of = len(sizes) if users is None else len(users)
    return (f"note: --k {k} is more than the memory bank of {len(short)} of {count(of, 'user')} (the largest of "
            f"those holds {max(short)}): their queries rank every memory they hold")


def check_kind_scope(kind: str, scope: str | None) -> None:
    """Hybrid's low-rank residual adapts the linear reranker's W: another ``--kind`` is refused
    as ``--kind``'s line (the core names the scope, which may be the policy store's, not given)."""
    if scope == "hybrid" and kind != "linear":
        raise InputError("scope hybrid needs the linear reranker (its low-rank residual adapts W); give --kind "
                         "linear, or scope user or shared", where=f"--kind {kind}")


def check_rank_scope(scope: str | None, rank: int | None) -> None:
    """``--rank`` sizes hybrid's per-user part: with another scope (None: user) it would be
    ignored, so it is refused in one line."""
    if rank is not None and (scope or "user") != "hybrid":
        raise InputError(f"only scope hybrid has a per-user rank; this run's scope is {scope or 'user'} "
                         "(give --scope hybrid, or leave --rank out)", where=f"--rank {rank}")


# core messages that name other fields than their own, as the options that give them
OPTION_WORDS = {settings.PAIRWISE_RATES: "the pairwise loss takes no judge rates or offset (--p-useful, --p-other, "
                                         "--offset; --preset calibrated sets the rates and offset): drop them, or use "
                                         "--loss logistic",
                settings.LOGISTIC_REFERENCE: "the default preset (and 'anchored') reads the logistic loss against the "
                                             "retriever's best score: leave --loss out (logistic), or use another "
                                             "--preset (realistic, reinforce)"}


def raise_option_error(e: ValueError, option: str | None = None):
    """A core ``ValueError("field: message")`` as the one-line error of option ``--field``
    (``option``, when the option has another name: ``--draw-tau`` gives ``tau``; a message
    that names other fields in :data:`OPTION_WORDS`' wording)."""
    name, _, msg = str(e).partition(": ")
    msg = OPTION_WORDS.get(msg, msg)
    raise InputError(msg or str(e), where=option or f"--{name.replace('_', '-')}") from None



def make_setting(preset, k, m, batch, tau, lr, reward, baseline, credit, kind, scope=None, rank=None, hidden=None,
                 *, clip=None, loss=None, p_useful=None, p_other=None, draw_tau=None, offset=None) -> Setting:
    """The program's parts from the options (``scope`` None: user; ``hidden``: the `mlp` kind's
    width, None its default; the keyword ones: :class:`Estimator` fields, None the preset's):
    :func:`rmm_jax.online.setting.resolve_setting` on a store that records no setting, a bad
    value as its option's one line. A verb's :class:`SettingOptions` ``o`` gives them all:
    ``make_setting(**o._asdict())``."""
    given = SettingOptions(preset, k, m, batch, tau, lr, reward, baseline, credit, kind, scope, rank, hidden,
                           clip=clip, loss=loss, p_useful=p_useful, p_other=p_other, draw_tau=draw_tau,
                           offset=offset)
    return _resolved(None, given, ()).setting


def _resolved(recorded: dict | None, given: SettingOptions, explicit) -> LearningSetting:
    """:func:`rmm_jax.online.setting.resolve_setting` with the CLI's checks of --rank and --kind
    against the scope first, and a bad value as its option's one-line error."""
    check_rank_scope(given.scope, given.rank)
    check_kind_scope(given.kind, given.scope)
    try:
        ls = resolve_setting(recorded, given, explicit)
    except ValueError as e:
        raise_option_error(e)
    loss = ls.setting.estimator.loss
    if given.offset is not None and loss != "logistic":   # a preset's own offset under another loss is left unread
        raise InputError(f"only the logistic loss reads an offset (the logit of a memory scored at its anchor); "
                         f"this run's loss is {loss!r}", where=f"--offset {given.offset:g}")
    return ls


def users_per_chunk_option(f):
    """``--users-per-chunk``, the same on every verb that runs the online loop."""
    return click.option("--users-per-chunk", type=IntRange(min=1), default=8, show_default=True,
                        help="Users run side by side per compiled call. In scopes shared and hybrid each chunk saves "
                             "a shared version (3.4 MiB at d=384) that the store keeps while its users' versions are: "
                             "about keep x users / this many of them; a larger chunk divides that disk and needs more "
                             "memory (docs/scopes.md).")(f)


def change_setting_option(f):
    """``--change-setting``: let this run change the learning setting the policy store records."""
    return click.option("--change-setting", is_flag=True,
                        help="Let an option change the learning setting the policy store records (preset, batch, "
                             "estimator, optimiser, step size); the run says what changed and the store records the "
                             "new setting. Without it such an option is refused.")(f)


def learning_setting(policies, given: SettingOptions, *, change: bool = False,
                     resume: bool = False) -> LearningSetting:
    """The run's setting: ``given`` (:func:`make_setting`) on a policy store that records
    none; on one that does, the recorded setting with the options the user gave on top
    (:func:`rmm_jax.online.setting.resolve_setting`). An option that changes the
    recorded setting is refused in one line naming it and both values, unless ``change``
    (``--change-setting``), or unless ``resume`` finds an interrupted run, whose own check
    refuses any option that differs from it."""
    recorded = read_setting(PolicyStore.open(policies)) if Path(policies).exists() else None
    if recorded is None:
        return _resolved(None, given, ())
    explicit = explicit_options()
    ls = _resolved(recorded, given, explicit)
    if ls.changes and not change and not (resume and runstate.RunState.interrupted_fingerprint(policies)):
        option, shown, was = blamed_change(ls, explicit)
        raise InputError(f"{shown} would change the learning setting policy store {policies} records ({was}); "
                         "leave the option out to continue with it, or add --change-setting",
                         where=f"--{option.replace('_', '-')}")
    return ls


def note_setting(ls: LearningSetting, given: SettingOptions, policies) -> None:
    """One stderr line when the run's setting is not what its options ``given`` alone give:
    the recorded setting continued, or the changes ``--change-setting`` made."""
    if ls.changes:
        info(f"learning setting of {policies} changed (--change-setting): "
             + ", ".join(f"{f} {shown_value(f, a)} -> {shown_value(f, b)}" for f, a, b in ls.changes),
             must_read=True)
    elif ls.recorded is not None:
        try:
            plain = setting_record(given.preset, make_setting(**given._asdict()))
        except InputError:   # the options alone name no setting (`--loss reinforce` over today's default preset)
            plain = None
        differ = setting_changes(plain, ls.record) if plain is not None else [("preset", None, ls.preset)]
        if differ:
            info(f"continuing with the learning setting {policies} records: "
                 + ", ".join(f"{f} {b}" for f, _, b in differ) + " (not the options' defaults)", must_read=True)


def config_dict(setting: Setting) -> dict:
    """The JSON record of a program's parts (reports, run-state fingerprints)."""
    return describe(*setting)


def progress_bar(total: int, desc: str, unit: str = "user"):
    """A bar on stderr while it is a terminal; none in a log file or a pipe (tqdm's ``disable=None``),
    where its carriage returns would only clutter a nightly job's log, nor under ``--quiet``."""
    return tqdm(total=total, desc=desc, unit=unit, file=sys.stderr, disable=True if total <= 0 or quiet() else None,
                leave=False)


def checkpoint_options(default_every: int, unit: str):
    """``--checkpoint-every`` and ``--resume`` (see :mod:`rmm_jax.persist.runstate`)."""
    def deco(f):
        f = click.option("--resume", is_flag=True,
                         help="Continue the interrupted run of the same command, inputs and options "
                              "from its last complete checkpoint.")(f)
        f = click.option("--checkpoint-every", type=IntRange(min=0), default=default_every, show_default=True,
                         help=f"Checkpoint the run every N {unit} (0: only when interrupted by "
                              "SIGINT/SIGTERM); results do not depend on it.")(f)
        return f
    return deco


def k_m_from_log(k: int | None, m: int | None, shape, log_path, *, notes: list[str] | None = None) -> tuple[int, int]:
    """``--k``/``--m`` for a run over a log (:func:`rmm_jax.online.streams.log_shape`): an option
    left out is the log's, when its records agree; one given must be the log's, when they do, or
    larger where every record lists its user's whole bank (``--k``; the default 20 over banks of
    18 was refused) or shows all its candidates (``--m``).
    The note saying so goes on stderr, or into ``notes`` for a verb that prints it later."""
    out = []
    for name, given, logged, line, apart, what, whole in (
            ("--k", k, shape.k, shape.k_line, shape.k_apart, "list", shape.whole_banks),
            ("--m", m, shape.m, shape.m_line, shape.m_apart, "show", shape.whole_slates)):
        says = f"{log_path} {what}s {logged} {'candidates' if name == '--k' else 'memories'} per call (line {line})"
        if given is None and apart is not None:
            raise InputError(f"the records of {log_path} disagree: {says}, but {apart}; pass {name}", where=name)
        # every record lists its user's whole bank (shows all its candidates): a larger K (M) would have too
        if given is not None and apart is None and given != logged and not (whole and given > logged):
            raise InputError(f"contradicts the log: {says}; leave {name} out to take it from the log",
                             where=f"{name} {given}")
        out.append(logged if given is None else given)
    if k is None or m is None:
        note = f"--k {out[0]} --m {out[1]} from {log_path}, whose records all agree"
        if notes is None:
            info(note)
        else:
            notes.append(note)
    return out[0], out[1]


def k_m_without_log(k: int | None, m: int | None) -> tuple[int, int]:
    """``--k``/``--m`` for the option checks of a verb whose log is empty (a quiet day):
    those given, the other the default (raised to ``--m``, or capped at ``--k``), so that
    ``--k 3 --m 5`` is refused as on a day with calls, and ``--m 30`` alone is not."""
    k = max(DEFAULTS.layout.k, m or 1) if k is None else k
    return k, min(DEFAULTS.layout.m, k) if m is None else m


def note_read(read: ReadReport, more=()) -> None:
    """On stderr, what reading a log or a requests file skipped (``read``'s one line, if any)
    and noted (:func:`note_lines`: ``read.notes``, then ``more``)."""
    if read.skipped:
        info(read.skipped_line(), must_read=True)
    note_lines([*read.notes, *more])


def check_store_writable(path, where: str) -> None:
    """A policy store a run writes (its directories and index), and the run-state kept beside it."""
    check_writable(path, where, depth=1)
    check_writable(runstate.RunState.path_for(path), where)


def begin_run_state(target, command: str, options: dict, *, resume: bool, checkpoint_every: int, inputs: dict,
                    restart_same: tuple[str, ...] = (), paths: dict | None = None, say_notes: bool = True):
    """Lock (and with ``resume`` restore) the run-state next to ``target``.

    The fingerprint holds ``options`` (option name -> value), then ``inputs`` (digests of
    input files, initial params) and the library versions; a resumed run must match.
    ``restart_same``: without ``resume``, an interrupted run of the same command whose
    ``inputs`` of these names are the same is started again instead of refused; not a
    ``--relearn`` run (this one or the interrupted one): started again, it would learn what
    the interrupted run saved once more, so it is resumed. ``paths``: the files of ``inputs``
    (name -> path), for its messages to name them. ``say_notes`` False: the caller prints the
    run-state's notes (``rs.notes``) once the run starts (:func:`rmm_jax.cli.online.saving_run`)."""
    if checkpoint_every < 0:
        raise InputError(f"must be >= 0, got {checkpoint_every}", where="--checkpoint-every")
    fp = {**options, **inputs, **runstate.versions()}
    same = None
    if restart_same and not options.get("--relearn"):
        same = lambda old: not old.get("--relearn") and all(old.get(n) == inputs[n] for n in restart_same)  # noqa: E731
    with as_options("resume"):                    # its messages say --resume
        rs = runstate.RunState.begin(target, command, fp, resume=resume, restart=same, paths=paths)
    for note in rs.notes if say_notes else ():
        info(note, must_read=True)      # the state an interrupted run left
    disk_errors.running(target)      # a full disk later says the run resumes
    return rs
