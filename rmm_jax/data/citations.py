"""Citations: simulating them, parsing them, and asking for them.

In RMM (Tan et al., ACL 2025) the generator LLM sees the ``M`` memories the reranker
selected, answers the user and, in the same call, cites the memories it used. A cited
memory earns reward (+1) and an uncited one does not (-1 in the paper's REINFORCE
update). This module provides the three pieces around that signal, without an LLM:

* :func:`oracle_cite` - a seeded, jittable citation simulator driven by gold labels,
  calibrated to the citation/judge agreement the paper measured
  (precision 0.876, recall 0.858);
* :func:`parse_citations` - turns a generator's inline citations (``[1, 3]``,
  ``[Memory 2]``, ``[M1][M3]``, ``[NO_CITE]``) into 0-based positions;
* :data:`RMM_PROMPT_TEMPLATE` / :func:`format_prompt` - the one-call
  "answer, then cite" prompt.

Simulator model
---------------
For one generator call with selection slots ``i = 1..M``, let ``v_i`` say whether slot
``i`` holds a real memory and ``g_i`` whether that memory is gold. With

    n_gold    = sum_i v_i * g_i
    n_nongold = sum_i v_i * (1 - g_i)

each valid slot is cited independently:

    P(cite i | gold)     = r                                     (recall)
    P(cite i | non-gold) = q = clip(r * n_gold * (1 - p) / (p * n_nongold), 0, 1)

and padded slots (``v_i = 0``) are never cited. ``q`` is chosen per call so that the
expected number of false citations equals ``E[cited gold] * (1 - p) / p``, hence

    precision = E[cited gold] / (E[cited gold] + E[cited non-gold])
              = r n_gold / (r n_gold + q n_nongold) = p

whenever ``q`` is not clipped and at least one non-gold memory is selected.
Aggregated over many such calls (sum of cited gold over sum of cited), the empirical
precision therefore converges to ``p``; the empirical recall (cited gold / selected
gold) converges to ``r`` over any calls.

Edge cases, by design:

* ``n_nongold == 0``: ``q`` is irrelevant (the denominator is guarded, nothing uses it).
  No false citation is possible, so such a call's precision is 1 and a workload with
  many all-gold selections has aggregate precision above ``p``.
* ``n_gold == 0``: no gold can be cited and the same formula gives ``q = 0``, so
  **a call that selected no gold memory cites nothing** (the simulated generator finds
  nothing useful and answers ``[NO_CITE]``). All its selected memories get the
  "uncited" reward. This keeps the false-citation rate tied to the number of true
  citations, which is what makes the aggregate precision exactly ``p``.
* ``q`` clips at 1 when ``r * n_gold * (1 - p) > p * n_nongold`` (many gold, few
  non-gold, a low precision target). Then every non-gold slot is cited and the
  realised precision of that call is *above* ``p``. With the defaults this needs
  ``n_gold / n_nongold > p / (r (1 - p)) ~= 8.23``, which cannot happen for ``M <= 9``.
* ``p = 1`` gives ``q = 0``: no false citation ever. ``r = 0`` cites nothing.
"""
from __future__ import annotations

import math
import numbers
import re
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from rmm_jax.errors import InputError

__all__ = [
    "DEFAULT_PRECISION",
    "DEFAULT_RECALL",
    "NO_CITE",
    "RMM_PROMPT_TEMPLATE",
    "check_rate",
    "false_cite_prob",
    "format_prompt",
    "oracle_cite",
    "parse_citations",
]

#: Citation precision against an LLM judge measured in the RMM paper.
DEFAULT_PRECISION = 0.876
#: Citation recall against an LLM judge measured in the RMM paper.
DEFAULT_RECALL = 0.858
#: The token a generator emits when no memory was useful.
NO_CITE = "[NO_CITE]"


# ---------------------------------------------------------------------------
# Citation simulator
# ---------------------------------------------------------------------------

def check_rate(value, name: str, *, low_open: bool) -> float:
    """Validate a rate (a citation precision or recall) and return it as a ``float``.

    ``value`` must be a concrete real number (a Python or NumPy scalar, or a 0-d
    array), not a traced JAX value, in ``(0, 1]`` when ``low_open`` else ``[0, 1]``.
    Raises :class:`InputError` located at ``argument '{name}'``.
    """
    if isinstance(value, jax.core.Tracer):
        raise InputError(
            f"must be a concrete Python float, not a traced array "
            f"(mark '{name}' static under jax.jit)", where=f"argument '{name}'")
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        # numbers.Real covers int, float and NumPy scalars; 0-d arrays are accepted below.
        try:
            arr = np.asarray(value)
        except Exception:  # pragma: no cover - exotic objects
            arr = None
        if arr is None or arr.shape != () or arr.dtype.kind not in "iuf":
            raise InputError(f"must be a float, got {type(value).__name__}",
                             where=f"argument '{name}'")
        value = arr.item()
    value = float(value)
    ok = math.isfinite(value) and (0.0 < value <= 1.0 if low_open else 0.0 <= value <= 1.0)
    if not ok:
        interval = "(0, 1]" if low_open else "[0, 1]"
        raise InputError(f"must be in {interval}, got {value!r}", where=f"argument '{name}'")
    return value


def _check_masks(is_gold, valid) -> tuple[jax.Array, jax.Array]:
    is_gold = jnp.asarray(is_gold)
    valid = jnp.asarray(valid)
    if is_gold.ndim < 1:
        raise InputError(f"must have shape (M,), got {is_gold.shape}", where="argument 'is_gold'")
    if valid.shape != is_gold.shape:
        raise InputError(f"shape {valid.shape} differs from is_gold's {is_gold.shape}",
                         where="argument 'valid'")
    return is_gold.astype(jnp.bool_), valid.astype(jnp.bool_)


def false_cite_prob(is_gold, valid, precision: float = DEFAULT_PRECISION,
                    recall: float = DEFAULT_RECALL) -> jax.Array:
    """Per-call probability ``q`` that a selected non-gold memory is cited.

        q = clip(recall * n_gold * (1 - precision) / (precision * n_nongold), 0, 1)

    with ``n_gold`` / ``n_nongold`` counted over valid slots of the last axis. Returns a
    float32 array of shape ``is_gold.shape[:-1]`` (a scalar for one call). When
    ``n_nongold == 0`` the value is finite but unused.
    """
    precision = check_rate(precision, "precision", low_open=True)
    recall = check_rate(recall, "recall", low_open=False)
    is_gold, valid = _check_masks(is_gold, valid)
    return _false_cite_prob(is_gold, valid, precision, recall)


def _false_cite_prob(is_gold: jax.Array, valid: jax.Array, precision: float,
                     recall: float) -> jax.Array:
    n_gold = jnp.sum(is_gold & valid, axis=-1, dtype=jnp.float32)
    n_nongold = jnp.sum(~is_gold & valid, axis=-1, dtype=jnp.float32)
    num = jnp.float32(recall * (1.0 - precision)) * n_gold
    den = jnp.float32(precision) * jnp.maximum(n_nongold, jnp.float32(1.0))
    return jnp.clip(num / den, jnp.float32(0.0), jnp.float32(1.0))


def oracle_cite(key: jax.Array, is_gold, valid, precision: float = DEFAULT_PRECISION,
                recall: float = DEFAULT_RECALL) -> jax.Array:
    """Simulate which selected memories a generator cites, from gold labels.

    Args:
      key: a JAX PRNG key; the same key and inputs give the same citations.
      is_gold: ``(M,)`` bool, whether the memory in each selection slot is gold.
      valid: ``(M,)`` bool, whether the slot holds a real memory (padded slots are
        never cited).
      precision: target citation precision ``p`` in ``(0, 1]`` (Python float).
      recall: target citation recall ``r`` in ``[0, 1]`` (Python float).

    Returns:
      ``(M,)`` bool: cited slots. Gold valid slots are cited with probability ``r``,
      non-gold valid slots with ``q = clip(r n_gold (1 - p) / (p n_nongold), 0, 1)``
      so that ``E[cited gold] / E[cited] = p`` (see the module docstring). With no
      gold selected, ``q = 0`` and nothing is cited.

    Pure and traceable: ``jax.jit`` (leave ``precision``/``recall`` as defaults or mark
    them static) and ``jax.vmap`` over ``key``/``is_gold``/``valid`` both work. Extra
    leading axes are treated as a batch of calls sharing one key.
    """
    precision = check_rate(precision, "precision", low_open=True)
    recall = check_rate(recall, "recall", low_open=False)
    is_gold, valid = _check_masks(is_gold, valid)
    q = _false_cite_prob(is_gold, valid, precision, recall)
    prob = jnp.where(is_gold, jnp.float32(recall), q[..., None])
    u = jax.random.uniform(key, is_gold.shape, dtype=jnp.float32)
    return valid & (u < prob)


# ---------------------------------------------------------------------------
# Parsing inline citations
# ---------------------------------------------------------------------------

_GROUP = re.compile(r"\[([^\[\]]*)\]")
_ITEM = re.compile(r"\s*(?:memory\s*|m\s*)?([0-9]+)\s*", re.IGNORECASE | re.ASCII)
_NO_CITE = re.compile(r"\s*no[_ ]?cite\s*", re.IGNORECASE)
_SEP = re.compile(r"[,;]")


def parse_citations(text: str, num_shown: int) -> tuple[int, ...]:
    """0-based positions of the memories cited in ``text``, first appearance first.

    A citation is a bracket group whose comma- (or semicolon-) separated items are all
    citation tokens: ``N``, ``Memory N``, ``MemoryN``, ``M N`` or ``MN`` (case-insensitive,
    ``N`` 1-based). Accepted examples: ``[1]``, ``[2, 3]``, ``[1,2]``, ``[Memory 3]``,
    ``[memory 3]``, ``[M2]``, ``[m2]``, ``[Memory 1, Memory 4]``, ``[M1][M3]``. A group
    with any other item (``[see above]``, ``[1, foo]``) is not a citation and is ignored
    whole. ``[NO_CITE]`` contributes nothing, so a reply citing nothing returns ``()``.

    Numbers outside ``1..num_shown`` are ignored (so years such as ``[2023]`` do not
    count); repeated citations are kept once, at their first position.
    """
    if not isinstance(text, str):
        raise InputError(f"must be a str, got {type(text).__name__}", where="argument 'text'")
    if isinstance(num_shown, bool) or not isinstance(num_shown, numbers.Integral) or num_shown < 0:
        raise InputError(f"must be a non-negative int, got {num_shown!r}",
                         where="argument 'num_shown'")
    num_shown = int(num_shown)
    seen: dict[int, None] = {}
    for group in _GROUP.finditer(text):
        body = group.group(1)
        if _NO_CITE.fullmatch(body):
            continue
        numbers_in_group = []
        for item in _SEP.split(body):
            m = _ITEM.fullmatch(item)
            if m is None:
                numbers_in_group = None
                break
            numbers_in_group.append(int(m.group(1)))
        if not numbers_in_group:
            continue
        for n in numbers_in_group:
            if 1 <= n <= num_shown:
                seen.setdefault(n - 1, None)
    return tuple(seen)


# ---------------------------------------------------------------------------
# Prompt
# ---------------------------------------------------------------------------

RMM_PROMPT_TEMPLATE = """\
You are a helpful assistant with a long-term memory of your past conversations with \
this user. Below are memories retrieved for the user's current message, each numbered.

{memories}

User: {query}

Instructions:
1. Answer the user's message. Use the memories only where they are relevant; if none \
is, answer from the conversation alone.
2. After your answer, on a final line of its own, cite the memories you actually used \
by their numbers, e.g. "Citations: [1, 3]". Cite only memories that contributed to the \
answer. If no memory was useful, write "Citations: [NO_CITE]".

Response:"""
"""Prompt for RMM's one-call "answer, then cite" generator.

Placeholders: ``{memories}`` - the selected memories, one per line, numbered from 1 in
the order the reranker chose (``Memory [1]: ...``); ``{query}`` - the user's message.
The reply ends with a line ``Citations: [i, j]`` or ``Citations: [NO_CITE]``, which
:func:`parse_citations` turns into 0-based positions among the shown memories. Fill it
with :func:`format_prompt`.
"""


def format_prompt(query: str, memories: Sequence[str]) -> str:
    """Fill :data:`RMM_PROMPT_TEMPLATE`: memories numbered ``Memory [1]: ...`` in order.

    With no memories the block reads ``(no memories)`` and the generator is expected
    to answer ``[NO_CITE]``.
    """
    if not isinstance(query, str):
        raise InputError(f"must be a str, got {type(query).__name__}", where="argument 'query'")
    if isinstance(memories, str) or not isinstance(memories, Sequence):
        raise InputError(f"must be a list of str, got {type(memories).__name__}",
                         where="argument 'memories'")
    for i, mem in enumerate(memories):
        if not isinstance(mem, str):
            raise InputError(f"item {i} is {type(mem).__name__}, expected str",
                             where="argument 'memories'")
    block = "\n".join(f"Memory [{i}]: {mem}" for i, mem in enumerate(memories, start=1))
    return RMM_PROMPT_TEMPLATE.format(memories=block or "(no memories)", query=query)
