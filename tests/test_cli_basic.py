"""The console script exists, teaches, and reports its version."""
import subprocess
import sys
from pathlib import Path


from rmm_jax.cli.main import main

REPO = Path(__file__).resolve().parents[1]


def run_cli(args, capsys):
    try:
        main(args)
        code = 0
    except SystemExit as e:
        code = e.code or 0
    out = capsys.readouterr()
    return code, out.out, out.err


def test_help_lists_the_verbs(capsys):
    code, out, _ = run_cli(["--help"], capsys)
    assert code == 0 and "version" in out and "Typical flow" in out


def test_version_names_jax_and_backend():
    exe = Path(sys.executable).parent / "rmm-jax"
    r = subprocess.run([str(exe), "version"], capture_output=True, text=True, cwd=REPO)
    assert r.returncode == 0 and r.stdout.startswith("rmm-jax ") and "jax" in r.stdout


def test_unknown_verb_fails_with_one_line(capsys):
    code, _, err = run_cli(["frobnicate"], capsys)
    assert code != 0 and "No such command" in err and "Traceback" not in err
