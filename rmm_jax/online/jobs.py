"""The main jobs, as library calls: pretrain, simulate, replay, and their summaries.

The CLI and the benchmarks are thin shells over these functions. Every report uses
prequential evaluation (see :mod:`rmm_jax.online.loop`): for each query in stream order,
the deterministic top-M of the policy *before* the update that uses the query.
"""
from __future__ import annotations

import dataclasses
from typing import Callable, Sequence

import jax
import numpy as np

from rmm_jax.data.citations import oracle_cite
from rmm_jax.errors import InputError
from rmm_jax.online.loop import Stream, flatten_queries, moving_average, run_streams, stream_from_user
from rmm_jax.online.pretrain import PretrainConfig, pretrain, split_users
from rmm_jax.core.update import Config

CURVE_WINDOW = 25


def load_streams(store, k: int, users: Sequence[str] | None = None) -> list[Stream]:
    """One :class:`Stream` per user of an embedding store (all users by default)."""
    ids = list(store.user_ids) if not users else list(users)
    unknown = [u for u in ids if u not in set(store.user_ids)]
    if unknown:
        raise InputError(f"unknown user id {unknown[0]!r} (the store has {len(store.user_ids)} users)",
                         where="--users")
    return [stream_from_user(store.user(u), k) for u in ids]


class Summary:
    """Query-weighted overall means, per-user means and the learning curve, built one
    user at a time: memory holds one small row per user, not the per-query values."""

    def __init__(self, m: int):
        self.m, self.per_user = m, {}
        self.sum_r = self.sum_n = 0.0
        self.count = 0
        self.pos_sum, self.pos_cnt = np.zeros(0), np.zeros(0)

    def add(self, user_id: str, recall, ndcg, valid) -> None:
        """Add one user's (T,) prequential values in stream order; only ``valid`` count."""
        v = np.asarray(valid, bool)
        r, n = np.asarray(recall, np.float64)[v], np.asarray(ndcg, np.float64)[v]
        m = self.m
        self.per_user[user_id] = {f"recall@{m}": float(r.mean()) if r.size else None,
                                  f"ndcg@{m}": float(n.mean()) if n.size else None, "queries": int(r.size)}
        self.sum_r += float(r.sum())
        self.sum_n += float(n.sum())
        self.count += int(r.size)
        if r.size > self.pos_sum.size:
            grow = r.size - self.pos_sum.size
            self.pos_sum, self.pos_cnt = np.pad(self.pos_sum, (0, grow)), np.pad(self.pos_cnt, (0, grow))
        self.pos_sum[:r.size] += r
        self.pos_cnt[:r.size] += 1

    def result(self) -> dict:
        m, c = self.m, self.count
        curve = self.pos_sum / np.maximum(self.pos_cnt, 1)
        return {f"recall@{m}": self.sum_r / c if c else None, f"ndcg@{m}": self.sum_n / c if c else None,
                "queries": c, "per_user": self.per_user,
                "curve": moving_average(curve, CURVE_WINDOW).round(5).tolist()}


def summarize(streams: Sequence[Stream], per_user_recall: dict, per_user_ndcg: dict, m: int) -> dict:
    """:class:`Summary` of whole streams: ``per_user_*`` map user id → (T,) values."""
    acc = Summary(m)
    for s in streams:
        acc.add(s.user_id, per_user_recall[s.user_id], per_user_ndcg[s.user_id], s.valid)
    return acc.result()


def base_values(s: Stream, m: int) -> tuple:
    """(Recall@m, NDCG@m) per query of the base retriever's own order."""
    from rmm_jax.core import metrics

    rel = s.cand_gold[:, :m] & s.cand_mask[:, :m]
    return metrics.recall_at_k(rel, s.num_gold, m), metrics.ndcg_at_k(rel, s.num_gold, m)


def base_summary(streams: Sequence[Stream], m: int) -> dict:
    """The base retriever's order, evaluated like a policy (same metric, same queries)."""
    acc = Summary(m)
    for s in streams:
        acc.add(s.user_id, *base_values(s, m), s.valid)
    return acc.result()


@dataclasses.dataclass
class OnlineResult:
    summary: dict
    user_ids: list
    states: list           # per chunk: stacked (params, opt_state, learner_state), host numpy
    chunk_users: list      # per chunk: user ids
    records: list          # log records (dicts), simulate only, when asked for


def run_online(streams: Sequence[Stream], params, cfg: Config, *, seed: int = 0, cite_fn=None,
               users_per_chunk: int = 8, want_log: bool = False, mesh=None,
               on_chunk: Callable | None = None, progress: Callable[[int], None] | None = None) -> OnlineResult:
    """Simulate (``cite_fn`` given) or replay (streams carry the logged selections) over
    streams in memory; :func:`run_chunks` with the final states kept unless ``on_chunk``
    (e.g. saving policies) takes them."""
    states, chunk_users, records = [], [], []

    def keep(ids, st, infos):
        if on_chunk is not None:
            on_chunk(ids, st, infos)
        else:
            states.append(st)
            chunk_users.append(ids)

    chunks = [streams[i:i + users_per_chunk] for i in range(0, len(streams), users_per_chunk)]
    summary, _ = run_chunks(chunks, params, cfg, seed=seed, cite_fn=cite_fn, users_per_chunk=users_per_chunk,
                            on_chunk=keep, on_records=records.extend if want_log else None, progress=progress,
                            mesh=mesh)
    return OnlineResult(summary, [s.user_id for s in streams], states, chunk_users, records)


def _log_records(s: Stream, selected, cited, log_prob) -> list[dict]:
    out = []
    for t, qid in enumerate(s.query_ids):
        cand_ids = [s.memory_ids[j] for j, ok in zip(s.cand[t], s.cand_mask[t]) if ok]
        sel = [int(p) for p in selected[t] if p >= 0]
        out.append({"user_id": s.user_id, "query_id": qid, "candidates": cand_ids,
                    "selected": [s.memory_ids[s.cand[t][p]] for p in sel],
                    "cited": [s.memory_ids[s.cand[t][p]] for p, c in zip(sel, cited[t]) if c],
                    "log_prob": float(log_prob[t])})
    return out


def simulate(streams, params, cfg: Config, *, precision: float, recall: float, **kw) -> OnlineResult:
    """The online loop against the oracle citation simulator."""
    return run_online(streams, params, cfg, cite_fn=oracle(precision, recall), **kw)


def streams_from_log(store, records, cfg: Config, log_path: str = "log") -> list[Stream]:
    """Replay streams: per user, the logged queries in log order with their logged
    candidates, selections and citations (ids mapped to the store's memories)."""
    by_user: dict[str, list] = {}
    for rec in records:
        by_user.setdefault(rec.user_id, []).append(rec)
    streams = []
    for uid, recs in by_user.items():
        user = store.user(uid)
        mem_index = {m: j for j, m in enumerate(user.memory_ids)}
        q_index = {q: i for i, q in enumerate(user.query_ids)}
        t, k = len(recs), cfg.k
        cand = np.zeros((t, k), np.int32)
        cmask = np.zeros((t, k), bool)
        sel = np.full((t, cfg.m), -1, np.int32)
        cited = np.zeros((t, cfg.m), bool)
        lp = np.zeros((t,), np.float32)
        has = np.zeros((t,), bool)
        qi = np.zeros((t,), np.int64)
        for i, r in enumerate(recs):
            if len(r.candidates) > k:
                raise InputError(f"record for user {uid!r}, query {r.query_id!r} has {len(r.candidates)} "
                                 f"candidates, more than --k {k}", where=log_path)
            if len(r.selected) > cfg.m:
                raise InputError(f"record for user {uid!r}, query {r.query_id!r} selected {len(r.selected)} "
                                 f"memories, more than --m {cfg.m}", where=log_path)
            qi[i] = q_index[r.query_id]
            cand[i, :len(r.candidates)] = [mem_index[c] for c in r.candidates]
            cmask[i, :len(r.candidates)] = True
            pos = {c: p for p, c in enumerate(r.candidates)}
            sel[i, :len(r.selected)] = [pos[x] for x in r.selected]
            cset = set(r.cited)
            cited[i, :len(r.selected)] = [x in cset for x in r.selected]
            if r.log_prob is not None:
                lp[i], has[i] = r.log_prob, True
        gold = np.asarray(user.gold, bool)[qi]
        streams.append(Stream(
            user_id=uid, bank=np.asarray(user.memory_emb, np.float32), queries=np.asarray(user.query_emb)[qi],
            cand=cand, cand_mask=cmask, cand_gold=np.take_along_axis(gold, cand, axis=1) & cmask,
            num_gold=gold.sum(1).astype(np.int32), valid=np.asarray(user.valid)[qi],
            memory_ids=tuple(user.memory_ids), query_ids=tuple(user.query_ids[j] for j in qi),
            selected=sel, cited=cited, logged_log_prob=lp, has_logged=has))
    return streams


def run_pretrain(streams: Sequence[Stream], params, pcfg: PretrainConfig, *, seed: int = 0,
                 progress=None, resume: dict | None = None, on_epoch=None):
    """Split users into train/validation and pretrain; returns (params, history, split).
    ``resume``/``on_epoch``: see :func:`rmm_jax.online.pretrain.pretrain`."""
    train_ids, val_ids = split_users([s.user_id for s in streams], pcfg.val_fraction, seed)
    by_id = {s.user_id: s for s in streams}
    best, history = pretrain(params, [by_id[u] for u in train_ids], [by_id[u] for u in val_ids], pcfg,
                             seed=seed, progress=progress, resume=resume, on_epoch=on_epoch)
    return best, history, {"train": train_ids, "validation": val_ids}


def static_summary(streams: Sequence[Stream], params, m: int) -> dict:
    """A fixed policy (no online updates) evaluated like the online runs."""
    from rmm_jax.online.pretrain import eval_per_query

    rec, nd = {}, {}
    for s in streams:
        data = {"q": s.queries, "m": s.bank[s.cand], "mask": s.cand_mask, "gold": s.cand_gold, "num_gold": s.num_gold}
        r, n = eval_per_query(params, data, m)
        rec[s.user_id], nd[s.user_id] = np.asarray(r), np.asarray(n)
    return summarize(streams, rec, nd, m)


ROWS = ("base", "pretrain", "online", "pretrain+online", "paper")


def compare(train_streams, eval_streams, cfg: Config, pcfg: PretrainConfig, *, rows=ROWS[:4], seed: int = 0,
            precision: float = 0.876, recall: float = 0.858, users_per_chunk: int = 8, kind_hidden=None,
            progress=None) -> dict:
    """The comparison table of the README: base retriever, pretrained policy (fixed),
    online from identity, online from pretrained, and the literal paper preset.

    Pretraining uses ``train_streams`` only (with its own validation split by user);
    every row is evaluated prequentially on ``eval_streams``. Returns row → summary.
    """
    from rmm_jax.core.reranker import init_reranker

    dim = eval_streams[0].bank.shape[1]
    identity = init_reranker(jax.random.key(seed), dim, cfg.kind, cfg.hidden)
    out, pretrained = {}, None
    if any(r.startswith("pretrain") for r in rows):
        pretrained, history, split = run_pretrain(train_streams, identity, pcfg, seed=seed)
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
        else:
            raise ValueError(f"rows: unknown row {row!r}")
    return out


# ---------------------------------------------------------------------------
# Many users in bounded memory: one chunk of users at a time
# ---------------------------------------------------------------------------

OUTPUT_KEYS = ("recall", "ndcg", "selected", "cited", "log_prob")


@dataclasses.dataclass
class RunProgress:
    """Where a chunked online run stands (what a run-state checkpoint holds).

    ``chunks_done`` chunks are complete (their policies saved, their per-query outputs
    handed to ``save_done``); ``chunk`` is the progress of chunk number ``chunks_done``
    (None: not started).
    """
    chunks_done: int
    chunk: object = None  # rmm_jax.online.loop.ChunkProgress | None


def known_ids(store, cache_users: int = 4) -> Callable:
    """A ``known=`` lookup for :mod:`rmm_jax.data.citation_log` that reads one user's ids at a time:
    ``user_id -> (query_ids, memory_ids) | None``. A streamed log holds each user's
    records on consecutive lines, so a small cache suffices."""
    import functools

    users = frozenset(store.user_ids)

    @functools.lru_cache(maxsize=cache_users)
    def lookup(uid: str):
        if uid not in users:
            return None
        u = store.user(uid)
        return frozenset(u.query_ids), frozenset(u.memory_ids)

    return lookup


def _check_limits(rec, cfg: Config, log_path) -> None:
    if len(rec.candidates) > cfg.k:
        raise InputError(f"record for user {rec.user_id!r}, query {rec.query_id!r} has {len(rec.candidates)} "
                         f"candidates, more than --k {cfg.k}", where=str(log_path))
    if len(rec.selected) > cfg.m:
        raise InputError(f"record for user {rec.user_id!r}, query {rec.query_id!r} selected {len(rec.selected)} "
                         f"memories, more than --m {cfg.m}", where=str(log_path))


def scan_log(log_path, cfg: Config, *, known=None, skip_invalid: bool = False) -> dict:
    """Validation pass over a whole log before any work, in bounded memory.

    Checks every record (schema, ``known`` ids, repeated pairs, the ``--k``/``--m``
    limits) and returns the read report plus ``"users"`` and ``"grouped"``: False when
    a user's records are not on consecutive lines (such a log cannot be streamed by
    user; :func:`replay_chunks` needs ``grouped``)."""
    from rmm_jax.data.citation_log import NotGroupedError, iter_user_chunks, read_log

    report: dict = {}
    users = 0
    try:
        for recs in iter_user_chunks(log_path, 1, known=known, skip_invalid=skip_invalid, report=report):
            for r in recs:
                _check_limits(r, cfg, log_path)
            users += 1
    except NotGroupedError:
        records, report = read_log(log_path, known=known, skip_invalid=skip_invalid)
        for r in records:
            _check_limits(r, cfg, log_path)
        return {**report, "users": len({r.user_id for r in records}), "grouped": False}
    return {**report, "users": users, "grouped": True}


def replay_chunks(store, log_path, cfg: Config, users_per_chunk: int, known=None, skip_invalid: bool = False,
                  report: dict | None = None):
    """Replay streams read from a log ``users_per_chunk`` users at a time (the log must
    hold each user's records on consecutive lines, see :func:`scan_log`); yields a list
    of :class:`Stream` per chunk. Memory holds one chunk's records and streams."""
    from rmm_jax.data.citation_log import iter_user_chunks

    for recs in iter_user_chunks(log_path, users_per_chunk, known=known, skip_invalid=skip_invalid,
                                 report=report):
        yield streams_from_log(store, recs, cfg, str(log_path))


def store_chunks(store, k: int, users: Sequence[str] | None, users_per_chunk: int):
    """Streams of a store's users (all by default), built ``users_per_chunk`` at a time."""
    ids = list(store.user_ids) if not users else list(users)
    known = set(store.user_ids)
    unknown = [u for u in ids if u not in known]
    if unknown:
        raise InputError(f"unknown user id {unknown[0]!r} (the store has {len(store.user_ids)} users)",
                         where="--users")

    def gen():
        for i in range(0, len(ids), users_per_chunk):
            yield [stream_from_user(store.user(u), k) for u in ids[i:i + users_per_chunk]]

    return len(ids), gen()


def oracle(precision: float, recall: float) -> Callable:
    """The oracle citation function of :func:`simulate`, rates checked before tracing."""
    from rmm_jax.data.citations import _check_rate

    _check_rate(precision, "precision", low_open=True)
    _check_rate(recall, "recall", low_open=False)
    return lambda key, is_gold, filled: oracle_cite(key, is_gold, filled, precision, recall)


def run_chunks(chunks, params, cfg: Config, *, seed: int = 0, cite_fn=None, users_per_chunk: int = 8,
               on_chunk: Callable | None = None, on_records: Callable | None = None,
               progress: Callable[[int], None] | None = None, segment_batches: int | None = None,
               resume: "RunProgress | None" = None,
               on_progress: Callable[["RunProgress"], None] | None = None,
               save_done: Callable[[int, dict], None] | None = None,
               load_done: Callable[[int], dict] | None = None, mesh=None) -> tuple[dict, dict]:
    """The online loop over an iterable of stream chunks (each <= ``users_per_chunk``
    users), holding one chunk at a time; the program is compiled once for all chunks.

    ``on_chunk(ids, states, infos)`` saves each chunk's policies; with ``cite_fn``
    (simulate) ``on_records(records)`` receives each chunk's generated log records.
    Per-user results do not depend on chunking (per-user keys). ``mesh`` shards each
    chunk's users over devices (:mod:`rmm_jax.online.sharding`). Returns ``(online summary, base retriever summary)``; memory holds one
    chunk plus one summary row per user.

    Resumable runs (:mod:`rmm_jax.persist.runstate`): ``segment_batches`` splits every chunk's
    stream into segments (see :func:`rmm_jax.online.loop.run_streams`); ``on_progress`` gets
    a :class:`RunProgress` after every segment but a chunk's last and after every
    completed chunk (once its ``on_chunk``/``on_records``/``save_done`` returned).
    ``save_done(i, outputs)`` stores completed chunk i's per-user outputs
    (``OUTPUT_KEYS``) and ``load_done(i)`` reads them back: ``resume`` (such a progress)
    skips the completed chunks, taking their summaries and log records from
    ``load_done``, and continues the one in progress.
    """
    from rmm_jax.online.loop import make_run, segment_runner

    run = None if segment_batches else make_run(cfg, cite_fn)
    seg_runs = segment_runner(cfg, cite_fn) if segment_batches else None
    online, base = Summary(cfg.m), Summary(cfg.m)
    n_chunk = 0
    for streams in chunks:
        streams = list(streams)
        if not streams:
            continue
        if len(streams) > users_per_chunk:
            raise ValueError(f"users_per_chunk: a chunk of {len(streams)} streams, more than {users_per_chunk}")
        for s in streams:
            base.add(s.user_id, *base_values(s, cfg.m), s.valid)
        ci, n_chunk = n_chunk, n_chunk + 1
        if resume is not None and ci < resume.chunks_done:  # completed before the interruption
            done = load_done(ci)
            records = []
            for s in streams:
                o = done[s.user_id]
                online.add(s.user_id, o["recall"], o["ndcg"], s.valid)
                if on_records is not None and cite_fn is not None:
                    records.extend(_log_records(s, o["selected"], o["cited"], o["log_prob"]))
            if records:
                on_records(records)
            if progress is not None:
                progress(len(streams))
            continue
        seg_cb = None if on_progress is None else (lambda cp, ci=ci: on_progress(RunProgress(ci, cp)))
        for chunk, st, out in run_streams(streams, params, cfg, seed=seed, cite_fn=cite_fn,
                                          users_per_chunk=users_per_chunk, run_fn=run, progress=progress,
                                          segment_batches=segment_batches, segment_runs=seg_runs,
                                          resume=resume.chunk if resume is not None and ci == resume.chunks_done
                                          else None, on_segment=seg_cb, mesh=mesh):
            fq = flatten_queries(out, cfg.batch)
            infos, records, done = [], [], {}
            for i, s in enumerate(chunk):
                t = s.queries.shape[0]
                r, v = fq["recall"][i, :t], s.valid
                online.add(s.user_id, r, fq["ndcg"][i, :t], v)
                if save_done is not None:
                    done[s.user_id] = {k: np.array(fq[k][i, :t]) for k in OUTPUT_KEYS if k in fq}
                infos.append({"queries_seen": int(t), f"prequential_recall@{cfg.m}":
                              float(r[v].mean()) if v.any() else None})
                if on_records is not None and cite_fn is not None:
                    records.extend(_log_records(s, fq["selected"][i, :t], fq["cited"][i, :t],
                                                fq["log_prob"][i, :t]))
            if on_chunk is not None:
                on_chunk([s.user_id for s in chunk], st, infos)
            if records:
                on_records(records)
            if save_done is not None:
                save_done(ci, done)
        if on_progress is not None:
            on_progress(RunProgress(ci + 1, None))
    if not online.per_user:
        raise InputError("no users to run", where="users")
    return online.result(), base.result()


class LogAppender:
    """Write generated log records chunk by chunk into a temporary file that replaces
    ``path`` atomically when the ``with`` block succeeds (nothing is left on failure).
    Records are validated as :func:`rmm_jax.data.citation_log.write_log` does."""

    def __init__(self, path):
        self.path, self.count, self._cm, self._f = path, 0, None, None

    def __enter__(self):
        from pathlib import Path

        from rmm_jax.persist.atomic import atomic_file

        self._cm = atomic_file(Path(self.path))
        self._f = self._cm.__enter__()
        return self

    def __call__(self, records) -> None:
        import json

        from rmm_jax.data.citation_log import record_to_json, validate_record

        for r in records:
            rec = validate_record(r, f"generated record {self.count}")
            self._f.write(json.dumps(record_to_json(rec), allow_nan=False) + "\n")
            self.count += 1

    def __exit__(self, *exc):
        return self._cm.__exit__(*exc)
