"""What ``rmm-jax pretrain`` reports: epoch 0 is the untrained start (no training loss, never
'nan'), a run that keeps it says so and why (stderr note, ``--json`` field), and an unknown
``--users`` id is a one-line error that writes nothing."""
from __future__ import annotations

import json

import pytest
from conftest import make_fake_store, run_cli

from rmm_jax.cli.pretrain import epoch_line
from rmm_jax.online.pretrain import untrained_kept


def history(val, best):
    return {"loss": [None] + [1.0] * (len(val) - 1), "train_recall": [0.5] * len(val), "val_recall": val,
            "best_epoch": best}


def test_untrained_kept_says_why_only_when_epoch_0_wins():
    msg = untrained_kept(history([0.41234, 0.4, 0.41234], 0), 5)
    assert msg == ("validation Recall@5 never improved on the base retriever's 0.4123 in 2 epochs (best trained: "
                   "0.4123); the untrained start was kept")
    assert "in 1 epoch (" in untrained_kept(history([0.4, 0.3], 0), 5)
    assert untrained_kept(history([0.4, 0.3, 0.5], 2), 5) is None
    assert untrained_kept(history([None, None], 0), 5) is None          # no validation users: nothing to select on


def test_epoch_line_untrained_start_has_no_loss():
    line = epoch_line({"epoch": 0, "loss": None, "train_recall": 0.25, "val_recall": 0.5}, 3)
    assert line == "epoch   0  loss      -  train R@3 0.2500  val R@3 0.5000  (untrained start: the base retriever)"
    line = epoch_line({"epoch": 4, "loss": 0.123456, "train_recall": 0.25, "val_recall": None}, 3)
    assert line == "epoch   4  loss 0.1235  train R@3 0.2500  val R@3      -"


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    return make_fake_store(tmp_path_factory.mktemp("pretrain") / "st", users=4)


def pretrain(capsys, store, out, *args):
    return run_cli(capsys, "pretrain", store, "--out", out, "--k", 10, "--m", 3, "--json", *args)


def test_best_epoch_0_is_reported(capsys, store, tmp_path):
    """A learning rate too small to change the ranking: no trained epoch beats the start."""
    code, out, err = pretrain(capsys, store, tmp_path / "p", "--lr", 1e-12, "--epochs", 2, "--patience", 1)
    assert code == 0, err
    rep = json.loads(out)
    assert rep["best_epoch"] == 0 and rep["untrained_start_kept"] is True
    start = rep["initial_val_recall@3"]
    assert f"never improved on the base retriever's {start:.4f}" in rep["untrained_start_kept_reason"]
    notes = [line for line in err.splitlines() if line.startswith("note:")]
    assert notes == [f"note: {rep['untrained_start_kept_reason']}"]
    assert "nan" not in err.lower() and "epoch   0  loss      -" in err


@pytest.mark.parametrize("users,fragment", [("nobody", "unknown user id 'nobody'"),
                                            ("user0,nobody", "unknown user id 'nobody'")])
def test_unknown_user_one_line_nothing_written(capsys, store, tmp_path, users, fragment):
    code, out, err = pretrain(capsys, store, tmp_path / "p", "--users", users)
    lines = err.strip().splitlines()
    assert code == 2 and out == "" and len(lines) == 1 and lines[0].startswith("error: --users: "), err
    assert fragment in lines[0] and not (tmp_path / "p").exists()


def test_from_python_an_unknown_user_or_a_val_fraction_names_the_argument(store):
    """load_streams(st, k, ["nobody"]) (and check_users, store_chunks, load_dialogue_streams)
    said "--users: unknown user id", split_users(ids, 0.9) "--val-fraction: ...": the CLI's
    options, to a Python caller who gave neither. They name the argument; `rmm-jax pretrain`
    and `simulate` still name the option (above, and tests/test_bad_input.py)."""
    from rmm_jax.data.store import open_store
    from rmm_jax.errors import InputError
    from rmm_jax.online.pretrain import split_streams, split_users
    from rmm_jax.online.streams import check_users, load_dialogue_streams, load_streams, store_chunks

    st = open_store(store)
    for call in (lambda: check_users(st, ["nobody"]), lambda: load_streams(st, 4, ["user0", "nobody"]),
                 lambda: load_dialogue_streams(st, 4, ["nobody"]), lambda: store_chunks(st, 4, ["nobody"], 2)):
        with pytest.raises(InputError, match=r"^users: unknown user id 'nobody' \(the store has 4 users\)$"):
            call()
    for call in (lambda: split_users(list(st.user_ids), 0.9), lambda: split_streams(load_streams(st, 4), 0.9)):
        with pytest.raises(InputError, match=r"^val_fraction: 0\.9 of 4 users holds out all 4 for validation"):
            call()


def test_from_python_users_must_be_a_list_of_distinct_ids_and_store_an_opened_store(store):
    """load_streams(st, k, users="user0") read the str letter by letter ("unknown user id 'u'"),
    users=[] gave every user, users=["user0", "user0"] ran user0 twice (its questions counted
    twice), and load_streams("st", k) was an AttributeError. Each is refused by name, as
    evaluate_log and count_calls refuse them (check_log_inputs), by every reader of a store's
    streams (check_users)."""
    from rmm_jax.data.store import open_store
    from rmm_jax.errors import InputError
    from rmm_jax.online.streams import check_users, load_dialogue_streams, load_streams, store_chunks

    st = open_store(store)
    readers = (lambda s, u: check_users(s, u), lambda s, u: load_streams(s, 4, u),
               lambda s, u: load_dialogue_streams(s, 4, u), lambda s, u: store_chunks(s, 4, u, 2))
    for read in readers:
        with pytest.raises(InputError, match=r"^users: expected a list of user ids \(str\), got str 'user0'$"):
            read(st, "user0")
        with pytest.raises(InputError, match=r"^users: is empty; give None for every user, or at least one user id$"):
            read(st, [])
        with pytest.raises(InputError, match=r"^users: user id 'user0' is given twice$"):
            read(st, ["user0", "user1", "user0"])
        with pytest.raises(InputError, match=r"^store: expected an embedding store, open_store\(path\), got str "):
            read(str(store), None)
    assert [s.user_id for s in load_streams(st, 4, ("user1", "user0"))] == ["user1", "user0"]
    assert len(load_streams(st, 4)) == 4


def test_out_of_device_memory_is_one_line_naming_the_commands_sizes(capsys, store, tmp_path, monkeypatch):
    """`pretrain --kind mlp --hidden 100000000` ran out of XLA's memory with a traceback
    (RESOURCE_EXHAUSTED), where simulate's NumPy MemoryError was one line, whose advice named
    --users-per-chunk, an option pretrain lacks. Both are one line, exit 1, naming the options
    that size what this command holds; nothing is written."""
    import jax

    from rmm_jax.cli import pretrain as verb

    def exhausted(*a, **k):
        raise jax.errors.JaxRuntimeError("RESOURCE_EXHAUSTED: Out of memory allocating 153600000000 bytes.")
        yield
    monkeypatch.setattr(verb, "pretrain_epochs", exhausted)
    code, out, err = pretrain(capsys, store, tmp_path / "p")
    assert (code, out) == (1, "") and err.splitlines()[-1] == (
        "error: out of memory (RESOURCE_EXHAUSTED: Out of memory allocating 153600000000 bytes.); smaller --k or "
        "--hidden need less"), err
    assert "Traceback" not in err and not (tmp_path / "p").exists()
