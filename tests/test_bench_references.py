"""The benchmark's PyTorch and NumPy references compute what rmm-jax computes.

On a fixed small input (d=16, K=8, M=3, B=4) with given selections and citations (no
sampling randomness), for the linear kind (torch and numpy) and the MLP kind (torch):

* scores equal ``rmm_jax.score`` (fused path) and ``rmm_jax.score_naive``;
* the REINFORCE gradient (binary reward, batch-mean baseline, reward-to-go, exact
  Plackett–Luce) equals ``jax.grad`` of rmm-jax's loss;
* params after one Adam step, and after three consecutive steps on different batches,
  equal rmm-jax's ``make_update`` (same lr, selection, citations, baseline).
  (A first Adam step is ≈ −lr·sign(g), so the multi-step check is the stronger one.)
Both zero-initialised and random non-zero starting parameters are used. "Equal" is within the
float32 error bound of rmm-jax's computation (tests/helpers.py ``f32_error``), counted twice: the
references evaluate the same formulas in float32 too, and their rounding obeys the same bound.

Also: the ``torch.compile`` reference (fused scoring) makes the same selections, citations
and updates as the eager loop, and ``ref_torch.reset`` gives a fresh start; the throughput
floor is the roofline; the Vowpal Wabbit peer (``benchmarks/peer_vw.py``) cites with the
library's two citation models, is anchored at the retriever (an untrained workspace ranks by
s/τ, learning sees s/τ as VW's base), learns a planted bilinear ranking, and the benchmark
exits non-zero when a learner ends below the retriever; its ablation logs Plackett–Luce slot
probabilities (skipped without ``vowpalwabbit``, except on CI); and
``benchmarks/gpu.sh --dry-run`` runs every benchmark's smoke version and writes its JSON.
"""
import functools
import json
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmarks"))
import _common  # noqa: E402
import _ref_numpy as ref_numpy  # noqa: E402
import _ref_torch as ref_torch  # noqa: E402
import peer_vw  # noqa: E402
import throughput  # noqa: E402
import torch  # noqa: E402

import rmm_jax as rj  # noqa: E402
from rmm_jax.core.update import reranker_reinforce_loss  # noqa: E402
from rmm_jax.data import citations as cm  # noqa: E402
from rmm_jax.data.citations import DEFAULT_PRECISION, DEFAULT_RECALL, false_cite_prob  # noqa: E402

sys.path.insert(0, os.path.dirname(__file__))
from helpers import assert_f32_close, f32_error  # noqa: E402

D, K, M, B = 16, 8, 3, 4
LR = 1e-2


def cfg_for(kind):
    """The estimator of the references (``cfg.tau`` is the only field they read)."""
    return setting_for(kind).estimator


def setting_for(kind, tau=None):
    return rj.preset("reinforce", kind=kind, k=K, m=M, batch=B, lr=LR, tau=tau or 0.7, credit="reward_to_go")


def make_batch(seed):
    rng = np.random.default_rng(seed)
    q = rng.normal(size=(B, D)).astype(np.float32)
    m = rng.normal(size=(B, K, D)).astype(np.float32)
    q /= np.linalg.norm(q, axis=1, keepdims=True)
    m /= np.linalg.norm(m, axis=2, keepdims=True)
    mask = np.ones((B, K), bool)
    mask[3, 6:] = False                                   # one query with 6 valid candidates
    selected = np.stack([rng.permutation(K)[:M] for _ in range(B)]).astype(np.int32)
    selected[3] = [5, 0, 2]
    selected[2, 2] = -1                                   # an unfilled slot
    cited = rng.random((B, M)) < 0.5
    cited[0] = [True, False, True]
    valid = np.array([True, True, True, True])
    return dict(q=q, m=m, mask=mask, selected=selected, cited=cited, valid=valid)


def jax_batch(bt):
    return rj.Batch(q=jnp.asarray(bt["q"]), m=jnp.asarray(bt["m"]), mask=jnp.asarray(bt["mask"]),
                    selected=jnp.asarray(bt["selected"]), cited=jnp.asarray(bt["cited"]),
                    gumbel=jnp.zeros((B, K)), valid=jnp.asarray(bt["valid"]),
                    logged_log_prob=jnp.zeros((B,)), has_logged=jnp.zeros((B,), bool))


def start_params(kind, nonzero):
    params = rj.init_reranker(jax.random.key(0), D, kind)
    if nonzero:
        leaves, tree = jax.tree.flatten(params)
        keys = jax.random.split(jax.random.key(1), len(leaves))
        leaves = [x + 0.1 * jax.random.normal(k, x.shape) for x, k in zip(leaves, keys)]
        params = jax.tree.unflatten(tree, leaves)
    return params


# The MLP memory adapter's output bias adds c·q' to every candidate's score: the softmax
# is shift-invariant, so its exact gradient is 0 and float32 leaves rounding noise, which
# Adam's g/(|g| + 1e-8) turns into arbitrary ±lr steps. The float32 bound of the Adam step
# says so (its sensitivity to the gradient is 1/|g| there), so no leaf needs skipping;
# test_mlp_shift_bias_gradient_is_zero checks the gradient is rounding noise instead.


def twice(bound):
    """The bound of two float32 evaluations of the same formulas (rmm-jax's and a reference's)."""
    return jax.tree.map(lambda b: 2 * b, bound)


@functools.lru_cache(maxsize=None)
def grads_bound(kind, nonzero, seed):
    """f32_error of (loss, gradient) of rmm-jax's loss on ``make_batch(seed)``, twice."""
    bt = make_batch(seed)
    return twice(f32_error(lambda p: jax_grads(p, cfg_for(kind), bt), start_params(kind, nonzero)))


@functools.lru_cache(maxsize=None)
def steps_bound(kind, nonzero):
    """f32_error of rmm-jax's three Adam steps (:func:`jax_steps`), twice."""
    return twice(f32_error(lambda p: jax_steps(kind, p, 3), start_params(kind, nonzero)))


def torch_tensors(bt):
    return (torch.from_numpy(bt["q"]), torch.from_numpy(bt["m"]), torch.from_numpy(bt["mask"]),
            torch.from_numpy(bt["selected"].astype(np.int64)), torch.from_numpy(bt["cited"]),
            torch.from_numpy(bt["valid"]))


@pytest.mark.parametrize("nonzero", [False, True])
@pytest.mark.parametrize("kind", ["linear", "mlp"])
def test_torch_scores_match(kind, nonzero):
    params = start_params(kind, nonzero)
    bt = make_batch(0)
    model = ref_torch.Reranker(D, kind).load_flax(params)
    q, m, mask, *_ = torch_tensors(bt)
    with torch.no_grad():
        s_t = model(q, m).numpy()
    naive = jax.vmap(rj.score_naive, in_axes=(None, 0, 0))
    s_fused = np.asarray(rj.score_batch(params, jnp.asarray(bt["q"]), jnp.asarray(bt["m"])))
    s_naive = np.asarray(naive(params, bt["q"], bt["m"]))
    e_naive = f32_error(naive, params, bt["q"], bt["m"])                  # torch builds the adapted memories too
    assert_f32_close(s_t, s_fused, e_naive + f32_error(rj.score_batch, params, bt["q"], bt["m"]))
    assert_f32_close(s_t, s_naive, 2 * e_naive)


@pytest.mark.parametrize("fused", [True, False])
@pytest.mark.parametrize("nonzero", [False, True])
def test_numpy_scores_match(nonzero, fused):
    params = start_params("linear", nonzero)
    bt = make_batch(0)
    s_np, _ = ref_numpy.forward(ref_numpy.from_flax(params), bt["q"], bt["m"], fused=fused)
    s_jax = np.asarray(rj.score_batch(params, jnp.asarray(bt["q"]), jnp.asarray(bt["m"])))
    e_np = f32_error(rj.score_batch if fused else jax.vmap(rj.score_naive, in_axes=(None, 0, 0)), params, bt["q"],
                     bt["m"])
    assert_f32_close(s_np, s_jax, e_np + f32_error(rj.score_batch, params, bt["q"], bt["m"]))


def jax_grads(params, cfg, bt):
    jb = jax_batch(bt)
    filled = (jb.selected >= 0) & jb.valid[:, None]
    r = rj.citation_rewards(jb.cited, filled, cfg.reward)
    b = jnp.sum(r) / jnp.sum(filled)
    return jax.value_and_grad(reranker_reinforce_loss)(params, jb, b, jb.valid.astype(jnp.float32), cfg)


@pytest.mark.parametrize("nonzero", [False, True])
@pytest.mark.parametrize("kind", ["linear", "mlp"])
def test_torch_gradient_matches(kind, nonzero):
    cfg, params, bt = cfg_for(kind), start_params(kind, nonzero), make_batch(1)
    loss_j, g_j = jax_grads(params, cfg, bt)
    model = ref_torch.Reranker(D, kind).load_flax(params)
    q, m, mask, sel, cited, valid = torch_tensors(bt)
    loss_t, _, _ = ref_torch.reinforce_loss(model(q, m, mask), sel, cited, valid, cfg.tau, mask)
    loss_t.backward()
    g_t = {}
    for name in ("q_adapter", "m_adapter"):
        mod = getattr(model, name)
        if kind == "linear":
            g_t[name] = {"W": {"kernel": mod.W.weight.grad.numpy().T}}
        else:
            g_t[name] = {ly: {"kernel": getattr(mod, ly).weight.grad.numpy().T,
                              "bias": getattr(mod, ly).bias.grad.numpy()} for ly in ("up", "down")}
    e_loss, e_g = grads_bound(kind, nonzero, 1)
    assert_f32_close(float(loss_t.detach()), loss_j, e_loss)
    assert_f32_close(g_t, g_j, e_g)


@pytest.mark.parametrize("nonzero", [False, True])
def test_numpy_gradient_matches(nonzero):
    cfg, params, bt = cfg_for("linear"), start_params("linear", nonzero), make_batch(1)
    loss_j, g_j = jax_grads(params, cfg, bt)
    loss_n, g_n, _ = ref_numpy.grads(ref_numpy.from_flax(params), bt["q"], bt["m"], bt["mask"],
                                     bt["selected"], bt["cited"], bt["valid"], cfg.tau)
    e_loss, e_g = grads_bound("linear", nonzero, 1)
    assert_f32_close(loss_n, loss_j, e_loss)
    assert_f32_close(ref_numpy.to_flax(g_n), g_j, e_g)


@functools.lru_cache(maxsize=None)
def jitted_apply(kind, tau=None):
    return jax.jit(rj.make_update(*setting_for(kind, tau)))


def jax_steps(kind, params, n_steps, batches=None, tau=None):
    """rmm-jax's update on one user (a users axis of 1) for ``n_steps`` batches (``make_batch(10 + i)``
    unless ``batches`` are given); the params after each step."""
    layout, est, opt = setting_for(kind, tau)
    apply = jitted_apply(kind, tau)
    one = lambda tree: jax.tree.map(lambda x: x[None], tree)
    shared = rj.init_shared(params, layout, opt)
    users = one(rj.init_user(params, jax.random.key(0), layout, est, opt))
    out = []
    for i in range(n_steps):
        jb = jax_batch(make_batch(10 + i) if batches is None else batches[i])
        jb = jb._replace(scores=rj.score_batch(jax.tree.map(lambda x: x[0], users.params), jb.q, jb.m, jb.mask))
        shared, users, _ = apply(shared, users, one(jb))
        out.append(jax.tree.map(lambda x: x[0], users.params))
    return out


@pytest.mark.parametrize("nonzero", [False, True])
@pytest.mark.parametrize("kind", ["linear", "mlp"])
def test_torch_adam_updates_match(kind, nonzero):
    params = start_params(kind, nonzero)
    expected, bound = jax_steps(kind, params, 3), steps_bound(kind, nonzero)
    model, opt = ref_torch.make(D, kind, lr=LR, params=params)
    for i in range(3):
        q, m, mask, sel, cited, valid = torch_tensors(make_batch(10 + i))
        ref_torch.update(model, opt, q, m, mask, sel, cited, valid, cfg_for(kind).tau)
        # first step: the update asked for by the brief; later steps: Adam moments too
        assert_f32_close(model.to_flax(), expected[i], bound[i], err_msg=f"step {i}")
    moved = max(float(np.max(np.abs(np.asarray(a) - np.asarray(b))))
                for a, b in zip(jax.tree.leaves(expected[-1]), jax.tree.leaves(params)))
    assert moved > 1e-3                                   # the check is not vacuous


def test_mlp_shift_bias_gradient_is_zero():
    _, g = jax_grads(start_params("mlp", True), cfg_for("mlp"), make_batch(1))
    _, bound = grads_bound("mlp", True, 1)                  # twice: here half of it is the bound, as 0 is exact
    assert_f32_close(g["m_adapter"]["down"]["bias"], 0.0, bound["m_adapter"]["down"]["bias"] / 2)
    assert float(jnp.max(jnp.abs(g["m_adapter"]["down"]["kernel"]))) > 1e-3


@pytest.mark.parametrize("fused", [True, False])
@pytest.mark.parametrize("nonzero", [False, True])
def test_numpy_adam_updates_match(nonzero, fused):
    params = start_params("linear", nonzero)
    expected, bound = jax_steps("linear", params, 3), steps_bound("linear", nonzero)
    p = ref_numpy.from_flax(params)
    opt = ref_numpy.Adam(p, lr=LR)
    for i in range(3):
        bt = make_batch(10 + i)
        ref_numpy.update(p, opt, bt["q"], bt["m"], bt["mask"], bt["selected"], bt["cited"], bt["valid"],
                         cfg_for("linear").tau, fused=fused)
        assert_f32_close(ref_numpy.to_flax(p), expected[i], bound[i], err_msg=f"step {i}")


def test_reference_loops_run_and_learn_nothing_strange():
    """Both references' full online loops run on a tiny stream and stay finite."""
    rng = np.random.default_rng(0)
    T, N = 16, 40
    bank = rng.normal(size=(N, D)).astype(np.float32)
    bank /= np.linalg.norm(bank, axis=1, keepdims=True)
    q = rng.normal(size=(T, D)).astype(np.float32)
    cand = np.argsort(-(q @ bank.T), 1)[:, :K]
    gold = rng.random((T, N)) < 0.1
    data = dict(bank=bank, q=q, cand=cand, mask=np.ones((T, K), bool),
                gold=np.take_along_axis(gold, cand, 1), num_gold=gold.sum(1))
    model, opt = ref_torch.make(D, lr=LR)
    rt = ref_torch.run_stream(model, opt, data, m=M, batch=B)
    p = ref_numpy.init(D)
    rn = ref_numpy.run_stream(p, ref_numpy.Adam(p, lr=LR), data, m=M, batch=B)
    assert rt.shape == rn.shape == (T // B,)
    assert np.all(np.isfinite(rt)) and np.all(np.isfinite(rn))
    assert all(np.isfinite(x.detach().numpy()).all() for x in model.parameters())
    assert np.isfinite(p["A"]).all() and np.abs(p["A"]).max() > 0


# --------------------------------------------------------------------------- PyTorch done well


@pytest.mark.parametrize("nonzero", [False, True])
def test_torch_fused_scores_match(nonzero):
    """The fused scoring the torch.compile reference uses is the same function as rmm-jax's."""
    params = start_params("linear", nonzero)
    bt = make_batch(0)
    model = ref_torch.Reranker(D, "linear", fused=True).load_flax(params)
    q, m, mask, *_ = torch_tensors(bt)
    with torch.no_grad():
        s_t = model(q, m, mask).numpy()
    s_jax = np.asarray(rj.score_batch(params, jnp.asarray(bt["q"]), jnp.asarray(bt["m"]), jnp.asarray(bt["mask"])))
    assert_f32_close(s_t, s_jax, twice(f32_error(rj.score_batch, params, bt["q"], bt["m"], bt["mask"])))
    assert np.isneginf(s_t[3, 6:]).all()


def tiny_stream(seed=0, t=24, n=40):
    rng = np.random.default_rng(seed)
    bank = rng.normal(size=(n, D)).astype(np.float32)
    bank /= np.linalg.norm(bank, axis=1, keepdims=True)
    q = rng.normal(size=(t, D)).astype(np.float32)
    cand = np.argsort(-(q @ bank.T), 1)[:, :K]
    gold = rng.random((t, n)) < 0.15
    return dict(bank=bank, q=q, cand=cand, mask=np.ones((t, K), bool), gold=np.take_along_axis(gold, cand, 1),
                num_gold=gold.sum(1))


def test_torch_reset_gives_a_fresh_run():
    """``ref_torch.reset`` puts a used (model, Adam) back to a fresh pair's start: the timed
    torch.compile repeats re-use one pair, so each repeat must redo the same work."""
    data = tiny_stream()
    params = start_params("linear", True)
    fresh_model, fresh_opt = ref_torch.make(D, lr=LR, params=params)
    r_fresh = ref_torch.run_stream(fresh_model, fresh_opt, data, m=M, batch=B, tau=0.5, seed=3)
    model, opt = ref_torch.make(D, lr=LR, params=params)
    ref_torch.run_stream(model, opt, data, m=M, batch=B, tau=0.5, seed=7)       # move it somewhere else
    ref_torch.reset(model, opt, params)
    r_reset = ref_torch.run_stream(model, opt, data, m=M, batch=B, tau=0.5, seed=3)
    np.testing.assert_array_equal(r_reset, r_fresh)
    for a, b in zip(model.parameters(), fresh_model.parameters()):
        np.testing.assert_array_equal(a.detach().numpy(), b.detach().numpy())


@pytest.mark.slow
def test_torch_compiled_step_matches_eager(monkeypatch):
    """The torch.compile reference (fused scoring, compiled forward/act/loss/Adam) draws the
    same random numbers in the same order as the eager loop, so it makes the same selections
    and citations and reaches the same parameters: within twice the float32 bound of rmm-jax's
    updates on the eager run's selections and citations (recorded as it draws them)."""
    ok, why = ref_torch.compile_available()
    if not ok:
        pytest.skip(why)
    data = tiny_stream()
    params = start_params("linear", True)
    drawn = {"selected": [], "cited": []}

    def recording(fn, key):
        def wrapped(*a, **kw):
            out = fn(*a, **kw)
            drawn[key].append(out.numpy().copy())
            return out
        return wrapped

    monkeypatch.setattr(ref_torch, "gumbel_top_m", recording(ref_torch.gumbel_top_m, "selected"))
    monkeypatch.setattr(ref_torch, "oracle_cite", recording(ref_torch.oracle_cite, "cited"))
    model_e, opt_e = ref_torch.make(D, lr=LR, params=params)
    r_eager = ref_torch.run_stream(model_e, opt_e, data, m=M, batch=B, tau=0.5, seed=3)
    monkeypatch.undo()
    model_c, opt_c = ref_torch.make(D, lr=LR, params=params, fused=True)
    step = ref_torch.CompiledStep(model_c, opt_c, m=M, tau=0.5)
    r_comp = ref_torch.run_stream_compiled(step, data, batch=B, seed=3)
    # each batch's Recall is a mean of B ratios in [0, 1]: bound it at magnitude 1
    ones = np.ones(B, np.float32)
    assert_f32_close(r_comp, r_eager, twice(f32_error(lambda h, n: jnp.mean(h / n), ones, ones)))
    batches = [dict(q=data["q"][t:t + B], m=data["bank"][data["cand"][t:t + B]], mask=data["mask"][t:t + B],
                    selected=sel.astype(np.int32), cited=cited, valid=np.ones(B, bool))
               for t, sel, cited in zip(range(0, len(data["q"]), B), drawn["selected"], drawn["cited"], strict=True)]
    n = len(batches)
    bound = twice(f32_error(lambda p: jax_steps("linear", p, n, batches, tau=0.5)[-1], params))
    assert_f32_close(model_c.to_flax(), model_e.to_flax(), bound)
    moved = max(float(np.max(np.abs(np.asarray(a) - np.asarray(b))))
                for a, b in zip(jax.tree.leaves(model_c.to_flax()), jax.tree.leaves(params)))
    assert moved > 1e-3


# --------------------------------------------------------------------------- floors


def test_floor_is_the_roofline():
    d, k, p = 384, 20, 2 * 384 * 384
    mem = throughput.floor_for(d, k, bandwidth_GBps=10.0, matmul_GFLOPs=1e6, n_params=p)
    assert mem["bound"] == "memory"
    assert mem["bytes_per_update"] == 32 * p + throughput.B * (k + 1) * d * 4
    # float64 arithmetic on the same Python floats on both sides: the default rtol (1e-7) is ample
    np.testing.assert_allclose(mem["floor_queries_per_s"], throughput.B / (mem["bytes_per_update"] / 10e9))
    comp = throughput.floor_for(d, k, bandwidth_GBps=1e6, matmul_GFLOPs=1.0, n_params=p)
    assert comp["bound"] == "compute"
    np.testing.assert_allclose(comp["floor_queries_per_s"], 1e9 / comp["flops_per_query"])
    bw = throughput.copy_bandwidth(1 << 20)                          # a 1 MiB copy, in cache
    assert bw["GBps"] == max(bw["numpy_GBps"], bw["jax_GBps"]) > 0


# --------------------------------------------------------------------------- the VW peer

def require_vw():
    """VW's tests skip without vowpalwabbit, except on CI (CI=true), where it must be installed."""
    if peer_vw.pyvw is None:
        if os.environ.get("CI") == "true":
            pytest.fail("vowpalwabbit is not installed (it is in the test and bench extras)")
        pytest.skip("vowpalwabbit is not installed (pip install vowpalwabbit)")


def test_numpy_citations_follow_the_library_rule():
    """VW's slates are cited by NumPy transcriptions of the library's two citation models:
    ref_numpy.oracle_cite (gold with probability r, non-gold with the library's per-call q,
    rmm_jax.data.citations.false_cite_prob) and ref_numpy.class_cite (useful p_useful, other
    p_other, all of a call without a useful one spurious, unfilled never), each slot's rate
    equal to the library's cite function's own, sampled over keys."""
    rng = np.random.default_rng(0)
    n = 200_000
    lib = peer_vw.CITATIONS["oracle"].library()
    keys = jax.random.split(jax.random.key(0), n)
    for is_gold in ([True, False, False, False, False], [True, True, False, False, False],
                    [False, False, False, False, False], [True, True, True, True, False]):
        g = np.tile(np.array(is_gold), (n, 1))
        cited = ref_numpy.oracle_cite(g, np.ones_like(g), rng, DEFAULT_PRECISION, DEFAULT_RECALL)
        q = float(false_cite_prob(jnp.asarray(is_gold), jnp.ones(5, bool), DEFAULT_PRECISION, DEFAULT_RECALL))
        rate = cited.mean(0)
        # Monte Carlo, not rounding: a rate over n = 200,000 draws has sd ≤ 0.0011, so 0.005 is > 4 sd
        for j, gj in enumerate(is_gold):
            np.testing.assert_allclose(rate[j], DEFAULT_RECALL if gj else q, atol=0.005)
        filled = np.array([True, True, True, True, False])                 # the last slot unfilled
        cited = peer_vw.CITATIONS["oracle"].numpy(g, np.tile(filled, (n, 1)), rng)
        lib_rate = np.asarray(jax.vmap(lambda k: lib(k, jnp.asarray(is_gold), jnp.asarray(filled)))(keys)).mean(0)
        useful = np.array(is_gold) & filled
        want = np.where(useful, cm.P_USEFUL, cm.P_OTHER if useful.any() else cm.SPURIOUS) * filled
        np.testing.assert_allclose(cited.mean(0), want, atol=0.005)
        np.testing.assert_allclose(lib_rate, want, atol=0.005)


def test_slate_probabilities_are_plackett_luce():
    """The ablation's sample_slate: per-slot probabilities multiply to the Plackett–Luce
    probability of the ordered slate, and its first draw follows the pmf."""
    rng = np.random.default_rng(1)
    pmf = rng.dirichlet(np.ones(6))
    first = np.zeros(6)
    for _ in range(20_000):
        order, p = peer_vw.sample_slate(pmf, 3, rng)
        first[order[0]] += 1
        assert len(set(order.tolist())) == 3
        exact, left = 1.0, pmf.sum()
        for a in order:
            exact *= pmf[a] / left
            left -= pmf[a]
        np.testing.assert_allclose(np.prod(p), exact, rtol=1e-12)          # float64: a few roundings of 1e-16
        np.testing.assert_allclose(p[0], pmf[order[0]], rtol=1e-12)
    np.testing.assert_allclose(first / first.sum(), pmf, atol=0.015)      # Monte Carlo: 20,000 draws, sd ≤ 0.0036


def _vw_example(seed, k=8, d=6):
    rng = np.random.default_rng(seed)
    q = rng.standard_normal(d)
    m = rng.standard_normal((k, d))
    return f"|Q {peer_vw.features(q)} ", [f"|M {peer_vw.features(v)}" for v in m], m @ q


def test_untrained_vw_ranks_as_the_retriever():
    """The anchor at ranking time: an untrained workspace predicts f = 0, so z = s/τ + f orders
    the candidates by the retriever's score, not by their position (the candidates here are
    in random order, so dropping s/τ would fall back to position order and fail). The
    Gumbel draw on z is rmm-jax's act step: with f = 0 its first pick follows softmax(s/τ)."""
    require_vw()
    ws = peer_vw.pyvw.Workspace(peer_vw.VWSetting().args())
    for seed in range(5):
        q_text, mem_text, s = _vw_example(seed)
        z = peer_vw.vw_logits(ws, s / 0.1, q_text, mem_text)
        np.testing.assert_array_equal(z, s / 0.1)                         # exact: base + 0.0 in float64
        assert peer_vw.rank(z, 3).tolist() == np.argsort(-s)[:3].tolist() != [0, 1, 2]
    rng = np.random.default_rng(0)
    first = np.bincount([peer_vw.gumbel_top(z, 3, rng)[0] for _ in range(20_000)], minlength=z.size) / 20_000
    want = np.exp(z - z.max()) / np.exp(z - z.max()).sum()
    np.testing.assert_allclose(first, want, atol=0.012)                    # Monte Carlo: 20,000 draws, sd ≤ 0.0036
    ws.finish()


def test_vw_dialogue_start_learns_the_pairs_and_is_loaded_by_the_online_pass(tmp_path):
    """VW's dialogue start: trained on the pairs, saved, and loaded as ``run_vw_user``'s
    ``init``, it ranks each pair's answering turn above where the retriever ranks it (a start
    that was not saved or loaded would rank exactly as the retriever; one that learned the
    labels the wrong way round would rank the answers lower)."""
    require_vw()
    from rmm_jax.data.store import UserData
    from rmm_jax.online.streams import dialogue_stream

    rng = np.random.default_rng(0)
    n, d = 16, 8                                   # answer = a fixed rotation of its question: bilinear, learnable
    rot = np.linalg.qr(rng.normal(size=(d, d)))[0]
    ask = rng.normal(size=(n, d))
    bank = np.stack([ask, ask @ rot.T + 0.1 * rng.normal(size=(n, d))], 1).reshape(2 * n, d).astype(np.float32)
    bank /= np.linalg.norm(bank, axis=1, keepdims=True)
    user = UserData("u", bank, np.zeros((0, d), np.float32), np.zeros((0, 2 * n), bool),
                    tuple(map(str, range(2 * n))), (), (), np.zeros(0, bool))
    s = dialogue_stream(user, np.array([[2 * i, 2 * i + 1] for i in range(n)]), k=2 * n - 1)
    setting = peer_vw.VWSetting(0.3, 0.0, 0.0, 18)
    path = peer_vw.vw_dialogue_start([s], peer_vw.VWStart(0.3, 20, True), bits=18, tau=0.1, path=tmp_path / "s.vw")
    ws = peer_vw.pyvw.Workspace(setting.args(0) + f" -i {path}")
    before, after = [], []
    for t in np.flatnonzero(s.cand_gold.any(1)):
        cand = s.cand[t]
        base = peer_vw.retriever_logits(s, t, cand, 0.1)
        z = peer_vw.vw_logits(ws, base, f"|Q {peer_vw.features(s.queries[t])} ",
                              [f"|M {peer_vw.features(bank[c])}" for c in cand])
        gold = int(np.flatnonzero(s.cand_gold[t])[0])
        before.append(int((base > base[gold]).sum()))
        after.append(int((z > z[gold]).sum()))
    ws.finish()
    assert len(before) == n and np.mean(after) < np.mean(before) / 2, (before, after)


def test_vw_frozen_recall_of_an_untrained_start_is_the_retrievers(tmp_path):
    """The score VW's dialogue start is tuned by: a model that learned nothing (no pairs) ranks
    every question as the retriever, so its frozen Recall@M is the retriever's, query for query."""
    require_vw()
    streams = peer_vw.synthetic_streams(2, 30, 40, 6, 8, seed=3)
    path = peer_vw.vw_dialogue_start([], peer_vw.VWStart(0.3, 1, True), bits=18, tau=0.1, path=tmp_path / "0.vw")
    base = peer_vw.base_recall(streams, 3)
    want = np.concatenate([base[s.user_id][s.valid] for s in streams]).mean()
    assert abs(peer_vw.vw_frozen_recall(path, streams, bits=18, tau=0.1, m=3) - want) < 1e-12


def test_vw_learning_sees_the_retriever_logit():
    """The anchor at learning time: a memory cited half the time has logit 0, so VW's learned
    f must end at −base (σ(base + f) = 1/2); a learner that ignored the base would end at 0."""
    require_vw()
    q_text, mem_text, _ = _vw_example(0, k=3, d=4)
    for b in (3.0, 0.0, -2.0):
        ws = peer_vw.pyvw.Workspace(peer_vw.VWSetting(lr=0.5).args())
        for i in range(300):
            peer_vw.vw_learn(ws, np.full(3, b), q_text, mem_text, [0, 1], [i % 2 == 0, i % 2 == 1])
        f = peer_vw.vw_logits(ws, np.zeros(3), q_text, mem_text)
        np.testing.assert_allclose(f[:2], -b, atol=0.3)      # where 300 SGD steps get to, not rounding
        ws.finish()


def test_vw_learns_a_planted_bilinear_ranking():
    """On users whose gold memory follows the retriever's score plus a planted query × memory
    score, anchored VW with -q QM starts at the retriever and learns the rest: on the second
    half of the stream its prequential Recall@2 is well above the retriever's."""
    require_vw()
    s = peer_vw.synthetic_streams(1, 400, 60, 8, 6, seed=0)[0]
    r = peer_vw.run_vw_user(s, peer_vw.VWSetting(lr=1.0), peer_vw.CITATIONS["oracle"].numpy, m=2, tau=0.1, seed=0)
    base = peer_vw.base_recall([s], 2)[s.user_id]
    assert r["recall"][200:].mean() > base[200:].mean() + 0.1, (r["recall"][200:].mean(), base[200:].mean())
    assert 0 < r["cite_rate"] < 1


def test_floor_failures_name_each_learner_below_the_retriever():
    """The floor covers VW and rmm-jax under every citation model; the ablation is exempt."""
    g = lambda mean: {"mean": mean, "lo": mean - 0.01, "hi": mean + 0.01, "significant": False}  # noqa: E731
    row = lambda name, x: {"label": peer_vw.learner_label(name, "anchored"), "gain_held_out": g(x),  # noqa: E731
                           "held_out_recall": {"mean": 0.4 + x}}
    res = lambda a, b, c: {"vw": row("vw", a), "rmm_jax": row("rmm_jax", b), "vw_cb": row("vw_cb", c)}  # noqa: E731
    out = {"m": 5, "base": {"held_out": 0.4}, "results": {"oracle": res(0.03, 0.1, -0.07),
                                                          "precision_recall": res(-0.01, 0.0, 0.2)}}
    bad = peer_vw.floor_failures(out)
    assert len(bad) == 2 and "'precision_recall'" in bad[0] and "VW" in bad[0]
    assert bad[1].startswith("rmm-jax (anchored preset) under citations 'precision_recall'")
    out["results"]["precision_recall"] = res(0.01, 0.02, -0.3)
    assert peer_vw.floor_failures(out) == []


def test_peer_vw_fails_loudly_below_the_retriever(tmp_path, monkeypatch):
    """The tiny synthetic run end to end with VW ranking against the retriever (the anchor
    reversed): the run exits non-zero naming VW, and its JSON keeps every learner's gain, the
    speeds and the failed target. rmm-jax is stood in for by a perfect ranker here (no
    compile); the real one runs in gpu.sh's dry run below, which must pass."""
    require_vw()
    monkeypatch.setattr(peer_vw, "vw_logits", lambda ws, base, q, m: -base)
    monkeypatch.setattr(peer_vw, "rmm_jax_online", lambda streams, cfg, cite: lambda seed: {
        s.user_id: np.ones(s.queries.shape[0]) for s in streams})
    with pytest.raises(SystemExit) as exc:
        peer_vw.main(["--synthetic", "--quick", "--citations", "oracle", "--seeds", "0,1", "--lr", "1",
                      "--json", str(tmp_path / "bad.json")])
    assert "below the retriever" in str(exc.value.code) and "VW logistic" in str(exc.value.code)
    assert "rmm-jax" not in str(exc.value.code)
    bad = json.loads((tmp_path / "bad.json").read_text())
    res = bad["results"]["oracle"]
    assert res["vw"]["gain_held_out"]["mean"] < 0 < res["rmm_jax"]["gain_held_out"]["mean"]
    assert [t["pass"] for t in bad["targets"]] == [False, True]
    assert bad["ratios"]["oracle"]["rmm_jax_over_vw_queries_per_s"]["median"] > 0 and bad["provenance"]["command"]


# --------------------------------------------------------------------------- gpu.sh


def test_gpu_script_dry_run(tmp_path):
    """benchmarks/gpu.sh --dry-run runs every benchmark's smoke version on this machine (CPU in
    CI) and writes their JSON and a summary; without --dry-run on CPU it does nothing."""
    require_vw()
    script = os.path.join(os.path.dirname(__file__), "..", "benchmarks", "gpu.sh")
    env = {**os.environ, "PYTHON": sys.executable}
    if jax.default_backend() == "cpu":
        idle = subprocess.run(["bash", script, str(tmp_path / "none")], capture_output=True, text=True, env=env,
                              timeout=120)
        assert idle.returncode == 0 and "nothing to do" in idle.stdout
        assert not (tmp_path / "none").exists()
    proc = subprocess.run(["bash", script, "--dry-run", str(tmp_path / "out")], capture_output=True, text=True,
                          env=env, timeout=600)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert summary["dry_run"] is True
    assert [b["name"] for b in summary["benchmarks"]] == ["throughput", "peer_vw"]
    for b in summary["benchmarks"]:
        assert b["rc"] == 0
        res = json.loads((tmp_path / "out" / b["json"]).read_text())
        assert res["targets"] and all("pass" in t for t in res["targets"])
    tp = json.loads((tmp_path / "out" / summary["benchmarks"][0]["json"]).read_text())
    assert set(tp["configs"]) == {"paper", "large", "mlp"}
    for key in ("users_scaling", "floor", "machine", "targets"):
        assert key in tp, key
    for r in tp["configs"].values():
        assert r["rmm_jax_qps"] > 0 and r["torch_qps"] > 0 and r["rmm_jax_compile_s"] > 0
        assert r["ratio_vs_torch"] == r["rmm_jax_qps"] / r["torch_qps"]       # the same float64 division
    assert tp["configs"]["paper"]["numpy_qps"] > 0
    assert all(r["seconds"] > 0 for r in tp["users_scaling"].values())
    assert tp["machine"]["bandwidth_GBps"] > 0 and tp["machine"]["matmul_GFLOPs"] > 0
    assert any(f.endswith(".png") and (tmp_path / "out" / f).stat().st_size > 0
               for f in os.listdir(tmp_path / "out"))
    # every target's verdict follows from its value, and the report prints each one
    log = (tmp_path / "out" / summary["benchmarks"][0]["json"].replace(".json", ".log")).read_text()
    for t in tp["targets"]:
        op, bound = t["target"].split()
        assert t["pass"] == (t["value"] >= float(bound) if op == ">=" else t["value"] <= float(bound)), t
        assert f"{'PASS' if t['pass'] else 'MISS'}  {t['name']}" in log
    vw = json.loads((tmp_path / "out" / summary["benchmarks"][1]["json"]).read_text())
    for res in vw["results"].values():
        assert res["vw"]["queries_per_s"]["median"] > 0 and res["rmm_jax"]["queries_per_s"]["median"] > 0


def _toy_stream(uid: str, t: int, n: int, d: int, k: int, seed: int):
    from rmm_jax.online.streams import Stream
    rng = np.random.default_rng(seed)
    bank = rng.normal(size=(n, d)).astype(np.float32)
    bank /= np.linalg.norm(bank, axis=1, keepdims=True)
    q = rng.normal(size=(t, d)).astype(np.float32)
    cand = np.argsort(-(q @ bank.T), 1)[:, :k].astype(np.int32)
    gold = rng.random((t, n)) < 0.15
    return Stream(uid, bank, q, cand, np.ones((t, k), bool), np.take_along_axis(gold, cand, 1),
                  gold.sum(1).astype(np.int32), gold.sum(1) > 0)


@pytest.mark.parametrize("negatives", ["shown", "all"])
def test_log_as_labels_makes_the_cited_shown_memories_the_gold(negatives):
    """Each call's cited memories (of the filled shown slots) become its gold, against the
    shown memories or all K; a call that cited nothing is dropped. Checked call by call
    against a loop over the slots."""
    s = _toy_stream("u", 40, 30, 6, 8, seed=1)
    rng = np.random.default_rng(2)
    sel = np.stack([rng.permutation(8)[:3] for _ in range(40)]).astype(np.int32)
    sel[rng.random(sel.shape) < 0.2] = -1                                       # unfilled slots
    cited = rng.random(sel.shape) < 0.4
    out = _common.log_as_labels(s, {"selected": sel, "cited": cited}, negatives)
    for t in range(40):
        want_gold = {int(j) for j, c in zip(sel[t], cited[t]) if j >= 0 and c}
        want_mask = {int(j) for j in sel[t] if j >= 0} if negatives == "shown" else set(range(8))
        assert set(np.flatnonzero(out.cand_gold[t]).tolist()) == want_gold
        assert set(np.flatnonzero(out.cand_mask[t]).tolist()) == want_mask
        assert bool(out.valid[t]) == bool(want_gold) and out.num_gold[t] == len(want_gold)
    np.testing.assert_array_equal(out.cand, s.cand)                             # the candidates stay


def test_run_chunk_ends_where_run_online_ends():
    """The benchmarks' chunk runner gives, per user, the prequential recall and the final
    reranker (shared part merged with the user's own) that the library's run_online records,
    in every scope."""
    streams = [_toy_stream(f"u{i}", 24 + 4 * i, 30, 6, 8, seed=10 + i) for i in range(3)]
    params = rj.init_reranker(jax.random.key(0), 6)
    for scope in ("user", "shared", "hybrid"):
        setting = rj.preset("default", k=8, m=3, lr=1e-2, scope=scope, rank=2 if scope == "hybrid" else None)
        program = rj.make_run(*setting, cite_fn=cm.oracle())
        finals, outputs, shared = _common.run_chunk(streams, program, params, seed=4)
        ref = rj.run_online(streams, program, params, seed=4, users_per_chunk=len(streams))
        for i, s in enumerate(streams):
            np.testing.assert_array_equal(np.asarray(outputs[s.user_id]["recall"]), ref.recall[s.user_id])
            own = jax.tree.map(lambda x, i=i: x[i], ref.states[0].params)
            want = program.layout.scope.merge(ref.shared.params, own)
            assert jax.tree.structure(finals[s.user_id]) == jax.tree.structure(want)
            for a, b in zip(jax.tree.leaves(finals[s.user_id]), jax.tree.leaves(want)):
                np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_memory_coordinates_score_as_the_narrow_reranker_until_they_learn():
    """learn_sweep's prior lever widens the embeddings with each memory's own coordinates. A
    linear reranker put in the corner of the wider maps (``with_prior``) scores every candidate
    as it scores the narrow stream (float64 reference, float32 bound); a bias written for one
    memory (the query map's entry from the constant to that memory's coordinate) moves that
    memory's score, and no other, by the bias times the scale."""
    import learn_sweep
    from helpers import params_of

    streams = [_toy_stream("a", 10, 30, 6, 8, seed=3), _toy_stream("b", 12, 25, 6, 8, seed=4)]
    narrow = jax.tree.map(lambda x: 0.1 * x, params_of(5, "linear", d=6))
    wide, params = learn_sweep.with_prior(streams, narrow, 20.0)
    wq, wm = (np.asarray(narrow[a]["W"]["kernel"], np.float64) for a in ("q_adapter", "m_adapter"))

    def reference(s, t, bias=None):  # the maps x' = x + x @ kernel, in float64
        q, m = s.queries[t].astype(np.float64), s.bank[s.cand[t]].astype(np.float64)
        out = (m + m @ wm) @ (q + q @ wq)
        return out if bias is None else out + bias

    for s, w in zip(streams, wide):
        assert w.bank.shape[1] == 6 + 30 + 1 and np.array_equal(w.cand, s.cand)
        for t in range(0, s.queries.shape[0], 3):
            args = (params, w.queries[t], w.bank[w.cand[t]])
            assert_f32_close(rj.score(*args), reference(s, t), f32_error(rj.score, *args))
    s, w = streams[1], wide[1]
    i = int(s.cand[0, 2])                                           # the third candidate of the first query
    kernel = np.array(params["q_adapter"]["W"]["kernel"])
    kernel[-1, 6 + i] = 0.25                                        # constant coordinate -> memory i's
    biased = {**params, "q_adapter": {"W": {"kernel": kernel}}}
    args = (biased, w.queries[0], w.bank[w.cand[0]])
    want = reference(s, 0, bias=np.where(np.arange(8) == 2, 0.25 * 20.0, 0.0))
    assert_f32_close(rj.score(*args), want, f32_error(rj.score, *args))


def test_the_hybrid_lever_steps_the_shared_part_as_its_rows_say():
    """learn_sweep's hybrid lever sets the shared part's step per row. Five users side by side
    (every one active, so the update multiplies the shared step by √5): ``shared_step`` 0 leaves
    the shared part exactly where it started while every user's factors learn; ``shared_step``
    √5 is the update's own rule, bit for bit the same run as both parts at the preset's rate
    through the same per-part optimiser; 0.5 moves the shared part less than that."""
    import learn_sweep

    streams = [_toy_stream(f"u{i}", 24, 40, 6, learn_sweep.K, seed=30 + i) for i in range(5)]
    params = rj.init_reranker(jax.random.key(0), 6)
    row = {"preset": "default", "scope": "hybrid", "rank": 2, "lr": 1e-2}

    def run(**extra):
        program = rj.make_run(*learn_sweep.setting_of({**row, **extra}), cite_fn=cm.oracle())
        return _common.run_chunk(streams, program, params, seed=2)

    def moved(r):   # how far the shared part went
        return sum(float(np.abs(np.asarray(a) - np.asarray(b)).sum())
                   for a, b in zip(jax.tree.leaves(r.shared), jax.tree.leaves(params)))

    frozen, half = run(shared_step=0.0), run(shared_step=0.5)
    rule = run(shared_step=float(learn_sweep.shared_step_multiple(5)))
    both = run(local_lr=1e-2)                                       # both parts at lr, one per-part optimiser
    assert moved(frozen) == 0.0
    for final in frozen.finals.values():                              # each user's B factors left 0
        b_factors = [x for path, x in jax.tree_util.tree_leaves_with_path(final) if getattr(path[-1], "key", "") == "b"]
        assert len(b_factors) == 2 and all(float(np.abs(np.asarray(x)).max()) > 0 for x in b_factors)
    for a, b in zip(jax.tree.leaves(rule.shared), jax.tree.leaves(both.shared)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    for uid in rule.outputs:
        np.testing.assert_array_equal(np.asarray(rule.outputs[uid]["recall"]), np.asarray(both.outputs[uid]["recall"]))
    assert 0.0 < moved(half) < moved(rule)


def test_the_steps_lever_sets_each_maps_rate_and_the_decay():
    """learn_sweep's steps lever: ``map_lr`` steps the query and memory maps at their own rates
    (a rate of 0 leaves that map where it started while the other learns), and ``decay`` at
    lr0 = the preset's rate is the constant rate, bit for bit the run of both maps at that rate."""
    import learn_sweep

    streams = [_toy_stream(f"u{i}", 24, 40, 6, learn_sweep.K, seed=40 + i) for i in range(2)]
    params = rj.init_reranker(jax.random.key(0), 6)
    row = {"preset": "default", "lr": 1e-2}

    def run(**extra):
        program = rj.make_run(*learn_sweep.setting_of({**row, **extra}), cite_fn=cm.oracle())
        return _common.run_chunk(streams, program, params, seed=3)

    def kernel(r, uid, adapter):
        return np.asarray(r.finals[uid][adapter]["W"]["kernel"])

    start = {a: np.asarray(params[a]["W"]["kernel"]) for a in ("q_adapter", "m_adapter")}
    only_m, only_q = run(map_lr=(0.0, 1e-2)), run(map_lr=(1e-2, 0.0))
    for uid in only_m.finals:
        np.testing.assert_array_equal(kernel(only_m, uid, "q_adapter"), start["q_adapter"])
        assert not np.array_equal(kernel(only_m, uid, "m_adapter"), start["m_adapter"])
        np.testing.assert_array_equal(kernel(only_q, uid, "m_adapter"), start["m_adapter"])
        assert not np.array_equal(kernel(only_q, uid, "q_adapter"), start["q_adapter"])
    flat, both = run(decay=(1e-2, 5.0)), run(map_lr=(1e-2, 1e-2))
    faster = run(decay=(1e-1, 5.0))
    for uid in flat.finals:
        for a in ("q_adapter", "m_adapter"):
            np.testing.assert_array_equal(kernel(flat, uid, a), kernel(both, uid, a))
        assert not np.array_equal(kernel(faster, uid, "m_adapter"), kernel(flat, uid, "m_adapter"))


@pytest.mark.parametrize("scope", ["user", "shared"])
def test_full_information_learns_as_a_numpy_loop(scope):
    """learn_sweep's bound lever: a reranker learning online from every candidate's gold. Against
    a NumPy loop written here (scores, greedy top M, the listwise gradient by hand, Adam): each
    batch is scored before the step that learns from it, and the prequential recalls agree query
    for query. At lr 0 they are the retriever's own; at the test's lr learning changes them. (No
    top-M boundary in the reference is closer than 1e-4, so float32 rounding cannot flip one.)"""
    import learn_sweep

    from rmm_jax.online.summary import base_values

    streams = [_toy_stream("a", 42, 30, 6, 8, seed=5), _toy_stream("b", 37, 25, 6, 8, seed=6)]
    streams[1].valid[3] = False                                      # an invalid query teaches nothing
    params = rj.init_reranker(jax.random.key(0), 6)
    m, b, tau, lr = learn_sweep.M, 4, learn_sweep.BOUND_TAU, 3e-2

    def reference(lr):
        ps = [ref_numpy.init(6) for _ in streams] if scope == "user" else [ref_numpy.init(6)]
        opts = [ref_numpy.Adam(p, lr) for p in ps]
        out = {s.user_id: [] for s in streams}
        for t0 in range(0, max(s.queries.shape[0] for s in streams), b):
            grads = []
            for i, s in enumerate(streams):
                p = ps[i if scope == "user" else 0]
                q, mm = s.queries[t0:t0 + b], s.bank[s.cand[t0:t0 + b]]
                gold = s.cand_gold[t0:t0 + b] & s.valid[t0:t0 + b, None]
                if not len(q):
                    grads.append(None)
                    continue
                scores, qp = ref_numpy.forward(p, q, mm, fused=False)
                ranked = np.sort(scores, 1)[:, ::-1]
                assert np.all(ranked[:, m - 1] - ranked[:, m] > 1e-4)
                top = ref_numpy.top_m(scores, m, np.ones_like(gold))
                hits = np.take_along_axis(gold, top, 1).sum(1)
                num = s.num_gold[t0:t0 + b]
                out[s.user_id] += np.where(num > 0, hits / np.maximum(num, 1), 0.0).tolist()
                z = scores / np.float32(tau)
                prob = np.exp(z - z.max(1, keepdims=True))
                prob /= prob.sum(1, keepdims=True)
                n = gold.sum(1, keepdims=True)
                ds = np.where(n > 0, prob - gold / np.maximum(n, 1), 0.0) / np.float32(tau)    # per query, summed
                grads.append((ds.astype(np.float32), q, mm, qp, int((n > 0).sum())))
            groups = [[g] for g in grads] if scope == "user" else [grads]
            for p, opt, group in zip(ps, opts, groups):
                group = [g for g in group if g is not None]
                if not group:
                    continue
                n_has = max(sum(g[4] for g in group), 1)
                total = {"A": np.zeros((6, 6), np.float32), "B": np.zeros((6, 6), np.float32)}
                for ds, q, mm, qp, _ in group:
                    u = np.einsum("bk,bkd->bd", ds / n_has, mm)
                    total["A"] += (u + u @ p["B"].T).T @ q
                    total["B"] += qp.T @ u
                opt.step(p, total)
        return out

    still = learn_sweep.full_information(streams, params, 0.0, scope)
    learned = learn_sweep.full_information(streams, params, lr, scope)
    want = reference(lr)
    for s in streams:
        np.testing.assert_array_equal(still[s.user_id], base_values(s, m)[0])
        np.testing.assert_allclose(learned[s.user_id], want[s.user_id], rtol=0, atol=1e-6)
    assert any(not np.array_equal(learned[s.user_id], still[s.user_id]) for s in streams)


def test_the_anchor_lever_pulls_each_user_back_to_its_start():
    """learn_sweep's anchor lever: ``pull_to_start`` at fraction 0 is plain Adam, bit for bit;
    at fraction 1 with no gradient an update lands back on the parameters the optimiser was
    initialised with (to float32 rounding); and in a run from a nonzero start, a pull keeps every user's final
    parameters nearer that start than Adam alone leaves them."""
    import learn_sweep
    import optax

    start = jax.tree.map(lambda x: x + 0.05, rj.init_reranker(jax.random.key(1), 6))
    grads = jax.tree.map(lambda x: jnp.full_like(x, 0.3), start)
    tx, adam = optax.chain(optax.adam(1e-2), learn_sweep.pull_to_start(0.0)), optax.adam(1e-2)
    got, _ = tx.update(grads, tx.init(start), start)
    ref, _ = adam.update(grads, adam.init(start), start)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(ref)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    pull = learn_sweep.pull_to_start(1.0)
    moved = jax.tree.map(lambda x: x + 1.0, start)
    upd, _ = pull.update(jax.tree.map(jnp.zeros_like, start), pull.init(start), moved)
    for a, b in zip(jax.tree.leaves(optax.apply_updates(moved, upd)), jax.tree.leaves(start)):
        # three float32 roundings of values below 2 (p − p0, the scaled step, the sum): ≤ 3 · 2⁻²³
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=0, atol=3 * 2.0 ** -23)

    streams = [_toy_stream(f"u{i}", 24, 40, 6, learn_sweep.K, seed=50 + i) for i in range(2)]
    row = {"preset": "default", "lr": 1e-2}

    def distance(**extra):
        program = rj.make_run(*learn_sweep.setting_of({**row, **extra}), cite_fn=cm.oracle())
        finals = _common.run_chunk(streams, program, start, seed=4).finals
        return [sum(float(np.abs(np.asarray(a) - np.asarray(b)).sum())
                    for a, b in zip(jax.tree.leaves(f), jax.tree.leaves(start))) for f in finals.values()]

    free, pulled = distance(), distance(anchor=0.2)
    assert all(0 < p < f for p, f in zip(pulled, free)), (pulled, free)


def test_the_start_check_learns_from_the_pairs_it_names_and_scores_26_and_30_only(tmp_path):
    """peer_vw's start check: the first row's starts learn from 26 and 30's pairs, the second's
    from every conversation's; both are scored on 26 and 30's questions only. Its retriever
    baseline is checked against a NumPy top-M over the candidates' dot products, and its VW
    values against VW's start trained and scored on exactly those pairs and questions."""
    require_vw()
    k, m = 8, 3
    streams = [_toy_stream(u, 20, 30, 6, k, seed=60 + i) for i, u in enumerate(("26", "30", "41"))]
    dialogue = [_toy_stream(u, 12, 30, 6, k, seed=70 + i) for i, u in enumerate(("26", "30", "41"))]
    start = peer_vw.VWStart(0.3, 1, False)
    out = peer_vw.start_check(streams, dialogue, start, bits=18, tau=0.1, m=m, seeds=[0], folder=tmp_path,
                              log=lambda _: None)
    assert [r["pairs"] for r in out["rows"]] == [24, 36]

    def numpy_base(ss):
        got = []
        for s in ss:
            for t in np.flatnonzero(s.valid):
                scores = s.bank[s.cand[t]] @ s.queries[t]
                top = np.argsort(-scores, kind="stable")[:m]
                got.append(s.cand_gold[t][top].sum() / s.num_gold[t])
        return float(np.mean(got))

    assert abs(out["base"] - numpy_base(streams[:2])) < 1e-6
    for row, pairs in zip(out["rows"], (dialogue[:2], dialogue)):
        path = peer_vw.vw_dialogue_start(pairs, start, bits=18, tau=0.1, path=tmp_path / "again.vw")
        assert row["vw"] == peer_vw.vw_frozen_recall(path, streams[:2], bits=18, tau=0.1, m=m)


def test_without_speakers_strips_each_turns_own_name_and_nothing_else():
    """transfer.py --no-speakers: each turn loses exactly its own ``"speaker: "`` prefix (a
    caption after the text stays; a name inside the text stays; a turn that does not begin
    with its name is unchanged), and questions are untouched."""
    from rmm_jax.data.locomo import turn_text
    from rmm_jax.data.types import Dataset, Query, Session, Turn, User

    turns = (Turn("D1:1", "s1", "Ann", turn_text("Ann", "Bob: did you see Bob?", None)),
             Turn("D1:2", "s1", "Bob", turn_text("Bob", "Here it is.", "a photo of a dog")),
             Turn("D1:3", "s1", "Bob", "Ann: not Bob's name first"))
    q = Query("q1", "What did Ann ask Bob?", ("D1:1",))
    out = _common.without_speakers(Dataset("locomo", (User("u", (Session("s1", None, turns),), (q,)),)))
    got = [t.text for t in out.users[0].sessions[0].turns]
    assert got[0] == "Bob: did you see Bob?"
    assert got[1] == turn_text("Bob", "Here it is.", "a photo of a dog")[len("Bob: "):] and "dog" in got[1]
    assert got[2] == "Ann: not Bob's name first"
    assert out.users[0].queries == (q,)
