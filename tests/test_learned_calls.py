"""What a policy remembers of the calls it learned from (rmm_jax.persist.learned_calls):
sorting and remembering equal a brute-force model that keeps every call ever learned, the
record stays the same size however many calls are learned, a call older than the window
is skipped only when it is at or before the horizon, and the record is saved in the
user's row and read back with the state, also beside rows written before it existed."""
from __future__ import annotations

import math

import jax
import numpy as np
import pytest

from rmm_jax.core.types import UserState
from rmm_jax.persist import learned_calls as lc
from rmm_jax.persist.policy_store import PolicyStore

W = 4


def brute(history: list, calls: list, relearn: bool) -> dict:
    """Flags of ``calls`` from every call ever learned (``history``), by the module's rules."""
    window, gone = history[-W:], history[:-W]
    horizon = max((t for _, _, t in gone if not math.isnan(t)), default=-math.inf)
    newest = {k: d for k, d, _ in window}
    out = {"known": [], "changed": [], "older": [], "learn": []}
    for k, d, t in calls:
        known, changed = k in newest and newest[k] == d, k in newest and newest[k] != d
        older = k not in newest and len(history) > W and t <= horizon
        for name, v in zip(out, (known, changed, older, relearn or not (known or changed or older))):
            out[name].append(v)
    return out


def as_calls(rows: list) -> lc.Calls:
    return lc.Calls(np.array([k for k, _, _ in rows], np.uint64), np.array([d for _, d, _ in rows], np.uint64),
                    np.array([t for _, _, t in rows], np.float64))


def test_sorting_and_remembering_equal_a_model_that_keeps_every_call():
    rng = np.random.default_rng(0)
    learned, history, saw = lc.empty(window=W), [], {"known": 0, "changed": 0, "older": 0}
    for _ in range(300):
        calls = [(int(rng.integers(8)), int(rng.integers(2)),
                  math.nan if rng.random() < 0.2 else float(rng.integers(20))) for _ in range(rng.integers(0, 5))]
        relearn = bool(rng.random() < 0.2)
        got = lc.classify(learned, as_calls(calls), relearn=relearn)
        want = brute(history, calls, relearn)
        assert {k: getattr(got, k).tolist() for k in want} == want
        for k in saw:
            saw[k] += sum(want[k])
        kept = [c for c, ok in zip(calls, want["learn"]) if ok]
        learned = lc.add(learned, as_calls(kept))
        history += kept
        assert int(learned.count) == len(history) and learned.keys.shape == (W,)   # bounded
    assert min(saw.values()) > 10           # every case came up


def test_a_call_older_than_the_window_is_skipped_only_at_or_before_the_horizon():
    learned = lc.add(lc.empty(window=2), as_calls([(1, 1, 10.0), (2, 1, 20.0), (3, 1, 30.0), (4, 1, math.nan)]))
    assert float(learned.horizon) == 20.0            # calls 1 and 2 left the window
    sort = lc.classify(learned, as_calls([(1, 1, 10.0), (5, 1, 20.0), (6, 1, 21.0), (7, 1, math.nan), (3, 1, 30.0),
                                          (4, 2, math.nan)]))
    assert sort.older.tolist() == [True, True, False, False, False, False]
    assert sort.learn.tolist() == [False, False, True, True, False, False]
    assert sort.changed.tolist() == [False] * 5 + [True]


def test_the_record_is_saved_in_the_users_row_and_read_back_with_the_state(tmp_path):
    ps = PolicyStore.create(tmp_path / "p", {"kind": "linear", "dim": 3, "hidden": None}, {"w": np.zeros(3)})
    state = UserState({"w": np.arange(6.0).reshape(2, 3)}, {}, {})
    mine = [lc.add(lc.empty(), as_calls([(i + 1, 7, float(i))])) for i in range(2)]
    stacked = jax.tree.map(lambda *xs: np.stack(xs), *mine)
    ps.save(["a", "b"], state, learned=stacked)
    ps.save(["c"], UserState({"w": np.ones((1, 3))}, {}, {}))          # saved without: learned from no call
    got = PolicyStore.open(tmp_path / "p").load_batch(["b", "c", "a"])
    assert got.learned.count.tolist() == [1, 0, 1]
    for i, j in ((0, 1), (2, 0)):
        for x, y in zip(jax.tree.leaves(got.learned), jax.tree.leaves(stacked)):
            np.testing.assert_array_equal(x[i], y[j])
    one = PolicyStore.open(tmp_path / "p").load("a")
    assert int(one.learned.count) == 1 and one.learned.keys[0] == 1


@pytest.mark.parametrize("text", ["call:c1", "query:q7", "text:where is it?"])
def test_hash64_is_sha256s_first_eight_bytes(text):
    import hashlib
    assert int(lc.hash64(text)) == int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "little")


def test_a_time_in_the_future_never_becomes_the_horizon():
    """A call learned with epoch milliseconds as its seconds (before logs refused times after
    now) left the window and became the horizon: every later call of the user was 'older
    than what it has learned' and skipped, every night. Such a time never becomes the
    horizon, and a horizon saved from one is not used; a true horizon still works."""
    ms = 1_688_976_000_000.0                          # 2023-07-10 in milliseconds: year ~55,000 as seconds
    learned = lc.add(lc.empty(window=2), as_calls([(1, 1, ms), (2, 1, 20.0), (3, 1, 30.0)]))
    assert float(learned.horizon) == -math.inf        # the call from the future left the window: no horizon
    saved = learned._replace(horizon=np.array(ms))    # a store an older rmm-jax wrote
    day2 = as_calls([(8, 1, 1.7e9), (9, 1, 1.7e9 + 60)])
    assert lc.classify(saved, day2).learn.tolist() == [True, True]
    assert float(lc.add(saved, day2).horizon) == 30.0  # the saved one dropped; 3 left the window, then 8
    true = lc.add(lc.empty(window=2), as_calls([(1, 1, 10.0), (2, 1, 20.0), (3, 1, 30.0)]))
    assert lc.classify(true, as_calls([(4, 1, 5.0), (5, 1, 15.0)])).older.tolist() == [True, False]   # horizon 10
