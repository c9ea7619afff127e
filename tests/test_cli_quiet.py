"""``--quiet/-q``, one meaning on every verb that prints progress or routine lines on stderr
(:func:`rmm_jax.cli.shell.quiet_option`): no progress bars and no routine lines; what a user
must read stays: every ``note:``, ``warning:`` and ``error:`` line, the lines a verb marks
must-read without such a prefix, and stdout, byte for byte. A nightly job's mail carries
what needs a look, not its progress, without ``2>/dev/null`` hiding the warnings too."""
from __future__ import annotations

import inspect
import io
import json
import re
import shutil
import warnings

import pytest
from conftest import make_fake_store, run_cli
from fake_embedder import FakeEmbedder

from rmm_jax.cli import common, shell
from rmm_jax.cli.main import Verbs, cli, register_commands
from rmm_jax.data import embed as embed_mod
from rmm_jax.persist.policy_store import PolicyStore

register_commands()

RUN = ["--lr", "0.01", "--users-per-chunk", "2"]
# Verbs that print nothing routine on stderr (only their output and note: lines): no --quiet.
NO_ROUTINE = {("version",): "prints on stdout only"}
# verbs that print nothing routine but take -q, so that a script can give it to every verb of their group
QUIET_ANYWAY = {("policies", "list"): "prints its table and note: lines only"}


def leaf_commands(group=cli, prefix=()):
    for name, cmd in sorted(group.commands.items()):
        if hasattr(cmd, "commands"):
            yield from leaf_commands(cmd, prefix + (name,))
        else:
            yield prefix + (name,), cmd


def test_every_verb_that_prints_progress_or_routine_lines_has_the_one_quiet_option():
    """A new verb cannot forget it: every verb has it, but those named in NO_ROUTINE, whose
    code shows no progress and prints no line but a note."""
    paths = []
    for path, cmd in leaf_commands():
        paths.append(path)
        opt = next((p for p in cmd.params if p.name == "quiet"), None)
        if path in NO_ROUTINE or path in QUIET_ANYWAY:
            src = inspect.getsource(inspect.unwrap(cmd.callback))
            assert (opt is None) is (path in NO_ROUTINE) and "progress" not in src and "err=True" not in src, path
            assert all(c.startswith('info(f"note: ') for c in re.findall(r"\binfo\(.*", src)), path
            continue
        assert opt is not None, f"rmm-jax {' '.join(path)} has no --quiet (decorate it with shell.quiet_option)"
        assert (opt.opts, opt.is_flag, opt.help) == (["--quiet", "-q"], True, shell.QUIET_HELP)
    assert len(paths) > 10 and {("replay",), ("policies", "rollback"), ("demo",), ("embed",)} <= set(paths)


def test_info_under_quiet_prints_only_what_must_be_read(capsys):
    token = shell.QUIET.set(True)
    try:
        for line in ("loaded x", "note: a note", "warning: a warning", "error: an error"):
            shell.info(line)
        shell.info("skipped 3 invalid records of 9; first: x", must_read=True)
        with common.progress_bar(3, "bar") as bar:
            assert bar.disable
    finally:
        shell.QUIET.reset(token)
    assert capsys.readouterr().err == ("note: a note\nwarning: a warning\nerror: an error\n"
                                       "skipped 3 invalid records of 9; first: x\n")
    shell.info("loaded x")                              # reset: the next command is not quiet
    assert capsys.readouterr().err == "loaded x\n"


class Terminal(io.StringIO):
    def isatty(self):
        return True


def test_no_bar_shows_on_a_terminal_under_quiet(monkeypatch):
    """The bars show on a terminal only; under --quiet on none: the verbs' (progress_bar) and
    the embedding model's (Embedder, which embed_texts makes for replay, evaluate, rerank)."""
    term = Terminal()
    monkeypatch.setattr("sys.stderr", term)
    emb = embed_mod.Embedder.__new__(embed_mod.Embedder)
    emb.progress, emb.model_name, emb._loaded = True, "m", None
    emb._load, emb._load_from = (lambda source, name: object()), None
    for quiet in (False, True):
        token = shell.QUIET.set(quiet)
        try:
            with common.progress_bar(3, "bar") as bar:
                assert bool(bar.disable) is quiet
                bar.update(3)
            emb._loaded = None
            emb.dim = None
            emb._model                                  # its "loading the embedding model" line
        finally:
            shell.QUIET.reset(token)
        shown = term.getvalue()
        assert ("bar" in shown and "loading the embedding model m" in shown) is not quiet, shown
        term.seek(0)
        term.truncate()


# --- every verb, run as it is and with -q ---------------------------------------------------

@pytest.fixture(scope="module")
def store(tmp_path_factory):
    return make_fake_store(tmp_path_factory.mktemp("quiet") / "store", users=4, sessions=6, dim=16)


@pytest.fixture(scope="module")
def logs(store, tmp_path_factory):
    """day1/day2 of a simulated log, a copy of day 2 with a misspelt key (a note), the
    requests of one call, and a policy store of both days whose rollback a kill interrupted:
    every reader says so in a note."""
    from rmm_jax.cli.main import main
    from rmm_jax.persist import policy_rollback

    tmp = tmp_path_factory.mktemp("logs")
    main(["simulate", str(store), "--policies", str(tmp / "sim"), "--log-out", str(tmp / "log.jsonl"),
          "--k", "8", "--m", "3", *RUN])
    records = [json.loads(line) for line in (tmp / "log.jsonl").read_text().splitlines()]
    seen: dict = {}
    first = [seen.setdefault(r["user_id"], []).append(r) or len(seen[r["user_id"]]) <= 4 for r in records]
    day1, day2 = [r for r, f in zip(records, first) if f], [r for r, f in zip(records, first) if not f]
    out = {"store": store, "day1": tmp / "day1.jsonl", "day2": tmp / "day2.jsonl", "misspelt": tmp / "misspelt.jsonl",
           "req": tmp / "req.jsonl", "pending": tmp / "pending", "user": records[0]["user_id"]}
    for name, recs in (("day1", day1), ("day2", day2), ("misspelt", [{**day2[0], "timestmap": 1}, *day2[1:]]),
                       ("req", [{"call_id": "r0", "user_id": day1[0]["user_id"], "query_id": day1[0]["query_id"]}])):
        out[name].write_text("".join(json.dumps(r) + "\n" for r in recs))
    for day in ("day1", "day2"):
        main(["replay", str(store), "--log", str(out[day]), "--policies", str(out["pending"]), "--k", "8", "--m", "3",
              *RUN])
    shutil.copytree(out["pending"], tmp / "two_runs")
    out["two_runs"] = tmp / "two_runs"

    def killed(*a, **k):
        raise KeyboardInterrupt("killed after the mark")
    with pytest.MonkeyPatch.context() as m:
        m.setattr(policy_rollback, "writer_index", killed)
        with pytest.raises(KeyboardInterrupt):
            policy_rollback.rollback(PolicyStore.open(out["pending"]))
    return out


# verb -> (its arguments in working directory D, given the logs; the note it must keep, or None: it has none)
PENDING = "note: a rollback of {pending} to v2 was interrupted"
VERBS = {
    "embed": (lambda d, g: ["embed", "synthetic:users=2,sessions=2,turns=3", "--out", d / "s"],
              "texts embedded were longer than model fake/bow-16 reads"),
    "retrieve": (lambda d, g: ["retrieve", g["store"], "--k", "8"], None),
    "pretrain": (lambda d, g: ["pretrain", g["store"], "--out", d / "pre", "--epochs", "1", "--k", "64", "--m", "3"],
                 "note: --k 64 is more than the memory bank"),
    "simulate": (lambda d, g: ["simulate", g["store"], "--policies", d / "p", "--k", "64", "--m", "3", "--log-out",
                               d / "log.jsonl", *RUN], "note: --k 64 is more than the memory bank"),
    "replay": (lambda d, g: ["replay", g["store"], "--log", g["misspelt"], "--policies", d / "p", *RUN],
               "is not a log key and was ignored (did you mean 'timestamp'?)"),
    "rerank": (lambda d, g: ["rerank", g["store"], "--policies", g["pending"], "--calls", g["req"], "--k", "8", "--m",
                             "3", "--out", d / "served.jsonl"], PENDING),
    "evaluate": (lambda d, g: ["evaluate", g["store"], "--log", g["day2"], "--policies", g["pending"],
                               "--allow-unreliable", "--bootstrap", "200"], PENDING),
    "cite-rates": (lambda d, g: ["cite-rates", g["store"], "--log", g["misspelt"], "--bootstrap", "200"],
                   "is not a log key and was ignored (did you mean 'timestamp'?)"),
    "policies show": (lambda d, g: ["policies", "show", g["pending"], g["user"]], PENDING),
    "policies export": (lambda d, g: ["policies", "export", g["pending"], g["user"], "--out", d / "u.npz"], PENDING),
    "policies rollback": (lambda d, g: ["policies", "rollback", shutil.copytree(g["two_runs"], d / "p")], None),
    "demo": (lambda d, g: ["demo", "--out", d / "demo", "--users", "4", "--sessions", "2", "--turns", "3", "--k", "8",
                           "--m", "3"], "note: --k 8 is more than the memory bank"),
}
# verbs whose only routine output is a bar (on a terminal: test_no_bar_shows_on_a_terminal_under_quiet)
BARS_ONLY = {"cite-rates"}


@pytest.mark.parametrize("verb", list(VERBS))
def test_quiet_drops_routine_lines_and_keeps_notes_warnings_and_stdout(verb, capsys, monkeypatch, tmp_path, logs):
    """Run as it is and with -q: stdout the same; -q's stderr is the plain run's without
    its routine lines, keeping each note:/warning: line (a warning raised in the command:
    printed as ``warning: ...``) and the verb's note."""
    monkeypatch.setattr("rmm_jax.cli.embed.Embedder", lambda *a, **kw: FakeEmbedder(16, max_tokens=2))
    monkeypatch.setattr("rmm_jax.cli.demo.Embedder", lambda *a, **kw: FakeEmbedder(16))
    invoke = Verbs.invoke

    def warned(self, ctx):
        warnings.warn("a warning raised in the command", UserWarning)
        return invoke(self, ctx)
    monkeypatch.setattr(Verbs, "invoke", warned)
    make, note = VERBS[verb]
    got = {}
    for quiet in (False, True):
        d = tmp_path / ("quiet" if quiet else "plain")
        d.mkdir()
        code, out, err = run_cli(capsys, *make(d, logs), *(["-q"] if quiet else []))
        assert code == 0, err
        got[quiet] = [s.replace(str(d), "D") for s in (out, err)]
    (out, err), (out_q, err_q) = got[False], got[True]
    assert out_q == out
    plain, quiet = err.splitlines(), err_q.splitlines()
    it = iter(plain)
    assert all(line in it for line in quiet), (plain, quiet)        # in order: nothing new
    dropped = [line for line in plain if line not in quiet]
    assert not any(line.startswith(shell.MUST_READ) for line in dropped), dropped
    assert bool(dropped) is (verb not in BARS_ONLY), (plain, quiet)
    assert "warning: UserWarning: a warning raised in the command" in quiet
    if note is not None:
        note = note.format(**logs)
        assert any(note in line for line in quiet) and any(note in line for line in plain), (note, quiet)
    if verb == "pretrain":      # the store it created stays, as simulate's does (-q printed nothing at all)
        assert any(line.startswith("wrote D/pre: best epoch ") for line in quiet), quiet


@pytest.mark.parametrize("gold", [["s1:1"], ["s1:0", "s1:1"]], ids=["gold on a kept turn", "gold on the prompt"])
def test_embed_quiet_keeps_the_skipped_line_when_gold_named_a_skipped_message(gold, capsys, monkeypatch, tmp_path):
    """The roles left out by default (a system prompt) are routine under -q; a gold turn id
    that names such a message is gold lost: its line stays."""
    monkeypatch.setattr("rmm_jax.cli.embed.Embedder", lambda *a, **kw: FakeEmbedder(16))
    chat = tmp_path / "chat.jsonl"
    chat.write_text(json.dumps({"user_id": "u1", "session_id": "s1", "messages": [
        {"role": "system", "content": "Be nice."}, {"role": "user", "content": "I have a dog named Rex."},
        {"role": "assistant", "content": "Nice!"}],
        "questions": [{"id": "q1", "question": "What pet do I have?", "gold_turn_ids": gold}]}) + "\n")
    code, _, err = run_cli(capsys, "embed", f"jsonl:{chat}", "--out", tmp_path / "s", "-q")
    assert code == 0, err
    lost = len(gold) > 1
    assert [line for line in err.splitlines() if line.startswith("skipped ")] == (
        ["skipped 1 message (1 system/developer); 1 gold turn id naming a skipped message; --keep-roles "
         "system,developer keeps system/developer messages"] if lost else []), err


def test_a_quiet_night_that_continues_its_users_prints_nothing_and_a_created_store_is_said(capsys, tmp_path, logs):
    """A nightly ``replay -q`` that continues every user of its store leaves stderr empty (the
    cron mail of docs/reliability.md); without -q it says it continued. A store the run creates
    (a mistyped --policies) is said under -q too."""
    for quiet in (False, True):
        pol = tmp_path / f"p{int(quiet)}"
        q = ["-q"] if quiet else []
        code, _, err = run_cli(capsys, "replay", logs["store"], "--log", logs["day1"], "--policies", pol, *RUN, *q)
        assert code == 0 and f"created {pol}: a new policy store" in err, err
        code, _, err = run_cli(capsys, "replay", logs["store"], "--log", logs["day2"], "--policies", pol, *RUN, *q)
        assert code == 0, err
        if quiet:
            assert err == "", err
        else:
            assert f"continued {pol}: 4 of 4 users from their saved versions" in err, err
