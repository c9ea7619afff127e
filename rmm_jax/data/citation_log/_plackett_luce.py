"""The Plackett–Luce log-probability of a logged selection, in float64 without JAX, and how
far a float32 logger's may lie from it: what a record's ``logits`` and ``log_prob`` must agree to."""
from __future__ import annotations

import math


def pl_tolerance(logits, m: int, log_prob: float) -> float:
    """How far a producer's float32 Plackett–Luce log-probability of ``m`` draws may lie from
    :func:`pl_log_prob` of the same ``logits``. Each of the m terms z_i − logsumexp rounds
    the logits and the running maximum (|z| ≤ Z, error ≤ Z·2⁻²⁴ each) and sums at most K
    exponentials (≤ K·2⁻²⁴ in the log), so the sum errs by at most m·(2Z + K + 2)·2⁻²⁴; the
    bound takes 4 times that, for other orders of the same sums. Where that is small (the
    logits of a policy at τ ≳ 1e-3), the floor max(1e-3, 1e-4·|log P|) decides, as always.

    >>> from rmm_jax.data.citation_log import pl_tolerance
    >>> pl_tolerance([0.5, -1.0, 2.0], 2, -1.2)
    0.001
    >>> round(pl_tolerance([1.4e5, 1.3e5, 0.0], 2, -3.0), 3)       # rerank --explore --tau 1e-5
    0.134
    """
    z = max((abs(float(x)) for x in logits), default=0.0)
    return max(1e-3, 1e-4 * abs(log_prob), 4 * m * (2 * z + len(logits) + 2) * 2.0**-24)


def pl_log_prob(logits, order) -> float:
    """Exact Plackett–Luce log-probability of drawing ``order`` (positions into
    ``logits``) in that order without replacement, in float64:

        log P = Σ_j [z_{i_j} − logsumexp_{k not drawn before j} z_k]

    (Plackett 1975; Luce 1959). The NumPy twin of
    :func:`rmm_jax.core.sampling.selection_log_prob` with τ = 1, for validating records
    without tracing a JAX function per record shape.

    >>> import math
    >>> from rmm_jax.data.citation_log import pl_log_prob
    >>> round(pl_log_prob([0.0, math.log(2.0), 0.0], [1, 0]), 6) == round(math.log(0.25), 6)
    True
    """
    z = [float(x) for x in logits]
    left = list(range(len(z)))
    total = 0.0
    for i in order:
        top = max(z[k] for k in left)
        total += z[i] - (top + math.log(sum(math.exp(z[k] - top) for k in left)))
        left.remove(i)
    return total
