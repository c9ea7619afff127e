"""``rmm-jax policies``: inspect, export and roll back a per-user policy store.

A policy store (see :mod:`rmm_jax.persist.policy_store`) is written by ``pretrain``/``simulate``/
``replay``; ``list``, ``show`` and ``export`` only read it, so they need no lock and are safe
while a writer runs. ``show`` reports what a load would actually get: it loads, with the
store's own rules. ``rollback`` is the one writer here (:mod:`rmm_jax.persist.policy_rollback`).
"""
from __future__ import annotations

import json
from pathlib import Path

import click
import jax
import numpy as np

from rmm_jax.cli.main import cli
from rmm_jax.cli.shell import (
    IntRange,
    as_options,
    check_output_file,
    check_writable,
    count,
    emit_json,
    info,
    json_option,
    note_lines,
    quiet_option,
    users_option,
)
from rmm_jax.errors import InputError
from rmm_jax.online.sinks import queries_learned
from rmm_jax.persist.atomic import atomic_file, write_json
from rmm_jax.persist.codec import encode_tree, leaf_specs
from rmm_jax.persist.policy_rollback import Rollback, plan, rollback, store_notes
from rmm_jax.persist.policy_store import PolicyStore
from rmm_jax.persist.policy_versions import version_span
from rmm_jax.persist.runstate import RunState

SHOW_VERSIONS = 10  # kept versions listed in text (all of them with --json)


def _user_list(user: str | None, users: list[str] | None) -> list[str] | None:
    """USER and/or the parsed ``--users`` as one list without repeats; None if neither was given."""
    return list(dict.fromkeys(([user] if user else []) + (users or []))) or None


def _require_users(st: PolicyStore, users: list[str]) -> None:
    """Fail on an unknown user before any progress line (errors are one line on stderr)."""
    for u in users:
        if not st.has_user(u):
            raise InputError(f"no saved policy for user {u!r} (known users: {st.n_users()})", where=str(st.path))


def _entry(e) -> dict:
    return {"version": e.version, "chunk": f"c{e.chunk:04d}", "row": e.row, "saved_at": e.saved_at,
            "shared_version": e.shared_version}


@cli.group()
def policies():
    """Inspect, export and roll back the per-user reranker policies saved by the online learner.

    \b
    Examples:
      rmm-jax policies list policies                  # users, versions, queries learned from
      rmm-jax policies show policies                  # what loads: shared version, versions kept
      rmm-jax policies show policies user7            # user7: the version that loads, its shared part, norms
      rmm-jax policies show policies --users user0,user1 --json
      rmm-jax policies export policies user7 --out user7.npz
      rmm-jax policies rollback policies              # evaluate showed it worse: undo the last run
    """


def list_rows(store: PolicyStore, users: list[str] | None = None) -> list[dict]:
    """One summary per user: versions, queries learned from (over all runs, and in the last
    one, from the newest version's info) and last update."""
    return [{"user": u, "versions": [e.version for e in es], "queries_learned": queries_learned(info),
             "queries_last_run": info.get("queries_seen"), "last_update": es[-1].saved_at}
            for u, es, info in store.listing(users)]


@policies.command("list")
@click.argument("store", type=click.Path())
@users_option("Only these users")
@quiet_option       # nothing routine to drop; taken so that a script can give every policies verb -q
@json_option("the table", "store, meta, n_users, users (one object per user), unfinished_run (null, or the run "
             "that has not finished writing the store: command, state, note), pending_rollback (null, or the note "
             "that an interrupted rollback is pending: the table shows the store as it was before it)")
def list_cmd(store, users, as_json):
    """List the users of policy store STORE: saved versions (newest last), the queries the
    newest version has learned from over all its runs (like its learner step, counted from
    the policy's start) and in the run that saved it, and the time of that run (UTC).

    The versions come from the store's index, unread: a list of 100,000 users reads no
    policy. `policies show` reads and verifies what loads (a damaged newest version is
    skipped for the one before, and said).

    \b
    Examples:
      rmm-jax policies list policies
      rmm-jax policies list policies --users user0,user1 --json
    """
    st = PolicyStore.open(store)
    wanted = _user_list(None, users)
    if wanted:
        _require_users(st, wanted)
    rows = list_rows(st, wanted)
    notes = store_notes(st)      # a reader writes nothing: it lists the versions a pending rollback forgets
    note_lines(notes.lines)
    if as_json:
        emit_json({"store": store, "meta": st.meta, "n_users": len(rows), "users": rows, **notes.doc()},
                  indent=None, sort_keys=False)
        return
    m = st.meta_info()
    shown = f" (listed: {len(rows)})" if wanted else ""
    click.echo(f"{store}: kind={m.kind} dim={m.dim} hidden={m.hidden} users={st.n_users()}{shown}")
    if not rows:
        return
    w = max(4, *(len(r["user"]) for r in rows))
    click.echo(f"{'user':<{w}}  {'versions':<20}  {'queries learned':>15}  {'last run':>8}  last update")
    for r in rows:
        total, last = ("-" if r[k] is None else str(r[k]) for k in ("queries_learned", "queries_last_run"))
        click.echo(f"{r['user']:<{w}}  {','.join(map(str, r['versions'])):<20}  {total:>15}  {last:>8}  "
                   f"{r['last_update']}")


def _leaf_table(tree) -> list[dict]:
    """Path, shape, dtype and L2 norm of every leaf of a pytree."""
    spec, leaves = encode_tree(tree)
    out = []
    for s in leaf_specs(spec):
        a = leaves[s["i"]]
        norm = float(np.linalg.norm(a.astype(np.float64).ravel())) if a.dtype.kind in "fiub" else None
        out.append({"path": s["path"], "shape": s["shape"], "dtype": s["dtype"], "norm": norm})
    return out


def store_doc(st: PolicyStore) -> dict:
    """What ``show`` reports about the store: the shared version that loads (and newer ones
    skipped), every shared version on disk and why it is kept, their bytes on disk together,
    every kept user version."""
    try:
        shared = st.shared_state()
        loads, skipped, error = shared.version, shared.skipped, None
    except InputError as e:
        loads, skipped, error = None, (), str(e)
    saves = st.saves()
    on_disk = st.shared_versions()
    newest, start = set(on_disk[-st.keep:]), st.start_shared_version()     # why each is kept
    used_by: dict[int, list[int]] = {}
    for s in saves:
        used_by.setdefault(s.shared_version, []).append(s.version)
    return {"path": str(st.path), "meta": st.meta, "scope": st.scope.name, "keep": st.keep, "n_users": st.n_users(),
            "shared": {"loads": loads, "error": error, "skipped": [s._asdict() for s in skipped],
                       "bytes": st.shared_total_bytes(),
                       "versions": [{"version": v, "newest": v in newest, "start": v == start,
                                     "used_by": used_by.get(v, [])} for v in on_disk]},
            "versions": [s._asdict() for s in saves]}


def user_docs(st: PolicyStore, users: list[str]) -> list[dict]:
    """What ``show`` reports per user, from one batch load: the version that loads, the
    shared version it pairs with, newer versions skipped and why, every kept version, bytes
    on disk (its row's share of its chunk; the shared version it pairs with, or the newest
    in scope ``user``), shapes and L2 norms of each part, and the saved info."""
    got = st.load_batch(users)
    docs = []
    for i, u in enumerate(got.users):
        state = jax.tree_util.tree_map(lambda a, i=i: a[i], got.state)
        sv = got.shared_versions[i]
        docs.append({"user": u, "version": got.versions[i], "shared_version": sv,
                     "skipped": [s._asdict() for s in got.skipped.get(u, ())],
                     "versions": [_entry(e) for e in st.entries(u)], "info": got.infos[i],
                     "bytes": {"user": st.user_bytes(u, got.versions[i]),
                               "shared": st.shared_bytes(sv if st.paired else None)},
                     **{p: _leaf_table(getattr(state, p)) for p in ("params", "opt_state", "learner_state")}})
    return docs


def _size(n: int) -> str:
    """``n`` bytes, human-readable (the exact count is in ``--json``)."""
    if n < 1024:
        return f"{n} B"
    x, unit = float(n), "B"
    for unit in ("KiB", "MiB", "GiB"):
        x /= 1024
        if x < 1024:
            break
    return f"{x:.1f} {unit}"


def _listed(items: list[str]) -> str:
    more = len(items) - SHOW_VERSIONS
    return ", ".join(items[-SHOW_VERSIONS:]) + (f" (and {more} older)" if more > 0 else "")


def _echo_store(doc: dict) -> None:
    m, sh = doc["meta"], doc["shared"]
    click.echo(f"store {doc['path']}: kind={m['kind']} dim={m['dim']} hidden={m['hidden']} scope={doc['scope']} "
               f"keep={doc['keep']} users={doc['n_users']}")
    loads = f"v{sh['loads']} loads" if sh["loads"] is not None else f"none loads ({sh['error']})"
    kept = [f"v{r['version']} (" + ", ".join((["the store's start"] if r.get("start") else [])
                                            + ([f"one of the newest {doc['keep']}"] if r["newest"] else [])
                                            + ([f"used by user versions {','.join(map(str, r['used_by']))}"]
                                               if r["used_by"] else [])) + ")" for r in sh["versions"]]
    click.echo(f"shared: {loads}; on disk: {_listed(kept)}")
    click.echo(_shared_disk(doc))
    for s in sh["skipped"]:
        click.echo(f"  skipped shared v{s['version']}: {s['reason']}")
    vs = [f"v{s['version']} ({count(s['users'], 'user')}" + (f", shared v{s['shared_version']}"
                                                     if s["shared_version"] is not None else "") + ")"
          for s in doc["versions"]]
    click.echo(f"user versions kept: {_listed(vs) or 'none'}")


def _shared_disk(doc: dict) -> str:
    """The line of the shared versions' bytes on disk together: in scopes with a shared part a
    run saves one per users chunk, each kept while a kept user version pairs with it."""
    sh = doc["shared"]
    line = f"shared bytes on disk: {_size(sh['bytes'])} in {count(len(sh['versions']), 'version')}"
    if doc["scope"] == "user":
        return line
    return line + (" (a run saves one per users chunk, kept while a kept user version pairs with it: about "
                   f"{doc['keep']} x users / --users-per-chunk when every run saves every user, up to "
                   f"{doc['keep']} x users and the start when each run saves a few)")


def _echo_user(d: dict, store: dict) -> None:
    pair = f", with shared v{d['shared_version']}" if d["shared_version"] is not None else ""
    click.echo(f"user {d['user']}: v{d['version']} loads{pair}")
    for s in d["skipped"]:
        click.echo(f"  skipped v{s['version']}: {s['reason']}")
    click.echo("versions: " + ", ".join(f"v{e['version']} ({e['saved_at']}" + (
        f", shared v{e['shared_version']})" if e["shared_version"] is not None else ")") for e in d["versions"]))
    ub, sb = d["bytes"]["user"], d["bytes"]["shared"]
    n = len(store["shared"]["versions"])
    among = ("the store's only shared version" if n == 1 else
             f"one of {n} shared versions on disk, {_size(store['shared']['bytes'])} in all")
    click.echo(f"bytes on disk: user {_size(ub['bytes'])} (v{ub['version']} {ub['chunk']} row {ub['row']}, "
               f"1/{ub['users_in_chunk']} of {_size(ub['chunk_bytes'])}); shared {_size(sb['bytes'])} "
               f"(v{sb['version']}, {among})")
    for part in ("params", "opt_state", "learner_state"):
        click.echo(f"{part}:")
        for leaf in d[part]:
            norm = "" if leaf["norm"] is None else f"  |.|={leaf['norm']:.6g}"
            click.echo(f"  {leaf['path']:<32} {str(tuple(leaf['shape'])):<14} {leaf['dtype']:<8}{norm}")
    click.echo(f"info: {json.dumps(d['info'], sort_keys=True)}")


@policies.command()
@click.argument("store", type=click.Path())
@click.argument("user", required=False)
@users_option("These users, with or instead of USER", default="none: the store alone")
@quiet_option
@json_option("what loads", "store (an object; its shared.bytes: every shared version on disk, together), users "
             "(one object per user asked for), unfinished_run (null, or the run that has not finished writing the "
             "store: command, state, note), pending_rollback (null, or the note that an interrupted rollback is "
             "pending: what loads is the store as it was before it)")
def show(store, user, users, as_json):
    """Show what loads from STORE. The store: its meta, the shared version that loads
    (newer damaged ones skipped), the shared versions on disk and why each is kept (the
    store's start, among its newest `keep`, or used by a kept user version) and their bytes
    together (scopes shared and hybrid: a run saves one per users chunk, so about keep x
    users / --users-per-chunk of them), the user versions kept. For USER
    (or --users): the version that loads, the shared version it pairs with (scopes shared
    and hybrid), any newer version skipped and why, bytes on disk, shapes and L2 norms of
    the params, optimiser and learner state, and the saved info.

    \b
    Examples:
      rmm-jax policies show policies                  # the store: shared version, versions kept
      rmm-jax policies show policies user7            # user7: the version that loads, its shared part, norms
    """
    st = PolicyStore.open(store)
    wanted = _user_list(user, users) or []
    _require_users(st, wanted)
    if wanted:
        info(f"loading {len(wanted)} user(s) from {store} ...")
    notes = store_notes(st)      # a reader writes nothing: it shows the versions a pending rollback forgets
    doc = {"store": store_doc(st), "users": user_docs(st, wanted) if wanted else [], **notes.doc()}
    note_lines(notes.lines)
    if as_json:
        emit_json(doc, indent=None, sort_keys=False)
        return
    _echo_store(doc["store"])
    for d in doc["users"]:
        _echo_user(d, doc["store"])


def export_params(st: PolicyStore, user: str, out: Path, version: int | None = None) -> dict:
    """Write ``user``'s params (the version that loads, or ``version``) as one ``.npz``
    (keys: leaf paths joined by "/", plus ``__meta__``) and ``<out>.json`` (meta, version,
    shared version, info, shapes); both atomically. Returns the JSON written."""
    saved = st.load(user, version=version)
    spec, leaves = encode_tree(saved.state.params, where=f"user {user!r} params")
    arrays = {s["path"]: leaves[s["i"]] for s in leaf_specs(spec)}
    doc = {"store": str(st.path), "user": user, "version": saved.version, "shared_version": saved.shared_version,
           "meta": st.meta, "info": saved.info, "shapes": {k: list(v.shape) for k, v in arrays.items()},
           "dtypes": {k: str(v.dtype) for k, v in arrays.items()}}
    with atomic_file(out, "wb") as f:
        np.savez(f, **arrays, __meta__=np.array(json.dumps(doc, sort_keys=True)))
    write_json(out.with_suffix(".json"), doc)
    return doc


@policies.command()
@click.argument("store", type=click.Path())
@click.argument("user")
@click.option("--out", "out", required=True, type=click.Path(),
              help="Output .npz; keys are leaf paths such as q_adapter/W/kernel. A FILE.json "
                   "with meta, version and info is written next to it.")
@click.option("--version", "version", type=IntRange(min=1), default=None,
              help="Export this saved version instead of the newest good one (one of the user's versions "
                   "`policies list` shows: numbers count the store's saves, so a user's need not be consecutive).")
@quiet_option
@json_option("what was exported (the .json written next to the .npz, with both paths)",
             "store, user, version, shared_version, meta, info, shapes, dtypes, out, json")
def export(store, user, out, version, as_json):
    """Export USER's params from STORE as one .npz (plus a .json with meta), e.g. to
    load with numpy.load outside rmm-jax. Both files are written atomically. In scope
    hybrid these are the user's own factors; the .json names the shared version they pair with.

    \b
    Examples:
      rmm-jax policies export policies user7 --out user7.npz
      rmm-jax policies export policies user7 --version 1 --out user7_v1.npz   # a version `policies list` shows
    """
    if not str(out).endswith(".npz"):
        raise InputError("export file must end in .npz", where=f"--out {out}")
    if Path(out).resolve().is_relative_to(Path(store).resolve()):   # its .json could replace policy_store.json
        raise InputError(f"is inside policy store {store}, whose files it could replace; choose a path outside it",
                         where=f"--out {out}")
    check_output_file(out, f"--out {out}")
    for path, what in ((Path(out), "it"), (Path(out).with_suffix(".json"), "the .json written next to it")):
        if path.is_dir():    # the rename into place failed after the .npz was written, with a traceback
            raise InputError(f"{what} ({path}) is a directory, not a file path", where=f"--out {out}")
    st = PolicyStore.open(store)
    _require_users(st, [user])
    doc = export_params(st, user, Path(out), version)     # (no progress line first: an error is the one line)
    note_lines(store_notes(st).lines)   # a reader writes nothing: it may export a version a pending rollback forgets
    info(f"wrote {out} (version {doc['version']}, {len(doc['shapes'])} arrays)")
    if as_json:
        emit_json({**doc, "out": str(out), "json": str(Path(out).with_suffix(".json"))}, indent=None, sort_keys=False)


def shown_to(r, asked: bool) -> int:
    """The version a rollback names as where it went: ``--to`` as given, else (undoing the
    newest run) the newest version the store keeps afterwards, which the run's own start
    (``r.to``) is not when an earlier rollback forgot that version."""
    return r.to if asked or r.newest is None else r.newest


def rollback_text(r: Rollback, store: str, done: bool, asked: bool = True) -> list[str]:
    """What a rollback did (or, not ``done``, would do), a line each; ``asked``: to ``--to``
    (else it undid the newest run, and names the version it went back to)."""
    if r.interrupted:
        lines = [f"finished the interrupted rollback of {store} to v{r.to}: forgot {version_span(r.versions)}"]
    else:
        verb = "rolled back" if done else "would roll back"
        r = r._replace(to=shown_to(r, asked))
        gone = "" if r.newest == r.to else (         # v{to} itself was forgotten (an earlier rollback) or pruned
            f" (it keeps no v{r.to}: the newest version at or below it, v{r.newest}, is the newest "
            f"{'now' if done else 'then'})" if r.newest is not None
            else f" (it keeps no version at or below v{r.to}: no user version {'remains' if done else 'would remain'})")
        lines = [f"{verb} {store} to v{r.to}{gone}: {'forgot' if done else 'forgets'} {version_span(r.versions)}; "
                 f"{len(r.users)} user{'s' if len(r.users) != 1 else ''} back at an earlier version, "
                 f"{len(r.removed)} new since v{r.to} removed"]
    if r.shared:
        lines.append(f"shared versions {', '.join(f'v{v}' for v in r.shared)} deleted (online runs saved them "
                     "after the shared version the kept users were trained against)")
    if not r.setting_known:
        lines.append("the learning setting stays as recorded: the versions forgotten do not say what it was before")
    if done and (r.users or r.interrupted):
        lines.append("the calls the forgotten versions learned from can be learned again: replay their log, or "
                     "simulate their questions again")
    return lines


@policies.command("rollback")
@click.argument("store", type=click.Path())
@click.option("--to", "to", type=int, default=None,
              help="Go back to the store as it was when user version TO was its newest: every user version "
                   "above TO is forgotten.  [default: (the version before the newest run of simulate or "
                   "replay, which that run's versions record)]")
@click.option("--dry-run", is_flag=True, help="Say what would be rolled back and change nothing.")
@quiet_option
@json_option("the rollback", "store, done (false with --dry-run), to, users, versions, removed, shared, setting, "
             "setting_known, interrupted, newest (the newest user version kept afterwards)")
def rollback_cmd(store, to, dry_run, as_json):
    """Undo the newest run on policy store STORE (or every version above --to), when
    `evaluate` shows what it learned worse than what logged the calls (a reliable
    estimate below the logged value), or the team distrusts the night.

    Each user loads its newest version at or below the point again, with the calls that
    version had learned from: so the next replay learns the rolled-back calls again, once.
    A user new since then leaves the store. In scopes shared and hybrid, the shared
    versions saved since go too. The learning setting is what it was before (a run that
    used --change-setting is undone with it). The store keeps --keep versions per user
    (3 unless set): a user whose state at that point is no longer kept is refused, and
    nothing changes. A kill during a rollback leaves the store as before or as after; the
    next writer finishes it.

    \b
    Examples:
      rmm-jax policies rollback policies --dry-run    # what the last run would take back
      rmm-jax policies rollback policies              # undo it
      rmm-jax policies rollback policies --to 12      # everything saved after v12
    """
    st = PolicyStore.open(store)
    if not dry_run:
        check_writable(store, f"STORE {store}", depth=1)
    with as_options("to", "keep"):
        r = plan(st, to, interrupted_run_ok=True) if dry_run else rollback(
            st, to, starting=lambda p: info(f"rolling back {store} to v{shown_to(p, to is not None)} ..."))
    interrupted = RunState.interrupted_command(st.path) if dry_run else None
    if interrupted:      # a dry run changes nothing: it reports, and says what the rollback itself needs
        info(f"note: the rollback itself is refused while an interrupted `{interrupted}` run's state is in "
             f"{RunState.path_for(st.path)}: finish that run with --resume (or remove that directory) first")
    if as_json:
        emit_json({"store": store, "done": not dry_run, **r._asdict()}, indent=None, sort_keys=False)
        return
    for line in rollback_text(r, store, done=not dry_run, asked=to is not None):
        click.echo(line)
