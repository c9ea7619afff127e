"""``rmm-jax demo`` as a result file (docs/index.md shows its table).

    python benchmarks/demo_result.py --json benchmarks/results/demo.json --plot benchmarks/results/demo.png

Runs the demo exactly as ``make demo`` does (``rmm-jax demo --json``: 16 built-in synthetic
users, half pretrain, the online loop on the other half, the default preset) in a temporary
working directory, and writes its JSON summary with the provenance every result file
carries (command, commit, whether the tree was clean). Extra arguments go to ``rmm-jax demo``.
"""
from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import tempfile
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import _common  # noqa: E402

from rmm_jax.cli.main import main as cli  # noqa: E402


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0], formatter_class=_common.HelpFormatter)
    ap.add_argument("--json", type=Path, default=None, help="write the demo's summary here")
    ap.add_argument("--plot", type=Path, default=None, help="copy the demo's learning_curve.png here")
    args, demo_args = ap.parse_known_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            try:
                cli(["demo", "--out", str(Path(tmp) / "demo"), "--json", *demo_args])
            except SystemExit as e:
                if e.code:
                    raise
        summary = json.loads(out.getvalue())
        if args.plot:
            with _common.atomic_output(args.plot) as tmp:
                tmp.write_bytes(Path(summary["plot"]).read_bytes())
    summary.pop("plot", None)                      # a temporary path
    summary["demo_args"] = demo_args
    for name, row in summary["rows"].items():
        if not name.startswith("_"):
            print(f"{name:<16} Recall@5 {row['recall@5']:.4f}")
    if args.json:
        _common.write_result(args.json, summary)
    return summary


if __name__ == "__main__":
    main()
