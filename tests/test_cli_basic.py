"""The console script exists, teaches, and reports its version."""
import io
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import click
import pytest
from click.testing import CliRunner
from fake_embedder import FakeEmbedder

from rmm_jax.cli.main import WITHOUT_JAX, cli, main, register_commands
from rmm_jax.data.store import open_store

REPO = Path(__file__).resolve().parents[1]

register_commands()  # every verb module adds itself to `cli`


def run_cli(args, capsys):
    try:
        main(args)
        code = 0
    except SystemExit as e:
        code = e.code or 0
    out = capsys.readouterr()
    return code, out.out, out.err


def command_paths(group=cli, prefix=()):
    """Every registered command as a path of names, sub-groups included and walked."""
    for name, cmd in sorted(group.commands.items()):
        yield prefix + (name,)
        if isinstance(cmd, click.Group):
            yield from command_paths(cmd, prefix + (name,))


def command_at(path):
    cmd = cli
    for name in path:
        cmd = cmd.commands[name]
    return cmd


def help_of(path):
    """``rmm-jax <path> --help``: (exit code, output)."""
    r = CliRunner().invoke(cli, [*path, "--help"], prog_name="rmm-jax")
    return r.exit_code, r.output


def section(help_text, title):
    """The lines of a help section (``Options:``, ``Commands:``), up to the next blank line."""
    m = re.search(rf"^{title}:\n((?:.+\n?)*)", help_text, re.M)
    return m.group(1).splitlines() if m else []


def option_entries(help_text):
    """{option name: its whole entry in ``Options:``, whitespace collapsed}."""
    entries = []
    for line in section(help_text, "Options"):
        if re.match(r"^  -", line):
            entries.append(line)
        else:
            entries[-1] += " " + line
    out = {}
    for e in entries:
        column = re.split(r"\s{2,}", e.strip())[0]
        for name in re.findall(r"(?:^|[ ,])(--?[\w-]+)", column):
            out[name] = " ".join(e.split())
    return out


def examples(help_text):
    """Command lines shown under an ``Example:``/``Examples:`` heading."""
    m = re.search(r"^  Examples?:\n((?:    .*\n?)+)", help_text, re.M)
    return [line.strip() for line in m.group(1).splitlines()] if m else []


def test_help_lists_the_verbs(capsys):
    code, out, _ = run_cli(["--help"], capsys)
    assert code == 0 and "version" in out and "Typical flow" in out
    listed = {line.split()[0] for line in section(out, "Commands")}
    assert listed == set(cli.commands) and len(listed) >= 7, (listed, sorted(cli.commands))


ALL_PATHS = list(command_paths())
NO_DEFAULT = (None, getattr(click.core, "UNSET", None))  # click >= 8.2 marks "no default" UNSET
TOP_LEVEL = [p for p in ALL_PATHS if len(p) == 1]


@pytest.mark.parametrize("path", ALL_PATHS, ids=" ".join)
def test_every_verb_help_exits_0_and_shows_the_defaults(path):
    code, out = help_of(path)
    assert code == 0 and out.startswith(f"Usage: rmm-jax {' '.join(path)} "), out
    entries = option_entries(out)
    for opt in command_at(path).params:
        if not isinstance(opt, click.Option) or opt.hidden:
            continue
        assert all(name in entries for name in opt.opts), (opt.opts, sorted(entries))
        if opt.is_flag or opt.required or opt.default in NO_DEFAULT or opt.show_default is False:
            continue
        assert "[default:" in entries[opt.opts[0]], entries[opt.opts[0]]


@pytest.mark.parametrize("path", ALL_PATHS, ids=" ".join)
def test_every_verb_help_has_an_example_of_that_verb(path):
    """Sub-commands included (`policies list --help` once showed none), and each parses."""
    _, out = help_of(path)
    shown = examples(out)
    assert shown and all(f"{line} ".startswith(f"rmm-jax {' '.join(path)} ") for line in shown), shown
    if isinstance(command_at(path), click.Group):  # a group's examples cover each sub-command
        for sub in command_at(path).commands:
            assert any(line.startswith(f"rmm-jax {' '.join(path)} {sub} ") for line in shown), (sub, shown)
    for line in shown:
        assert parse_example(line)[0] == path or isinstance(command_at(path), click.Group), line


def test_version_names_jax_and_backend():
    exe = Path(sys.executable).parent / "rmm-jax"
    r = subprocess.run([str(exe), "version"], capture_output=True, text=True, cwd=REPO)
    assert r.returncode == 0 and r.stdout.startswith("rmm-jax ") and "jax" in r.stdout


def test_version_option(capsys):
    from rmm_jax.version import __version__

    code, out, err = run_cli(["--version"], capsys)
    assert (code, out, err) == (0, f"rmm-jax {__version__}\n", "")


def test_top_level_help_names_every_step_of_a_teams_day():
    flow = " ".join(line.split()[1] for line in flow_of(help_of(())[1]))
    assert flow == "embed rerank replay rerank evaluate embed retrieve pretrain simulate demo", flow


def test_unknown_verb_fails_with_one_line(capsys):
    code, _, err = run_cli(["frobnicate"], capsys)
    assert code != 0 and "No such command" in err and "Traceback" not in err


def _commands(group=None, path=()):
    for name, cmd in sorted((group or cli).commands.items()):
        if isinstance(cmd, click.Group):
            yield from _commands(cmd, (*path, name))
        else:
            yield (*path, name), cmd


def test_a_number_option_is_named_as_int_and_float_options_are(capsys):
    """A bounded number option said "INTEGER RANGE" in --help and "'abc' is not a valid integer
    range" for a non-number, where int options say INTEGER and "not a valid integer"."""
    ranged = [(path, p.name) for path, cmd in _commands() for p in cmd.params
              if isinstance(p.type, (click.IntRange, click.FloatRange))]
    assert len(ranged) > 10
    for path, cmd in _commands():
        for p in cmd.params:
            if isinstance(p.type, (click.IntRange, click.FloatRange)):
                assert p.type.name == ("integer" if isinstance(p.type, click.IntRange) else "float"), (path, p.name)
    code, _, err = run_cli(["retrieve", "nowhere", "--k", "abc"], capsys)
    assert code == 2 and "'abc' is not a valid integer. " in err, err


@pytest.mark.parametrize("words", [[], ["policies"]])
def test_a_group_called_alone_prints_its_help_not_an_error(capsys, words):
    """`rmm-jax` (or `rmm-jax policies`) alone asks for the help: it prints the group's help as
    click does (on stderr, exit 2), not "error: Usage: ..." with a hint to run --help."""
    code, out, err = run_cli(words, capsys)
    assert (code, out) == (2, "")
    first = err.splitlines()[0]       # the program's name is sys.argv[0]'s (pytest's, in-process)
    assert first.startswith("Usage: ") and first.endswith(" ".join([*words, "[OPTIONS] COMMAND [ARGS]..."])), first
    assert "error" not in err.splitlines()[0] and "--help')" not in err
    assert "Commands:" in err


@pytest.mark.parametrize("preset, loss, want", [
    ("default", None, "logistic"), ("realistic", "reinforce", "reinforce"),
    ("reinforce", None, "reinforce"), ("reinforce", "logistic", "logistic")])
def test_loss_option_overrides_the_presets_loss(preset, loss, want):
    from rmm_jax.cli.common import make_setting

    setting = make_setting(preset, 20, 5, None, None, None, None, None, None, "linear", loss=loss)
    assert setting.estimator.loss == want


# --------------------------------------------------------------------------- the examples run as written

# The verbs' examples form one walk from the repository root, in this order; the top-level
# help's typical flow is another. Each example reads only files of the repository (examples/)
# or what an example before it wrote.
WALK = ["embed", "retrieve", "pretrain", "simulate", "replay", "rerank", "evaluate", "cite-rates", "policies", "demo",
        "version"]
READS = ("store", "log_path", "calls_path")                  # parameters naming an input
WRITES = ("out", "log_out", "plot_path")                     # parameters naming an output


def flow_of(help_text):
    """The command lines of the top-level help's typical flow, up to the blank line after it (a
    comment may wrap to its own line; a line of two spaces titles the next part)."""
    m = re.search(r"^  Typical flow.*:\n((?:  .*\n?)+)", help_text, re.M)
    return [line.split("#")[0].strip() for line in m.group(1).splitlines() if line.strip().startswith("rmm-jax ")]


def parse_example(line):
    """(command path, click params) of ``rmm-jax ...``, parsed as click would run it."""
    args = line.split("#")[0].split()[1:]
    cmd, path = cli, []
    while isinstance(cmd, click.Group):
        path.append(args[0])
        cmd, args = cmd.commands[args[0]], args[1:]
    with cmd.make_context(" ".join(path), args) as ctx:
        return tuple(path), dict(ctx.params)


def check_walk(lines, made):
    """Each example parses, and every file or store it reads exists or was ``made`` before it."""
    from rmm_jax.data import load_spec

    for line in lines:
        path, p = parse_example(line)
        reads = [p[k] for k in READS if p.get(k)]
        if path[0] == "policies":
            reads.append(p["store"])
        if (path[0] in ("rerank", "evaluate") or p.get("init") == "pretrained") and p.get("policies"):
            reads.append(p["policies"])         # rerank without --policies serves the retriever
        if path[0] == "embed" and not p["spec"].startswith("synthetic"):
            load_spec(p["spec"])                      # the loader runs as written (no model needed)
        missing = [r for r in reads if r not in made and not (REPO / r).exists()]
        assert not missing, f"{line!r} reads {missing}, which no example before it writes"
        made |= {p[k] for k in WRITES if p.get(k)} | ({p["policies"]} if path[0] in ("simulate", "replay") else set())


def test_help_examples_parse_and_read_only_what_exists_or_an_earlier_example_wrote(monkeypatch):
    """Every verb's examples and the typical flow, as a user would paste them from the repository
    root: the options exist and take these values, an embed SPEC loads, and nothing is read
    that neither examples/ nor an earlier example provides (the `embed log:` example once
    failed on its own log)."""
    monkeypatch.chdir(REPO)
    check_walk(flow_of(help_of(())[1]), set())
    check_walk([line for verb in WALK for line in examples(help_of((verb,))[1])], set())
    assert {v for v in cli.commands} == set(WALK)           # a new verb joins the walk


def run_walk(lines, tmp_path, monkeypatch, capsys):
    """Run ``lines`` (``rmm-jax ...``) in order from a copy of the repository root's examples/,
    with a model-free embedder; returns {line: stdout}. Every line exits 0, but evaluate may
    exit 3 (some estimates unreliable: the fake embedder's logits, not the example)."""
    from conftest import run_cli as run  # (capsys, *args), not this file's run_cli
    from conftest import use_fake_embedder

    use_fake_embedder(monkeypatch)
    shutil.copytree(REPO / "examples", tmp_path / "examples")
    monkeypatch.chdir(tmp_path)
    outs = {}
    for line in lines:
        code, outs[line], err = run(capsys, *shlex.split(line.split("  #")[0])[1:])
        verb = line.split()[1]
        assert code == 0 or (verb == "evaluate" and code == 3 and "unreliable; exit status 3" in err), (line, err)
    return outs


def test_the_typical_flow_runs_as_written_and_measures_something(tmp_path, monkeypatch, capsys):
    """The top-level help's typical flow, run line by line (`demo` has its own tests): every
    command exits 0, and retrieve, pretrain and simulate get questions with gold. The flow
    once ran them on examples/, which holds none: a table of dashes, then two errors."""
    lines = flow_of(help_of(())[1])
    assert lines[-1] == "rmm-jax demo", lines
    outs = run_walk(lines[:-1], tmp_path, monkeypatch, capsys)
    (out,) = [o for line, o in outs.items() if line.split()[1] == "retrieve"]
    overall = next(r for r in out.splitlines() if r.startswith("overall")).split()
    assert int(overall[1]) > 0 and float(overall[2]) > 0, out       # questions measured
    assert {p.name for p in tmp_path.iterdir()} >= {"stores", "policies", "pretrained", "simulated"}


def test_every_verbs_examples_run_as_written_in_order(tmp_path, monkeypatch, capsys):
    """The walk of every verb's examples, run (the test above only parses it): retrieve's,
    pretrain's and simulate's ran on the chats of examples/, which hold no question, so a
    user who pasted them got a table of dashes and errors. `demo` has its own tests."""
    lines = [line for verb in WALK if verb != "demo" for line in examples(help_of((verb,))[1])]
    assert len(lines) > 20, lines
    run_walk(lines, tmp_path, monkeypatch, capsys)


# Each verb's module loads when the verb is called. The child embeds a small chat history with a
# model-free embedder and reports which of JAX's libraries it imported on the way.
NO_JAX_CHILD = textwrap.dedent("""
    import sys
    from fake_embedder import FakeEmbedder
    import rmm_jax.cli.embed as verb
    verb.Embedder = lambda *a, **kw: FakeEmbedder(8)
    from rmm_jax.cli.main import main
    for args in (["--version"], ["embed", "--help"], ["embed", sys.argv[1], "--out", sys.argv[2]]):
        try:
            main(args)
        except SystemExit as e:
            assert not e.code, (args, e.code)
    print(sorted(m for m in sys.modules if m.split(".")[0] in ("jax", "jaxlib", "chex", "optax")))
""")


def test_the_verbs_without_jax_start_without_it(tmp_path):
    assert WITHOUT_JAX == {"embed"}  # the child below runs each of them
    env = {**os.environ, "PYTHONPATH": str(REPO / "tests")}
    p = subprocess.run([sys.executable, "-c", NO_JAX_CHILD, "jsonl:examples/chat_history.jsonl", str(tmp_path / "s")],
                       cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    assert p.stdout.splitlines()[-1] == "[]", p.stdout
    store = open_store(tmp_path / "s")
    assert len(store.user_ids) == 12 and store.model == "fake/bow-8" and store.dim == 8


def test_as_options_names_the_option_that_gives_an_argument():
    """cli.shell.as_options: an API error about one of the listed arguments (InputError's
    ``arg=``) becomes its option's (underscores as dashes, or the option a rename gives),
    keeping what follows the name; any other error passes as it is, a location (``where=``)
    spelt like an argument among them: a store directory named ``users`` is not ``--users``."""
    import pytest

    from rmm_jax.cli.shell import as_options
    from rmm_jax.errors import InputError

    for given, args, renamed, want in (({"arg": "val_fraction"}, ("val_fraction",), {}, "--val-fraction: bad"),
                                       ({"arg": "users user9"}, ("users",), {}, "--users user9: bad"),
                                       ({"arg": "path"}, (), {"path": "into"}, "--into: bad"),
                                       ({"arg": "model_id"}, ("model",), {"model_id": "model"}, "--model: bad"),
                                       ({"arg": "store"}, ("users",), {}, "store: bad"),
                                       ({"arg": "users9"}, ("users",), {}, "users9: bad"),
                                       ({"where": "users"}, ("users",), {}, "users: bad"),
                                       ({"where": "users user9"}, ("users",), {}, "users user9: bad"),
                                       ({"where": "path"}, (), {"path": "into"}, "path: bad"),
                                       ({}, ("users",), {}, "bad")):
        with pytest.raises(InputError) as e, as_options(*args, **renamed):
            raise InputError("bad", **given)
        assert str(e.value) == want, (given, str(e.value))
        if want.startswith("--"):            # an option is a location: another as_options leaves it
            assert e.value.arg is None and e.value.where == want.partition(":")[0]
    with pytest.raises(ValueError, match="^users: plain$"), as_options("users"):
        raise ValueError("users: plain")                  # not an InputError: not the API's one line
    # within it, an API message that mentions a listed argument in its text names the option
    from rmm_jax.errors import named

    with as_options("min_ess", "relearn", path="into"):
        assert (named("min_ess", 3), named("relearn", True), named("path"), named("clip", 10)) == \
            ("--min-ess 3", "--relearn", "--into", "clip=10")
        with as_options("clip"):                                           # inner adds to outer
            assert (named("clip", 10), named("min_ess")) == ("--clip 10", "--min-ess")
    assert (named("min_ess", 3), named("relearn", True)) == ("min_ess=3", "relearn=True")    # and is gone after


class _Terminal(io.StringIO):
    def isatty(self):
        return True


@pytest.mark.parametrize("stream, drawn", [(_Terminal, True), (io.StringIO, False)], ids=["terminal", "log file"])
def test_progress_bars_draw_on_a_terminal_only(monkeypatch, stream, drawn):
    """A nightly job's stderr, sent to a file, once filled with the bars' carriage returns."""
    from rmm_jax.cli.common import progress_bar

    err = stream()
    monkeypatch.setattr(sys, "stderr", err)
    with progress_bar(3, "rerank", unit="batch") as bar:
        for _ in range(3):
            bar.update(1)
    assert ("\r" in err.getvalue() and "rerank" in err.getvalue()) == drawn, repr(err.getvalue())


@pytest.mark.parametrize("path, options", [(("simulate",), ["--k", "--m", "--batch"]),
                                           (("replay",), ["--k", "--m", "--batch", "--passes", "--clip"])],
                         ids=lambda x: " ".join(x) if isinstance(x, tuple) else None)
def test_options_with_a_floor_show_it_in_help_and_refuse_below_it_by_name(path, options, capsys):
    """--batch, --passes and --clip showed no valid range, unlike the options that show x>=1;
    --batch and --passes show their ceiling too (1<=x<=MAX_BATCH, MAX_PASSES)."""
    from rmm_jax.cli.common import MAX_BATCH, MAX_PASSES
    entries = option_entries(help_of(path)[1])
    for opt in options:
        top = {"--batch": MAX_BATCH, "--passes": MAX_PASSES}.get(opt)
        shown = "x>=1" if top is None else f"1<=x<={top}"
        assert shown in entries[opt], entries[opt]
        code, _, err = run_cli([*path, "STORE", opt, "0"], capsys)
        assert code == 2 and re.search(rf"Invalid value for '{opt}': 0(\.0)? is not in the range {re.escape(shown)}",
                                       err), err


def test_demo_says_how_much_room_pretraining_leaves_and_online_stays_within_it(capsys, monkeypatch, tmp_path):
    """The demo's room line is the ceiling's Recall@M minus pretraining's, from the same rows it
    writes to summary.json (which carries it too, for scripts), and what online learning adds after
    pretraining never passes it: the ceiling orders every gold candidate first, so no reranker of the
    K candidates does better."""
    monkeypatch.setattr("rmm_jax.cli.demo.Embedder", lambda *a, **kw: FakeEmbedder(16))
    out_dir = tmp_path / "demo"
    code, out, err = run_cli([str(a) for a in ("demo", "--out", out_dir, "--users", 4, "--sessions", 3,
                                               "--turns", 4, "--k", 8, "--m", 3)], capsys)
    assert code == 0, err
    summary = json.loads((out_dir / "summary.json").read_text())
    rows = summary["rows"]
    room = rows["ceiling"]["recall@3"] - rows["pretrain"]["recall@3"]
    assert summary["room_above_pretraining"] == pytest.approx(room, abs=1e-12)
    line = [s for s in out.splitlines() if s.startswith("room above pretraining:")]
    assert len(line) == 1, out
    assert float(line[0].split()[3]) == pytest.approx(room, abs=5e-5), (line, room)
    assert rows["pretrain+online"]["recall@3"] <= rows["ceiling"]["recall@3"] + 1e-9
    assert room >= -1e-9
    # its own --out again: a re-run (the store reused); someone's directory: refused, nothing written
    code, _, err = run_cli([str(a) for a in ("demo", "--out", out_dir, "--users", 4, "--sessions", 3,
                                             "--turns", 4, "--k", 8, "--m", 3, "-q")], capsys)
    assert code == 0, err
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("x")
    (mine / "summary.json").write_text('{"mine": 1}')
    for bad, says in ((mine, "holds 'notes.txt', which no demo wrote"), (mine / "only_summary", "holds a "
                      "summary.json that is not a demo's, which no demo wrote")):
        if bad.name == "only_summary":
            bad.mkdir()
            (bad / "summary.json").write_text("[]")
        before = sorted(p.name for p in bad.iterdir())
        code, out, err = run_cli(["demo", "--out", str(bad)], capsys)
        assert (code, out) == (2, "") and err == f"error: --out {bad}: {says}: give a new or empty directory, or an " \
            "earlier demo's --out\n", err
        assert sorted(p.name for p in bad.iterdir()) == before


@pytest.mark.parametrize("verb", ["rerank", "evaluate"])
def test_the_draw_temperature_is_draw_tau_in_every_verb_and_tau_still_gives_it(verb):
    """rerank's and evaluate's --tau is the draw's temperature, which replay, simulate and demo
    call --draw-tau (their --tau is the loss's): a user who copied --tau from a replay drew at
    the loss's temperature. Its name is --draw-tau there too; --tau still gives the same value."""
    for name in ("--draw-tau", "--tau"):
        args = [name, "0.25"] + (["S", "--calls", "c.jsonl", "--explore"] if verb == "rerank" else
                                 ["S", "--log", "l.jsonl", "--policies", "p"])
        with cli.commands[verb].make_context(verb, args) as ctx:
            assert ctx.params["tau"] == 0.25
    opts = {p.name: p.opts for p in cli.commands[verb].params}
    assert opts["tau"][0] == "--draw-tau"
    assert all("--draw-tau" in {o for p in cli.commands[v].params for o in p.opts} for v in ("replay", "simulate"))
