"""``rmm-jax embed``: dataset -> embedding store."""
from __future__ import annotations

import time
from pathlib import Path

import click

from rmm_jax.cli.main import cli
from rmm_jax.cli.shell import (
    FloatRange,
    IntRange,
    as_options,
    cache_dir_option,
    check_output_dir,
    check_writable,
    count,
    emit_json,
    explicit_options,
    info,
    json_option,
    note_lines,
    quiet_option,
)
from rmm_jax.data import load_spec
from rmm_jax.data.embed import (
    DEFAULT_BATCH_SIZE,
    DEFAULT_MODEL,
    Embedder,
    model_id,
    truncation_note,
)
from rmm_jax.data.granularity import (
    DEFAULT_GRANULARITY,
    DEFAULT_MERGE_THRESHOLD,
    DEFAULT_SEGMENT_THRESHOLD,
    GRANULARITIES,
    check_threshold,
)
from rmm_jax.data.jsonl import INSTRUCTION_ROLES, MAX_MESSAGE_CHARS
from rmm_jax.data.log_dataset import parse_log_spec
from rmm_jax.data.store import (
    append_store,
    check_model,
    check_store_path,
    is_store,
    open_store,
    store_counts,
    unanswered,
    write_store,
)
from rmm_jax.errors import InputError
from rmm_jax.persist.atomic import real_path

# the API names its arguments; the errors of those this command's options give name the option
MODEL = {"embedder": "model", "model_id": "model"}          # the model an Embedder (or its id) is of


@cli.command()
@click.argument("spec", metavar="SPEC")
@click.option("--out", "out", default=None, type=click.Path(file_okay=False),
              help="Store directory to write: a new path, an empty directory or an embedding store, which is "
                   "replaced atomically (nothing is left on failure); any other directory, or the current one, is "
                   "refused.")
@click.option("--into", "into", default=None, type=click.Path(file_okay=False),
              help="Instead: append SPEC's new users, sessions and questions to this existing store, embedding "
                   "only their texts; repeated sessions are skipped and counted; ids and every user's rows stay "
                   "(docs/own-data.md, 'Memory banks grow'); a question's gold may name its user's turns and "
                   "sessions in the store. Same model and granularity as the store.")
@click.option("--granularity", type=click.Choice(GRANULARITIES), default=DEFAULT_GRANULARITY,
              help="Memory unit: one dialogue turn, one whole session, or a topic segment "
                   "(embedding-similarity segmentation plus add/merge).")
@click.option("--model", default=DEFAULT_MODEL,
              help="sentence-transformers model name or local directory; the default is the "
                   f"packaged offline copy of {DEFAULT_MODEL}.")
@click.option("--segment-threshold", type=FloatRange(-1.0, 1.0),
              default=DEFAULT_SEGMENT_THRESHOLD,
              help="segment: a turn joins the current segment while its cosine to the "
                   "segment mean is at least this.")
@click.option("--merge-threshold", type=FloatRange(-1.0, 1.0),
              default=DEFAULT_MERGE_THRESHOLD,
              help="segment: a segment merges into the most similar existing memory when "
                   "their cosine exceeds this.")
@cache_dir_option
@click.option("--batch-size", type=IntRange(min=1), default=DEFAULT_BATCH_SIZE,
              help="Texts per model call.")
@click.option("--no-cache", is_flag=True, help="Do not read or write the embedding cache.")
@click.option("--answers", is_flag=True,
              help="Also embed each question with its reference answer (answers.npy), for "
                   "`simulate --citations answer`. With --into, a store that has them gets them for its new "
                   "questions whether given or not; one that has none is refused.")
@click.option("--skip-invalid", is_flag=True,
              help="jsonl: skip and count invalid messages (content null without tool calls, empty, or longer "
                   f"than {MAX_MESSAGE_CHARS} characters) instead of failing on the first; with --into, also a "
                   "new user with no message with text (a user the store holds needs none).")
@click.option("--keep-roles", default="", metavar="ROLES", callback=lambda ctx, param, v: _roles(v),
              help="jsonl: also keep these roles' messages as memories, comma-separated "
                   f"({', '.join(INSTRUCTION_ROLES)}). By default they are left out and counted: a system "
                   "prompt repeated in every session would fill the memory bank.")
@quiet_option
@json_option("the store's manifest", "store, spec, dataset, format, version, model, dim, granularity, counts, "
             "stats, texts_embedded, and seconds (--out) or added (--into: what this run appended)")
def embed(spec, out, into, granularity, model, segment_threshold, merge_threshold, cache_dir,
          batch_size, no_cache, answers, skip_invalid, keep_roles, as_json):
    """Embed a dataset's memories and questions into an embedding store.

    SPEC names the data: `locomo:PATH` (a LoCoMo JSON file or a directory of them),
    `longmemeval:PATH`, `synthetic[:users=N,...]`, your own chat histories
    `jsonl:PATH` (OpenAI chat messages; schema in docs/own-data.md), or a generator-call log
    that carries texts, `log:CALLS.jsonl[,memories=MEMS.jsonl]` (each call becomes a
    question, its candidates the user's memories, ids kept as logged so the log replays
    on the store; a gold id naming a memory no record carries has no text, so it is
    dropped from its question's gold and counted: `stats.gold_without_text`). Memories
    are built at the chosen granularity, embedded with MODEL (cached on disk: re-runs
    embed nothing twice) and written with the questions and their gold memories to OUT.

    jsonl: messages as OpenAI writes them. A list `content` keeps its text parts,
    joined by a newline; other parts (images, audio, files) are dropped and counted,
    and a message with no text part is skipped. Tool results (role `tool`),
    tool-call-only messages (`content: null` with `tool_calls`) and instructions (roles
    `system`, `developer`; keep them with --keep-roles) are skipped and counted.
    `content: null` without a tool call, empty content and content over the character
    limit are errors naming file:line, or skipped and counted with --skip-invalid. The
    counts are printed on stderr and kept in the manifest (`stats.skipped` in --json;
    with --into, this run's are `added.skipped` and `stats.skipped` adds up every file
    read into the store).

    \b
    Examples:
      rmm-jax embed jsonl:examples/chat_history.jsonl --out stores/mine
      rmm-jax embed jsonl:examples/chat_history.jsonl --out stores/mine_seg --granularity segment
      rmm-jax embed synthetic:users=4 --out stores/synthetic --json
      rmm-jax embed jsonl:examples/chat_history.jsonl --into stores/mine   # appends only what is new
    """
    if (out is None) == (into is None):
        raise InputError("give --out (a new store) or --into (append to an existing one)"
                         + (", not both" if out is not None else ""), where="--out")
    if out is not None:
        check_output_dir(out, f"--out {out}")
    for name in ("segment_threshold", "merge_threshold"):     # given where nothing reads it: refused
        option = f"--{name.replace('_', '-')}"
        if name in explicit_options() and (into is not None or granularity != "segment"):
            why = ("an append keeps the store's turn or session memories" if into is not None
                   else f"this run builds {granularity} memories")
            raise InputError(f"only --granularity segment reads it; {why}", where=option)
        with as_options(name):                  # before the data and the model load: one line
            check_threshold(name, segment_threshold if name == "segment_threshold" else merge_threshold)
    if into is not None:
        return _append(spec, into, model, granularity, cache_dir, batch_size, no_cache, skip_invalid, keep_roles,
                       answers, as_json)
    with as_options(path="out"):        # before any work; write_store checks it again
        check_store_path(out)
    _check_replaceable(out, f"--out {out}")
    was = store_counts(out) if is_store(out) else None      # said once the new store is in its place
    t0 = time.perf_counter()
    with as_options("skip_invalid", "keep_roles"):
        dataset = load_spec(spec, skip_invalid=skip_invalid, keep_roles=keep_roles)
    if dataset.name == "log" and granularity != "turn":
        raise InputError(f"a log's memories are kept as logged (their ids are what the log names); "
                         f"use --granularity turn, not {granularity!r}", where="--granularity")
    t_load = time.perf_counter() - t0
    info(f"loaded {spec}: {count(len(dataset.users), 'user')} ({t_load:.1f}s)")
    if dataset.name == "jsonl":
        _note_skipped(dataset.stats["skipped"])
    note_lines(dataset.stats.get("notes", ()))      # log: unknown keys that look misspelt
    n_q, no_gold = sum(len(u.queries) for u in dataset.users), dataset.stats.get("no_gold", 0)
    dropped = dataset.stats.get("gold_without_text", 0)
    if dropped:
        mems = parse_log_spec(spec.partition(":")[2])[1]          # given: the texts go there, not a new option
        info(f"note: dropped {count(dropped, 'gold id')} naming {'a memory' if dropped == 1 else 'memories'} no "
             f"record carries (never retrieved, so no text to embed; first: "
             f"{dataset.stats['gold_without_text_first'][0]}); Recall counts only the gold the store holds. "
             + (f"Add their texts to {mems} to keep them" if mems
                else "Give their texts with log:CALLS,memories=MEMS to keep them"))
    if dataset.name in ("jsonl", "log") and no_gold:
        info(f"note: {no_gold} of {n_q} questions have no gold ids; Recall, NDCG and MRR skip them"
             + (" (no question has gold)" if no_gold == n_q else ""))
    n = unanswered(dataset) if answers else 0
    if n:
        info(f"note: --answers: {n} of {count(n_q, 'question')} {'has' if n == 1 else 'have'} no answer; "
             + ("its answer embedding is of the question alone" if n == 1 else
                "their answer embeddings are of the questions alone"))
    t1 = time.perf_counter()
    with as_options("model", "granularity", "segment_threshold", "merge_threshold", "cache_dir", path="out", **MODEL):
        embedder = Embedder(model, cache_dir=cache_dir, batch_size=batch_size, progress=True,
                            use_cache=not no_cache)
        info(f"model {embedder.model_id} (dim {embedder.dim}), cache "
             f"{embedder.cache_dir if embedder.cache_dir else 'off'}")
        try:
            thresholds = ({"segment_threshold": segment_threshold, "merge_threshold": merge_threshold}
                          if granularity == "segment" else {})     # only segment reads them (else refused)
            manifest = write_store(out, dataset, granularity, embedder, spec=spec, progress=info, answers=answers,
                                   **thresholds)
        finally:
            embedder.close()
    _note_truncated(embedder)
    total = time.perf_counter() - t0
    c = manifest["counts"]
    info(f"wrote {out}: {count(c['users'], 'user')}, {count(c['memories'], 'memory')}, {count(c['queries'], 'query')} "
         f"({count(embedder.texts_embedded, 'text')} embedded, the rest cached or repeated; {total:.1f}s total)")
    if was is not None:
        info(f"replaced {out} (was {count(was['users'], 'user')}, {count(was['memories'], 'memory')})")
    if as_json:
        report = dict(manifest)
        report["store"] = str(out)
        report["seconds"] = {"load": round(t_load, 3), "model_and_store": round(time.perf_counter() - t1, 3),
                             "total": round(total, 3)}
        report["texts_embedded"] = embedder.texts_embedded
        emit_json(report, indent=None)
    else:
        click.echo(f"{out}: {count(c['users'], 'user')}, {count(c['memories'], granularity + ' memory')}, "
                   f"{count(c['queries'], 'query')}, model {manifest['model']} (dim {manifest['dim']})")



def _append(spec, into, model, granularity, cache_dir, batch_size, no_cache, skip_invalid, keep_roles, answers,
            as_json) -> None:
    """``embed SPEC --into STORE``: the store's model and granularity unless given (and then
    they must match it). New questions get answer embeddings when the store has them; a store
    without them cannot take ``--answers`` (its old questions' answers are not in it)."""
    st = open_store(into)
    _check_replaceable(into, f"--into {into}")
    given = explicit_options()
    if "model" in given:        # before the model loads: it would load, then be refused
        with as_options("model", **MODEL):
            check_model(st, into, model_id(model))
    if "granularity" in given and granularity != st.granularity:
        raise InputError(f"STORE {into} holds {st.granularity!r} memories, not {granularity!r}", where="--granularity")
    if answers and st.answer_emb is None:
        raise InputError(f"STORE {into} holds no answer embeddings, and its questions' answers are not stored to "
                         "add them; re-embed the whole dataset with --out STORE --answers", where="--answers")
    t0 = time.perf_counter()
    with as_options("skip_invalid", "keep_roles"):     # gold of earlier days: the store holds it (append_store)
        dataset = load_spec(spec, skip_invalid=skip_invalid, keep_roles=keep_roles, gold_elsewhere=True)
    if dataset.name == "jsonl":
        _note_skipped(dataset.stats["skipped"])
    with as_options("model", "cache_dir", path="into", **MODEL):
        embedder = Embedder(model if "model" in given else st.model.removeprefix("local:"), cache_dir=cache_dir,
                            batch_size=batch_size, progress=True, use_cache=not no_cache)
        try:
            res = append_store(into, dataset, embedder, spec=spec, progress=info, skip_invalid=skip_invalid)
        finally:
            embedder.close()
    _note_truncated(embedder)
    c, a = res["manifest"]["counts"], res["added"]
    info(f"{'appended to' if any(a[k] for k in ('users', 'sessions', 'queries')) else 'nothing new for'} {into}: "
         f"now {count(c['users'], 'user')}, {count(c['memories'], 'memory')}, {count(c['queries'], 'query')} "
         f"({count(embedder.texts_embedded, 'text')} embedded; {time.perf_counter() - t0:.1f}s)")
    if as_json:
        emit_json({**res["manifest"], "store": str(into), "added": a, "texts_embedded": embedder.texts_embedded},
                  indent=None)
    else:
        click.echo(f"{into}: +{count(a['users'], 'user')}, +{count(a['sessions'], 'session')} "
                   f"({count(a['memories'], 'memory')}), +{count(a['queries'], 'question')}; skipped "
                   f"{count(a['sessions_repeated'], 'session')} and {count(a['queries_repeated'], 'question')} "
                   "already in the store" + (f", and {count(a['users_without_text'], 'new user')} with no message "
                                             "with text" if a["users_without_text"] else ""))


def _check_replaceable(path, where: str) -> None:
    """The store is written beside ``path`` and swapped into its place, and the old one deleted:
    refuse, before any work, what would fail only then. The current directory, or one holding
    it (a rename cannot move '.', and the shell would be left in the deleted old store); a
    parent that cannot take the new store; an old store that cannot be moved or deleted
    (read-only, immutable)."""
    p = real_path(path)                # a link's store is written where it points
    full, here = p.resolve(), Path.cwd().resolve()
    if full == here or full in here.parents:
        raise InputError("is the current directory or holds it, which cannot be replaced; write the store elsewhere",
                         where=where)
    check_writable(p.parent, where, own_files=False)        # the store is renamed in; its siblings stay
    if p.exists():
        check_writable(p, where)


def _roles(value: str) -> tuple[str, ...]:
    """``--keep-roles system,developer`` -> ``("system", "developer")``, each one of INSTRUCTION_ROLES."""
    roles = tuple(dict.fromkeys(r.strip() for r in value.split(",") if r.strip()))
    bad = [r for r in roles if r not in INSTRUCTION_ROLES]
    if bad:
        raise InputError(f"unknown role {bad[0]!r}; expected a comma-separated list of {', '.join(INSTRUCTION_ROLES)}",
                         where="--keep-roles")
    return roles


def _note_truncated(embedder) -> None:
    """One stderr line when the model read only the beginning of some texts
    (:func:`rmm_jax.data.embed.truncation_note`)."""
    note_lines([truncation_note(embedder)])


def _note_skipped(skipped: dict) -> None:
    """One stderr line with what a jsonl: dataset skipped (nothing when nothing was)."""
    labels = {"tool_results": "tool result", "tool_calls": "tool-call-only",      # a noun: count()'s plural
              "instructions": "system/developer", "no_text": "with no text part",
              "null_content": "content null without tool calls", "empty": "empty",
              "too_long": f"over {MAX_MESSAGE_CHARS} characters"}
    kinds = [count(skipped[k], label) if k == "tool_results" else f"{skipped[k]} {label}"
             for k, label in labels.items() if skipped[k]]
    parts = [f"{count(sum(skipped[k] for k in labels), 'message')} ({', '.join(kinds)})"] if kinds else []
    if skipped["non_text_parts"]:
        parts.append(f"{count(skipped['non_text_parts'], 'non-text content part')} (images, audio, files, refusals)")
    if skipped.get("sessions_without_text"):
        parts.append(f"{count(skipped['sessions_without_text'], 'session')} with no message with text (nothing "
                     "to add)")
    if skipped["gold_on_skipped"]:
        n = skipped["gold_on_skipped"]
        parts.append(f"{count(n, 'gold turn id')} naming {'a skipped message' if n == 1 else 'skipped messages'}")
    if parts:
        first = f"; first invalid: {skipped['first_errors'][0]}" if skipped["first_errors"] else ""
        keep = "; --keep-roles system,developer keeps system/developer messages" if skipped["instructions"] else ""
        # what --skip-invalid dropped, or gold that named a skipped message, must be read; the
        # roles left out by default (system prompts, tool results) are counted as routine
        info(f"skipped {'; '.join(parts)}{first}{keep}", must_read=bool(first or skipped["gold_on_skipped"]))
