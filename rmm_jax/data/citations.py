"""Simulated citations: what a generator would cite, without an LLM.

In RMM (Tan et al., ACL 2025) the generator LLM sees the ``M`` memories the reranker
selected, answers the user and, in the same call, cites the memories it used. A cited
memory earns reward (+1) and an uncited one does not (-1 in the paper's REINFORCE
update). This module provides the pieces around that signal, without an LLM:

* :func:`oracle` / :func:`class_cite` - the class-calibrated citation simulator: a
  shown useful memory is cited with P(cite | useful), any other with P(cite | not
  useful), both derived from the paper's per-class judge table, plus a spurious rate
  for calls where nothing useful is shown;
* :func:`position_oracle` - the same with a citation rate that decays with the display
  slot;
* :func:`answer_support` - a label-free notion of "useful": the candidates that support
  the dataset's reference answer, by embedding similarity (host side, precomputed);
* :func:`oracle_cite` - the precision/recall simulator (``--precision/--recall``).

A real generator's side, the prompt that asks for citations and the parser that reads
them back, is :mod:`rmm_jax.data.prompt`.

Every simulator is a ``cite_fn(key, is_gold (M,) bool, filled (M,) bool) -> cited (M,)
bool`` with its rates bound (the :data:`rmm_jax.core.update.CiteFn` contract): slots
are in display order, ``is_gold`` says whether the shown memory is *useful* (the gold
labels, or ``Stream.cite_gold`` when a stream carries its own notion of useful, e.g.
:func:`answer_support`), and unfilled slots are never cited. All are pure, seeded and
jittable; the rates are Python floats fixed when the function is built.

Class-calibrated simulator (:func:`oracle`)
-------------------------------------------
The paper compares the generator's citations with an LLM judge that labels each shown
memory useful or not, and reports per class (percent):

    class               P      R
    Useful memory       89.4   91.1
    Not-useful memory   87.2   84.6
    overall             87.6   85.8   (F1 86.7)

Our reading: the judge is the reference, a citation is the prediction "useful", and
each row is that class's precision and recall over all shown memories. Then

    recall(Useful)     = P(cited | useful)         = 0.911  =: p_useful   (P_USEFUL)
    recall(Not-useful) = P(not cited | not useful) = 0.846
    =>                   P(cited | not useful)     = 0.154  =: p_other    (P_OTHER)

The precisions are not free: with a share ``pi`` of useful memories among those shown,

    P(useful | cited)         = pi p_useful / (pi p_useful + (1 - pi) p_other)
    P(not useful | not cited) = (1 - pi)(1 - p_other) / ((1 - pi)(1 - p_other) + pi (1 - p_useful))

and ``pi = 0.585`` (:data:`JUDGE_USEFUL_SHARE`, least squares) gives 89.3 and 87.1,
the table's 89.4 and 87.2 to within its rounding: the four class numbers are one
consistent 2x2 table, and the two recalls are all a simulator needs (it sees which
memories are useful, so the base rate is the workload's, not the paper's). The
overall row is neither the macro mean (88.3 / 87.9) nor the support-weighted mean
(88.5 / 88.4) of the class rows, so it cannot be split into per-class rates; it is
what :func:`oracle_cite`'s defaults (:data:`DEFAULT_PRECISION`,
:data:`DEFAULT_RECALL`) were set from.

**Spurious citations.** A call that shows no useful memory can still cite: every
filled slot of such a call is cited with probability ``spurious``. The table pools all
shown memories and has no row for calls without a useful one, so the only rate it
supports for them is the not-useful rate itself: ``spurious = p_other = 0.154``
(:data:`SPURIOUS`, independence across slots). With ``M = 5`` such a call cites at
least one memory with probability ``1 - 0.846^5 = 0.57``. ``spurious = 0`` is the
generator that always answers ``[NO_CITE]`` when nothing useful is shown, as
:func:`oracle_cite` does.

Per filled slot ``j`` of a call, with ``any_useful`` = some filled slot is useful:

    P(cite j) = p_useful   if j is useful
              = p_other    if j is not useful and any_useful
              = spurious   if nothing shown is useful

independently across slots (times the position factor below).

Position bias (:func:`position_oracle`)
---------------------------------------
Generators cite what they read first. The position model multiplies every rate above
by a geometric factor of the 0-based display slot ``j``:

    P(cite j) = rate_j * decay^j,       decay = 0.9 by default (:data:`POSITION_DECAY`)

so the table's rates hold at the first slot and the fifth is cited at 0.9^4 = 0.66 of
them (the mean factor over M = 5 slots is 0.82). The direction follows the primacy
effect reported for LLM readers (Liu et al., "Lost in the Middle", TACL 2024); the
value 0.9 is our choice, not a measurement. ``decay = 1`` is :func:`oracle`.

Answer support (:func:`answer_support`)
---------------------------------------
A label-free notion of "useful" that never reads gold evidence ids: the simulated
response is the dataset's reference answer, and a retrieved candidate supports it when
its embedding is close to that of the question and answer together,
``e = embed(question + " " + answer)``. With cosine similarities
``c_k = <e, m_cand[k]>`` over the K candidates of a query (embeddings L2-normalised):

    supported[k] = filled[k] and rank(c_k) < top_c and c_k >= threshold

(``rank`` 0 = most similar among the query's candidates, ties broken by retriever
order; either part can be switched off with ``None``). Defaults
:data:`ANSWER_TOP_C` = 1 and :data:`ANSWER_THRESHOLD` = 0.5: chosen by
``benchmarks/citation_agreement.py`` as the best Useful-class F1 against LoCoMo gold
evidence on conversations 26 and 30 (turn memories, MiniLM, K = 20), over
top_c 1..3 x threshold {none, 0.40 .. 0.70}; the other three conversations are the
held-out report. The generator thus cites the one candidate that best matches its
answer, and cites nothing when even that one is far from it. The rank limit is what
matters (tuning F1 0.363 with the floor, 0.360 without; top-2 at best 0.321).

It runs on the host, outside the compiled loop: compute it once per query over the
base retriever's candidates and carry it as ``Stream.cite_gold``; inside the loop a
cite function (e.g. ``oracle(p_useful=1, p_other=0, spurious=0)`` to cite exactly the
supported memories that are shown, or the calibrated defaults to add the judge's
noise) draws the citations, jittably, from it.

Precision/recall simulator (:func:`oracle_cite`)
------------------------------------------------
Targets a citation precision ``p`` and recall ``r`` instead of per-class rates (the
``--precision/--recall`` overrides; defaults from the table's overall row). For one
generator call with selection slots ``i = 1..M``, let ``v_i`` say whether slot ``i``
holds a real memory and ``g_i`` whether that memory is gold. With

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

import functools
import math
import numbers

import jax
import jax.numpy as jnp
import numpy as np

from rmm_jax.deprecated import moved
from rmm_jax.errors import InputError, named

__all__ = [
    "ANSWER_THRESHOLD",
    "ANSWER_TOP_C",
    "DEFAULT_PRECISION",
    "DEFAULT_RECALL",
    "JUDGE_TABLE",
    "JUDGE_USEFUL_SHARE",
    "P_OTHER",
    "P_USEFUL",
    "POSITION_DECAY",
    "SPURIOUS",
    "CITATION_MODELS",
    "answer_oracle",
    "answer_support",
    "check_rate",
    "citation_model",
    "class_cite",
    "false_cite_prob",
    "oracle",
    "oracle_cite",
    "position_oracle",
    "precision_recall_oracle",
]

#: Citation precision against an LLM judge measured in the RMM paper.
DEFAULT_PRECISION = 0.876
#: Citation recall against an LLM judge measured in the RMM paper.
DEFAULT_RECALL = 0.858

#: The paper's citation/judge agreement table, per class: (precision, recall).
JUDGE_TABLE = {"useful": (0.894, 0.911), "not_useful": (0.872, 0.846), "overall": (0.876, 0.858)}
#: P(cited | a useful memory is shown) = recall of the Useful class.
P_USEFUL = 0.911
#: P(cited | a not-useful memory is shown) = 1 - recall of the Not-useful class.
P_OTHER = 0.154
#: P(cited | shown) for every memory of a call that shows no useful one (= P_OTHER).
SPURIOUS = P_OTHER
#: Share of useful memories among those shown that the table's precisions imply.
JUDGE_USEFUL_SHARE = 0.585
#: Per-slot factor of the position model: slot j (0-based) is cited at decay**j of the rate.
POSITION_DECAY = 0.9
#: Answer support: a candidate must rank in the top ANSWER_TOP_C by similarity to the answer ...
ANSWER_TOP_C = 1
#: ... and reach this cosine similarity to embed(question + " " + answer).
ANSWER_THRESHOLD = 0.5


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
# Class-calibrated and position-biased simulators
# ---------------------------------------------------------------------------

def class_cite(key: jax.Array, is_gold, valid, p_useful: float = P_USEFUL, p_other: float = P_OTHER,
               spurious: float = SPURIOUS, decay: float = 1.0) -> jax.Array:
    """Simulate citations with per-class rates (see the module docstring).

    Args:
      key: a JAX PRNG key; the same key and inputs give the same citations.
      is_gold: ``(M,)`` bool, whether the memory in each slot (display order) is useful.
      valid: ``(M,)`` bool, whether the slot holds a shown memory (others are never cited).
      p_useful: P(cite | useful) in ``[0, 1]``.
      p_other: P(cite | not useful) in a call that shows a useful memory, ``[0, 1]``.
      spurious: P(cite) of every shown memory in a call that shows none useful, ``[0, 1]``.
      decay: position factor in ``(0, 1]``: slot ``j`` (0-based) is cited at ``decay**j``
        times its rate; 1 means no position bias.

    Returns:
      ``(M,)`` bool: cited slots. Extra leading axes are a batch of calls sharing one key.

    Pure and traceable; the rates must be concrete floats (bind them, e.g. with
    :func:`oracle`, or mark them static under ``jax.jit``).
    """
    p_useful = check_rate(p_useful, "p_useful", low_open=False)
    p_other = check_rate(p_other, "p_other", low_open=False)
    spurious = check_rate(spurious, "spurious", low_open=False)
    decay = check_rate(decay, "decay", low_open=True)
    is_gold, valid = _check_masks(is_gold, valid)
    useful = is_gold & valid
    any_useful = jnp.any(useful, axis=-1, keepdims=True)
    prob = jnp.where(useful, jnp.float32(p_useful),
                     jnp.where(any_useful, jnp.float32(p_other), jnp.float32(spurious)))
    if decay != 1.0:
        prob = prob * jnp.asarray(np.power(decay, np.arange(is_gold.shape[-1]), dtype=np.float64), jnp.float32)
    u = jax.random.uniform(key, is_gold.shape, dtype=jnp.float32)
    return valid & (u < prob)


def oracle(*, p_useful: float = P_USEFUL, p_other: float = P_OTHER, spurious: float = SPURIOUS):
    """The class-calibrated cite function ``cite_fn(key, is_gold, filled) -> cited``.

    Defaults: the paper's per-class judge rates (0.911, 0.154, 0.154; see the module
    docstring). Rates are checked here, before any tracing.

    Examples:
      >>> import jax, jax.numpy as jnp
      >>> from rmm_jax.data.citations import oracle
      >>> cite = oracle(p_useful=1.0, p_other=0.0, spurious=0.0)
      >>> cite(jax.random.key(0), jnp.array([False, True, False]), jnp.array([True, True, False])).tolist()
      [False, True, False]
    """
    return position_oracle(p_useful=p_useful, p_other=p_other, spurious=spurious, decay=1.0)


def position_oracle(*, p_useful: float = P_USEFUL, p_other: float = P_OTHER, spurious: float = SPURIOUS,
                    decay: float = POSITION_DECAY):
    """:func:`oracle` with a position bias: slot ``j`` (0-based, display order) is cited at
    ``decay**j`` times its class rate (default 0.9 per slot; see the module docstring)."""
    rates = {"p_useful": check_rate(p_useful, "p_useful", low_open=False),
             "p_other": check_rate(p_other, "p_other", low_open=False),
             "spurious": check_rate(spurious, "spurious", low_open=False),
             "decay": check_rate(decay, "decay", low_open=True)}
    return functools.partial(class_cite, **rates)


def answer_oracle():
    """The cite function of the ``answer`` citation model: it cites exactly the shown useful
    memories and nothing else (:func:`oracle` at rates 1, 0, 0). With a stream's ``cite_gold``
    set by :func:`answer_support` it cites the shown memories that support the reference
    answer; on gold labels it is the perfect citer (no judge noise).

    Examples:
      >>> import jax, jax.numpy as jnp
      >>> from rmm_jax.data.citations import answer_oracle
      >>> answer_oracle()(jax.random.key(0), jnp.array([False, True, True]), jnp.array([True, True, False])).tolist()
      [False, True, False]
    """
    return oracle(p_useful=1.0, p_other=0.0, spurious=0.0)


def precision_recall_oracle(precision: float = DEFAULT_PRECISION, recall: float = DEFAULT_RECALL):
    """The precision/recall oracle (:func:`oracle_cite`) with its rates bound, checked here
    before any tracing. Not the class-calibrated :func:`oracle` of ``simulate --citations
    oracle``.

    Examples:
      >>> import jax, jax.numpy as jnp
      >>> from rmm_jax.data.citations import precision_recall_oracle
      >>> cite = precision_recall_oracle(1.0, 1.0)
      >>> cite(jax.random.key(0), jnp.array([False, True, False]), jnp.array([True, True, True])).tolist()
      [False, True, False]
    """
    check_rate(precision, "precision", low_open=True)
    check_rate(recall, "recall", low_open=False)
    return functools.partial(oracle_cite, precision=precision, recall=recall)


#: The citation models :func:`citation_model` chooses among by name.
CITATION_MODELS = ("oracle", "position", "answer", "precision_recall")


def citation_model(name: str, *, precision: float | None = None, recall: float | None = None):
    """The cite function of a citation model by name (:data:`CITATION_MODELS`):

    * ``oracle``: the class-calibrated :func:`oracle` at the paper's per-class rates; given
      ``precision`` or ``recall``, the precision/recall :func:`precision_recall_oracle`
      instead (the other rate at its default), as ``simulate --precision/--recall`` do;
    * ``position``: :func:`position_oracle` (the class rates with a decay per display slot);
    * ``answer``: :func:`answer_oracle` (exactly the shown useful memories; the streams
      carry answer support as their ``cite_gold``);
    * ``precision_recall``: :func:`precision_recall_oracle`, at 0.876/0.858 unless given.

    ``precision``/``recall`` apply to ``oracle`` and ``precision_recall`` only: for another
    model they raise :class:`~rmm_jax.errors.InputError` naming ``name``.

    Examples:
      >>> from rmm_jax.data.citations import citation_model
      >>> citation_model("oracle").keywords
      {'p_useful': 0.911, 'p_other': 0.154, 'spurious': 0.154, 'decay': 1.0}
      >>> citation_model("oracle", recall=0.5).keywords
      {'precision': 0.876, 'recall': 0.5}
      >>> citation_model("answer").keywords["p_other"], citation_model("position").keywords["decay"]
      (0.0, 0.9)
      >>> citation_model("answer", precision=0.9)
      Traceback (most recent call last):
      ...
      rmm_jax.errors.InputError: name: precision/recall replace the oracle; they do not apply to 'answer'
    """
    overridden = precision is not None or recall is not None
    precision = DEFAULT_PRECISION if precision is None else precision
    recall = DEFAULT_RECALL if recall is None else recall
    if name == "precision_recall" or (name == "oracle" and overridden):
        return precision_recall_oracle(precision, recall)
    if name not in CITATION_MODELS:
        raise InputError(f"must be one of {', '.join(CITATION_MODELS)}, got {name!r}", arg="name")
    if overridden:
        raise InputError(f"{named('precision')}/{named('recall')} replace the oracle; they do not apply to {name!r}",
                         arg="name")
    if name == "oracle":
        return oracle()
    return position_oracle() if name == "position" else answer_oracle()


# ---------------------------------------------------------------------------
# Answer support (label-free; host side)
# ---------------------------------------------------------------------------

def _float_matrix(x, name: str, ndim: int) -> np.ndarray:
    a = np.asarray(x)
    if a.ndim != ndim or a.dtype.kind not in "iuf":
        raise InputError(f"must be a {ndim}-d real array, got shape {a.shape} dtype {a.dtype}",
                         where=f"argument '{name}'")
    return a.astype(np.float32, copy=False)


def answer_support(qa_emb, bank, cand, cand_mask, *, top_c: int | None = ANSWER_TOP_C,
                   threshold: float | None = ANSWER_THRESHOLD) -> np.ndarray:
    """Which candidates support the reference answer: ``(T, K)`` bool (NumPy, host side).

    Args:
      qa_emb: ``(T, d)`` embedding of each query's question and reference answer
        (``question + " " + answer``), L2-normalised like the bank.
      bank: ``(N, d)`` memory embeddings of the user.
      cand: ``(T, K)`` int indices into ``bank``, the base retriever's candidates.
      cand_mask: ``(T, K)`` bool, which candidates are real.
      top_c: a candidate must be among the ``top_c`` most similar of its query (ties
        broken by candidate order); ``None``: no rank limit.
      threshold: and its cosine similarity must be at least ``threshold``; ``None``: no
        floor. At least one of the two must be given.

    Reads no gold labels. Runs outside the compiled loop: compute it once and carry it as
    ``Stream.cite_gold``; the citation draw inside the loop stays jittable.
    """
    if top_c is None and threshold is None:
        raise InputError("give top_c, threshold or both", where="argument 'top_c'")
    if top_c is not None and (isinstance(top_c, bool) or not isinstance(top_c, numbers.Integral) or top_c < 1):
        raise InputError(f"must be a positive int or None, got {top_c!r}", where="argument 'top_c'")
    if threshold is not None and (isinstance(threshold, bool) or not isinstance(threshold, numbers.Real)
                                  or not math.isfinite(threshold)):
        raise InputError(f"must be a finite float or None, got {threshold!r}", where="argument 'threshold'")
    qa = _float_matrix(qa_emb, "qa_emb", 2)
    mem = _float_matrix(bank, "bank", 2)
    cand = np.asarray(cand)
    mask = np.asarray(cand_mask)
    if qa.shape[1] != mem.shape[1]:
        raise InputError(f"dimension {qa.shape[1]} differs from the bank's {mem.shape[1]}", where="argument 'qa_emb'")
    if cand.ndim != 2 or cand.shape[0] != qa.shape[0] or cand.dtype.kind not in "iu":
        raise InputError(f"must be an int array of shape ({qa.shape[0]}, K), got {cand.shape} {cand.dtype}",
                         where="argument 'cand'")
    if mask.shape != cand.shape:
        raise InputError(f"shape {mask.shape} differs from cand's {cand.shape}", where="argument 'cand_mask'")
    mask = mask.astype(bool)
    if mask.any() and (cand[mask].min() < 0 or cand[mask].max() >= mem.shape[0]):
        raise InputError(f"indices must be in [0, {mem.shape[0]})", where="argument 'cand'")
    idx = np.where(mask, cand, 0)
    # Multiply then sum each row the same way, so equal memories tie exactly (einsum/BLAS
    # may round the same dot product differently at different positions).
    sim = (mem[idx] * qa[:, None, :]).sum(-1)
    sim = np.where(mask, sim, -np.inf)
    out = mask.copy()
    if threshold is not None:
        out &= sim >= np.float32(threshold)
    if top_c is not None:
        order = np.argsort(-sim, axis=1, kind="stable")
        rank = np.empty_like(order)
        np.put_along_axis(rank, order, np.arange(sim.shape[1])[None, :], axis=1)
        out &= rank < top_c
    return out


# moved to rmm_jax.data.prompt (the real generator's side); the old path warns
__getattr__ = moved(__name__, dict.fromkeys(("NO_CITE", "RMM_PROMPT_TEMPLATE", "format_prompt", "parse_citations"),
                                            "rmm_jax.data.prompt"))
