"""Claims: of the processes given one batch, exactly one builds it.

What the scheduler relies on: a claim is taken once, by one process, however many race
for it; once dropped nobody takes it; and the tokens do not outlive the process that
made them.
"""

from __future__ import annotations

import multiprocessing
import os
import subprocess
import sys

from raycap.rows.claims import Claim, new_claim


def _race(token: str, start, out) -> None:
    start.wait()
    out.put(Claim(token).take())


def test_a_claim_is_taken_by_exactly_one_of_the_processes_racing_for_it():
    context = multiprocessing.get_context("spawn")
    for _ in range(3):
        claim = new_claim()
        assert claim is not None
        start, out = context.Event(), context.Queue()
        racers = [context.Process(target=_race, args=(claim.token, start, out)) for _ in range(6)]
        for racer in racers:
            racer.start()
        start.set()
        taken = [out.get(timeout=60) for _ in racers]
        for racer in racers:
            racer.join(timeout=60)
        assert taken.count(True) == 1, taken
        assert not claim.take()


def test_a_dropped_claim_cannot_be_taken_and_another_claim_is_its_own():
    first, second = new_claim(), new_claim()
    first.drop()
    assert not first.take()
    assert second.take() and not second.take()
    second.drop()  # taken already: nothing to do


def test_a_claim_not_visible_here_is_not_taken(tmp_path):
    assert not Claim(str(tmp_path / "on-another-node")).take()


def test_the_tokens_are_in_memory_and_gone_when_their_process_exits():
    script = "from raycap.rows.claims import new_claim; import os; print(os.path.dirname(new_claim().token))"
    made = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True).stdout.strip()
    if os.path.isdir("/dev/shm"):
        assert made.startswith("/dev/shm/"), made
    assert not os.path.exists(made), "the tokens' directory outlived its process"
