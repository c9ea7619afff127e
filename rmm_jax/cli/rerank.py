"""``rmm-jax rerank``: serve stored policies on a file of calls."""
from __future__ import annotations

import json
import sys
import time
from collections import defaultdict
from pathlib import Path

import click
import numpy as np

from rmm_jax.cli.common import DEFAULTS, check_output_file, info, progress_bar
from rmm_jax.cli.main import cli
from rmm_jax.data.calls import read_calls
from rmm_jax.data.embed import Embedder
from rmm_jax.data.retrieval import top_k
from rmm_jax.data.store import open_store
from rmm_jax.errors import InputError, at
from rmm_jax.online.serve import DEFAULT_CACHE_USERS, Reranker
from rmm_jax.persist.atomic import atomic_file


def _embed(texts: list[str], model: str) -> dict[str, np.ndarray]:
    """Every distinct text's embedding with STORE's model (through the disk cache); the
    model is loaded only when there is text to embed."""
    if not texts:
        return {}
    distinct = list(dict.fromkeys(texts))
    emb = Embedder(model, progress=False)
    try:
        vecs = emb.encode(distinct)
    finally:
        emb.close()
    return dict(zip(distinct, vecs))


class _Users:
    """STORE's users, read once each, with their memory-id index."""

    def __init__(self, st, calls_path):
        self.st, self.path, self.cache = st, calls_path, {}

    def get(self, call, key):
        if call.user_id not in self.cache:
            if call.user_id not in set(self.st.user_ids):
                raise InputError(f"user {call.user_id!r} is not in STORE {self.st.path} (needed for '{key}')",
                                 where=at(self.path, call.line, "user_id"))
            u = self.st.user(call.user_id)
            self.cache[call.user_id] = (u, {m: j for j, m in enumerate(u.memory_ids)},
                                        {q: i for i, q in enumerate(u.query_ids)})
        return self.cache[call.user_id]


@cli.command()
@click.argument("store", type=click.Path())
@click.option("--policies", required=True, type=click.Path(), help="Policy store whose policies rank the calls.")
@click.option("--calls", "calls_path", required=True, type=click.Path(),
              help="JSONL of calls: user_id; query (text) or query_id; candidates (memory ids of STORE), "
                   "candidate_texts, or neither (the base retriever's top --k).")
@click.option("--m", type=click.IntRange(min=1), default=DEFAULTS.layout.m, help="Memories to select per call.")
@click.option("--k", type=click.IntRange(min=1), default=DEFAULTS.layout.k,
              help="Candidates from the base retriever when a call lists none.")
@click.option("--out", type=click.Path(dir_okay=False), default=None,
              help="Write the JSONL here (atomically) instead of stdout.")
@click.option("--cache-users", type=click.IntRange(min=1), default=DEFAULT_CACHE_USERS,
              help="Users' policies kept on the device.")
def rerank(store, policies, calls_path, m, k, out, cache_users):
    """Rank each call's candidate memories with the user's stored policy (deterministic top-M).

    For every line of --calls, one JSON line: the call_id (if given), user_id, the selected
    memories (ids, or texts for candidate_texts) best first with their positions and
    reranker scores, and the policy version that ranked it (null for a user the store
    does not hold: they are served the shared part, as a run would start them). Texts are
    embedded with STORE's model through the embedding cache. A bad call is one error line
    naming file:line; nothing is written then.

    \b
    Example:
      rmm-jax rerank stores/mine --policies policies --calls examples/requests.jsonl --m 3 --out ranked.jsonl
    """
    t0 = time.perf_counter()
    check_output_file(out, f"--out {out}")
    st = open_store(store)
    rr = Reranker.open(policies, cache_users=cache_users)
    if rr.dim != st.dim:
        raise InputError(f"policy store has dim {rr.dim}, STORE {st.dim} (made for another embedding model?)",
                         where=f"--policies {policies}")
    calls = read_calls(calls_path)
    users = _Users(st, calls_path)
    vecs = _embed([c.query_text for c in calls if c.query_text]
                  + [t for c in calls for t in c.candidate_texts or ()], st.model)
    prepared = []                                 # (call, q (d,), cands (K, d), names)
    for c in calls:
        if c.query_text is not None:
            q = vecs[c.query_text]
        else:
            u, _, q_index = users.get(c, "query_id")
            if c.query_id not in q_index:
                raise InputError(f"unknown query id for user {c.user_id!r}", where=at(calls_path, c.line, "query_id"))
            q = u.query_emb[q_index[c.query_id]]
        if c.candidate_texts is not None:
            cands, names = np.stack([vecs[t] for t in c.candidate_texts]), list(c.candidate_texts)
        else:
            u, m_index, _ = users.get(c, "candidates" if c.candidates else "the retrieved candidates")
            if c.candidates is not None:
                bad = [x for x in c.candidates if x not in m_index]
                if bad:
                    raise InputError(f"unknown memory id {bad[0]!r} for user {c.user_id!r}",
                                     where=at(calls_path, c.line, "candidates"))
                idx = [m_index[x] for x in c.candidates]
            else:
                idx = top_k(np.asarray(q)[None], u.memory_emb, min(k, len(u.memory_ids)))[1][0].tolist()
            cands, names = u.memory_emb[idx], [u.memory_ids[j] for j in idx]
        if m > len(names):
            raise InputError(f"--m {m} is more than this call's {len(names)} candidates", where=at(calls_path, c.line))
        prepared.append((c, np.asarray(q, np.float32), np.asarray(cands, np.float32), names))
    groups = defaultdict(list)                    # one batched call per user and candidate count
    for i, (c, q, cands, _) in enumerate(prepared):
        groups[(c.user_id, cands.shape[0])].append(i)
    lines: list[str | None] = [None] * len(prepared)
    with progress_bar(len(groups), "rerank", unit="batch") as bar:
        for (uid, _), rows in groups.items():
            got = rr.rank(uid, np.stack([prepared[i][1] for i in rows]), np.stack([prepared[i][2] for i in rows]), m)
            pol = rr.policy(uid)
            for r, i in enumerate(rows):
                c, _, _, names = prepared[i]
                pos = [int(p) for p in got.selected[r] if p >= 0]
                rec = {**({"call_id": c.call_id} if c.call_id is not None else {}), "user_id": uid,
                       **({"query_id": c.query_id} if c.query_id is not None else {}),
                       "selected": [names[p] for p in pos], "positions": pos,
                       "scores": [round(float(got.scores[r, p]), 6) for p in pos],
                       "policy_version": pol.version, "shared_version": pol.shared_version}
                lines[i] = json.dumps(rec)
            bar.update(1)
    text = "".join(line + "\n" for line in lines)
    if out:
        with atomic_file(Path(out)) as f:
            f.write(text)
        info(f"ranked {len(lines)} calls of {len({c.user_id for c in calls})} users in "
             f"{time.perf_counter() - t0:.1f} s; wrote {out}")
    else:
        sys.stdout.write(text)
