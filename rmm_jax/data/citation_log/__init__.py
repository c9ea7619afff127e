"""Logged citations: the JSONL schema for real generator calls.

A citation log is a UTF-8 JSONL file with one JSON object per generator call, in any
order. Blank lines are skipped; line numbers in error messages count every physical
line (``\\n``), blank ones included, starting at 1.

| key              | type                  | required | meaning / constraints                                         |
|------------------|-----------------------|----------|---------------------------------------------------------------|
| `user_id`        | string (non-empty)    | yes      | the user whose memory bank was searched                       |
| `call_id`        | string (non-empty)    | no       | the call's own id (what a serving system writes); names the call |
| `query_id`       | string (non-empty)    | one of these three | the query: a question of the store, or the application's id for it |
| `query`          | string                | (see "Identity") | the query text; embedded when the store lacks the query |
| `candidates`     | list of string        | yes      | the K memory ids the retriever returned, in retriever order; non-empty, unique |
| `selected`       | list of string        | yes      | the M memory ids shown to the generator, in display order (position 1 first); non-empty, unique, each in `candidates` |
| `cited`          | list of string        | yes      | memory ids the generator cited; may be empty; unique, each in `selected` |
| `log_prob`       | number or null        | no       | log-probability of `selected` under the policy that logged it; finite, `<= 0` (integers accepted) |
| `logits`         | list of number, null  | no       | the logging policy's Plackett–Luce logits s_i/τ, one per candidate, in `candidates` order; finite. With `log_prob` too, the two must agree (see below) |
| `timestamp`      | string, number, null  | no       | when the call happened (free form; numbers must be finite)    |
| `gold`           | list of string, null  | no       | memory ids relevant to the query (gold), for Recall@M; unique |
| `policy_version` | integer ≥ 1, null     | no       | the served user's policy version (``rmm-jax rerank``; null: none of its own) |
| `shared_version` | integer ≥ 1, null     | no       | the shared version it was served with (null: none)            |

**Identity of a call.** Within one user, a call is named by its ``call_id`` when it has
one, else by its ``query_id``, else by its ``query`` text (:func:`call_key`); a record
needs at least one of the three, and two records of a log may not name the same call
(the first one wins with ``skip_invalid``). So a production log that asks the same
question twice gives each call its own ``call_id``.

Each item of `candidates` is either a memory id (a string) or an object
``{"id": "m3", "text": "..."}`` carrying the memory's text; the two forms may be mixed.
A text, like a ``query``, may not be empty or only whitespace.
Texts, `query` and `gold` are what ``rmm-jax embed log:calls.jsonl --out STORE`` needs
to build an embedding store straight from a production log (:mod:`rmm_jax.data.log_dataset`).
``replay`` and ``evaluate`` take a query or a memory from the store when the store holds
its id, and embed the record's text otherwise (:mod:`rmm_jax.data.log_vectors`); gold
comes from the store for a question it holds, from the record's ``gold`` otherwise, less
the ids no bank holds (neither the store nor any record of the user: a gold memory never
retrieved has no text; read against ``known``, one note counts them, and the records keep
their gold as logged).

A **served record** (what ``rmm-jax rerank --explore`` writes, :func:`validate_record`
with ``served=True``) is a record without ``cited``: the application adds the memories
the generator cited, and the line becomes a log record. Its ``timestamp`` is the
request's, or the time ``rerank`` served the call (:func:`utc_timestamp`).

Example lines::

    {"user_id": "u1", "query_id": "q7", "candidates": ["m3", "m1", "m9"],
     "selected": ["m1", "m3"], "cited": ["m1"], "log_prob": -1.2}
    {"user_id": "u1", "call_id": "c-0412", "query": "Where does my sister live now?",
     "candidates": [{"id": "m3", "text": "My sister moved to Lisbon."}, {"id": "m1", "text": "..."}],
     "selected": ["m3"], "cited": ["m3"], "logits": [4.1, 2.0], "log_prob": -0.115, "gold": ["m3"]}

Decisions:

* ``true``/``false`` are not numbers (``log_prob: true`` is a type error).
* ``null`` for an optional key means "absent"; :func:`write_log` and :class:`LogWriter`
  omit absent keys.
* Numeric ``timestamp`` values must be finite.
* Memory, user and query ids must be non-empty strings.
* `logits` and `log_prob` together must agree: the exact Plackett–Luce log-probability
  of `selected` under `logits`, Σ_j [z_{i_j} − logsumexp of the candidates not drawn
  yet], may differ from `log_prob` by at most :func:`pl_tolerance` (a float32 logger's
  rounding: max(1e-3, 1e-4·|log_prob|), or the float32 bound for large logits). Off-policy evaluation needs `logits` for the slate
  estimators (RIPS, IIPS); IPS and SNIPS need only `log_prob`.
* A memory's text may appear in several records of a user; it must be the same in all
  of them (the reader checks it). A record may carry the text of a memory the store
  holds, and it must be the store's text of that id (checked when ``known`` maps memory
  ids to texts, as :func:`rmm_jax.data.log_vectors.known_ids` does): the store's
  embedding is used, so another text under that id would be silently ignored.
* Unknown extra keys are **allowed and ignored** (forward compatibility: a logger may
  add e.g. ``"answer"``); they are not kept in :class:`LogRecord`. A key repeated
  inside any JSON object on a line is an error (JSON parsers silently keep the last).
* An unknown key that is probably a misspelt log key (``timestmap``, ``log_porb``,
  ``Cited``: :func:`misspelt_key`, a difflib ratio of at least 0.8 to a log key, in
  lower case) is still ignored, but the reader notes it (the report's ``notes``), once
  per key and log, naming the first line that has it:
  ``log.jsonl:3: key 'timestmap' is not a log key and was ignored (did you mean
  'timestamp'?)``; ``replay``, ``evaluate``, ``cite-rates`` and ``embed log:`` print
  each as a ``note:`` line on stderr. Keys of other names (``answer``, ``model``,
  ``latency_ms``, the ``scores`` and ``positions`` ``rerank`` writes) are not noted.
  A log key with ``_ids``, ``_id``, ``_texts`` or ``_text`` appended (``gold_ids``,
  ``cited_ids``, ``query_text``) is noted too, unless the record also has the log key.
  Only a key not seen on an earlier line is compared, so reading stays one subset test
  a record.

Every problem raises :class:`~rmm_jax.errors.InputError` with a one-line message that
starts ``path:line`` and names the key, e.g.
``logs.jsonl:12: key 'cited': id 'm4' is not in 'selected'``.

The package holds one concern a module, and names here what the rest of rmm_jax uses:
``_schema`` (the keys, :class:`LogRecord`), ``_record`` (one record checked, and back to
JSON), ``_plackett_luce`` (``logits`` against ``log_prob``), ``_time`` (``timestamp``),
``_keys`` (misspelt keys), ``_identity`` (:func:`call_key` and what a policy store remembers
of a call), ``_known`` (a record against a store's ids), ``_read`` and ``_write``; the lines
themselves are decoded as every JSONL file is (:mod:`rmm_jax.data.json_lines`).
"""
from rmm_jax.data.citation_log._identity import CONTENT_LEFT_OUT, call_hash, call_hashes, call_key, learned_content
from rmm_jax.data.citation_log._keys import CLOSE_KEY, KEY_SUFFIXES, misspelt_key, note_misspelt_keys
from rmm_jax.data.citation_log._known import Known, check_known
from rmm_jax.data.citation_log._plackett_luce import pl_log_prob, pl_tolerance
from rmm_jax.data.citation_log._read import (
    LogReading,
    NotGroupedError,
    ReadReport,
    is_empty_log,
    iter_log,
    iter_numbered,
    iter_user_chunks,
    read_log,
)
from rmm_jax.data.citation_log._record import FLOAT32_MAX, call_record, record_to_json, validate_record
from rmm_jax.data.citation_log._schema import LOG_KEYS, OPTIONAL_KEYS, REQUIRED_KEYS, LogRecord
from rmm_jax.data.citation_log._time import FUTURE_SKEW, check_timestamp, time_text, timestamp_seconds, utc_timestamp
from rmm_jax.data.citation_log._write import LogWriter, write_log
from rmm_jax.data.json_lines import MAX_FIRST_ERRORS, STDIN, json_lines, source_name

__all__ = [
    "CLOSE_KEY", "CONTENT_LEFT_OUT", "FLOAT32_MAX", "FUTURE_SKEW", "KEY_SUFFIXES", "LOG_KEYS", "MAX_FIRST_ERRORS",
    "OPTIONAL_KEYS", "REQUIRED_KEYS", "STDIN", "Known", "LogReading", "LogRecord", "LogWriter", "NotGroupedError",
    "ReadReport", "call_hash", "call_hashes", "call_record", "call_key", "check_known", "check_timestamp",
    "is_empty_log", "iter_log", "iter_numbered", "iter_user_chunks", "json_lines", "learned_content",
    "misspelt_key", "note_misspelt_keys", "pl_log_prob", "pl_tolerance", "read_log", "record_to_json", "source_name",
    "time_text", "timestamp_seconds", "utc_timestamp", "validate_record", "write_log",
]
