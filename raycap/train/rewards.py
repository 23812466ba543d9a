"""The record columns as a trainer reads them: each row's reward and its GRPO group.

Rows built from rollout records carry `reward` (float64, null when the record has none)
and `task_index` (int64, null when absent), among the record columns of SPEC §10.7. A
trainer's group is the task: the rollouts of one task form one GRPO group, and a row
without a task index is a group of its own.

- `reward_value` reads a reward and never guesses: null, NaN, infinity, a bool or a
  string is no reward (None), which the trainer conventions treat as "do not train".
- `group_key` names a row's group: `task:<index>` for the rollouts of a task, or a key of
  its own (`own_group`: random, so no other row, batch, output or run shares it). A
  task index that is not a whole number is a damaged row: ValueError naming the rollout.

Numpy batches (`Dataset.iter_batches(batch_format="numpy")`) may hold a null as NaN and
an integer as a float: a NaN task index is read as null, a whole float as its int.
"""

from __future__ import annotations

import math
import numbers
import uuid
from typing import Any

import numpy as np
import pyarrow as pa

from raycap.capture.untrusted import bounded_repr

# The record columns a batch reports per row, when the rows have them.
RECORD_FEED_COLUMNS = ("reward", "task_index")


def has_record_columns(batch: Any) -> bool:
    """Whether a row batch (or a list of column names) carries rewards to report."""
    names = batch.schema.names if isinstance(batch, (pa.Table, pa.RecordBatch)) else batch
    return "reward" in names


def reward_value(value: Any) -> float | None:
    """A row's reward as a float, or None when it has none: null, NaN or infinite, or
    not a number at all (a bool or a string is not a reward). Never a guess."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Real):
        return None
    number = float(value)
    return number if math.isfinite(number) else None


def group_key(task_index: Any, rollout_id: str) -> str:
    """A row's GRPO group (SPEC §10.7): the rollouts of one task share `task:<index>`; a
    row without a task index (null, or NaN as numpy batches hold a null) gets a key no
    other row has. A task index that is not a whole number is a damaged row."""
    if task_index is None:
        return own_group(rollout_id)
    if isinstance(task_index, numbers.Integral) and not isinstance(task_index, (bool, np.bool_)):
        return f"task:{int(task_index)}"
    if isinstance(task_index, numbers.Real) and not isinstance(task_index, np.bool_):
        number = float(task_index)
        if math.isnan(number):
            return own_group(rollout_id)
        if math.isfinite(number) and number == int(number):
            return f"task:{int(number)}"
    raise ValueError(f"rollout {rollout_id}: task_index {bounded_repr(task_index)} is not a whole number; the row is damaged")


def own_group(rollout_id: str) -> str:
    """A group key that no other row has (random, so rows of other batches, outputs or
    runs never share it, and `task:` keys never collide with it)."""
    return f"rollout:{rollout_id}:{uuid.uuid4().hex}"
