"""The ``rmm-jax`` command line: one click group, one verb per sub-command, each verb's
module imported when the verb is called (:class:`Verbs`), so that a verb loads only what it
needs (``embed`` and ``--version`` start without JAX).

The CLI is a thin shell over :mod:`rmm_jax`. Bad input raises
:class:`rmm_jax.errors.InputError`; :func:`main` prints its one-line message on stderr
and exits with status 2 (75 for a :class:`rmm_jax.errors.Busy` one: another process holds
the lock on what this command writes; retry when it ends), with no traceback. Click's usage
errors (a bad option value, a missing argument) are printed the same way: one ``error: ...`` line, status 2. Warnings
raised during a command print as ``warning: ...`` lines without source lines, repeated
policy restores summarised (:mod:`rmm_jax.cli.warning_lines`). A reader of stdout that
leaves before everything is written (``| head -1``) is the same line as a FIFO's
(:func:`rmm_jax.persist.atomic.atomic_file`): ``error: stdout: its reader closed the pipe
before everything was written``, status 2.
"""
from __future__ import annotations

import contextlib
import importlib
import io
import os
import sys

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import click

from rmm_jax.cli import disk_errors
from rmm_jax.cli.signals import Interrupted
from rmm_jax.cli.warning_lines import reported_warnings
from rmm_jax.errors import PIPE_CLOSED, InputError
from rmm_jax.version import __version__

CONTEXT = dict(help_option_names=["-h", "--help"], show_default=True, max_content_width=100)

# verb -> the module that defines it (rmm_jax.cli.<module>); a module is imported when its verb
# is called or listed, so a verb starts with only what it needs.
VERBS: dict[str, str] = {"embed": "embed", "retrieve": "retrieve", "policies": "policies", "pretrain": "pretrain",
                         "simulate": "simulate", "replay": "replay", "rerank": "rerank", "evaluate": "evaluate",
                         "cite-rates": "cite_rates", "demo": "demo"}
# Verbs that never load JAX (tests/test_cli_basic.py checks it): they start in a fraction of a
# second, and have no programs to keep in the compilation cache.
WITHOUT_JAX = frozenset({"embed"})


class _StdoutClosed(Exception):
    """stdout's reader left: raised past click, whose ``main`` would exit 1 without a word."""


class Verbs(click.Group):
    """The group, loading each verb's module on first use (click's lazy group pattern)."""

    def make_context(self, *args, **kwargs) -> click.Context:   # --help and --version print here
        try:
            return super().make_context(*args, **kwargs)
        except BrokenPipeError as e:
            raise _StdoutClosed from e

    def invoke(self, ctx: click.Context):                         # every verb, its --help included
        try:
            return super().invoke(ctx)
        except BrokenPipeError as e:
            raise _StdoutClosed from e

    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted({*self.commands, *VERBS})

    def get_command(self, ctx: click.Context, name: str) -> click.Command | None:
        if name not in self.commands and name in VERBS:
            importlib.import_module(f"rmm_jax.cli.{VERBS[name]}")  # the module adds its verb to `cli`
        return self.commands.get(name)


@click.group(cls=Verbs, context_settings=CONTEXT)
@click.option("--compile-cache/--no-compile-cache", default=True,
              help="Keep compiled programs on disk so that the next command loads them instead of compiling again "
                   "(in $JAX_COMPILATION_CACHE_DIR, else $XDG_CACHE_HOME/rmm-jax/jax or ~/.cache/rmm-jax/jax, and "
                   "the serving programs whole in the same path followed by -executables; "
                   "RMM_JAX_COMPILE_CACHE=0 also switches it off).")
@click.version_option(__version__, "--version", prog_name="rmm-jax", message="%(prog)s %(version)s",
                      help="Print the version and exit (the `version` verb adds JAX and the device).")
@click.pass_context
def cli(ctx: click.Context, compile_cache: bool):
    """rmm-jax: train and simulate the citation-driven memory reranker of
    Reflective Memory Management (Tan et al., ACL 2025) on precomputed embeddings.

    \b
    Typical flow (from the repository root, on examples/: chats and logged calls, no questions):
      rmm-jax embed jsonl:examples/chat_history.jsonl --out stores/mine   # chats -> embedding store
      rmm-jax rerank stores/mine --calls examples/requests_day1.jsonl --explore --out served1.jsonl
                                                  # serve day 1: no policy yet, the retriever's
      rmm-jax replay stores/mine --log examples/calls_day1.jsonl --policies policies --scope hybrid
                                                  # at night: learn from the day's logged citations
      rmm-jax rerank stores/mine --policies policies --calls examples/requests_day2.jsonl --explore --out served2.jsonl
                                                  # serve day 2 from what it learned
      rmm-jax evaluate stores/mine --log examples/calls_day2.jsonl --policies policies
                                                  # before shipping a night: estimate on a day's log
    (A start from the chats themselves, `pretrain --labels dialogue`, suits some chats and not
    these: `evaluate` it on a day's log first, docs/own-data.md.)
    With questions and gold (locomo:, longmemeval:, your chats' questions, or synthetic users):
      rmm-jax embed synthetic:users=8 --out stores/synth
      rmm-jax retrieve stores/synth --k 20                    # the base retriever's Recall
      rmm-jax pretrain stores/synth --out pretrained          # offline reranker on the gold
      rmm-jax simulate stores/synth --policies simulated      # learn from simulated citations
      rmm-jax demo                                # all of it on built-in synthetic users
    """
    if ctx.invoked_subcommand not in WITHOUT_JAX:
        from rmm_jax.online.compile_cache import setup  # imports JAX

        setup(compile_cache)


@cli.command()
@click.option("--json", "as_json", is_flag=True,
              help="Print the versions as one JSON object on stdout, keys: rmm_jax, jax, jaxlib, python, backend, "
                   "devices (one string per device JAX sees).")
def version(as_json):
    """Print the rmm-jax, JAX and device versions.

    \b
    Example:
      rmm-jax version
      rmm-jax version --json
    """
    import platform

    import jax
    import jaxlib

    if as_json:
        from rmm_jax.cli.shell import emit_json

        emit_json({"rmm_jax": __version__, "jax": jax.__version__, "jaxlib": jaxlib.__version__,
                   "python": platform.python_version(), "backend": jax.default_backend(),
                   "devices": [str(d) for d in jax.devices()]})
        return
    click.echo(f"rmm-jax {__version__} (jax {jax.__version__}, backend {jax.default_backend()})")


def register_commands() -> None:
    """Import every verb's module now (each adds itself to :data:`cli`), for readers of
    ``cli.commands`` such as the docs; commands themselves load their verb on first use."""
    for name in VERBS.values():
        importlib.import_module(f"rmm_jax.cli.{name}")


class _Stdout(io.RawIOBase):
    """stdout's file descriptor, whose write errors name ``stdout`` (a full disk under
    ``> served.jsonl`` is ``error: stdout: no space left on device``, not an unnamed write):
    :func:`rmm_jax.cli.disk_errors.error_line` reads the name. Never closes the descriptor."""

    def __init__(self, fd: int):
        super().__init__()
        self._fd = fd

    def writable(self) -> bool:
        return True

    def fileno(self) -> int:
        return self._fd

    def write(self, b) -> int:
        try:
            return os.write(self._fd, b)
        except OSError as e:        # EPIPE stays a BrokenPipeError (OSError picks the subclass by errno)
            raise OSError(e.errno, e.strerror, disk_errors.STDOUT) from None


def _whole_writes() -> None:
    """stdout through :class:`_Stdout` and a buffered writer. Under PYTHONUNBUFFERED (or
    ``python -u``) stdout wrote straight into its file, and a write that a pipe took only part
    of (its reader gone) lost the rest without an error (TextIOWrapper ignores the short
    count): a buffered writer writes everything or raises, and its errors name stdout. Lines
    go out as before: line by line where stdout was unbuffered or line-buffered (a terminal;
    ``click.echo`` flushes), in blocks into a file or a pipe. A stdout without a descriptor
    (a test's capture) stays as it is."""
    out = sys.stdout
    try:
        fd = out.fileno()
    except (AttributeError, OSError, ValueError):
        return
    lines = bool(out.line_buffering) or isinstance(getattr(out, "buffer", None), io.RawIOBase)
    with contextlib.suppress(OSError, ValueError):
        out.flush()
    sys.stdout = io.TextIOWrapper(io.BufferedWriter(_Stdout(fd)), encoding=out.encoding, errors=out.errors,
                                  line_buffering=lines)


def main(argv=None) -> None:
    _whole_writes()
    disk_errors.forget()
    try:
        with reported_warnings():  # one formatted line per warning on stderr, at the end
            code = cli.main(args=argv, standalone_mode=False)
            if sys.stdout is not None:      # what is still buffered: a reader gone fails here, not at the exit
                sys.stdout.flush()
        if isinstance(code, int) and code:  # ctx.exit(n) returns n when click is not standalone
            sys.exit(code)
    except InputError as e:            # 2: bad input; 75 (Busy): another writer holds the lock, retry later
        click.echo(f"error: {e}", err=True)
        sys.exit(e.exit_code)
    except (_StdoutClosed, BrokenPipeError):   # `rmm-jax ... | head -1`: as a FIFO's reader leaving (--out)
        _stdout_closed()
    except Interrupted as e:  # SIGINT/SIGTERM: progress was checkpointed (rmm_jax.cli.signals)
        click.echo(str(e), err=True)
        sys.exit(e.exit_code)
    except click.exceptions.Abort:
        click.echo("aborted", err=True)
        sys.exit(130)
    except click.exceptions.NoArgsIsHelpError as e:
        # `rmm-jax` or `rmm-jax policies` alone: the help is what was asked for, not an error line
        click.echo(e.format_message(), err=True)
        sys.exit(e.exit_code)
    except click.UsageError as e:
        # One line, like InputError (click's own format adds usage and hint lines).
        hint = f" (try '{e.ctx.command_path} --help')" if e.ctx is not None else ""
        click.echo(f"error: {e.format_message()}{hint}", err=True)
        sys.exit(e.exit_code)
    except click.ClickException as e:
        e.show()
        sys.exit(e.exit_code)
    except click.exceptions.Exit as e:
        sys.exit(e.exit_code)
    except KeyboardInterrupt:
        click.echo("interrupted", err=True)
        sys.exit(130)
    except MemoryError as e:    # e.g. numpy's, for a --users-per-chunk far beyond the store's users
        _out_of_memory(e, argv)
    except Exception as e:      # a full disk or a size limit (ulimit -f) while writing: one line, not a traceback
        if "RESOURCE_EXHAUSTED" in str(e).split(":", 1)[0] + type(e).__name__:   # XLA's out of memory
            _out_of_memory(e, argv)
        line = disk_errors.error_line(e)
        if line is None:
            raise
        click.echo(line, err=True)
        sys.exit(1)


#: the options that size what a command holds in memory, in the order the advice names them
SIZES = ("--users-per-chunk", "--batch", "--k", "--hidden")


def _out_of_memory(e: BaseException, argv) -> None:
    """One line and status 1 for a run out of memory (NumPy's MemoryError, XLA's
    RESOURCE_EXHAUSTED, which `pretrain --hidden 100000000` was a traceback of), naming the
    options of the command run that size what it holds."""
    words = sys.argv[1:] if argv is None else [str(a) for a in argv]
    cmd, group = None, cli
    for w in words:              # the sub-command (and a group's sub-command): its options
        sub = getattr(group, "commands", {}).get(w)
        if sub is None:
            break
        cmd = group = sub
    have = {o for p in (cmd.params if cmd is not None else ()) for o in p.opts}
    sizes = [o for o in SIZES if o in have]
    detail = str(e).strip().splitlines()[0][:200] if str(e).strip() else type(e).__name__
    click.echo(f"error: out of memory ({detail})"
               + (f"; smaller {', '.join(sizes[:-1])}{' or ' if len(sizes) > 1 else ''}{sizes[-1]} need less"
                  if sizes else ""), err=True)
    sys.exit(1)


def _stdout_closed() -> None:
    """One error line and status 2 (as for a FIFO's reader leaving), then nothing more: stdout
    becomes /dev/null, so that Python's flush at the exit of what is left does not print
    "Exception ignored ... BrokenPipeError" (Python's docs, "Note on SIGPIPE")."""
    with contextlib.suppress(OSError):      # stderr may be gone too (`2>&1 | head`)
        click.echo(f"error: {InputError(PIPE_CLOSED, where='stdout')}", err=True)
    with contextlib.suppress(OSError, ValueError):
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
    sys.exit(2)


if __name__ == "__main__":
    # Run through the imported module so sub-commands register on the same group.
    from rmm_jax.cli.main import main as _main

    _main()
