"""`rmm-jax embed` and `rmm-jax retrieve`, run in-process through rmm_jax.cli.main.main."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
from conftest import locomo_dir, run_cli
from helpers import assert_f32_close, f32_error

from rmm_jax.cli.main import main
from rmm_jax.core import metrics

MODEL_ID = "sentence-transformers/all-MiniLM-L6-v2"


run = run_cli


TURNS = [
    ("Ann", "I just adopted a golden retriever puppy named Max."),
    ("Bob", "Congrats! I have been training for the city marathon."),
    ("Ann", "My sister moved to Lisbon for a new job in biotech."),
    ("Bob", "I painted a sunset over the lake last weekend."),
    ("Ann", "We are renovating the kitchen with blue tiles."),
    ("Bob", "My favourite band is playing a concert in June."),
    ("Ann", "I started learning the cello three months ago."),
    ("Bob", "Our team won the regional chess tournament."),
]


def write_locomo(path: Path, with_bad_evidence: bool = False) -> Path:
    """A tiny LoCoMo-layout conversation: 2 sessions x 4 turns, 4 questions.

    Each question is the exact text of its evidence turn, so the retriever must put the
    gold turn first: Recall@k = MRR = 1 for every question.
    """
    conv = {"speaker_a": "Ann", "speaker_b": "Bob", "qa": []}
    for s in (1, 2):
        conv[f"session_{s}_date_time"] = f"1:00 pm on {s} May, 2023"
        conv[f"session_{s}"] = [
            {"speaker": sp, "dia_id": f"D{s}:{t + 1}", "text": txt}
            for t, (sp, txt) in enumerate(TURNS[(s - 1) * 4: s * 4])]
    for i in (0, 3, 5, 6):
        s, t = divmod(i, 4)
        sp, txt = TURNS[i]
        conv["qa"].append({"question": f"{sp}: {txt}", "answer": "x",
                           "evidence": [f"D{s + 1}:{t + 1}"], "category": 1 + i % 4})
    path.write_text(json.dumps(conv))
    return path


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("cli-cache")


@pytest.fixture(autouse=True)
def _isolated_cache(monkeypatch, cache_dir):
    monkeypatch.setenv("RMM_JAX_CACHE", str(cache_dir))


@pytest.fixture(scope="module")
def tiny_store(tmp_path_factory):
    """A store of the tiny conversation, built once through the CLI."""
    d = tmp_path_factory.mktemp("tiny")
    data = write_locomo(d / "7.json")
    out = d / "store"
    try:
        main(["embed", f"locomo:{data}", "--out", str(out), "--quiet"])
    except SystemExit as e:
        assert e.code in (0, None)
    return out


def no_leftovers(parent: Path, name: str) -> bool:
    return not any(p.name == name or p.name.startswith(f".{name}.") for p in parent.iterdir())


# --------------------------------------------------------------------------- help
def test_help_teaches(capsys):
    code, out, _ = run(capsys, "embed", "--help")
    out = " ".join(out.split())                      # independent of the terminal width
    assert code == 0 and "Examples:" in out and "rmm-jax embed jsonl:examples/chat_history.jsonl" in out
    assert "`locomo:PATH`" in out                    # every dataset scheme is named
    assert "[default: turn]" in out and "[default: all-MiniLM-L6-v2]" in out
    code, out, _ = run(capsys, "retrieve", "--help")
    out = " ".join(out.split())
    assert code == 0 and "Examples:" in out and "[default: 20;" in out


# --------------------------------------------------------------------------- embed
def test_embed_json_and_cache(capsys, tmp_path, cache_dir):
    data = write_locomo(tmp_path / "7.json")
    out = tmp_path / "store"
    code, stdout, stderr = run(capsys, "embed", f"locomo:{data}", "--out", out, "--json",
                               "--cache-dir", tmp_path / "own-cache")
    assert code == 0, stderr
    rep = json.loads(stdout)                         # one parseable object; info went to stderr
    assert rep["format"] == "rmm-jax-embedding-store" and rep["model"] == MODEL_ID
    assert rep["counts"] == {"users": 1, "memories": 8, "queries": 4}
    # 8 turns + 4 questions, but each question is a turn's exact text: embedded once
    assert rep["granularity"] == "turn" and rep["texts_embedded"] == 8
    assert "wrote" in stderr
    # a re-run (other granularity) embeds nothing twice: turns and questions are cached
    code, stdout, _ = run(capsys, "embed", f"locomo:{data}", "--out", tmp_path / "s2", "--json",
                          "--cache-dir", tmp_path / "own-cache", "--granularity", "segment")
    assert code == 0 and json.loads(stdout)["texts_embedded"] <= 2   # only merged segment texts
    code, stdout, _ = run(capsys, "embed", f"locomo:{data}", "--out", out, "--json",
                          "--cache-dir", tmp_path / "own-cache")
    assert code == 0 and json.loads(stdout)["texts_embedded"] == 0


def test_embed_into_refuses_a_segment_threshold_it_would_ignore(capsys, tmp_path):
    data = write_locomo(tmp_path / "7.json")
    code, _, err = run(capsys, "embed", f"locomo:{data}", "--out", tmp_path / "s", "--quiet")
    assert code == 0, err
    before = sorted((p.name, p.read_bytes()) for p in (tmp_path / "s").iterdir())
    code, out, err = run(capsys, "embed", f"locomo:{data}", "--into", tmp_path / "s", "--segment-threshold", "0.4")
    assert code == 2 and out == "" and err.count("\n") == 1, err
    assert "--segment-threshold: only --granularity segment reads it; an append keeps" in err
    assert sorted((p.name, p.read_bytes()) for p in (tmp_path / "s").iterdir()) == before


def test_embed_session_granularity(capsys, tmp_path):
    data = write_locomo(tmp_path / "7.json")
    code, stdout, _ = run(capsys, "embed", f"locomo:{data}", "--out", tmp_path / "s",
                          "--granularity", "session", "--quiet")
    assert code == 0 and "2 session memories" in stdout
    # one conversation: its summary counts "1 user", not "1 users" (the counts are the store's)
    assert stdout.startswith(f"{tmp_path / 's'}: 1 user, 2 session memories, 4 queries, model"), stdout


@pytest.mark.parametrize("case", ["missing", "malformed", "unknown-spec", "bad-model",
                                  "bad-granularity", "bad-threshold", "no-conversation", "no-session",
                                  "threshold-without-segment"])
def test_embed_bad_input_one_line_no_store(capsys, tmp_path, case):
    data = write_locomo(tmp_path / "7.json")
    bad = tmp_path / "bad.json"
    bad.write_text('{"speaker_a": "A",\n "qa": [}')
    (tmp_path / "none.json").write_text("[]")            # these two made a store of no users, or of a user
    (tmp_path / "bare.json").write_text(json.dumps({"speaker_a": "A", "speaker_b": "B", "qa": []}))  # with no memory
    args = {
        "missing": [f"locomo:{tmp_path / 'nope.json'}"],
        "malformed": [f"locomo:{bad}"],
        "unknown-spec": ["nosuchdataset:foo"],
        "bad-model": [f"locomo:{data}", "--model", "no-such-model-xyz"],
        "bad-granularity": [f"locomo:{data}", "--granularity", "paragraph"],
        "bad-threshold": [f"locomo:{data}", "--granularity", "segment", "--merge-threshold", "3"],
        "no-conversation": [f"locomo:{tmp_path / 'none.json'}"],
        "no-session": [f"locomo:{tmp_path / 'bare.json'}"],
        "threshold-without-segment": [f"locomo:{data}", "--merge-threshold", "0.5"],     # nothing would read it
    }[case]
    out_dir = tmp_path / "out" / "store"
    code, stdout, stderr = run(capsys, "embed", *args, "--out", out_dir, "--quiet")
    assert code == 2, (code, stderr)
    lines = [ln for ln in stderr.strip().splitlines() if ln.strip()]
    # click usage errors (bad-granularity, bad-threshold) are one line too (cli.main.main)
    assert len(lines) == 1 and lines[0].startswith("error: "), stderr
    assert "Traceback" not in stderr
    if case == "missing":
        assert "nope.json" in stderr
    if case == "malformed":
        assert "bad.json:2" in stderr
    if case == "bad-model":
        assert "--model" in stderr and "no-such-model-xyz" in stderr
    if case == "bad-granularity":
        assert "paragraph" in stderr
    if case == "threshold-without-segment":
        assert "--merge-threshold: only --granularity segment reads it; this run builds turn memories" in stderr
    if case == "no-conversation":
        assert "none.json: holds no users" in stderr
    if case == "no-session":
        assert "bare.json: user" in stderr and "no turn to embed" in stderr
    assert not out_dir.exists()
    assert not (tmp_path / "out").exists() or no_leftovers(tmp_path / "out", "store")


# --------------------------------------------------------------------------- retrieve
def test_retrieve_json_exact_recall(capsys, tiny_store):
    code, stdout, stderr = run(capsys, "retrieve", tiny_store, "--k", 5, "--json")
    assert code == 0, stderr
    res = json.loads(stdout)
    assert {"overall", "per_user", "per_category", "counts"} <= set(res)
    # every question is the verbatim text of its gold turn -> found at rank 1. Recall, MRR and
    # recall_all are then exactly 1 (x/x, and a float64 mean of ones); NDCG divides two float32
    # sums of the same discounts, within the float32 bound of an all-hit list of 5.
    assert res["overall"]["recall@5"] == res["overall"]["mrr"] == res["overall"]["recall_all@5"] == 1.0
    all_hit = max(float(f32_error(lambda r, n: metrics.ndcg_at_k(r, n, 5), np.ones((1, 5), bool), np.array([g]))[0])
                  for g in range(1, 6))
    assert_f32_close(res["overall"]["ndcg@5"], 1.0, all_hit)
    assert res["per_user"]["7"]["recall@5"] == 1.0 and res["per_user"]["7"]["n"] == 4
    assert set(res["per_category"]) == {"1", "2", "3", "4"}
    assert res["counts"]["valid_queries"] == 4 and res["counts"]["memories"] == 8


def test_retrieve_table(capsys, tiny_store):
    code, stdout, _ = run(capsys, "retrieve", tiny_store, "--k", 8)
    assert code == 0
    assert "recall@5" in stdout and "recall@8" in stdout and "recall_all@8" in stdout
    assert "ndcg@8" in stdout and "mrr" in stdout
    overall = next(ln for ln in stdout.splitlines() if ln.startswith("overall"))
    assert overall.split()[1] == "4" and overall.split()[2] == "1.000"
    assert "category" in stdout


def test_retrieve_k_larger_than_bank(capsys, tiny_store):
    code, stdout, stderr = run(capsys, "retrieve", tiny_store, "--k", 20)
    assert code == 2 and stdout == ""
    assert stderr.count("\n") == 1 and "--k" in stderr and "k=20" in stderr and "8 memories" in stderr
    # evaluate_store (rmm_jax.data.retrieval) names its argument k; the CLI words it as its options
    assert stderr.endswith("--k: k=20 is larger than the memory bank of user '7' (8 memories); use a smaller --k or "
                           "--pad-short-banks\n"), stderr
    code, stdout, _ = run(capsys, "retrieve", tiny_store, "--k", 20, "--pad-short-banks", "--json")
    assert code == 0 and json.loads(stdout)["overall"]["recall@20"] == 1.0          # exact, as above


def test_retrieve_k_passes_the_bank_of_a_user_without_questions(capsys, tmp_path, tiny_store):
    """A user without questions retrieves nothing, so its bank may be shorter than --k: such
    a user made retrieve refuse --k for everyone (or need --pad-short-banks)."""
    chats = tmp_path / "chats.jsonl"
    chats.write_text(json.dumps({"user_id": "alice", "sessions": [{"session_id": "s1", "messages": [
        {"role": "user", "content": "I adopted a puppy named Max."}]}]}) + "\n")
    both = tmp_path / "both"
    shutil.copytree(tiny_store, both)
    code, _, err = run(capsys, "embed", f"jsonl:{chats}", "--into", both)
    assert code == 0, err
    code, stdout, err = run(capsys, "retrieve", both, "--k", 8, "--json")
    assert code == 0, err
    res = json.loads(stdout)
    assert res["overall"]["recall@8"] == 1.0 and res["per_user"]["alice"]["n"] == 0
    code, stdout, err = run(capsys, "retrieve", both, "--k", 9)        # the user with questions still counts
    assert code == 2 and stdout == "" and "k=9" in err and "8 memories" in err and "alice" not in err


def test_retrieve_bad_stores(capsys, tmp_path, tiny_store):
    code, _, err = run(capsys, "retrieve", tmp_path / "nope")
    assert code == 2 and "no such embedding store" in err and err.count("\n") == 1
    code, _, err = run(capsys, "retrieve", tiny_store, "--expect-model", "other/model")
    assert code == 2 and "other/model" in err and MODEL_ID in err
    broken = tmp_path / "broken"
    shutil.copytree(tiny_store, broken)
    q = np.load(broken / "queries.npy")
    q[1, 0] = np.nan
    np.save(broken / "queries.npy", q)
    code, out, err = run(capsys, "retrieve", broken, "--k", 5, "--json")
    assert code == 2 and out == "" and "queries.npy" in err and "NaN" in err
    (broken / "manifest.json").write_text("[1, 2")
    code, _, err = run(capsys, "retrieve", broken)
    assert code == 2 and "manifest.json:1" in err


# --------------------------------------------------------------------------- real data
@pytest.mark.locomo
def test_locomo_conversation_26_baseline(capsys, tmp_path):
    path = locomo_dir() / "26.json"
    out = tmp_path / "store26"
    code, _, err = run(capsys, "embed", f"locomo:{path}", "--out", out, "--quiet")
    assert code == 0, err
    code, stdout, err = run(capsys, "retrieve", out, "--k", 20, "--json")
    assert code == 0, err
    res = json.loads(stdout)
    u = res["per_user"]["26"]
    # reference: Recall@5 ~ 0.34, Recall@20 ~ 0.57 with speaker + caption in the turn text (a band
    # for the embedding model's version and the data, not rounding)
    assert u["recall@5"] == pytest.approx(0.34, abs=0.02)
    assert u["recall@20"] == pytest.approx(0.57, abs=0.02)
    assert res["counts"]["valid_queries"] == u["n"] >= 190


@pytest.mark.parametrize("option,given", [("--skip-invalid", ()), ("--keep-roles", ("system",))])
def test_embed_names_its_option_where_load_spec_names_the_argument(capsys, tmp_path, option, given):
    """load_spec names its argument (skip_invalid, keep_roles); embed, --out or --into, still
    says the option it was given as (cli.shell.as_options)."""
    for target in ("--out", "--into"):
        if target == "--into":
            assert run(capsys, "embed", "synthetic:users=1", "--out", tmp_path / "s", "--quiet")[0] == 0
        code, out, err = run(capsys, "embed", "synthetic:users=1", target, tmp_path / "s", option, *given)
        assert code == 2 and out == "" and err.count("\n") == 1, err
        assert err.startswith(f"error: {option}: applies to jsonl: datasets only, not synthetic:"), err


def test_embed_into_takes_gold_on_an_earlier_days_turns_and_embed_out_does_not(capsys, tmp_path, monkeypatch):
    """A day file's question about an earlier day's memories: `embed --into` looks its gold up in
    the store (it was refused as "unknown turn id", so the question went without gold); an id
    the store lacks too is one line naming file:line and key, nothing written; `embed --out` has
    no store, so the file's own turns are all its gold may name."""
    from conftest import use_fake_embedder
    use_fake_embedder(monkeypatch)

    def day(name, sessions, questions=()):
        path = tmp_path / name
        path.write_text(json.dumps({"user_id": "alice", "sessions": [
            {"session_id": sid, "messages": [{"role": "user", "content": text}]} for sid, text in sessions],
            "questions": list(questions)}) + "\n")
        return f"jsonl:{path}"

    store = tmp_path / "store"
    code, _, err = run(capsys, "embed", day("day1.jsonl", [("s1", "I adopted a puppy named Max.")]), "--out", store)
    assert code == 0, err
    day2 = day("day2.jsonl", [("s2", "I started piano lessons.")],
               [{"id": "q1", "question": "What is my dog called?", "gold_turn_ids": ["s1:0"]},
                {"id": "q2", "question": "What happened on day one?", "gold_session_ids": ["s1"]}])
    code, out, err = run(capsys, "embed", day2, "--into", store, "--json")
    assert code == 0, err
    assert json.loads(out)["added"]["queries"] == 2
    rows = [json.loads(ln) for ln in (store / "queries.jsonl").read_text().splitlines()]
    assert [r["gold_memory_ids"] for r in rows] == [["s1:0"], ["s1:0"]]
    code, out, err = run(capsys, "retrieve", store, "--k", 2, "--json")
    assert code == 0, err
    assert json.loads(out)["per_user"]["alice"]["n"] == 2 and json.loads(out)["per_user"]["alice"]["recall@2"] == 1.0

    bad = day("day3.jsonl", [("s3", "Max learned to sit.")],
              [{"id": "q3", "question": "And the cat?", "gold_turn_ids": ["s3:0", "s1:7"]}])
    files = {p.name: p.read_bytes() for p in store.iterdir()}
    code, out, err = run(capsys, "embed", bad, "--into", store)
    assert code == 2 and out == "" and err.count("\n") == 1, err
    assert err == (f"error: {tmp_path / 'day3.jsonl'}:1: key 'questions[0].gold_turn_ids[1]': unknown turn id 's1:7' "
                   f"for user 'alice' (neither this file nor STORE {store} holds it)\n")
    assert {p.name: p.read_bytes() for p in store.iterdir()} == files
    code, out, err = run(capsys, "embed", day2, "--out", tmp_path / "fresh")
    assert code == 2 and out == "" and not (tmp_path / "fresh").exists()
    assert err == (f"error: {tmp_path / 'day2.jsonl'}:1: key 'questions[0].gold_turn_ids[0]': unknown turn id 's1:0' "
                   "for user 'alice'\n")


def test_a_cache_root_that_cannot_be_made_is_one_line_naming_what_set_it(capsys, tmp_path, monkeypatch):
    """A cache root under a regular file (or in /sys) cannot be made: one line naming --cache-dir, or
    $RMM_JAX_CACHE when the variable set it (what replay and rerank embed through), exit 2, no store;
    it was a PermissionError or NotADirectoryError traceback from Embedder."""
    from rmm_jax.data.embed import embed_texts
    from rmm_jax.errors import InputError

    (tmp_path / "afile").write_text("x")
    root = tmp_path / "afile" / "cache"
    data = write_locomo(tmp_path / "7.json")
    code, stdout, stderr = run(capsys, "embed", f"locomo:{data}", "--out", tmp_path / "s", "--cache-dir", root, "-q")
    assert (code, stdout) == (2, "")
    assert stderr.startswith(f"error: --cache-dir {root}: cannot write: {root}/") and stderr.endswith(
        ": Not a directory\n") and stderr.count("\n") == 1, stderr
    monkeypatch.setenv("RMM_JAX_CACHE", str(root))
    code, stdout, stderr = run(capsys, "embed", f"locomo:{data}", "--out", tmp_path / "s", "-q")
    assert (code, stdout) == (2, "") and stderr.startswith(f"error: $RMM_JAX_CACHE={root}: cannot write: "), stderr
    assert stderr.count("\n") == 1
    with pytest.raises(InputError, match=rf"^\$RMM_JAX_CACHE={root}: cannot write: .*: Not a directory$"):
        embed_texts(["a text the store lacks"], MODEL_ID)
    assert not (tmp_path / "s").exists()


@pytest.mark.parametrize("both", [False, True], ids=["neither", "both"])
def test_embed_wants_out_or_into_and_says_not_both(capsys, tmp_path, both):
    data = write_locomo(tmp_path / "7.json")
    more = ["--out", tmp_path / "a", "--into", tmp_path / "b"] if both else []
    code, _, err = run(capsys, "embed", f"locomo:{data}", *more, "--quiet")
    want = "error: --out: give --out (a new store) or --into (append to an existing one)" + (", not both" * both)
    assert code == 2 and err.strip() == want, err
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()


@pytest.mark.parametrize("store, k, where", [
    (None, "5", "k: k must be a positive integer"),        # TypeError comparing with the bank sizes
    (None, None, "k: k must be a positive integer"),
    ("path", 5, "store: expected an opened store (open_store(path))"),   # AttributeError bank_sizes
])
def test_evaluate_store_names_a_bad_k_or_an_unopened_store(tiny_store, store, k, where):
    from rmm_jax.data.retrieval import evaluate_store
    from rmm_jax.data.store import open_store
    from rmm_jax.errors import InputError
    with pytest.raises(InputError) as e:
        evaluate_store(str(tiny_store) if store == "path" else open_store(tiny_store), k)
    assert str(e.value).startswith(where), str(e.value)
