"""A training step's cut: shared with builder tasks or built alone, as the steps before
were faster; a shared step cut so that both sides end together.

What a trainer relies on: a step is not slowed for long by tasks that cannot keep up
(on a machine whose cores are busy, Ray's niced workers crawl), and it goes back to
sharing once they can; a shared step's cut follows the tasks' measured pace, within
bounds.
"""

from __future__ import annotations

from raycap.cluster.rebuild.step_split import MIN_TASK_IDS, PROBE_EVERY, StepSplit


def test_a_step_is_shared_or_built_alone_as_the_steps_before_were_faster():
    split = StepSplit()
    ways = []
    for shared_s, alone_s in [(0.060, 0.040)] * 12:  # on busy cores: alone is faster
        share = split.task_ids(64, 1)
        ways.append(share > 0)
        split.stepped(64, shared_s if share else alone_s)
    # Each way is timed first, then the faster one is taken, and the other every
    # PROBE_EVERY-th step, to see a change.
    assert ways == [step == 1 or step % PROBE_EVERY == 0 for step in range(1, 13)], ways
    for _ in range(12):  # the cores free again: shared is faster
        share = split.task_ids(64, 1)
        split.stepped(64, 0.025 if share else 0.035)
    assert [split.task_ids(64, 1) > 0 for _ in range(PROBE_EVERY - 1)].count(True) >= PROBE_EVERY - 2
    # A step too small to be worth a task is built alone and not timed as a way.
    assert StepSplit().task_ids(2 * MIN_TASK_IDS - 1, 1) == 0


def test_a_shared_steps_cut_follows_how_its_tasks_kept_up():
    split = StepSplit()
    split.pace = {True: 0.0, False: 1.0}  # sharing is the faster way

    def share(n: int = 64, tasks: int = 1) -> int:
        """The next shared step's share (a step built alone, to time that way, skipped)."""
        return next(got for got in (split.task_ids(n, tasks) for _ in range(PROBE_EVERY)) if got)

    # Before any measure: this process takes two tasks' shares (HERE_SHARES).
    assert share() == 64 // 3
    # A task whose batch this process took over (it had not started) gets less, down to
    # MIN_TASK_IDS.
    shares = []
    for _ in range(8):
        split.measured(48, 0.030, 16, None)
        shares.append(share())
    assert shares == sorted(shares, reverse=True) and shares[-1] == MIN_TASK_IDS, shares
    # A task that keeps pace gets more again, at most an even share.
    for _ in range(8):
        split.measured(32, 0.020, 32, 0.020)
    assert share() == 32 and share(64, 3) == 16
    # A task that ended when this process did keeps its share.
    for _ in range(8):
        here = 64 - share()
        split.measured(here, 0.030, 64 - here, 0.030)
    assert share() == 64 - here
