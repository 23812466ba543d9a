"""The builds' silencing of per-rollout detail warnings (raycap.rows.batch): builds on several
threads at once leave the loggers as they found them."""

from __future__ import annotations

import logging
import threading

from raycap.rows import batch


def test_overlapping_builds_on_two_threads_restore_the_detail_loggers():
    # A starts, B starts, A ends, B ends: B must not restore the level A had raised.
    before = {name: logging.getLogger(name).level for name in batch._DETAIL_LOGGERS}
    a_in, b_in, a_out = threading.Event(), threading.Event(), threading.Event()

    def build_a():
        with batch._mask_logging(False):
            a_in.set()
            b_in.wait(5)
        a_out.set()

    def build_b():
        a_in.wait(5)
        with batch._mask_logging(False):
            b_in.set()
            a_out.wait(5)

    threads = [threading.Thread(target=build_a), threading.Thread(target=build_b)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert {name: logging.getLogger(name).level for name in batch._DETAIL_LOGGERS} == before
    assert logging.getLogger("raycap.capture.consumer").isEnabledFor(logging.WARNING)
