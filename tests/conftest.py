"""Shared test helpers. Keep this small; append helpers below."""
from __future__ import annotations

import os
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def locomo_dir() -> Path:
    """The LoCoMo data directory: $RMM_LOCOMO_DIR, default <repo>/../shared/data/locomo.

    Skips the calling test when the data is absent, except on CI (CI=true) where a
    missing dataset is a failure rather than a silent skip.
    """
    path = Path(os.environ.get("RMM_LOCOMO_DIR") or REPO.parent / "shared" / "data" / "locomo")
    if path.is_dir() and any(path.glob("*.json")):
        return path
    msg = f"LoCoMo data not found at {path}: set RMM_LOCOMO_DIR"
    if os.environ.get("CI") == "true":
        pytest.fail(msg)
    pytest.skip(msg)
