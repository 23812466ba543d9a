"""A bound on a test that could hang: a regression that blocks (on a FIFO, say) fails
the test instead of hanging the suite."""

from __future__ import annotations

import signal
from contextlib import contextmanager


class StillBlocked(BaseException):
    """Raised by the alarm: a BaseException, so no `except OSError` on the way (which
    would catch a TimeoutError) can swallow it and let a hang pass for a refusal."""


@contextmanager
def no_hang(seconds: int = 20):
    """Fail the test instead of hanging it (a blocking open is interrupted by the alarm)."""

    def fail(signum, frame):
        raise StillBlocked(f"still blocked after {seconds} s")

    previous = signal.signal(signal.SIGALRM, fail)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)
