"""What every benchmark shares: where LoCoMo is, what happens when it is absent, how a
result file is written, and how spread and uncertainty are summarised.

Scripts run as ``python benchmarks/NAME.py``, so Python puts this folder first on
``sys.path`` and ``import _common`` works without touching it; ``rmm_jax`` is the installed
package. No benchmark imports another: what two of them need lives here.

* :func:`locomo_dir` / :func:`add_data_option`: ``--data`` (default ``$RMM_LOCOMO_DIR``, else
  ``../shared/data/locomo`` beside the repository), and :func:`require_data`: absent data
  is a skip with the reason (exit 0), except under ``CI=true`` where it fails (exit 1).
* :func:`write_result`: the JSON artifact under ``benchmarks/results/``, written atomically,
  with the command line, date, commit and machine that produced it.
* :func:`spread`: median, min and max of per-repeat values (timings: medians of
  interleaved repeats). :func:`gain_interval` / :func:`format_interval`: a gain's 95%
  interval, re-exported from :mod:`rmm_jax.online.stats` (the one interval function).
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import subprocess
import sys
from pathlib import Path

import numpy as np

from rmm_jax.online.stats import format_interval, gain_interval  # noqa: F401  (re-exported)
from rmm_jax.persist.atomic import write_json

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
RESULTS = HERE / "results"
DATA_ENV = "RMM_LOCOMO_DIR"


def locomo_dir() -> Path:
    """The LoCoMo directory: ``$RMM_LOCOMO_DIR``, else ``<repo>/../shared/data/locomo``."""
    return Path(os.environ.get(DATA_ENV) or REPO.parent / "shared" / "data" / "locomo")


def add_data_option(ap: argparse.ArgumentParser) -> None:
    """``--data``: the LoCoMo file or directory (default :func:`locomo_dir`)."""
    ap.add_argument("--data", type=Path, default=locomo_dir(),
                    help=f"LoCoMo file or directory (default ${DATA_ENV}, else ../shared/data/locomo)")


def require_data(path: Path) -> Path:
    """``path`` if it holds LoCoMo; otherwise exit 0 with the reason (exit 1 under ``CI=true``)."""
    path = Path(path)
    if path.is_file() or (path.is_dir() and any(path.glob("*.json"))):
        return path
    msg = f"{path}: LoCoMo data not found (set --data or {DATA_ENV})"
    if os.environ.get("CI", "").lower() == "true":
        sys.exit(f"error: {msg}")
    print(f"skipped: {msg}", file=sys.stderr)
    sys.exit(0)


def _commit() -> str | None:
    try:
        return subprocess.run(["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"], capture_output=True,
                              text=True, check=True).stdout.strip() or None
    except (OSError, subprocess.CalledProcessError):
        return None


def provenance() -> dict:
    """Who wrote a result: command line, UTC date, commit, machine, load average."""
    return {"command": "python " + " ".join([os.path.relpath(sys.argv[0], REPO)] + sys.argv[1:]),
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "commit": _commit(), "machine": {"platform": platform.platform(), "cpus": os.cpu_count()},
            "load_average": list(os.getloadavg())}


def write_result(path, result: dict) -> None:
    """Write ``result`` (plus ``provenance``) as JSON, atomically; NumPy scalars become numbers."""
    out = json.loads(json.dumps({**result, "provenance": provenance()}, default=_plain))
    write_json(Path(path), out)
    print(f"wrote {path}", file=sys.stderr)


def _plain(x):
    if isinstance(x, np.ndarray):
        return x.tolist()
    if isinstance(x, (np.floating, np.integer, np.bool_)):
        return x.item()
    raise TypeError(f"not JSON serialisable: {type(x).__name__}")


def spread(values) -> dict:
    """``{median, min, max, values}`` of per-repeat values."""
    v = [float(x) for x in values]
    return {"median": float(np.median(v)), "min": min(v), "max": max(v), "values": v}
