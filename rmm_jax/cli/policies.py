"""``rmm-jax policies``: inspect and export a per-user policy store.

A policy store (see :mod:`rmm_jax.persist.policy_store`) is written by ``pretrain``/``simulate``;
these commands only read it, so they need no lock and are safe while a writer runs.
"""
from __future__ import annotations

import json

import click
import numpy as np

from rmm_jax.cli.main import cli
from rmm_jax.errors import InputError
from rmm_jax.persist.codec import encode_tree, leaf_specs
from rmm_jax.persist.policy_store import PolicyStore


def _open(store: str) -> PolicyStore:
    return PolicyStore.open(store)


def _progress(msg: str) -> None:
    click.echo(msg, err=True)


def _require_user(st, user: str) -> None:
    """Fail on an unknown user before any progress line (errors are one line on stderr)."""
    if not st.has_user(user):
        raise InputError(f"no saved policy for user {user!r} (known users: {st.n_users()})",
                         where=str(st.path))


@cli.group()
def policies():
    """Inspect per-user reranker policies saved by the online learner.

    \b
    Examples:
      rmm-jax policies list policies/                 # users, versions, queries seen
      rmm-jax policies show policies/ user_7          # shapes, norms, bytes, info of one user
      rmm-jax policies export policies/ user_7 --out user_7.npz
    """


def list_rows(store) -> list[dict]:
    """One summary per user: versions, queries seen (from info) and last update."""
    return [{"user": r["user"], "versions": [e["version"] for e in r["versions"]],
             "queries_seen": r["info"].get("queries_seen"), "last_update": r["versions"][-1]["saved_at"]}
            for r in store.listing()]


@policies.command("list")
@click.argument("store", type=click.Path())
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object on stdout instead of a table.")
def list_cmd(store, as_json):
    """List the users of policy store STORE: saved versions (newest last), queries seen
    (the "queries_seen" entry of the newest info) and time of the last update (UTC)."""
    st = _open(store)
    rows = list_rows(st)
    if as_json:
        click.echo(json.dumps({"store": store, "meta": st.meta, "n_users": len(rows), "users": rows}))
        return
    m = st.meta
    click.echo(f"{store}: kind={m['kind']} dim={m['dim']} hidden={m['hidden']} users={len(rows)}")
    if not rows:
        return
    w = max(4, *(len(r["user"]) for r in rows))
    click.echo(f"{'user':<{w}}  {'versions':<20}  {'queries':>8}  last update")
    for r in rows:
        q = "-" if r["queries_seen"] is None else str(r["queries_seen"])
        click.echo(f"{r['user']:<{w}}  {','.join(map(str, r['versions'])):<20}  {q:>8}  {r['last_update']}")


def _leaf_table(tree) -> list[dict]:
    """Path, shape, dtype and L2 norm of every leaf of a pytree."""
    spec, leaves = encode_tree(tree)
    out = []
    for s in leaf_specs(spec):
        a = leaves[s["i"]]
        norm = float(np.linalg.norm(a.astype(np.float64).ravel())) if a.dtype.kind in "fiub" else None
        out.append({"path": s["path"], "shape": s["shape"], "dtype": s["dtype"], "norm": norm})
    return out


def show_doc(st, user: str) -> dict:
    """Everything ``show`` prints for one user, as a JSON-able dict. ``bytes``: on disk,
    the user's newest entry (its row's share of its chunk's array files) and the newest
    shared version (stored once for all users)."""
    pol = st.load_user(user)
    return {"store": str(st.path), "user": user, "meta": st.meta, "scope": st.scope,
            "restored_version": pol.version,
            "skipped": st.last_restore_report["skipped"] if st.last_restore_report else [],
            "versions": st.version_entries(user), "info": pol.info,
            "bytes": {"user": st.user_bytes(user), "shared": st.shared_bytes()},
            "params": _leaf_table(pol.params), "opt_state": _leaf_table(pol.opt_state),
            "learner_state": _leaf_table(pol.learner_state)}


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


@policies.command()
@click.argument("store", type=click.Path())
@click.argument("user")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object on stdout instead of text.")
def show(store, user, as_json):
    """Show USER's policy in STORE: store meta, saved versions, the version restored
    (a newer corrupt one is skipped and reported), bytes on disk (the user's entry and
    the shared part), shapes and L2 norms of the params, optimiser and learner state, and
    the saved info (queries seen, metrics)."""
    st = _open(store)
    _require_user(st, user)
    _progress(f"loading {user!r} from {store} ...")
    doc = show_doc(st, user)
    if as_json:
        click.echo(json.dumps(doc))
        return
    m = doc["meta"]
    click.echo(f"user {user} in {store} (kind={m['kind']} dim={m['dim']} hidden={m['hidden']} "
               f"scope={doc['scope']})")
    vs = ", ".join(f"v{e['version']} ({e.get('saved_at')})" for e in doc["versions"])
    click.echo(f"versions: {vs}; restored v{doc['restored_version']}")
    for s in doc["skipped"]:
        click.echo(f"  skipped v{s['version']}: {s['reason']}")
    ub, sb = doc["bytes"]["user"], doc["bytes"]["shared"]
    click.echo(f"bytes on disk: user {_size(ub['bytes'])} (v{ub['version']} {ub['chunk']} row {ub['row']}, "
               f"1/{ub['users_in_chunk']} of {_size(ub['chunk_bytes'])}); shared {_size(sb['bytes'])} "
               f"(v{sb['version']}, once for all users)")
    for part in ("params", "opt_state", "learner_state"):
        click.echo(f"{part}:")
        for leaf in doc[part]:
            norm = "" if leaf["norm"] is None else f"  |.|={leaf['norm']:.6g}"
            click.echo(f"  {leaf['path']:<32} {str(tuple(leaf['shape'])):<14} {leaf['dtype']:<8}{norm}")
    click.echo(f"info: {json.dumps(doc['info'], sort_keys=True)}")


@policies.command()
@click.argument("store", type=click.Path())
@click.argument("user")
@click.option("--out", "out", required=True, type=click.Path(),
              help="Output .npz; keys are leaf paths such as q_adapter/W/kernel. A FILE.json "
                   "with meta, version and info is written next to it.")
@click.option("--version", "version", type=int, default=None,
              help="Export this saved version instead of the newest good one.")
def export(store, user, out, version):
    """Export USER's params from STORE as one .npz (plus a .json with meta), e.g. to
    load with numpy.load outside rmm-jax. Both files are written atomically."""
    st = _open(store)
    _require_user(st, user)
    if not str(out).endswith(".npz"):
        raise InputError("export file must end in .npz", where=f"--out {out}")
    _progress(f"exporting {user!r} from {store} ...")
    doc = st.export_user(user, out, version=version)
    _progress(f"wrote {out} (version {doc['version']}, {len(doc['shapes'])} arrays)")
