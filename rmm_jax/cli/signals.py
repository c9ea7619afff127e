"""Stop cleanly on SIGINT/SIGTERM: finish the compiled call, checkpoint, then exit."""
from __future__ import annotations

import os
import signal
import sys
import threading

MESSAGE = "interrupted; resume with --resume"


class Interrupted(Exception):
    """Raised after SIGINT/SIGTERM once the progress is checkpointed."""

    def __init__(self, signum: int):
        self.signum = signum
        self.exit_code = 128 + signum
        super().__init__(MESSAGE)


class StopSignals:
    """Within ``with``: SIGINT/SIGTERM only set a flag, checked by :meth:`check` between
    compiled calls (after the checkpoint); a second signal exits at once (the last
    checkpoint stays valid). Outside the main thread this does nothing."""

    def __init__(self):
        self.signum: int | None = None
        self._old: dict = {}

    def __enter__(self):
        if threading.current_thread() is threading.main_thread():
            for s in (signal.SIGINT, signal.SIGTERM):
                self._old[s] = signal.signal(s, self._handle)
        return self

    def _handle(self, signum, frame):
        if self.signum is not None:
            sys.stderr.write(MESSAGE + "\n")
            sys.stderr.flush()
            os._exit(128 + signum)
        self.signum = signum

    def check(self) -> None:
        if self.signum is not None:
            raise Interrupted(self.signum)

    def __exit__(self, *exc):
        for s, h in self._old.items():
            signal.signal(s, h)
        self._old = {}
        return False
