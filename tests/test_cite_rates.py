"""`rmm-jax cite-rates`: a generator's citation rates against gold, from its log.

The counts are checked against a brute-force count over the log's JSON and the store's
gold (every gold source: the store's questions, a record's own `gold`, calls without
any); the rates of the class-calibrated simulator are recovered inside their intervals;
a generator whose citations carry nothing gets no correction; misuse is one line."""
from __future__ import annotations

import json

import numpy as np
import pytest
from conftest import make_fake_store, run_cli

from rmm_jax.cli.main import main
from rmm_jax.data.citations import P_OTHER, P_USEFUL
from rmm_jax.data.store import open_store
from rmm_jax.online.cite_rates import ADVISE_FROM, advice
from rmm_jax.persist.policy_setting import read_setting
from rmm_jax.persist.policy_store import PolicyStore

SIM = ["--k", "10", "--m", "4", "--users-per-chunk", "4", "--checkpoint-every", "0", "--seed", "5"]


@pytest.fixture(scope="module")
def logged(tmp_path_factory):
    """A store of 8 users and a class-calibrated simulated log of every question."""
    root = tmp_path_factory.mktemp("rates")
    store = make_fake_store(root / "store", users=8, sessions=6, turns=8)
    try:
        main([str(a) for a in ("simulate", store, "--policies", root / "pol", "--log-out", root / "sim.jsonl", *SIM)])
    except SystemExit as e:
        assert e.code in (0, None), e.code
    return root, store


def rates(capsys, store, log, *extra):
    code, out, err = run_cli(capsys, "cite-rates", store, "--log", log, "--json", *extra)
    assert code == 0, err
    return json.loads(out)


def brute_force(store_path, records):
    """(gold cited, gold shown, other cited, other shown) by hand: the store's gold for
    its questions, else the record's; calls without gold are not counted."""
    st = open_store(store_path)
    tally = np.zeros(4, int)
    counted = 0
    for r in records:
        gold = None
        if st.has_user(r["user_id"]) and r.get("query_id") in st.user(r["user_id"]).query_ids:
            u = st.user(r["user_id"])
            row = list(u.query_ids).index(r["query_id"])
            gold = {m for m, g in zip(u.memory_ids, u.gold[row]) if g} if not u.abstention[row] else None
        elif r.get("gold"):
            gold = set(r["gold"])
        if not gold:
            continue
        counted += 1
        for m in r["selected"]:
            tally += [m in gold and m in r["cited"], m in gold, m not in gold and m in r["cited"], m not in gold]
    return counted, tally


def test_counts_match_a_brute_force_count_over_every_gold_source(logged, capsys):
    root, store = logged
    records = [json.loads(line) for line in open(root / "sim.jsonl")]
    # calls the store does not hold: two with their own gold among text candidates, one without gold
    texts = [{"id": f"x{i}", "text": f"a new memory number {i}"} for i in range(6)]
    extra = [
        {"user_id": "user0", "query": "what is new?", "candidates": texts, "selected": ["x0", "x1", "x2"],
         "cited": ["x0", "x2"], "log_prob": -1.0, "gold": ["x0", "x1"]},
        {"user_id": "newcomer", "query": "and now?", "candidates": texts, "selected": ["x3", "x4"],
         "cited": ["x4"], "log_prob": -1.0, "gold": ["x5"]},
        {"user_id": "user1", "query": "no gold here", "candidates": texts, "selected": ["x1", "x2"],
         "cited": ["x1"], "log_prob": -1.0},
    ]
    log = root / "mixed.jsonl"
    log.write_text("".join(json.dumps(r) + "\n" for r in records + extra))
    got = rates(capsys, store, log)
    counted, (gc, gs, oc, os_) = brute_force(store, [{**r, "candidates": [c["id"] if isinstance(c, dict) else c
                                                                         for c in r["candidates"]]}
                                                     for r in records + extra])
    assert got["calls"] == len(records) + 3 and got["calls_with_gold"] == counted == len(records) + 2
    assert (got["p_useful"]["cited"], got["p_useful"]["shown"]) == (gc, gs)
    assert (got["p_other"]["cited"], got["p_other"]["shown"]) == (oc, os_)
    assert got["p_useful"]["value"] == round(gc / gs, 4) and got["p_other"]["value"] == round(oc / os_, 4)
    split = got["p_other_when_gold_shown"], got["p_cite_when_no_gold_shown"]
    assert sum(s["cited"] for s in split) == oc and sum(s["shown"] for s in split) == os_
    assert got["users"] == 9 and got["resampled"] == ["user", "call"]
    for key in ("p_useful", "p_other"):
        assert got[key]["lo"] <= got[key]["value"] <= got[key]["hi"]
    # --users: only theirs, counted the same way
    mine = rates(capsys, store, log, "--users", "user0,user3")
    counted, (gc, gs, _, _) = brute_force(store, [r for r in records + extra[:1] if r["user_id"] in ("user0", "user3")])
    assert mine["calls_with_gold"] == counted and (mine["p_useful"]["cited"], mine["p_useful"]["shown"]) == (gc, gs)


def test_the_class_calibrated_simulators_rates_are_recovered_and_not_corrected(logged, capsys):
    """The paper's judge rates (0.911, 0.154) are recovered; at them the default learned as well
    uncorrected on the LoCoMo grid, so the advice is to leave it uncorrected."""
    root, store = logged
    got = rates(capsys, store, root / "sim.jsonl")
    assert got["p_useful"]["lo"] <= P_USEFUL <= got["p_useful"]["hi"], got["p_useful"]
    assert got["p_other"]["lo"] <= P_OTHER <= got["p_other"]["hi"], got["p_other"]
    assert got["apart"] and got["p_other"]["value"] < ADVISE_FROM["p_other"]
    assert got["advice"] == "uncorrected" and got["options"] is None
    code, out, _ = run_cli(capsys, "cite-rates", store, "--log", root / "sim.jsonl")
    assert out.startswith(f"{got['calls_with_gold']} of {got['calls']} calls have gold (8 users); "), out
    last = out.strip().splitlines()[-1]
    assert last.startswith("no correction is advised: on the LoCoMo grid's tuning conversations correcting"), out
    code, one, _ = run_cli(capsys, "cite-rates", store, "--log", root / "sim.jsonl", "--users", "user0")
    assert code == 0 and " gold (1 user); " in one.splitlines()[0], one     # not "(1 users)"


def recited(root, store, name: str, p_useful: float, p_other: float, seed: int = 0):
    """sim.jsonl with every shown memory cited afresh: a gold one at ``p_useful``, any other at
    ``p_other`` (a generator with those rates), against the store's gold."""
    st = open_store(store)
    rng = np.random.default_rng(seed)
    out = []
    for line in open(root / "sim.jsonl"):
        r = json.loads(line)
        u = st.user(r["user_id"])
        row = list(u.query_ids).index(r["query_id"])
        gold = {m for m, g in zip(u.memory_ids, u.gold[row]) if g}
        out.append({**r, "cited": [m for m in r["selected"] if rng.random() < (p_useful if m in gold else p_other)]})
    path = root / name
    path.write_text("".join(json.dumps(r) + "\n" for r in out))
    return path


def test_a_generator_that_cites_others_often_is_advised_the_correction_and_it_runs(logged, capsys):
    """At 0.9 and 0.4 (inside ADVISE_FROM, apart) the advice is to correct, the options are the
    measured rates, and a learning verb takes them as printed, with the default preset."""
    root, store = logged
    log = recited(root, store, "noisy.jsonl", 0.9, 0.4)
    got = rates(capsys, store, log)
    useful, other = got["p_useful"]["value"], got["p_other"]["value"]
    assert got["p_useful"]["lo"] <= 0.9 <= got["p_useful"]["hi"] and got["p_other"]["lo"] <= 0.4 <= got["p_other"]["hi"]
    assert got["advice"] == "correct" and got["options"] == f"--p-useful {useful} --p-other {other}"
    code, out, _ = run_cli(capsys, "cite-rates", store, "--log", log)
    last = out.strip().splitlines()[-1]
    assert code == 0 and last == f"to correct the default's logistic loss for them: {got['options']}", last
    code, _, err = run_cli(capsys, "replay", store, "--log", log, "--policies", root / "advised",
                           *got["options"].split(), "--k", "10", "--m", "4", "--checkpoint-every", "0")
    assert code == 0, err
    setting = read_setting(PolicyStore.open(root / "advised"))
    assert setting["preset"] == "default", setting
    assert (setting["estimator"]["p_useful"], setting["estimator"]["p_other"]) == (useful, other), setting


@pytest.mark.parametrize("useful, other, apart, want", [
    (0.9, 0.3, True, "correct"), (0.65, 0.25, True, "correct"), (0.64, 0.5, True, "uncorrected"),
    (0.9, 0.24, True, "uncorrected"), (0.9, 0.3, False, "overlap"), (0.3, 0.3, False, "uninformative"),
    (0.2, 0.3, True, "uninformative"), (None, 0.3, False, "unmeasured"), (0.8, None, False, "unmeasured")])
def test_the_advice_follows_where_the_correction_paid(useful, other, apart, want):
    assert advice(useful, other, apart) == want


def test_citations_that_ignore_gold_get_no_correction(logged, capsys):
    """The same log with each shown memory cited at random (rate 0.3), gold or not."""
    root, store = logged
    log = root / "blind.jsonl"
    rng = np.random.default_rng(0)
    recs = [json.loads(line) for line in open(root / "sim.jsonl")]
    log.write_text("".join(json.dumps({**r, "cited": [m for m in r["selected"] if rng.random() < 0.3]}) + "\n"
                           for r in recs))
    got = rates(capsys, store, log)
    assert not got["apart"] and got["options"] is None and got["advice"] in ("overlap", "uninformative"), got
    assert got["p_useful"]["lo"] <= 0.3 <= got["p_useful"]["hi"] and got["p_other"]["lo"] <= 0.3 <= got["p_other"]["hi"]
    code, out, _ = run_cli(capsys, "cite-rates", store, "--log", log)
    last = out.strip().splitlines()[-1]
    assert code == 0 and ("no correction" in last or "say nothing" in last), last


def test_a_misspelt_gold_key_is_noted_on_the_no_gold_error_line(logged, capsys):
    """A log whose gold sits under a misspelt key (`glod`, a swap difflib's ratio misses in a
    4-letter key) has no call with gold: the note naming the key is on that error's line,
    which is the one run where the user needs it (it was printed only after a measurement),
    and bad input stays one line, as evaluate's missing log_prob with its note is (it was a
    note line, then the error line)."""
    root, store = logged
    log = root / "glod.jsonl"
    log.write_text(json.dumps({"user_id": "user0", "query": "q?", "candidates": [{"id": "x", "text": "t"}],
                               "selected": ["x"], "cited": ["x"], "log_prob": 0.0, "glod": ["x"]}) + "\n")
    code, out, err = run_cli(capsys, "cite-rates", store, "--log", log)
    assert code == 2 and out == "", err
    assert err.splitlines() == [
        f"error: {log}: none of its 1 call has gold (STORE's, for a question it holds, or the record's `gold`): "
        f"nothing to measure the citations against; note: {log}:1: key 'glod' is not a log key and was ignored "
        "(did you mean 'gold'?)"], err


def test_a_log_without_gold_and_bad_options_are_one_line(logged, capsys):
    root, store = logged
    log = root / "nogold.jsonl"
    log.write_text(json.dumps({"user_id": "user0", "query": "q?", "candidates": [{"id": "x", "text": "t"}],
                               "selected": ["x"], "cited": ["x"], "log_prob": 0.0}) + "\n")
    for args, where in (([log], str(log)), ([root / "sim.jsonl", "--users", "zed"], "--users"),
                        ([root / "sim.jsonl", "--bootstrap", "0"], "--bootstrap")):
        code, out, err = run_cli(capsys, "cite-rates", store, "--log", *args)
        assert code == 2 and out == "" and len(err.strip().splitlines()) == 1, err
        assert err.startswith(f"error: {where}"), err


def test_count_calls_refuses_a_store_path_or_a_str_of_users_by_name(logged):
    """count_calls("stores/mine", log), as docs/api.md's count_calls(store, log) reads, was an
    AttributeError ('str' object has no attribute 'user_ids'), and users="user0" was read
    letter by letter ("user 'u' has no record")."""
    from rmm_jax.errors import InputError
    from rmm_jax.online.cite_rates import count_calls

    root, store = logged
    log = root / "sim.jsonl"
    with pytest.raises(InputError, match=r"^store: expected an embedding store, open_store\(path\), got str "):
        count_calls(str(store), log)
    st = open_store(store)
    for users in ("user0", ["user0", 3]):
        with pytest.raises(InputError, match=r"^users: expected a list of user ids \(str\), got "):
            count_calls(st, log, users=users)
    assert count_calls(st, log, users=["user0"]).user_ids == ["user0"]


def test_count_calls_returns_its_read_report_and_its_old_report_parameter_warns(logged):
    """count_calls filled a ``report=`` dict in place; the read report is now its
    CallCounts' ``read`` (a ReadReport), and the parameter still fills the dict, with a
    DeprecationWarning."""
    from rmm_jax.online.cite_rates import count_calls

    root, store = logged
    st = open_store(store)
    counts = count_calls(st, root / "sim.jsonl")
    assert counts.read.records == counts.calls and counts.read.skipped == 0 and counts.read.skipped_line() is None
    report = {}
    with pytest.warns(DeprecationWarning, match=r"^count_calls\(report=\.\.\.\) is deprecated: read the returned "):
        count_calls(st, root / "sim.jsonl", report=report)
    assert report == counts.read._asdict()


def test_from_python_a_user_with_no_record_names_the_argument(logged):
    """count_calls(st, log, users=["zed"]) and scan_log(log, layout, users=["zed"]) said
    "--users: user 'zed' has no record": the CLI's option, to a Python caller. They name the
    argument; `cite-rates` and `replay` still say --users (above, tests/test_bad_input.py)."""
    from rmm_jax.core.config import Layout
    from rmm_jax.errors import InputError
    from rmm_jax.online.cite_rates import count_calls
    from rmm_jax.online.streams import scan_log

    root, store = logged
    log = root / "sim.jsonl"
    with pytest.raises(InputError, match=r"^users: user 'zed' has no record in "):
        count_calls(open_store(store), log, users=["user0", "zed"])
    with pytest.raises(InputError, match=r"^users: user 'zed' has no record in "):
        scan_log(log, Layout(k=10, m=4), users=["user0", "zed"])
    assert scan_log(log, Layout(k=10, m=4), users=["user0"]).user_ids == ["user0"]


def test_users_empty_or_repeated_is_refused_by_name(logged):
    """count_calls(st, log, users=[]) counted every user's calls and scan_log(..., users=[])
    replayed every user, while a repeated id (users=["user0", "user0"]) was taken silently;
    load_streams counted such a user twice. Both are refused by name, as every reader of users
    refuses them (check_user_list)."""
    from rmm_jax.core.config import Layout
    from rmm_jax.errors import InputError
    from rmm_jax.online.cite_rates import count_calls
    from rmm_jax.online.streams import scan_log

    root, store = logged
    log = root / "sim.jsonl"
    st = open_store(store)
    for users, msg in (([], "is empty; give None for every user"),
                       (["user0", "user0"], "user id 'user0' is given twice"),
                       ("user0", r"expected a list of user ids \(str\), got str 'user0'")):
        with pytest.raises(InputError, match=rf"^users: {msg}"):
            count_calls(st, log, users=users)
        with pytest.raises(InputError, match=rf"^users: {msg}"):
            scan_log(log, Layout(k=10, m=4), users=users)


@pytest.mark.parametrize("counts", [{}, None, [1, 2]])
def test_cite_rates_refuses_what_is_not_call_counts_by_name(counts):
    """cite_rates({}) was an AttributeError ('dict' object has no attribute 'users')."""
    from rmm_jax.errors import InputError
    from rmm_jax.online.cite_rates import cite_rates

    with pytest.raises(InputError, match=r"^c: expected CallCounts, count_calls\(store, log_path\), got "):
        cite_rates(counts)


def _calls(gold: list[tuple[int, int]], other: list[tuple[int, int]]):
    """CallCounts of one user's calls: each call's (gold cited, gold shown) and (other cited,
    other shown)."""
    from rmm_jax.online.cite_rates import call_row, counts_of

    rows = [call_row([True] * gs + [False] * os, [True] * gc + [False] * (gs - gc) + [True] * oc + [False] * (os - oc))
            for (gc, gs), (oc, os) in zip(gold, other)]
    return counts_of([0] * len(rows), rows, ["user0"], len(rows))


def _binomial_tail_bound(cited: int, shown: int, tail: float, upper: bool) -> float:
    """The Clopper-Pearson bound by brute force, independent of the module: bisection on a
    sum of binomial terms (P(X >= cited) = tail for the lower bound, P(X <= cited) = tail for
    the upper)."""
    from math import comb

    def cdf(k, p):
        return sum(comb(shown, i) * p ** i * (1 - p) ** (shown - i) for i in range(k + 1))

    lo, hi = 0.0, 1.0
    for _ in range(60):
        p = (lo + hi) / 2
        f = cdf(cited, p) if upper else 1 - cdf(cited - 1, p)   # upper: falls with p; lower: rises
        if (f > tail) == upper:
            lo = p
        else:
            hi = p
    return (lo + hi) / 2


@pytest.mark.parametrize("level", [0.9, 0.95, 0.99])
@pytest.mark.parametrize("cited,shown", [(7, 7), (0, 7), (1, 1), (0, 1), (3, 10), (10, 53), (45, 45), (1, 60)])
def test_exact_interval_matches_an_independent_binomial_computation(cited, shown, level):
    from rmm_jax.online.cite_rates import exact_interval

    lo, hi = exact_interval(cited, shown, level)
    tail = (1 - level) / 2
    want_lo = 0.0 if cited == 0 else _binomial_tail_bound(cited, shown, tail, upper=False)
    want_hi = 1.0 if cited == shown else _binomial_tail_bound(cited, shown, tail, upper=True)
    assert lo == pytest.approx(want_lo, abs=1e-9) and hi == pytest.approx(want_hi, abs=1e-9)
    try:
        from scipy.stats import beta
    except ImportError:   # jax requires scipy, but the brute force above suffices
        return
    assert lo == pytest.approx(0.0 if cited == 0 else beta.ppf(tail, cited, shown - cited + 1), abs=1e-9)
    assert hi == pytest.approx(1.0 if cited == shown else beta.ppf(1 - tail, cited + 1, shown - cited), abs=1e-9)


def test_all_cited_or_none_cited_is_not_a_zero_width_interval():
    """7 of 7 gold memories cited over 7 calls read [1.0000, 1.0000]: every bootstrap resample
    of calls gives 1 when every trial agrees, and 0 of n gave [0, 0]. Each bound is now at
    least the exact binomial one: 7 of 7 at 95% is [0.5904, 1]."""
    from rmm_jax.online.cite_rates import cite_rates

    r = cite_rates(_calls([(1, 1)] * 7, [(0, 4)] * 7), n_boot=200)
    assert (r["p_useful"]["value"], r["p_useful"]["lo"], r["p_useful"]["hi"]) == (1.0, 0.5904, 1.0)
    other = r["p_other"]                     # 0 of 28: upper bound 1 - 0.025 ** (1 / 28)
    assert (other["value"], other["lo"]) == (0.0, 0.0) and other["hi"] == round(1 - 0.025 ** (1 / 28), 4) > 0.1
    r99 = cite_rates(_calls([(1, 1)] * 7, [(0, 4)] * 7), n_boot=200, level=0.99)
    assert r99["p_useful"]["lo"] == round(0.005 ** (1 / 7), 4) < 0.5904


def test_a_correction_is_not_advised_from_a_zero_width_interval():
    """2 of 2 gold memories cited and 0 of 20 others: the bootstrap's [1, 1] and [0, 0] were
    'apart', and a correction --p-useful 1.0 --p-other 0.0 was advised from two gold memories.
    The exact bounds (2 of 2: lo 0.158; 0 of 20: hi 0.168) overlap: no correction."""
    from rmm_jax.online.cite_rates import cite_rates

    r = cite_rates(_calls([(1, 1), (1, 1)] + [(0, 0)] * 2, [(0, 5)] * 4), n_boot=200)
    assert r["p_useful"]["lo"] < r["p_other"]["hi"]
    assert (r["apart"], r["options"]) == (False, None)


def test_a_wider_bootstrap_interval_is_kept_over_the_exact_one():
    """Trials clustered in calls (each call cites all of its 10 gold memories or none, 20
    calls): the bootstrap over calls is wider than the binomial interval of 100 of 200
    trials taken as independent, and it is kept."""
    from rmm_jax.online.cite_rates import cite_rates, exact_interval

    c = _calls([(10, 10)] * 10 + [(0, 10)] * 10, [(1, 5)] * 20)
    r = cite_rates(c, n_boot=2000)["p_useful"]
    exact_lo, exact_hi = exact_interval(100, 200)
    assert (r["cited"], r["shown"], r["value"]) == (100, 200, 0.5)
    assert r["lo"] < exact_lo - 0.05 and r["hi"] > exact_hi + 0.05      # about [0.28, 0.72] against [0.43, 0.57]
