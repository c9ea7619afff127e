"""The `--json` contract of every verb and sub-command that has it, run on a copy of examples/
with a model-free embedder: stdout is exactly one strict JSON document (no NaN or Infinity,
which json.loads accepts and jq refuses) whatever notes, warnings and progress the command
prints (misspelt log keys, --users, an unreliable evaluate, a replay with nothing to learn, a
tiny demo); the exit status is the one without --json; the --json help names every top-level
key printed; on bad input nothing reaches stdout."""
import contextlib
import io
import json
import re
import shlex
import shutil
from pathlib import Path

import click
import pytest

from rmm_jax.cli.main import cli, main, register_commands

REPO = Path(__file__).resolve().parents[1]
register_commands()

# (label, command line, expected exit status), run in this order from a copy of examples/
WALK = [
    ("embed --out", "embed jsonl:examples/chat_history.jsonl --out stores/mine --json", 0),
    ("embed --into", "embed jsonl:examples/chat_history.jsonl --into stores/mine --json", 0),
    ("embed synthetic", "embed synthetic:users=4,sessions=3,turns=6 --out stores/synth --json", 0),
    ("retrieve", "retrieve stores/synth --k 10 --json", 0),
    ("pretrain dialogue", "pretrain stores/mine --labels dialogue --epochs 1 --out policies --json", 0),
    ("pretrain gold --plot", "pretrain stores/synth --k 10 --epochs 1 --out pretrained --plot pt.png --json", 0),
    ("replay", "replay stores/mine --log examples/calls_day1.jsonl --policies policies --plot day1.png --json", 0),
    ("replay nothing to learn", "replay stores/mine --log examples/calls_day1.jsonl --policies policies "
                                "--plot nothing.png --json", 0),
    ("rerank", "rerank stores/mine --policies policies --calls examples/requests_day2.jsonl --explore "
               "--out served.jsonl --json", 0),
    ("rerank no store", "rerank stores/mine --calls examples/requests_day1.jsonl --out ranked.jsonl --json", 0),
    ("replay misspelt keys", "replay stores/mine --log typo1.jsonl --policies typo --users user0 --json", 0),
    ("evaluate unreliable", "evaluate stores/mine --log examples/calls_day2.jsonl --policies policies "
                            "--bootstrap 40 --json", 3),
    ("evaluate misspelt keys", "evaluate stores/mine --log typo2.jsonl --policies policies --users user0,user1 "
                               "--bootstrap 40 --allow-unreliable --plot ev.png --json", 0),
    ("evaluate one call", "evaluate stores/mine --log examples/calls_day2.jsonl --policies policies "
                          "--users newcomer --bootstrap 40 --json", 3),
    ("simulate", "simulate stores/synth --policies simulated --k 10 --users user1 --log-out sim.jsonl --plot sim.png "
                 "--json", 0),
    ("cite-rates", "cite-rates stores/synth --log sim.jsonl --bootstrap 40 --json", 0),
    ("cite-rates misspelt keys", "cite-rates stores/synth --log sim_typo.jsonl --users user1 --bootstrap 40 --json", 0),
    ("policies list", "policies list policies --json", 0),
    ("policies show", "policies show policies --json", 0),
    ("policies show users", "policies show policies user0 --users user1 --json", 0),
    ("policies export", "policies export policies user0 --out user0.npz --json", 0),
    ("policies rollback --dry-run", "policies rollback policies --dry-run --json", 0),
    ("policies rollback", "policies rollback simulated --json", 0),
    ("demo tiny", "demo --out runs/demo --users 4 --sessions 1 --turns 2 --k 10 --json", 0),
    ("version", "version --json", 0),
]
# bad input: exit 2, one line on stderr, nothing on stdout
BAD = [
    "retrieve stores/mine --json",                                              # no questions
    "pretrain stores/mine --out p2 --json",                                     # no gold
    "replay stores/mine --log nocited.jsonl --policies p3 --json",              # a required key misspelt
    "evaluate stores/mine --log examples/calls_day2.jsonl --policies policies --users nobody --json",
    "cite-rates stores/synth --log sim.jsonl --users user3 --json",             # a user with no call
    "policies show policies nobody --json",
    "policies rollback pretrained --json",                                      # nothing to roll back
    "rerank stores/mine --calls examples/requests_day1.jsonl --json",           # stdout carries the records
    "rerank stores/mine --calls examples/requests_day1.jsonl --out - --json",
    "demo --out runs/demo2 --users 2 --json",
]


def _strict(text):
    def refuse(constant):
        raise ValueError(f"{constant} is not JSON")
    return json.loads(text, parse_constant=refuse)


def _run(line):
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            main(shlex.split(line))
            code = 0
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else 1
    return code, out.getvalue(), err.getvalue()


def _edit_log(src, dst, change):
    with open(src) as f, open(dst, "w") as o:
        for line in f:
            rec = json.loads(line)
            change(rec)
            o.write(json.dumps(rec) + "\n")


@pytest.fixture(scope="module")
def walk(tmp_path_factory):
    """{label or bad line: (exit status, stdout, stderr)}; runs once for the module."""
    from conftest import use_fake_embedder

    root = tmp_path_factory.mktemp("json")
    shutil.copytree(REPO / "examples", root / "examples")
    _edit_log(root / "examples/calls_day1.jsonl", root / "typo1.jsonl",
              lambda r: r.update(timestmap=r.pop("timestamp")))
    _edit_log(root / "examples/calls_day2.jsonl", root / "typo2.jsonl",
              lambda r: r.update(timestmap=r.pop("timestamp"), log_porb=0))
    _edit_log(root / "examples/calls_day1.jsonl", root / "nocited.jsonl", lambda r: r.update(citd=r.pop("cited")))
    results = {}
    with pytest.MonkeyPatch.context() as mp:
        use_fake_embedder(mp)
        mp.chdir(root)
        for label, line, _ in WALK:
            results[label] = _run(line)
            if label == "simulate":
                _edit_log(root / "sim.jsonl", root / "sim_typo.jsonl", lambda r: r.update(Gold=[], timestmap=1))
        for line in BAD:
            results[line] = _run(line)
        # the exit status without --json: evaluate's 3 (unreliable), replay's 0 (nothing to learn)
        for label in ("evaluate unreliable", "replay nothing to learn"):
            line = dict((lab, li) for lab, li, _ in WALK)[label]
            results[label + " (text)"] = _run(line.replace(" --json", ""))
        # a policy store whose file holds NaN (hand-edited, or written by another tool): json.loads reads it
        shutil.copytree(root / "policies", root / "nan_meta")
        meta = json.loads((root / "nan_meta/policy_store.json").read_text())
        meta["meta"]["config"]["pretrain"]["lr"] = float("nan")
        (root / "nan_meta/policy_store.json").write_text(json.dumps(meta))
        for line in ("policies list nan_meta --json", "policies show nan_meta user0 --json"):
            results[line] = _run(line)
    results["_root"] = root                     # where the walk ran: the files it wrote
    return results


@pytest.mark.parametrize("label,line,code", WALK, ids=[w[0] for w in WALK])
def test_stdout_is_one_strict_json_object(walk, label, line, code):
    got, out, err = walk[label]
    assert got == code, (line, err)
    doc = _strict(out)
    assert isinstance(doc, dict) and doc, out


def _json_help(path):
    cmd = cli
    for name in path:
        cmd = cmd.commands[name]
    (opt,) = [p for p in cmd.params if isinstance(p, click.Option) and "--json" in p.opts]
    return opt.help


@pytest.mark.parametrize("label,line,code", WALK, ids=[w[0] for w in WALK])
def test_the_json_help_names_every_key_printed(walk, label, line, code):
    """A script reads keys the help promises: every top-level key printed is named there
    (a metric at M, `val_recall@5`, as `val_recall@M`)."""
    words = shlex.split(line)
    path = words[:2] if words[0] == "policies" else words[:1]
    named = set(re.findall(r"[\w@+]+", _json_help(path)))
    keys = {re.sub(r"@\d+$", "@M", k) for k in _strict(walk[label][1])}
    assert keys <= named, (path, sorted(keys - named))


def test_the_plot_written_is_named_in_the_json_as_pretrain_and_demo_name_theirs(walk):
    """simulate, replay and evaluate wrote --plot without a word of it in --json, where pretrain
    and demo name theirs: each says the PNG it wrote, or null when it wrote none."""
    for label, png in (("replay", "day1.png"), ("simulate", "sim.png"), ("evaluate misspelt keys", "ev.png"),
                       ("pretrain gold --plot", "pt.png"), ("replay nothing to learn", None),
                       ("evaluate unreliable", None), ("pretrain dialogue", None)):
        assert _strict(walk[label][1])["plot"] == png, label
        assert png is None or (walk["_root"] / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", label
    assert not (walk["_root"] / "nothing.png").exists()       # given --plot, nothing learned: null, no file


def test_notes_go_to_stderr_and_the_exit_status_is_the_one_without_json(walk):
    assert "did you mean 'timestamp'" in walk["replay misspelt keys"][2]
    assert "did you mean 'log_prob'" in walk["evaluate misspelt keys"][2]
    assert "did you mean 'gold'" in walk["cite-rates misspelt keys"][2]
    assert "unreliable" in walk["evaluate unreliable"][2]
    for label in ("evaluate unreliable", "replay nothing to learn"):
        assert walk[label + " (text)"][0] == walk[label][0], label


@pytest.mark.parametrize("line", BAD)
def test_bad_input_writes_nothing_to_stdout(walk, line):
    code, out, err = walk[line]
    assert (code, out) == (2, ""), (out, err)
    assert err.startswith("error: ") and len(err.strip().splitlines()) == 1, err


@pytest.mark.parametrize("line", ["policies list nan_meta --json", "policies show nan_meta user0 --json"])
def test_a_nan_the_command_reads_is_printed_as_null(walk, line):
    """`policies list/show --json` printed a store's meta as json.dumps wrote it: NaN read from
    policy_store.json came out as NaN, which jq refuses. Every verb prints through emit_json."""
    code, out, err = walk[line]
    assert code == 0, err
    doc = _strict(out)
    meta = doc["meta"] if "meta" in doc else doc["store"]["meta"]
    assert meta["config"]["pretrain"]["lr"] is None


def test_emit_json_writes_strict_json(capsys):
    import numpy as np

    from rmm_jax.cli.shell import emit_json

    emit_json({"nan": float("nan"), "inf": [float("inf"), -float("inf")], "f32": np.float32(1.5),
               "i64": np.int64(3), "arr": np.array([1.0, np.nan]), "t": (1, 2)})
    assert _strict(capsys.readouterr().out) == {"nan": None, "inf": [None, None], "f32": 1.5, "i64": 3,
                                                "arr": [1.0, None], "t": [1, 2]}


def test_version_json_says_what_this_process_runs(walk):
    """`version --json` gives a script the versions and devices the CLI itself runs with."""
    import platform

    import jax
    import jaxlib

    import rmm_jax

    doc = _strict(walk["version"][1])
    assert (doc["rmm_jax"], doc["jax"], doc["jaxlib"], doc["python"], doc["backend"]) == (
        rmm_jax.__version__, jax.__version__, jaxlib.__version__, platform.python_version(), jax.default_backend())
    assert doc["devices"] == [str(d) for d in jax.devices()] and doc["devices"]


def test_rerank_json_counts_who_served_each_call(walk):
    """rerank --json says how many calls each kind of policy served; the served lines say it
    too (policy_version null: a user the store does not hold), and the counts must agree."""
    served = _strict(walk["rerank"][1])
    lines = [json.loads(x) for x in (walk["_root"] / served["out"]).read_text().splitlines()]
    own = sum(rec["policy_version"] is not None for rec in lines)
    assert served["served_by"] == {"own_policy": own, "shared": len(lines) - own, "identity": 0}
    assert 0 < own < len(lines) == served["calls"]          # day 2 has a user day 1 never saw
    assert served["users"] == len({rec["user_id"] for rec in lines}) and served["explore"] is True
    alone = _strict(walk["rerank no store"][1])
    assert alone["served_by"] == {"own_policy": 0, "shared": 0, "identity": alone["calls"]} and alone["calls"] > 0


def test_policies_export_json_is_the_json_written_beside_the_npz(walk):
    """`policies export --json` prints what it wrote next to the .npz, and both paths."""
    doc = _strict(walk["policies export"][1])
    beside = json.loads((walk["_root"] / doc["json"]).read_text())
    assert {k: v for k, v in doc.items() if k not in ("out", "json")} == beside
    assert (doc["user"], doc["out"]) == ("user0", "user0.npz") and (walk["_root"] / doc["out"]).is_file()


def test_every_verb_has_json_and_the_walk_runs_it():
    """Every command, sub-commands included, takes --json, and the walk above runs each one
    with it: a new verb without --json, or with one that no test runs, fails here."""
    def leaves(group, path=()):
        for name, cmd in sorted(group.commands.items()):
            yield from leaves(cmd, (*path, name)) if isinstance(cmd, click.Group) else [(*path, name)]

    verbs = set(leaves(cli))
    assert len(verbs) > 10
    without = [v for v in verbs if not any(isinstance(p, click.Option) and "--json" in p.opts
                                           for p in _command(v).params)]
    assert not without, without
    walked = {tuple(w[:2]) if w[0] == "policies" else (w[0],) for w in (shlex.split(line) for _, line, _ in WALK)}
    assert verbs <= walked, sorted(verbs - walked)


def _command(path):
    cmd = cli
    for name in path:
        cmd = cmd.commands[name]
    return cmd

