"""``rmm-jax rerank``: serve stored policies on a file of calls."""
from __future__ import annotations

import contextlib
import difflib
import json
import sys
import time
from pathlib import Path

import click

from rmm_jax.cli.common import DEFAULTS, check_tau_option, note_read, open_policies_for, progress_bar, short_bank_note
from rmm_jax.cli.main import cli
from rmm_jax.cli.shell import (
    SEED,
    IntRange,
    as_options,
    cache_dir_option,
    check_output_file,
    count,
    emit_json,
    info,
    json_option,
    note_lines,
    quiet_option,
)
from rmm_jax.data.calls import Skipped, check_not_served, check_out_apart, prepare_calls, read_calls
from rmm_jax.data.citation_log import ReadReport, call_key, record_to_json, validate_record
from rmm_jax.data.json_lines import MAX_FIRST_ERRORS, source_name
from rmm_jax.data.store import open_store
from rmm_jax.errors import InputError, at
from rmm_jax.online.serve import DEFAULT_CACHE_USERS, Reranker, call_batches, serve_calls
from rmm_jax.persist.atomic import atomic_file
from rmm_jax.persist.policy_header import STORE_FILE
from rmm_jax.persist.policy_rollback import StoreNotes, store_notes


def serve_clock() -> int:
    """Now, in microseconds since the epoch: read once per run (a test replaces it)."""
    return time.time_ns() // 1000


def nearby_policy_store(path) -> str | None:
    """A policy store beside the missing ``--policies PATH`` whose name is close to its own (a
    typo on day 30 served the retriever with exit 0 and a line that reads like day 1's): its
    path, or None."""
    p = Path(path)
    try:
        names = [q.name for q in p.parent.iterdir()]
    except OSError:
        return None
    for name in difflib.get_close_matches(p.name, names, n=5, cutoff=0.8):    # names first: a stat for few
        with contextlib.suppress(OSError):
            if (p.parent / name / STORE_FILE).is_file():
                return str(p.parent / name)
    return None


@cli.command()
@click.argument("store", type=click.Path())
@click.option("--policies", type=click.Path(), default=None,
              help="Policy store whose policies rank the calls. Left out, or a store that does not exist yet: the "
                   "identity reranker (the base retriever's own scores) serves everyone, so a team can start "
                   "exploring before any policy exists.")
@click.option("--calls", "calls_path", required=True, type=click.Path(),
              help="JSONL of calls: user_id; query (text) and/or query_id; candidates (memory ids of STORE, or "
                   "{\"id\", \"text\"} objects as a log writes them: your own ids), candidate_texts, or neither "
                   "(the base retriever's top --k); call_id; timestamp (without one, the "
                   "served line gets the time it was served). Other keys are ignored (one that looks like a misspelt "
                   "key is noted). -: standard input.")
@click.option("--m", type=IntRange(min=1), default=DEFAULTS.layout.m,
              help="Memories to select per call (a call with fewer candidates selects all of them).")
@click.option("--k", type=IntRange(min=1), default=DEFAULTS.layout.k,
              help="Candidates from the base retriever when a call lists none.")
@click.option("--explore", is_flag=True,
              help="Draw the shown memories (Gumbel top-M at --draw-tau, a Plackett–Luce sample) instead of the "
                   "deterministic top-M, and log each draw's log_prob and logits: the propensities that let "
                   "tomorrow's replay and evaluate use today's log.")
@click.option("--draw-tau", "--tau", "tau", type=float, default=None,
              show_default="the learning setting the policy store records",
              help="--explore: the sampling temperature, what replay and simulate call --draw-tau (their --tau, the "
                   "loss's, when none is given). --tau is the same option.")
@click.option("--seed", type=SEED, default=0, show_default=True,
              help="--explore: each call's noise derives from the seed, the user and the call's identity "
                   "(call_id, else query_id, else the query text): serving the same call again draws the same.")
@click.option("--out", type=click.Path(dir_okay=False), default=None,
              help="Write the JSONL here (atomically) instead of stdout (-: stdout, as without --out); not the --calls "
                   "file, nor a path inside STORE or --policies. With --explore, a file that holds another record of "
                   "these calls (served by other policies, or with the citations added) is kept: refused.")
@click.option("--cache-users", type=IntRange(min=1), default=DEFAULT_CACHE_USERS,
              help="Users' policies kept on the device.")
@click.option("--skip-invalid", is_flag=True,
              help="Leave out and count invalid requests (a user STORE lacks, a timestamp in the future, a "
                   "malformed line) instead of failing the file: the others are served.")
@cache_dir_option
@quiet_option
@json_option("a summary of the run (with --out FILE: without it stdout carries the served lines)",
             "calls, users, skipped (requests left out by --skip-invalid), first_errors (the first of their "
             "errors), served_by (own_policy: calls served by their user's saved policy; shared: by the "
             "shared part, for a user the store does not hold; identity: by the retriever's scores, without a "
             "policy store), explore, out, seconds, unfinished_run (null, or the run that has not finished writing the "
             "policies: command, state, note), pending_rollback (null, or the note that an interrupted "
             "rollback of --policies is pending: the calls were served by the versions it forgets)")
def rerank(store, policies, calls_path, m, k, explore, tau, seed, out, cache_users, skip_invalid, cache_dir,
           as_json):
    """Select each call's memories with the user's stored policy.

    For every line of --calls, one JSON line in input order: a citation-log record
    without `cited` (docs/own-data.md): user_id, call_id, query_id and/or query, the
    timestamp (the call's own, else the time it was served, see below), the
    candidates (memory ids; {"id", "text"} objects for candidates given with a text: your
    own ids, or for candidate_texts "t:" + the first 16 hex digits of the text's sha256),
    the selected memories in display
    order, and the policy_version and shared_version that served it (null for a user the
    store does not hold: they are served the shared part, as a run would start them). The default is
    the deterministic top-M (and each selected memory's score, `scores`, with its
    `positions`). With --explore the selection is drawn and the line carries log_prob
    and logits. Add the memories the generator cited as `cited`, and the file is the
    next day's `replay` and `evaluate` log, unchanged.

    A call without a timestamp is stamped with the time it was served, as ISO 8601 UTC to
    the microsecond (2025-05-01T09:30:00.000042Z): the run's start plus one microsecond per
    line before it, so a run's calls keep their order and the next run's come after them.
    Replay recognises a call learned before by its timestamp once the call has left the
    last 512 a policy remembers (docs/reliability.md, "Exactly once").

    Texts are embedded with STORE's model through the embedding cache (--cache-dir). A bad call is one
    error line naming file:line; nothing is written then. With --skip-invalid it is left out and
    counted (one line names the first), and every other call is served.

    \b
    Examples:
      rmm-jax rerank stores/mine --policies policies --calls examples/requests_day1.jsonl --out ranked.jsonl
      rmm-jax rerank stores/mine --policies policies --calls examples/requests_day1.jsonl --explore --out served.jsonl
    """
    t0, now = time.perf_counter(), serve_clock()
    out = None if out == "-" else out            # `-` is stdout, as without --out (it wrote a file named -)
    check_out_apart(out, f"--out {out}", calls_path, [("STORE", store), ("--policies", policies)])
    check_output_file(out, f"--out {out}")
    if as_json and not out:
        raise InputError("needs --out FILE: without it stdout carries the served lines", where="--json")
    st = open_store(store)
    note, notes = None, StoreNotes()
    if policies is not None and Path(policies).exists():
        rr = Reranker(open_policies_for(policies, st), cache_users=cache_users)
        # a reader writes nothing: it serves the versions a pending rollback forgets, and those a run not
        # finished has written so far
        notes = store_notes(rr.store)
    else:
        rr = Reranker(None, dim=st.dim)
        near = None if policies is None else nearby_policy_store(policies)
        note = (("no policy yet" if policies is None else f"no policy store at {policies}")
                + (f" (did you mean {near}?)" if near else "")
                + ": serving the identity reranker (the base retriever's scores)")
    check_tau_option(tau, "--draw-tau")
    if tau is not None and not explore:
        raise InputError("only --explore samples; the deterministic top-M has no temperature", where="--draw-tau")
    key_notes: list[str] = []
    routine: list[str] = []                       # the texts the store lacked: every day's new questions
    skipped: list[Skipped] | None = [] if skip_invalid else None
    calls = read_calls(calls_path, key_notes, skipped=skipped)
    calls_path = source_name(calls_path)          # "-" read standard input: errors name <stdin>:line
    with as_options("k", "m", "cache_dir"):       # the API names its arguments, the CLI its options
        prepared = prepare_calls(st, calls, calls_path, k, m, key_notes, routine, cache_dir=cache_dir,
                                 skipped=skipped)
    asked = {(c.user_id, call_key(c)) for c in calls} | {s.identity for s in skipped or () if s.identity}
    calls = [p.call for p in prepared]
    errors = [s.error for s in sorted(skipped or ())]        # by line: read_calls' first, then prepare_calls'
    read = ReadReport(len(calls), len(errors), errors[:MAX_FIRST_ERRORS], [])
    note_read(read)
    if note:                                      # after the calls are checked: an error stays one line
        info(note, must_read=True)
    for line in routine:
        info(line)
    note_lines(key_notes + notes.lines)   # unknown keys that look misspelt; texts the model cut; the store's
    retrieved = list(dict.fromkeys(c.user_id for c in calls if c.candidates is None and c.candidate_texts is None))
    bank_note = short_bank_note(st, k, retrieved) if retrieved else None    # --k only sizes what the retriever fills
    if bank_note:
        info(bank_note)
    short = sum(p.cands.shape[0] < m for p in prepared)
    if short:
        info(f"{count(short, 'call')} with fewer than --m {m} candidates: served with all of them selected",
             must_read=True)
    lines: list[str | None] = [None] * len(prepared)
    served_by = dict.fromkeys(("own_policy", "shared", "identity"), 0)
    batches = call_batches(prepared)
    with progress_bar(len(batches), "rerank", unit="batch") as bar:
        for batch in serve_calls(rr, prepared, m, explore=explore, seed=seed, tau=tau, now=now, batches=batches):
            for s in batch:
                obj = record_to_json(s.record, served=True)
                if s.positions is not None:           # the deterministic top-M: what it selected, and the scores
                    obj.update(positions=s.positions, scores=s.scores)
                validate_record(obj, at(calls_path, prepared[s.index].call.line), served=True)
                lines[s.index] = json.dumps(obj)
                served_by[s.served_by] += 1
            bar.update(1)
    if explore:                                   # a served record is what the generator was shown: kept
        check_not_served(out, f"--out {out}", asked, [json.loads(line) for line in lines])
    text = "".join(line + "\n" for line in lines)
    if out:
        with atomic_file(Path(out)) as f:
            f.write(text)
        seconds = time.perf_counter() - t0
        users = len({c.user_id for c in calls})
        if calls:
            info(f"{'served' if explore else 'ranked'} {count(len(lines), 'call')} of {count(users, 'user')} "
                 f"in {seconds:.1f} s; wrote {out}")
        if as_json:
            emit_json({"calls": len(lines), "users": users, "skipped": read.skipped, "first_errors": read.first_errors,
                       "served_by": served_by, "explore": explore, "out": out, "seconds": round(seconds, 3),
                       **notes.doc()})
    else:
        sys.stdout.write(text)
    if not calls:       # a day without traffic: an empty output, not an error (docs/lifecycle.md, "A quiet day")
        info(f"{'served' if explore else 'ranked'} 0 calls "
             + ("(every request was invalid)" if read.skipped else "(the requests file is empty)")
             + (f"; wrote an empty {out}" if out else ""))
