"""Streams: each user's queries in order, with their retrieved candidates, on the host.

The online data flow is dataset → embedding store → **streams** → compiled loop. A
:class:`Stream` is one user's unpadded arrays; :func:`pad_streams` stacks a chunk of
them into the fixed-shape :class:`ChunkData` the compiled loop takes. Streams come from
an embedding store (:func:`store_chunks`, :func:`load_streams`: simulate, pretrain) or
from a citation log (:func:`log_chunks`, :func:`streams_from_log`: replay), and a run's
per-query outputs go back to log records with :func:`log_records`.

One concern per private module: ``_stream`` (the stream, its seeds and its padded chunk),
``_store`` (from an embedding store), ``_log`` (from a citation log, and back).
"""
from rmm_jax.online.streams._log import (
    LogScan,
    LogShape,
    calls_by_user,
    check_limits,
    log_chunks,
    log_records,
    log_shape,
    scan_log,
    streams_from_log,
)
from rmm_jax.online.streams._store import (
    check_users,
    dialogue_stream,
    load_dialogue_streams,
    load_streams,
    store_chunks,
    stream_from_user,
    with_answer_support,
)
from rmm_jax.online.streams._stream import (
    ChunkData,
    Stream,
    bucket,
    pad_streams,
    repeat_passes,
    stream_batches,
    take_queries,
    user_hash,
    user_key,
    user_keys,
)

__all__ = ["ChunkData", "LogScan", "LogShape", "Stream", "bucket", "calls_by_user", "check_limits", "check_users",
           "dialogue_stream", "load_dialogue_streams", "load_streams", "log_chunks", "log_records", "log_shape",
           "pad_streams", "repeat_passes", "scan_log", "store_chunks", "stream_batches", "stream_from_user",
           "streams_from_log", "take_queries", "user_hash", "user_key", "user_keys", "with_answer_support"]
