"""Off-policy evaluation (rmm_jax.online.ope, ``rmm-jax evaluate``).

* PL quantities against brute-force enumeration of every ordered selection: prefix
  probabilities (RIPS), per-slot marginals (IIPS; exact and Monte Carlo) and shown-set
  probabilities.
* Unbiasedness on tiny enumerable cases: the exact expectation, over every selection the
  behaviour PL policy can draw, of IPS / RIPS / IIPS equals the target's true value under
  the reward structure each assumes, and differs where the assumption fails.
* IPS, SNIPS, RIPS and IIPS against the Open Bandit Pipeline (``obp``) on the same inputs,
  and against a direct NumPy transcription of the formulas (kept when obp is absent).
* ``rmm-jax evaluate`` end to end on a fake store: JSON shape, on-policy sanity
  (target = logging policy gives weights 1), --users, --clip, missing logits, bad records.
* Reliability: overflowing weights, impossible log_probs, low ESS, out-of-range values
  and intervals are reported as unreliable (no number, a reason, exit 3, strict JSON, one
  warning line, no NumPy warning), and a correct on-policy log is not (no false alarm);
  ``--plot``.
"""
from __future__ import annotations

import builtins
import dataclasses
import itertools
import json
import math
import os
import re
import warnings

import jax
import numpy as np
import pytest
from conftest import make_fake_store, run_cli
from helpers import assert_f32_close, f32_error

from rmm_jax.core.reranker import init_reranker, score
from rmm_jax.core.sampling import selection_log_probs
from rmm_jax.data.citation_log import pl_log_prob
from rmm_jax.data.store import open_store
from rmm_jax.online.ope import (
    Target,
    call_problems,
    estimate,
    estimator_weights,
    evaluate_calls,
    evaluate_log,
    learned_calls,
    load_calls,
    prefix_log_probs,
    report_entry,
    shown_set_probs,
    slot_marginals,
    slot_marginals_exact,
    slot_marginals_mc,
    subset_count,
    verdict,
)
from rmm_jax.online.streams import stream_from_user
from rmm_jax.persist.policy_store import PolicyStore


# --------------------------------------------------------------------------- brute force
def selections(z, mask, m):
    """Every ordered selection of min(m, #valid) candidates with its PL probability."""
    valid = [i for i in range(len(z)) if mask[i]]
    w = np.exp(np.asarray(z, np.float64))
    for perm in itertools.permutations(valid, min(m, len(valid))):
        p, left = 1.0, list(valid)
        for a in perm:
            p *= w[a] / sum(w[k] for k in left)
            left.remove(a)
        yield perm, p


def brute_marginals(z, mask, m):
    out = np.zeros((m, len(z)))
    for perm, p in selections(z, mask, m):
        for j, a in enumerate(perm):
            out[j, a] += p
    return out


CASES = [(4, 1), (4, 2), (5, 3), (6, 3), (6, 4), (7, 2)]


def random_case(k, seed, masked=0):
    rng = np.random.default_rng(seed)
    z = rng.normal(size=k) * 1.5
    mask = np.ones(k, bool)
    if masked:
        mask[rng.choice(k, masked, replace=False)] = False
    return z, mask


@pytest.mark.parametrize("k,m", CASES)
@pytest.mark.parametrize("masked", [0, 1, 3])
def test_slot_marginals_exact_equal_enumeration(k, m, masked):
    z, mask = random_case(k, 10 * k + m + masked, masked)
    got = slot_marginals_exact(z[None], mask[None], m)[0]
    np.testing.assert_allclose(got, brute_marginals(z, mask, m), atol=1e-12)       # float64 on both sides
    assert np.all(got[:, ~mask] == 0)


def test_slot_marginals_exact_in_blocks_of_calls_equal_enumeration_per_call():
    """Calls run ``block`` at a time (a level's arrays grow with calls × sets): every call of
    a batch that spans several blocks, masks differing per call, matches its brute force."""
    cases = [random_case(6, seed, seed % 3) for seed in range(7)]
    z, mask = np.stack([c[0] for c in cases]), np.stack([c[1] for c in cases])
    got = slot_marginals_exact(z, mask, 3, block=3)
    for i, (zi, mi) in enumerate(cases):
        np.testing.assert_allclose(got[i], brute_marginals(zi, mi, 3), atol=1e-12)


def test_slot_marginals_monte_carlo_close_and_labelled():
    z, mask = random_case(7, 3, 1)
    exact = brute_marginals(z, mask, 3)
    mc = slot_marginals_mc(z[None], mask[None], 3, samples=20000, seed=1)[0]
    assert np.abs(mc - exact).max() < 0.01              # Monte Carlo (20,000 samples, Rao-Blackwellised)
    assert np.all(mc[:, mask] > 0)  # Rao-Blackwellised: never 0 for a candidate still available
    _, info = slot_marginals(z[None], mask[None], 3)
    assert info == {"method": "exact", "subsets": subset_count(7, 3)} and subset_count(7, 3) == 1 + 7 + 21
    got, info = slot_marginals(z[None], mask[None], 3, exact_limit=10, samples=20000)
    assert info["method"] == "monte_carlo" and info["samples"] == 20000
    assert np.abs(got[0] - exact).max() < 0.01


@pytest.mark.parametrize("k,m", [(4, 2), (5, 3), (6, 2)])
def test_shown_set_probs_equal_enumeration(k, m):
    z, mask = random_case(k, k + m, 0)
    members, probs = shown_set_probs(z[None], mask[None], m)
    want = {}
    for perm, p in selections(z, mask, m):
        want[frozenset(perm)] = want.get(frozenset(perm), 0.0) + p
    got = {frozenset(np.flatnonzero(members[c]).tolist()): probs[0, c] for c in range(len(members))}
    assert set(got) == set(want)
    for s, p in want.items():
        assert got[s] == pytest.approx(p, abs=1e-12)                        # float64 on both sides


@pytest.mark.parametrize("k,m", [(4, 2), (5, 3), (6, 4)])
def test_prefix_probabilities_equal_enumeration(k, m):
    """RIPS's prefix probability P(a_1..a_j): the closed form (cumulated per-draw PL
    log-probs) equals the total probability of every full selection with that prefix."""
    z, mask = random_case(k, 7 * k + m, 1)
    sels = list(selections(z, mask, m))
    for perm, _ in sels[:: max(1, len(sels) // 12)]:
        got = np.exp(prefix_log_probs(z[None], np.asarray(perm)[None], mask[None])[0])
        b = log_prefix_bound(z, perm, mask)             # prefix_log_probs runs in float32
        for j in range(len(perm)):
            want = sum(p for other, p in sels if other[:j + 1] == perm[:j + 1])
            assert_f32_close(got[j], want, want * np.expm1(b[j]))
        assert_f32_close(math.log(got[-1]), pl_log_prob(np.where(mask, z, -np.inf), list(perm)), b[-1])


# --------------------------------------------------------------------------- unbiasedness
K, M = 4, 2


def log_prefix_bound(z, perm, mask) -> np.ndarray:
    """A bound on |prefix_log_probs(z) − the exact log prefix probabilities of the float64 ``z``|:
    prefix_log_probs rounds the logits to float32 (a draw's log-probability moves by at most twice
    the largest logit change) and evaluates in float32 (f32_error); both cumulate over the draws."""
    z32 = np.asarray(z, np.float32)
    rounding = 2 * np.abs(z32.astype(np.float64) - np.asarray(z, np.float64)).max()
    per_draw = f32_error(lambda x: selection_log_probs(x, np.asarray(perm, np.int32), 1.0, mask=np.asarray(mask)),
                         z32)
    return np.cumsum(per_draw + rounding)


def contributions(zb, zt, perm, rewards):
    """One logged call's estimate by each estimator (n = 1, no bootstrap), and a bound on each
    estimate's relative error: its weights are exp of differences of float32 log prefix
    probabilities (IPS the whole selection's, RIPS each prefix's; IIPS's marginals are float64)."""
    sel = np.asarray(perm)[None]
    mask = np.ones((1, K), bool)
    pb, pt = prefix_log_probs(zb[None], sel, mask), prefix_log_probs(zt[None], sel, mask)
    mb, mt = slot_marginals_exact(zb[None], mask, M), slot_marginals_exact(zt[None], mask, M)
    ratio = np.array([[mt[0, j, a] / mb[0, j, a] for j, a in enumerate(perm)]])
    kw = {"log_ratio": pt[:, -1] - pb[:, -1], "prefix_log_ratio": pt - pb, "marginal_ratio": ratio}
    r = np.asarray(rewards, np.float64)[None]
    drift = log_prefix_bound(zb, perm, mask[0]) + log_prefix_bound(zt, perm, mask[0])
    rel = {"ips": np.expm1(drift[-1]), "rips": np.expm1(drift.max()), "iips": 1e-12}
    return {name: (estimate(name, estimator_weights(name, **kw), r, bootstrap=0)["value"], rel[name])
            for name in ("ips", "rips", "iips")}


def expectations(reward_fn, seed):
    """(E_μ[estimate] per estimator, V(π), a bound on each expectation's float error) over every
    selection of 3 contexts. Rewards are ≥ 0, so an estimate off by a relative δ is off by δ·v."""
    rng = np.random.default_rng(seed)
    exp, bound = {"ips": 0.0, "rips": 0.0, "iips": 0.0}, {"ips": 0.0, "rips": 0.0, "iips": 0.0}
    truth = 0.0
    for c in range(3):
        zb, zt = rng.normal(size=K), rng.normal(size=K) * 2
        table = rng.uniform(size=(K + 1,) * M + (M,))  # rewards by (a_1, a_2) and slot
        mask = np.ones(K, bool)
        for perm, p in selections(zt, mask, M):
            truth += p * sum(reward_fn(table, perm)) / 3
        for perm, p in selections(zb, mask, M):
            for name, (v, rel) in contributions(zb, zt, perm, reward_fn(table, perm)).items():
                exp[name] += p * v / 3
                bound[name] += p * abs(v) * rel / 3
    return exp, truth, bound


SLATE = lambda t, perm: [t[perm[0], perm[1], j] for j in range(M)]           # noqa: E731 any slot depends on all
CASCADE = lambda t, perm: [t[perm[0], K, 0], t[perm[0], perm[1], 1]]         # noqa: E731 slot j: prefix 1..j
ITEM = lambda t, perm: [t[perm[0], K, 0], t[K, perm[1], 1]]                  # noqa: E731 slot j: its item


@pytest.mark.parametrize("seed", [0, 1])
def test_ips_unbiased_for_any_reward(seed):
    exp, truth, bound = expectations(SLATE, seed)
    assert_f32_close(exp["ips"], truth, bound["ips"])
    assert abs(exp["rips"] - truth) > 1e-3 and abs(exp["iips"] - truth) > 1e-3  # their assumptions fail


@pytest.mark.parametrize("seed", [0, 1])
def test_rips_unbiased_for_cascade_rewards(seed):
    exp, truth, bound = expectations(CASCADE, seed)
    assert_f32_close(exp["rips"], truth, bound["rips"])
    assert_f32_close(exp["ips"], truth, bound["ips"])
    assert abs(exp["iips"] - truth) > 1e-3


@pytest.mark.parametrize("seed", [0, 1])
def test_iips_unbiased_for_item_position_rewards(seed):
    exp, truth, bound = expectations(ITEM, seed)
    for name in ("ips", "rips", "iips"):
        assert_f32_close(exp[name], truth, bound[name], err_msg=name)


# --------------------------------------------------------------------------- formulas and obp
def logged_data(seed, n=300, k=8, m=3):
    """Calls logged by a PL behaviour: (weights kwargs, rewards (n, m), marginals, prefix probs)."""
    rng = np.random.default_rng(seed)
    zb, zt = rng.normal(size=(n, k)), rng.normal(size=(n, k)) * 1.5
    mask = np.ones((n, k), bool)
    sel = np.argsort(-(zb + rng.gumbel(size=(n, k))), axis=1)[:, :m]
    pb, pt = prefix_log_probs(zb, sel, mask), prefix_log_probs(zt, sel, mask)
    mb, mt = slot_marginals_exact(zb, mask, m), slot_marginals_exact(zt, mask, m)
    idx = sel[:, :, None]
    marg_b, marg_t = np.take_along_axis(mb, idx, 2)[:, :, 0], np.take_along_axis(mt, idx, 2)[:, :, 0]
    rewards = (rng.uniform(size=(n, m)) < 0.3).astype(np.float64)
    kw = {"log_ratio": pt[:, -1] - pb[:, -1], "prefix_log_ratio": pt - pb, "marginal_ratio": marg_t / marg_b}
    return kw, rewards, (np.exp(pb), np.exp(pt)), (marg_b, marg_t)


def value(name, kw, rewards, **opts):
    return estimate(name, estimator_weights(name, **kw), rewards, bootstrap=0, **opts)["value"]


def test_estimators_match_a_numpy_transcription():
    """float64 on both sides (here and against obp): rel 1e-9 leaves room for summation order."""
    kw, r, (pb, pt), (mb, mt) = logged_data(0)
    w = pt[:, -1] / pb[:, -1]
    R = r.sum(1)
    assert value("ips", kw, r) == pytest.approx(np.mean(w * R), rel=1e-9)
    assert value("snips", kw, r) == pytest.approx(np.sum(w * R) / np.sum(w), rel=1e-9)
    assert value("rips", kw, r) == pytest.approx(np.mean(np.sum(pt / pb * r, 1)), rel=1e-9)
    wp = pt / pb
    assert value("snrips", kw, r) == pytest.approx(np.sum(np.sum(wp * r, 0) / np.sum(wp, 0)), rel=1e-9)
    assert value("iips", kw, r) == pytest.approx(np.mean(np.sum(mt / mb * r, 1)), rel=1e-9)
    # clipping caps each weight
    assert value("ips", kw, r, clip=2.0) == pytest.approx(np.mean(np.minimum(w, 2.0) * R), rel=1e-9)


def test_estimators_match_obp():
    obp_ope = pytest.importorskip("obp.ope")
    kw, r, (pb, pt), (mb, mt) = logged_data(1)
    n, m = r.shape
    R = r.sum(1)
    # IPS / SNIPS: obp's one-slot estimators with the slate as one action of probability pscore
    action_dist = np.zeros((n, 2, 1))
    action_dist[:, 0, 0] = np.minimum(pt[:, -1], 1.0)
    action_dist[:, 1, 0] = 1 - action_dist[:, 0, 0]
    common = dict(reward=R, action=np.zeros(n, int), position=np.zeros(n, int), pscore=pb[:, -1],
                  action_dist=action_dist)
    assert value("ips", kw, r) == pytest.approx(
        obp_ope.InverseProbabilityWeighting().estimate_policy_value(**common), rel=1e-9)
    assert value("snips", kw, r) == pytest.approx(
        obp_ope.SelfNormalizedInverseProbabilityWeighting().estimate_policy_value(**common), rel=1e-9)
    # slate estimators: one row per (call, slot)
    slate = dict(slate_id=np.repeat(np.arange(n), m), reward=r.ravel(), position=np.tile(np.arange(m), n))
    assert value("ips", kw, r) == pytest.approx(obp_ope.SlateStandardIPS(len_list=m).estimate_policy_value(
        **slate, pscore=np.repeat(pb[:, -1], m), evaluation_policy_pscore=np.repeat(pt[:, -1], m)), rel=1e-9)
    assert value("rips", kw, r) == pytest.approx(obp_ope.SlateRewardInteractionIPS(len_list=m).estimate_policy_value(
        **slate, pscore_cascade=pb.ravel(), evaluation_policy_pscore_cascade=pt.ravel()), rel=1e-9)
    assert value("iips", kw, r) == pytest.approx(obp_ope.SlateIndependentIPS(len_list=m).estimate_policy_value(
        **slate, pscore_item_position=mb.ravel(), evaluation_policy_pscore_item_position=mt.ravel()), rel=1e-9)


def test_bootstrap_interval_ess_and_clip_counts():
    kw, r, (pb, pt), _ = logged_data(2)
    w = pt[:, -1] / pb[:, -1]
    res = estimate("ips", estimator_weights("ips", **kw), r, bootstrap=500, seed=0)
    lo, hi = res["ci95"]
    assert lo < res["value"] < hi and res["se"] > 0 and res["n"] == r.shape[0]
    assert res["ess"] == pytest.approx(w.sum() ** 2 / (w ** 2).sum(), rel=1e-9)
    again = estimate("ips", estimator_weights("ips", **kw), r, bootstrap=500, seed=0)
    assert again == res  # seeded
    res = estimate("ips", estimator_weights("ips", **kw), r, bootstrap=10, clip=1.5)
    assert res["clipped"] == int((w > 1.5).sum()) > 0
    # the interval of a wider spread is wider: the bootstrap sees the data
    narrow = estimate("ips", np.ones_like(r), r, bootstrap=500)
    wide = estimate("ips", np.ones_like(r), r * 5, bootstrap=500)
    assert wide["ci95"][1] - wide["ci95"][0] == pytest.approx(5 * (narrow["ci95"][1] - narrow["ci95"][0]), rel=1e-9)


# --------------------------------------------------------------------------- rmm-jax evaluate
TAU, KK, MM = 0.1, 6, 2


def drawn_records(st, rng, logits, cited) -> list[dict]:
    """A log record per question of ``st``'s users: MM of its KK candidates drawn by Gumbel
    top-MM at ``logits(user, t, cand)`` (float64, one per candidate), with those logits and the
    draw's log_prob; it cites ``cited(user, t, shown)`` (memory rows, after the draw's noise)."""
    records = []
    for uid in st.user_ids:
        u = st.user(uid)
        s = stream_from_user(u, KK)
        for t, qid in enumerate(u.query_ids):
            cand = [int(j) for j, ok in zip(s.cand[t], s.cand_mask[t]) if ok]
            z = logits(u, t, cand)
            order = [int(p) for p in np.argsort(-(z + rng.gumbel(size=len(z))))[:MM]]
            shown = [cand[p] for p in order]
            records.append({"user_id": uid, "query_id": qid, "candidates": [u.memory_ids[j] for j in cand],
                            "selected": [u.memory_ids[j] for j in shown],
                            "cited": [u.memory_ids[j] for j in cited(u, t, shown)],
                            "logits": [float(x) for x in z], "log_prob": pl_log_prob(z, order)})
    return records


@pytest.fixture(scope="module")
def ope_env(tmp_path_factory):
    """A fake store, an identity policy store, and a log drawn by the identity reranker at TAU
    (logits and log_prob on every record)."""
    root = tmp_path_factory.mktemp("ope")
    store = make_fake_store(root / "store", users=4, sessions=4, turns=8, dim=16)   # 48 calls: ESS 48 on policy
    st = open_store(store)
    pol = root / "pol"
    PolicyStore.create(pol, {"kind": "linear", "dim": 16, "hidden": None,
                             "config": {"pretrained": False, "model": st.model}}, init_reranker(jax.random.key(0), 16))
    rng = np.random.default_rng(0)
    records = drawn_records(st, rng, lambda u, t, cand: (u.memory_emb[cand] @ u.query_emb[t]) / TAU,
                            lambda u, t, shown: [j for j in shown if u.gold[t][j] or rng.uniform() < 0.1])
    log = root / "log.jsonl"
    log.write_text("".join(json.dumps(r) + "\n" for r in records))
    return {"root": root, "store": store, "pol": pol, "log": log, "records": records, "users": st.user_ids}


def strict_json(text: str):
    """``json.loads`` that refuses NaN, Infinity and -Infinity."""
    def refuse(name):
        raise AssertionError(f"non-standard JSON constant {name} in the output")
    return json.loads(text, parse_constant=refuse)


def logit_drift(env) -> float:
    """A bound δ on |log π(selection)| − the logged one for the identity target at TAU: the log's
    logits are NumPy's float32 (m·q)/τ, evaluate's are rmm-jax's float32 score/τ (f32_error each,
    the same bound for both), and a Plackett–Luce log-probability of M draws moves by at most
    2·M·max|Δz|. Importance weights are then within e^{±δ} of 1."""
    st = open_store(env["store"])
    p = init_reranker(jax.random.key(0), 16)
    worst = 0.0
    for uid in st.user_ids:
        u = st.user(uid)
        s = stream_from_user(u, KK)
        for t in range(len(u.query_ids)):
            m = np.asarray(u.memory_emb[[int(j) for j, ok in zip(s.cand[t], s.cand_mask[t]) if ok]])
            e = f32_error(lambda p, q, m: score(p, q, m) / TAU, p, np.asarray(u.query_emb[t]), m)
            worst = max(worst, 2 * float(e.max()))
    return 2 * MM * worst


def evaluate(capsys, env, *args, log=None):
    return run_cli(capsys, "evaluate", env["store"], "--log", log or env["log"], "--policies", env["pol"],
                   "--k", KK, "--m", MM, "--bootstrap", 200, *args)


@pytest.mark.parametrize("text", ["", "\n\n"], ids=["0 bytes", "blank lines"])
def test_evaluate_on_an_empty_log_has_no_calls_to_judge(capsys, ope_env, tmp_path, text):
    """A day without calls was "no records (the file is empty)", exit 2: no calls to judge,
    verdict none, exit 0; --json has the report's keys, 0 calls, no estimate, no ship."""
    empty = tmp_path / "quiet.jsonl"
    empty.write_text(text)
    code, out, err = evaluate(capsys, ope_env, "--json", log=empty)
    assert code == 0 and "verdict: none (" in err and "has no calls to judge: the file is empty" in err, err
    doc = strict_json(out)
    full = strict_json(evaluate(capsys, ope_env, "--json", "--allow-unreliable")[1])
    assert doc.keys() == full.keys() and doc["verdict"].keys() == full["verdict"].keys()
    assert (doc["calls"], doc["estimates"], doc["unreliable"]) == (0, {}, [])
    assert doc["verdict"]["ship"] is False and doc["verdict"]["self_served"] is False
    assert "has no calls to judge" in doc["verdict"]["reason"]
    code, out, err = evaluate(capsys, ope_env, log=empty)
    assert code == 0, err
    assert out.strip() == f"verdict: none ({empty} has no calls to judge: the file is empty)"


def test_evaluate_on_an_empty_log_checks_its_options(capsys, ope_env, tmp_path):
    """An empty log skipped the option checks a log with calls gets: `--k 3 --m 5` (m > k)
    or `--k 0` exited 0 with "verdict: none", hiding a nightly job's bad options until a
    day with calls. Now the one line naming the option, exit 2, nothing on stdout."""
    empty = tmp_path / "quiet.jsonl"
    empty.write_text("")
    for extra, line in ((("--k", 3, "--m", 5), "error: --m: must be an int in [1, k=3], got 5"),
                        (("--k", 0), "error: --k: must be an int >= 1, got 0")):
        code, out, err = evaluate(capsys, ope_env, *extra, "--json", log=empty)
        assert (code, out, err.strip()) == (2, "", line), err
    code, out, err = evaluate(capsys, ope_env, "--m", 30, "--k", 40, log=empty)
    assert code == 0 and out.startswith("verdict: none ("), err


def test_evaluate_clip_inf_is_no_clipping_as_replay_takes_it(capsys, ope_env):
    """replay's --clip inf means no ceiling; evaluate refused it ("must be a finite number >= 1"):
    it is the report of no --clip, number for number."""
    code, out, err = evaluate(capsys, ope_env, "--tau", TAU, "--json", "--bootstrap", 40)
    code_inf, out_inf, err_inf = evaluate(capsys, ope_env, "--tau", TAU, "--json", "--bootstrap", 40, "--clip", "inf")
    assert (code, err) == (code_inf, err_inf) and strict_json(out_inf)["clip"] is None
    assert strict_json(out_inf) == strict_json(out)
    for bad in ("nan", "0.5", "-inf"):
        code, out, err = evaluate(capsys, ope_env, "--tau", TAU, "--clip", bad)
        assert (code, err) == (2, f"error: --clip: must be >= 1 (inf: no clipping), got {float(bad)}\n"), err


def test_evaluate_says_when_direct_comes_from_monte_carlo_marginals(capsys, ope_env):
    """The report's footnote called `direct` the target's exact expected Recall@M also where the
    slot marginals were Monte Carlo (--exact-limit below their count); it says which now."""
    code, out, err = evaluate(capsys, ope_env, "--tau", TAU, "--allow-unreliable")
    assert code == 0 and "direct: the target's exact expected Recall@M from the gold labels)" in out, err
    code, out, err = evaluate(capsys, ope_env, "--tau", TAU, "--allow-unreliable", "--exact-limit", 1,
                              "--mc-samples", 64)
    assert code == 0 and "direct: the target's expected Recall@M from the gold labels, over Monte Carlo slot " \
                         "marginals (--mc-samples;" in out, err


def test_evaluate_on_policy_weights_are_one(capsys, ope_env):
    """Target = the logging policy (identity reranker, same τ): every importance weight is 1,
    so every estimator returns the logged mean and the ESS is the number of calls. No false
    alarm: every estimate is reliable, nothing is printed on stderr, exit 0."""
    code, out, err = evaluate(capsys, ope_env, "--tau", TAU, "--json")
    assert code == 0 and err == "", err
    rep = strict_json(out)
    n = len(ope_env["records"])
    assert n >= 30 and rep["calls"] == n and rep["users"] == 4 and rep["marginals"]["method"] == "exact"
    assert rep["estimators"] == ["ips", "snips", "rips", "snrips", "iips"]
    assert set(rep["estimates"]) == {"cited", "cite_rate", "recall"} and rep["unreliable"] == []
    cited = rep["estimates"]["cited"]
    mean_cited = np.mean([len(r["cited"]) for r in ope_env["records"]])
    assert cited["logged"]["value"] == pytest.approx(mean_cited)            # float64 means of the same counts
    # weights within e^{±δ} of 1 (logit_drift): a ratio of weighted sums moves by at most e^{2δ} − 1,
    # the ESS (Σw)²/Σw² by e^{4δ} − 1
    delta = logit_drift(ope_env)
    assert delta < 1e-3                                                      # and a bug moves them by far more
    for name in rep["estimators"]:
        assert cited[name]["reliable"] and "reason" not in cited[name]
        assert cited[name]["value"] == pytest.approx(mean_cited, rel=np.expm1(2 * delta)), name
        assert cited[name]["ess"] == pytest.approx(n, rel=np.expm1(4 * delta))
        assert cited[name]["weight_mean"] == pytest.approx(1.0, abs=np.expm1(delta))
        lo, hi = cited[name]["ci95"]
        assert lo <= cited[name]["value"] <= hi
    assert "direct" in rep["estimates"]["recall"]
    code, out, err = evaluate(capsys, ope_env, "--tau", TAU)
    assert code == 0 and err == "" and "unreliable" not in out and "nan" not in out.lower()


def test_a_log_the_target_served_itself_gets_no_verdict_and_no_rollback(capsys, ope_env, tmp_path, monkeypatch):
    """Every call logged with the versions the target loads (rerank writes policy_version and
    shared_version; null for a user without its own policy): every weight is 1 and every gain
    0 by construction, so no ship and no 'do not ship' with its rollback hint (before: 'do not
    ship (... [-5.1e-08, +4.4e-08] contains 0)' and a hint whose rollback removes every user's
    policy). Some calls so served: a note counts them and the estimate stands. A record
    without the keys, or with other versions, never counts by version: the target here is at
    another temperature than the log's, so its probabilities do not agree with the logged ones
    either (the float32 check: test_an_own_log_without_versions_agrees_to_float32_rounding)."""
    import rmm_jax.cli.evaluate as cli_evaluate
    monkeypatch.setattr(cli_evaluate, "rollback_hint", lambda ps, policies: "HINT: roll back")
    from rmm_jax.online.serve import load_policy
    got = load_policy(PolicyStore.open(ope_env["pol"]), ope_env["users"][0])   # no policy of its own: shared v1
    assert (got.version, got.shared_version) == (None, 1)
    recs = ope_env["records"]
    served = {"policy_version": None, "shared_version": 1}
    for name, rows, n_served in [("all", [{**r, **served} for r in recs], len(recs)),
                                 ("some", [{**r, **served} if i % 4 == 0 else r for i, r in enumerate(recs)],
                                  len(recs[::4])),
                                 ("other", [{**r, "policy_version": None, "shared_version": 2}
                                            for r in recs], 0),
                                 ("none", recs, 0)]:
        log = tmp_path / f"{name}.jsonl"
        log.write_text("".join(json.dumps(r) + "\n" for r in rows))
        code, out, err = evaluate(capsys, ope_env, "--tau", 0.08, "--json", log=log)
        assert code == 0, err
        rep = strict_json(out)
        v = rep["verdict"]
        assert v["served_by_target"] == n_served and v["self_served"] == (n_served == len(recs)), name
        assert "HINT" not in err
        note = [x for x in rep["notes"] if "POLICIES served" in x]
        assert note == ([] if n_served in (0, len(recs)) else
                        [f"POLICIES served {n_served} of these {len(recs)} calls itself (their logged policy_version "
                         "and shared_version are the ones it loads, or it gives them the logged probabilities to "
                         "float32 rounding): on those the estimate compares it with itself"])
        code, out, err = evaluate(capsys, ope_env, "--tau", 0.08, log=log)
        line = out.splitlines()[-1]
        if n_served == len(recs):
            assert not v["ship"] and not v["worse"]
            assert line.startswith("verdict: none (snips on cite_rate: POLICIES served all 48 of these calls"), line
            assert line.endswith("evaluate a newer version on this log, or this version on a log it did not serve)")
        else:
            assert "POLICIES served all" not in out and not line.startswith("verdict: none"), line


def test_an_own_log_without_versions_agrees_to_float32_rounding(capsys, ope_env, tmp_path, monkeypatch):
    """An application's own log, without policy_version/shared_version, whose log_prob and
    logits the evaluated policy computed itself (the identity reranker at TAU): every weight is
    1 up to float32 rounding, and that rounding alone decided the verdict (before: 'ship (...
    [+5.9e-09, +5.0e-08] lies above 0)', or 'do not ship' with a rollback hint, by the CPU).
    Now every call agrees within the float32 bound (rounding_bound) and the verdict is none,
    saying so. The bound (float32 error analysis) is far above the rounding seen and far below a real
    policy change: a target at another temperature differs from the log by orders of magnitude
    more, and its decisions (ship, worse) stand, with gains far above what rounding can move."""
    import rmm_jax.cli.evaluate as cli_evaluate
    monkeypatch.setattr(cli_evaluate, "rollback_hint", lambda ps, policies: "HINT: roll back")
    assert not any("policy_version" in r or "shared_version" in r for r in ope_env["records"])
    code, out, err = evaluate(capsys, ope_env, "--tau", TAU, "--json")
    assert code == 0 and err == "", err
    rep = strict_json(out)
    v, n = rep["verdict"], len(ope_env["records"])
    assert v["self_served"] and v["served_by_target"] == n and not v["ship"] and not v["worse"], v
    assert v["reliable"] and abs(v["gain"]["value"]) < 1e-6                     # the estimate itself stands
    code, out, err = evaluate(capsys, ope_env, "--tau", TAU)
    line = out.splitlines()[-1]
    assert code == 0 and "HINT" not in err, err
    assert line.startswith(f"verdict: none (snips on cite_rate: the target and the logging policy agree to float32 "
                           f"rounding on all {n} of these calls (every importance weight is 1 within float32's error "
                           "bound, so any gain lies within ±"), line
    assert line.endswith("POLICIES served them, or it draws exactly as what served them did (a uniform draw at a large "
                         "--draw-tau, or the same params), so the log cannot compare it with itself: evaluate a newer "
                         "version on this log, or this version on a log it did not serve)"), line

    from rmm_jax.online.ope import Target, agrees_to_rounding, load_calls, rounding_bound, rounding_gain
    from rmm_jax.online.ope._marginals import _prefix_log_probs
    st, ps = open_store(ope_env["store"]), PolicyStore.open(ope_env["pol"])

    def log_ratios(tau, log):
        calls = load_calls(st, log, ps, Target(KK, MM, tau))
        lr = _prefix_log_probs(calls.target_logits, calls.selected, calls.mask)[:, -1] - calls.log_prob
        return calls, np.abs(lr), rounding_bound(calls)

    calls, lr, bound = log_ratios(TAU, ope_env["log"])
    assert agrees_to_rounding(calls).all() and (bound > 0).all() and np.isfinite(bound).all()
    assert lr.max() < 0.05 * bound.min(), (lr.max(), bound.min())           # a bound, not what this CPU gives
    # a real change of policy: the identity at another temperature, shipping and shown worse as before
    better = [{**r, "cited": [m for m in r["selected"] if z[m] >= np.median(r["logits"])]}
              for r in ope_env["records"] for z in [dict(zip(r["candidates"], r["logits"]))]]
    worse = [{**r, "cited": [m for m in r["selected"] if z[m] < np.median(r["logits"])]}
             for r in ope_env["records"] for z in [dict(zip(r["candidates"], r["logits"]))]]
    for name, rows, ship in [("better", better, True), ("worse", worse, False)]:
        log = tmp_path / f"{name}.jsonl"
        log.write_text("".join(json.dumps(r) + "\n" for r in rows))
        code, out, err = evaluate(capsys, ope_env, "--tau", 0.05, "--json", "--allow-unreliable", log=log)
        rep = strict_json(out)
        v = rep["verdict"]
        assert v["reliable"] and not v["self_served"] and v["served_by_target"] == 0, (name, v)
        assert v["ship"] == ship and v["worse"] == (not ship), (name, v)
        calls, lr, bound = log_ratios(0.05, log)
        assert not agrees_to_rounding(calls).any() and (lr / bound).min() > 10 and np.median(lr / bound) > 1000
        tol = rounding_gain(calls, rep["ranges"]["cite_rate"])
        assert min(abs(x) for x in v["gain"]["ci95"]) > 100 * tol, (v, tol)     # the whole interval, 160x


def test_large_learned_weights_a_log_of_another_version_is_not_called_rounding(capsys, tmp_path):
    """Night 70 of a daily loop, small: policies whose learned weights are large (their scores'
    terms cancel, so float32's worst-case bound on a score, γ_N times the score on absolute
    values, is far above the score's own size) judged on a log that another version served
    (each record's policy_version/shared_version differ from those POLICIES loads). Before:
    the worst-case bound (median about 0.3 nats here, 2.1 at night 70) exceeded the real
    log-ratios (median about 0.08), so most calls 'agreed to float32 rounding' and counted as
    served by POLICIES, with the verdict none once all did. Now the logged versions decide
    (none served), and without version keys a bound beyond AGREE_LIMIT never calls agreement:
    a note says rounding cannot be told from a change there."""
    from rmm_jax.online.ope import AGREE_LIMIT, Target, agrees_to_rounding, rounding_bound
    from rmm_jax.online.ope._marginals import _prefix_log_probs
    dim = 128
    store = make_fake_store(tmp_path / "store", users=4, sessions=4, turns=8, dim=dim)
    st = open_store(store)
    rng = np.random.default_rng(1)
    a, b = rng.normal(size=(dim, dim)) * 0.15, rng.normal(size=(dim, dim)) * 0.15

    def params(wm, wq):
        return {"m_adapter": {"W": {"kernel": jax.numpy.asarray(wm, np.float32)}},
                "q_adapter": {"W": {"kernel": jax.numpy.asarray(wq, np.float32)}}}
    logger = params(a + 0.01 * rng.normal(size=a.shape), b + 0.01 * rng.normal(size=b.shape))
    pol = tmp_path / "pol"
    PolicyStore.create(pol, {"kind": "linear", "dim": dim, "hidden": None,
                             "config": {"pretrained": False, "model": st.model}}, params(a, b))   # loads (None, 1)
    records = [{**r, "policy_version": None, "shared_version": 2} for r in drawn_records(
        st, rng, lambda u, t, cand: np.asarray(score(logger, u.query_emb[t], u.memory_emb[cand]), np.float64) / TAU,
        lambda u, t, shown: shown[:1])]
    env = {"store": store, "pol": pol}
    for name, rows in [("versions", records),
                       ("no versions", [{k: v for k, v in r.items() if not k.endswith("_version")} for r in records])]:
        log = tmp_path / f"{name}.jsonl"
        log.write_text("".join(json.dumps(r) + "\n" for r in rows))
        calls = load_calls(st, log, PolicyStore.open(pol), Target(KK, MM, TAU))
        lr = np.abs(_prefix_log_probs(calls.target_logits, calls.selected, calls.mask)[:, -1] - calls.log_prob)
        bound = rounding_bound(calls)
        assert np.median(lr) > 0.05 and (bound > AGREE_LIMIT).sum() > len(lr) / 2, (np.median(lr), bound)
        assert not (agrees_to_rounding(calls, bound) & (lr > AGREE_LIMIT)).any()
        code, out, err = evaluate(capsys, env, "--json", "--allow-unreliable", log=log)
        assert code == 0, err
        rep = strict_json(out)
        v = rep["verdict"]
        assert v["served_by_target"] == 0 and not v["self_served"], (name, v)
        assert not [x for x in rep["notes"] if "POLICIES served" in x], rep["notes"]
        coarse = [x for x in rep["notes"] if "rounding can be told from a change of policy" in x]
        if name == "versions":
            assert coarse == []
        else:
            n_coarse = int((bound > AGREE_LIMIT).sum())
            assert coarse == [f"on {n_coarse} of these {len(lr)} calls, logged without policy_version and "
                              "shared_version, float32 rounding of the target's scores could move a log-probability "
                              f"by up to {bound.max():.2g} nats (its scores are large), beyond the {AGREE_LIMIT:g} "
                              "within which rounding can be told from a change of policy: they count as not served "
                              "by POLICIES"], coarse


def test_rollback_hint_only_for_a_reliable_estimate_below_the_logged_value(capsys, ope_env, tmp_path, monkeypatch):
    """docs/lifecycle.md: a rollback is for 'an evaluate whose estimate is reliable and below
    the logged value'. The hint printed on every verdict that did not ship: a gain whose
    interval contains 0, and an unreliable estimate (low ESS) too. Now: contains 0 says 'not
    shown better, nor worse' with no hint; unreliable: no hint; lies below 0: the hint."""
    import rmm_jax.cli.evaluate as cli_evaluate
    monkeypatch.setattr(cli_evaluate, "rollback_hint", lambda ps, policies: "HINT: roll back")
    code, out, err = evaluate(capsys, ope_env, "--tau", 0.08)                    # near the logging policy
    assert code == 0 and "HINT" not in err, err
    assert ("verdict: do not ship: not shown better, nor worse; `rerank` serves them already when a replay made them "
            "current: keeping them or `rmm-jax policies rollback` is the team's call (snips") in out
    code, out, err = evaluate(capsys, ope_env, "--tau", 0.08, "--json")
    v = strict_json(out)["verdict"]
    assert code == 0 and v["reliable"] and v["gain"]["ci95"][0] < 0 < v["gain"]["ci95"][1] and not v["worse"], v
    code, out, err = evaluate(capsys, ope_env, "--tau", 0.3, "--min-ess", 47)    # unreliable: low ESS
    assert code == 3 and "HINT" not in err and "\nverdict: do not ship (snips on cite_rate: no reliable" in out, err
    # cited only where the target (identity at TAU, from the log's logits) ranks the memory low: it loses
    worse = []
    for r in ope_env["records"]:
        z = dict(zip(r["candidates"], r["logits"]))
        worse.append({**r, "cited": [m for m in r["selected"] if z[m] < np.median(r["logits"])]})
    log = tmp_path / "worse.jsonl"
    log.write_text("".join(json.dumps(r) + "\n" for r in worse))
    code, out, err = evaluate(capsys, ope_env, "--tau", 0.05, "--json", "--allow-unreliable", log=log)
    v = strict_json(out)["verdict"]
    assert v["reliable"] and v["worse"] and v["gain"]["ci95"][1] < 0, v
    assert "HINT: roll back" in err.splitlines()
    code, out, err = evaluate(capsys, ope_env, "--tau", 0.05, "--allow-unreliable", log=log)
    assert "\nverdict: do not ship (snips on cite_rate: gain -" in out and "lies below 0)" in out


def test_evaluate_other_target_table_users_and_clip(capsys, ope_env):
    code, out, err = evaluate(capsys, ope_env, "--tau", 0.3, "--json", "--clip", 1.5)
    assert code == 0, err
    rep = strict_json(out)
    assert rep["clip"] == 1.5 and rep["warnings"] and "biased" in rep["warnings"][0]
    assert "warning: importance weights clipped at 1.5" in err
    assert rep["estimates"]["cited"]["ips"]["clipped"] > 0
    code, out, _ = evaluate(capsys, ope_env, "--tau", 0.3, "--allow-unreliable")
    assert code == 0 and "95% interval" in out and "snips" in out and "iips" in out and "direct" in out
    uid = ope_env["users"][0]
    code, out, _ = evaluate(capsys, ope_env, "--users", uid, "--json", "--min-ess", 0)
    n_user = sum(r["user_id"] == uid for r in ope_env["records"])
    assert code == 0 and strict_json(out)["calls"] == n_user
    two = ",".join(ope_env["users"][:2])
    code, out, _ = evaluate(capsys, ope_env, "--users", two, "--json", "--min-ess", 0)
    assert code == 0 and strict_json(out)["calls"] == sum(r["user_id"] in two.split(",") for r in ope_env["records"])
    code, out, _ = evaluate(capsys, ope_env, "--exact-limit", 2, "--mc-samples", 64, "--json")
    assert code == 0 and strict_json(out)["marginals"]["method"] == "monte_carlo"


@pytest.mark.parametrize("users,fragment", [("nobody", "unknown user id 'nobody'"),
                                            ("user0,,user1", "empty user id")])
def test_evaluate_users_bad_one_line(capsys, ope_env, users, fragment):
    code, out, err = evaluate(capsys, ope_env, "--users", users)
    lines = err.strip().splitlines()
    assert code == 2 and out == "" and len(lines) == 1 and "--users" in lines[0] and fragment in lines[0], err
    code, _, err = evaluate(capsys, ope_env, "--user", "user0")      # the old repeatable form is gone
    assert code == 2 and "--user" in err


def test_evaluate_without_logits_reports_ips_snips_only(capsys, ope_env, tmp_path):
    log = tmp_path / "old.jsonl"
    log.write_text("".join(json.dumps({k: v for k, v in r.items() if k != "logits"}) + "\n"
                           for r in ope_env["records"]))
    code, out, err = evaluate(capsys, ope_env, "--json", log=log)
    assert code == 0, err
    rep = strict_json(out)
    assert rep["estimators"] == ["ips", "snips"]
    assert set(rep["estimates"]["cited"]) == {"logged", "ips", "snips"}
    assert any("logits" in note for note in rep["notes"])


@pytest.mark.parametrize("case", ["no_behaviour", "mismatch", "positive", "unknown_memory", "too_many_selected",
                                  "clip", "min_ess", "plot"])
def test_evaluate_bad_input_one_line(capsys, ope_env, tmp_path, case):
    recs = [dict(r) for r in ope_env["records"][:4]]
    names = [":3", "'log_prob'"]
    args = []
    if case == "no_behaviour":
        del recs[2]["log_prob"], recs[2]["logits"]
    elif case == "mismatch":
        recs[2]["log_prob"] = recs[2]["log_prob"] - 1.0
    elif case == "positive":          # no policy gives a probability above 1: bad input, not an estimate
        del recs[2]["logits"]
        recs[2]["log_prob"] = 0.5
    elif case == "unknown_memory":
        spare = next(c for c in recs[2]["candidates"] if c not in recs[2]["selected"])
        recs[2]["candidates"] = [("ghost" if c == spare else c) for c in recs[2]["candidates"]]
        names = [":3", "'candidates'", "ghost"]
    elif case == "too_many_selected":
        recs[2]["selected"] = recs[2]["candidates"][:MM + 1]
        recs[2]["cited"] = []
        del recs[2]["log_prob"]
        names = ["--m"]
    elif case == "clip":
        args, names = ["--clip", "0.5"], ["--clip"]
    elif case == "min_ess":
        args, names = ["--min-ess", "-1"], ["--min-ess"]
    else:
        args, names = ["--plot", str(tmp_path / "p.pdf")], ["--plot", ".png"]
    log = tmp_path / "bad.jsonl"
    log.write_text("".join(json.dumps(r) + "\n" for r in recs))
    code, out, err = evaluate(capsys, ope_env, "--json", *args, log=log)
    assert code == 2 and out == "", (code, err)
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and "Traceback" not in err, err
    for name in names:
        assert name in lines[0], (name, lines[0])


# --------------------------------------------------------------------------- reliability
def crafted_log(env, tmp_path, change, *, logits=False):
    """The fixture's log with ``change(records)`` applied (``logits`` dropped unless kept:
    a changed log_prob would disagree with them, which the reader refuses)."""
    recs = [{k: v for k, v in r.items() if logits or k != "logits"} for r in env["records"]]
    change(recs)
    log = tmp_path / "crafted.jsonl"
    log.write_text("".join(json.dumps(r) + "\n" for r in recs))
    return log




def run_strict(capsys, env, *args, log):
    """``evaluate`` with every warning turned into an error."""
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        return evaluate(capsys, env, *args, log=log)


NUMBER_WORDS = re.compile(r"\b(nan|inf|infinity)\b", re.IGNORECASE)


def first_uncited(recs):
    return next(i for i, r in enumerate(recs) if not r["cited"])


def test_overflowing_weights_are_unreliable_not_nan(capsys, ope_env, tmp_path):
    """A log_prob of -800 makes log(π/μ) ≈ 800 > 709.8: the weight is not a float64. Before:
    'nan' printed, exit 0, NumPy RuntimeWarnings with source lines."""
    def change(recs):
        recs[first_uncited(recs)]["log_prob"] = -800.0
    log = crafted_log(ope_env, tmp_path, change)
    code, out, err = run_strict(capsys, ope_env, "--tau", TAU, log=log)
    assert code == 3, err
    assert not NUMBER_WORDS.search(out) and "Warning" not in err and "Traceback" not in err
    assert out.count("unreliable (weights overflow: log(π/μ) up to 79") == 6    # ips, snips on three metrics
    assert "logged" in out and "direct" in out                                   # the rest of the table is there
    assert err.strip().splitlines()[-1].startswith("6 of 10 estimates are unreliable; exit status 3")
    code, out, err = run_strict(capsys, ope_env, "--tau", TAU, "--json", log=log)
    assert code == 3
    rep = strict_json(out)
    for metric in ("cited", "cite_rate", "recall"):
        for name in ("ips", "snips"):
            est = rep["estimates"][metric][name]
            assert est["value"] is None and est["ci95"] is None and est["se"] is None and not est["reliable"]
            assert "overflow" in est["reason"] and "on 1 of 48 calls" in est["reason"]
        assert rep["estimates"][metric]["logged"]["reliable"]
    assert {(u["metric"], u["estimator"]) for u in rep["unreliable"]} == {
        (m, e) for m in ("cited", "cite_rate", "recall") for e in ("ips", "snips")}
    code, out2, _ = run_strict(capsys, ope_env, "--tau", TAU, "--allow-unreliable", log=log)
    assert code == 0 and "unreliable (weights overflow" in out2
    # the clip cannot hide a weight that is no number: still unreliable
    code, out, _ = run_strict(capsys, ope_env, "--tau", TAU, "--json", "--clip", 5, log=log)
    assert code == 3 and "overflow" in strict_json(out)["estimates"]["cited"]["ips"]["reason"]


def test_huge_weight_out_of_range_and_low_ess(capsys, ope_env, tmp_path):
    """The reported case: one cited call logged with log_prob -60 gets weight ~e^58, so IPS
    claims ~1e23 cited memories per call (at most 2 are shown). Now: unreliable, with both
    reasons, and the one-line low-ESS warning."""
    def change(recs):
        recs[next(i for i, r in enumerate(recs) if r["cited"])]["log_prob"] = -60.0
    log = crafted_log(ope_env, tmp_path, change)
    code, out, err = run_strict(capsys, ope_env, "--tau", TAU, "--json", log=log)
    assert code == 3
    est = strict_json(out)["estimates"]["cited"]["ips"]
    assert est["value"] is None and "outside the metric's range [0, 2]" in est["reason"]
    assert "ESS 1.0 of 48 calls < 30" in est["reason"]
    warn = [line for line in err.splitlines() if line.startswith("warning:")]
    assert len(warn) == 1 and "effective sample size below 30" in warn[0] and "--clip" in warn[0], err


def test_low_ess_one_warning_and_clip_fixes_it(capsys, ope_env, tmp_path):
    """One uncited call weighs e^6 ≈ 403 (its log_prob lowered by 6): ESS (47+e^6)²/(47+e^12)
    ≈ 1.2 of 48 calls, values in range, weights' mean within its error. Only the ESS check
    fires; --clip 2 brings the ESS back to (47+2)²/(47+4) ≈ 47 and the estimates back."""
    def change(recs):
        recs[first_uncited(recs)]["log_prob"] -= 6.0
    log = crafted_log(ope_env, tmp_path, change)
    code, out, err = run_strict(capsys, ope_env, "--tau", TAU, log=log)
    assert code == 3
    warn = [line for line in err.splitlines() if "effective sample size" in line]
    assert len(warn) == 1 and warn[0].startswith("warning: ") and "log more calls" in warn[0]
    assert "try --clip (e.g. --clip 10: biased, lower variance) or" in warn[0], warn
    # from Python the advice names the argument: evaluate_log has clip=, no --clip
    got = evaluate_log(open_store(ope_env["store"]), log, PolicyStore.open(ope_env["pol"]), Target(KK, MM, TAU),
                       bootstrap=40)["warnings"]
    assert len(got) == 1 and "try clip (e.g. clip=10: biased, lower variance) or" in got[0] and "--" not in got[0]
    ess = (47 + math.exp(6)) ** 2 / (47 + math.exp(12))
    assert out.count(f"unreliable (ESS {ess:.1f} of 48 calls < 30)") == 6     # ips, snips on the three metrics
    code, out, err = run_strict(capsys, ope_env, "--tau", TAU, "--json", "--clip", 2, log=log)
    assert code == 0, err
    rep = strict_json(out)
    assert rep["unreliable"] == [] and "effective sample size" not in err
    ips = rep["estimates"]["cited"]["ips"]                   # the 47 other weights within e^{±δ} of 1
    assert ips["ess"] == pytest.approx(49 ** 2 / 51, rel=np.expm1(4 * logit_drift(ope_env))) and ips["clipped"] == 1


def test_ess_threshold_is_the_option(capsys, ope_env):
    """On policy every weight is 1 and the ESS is n = 48: --min-ess 48.5 flags it (the log is
    too small for that threshold, and the warning says so), --min-ess 47.5 does not."""
    code, out, err = evaluate(capsys, ope_env, "--tau", TAU, "--min-ess", 48.5, "--json")
    rep = strict_json(out)
    assert code == 3 and rep["min_ess"] == 48.5
    assert all("ESS 48.0 of 48 calls < 48.5" in u["reason"] for u in rep["unreliable"])
    assert {u["metric"] for u in rep["unreliable"]} == {"cited", "cite_rate", "recall"}
    assert "too few calls" in err and len([ln for ln in err.splitlines() if ln.startswith("warning:")]) == 1
    assert "log more calls (or lower --min-ess)" in err, err
    got = evaluate_log(open_store(ope_env["store"]), ope_env["log"], PolicyStore.open(ope_env["pol"]),
                       Target(KK, MM, TAU), bootstrap=40, min_ess=48.5)["warnings"]
    assert len(got) == 1 and got[0].endswith("log more calls (or lower min_ess)"), got
    code, out, err = evaluate(capsys, ope_env, "--tau", TAU, "--min-ess", 47.5, "--json")
    assert code == 0 and strict_json(out)["unreliable"] == [] and err == ""



@pytest.mark.parametrize("grouped", [True, False], ids=["grouped", "interleaved"])
def test_evaluate_log_reads_the_log_once(ope_env, tmp_path, monkeypatch, grouped):
    """evaluate_log read the day's log again for its learned-calls count (scan_log), and a
    third time when a user's records are not on consecutive lines (scan_log's second pass):
    the count now comes from the calls load_calls read. It counts what learned_calls does."""
    log = ope_env["log"]
    if not grouped:             # round-robin over the users: no user's records are consecutive
        by_user = [[r for r in ope_env["records"] if r["user_id"] == u] for u in ope_env["users"]]
        log = tmp_path / "interleaved.jsonl"
        log.write_text("".join(json.dumps(r) + "\n" for recs in itertools.zip_longest(*by_user) for r in recs if r))
    st, ps, cfg = open_store(ope_env["store"]), PolicyStore.open(ope_env["pol"]), Target(KK, MM, TAU)
    expected = learned_calls(st, log, ps, cfg)
    opened = []
    real_open = builtins.open

    def counting_open(file, *args, **kwargs):
        if isinstance(file, (str, os.PathLike)) and os.fspath(file) == os.fspath(log):
            opened.append(file)
        return real_open(file, *args, **kwargs)

    monkeypatch.setattr(builtins, "open", counting_open)
    loaded = []                 # and each user's state once: for its policy and for the calls it learned
    real_load = PolicyStore.load_batch
    monkeypatch.setattr(PolicyStore, "load_batch", lambda self, users, **kw: (loaded.extend(users),
                                                                              real_load(self, users, **kw))[1])
    got = evaluate_log(st, log, ps, cfg, bootstrap=40)
    assert len(opened) == 1, f"the log was opened {len(opened)} times"
    assert sorted(loaded) == sorted(ope_env["users"]), loaded
    assert got["learned_calls"] == expected and expected["calls"] == len(ope_env["records"])

def test_deterministic_logger_log_prob_zero_is_flagged(capsys, ope_env, tmp_path):
    """log_prob 0 says the logger could show nothing else. Then the weights are π(a) < 1 and
    cannot average 1: the log does not cover the target, and IPS would quietly shrink."""
    def change(recs):
        for r in recs:
            r["log_prob"] = 0.0
    log = crafted_log(ope_env, tmp_path, change)
    code, out, err = run_strict(capsys, ope_env, "--tau", TAU, "--json", log=log)
    assert code == 3
    rep = strict_json(out)
    for metric in ("cited", "cite_rate", "recall"):
        for name in ("ips", "snips"):
            est = rep["estimates"][metric][name]
            assert est["value"] is None and "not 1: log_prob is not the logging policy's probability" in est["reason"]
            assert est["weight_mean"] < 0.9



def test_wrong_log_prob_blames_the_log_not_clip_nor_the_policies(capsys, ope_env, tmp_path):
    """Every log_prob 0 (the log's propensities are wrong): the verdict's reason is the log,
    so stderr says the log cannot judge the policies and why, and suggests neither --clip
    (no clip makes the weights average 1) nor a rollback. Before: 'try --clip (e.g. --clip
    10 ...)', and the verdict line read as if the policies had failed."""
    def change(recs):
        for r in recs:
            r["log_prob"] = 0.0
    log = crafted_log(ope_env, tmp_path, change)
    for extra in ([], ["--clip", "2"]):
        code, out, err = run_strict(capsys, ope_env, "--tau", TAU, *extra, log=log)
        assert code == 3
        warn = [ln for ln in err.splitlines() if ln.startswith("warning: ") and "clipped at" not in ln]
        assert len(warn) == 1 and warn[0].startswith("warning: the log cannot judge these policies"), err
        assert "log_prob is not the logging policy's probability" in warn[0]
        assert "Neither --clip nor a rollback helps" in warn[0] and "try" not in err and "a lower --clip" not in err
        assert "verdict: do not ship: the log cannot judge these policies" in out
    code, out, err = run_strict(capsys, ope_env, "--tau", TAU, "--json", log=log)
    v = strict_json(out)["verdict"]
    assert not v["ship"] and "log_prob is not the logging policy's probability" in v["log_problem"]


def test_a_correct_log_and_a_far_target_names_the_drift_not_the_log(capsys, ope_env, tmp_path):
    """An exact log (every log_prob the Plackett–Luce probability of its logits, every
    candidate drawable) judged for a target far from the logging policy (the identity's
    ranking reversed): its selections are rare in the log, a few calls carry the weight and
    the weights' mean falls below 1. Before: 'weights average 0.0x, not 1: log_prob is not the
    logging policy's probability, or the log does not cover the target' and a fix to log
    log_prob right, blaming a correct log. Now the message names the drift first, says the
    log's log_prob agree with its logits, and how to tell the causes apart, in the text and
    in --json (verdict log_problem, the warning's fix, the estimate's reason)."""
    pol = tmp_path / "far"
    st = open_store(ope_env["store"])
    eye = np.eye(16, dtype=np.float32)
    PolicyStore.create(pol, {"kind": "linear", "dim": 16, "hidden": None,
                             "config": {"pretrained": False, "model": st.model}},
                       {"m_adapter": {"W": {"kernel": jax.numpy.asarray(-2 * eye)}},
                        "q_adapter": {"W": {"kernel": jax.numpy.zeros((16, 16), np.float32)}}})   # scores -mᵀq
    rng = np.random.default_rng(3)
    records = []
    for r in ope_env["records"]:           # logged at τ 0.05: log_prob exact, every candidate drawable
        z = np.asarray(r["logits"]) * (TAU / 0.05)
        order = [int(p) for p in np.argsort(-(z + rng.gumbel(size=len(z))))[:MM]]
        records.append({**r, "logits": [float(x) for x in z], "selected": [r["candidates"][p] for p in order],
                        "cited": [r["candidates"][order[0]]], "log_prob": pl_log_prob(z, order)})
    log = tmp_path / "exact.jsonl"
    log.write_text("".join(json.dumps(r) + "\n" for r in records))
    env = {**ope_env, "pol": pol, "log": log}
    code, out, err = evaluate(capsys, env, "--tau", 0.02, "--json")
    assert code == 3, err
    rep = strict_json(out)
    est, v = rep["estimates"]["cite_rate"]["snips"], rep["verdict"]
    assert est["weight_mean"] < 0.1 and est["ess"] < 0.1 * est["n"], est
    for text in (v["log_problem"], est["reason"]):
        assert "the target has likely drifted far from the logging policy" in text, text
    assert "every record's log_prob is the Plackett–Luce probability of its logits" in v["log_problem"]
    fix = [w for w in rep["warnings"] if w.startswith("the log cannot judge these policies")]
    assert len(fix) == 1 and "to tell the two apart" in fix[0] and "a later day's" in fix[0], rep["warnings"]
    code, out, err = evaluate(capsys, env, "--tau", 0.02)
    assert "the target has likely drifted far from the logging policy" in err, err


@pytest.mark.parametrize("args", [["--users", "user0"], ["--users", "user0", "--clip", "2"], ["--min-ess", "47"]])
def test_too_few_calls_for_min_ess_says_so_and_never_suggests_clip(capsys, ope_env, args):
    """ESS <= n, and clipping lower never lowers it, so ``ess_max`` (the ESS at --clip 1) is
    the most any clip gives. 12 calls of user0 (a target at tau 0.3: ESS about 7) cannot
    reach --min-ess 30: the log is too small, no rollback advised. 48 calls cannot reach
    --min-ess 47 either (ESS at most 42 at any clip): there the target's selections are rare
    in the log, its divergence, so not shipping stays the advice. Before: 'try --clip (e.g.
    --clip 10 ...)' and, with --clip 2, 'try a lower --clip'."""
    code, out, err = evaluate(capsys, ope_env, "--tau", 0.3, *args, "--json")
    assert code == 3
    warn = [ln for ln in err.splitlines() if ln.startswith("warning: ") and "clipped at" not in ln]
    assert "try --clip" not in err and "a lower --clip" not in err, err
    rep = strict_json(out)
    est = rep["estimates"]["cite_rate"]["snips"]
    assert est["ess"] <= est["ess_max"] <= est["n"] == rep["calls"] and est["ess_max"] < rep["min_ess"]
    if rep["calls"] < rep["min_ess"]:
        assert len(warn) == 1 and warn[0].startswith("warning: the log cannot judge these policies"), err
        assert "too few calls" in warn[0] and warn[0].endswith("log more calls (or lower --min-ess)")
        assert "too few calls" in rep["verdict"]["log_problem"]
    else:
        assert len(warn) == 1 and warn[0].startswith("warning: effective sample size below 47"), err
        assert f"the target's selections are rare in this log: at any --clip the ESS is at most " \
               f"{est['ess_max']:.1f} of {est['n']} calls; log more calls (rerank --explore), or do not ship" in warn[0]
        assert rep["verdict"]["log_problem"] is None


def test_zero_prints_without_a_sign(capsys, ope_env):
    """On policy every gain is 0 up to float rounding: printed '0.0000', never '-0.0000' nor
    '+0.0000' (the table, the cited-recall line and the verdict's gain)."""
    code, out, err = evaluate(capsys, ope_env, "--tau", TAU)
    assert code == 0, err
    assert "-0.0000" not in out and "+0.0000" not in out, out
    assert "0.0000 [  0.0000,   0.0000]" in out and "gain 0.0000 [0.0000, 0.0000]" in out
    from rmm_jax.online.ope import signed
    assert (signed(-0.0), signed(-1e-7, 8), signed(1e-7), signed(0.25), signed(-0.25, 8)) == (
        "0.0000", "  0.0000", "0.0000", "+0.2500", " -0.2500")
    assert signed(2e-9, tiny=True) == "+2.0e-09" and signed(0.0, tiny=True) == "0.0000"


def test_intervals_within_range_and_marked_when_cut(capsys, ope_env):
    """Every reported value and interval lies in its metric's range; '*' marks exactly the
    intervals the range cut."""
    code, out, _ = evaluate(capsys, ope_env, "--tau", 0.3, "--json", "--allow-unreliable", "--min-ess", 0)
    rep = strict_json(out)
    assert code == 0
    cut = 0
    for metric, per in rep["estimates"].items():
        lo, hi = rep["ranges"][metric]
        for name, est in per.items():
            a, b = est["ci95"]
            assert lo <= a <= est["value"] <= b <= hi, (metric, name, est)
            cut += est["ci95_clipped"]
    code, out, _ = evaluate(capsys, ope_env, "--tau", 0.3, "--allow-unreliable", "--min-ess", 0)
    assert sum(line.split("]")[1].startswith("*") for line in out.splitlines() if "[" in line) == cut


def test_report_entry_clamps_and_cuts_and_verdict_judges_range():
    est = {"value": 0.9, "ci95": [0.5, 1.3], "se": 0.2, "ess": 50.0, "n": 50, "nonfinite": 0,
           "weight_mean": 1.02, "weight_mean_se": 0.05}
    assert verdict(est, value_range=(0.0, 1.0), min_ess=30) == []
    row = report_entry(est, [], (0.0, 1.0))
    assert row["value"] == 0.9 and row["ci95"] == [0.5, 1.0] and row["ci95_clipped"] is True and row["reliable"]
    assert report_entry(est, [], (0.0, 2.0))["ci95_clipped"] is False
    rounding = dict(est, value=1.0 + 1e-6, ci95=[0.5, 1.0 + 1e-6])
    assert verdict(rounding, value_range=(0.0, 1.0)) == []
    assert report_entry(rounding, [], (0.0, 1.0))["value"] == 1.0
    assert report_entry(rounding, [], (0.0, 1.0))["ci95_clipped"] is False
    out = dict(est, value=1.2)
    (reason,) = verdict(out, value_range=(0.0, 1.0))
    assert "1.2 is outside the metric's range [0, 1]" == reason
    row = report_entry(out, [reason], (0.0, 1.0))
    assert row["value"] is None and row["ci95"] is None and row["reason"] == reason
    assert verdict(dict(est, ess=29.9), min_ess=30) == ["ESS 29.9 of 50 calls < 30"]
    assert verdict(dict(est, ess=29.96), min_ess=30) == ["ESS 29.9 of 50 calls < 30"]   # not "30.0 ... < 30"
    assert verdict(dict(est, ess=30.0), min_ess=30) == []
    assert verdict(dict(est, weight_mean=1.09, weight_mean_se=0.001)) == []              # within 0.1
    assert verdict(dict(est, weight_mean=1.5, weight_mean_se=0.2)) == []                 # within 3.29 s.e.
    (reason,) = verdict(dict(est, weight_mean=1.5, weight_mean_se=0.1))
    assert reason.startswith("weights average 1.5 (s.e. 0.1), not 1")


def test_estimate_with_overflow_is_silent_and_flagged():
    lr = np.array([800.0, 0.0, -1.0, 0.5])
    r = np.array([[1.0], [0.0], [1.0], [0.0]])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        w = estimator_weights("ips", log_ratio=lr)
        est = estimate("ips", w, r, bootstrap=50)
        near = estimate("ips", np.array([[1e308], [1e308], [1.0], [1.0]]), np.ones((4, 1)), bootstrap=50)  # sum: inf
    assert np.isinf(w[0, 0]) and est["nonfinite"] == 1 and math.isnan(est["value"])
    assert verdict(est) == ["importance weights overflow: not finite on 1 of 4 calls"]
    assert verdict(est, problems=["x"]) == ["x"]
    assert verdict(near) == ["not finite: the weighted sums overflow float64"]
    row = report_entry(est, verdict(est))
    assert row["value"] is None and row["ess"] is None
    json.dumps(row, allow_nan=False)


def test_kish_ess_exact_and_scale_free():
    rng = np.random.default_rng(0)
    w = rng.lognormal(size=(200, 1)) * 3
    r = rng.uniform(size=(200, 1))
    want = w.sum() ** 2 / (w ** 2).sum()
    assert estimate("ips", w, r, bootstrap=0)["ess"] == pytest.approx(want, rel=1e-12)      # float64
    assert estimate("ips", w * 1e300, r, bootstrap=0)["ess"] == pytest.approx(want, rel=1e-12)  # no overflow


@pytest.mark.parametrize("seed", range(6))
def test_weight_mean_check_quiet_on_correct_logs_loud_on_deterministic(seed):
    """Calls logged by a PL policy with its true log_prob, target moderately different: the
    weights' mean is 1 in expectation and the 0.1% check stays quiet. The same calls with
    log_prob 0 (a deterministic logger) are flagged every time."""
    rng = np.random.default_rng(seed)
    n, k, m = 400, 8, 3
    zb = rng.normal(size=(n, k))
    zt = zb + 0.5 * rng.normal(size=(n, k))
    mask = np.ones((n, k), bool)
    sel = np.argsort(-(zb + rng.gumbel(size=(n, k))), axis=1)[:, :m]
    pb, pt = prefix_log_probs(zb, sel, mask), prefix_log_probs(zt, sel, mask)
    r = (rng.uniform(size=(n, m)) < 0.3).astype(np.float64)
    for name in ("ips", "rips"):
        kw = {"log_ratio": pt[:, -1] - pb[:, -1], "prefix_log_ratio": pt - pb}
        est = estimate(name, estimator_weights(name, **kw), r, bootstrap=0)
        assert not any("not 1" in x for x in verdict(est)), (name, est["weight_mean"], est["weight_mean_se"])
    est = estimate("ips", estimator_weights("ips", log_ratio=pt[:, -1]), r, bootstrap=0)
    assert any("not 1" in x for x in verdict(est))


def test_a_mean_below_one_with_no_tail_drawn_names_the_drift_beside_the_log_prob():
    """A correct log of 48 calls judging a target that moved its mass onto a candidate the
    logger seldom draws: the log holds none of those selections, so every weight is small
    and alike (ESS near the number of calls) and their mean falls below 1. evaluate blamed
    the log's log_prob alone ("log each call's log_prob as the probability ..."), telling a
    team with a correct log to fix it (the docs audit: 0.561 at an ESS of 34 of 48). The
    cause now names both, with how to tell them apart; with logits on every record (the log
    is self-consistent) the drift first."""
    from rmm_jax.online.ope._estimators import heavy_tailed
    from rmm_jax.online.ope._report import log_cause

    rng = np.random.default_rng(0)
    n, k, m = 48, 8, 3
    zb = rng.normal(size=(n, k))
    zb[:, -1] = -20.0                         # the logger all but never draws candidate 7 ...
    zt = zb.copy()
    zt[:, -1] = 1.0                           # ... which the target shows about half the time
    mask = np.ones((n, k), bool)
    sel = np.argsort(-(zb + rng.gumbel(size=(n, k))), axis=1)[:, :m]      # logged exactly: a correct log
    ratio = prefix_log_probs(zt, sel, mask)[:, -1] - prefix_log_probs(zb, sel, mask)[:, -1]
    r = (rng.uniform(size=(n, m)) < 0.3).astype(np.float64)
    est = {**estimate("ips", estimator_weights("ips", log_ratio=ratio), r, bootstrap=0), "reliable": False}
    assert est["weight_mean"] < 0.7 and not heavy_tailed(est), est       # below 1, and no tail drawn
    cause = log_cause(est, 30)
    assert "log_prob is not the logging policy's probability, or the target has drifted" in cause.why, cause
    assert cause.fix.startswith("to tell the two apart") and "a later day's" in cause.fix, cause
    checked = log_cause(est, 30, logits_checked=True)
    assert "the target has likely drifted far from the logging policy" in checked.why, checked
    assert "Plackett–Luce probability of its logits" in checked.why and checked.fix == cause.fix, checked


def test_over_fewer_calls_than_min_ess_the_weight_mean_is_no_diagnosis_of_the_log():
    """A day's correct log of 16 calls, the target replayed on it: evaluate said its weights
    average 0.783 (s.e. 0.063), "log_prob is not the logging policy's probability", and told
    the team to fix its logging (the same policies on 2,400 calls of the same logger: 0.994).
    Over so few calls the tail of large weights is seldom sampled: correct logs of 16 calls
    fail the 0.1% check about 8% of the time. Below min_ess a failed check says it cannot tell
    sampling from a wrong log_prob (the ESS withholds the estimate already), and the log's
    cause is its size, with the log_prob to check."""
    from rmm_jax.online.ope._report import log_cause

    flagged, hedged = {0: 0, 30: 0}, 0
    for seed in range(200):
        rng = np.random.default_rng(seed)
        n, k, m = 16, 8, 3
        zb = rng.normal(size=(n, k))
        zt = zb + rng.normal(size=(n, k))
        mask = np.ones((n, k), bool)
        sel = np.argsort(-(zb + rng.gumbel(size=(n, k))), axis=1)[:, :m]
        pb, pt = prefix_log_probs(zb, sel, mask), prefix_log_probs(zt, sel, mask)
        r = (rng.uniform(size=(n, m)) < 0.3).astype(np.float64)
        est = estimate("ips", estimator_weights("ips", log_ratio=pt[:, -1] - pb[:, -1]), r, bootstrap=0)
        for min_ess in flagged:
            flagged[min_ess] += any("not 1: " in x for x in verdict(est, min_ess=min_ess))
        off = any("over only 16 calls: too few to tell large weights not sampled yet from a log_prob that is not "
                  "the logging policy's probability" in x for x in verdict(est, min_ess=30))
        hedged += off
        cause = log_cause({**est, "reliable": False}, 30)
        assert cause.why.startswith("the log has too few calls: 16 of them"), cause
        assert ("check that each record's log_prob" in cause.fix) is off, cause
    # without min_ess: the false alarms measured; with it, the same calls said to be undecidable
    assert flagged[0] >= 10 and flagged[30] == 0 and hedged == flagged[0], (flagged, hedged)
    # weights far ABOVE 1 are no sampling (unsampled large weights only pull the mean down; a mean of c or
    # more has probability at most 1/c): the check stands over 16 calls, and the cause is the log_prob
    rng = np.random.default_rng(0)
    r = (rng.uniform(size=(16, 3)) < 0.3).astype(np.float64)
    est = estimate("ips", (np.full(16, 50.0) * rng.uniform(0.9, 1.1, 16))[:, None], r, bootstrap=0)
    reasons = verdict(est, min_ess=30)
    assert any("not 1: log_prob is not the logging policy's probability" in x for x in reasons), reasons
    assert not any("too few to tell" in x or ", or the log does not cover" in x for x in reasons), reasons
    cause = log_cause({**est, "reliable": False}, 30)
    assert cause.why.startswith("the importance weights average") and "log_prob is not" in cause.why, cause
    assert "only pull the mean below 1" in cause.why and ", or the log misses" not in cause.why, cause


def test_call_problems_name_what_the_reader_would_refuse(ope_env):
    """Calls built without the reader (the library API): a positive log_prob, a selection
    no Plackett–Luce policy can draw, non-finite target scores each give their reason."""
    st = open_store(ope_env["store"])
    calls = load_calls(st, ope_env["log"], PolicyStore.open(ope_env["pol"]), Target(KK, MM, TAU))
    n = len(calls.user_ids)
    rows = np.arange(n)
    kw = {"log_ratio": np.zeros(n)}
    assert call_problems(calls, rows, **kw) == {"direct": [], "ips": [], "snips": []}
    lp = calls.log_prob.copy()
    lp[[0, 1]] = 0.3
    got = call_problems(dataclasses.replace(calls, log_prob=lp), rows, **kw)
    assert got["ips"] == [f"log_prob is not a log-probability (> 0 or not finite) on 2 of {n} calls"]
    assert call_problems(dataclasses.replace(calls, log_prob=lp), rows[2:], **kw)["ips"] == []
    sel = calls.selected.copy()
    sel[3] = [sel[3, 0], sel[3, 0]]
    got = call_problems(dataclasses.replace(calls, selected=sel), rows, **kw)
    assert "impossible under any Plackett–Luce policy" in got["ips"][0] and got["direct"] == []
    t = calls.target_logits.copy()
    t[5, 0] = np.nan
    got = call_problems(dataclasses.replace(calls, target_logits=t), rows, **kw)
    assert got["direct"] == got["snips"] == [f"the target policy's scores are not finite on 1 of {n} calls"]
    res = evaluate_calls(dataclasses.replace(calls, target_logits=t), Target(KK, MM, TAU), bootstrap=20)
    assert not res["estimates"]["recall"]["direct"]["reliable"]
    assert all(not res["estimates"][m][e]["reliable"] for m in res["estimates"] for e in res["estimators"])
    json.dumps(res, allow_nan=False)


def test_evaluate_plot_writes_png(capsys, ope_env, tmp_path):
    def change(recs):
        recs[first_uncited(recs)]["log_prob"] = -800.0
    log = crafted_log(ope_env, tmp_path, change, logits=False)
    png = tmp_path / "plots" / "ope.png"
    code, _, err = run_strict(capsys, ope_env, "--tau", 0.3, "--plot", png, "--allow-unreliable", log=log)
    assert code == 0, err
    data = png.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    import matplotlib.image
    img = matplotlib.image.imread(png)
    assert img.ndim == 3 and img.shape[0] > 100 and img.shape[1] > 300


def test_a_bad_target_or_an_argument_of_the_wrong_type_is_refused_by_name(ope_env):
    """From Python, Target(k, m, tau=0) (or -1, or NaN) gave a whole report of estimates from
    s/0 with only a RuntimeWarning; m > k was a ValueError from the selection check, a tuple
    for cfg or a path for the store or the policies an AttributeError, and users="user0" was
    read letter by letter ("unknown user id 'u'")."""
    from rmm_jax.errors import InputError
    from rmm_jax.online.ope import evaluate_log

    st, ps = open_store(ope_env["store"]), PolicyStore.open(ope_env["pol"])
    for cfg, where in ((Target(KK, MM, 0.0), "cfg.tau"), (Target(KK, MM, -1.0), "cfg.tau"),
                       (Target(KK, MM, float("nan")), "cfg.tau"), (Target(KK, KK + 1, TAU), "cfg.m"),
                       (Target(2.5, 1, TAU), "cfg.k"), ((KK, MM, TAU), "cfg")):
        with pytest.raises(InputError, match=rf"^{where}: "):
            evaluate_log(st, ope_env["log"], ps, cfg, bootstrap=40)
    calls = load_calls(st, ope_env["log"], ps, Target(KK, MM, TAU))
    with pytest.raises(InputError, match=r"^cfg.tau: "):
        evaluate_calls(calls, Target(KK, MM, 0.0), bootstrap=40)
    for args, where in (((str(ope_env["store"]), ope_env["log"], ps), "store"),
                        ((st, ope_env["log"], str(ope_env["pol"])), "policies")):
        with pytest.raises(InputError, match=rf"^{where}: expected an? .* store, .*\(path\), got str "):
            evaluate_log(*args, Target(KK, MM, TAU), bootstrap=40)
    with pytest.raises(InputError, match=r"^users: expected a list of user ids \(str\), got str 'user0'$"):
        evaluate_log(st, ope_env["log"], ps, Target(KK, MM, TAU), users="user0", bootstrap=40)
    assert evaluate_log(st, ope_env["log"], ps, Target(KK, MM, TAU), users=["user0"], bootstrap=40)["users"] == 1


def test_evaluate_log_refuses_policies_made_for_another_embedding_model_or_dim(ope_env, monkeypatch):
    """The CLI refused a policy store made for another embedding model than STORE's, and
    evaluate_log took it from Python and gave a whole report; one of another dimension failed
    deep inside, naming ``q``, no argument of evaluate_log. Each is refused naming ``policies``."""
    from rmm_jax.errors import InputError
    from rmm_jax.online.ope import evaluate_log

    st, ps = open_store(ope_env["store"]), PolicyStore.open(ope_env["pol"])
    for field, value, says in (("model", "another-model", r"policy store was made for embedding model "
                                                           r"'another-model', the embedding store uses "),
                               ("dim", st.dim + 1, rf"policy store has dim {st.dim + 1}, the embedding store's is "
                                                   rf"{st.dim} ")):
        meta = ps.meta_info()
        wrong = meta._replace(**({"config": {**(meta.config or {}), "model": value}} if field == "model"
                                 else {"dim": value}))
        with monkeypatch.context() as m:
            m.setattr(type(ps), "meta_info", lambda self, wrong=wrong: wrong)
            with pytest.raises(InputError, match=rf"^policies: {says}"):
                evaluate_log(st, ope_env["log"], ps, Target(KK, MM, TAU), bootstrap=40)
    assert evaluate_log(st, ope_env["log"], ps, Target(KK, MM, TAU), bootstrap=40)["calls"] > 0


def test_from_python_an_error_names_the_argument_and_the_cli_its_option(capsys, ope_env):
    """evaluate_log(..., bootstrap=10) said "--bootstrap: must be >= 40", users=["nobody"]
    "--users: unknown user id": the CLI's option names, for a call that has none. From
    Python the error names the argument; `rmm-jax evaluate` still names its option."""
    from rmm_jax.errors import InputError
    from rmm_jax.online.ope import evaluate_log

    st, ps, cfg = open_store(ope_env["store"]), PolicyStore.open(ope_env["pol"]), Target(KK, MM, TAU)
    for kw, where in (({"bootstrap": 10}, "bootstrap"), ({"clip": 0.5}, "clip"), ({"min_ess": -1.0}, "min_ess"),
                      ({"users": ["nobody"]}, "users"), ({"seed": "0"}, "seed"), ({"seed": -1}, "seed"),
                      ({"mc_samples": 0}, "mc_samples"), ({"exact_limit": 0}, "exact_limit")):
        with pytest.raises(InputError, match=rf"^{where}: "):
            evaluate_log(st, ope_env["log"], ps, cfg, **{"bootstrap": 40, **kw})
    for args, option in ((("--bootstrap", 10), "--bootstrap"), (("--clip", 0.5), "--clip"),
                         (("--min-ess", -1), "--min-ess"), (("--users", "nobody"), "--users")):
        code, out, err = run_cli(capsys, "evaluate", ope_env["store"], "--log", ope_env["log"], "--policies",
                                 ope_env["pol"], "--k", KK, "--m", MM, *args)
        assert code == 2 and out == "" and err.startswith(f"error: {option}: ") and len(err.splitlines()) == 1, err


def test_estimate_refuses_bad_arrays_and_names_by_argument():
    """estimate("ips", np.ones(3), np.ones(3)) (1-D, as lists too, or of unequal lengths) was
    "IndexError: too many indices for array", an unknown estimator "IndexError: invalid index
    to scalar variable". Each is one InputError naming the argument; NaN weights are still
    reported (nonfinite), not refused: an overflow gives them."""
    from rmm_jax.errors import InputError

    ok = np.ones((3, 1))
    cases = [
        (("ips", np.ones(3), np.ones(3)), {}, r"^weights: expected a 2-D array \(n calls, M slots\), "
                                              r"got shape \(3,\)$"),
        (("ips", [1, 1, 1], [0, 1, 0]), {}, r"^weights: expected a 2-D array"),
        (("ipss", ok, ok), {}, r"^name: unknown estimator 'ipss'; one of ips, snips, rips, snrips, iips$"),
        (("ips", ok, np.ones((4, 1))), {}, r"^rewards: expected shape \(n calls, M slots\) with weights of shape "
                                           r"\(n, M\) or \(n, 1\), got \(4, 1\) with weights \(3, 1\)$"),
        (("snips", np.array([[1.0], [-1.0], [1.0]]), ok), {}, r"^weights: importance weights must be >= 0"),
        (("ips", ok, np.array([[1.0], [np.nan], [1.0]])), {}, r"^rewards: contains NaN or Inf$"),
        (("ips", ok, ok), {"logged": np.ones(4)}, r"^logged: expected shape \(3,\)"),
        (("ips", ok, ok), {"seed": "0"}, r"^seed: must be an int"),
        (("ips", ok, ok), {"bootstrap": -1}, r"^bootstrap: must be an int >= 0"),
    ]
    for args, kw, match in cases:
        with pytest.raises(InputError, match=match):
            estimate(*args, **kw)
    assert estimate("ips", [[1], [1], [1]], [[0], [1], [0]], bootstrap=0)["value"] == pytest.approx(1 / 3)
    assert math.isnan(estimate("ips", np.array([[1.0], [np.nan], [1.0]]), ok, bootstrap=0)["value"])


def test_ship_verdict_names_its_argument():
    """ship_verdict(report) (the whole report) was KeyError "'cite_rate'", metric="foo" or
    estimator="ipss" a bare KeyError: one InputError naming the argument and what is valid."""
    from rmm_jax.errors import InputError
    from rmm_jax.online.ope import ship_verdict

    entry = {"n": 40, "reliable": True, "value": 0.5, "ci95": [0.4, 0.6], "se": 0.05,
             "gain": {"value": 0.1, "ci95": [0.05, 0.15], "se": 0.02}}
    estimates = {"cited": {"logged": {"n": 40, "reliable": True}, "snips": entry},
                 "cite_rate": {"logged": {"n": 40, "reliable": True}, "ips": entry, "snips": entry}}
    assert ship_verdict(estimates)["ship"] is True
    for args, kw, match in (
            (({"estimates": estimates, "calls": 40},), {}, r"^estimates: got the whole report: pass "
                                                           r"report\['estimates'\]$"),
            (([],), {}, r"^estimates: expected the 'estimates' of an evaluate_log report"),
            ((estimates,), {"metric": "foo"}, r"^metric: unknown metric 'foo'; estimates holds 'cited', 'cite_rate'$"),
            ((estimates,), {"metric": "recall"}, r"^metric: no estimates of 'recall'"),
            ((estimates,), {"estimator": "ipss"}, r"^estimator: unknown estimator 'ipss'; one of ips, snips$"),
            ((estimates,), {"metric": "cited", "estimator": "ips"}, r"^estimator: no gain of cited by 'ips'; "
                                                                    r"one of snips$")):
        with pytest.raises(InputError, match=match):
            ship_verdict(*args, **kw)


def test_slot_marginals_and_prefix_log_probs_refuse_bad_input_by_name():
    """A mask of another shape was a NumPy broadcast error; samples=0 returned all NaN,
    samples=-1 a JAX error; m > K and NaN logits returned padded or NaN marginals without a
    word, prefix_log_probs numbers for a candidate that does not exist. Each is one
    InputError naming the argument."""
    from rmm_jax.errors import InputError

    z, mk = np.zeros((1, 4)), np.ones((1, 4), bool)
    for args, kw, match in (
            ((z, np.ones((1, 3), bool), 2), {}, r"^mask: expected shape \(1, 4\) .* got \(1, 3\)$"),
            ((z, mk, 2), {"exact_limit": 1, "samples": 0}, r"^samples: must be an int >= 1, got int 0$"),
            ((z, mk, 2), {"exact_limit": 1, "samples": -1}, r"^samples: must be an int >= 1"),
            ((z, mk, 2), {"seed": "0"}, r"^seed: must be an int in \[0, 2\*\*63\), got str '0'$"),
            ((z, mk, 5), {}, r"^m: must be an int in \[1, K=4\], got int 5$"),
            ((np.array([[np.nan, 0, 0, 0]]), mk, 2), {}, r"^logits: contains NaN or Inf where mask is True$"),
            ((np.zeros((1, 2, 4)), mk, 2), {}, r"^logits: expected a real array \(n calls, K candidates\)")):
        with pytest.raises(InputError, match=match):
            slot_marginals(*args, **kw)
    masked_nan = np.array([[np.nan, 0, 0, 0]])          # a masked candidate's logit is never read
    got, _ = slot_marginals(masked_nan, np.array([[False, True, True, True]]), 2)
    np.testing.assert_allclose(got[0, :, 1:], 1 / 3)
    for args, match in (((z, np.array([[0, 9]])), r"^selected: indices must be in \[0, K=4\), .* got 9$"),
                        ((z, np.array([[1, 1]])), r"^selected: candidate 1 is selected twice"),
                        ((z, np.array([[0.0, 1.0]])), r"^selected: expected an int array"),
                        ((np.zeros((2, 4)), np.array([[0, 1]])), r"^selected: expected 2 rows")):
        with pytest.raises(InputError, match=match):
            prefix_log_probs(*args)


def test_prefix_log_probs_refuses_a_masked_pick_by_name():
    """A pick of a candidate the mask drops has no probability under the
    policy: prefix_log_probs returned the -1e30 stand-in for it without a word; it is an
    InputError naming the row. Every selection a draw can make (enumerated) is still taken."""
    from rmm_jax.errors import InputError

    z, mask = np.zeros((2, 6)), np.ones((2, 6), bool)
    mask[1, 2] = False
    with pytest.raises(InputError, match=r"^selected: candidate 2 \(row 1\) is masked or its score is not finite"):
        prefix_log_probs(z, np.array([[0, 3, -1], [1, 2, 5]]), mask)
    with pytest.raises(InputError, match=r"^selected: candidate 4 \(row 0\) is masked"):
        prefix_log_probs(np.where(np.arange(6) == 4, -np.inf, z), np.array([[4, 0, -1], [1, 0, 5]]),
                         np.arange(6) != 4)
    zr, mr = random_case(5, 11, 1)
    for perm, _ in selections(zr, mr, 3):
        assert np.isfinite(prefix_log_probs(zr[None], np.asarray(perm)[None], mr[None])).all()


def test_snips_beyond_the_estimand_range_by_its_weighting_alone_is_clamped_not_withheld():
    """SNIPS is Σ w_i R_i / Σ w_i, so it lies within the same weighted mean of the calls' ranges;
    a target at every call's ceiling whose weights favour the calls with the higher ceiling gives
    a SNIPS above the estimand's range (the mean of the ceilings) by sampling alone. That is
    reported, clamped to the estimand's range (it was withheld: 'outside the metric's range');
    IPS, (1/n) Σ w_i R_i, beyond the range is still withheld."""
    from rmm_jax.online.ope import Calls, Target, evaluate_calls, prefix_log_probs, slot_rewards
    rng = np.random.default_rng(3)
    n, k, m = 400, 4, 2
    gold = np.zeros((n, k), bool)
    gold[:, 0] = True
    gold[::2, 1] = True                        # even calls: two gold (ceiling 2/2), odd: one of two in the bank
    num_gold = np.full(n, 2, np.int32)
    # the logger already prefers gold memories; the target shows them first (at every call's ceiling).
    # A call with two gold is drawn whole less often by the logger, so its weight is larger: SNIPS
    # leans to the calls whose ceiling is 1
    behaviour = (np.where(gold, 2.0, -2.0) + rng.normal(size=(n, k))).astype(np.float32)
    target = np.where(gold, 8.0, -8.0).astype(np.float32)
    g = rng.gumbel(size=(n, k))
    selected = np.argsort(-(behaviour + g), axis=1)[:, :m].astype(np.int32)    # Plackett-Luce draws
    log_prob = prefix_log_probs(behaviour, selected)[:, -1].astype(np.float64)
    calls = Calls(user_ids=["u"] * n, query_ids=[f"q{i}" for i in range(n)], target_logits=target,
                  behaviour_logits=None, mask=np.ones((n, k), bool), selected=selected,
                  cited=np.zeros((n, m), bool), log_prob=log_prob, cand_gold=gold, num_gold=num_gold,
                  valid=np.ones(n, bool), own_policy={"u": True})
    mr = slot_rewards(calls)["recall"]
    a, b = mr.value_range
    assert (a, b) == (0.0, 0.75)               # mean of ceilings 1 and 1/2
    w = np.exp(prefix_log_probs(target, selected)[:, -1] - log_prob)[:, None]
    snips = float((w[:, 0] * mr.rewards.sum(1)).sum() / w[:, 0].sum())
    assert snips <= float(w[:, 0] @ mr.high / w[:, 0].sum()) + 1e-12   # within its own weighted range
    rep = evaluate_calls(calls, Target(k, m, 1.0))["estimates"]["recall"]
    truth = rep["direct"]["value"]
    assert truth == pytest.approx(b, abs=1e-3)    # the target sits at the ceiling of every call
    assert snips > b * (1 + 1e-3)               # beyond the estimand's range: reported, clamped to it
    assert rep["snips"]["reliable"] and rep["snips"]["value"] == b, rep["snips"]
    ips = float((w[:, 0] * mr.rewards.sum(1)).mean())
    assert ips > b * (1 + 1e-3)                 # IPS beyond it too: withheld, for that reason among others
    assert not rep["ips"]["reliable"] and f"{ips:.4g} is outside the metric's range" in rep["ips"]["reason"], \
        rep["ips"]
