"""The shell's side of every verb, without JAX: notes on stderr (no routine ones under
``--quiet``) and JSON on stdout, the ``--users`` filter, which options the user gave, and
output paths refused before any work.

Verbs that never touch JAX (``embed``) import only this of the CLI's helpers, so that they
start in a fraction of a second (:mod:`rmm_jax.cli.main` loads each verb when it is called).
"""
from __future__ import annotations

import contextlib
import functools
import json
import math
import os
from pathlib import Path

import click
from click.core import ParameterSource

from rmm_jax.cli import disk_errors
from rmm_jax.data.embed import CACHE_ENV, DEFAULT_CACHE_ROOT, QUIET
from rmm_jax.data.words import count  # noqa: F401 - the verbs' count, shared with the data layer's lines
from rmm_jax.errors import InputError, WriteFailed, worded
from rmm_jax.persist.atomic import real_path, write_problem


class IntRange(click.IntRange):
    """click's ``IntRange`` named as ``int`` options are, in help and errors (``--k INTEGER``,
    "'abc' is not a valid integer"), not "integer range"; the bounds still show in the help."""
    name = "integer"


class FloatRange(click.FloatRange):
    """click's ``FloatRange`` named as ``float`` options are ("'abc' is not a valid float")."""
    name = "float"


SEED = IntRange(0, 2**63 - 1)   # every --seed: NumPy's generators refuse < 0, JAX's keys >= 2**63
MAX_INDEX = 2**31 - 1           # candidates and memories are indexed in int32: --k 10**20 was a NumPy traceback


class IndexCount(IntRange):
    """A count of candidates or memories (``--k``, ``--m``): at least 1 (``x>=1`` in the help),
    at most :data:`MAX_INDEX`, which an error names."""

    def __init__(self):
        super().__init__(min=1)

    def convert(self, value, param, ctx):
        n = super().convert(value, param, ctx)
        if n > MAX_INDEX:
            self.fail(f"{n} is more than {MAX_INDEX} (candidates and memories are indexed in int32)", param, ctx)
        return n


#: The lines a user must read, printed under ``--quiet`` too.
MUST_READ = ("note: ", "warning: ", "error: ")

QUIET_HELP = ("No progress bars and no routine lines on stderr; what must be read stays: every note:, warning: "
              "and error: line, and stdout.")


def info(msg: str, *, must_read: bool = False) -> None:
    """Progress and notes go to stderr so that ``--json`` stdout stays parseable. Under
    ``--quiet`` (:func:`quiet_option`) only the lines a user must read are printed: those that
    start ``note:``, ``warning:`` or ``error:``, and those a caller marks ``must_read`` (a
    state to act on said without such a prefix); routine lines (progress, what was written,
    timings) are not."""
    if QUIET.get() and not must_read and not msg.startswith(MUST_READ):
        return
    click.echo(msg, err=True)


def note_lines(lines) -> None:
    """A ``note:`` line on stderr for each of ``lines`` (None: none): what a read noted (unknown
    keys that look misspelt, texts the model cut) and a policy store's notes
    (:class:`rmm_jax.persist.policy_rollback.StoreNotes` ``.lines``)."""
    for line in filter(None, lines):
        info(f"note: {line}")


def quiet() -> bool:
    """True while the running command was given ``--quiet``."""
    return QUIET.get()


def quiet_option(f):
    """``--quiet/-q``, the same on every verb that prints progress or routine lines on stderr:
    for the command's run, :func:`info` prints only what must be read and no progress bar
    shows (:func:`rmm_jax.cli.common.progress_bar`, the embedding bars). The state is set
    around the command and reset after it, also on an error, so that a command run in the
    same process after it (a test's) is not quiet. tests/test_cli_quiet.py checks that every
    verb that prints such lines has it."""
    @functools.wraps(f)
    def run(*args, quiet: bool, **kwargs):
        token = QUIET.set(quiet)
        try:
            return f(*args, **kwargs)
        finally:
            QUIET.reset(token)
    return click.option("--quiet", "-q", is_flag=True, help=QUIET_HELP)(run)


def cache_dir_option(f):
    """``--cache-dir``, the same on every verb that embeds text (``embed``, and ``rerank``,
    ``replay`` and ``evaluate`` for the texts a store lacks): the embedding cache's root, given
    to the verb as ``cache_dir`` (None: ``$RMM_JAX_CACHE``, else the default root)."""
    return click.option("--cache-dir", type=click.Path(file_okay=False), default=None,
                        show_default=f"${CACHE_ENV} or {DEFAULT_CACHE_ROOT}",
                        help="Embedding cache root; one sub-directory per model.")(f)


def _plain(x):
    """``x`` with NumPy scalars and arrays as Python numbers and lists, tuples as lists, and
    every non-finite float as None."""
    if isinstance(x, dict):
        return {k: _plain(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_plain(v) for v in x]
    if hasattr(x, "tolist") and not isinstance(x, (str, bytes)):    # NumPy (and JAX) scalars and arrays
        return _plain(x.tolist())
    if isinstance(x, float) and not math.isfinite(x):
        return None
    return x


def json_text(obj, *, indent: int | None = 2, sort_keys: bool = True) -> str:
    """``obj`` as strict JSON: a non-finite float is written as null, like every value these
    objects cannot give (json.dumps writes NaN or Infinity, which json.loads accepts and jq and
    other strict parsers refuse), NumPy numbers as numbers (an integer stays one)."""
    return json.dumps(_plain(obj), indent=indent, sort_keys=sort_keys, allow_nan=False)


def emit_json(obj, *, indent: int | None = 2, sort_keys: bool = True) -> None:
    """Print ``obj`` on stdout as one strict JSON document (:func:`json_text`): what every
    verb's ``--json`` prints, alone on stdout."""
    click.echo(json_text(obj, indent=indent, sort_keys=sort_keys))


def json_option(what: str, keys: str):
    """``--json``, the same on every verb: ``what`` the object is and ``keys`` its top-level
    keys, named in the help so that a script knows what to read (tests/test_cli_json.py checks
    that every key a verb prints is named). Notes, warnings and progress stay on stderr."""
    return click.option("--json", "as_json", is_flag=True,
                        help=f"Print {what} as one JSON object on stdout, keys: {keys}. "
                             "Notes and progress stay on stderr.")


def parse_users(users: str | None) -> list[str] | None:
    """``--users a,b`` -> ``["a", "b"]`` (None: all users); an empty or repeated item is an
    error (a user run twice in one run is saved twice in one version; pretrain trained on it twice).

    >>> from rmm_jax.cli.shell import parse_users
    >>> parse_users("a, b")
    ['a', 'b']
    """
    if users is None:
        return None
    ids = [u.strip() for u in users.split(",")]
    if not all(ids):
        raise InputError(f"empty user id in {users!r} (expected comma-separated ids, e.g. a,b)", where="--users")
    seen: set[str] = set()
    twice = next((u for u in ids if u in seen or seen.add(u)), None)
    if twice is not None:
        raise InputError(f"user id {twice!r} is given twice", where="--users")
    return ids


def users_option(what: str = "Only these users", default: str = "all"):
    """``--users a,b``, the same filter on every verb that takes users; the value arrives
    parsed (a list of ids, or None: ``default``, which the help shows)."""
    return click.option("--users", default=None, metavar="A,B", callback=lambda ctx, p, v: parse_users(v),
                        help=f"{what} (comma-separated ids; default: {default}).")


def _png_path(ctx, param, value):
    if value is not None and Path(value).suffix.lower() != ".png":
        raise InputError(f"must name a .png file, got {value!r}", where="--plot")
    return value


def png_option(help: str):
    """``--plot FILE.png``, the same on every verb that draws (``help`` says what): a path that
    does not end in .png is refused in one line when the options are read, before any work."""
    return click.option("--plot", "plot_path", type=click.Path(dir_okay=False), default=None, metavar="FILE.png",
                        callback=_png_path, help=help)


def explicit_options() -> set[str]:
    """The parameters of the running command that the user gave (on the command line or
    in the environment), not left at their defaults."""
    ctx = click.get_current_context()
    given = (ParameterSource.COMMANDLINE, ParameterSource.ENVIRONMENT)
    return {n for n in ctx.params if ctx.get_parameter_source(n) in given}


def check_writable(path, where: str, depth: int = 0, *, own_files: bool = True) -> None:
    """Refuse, in one line and before any work, an output location that cannot take new files
    (:func:`rmm_jax.persist.atomic.write_problem`: permissions, a read-only mount). A read-only
    file system is the machine's doing (exit status 1, :class:`~rmm_jax.errors.WriteFailed`), as
    when it stops a write part-way; a permission is the input's (2)."""
    disk_errors.writing(where, path)      # named by the line of a full disk or a size limit later
    problem = write_problem(path, depth, own_files=own_files)
    if problem:
        raise (WriteFailed if problem.machine else InputError)(f"cannot write: {problem}", where=where)


def check_output_file(path, where: str) -> None:
    """A file output (written to a temporary sibling, then renamed): its directory must take new
    files. ``-``, which a user means as stdout, was written as a file named ``-``: an option
    that takes it as stdout (``rerank --out -``) turns it into None first; here it is refused
    in one line, since stdout carries the verb's own output."""
    if str(path) == "-":
        raise InputError("writes a file, not stdout (stdout carries this command's own output, its summary or "
                         "--json); give a file path", where=where)
    if path:
        disk_errors.writing(where, path)
        target = real_path(path)                                      # a link's file is replaced where it points
        check_writable(target.parent, where, own_files=False)         # renamed in: the others are not touched
        if target.is_file() and not os.access(target, os.W_OK):       # but a read-only or immutable one is refused
            raise InputError(f"cannot write: {target}: not writable", where=where)


def check_output_dir(path, where: str) -> None:
    """A directory output (``embed --out``, ``pretrain --out``): ``-``, which a user means as
    stdout, made a directory named ``-``; it is refused in one line, before any work."""
    if str(path) == "-":
        raise InputError("writes a directory, not stdout; give a directory path", where=where)
    disk_errors.writing(where, path)


TWICE = " (the log is read more than once: checked whole before anything is written or estimated, then used)"


def check_input_file(path, where: str, why: str = "") -> None:
    """An input file that cannot be standard input (``-``, which was "file not found"): refused
    in one line saying ``why``, before any work. ``rerank --calls -`` reads stdin instead."""
    if str(path) == "-":
        raise InputError(f"reads a file, not standard input{why}; give a file path", where=where)


@contextlib.contextmanager
def as_options(*args: str, **renamed: str):
    """The API's errors about one of its arguments ``args`` (``InputError(..., arg="min_ess")``:
    ``min_ess: ...``), as the one-line error of the option that gives it (``--min-ess: ...``,
    underscores as dashes): called from Python they name the argument, and one check serves
    both. ``renamed`` maps an argument to the option that gives it under another name
    (``path="into"``: ``--into``). An argument error that goes on after the name
    (``arg="users user9"``) keeps the rest (``--users user9``). Any other error passes
    unchanged, a location among them: a store directory named ``users`` is not ``--users``.
    Within it, the API's messages that mention one of these arguments (:func:`rmm_jax.errors.named`:
    ``more than k=4``) name its option (``more than --k 4``)."""
    try:
        with worded({a: "--" + renamed.get(a, a).replace("_", "-") for a in (*args, *renamed)}):
            yield
    except InputError as e:
        if e.arg is None or (e.arg not in args and e.arg not in renamed):
            raise
        msg = e.message
        option = renamed.get(e.arg, e.arg).replace("_", "-")
        raise InputError(msg, where=f"--{option}{e.where[len(e.arg):]}") from None
