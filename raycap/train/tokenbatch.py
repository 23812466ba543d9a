"""The fixed-shape token arrays a trainer takes: `TokenBatch`.

Every array has shape (lines, seq_len); padding carries attention 0 and loss weight 0.
Only numpy is used; torch is imported only by `tensors()`.

- `token_ids` int64, `loss_mask` int8 (1 on generated tokens), `logprobs` float64 (the
  captured ones, 0.0 elsewhere), `attention_mask` int8;
- `segment_ids` int32 (which packed row a token belongs to, 0 on padding: packed rows
  must not attend to each other) and `position_ids` int64 (restarting per packed row);
- `loss_weights` float32: `loss_mask` times the row's `weight`;
- `versions` int64 (only for rows built with a `version_key`): the policy version that
  generated each token, `NO_VERSION` (-1) elsewhere.

`rollout_ids` lists each line's packed rollouts; with a `reward` column, `rewards` and
`groups` give each packed row's reward (None when it has none: a trainer must not train
on it) and its GRPO group (`"task:<task_index>"`, or a key of its own). Token counts for
normalising a loss: `total_tokens`, `trained_tokens`, and the whole step's
`step_total_tokens`, `step_trained_tokens`. `arrays(torch_dtypes=True)` and `tensors()`
give the dtypes a torch trainer feeds.

The arrays' meaning in full: docs/internals.md ("The token batch").
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass, field
from typing import Any

import numpy as np

# The dtypes a torch trainer takes where they differ from the arrays' own: float32 log
# probs (the model's dtype), bool masks (scaled_dot_product_attention refuses int8 masks).
TORCH_DTYPES = {"logprobs": np.float32, "loss_mask": np.bool_, "attention_mask": np.bool_}
# The version of a token no versioned call generated (prompt, tool output, padding, a
# call or row without a version). Versions are policy steps, so never negative.
NO_VERSION = -1


@dataclass
class TokenBatch:
    """Fixed-width token arrays for a trainer (see the module docstring for each)."""

    token_ids: np.ndarray
    loss_mask: np.ndarray
    logprobs: np.ndarray
    attention_mask: np.ndarray
    segment_ids: np.ndarray
    position_ids: np.ndarray
    loss_weights: np.ndarray
    rollout_ids: list[list[str]] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)  # too_long="skip": rollouts left out
    # Empty lines that only fill the fixed shape (the last batch of a stream, or a
    # data-parallel rank evened out with the others): attention and loss weight 0.
    padding_lines: int = 0
    # Per-token policy versions, when the rows carry version columns (else None).
    versions: np.ndarray | None = None
    # Per line, aligned with rollout_ids, when the rows carry a reward column (else None):
    # each packed row's reward (None: it has none) and its GRPO group key.
    rewards: list[list[float | None]] | None = None
    groups: list[list[str]] | None = None
    # Rollouts left out because their token list is empty though mask_sample is false.
    empty_rows: list[str] = field(default_factory=list)
    # The tokens of the whole step this batch belongs to (every rank's, for a
    # DataParallelFeed; this batch's own otherwise): a loss normaliser no rank must
    # all-reduce. Set by whatever made the batch.
    step_total_tokens: int | None = None
    step_trained_tokens: int | None = None

    ARRAYS = (
        "token_ids", "loss_mask", "logprobs", "attention_mask", "segment_ids", "position_ids", "loss_weights",
    )

    @property
    def shape(self) -> tuple[int, int]:
        return self.token_ids.shape

    @property
    def total_tokens(self) -> int:
        """The real (attended) tokens of this batch; 0 for a batch of padding lines."""
        return int(np.count_nonzero(self.attention_mask))

    @property
    def trained_tokens(self) -> int:
        """The tokens of this batch with loss mask 1; 0 for a batch of padding lines."""
        return int(np.count_nonzero(self.loss_mask))

    def arrays(self, *, torch_dtypes: bool = False) -> dict[str, np.ndarray]:
        """The arrays by name, as a trainer's batch dict (with `versions` when present).
        `torch_dtypes=True` casts them to what a torch trainer takes (`TORCH_DTYPES`:
        float32 log probs, bool loss and attention masks); the default keeps the dtypes
        of the module docstring."""
        out = {name: getattr(self, name) for name in self.ARRAYS}
        if self.versions is not None:
            out["versions"] = self.versions
        if torch_dtypes:
            out = {name: array.astype(TORCH_DTYPES.get(name, array.dtype), copy=False) for name, array in out.items()}
        return out

    def tensors(self) -> dict[str, Any]:
        """`arrays(torch_dtypes=True)` as CPU torch tensors (ImportError without torch)."""
        return torch_tensors(self.arrays(torch_dtypes=True), asked="TokenBatch.tensors()")


def torch_tensors(arrays: dict[str, np.ndarray], *, asked: str) -> dict[str, Any]:
    """numpy arrays as torch tensors sharing their memory; arrays of Python objects (a
    group id's strings) stay numpy, as non-tensor batch fields do. `asked` names the call
    in the error when torch is missing."""
    if importlib.util.find_spec("torch") is None:
        raise ImportError(f"{asked} needs torch, which raycap does not install; pip install torch, or take numpy arrays")
    import torch

    return {
        name: array if array.dtype == object else torch.from_numpy(np.ascontiguousarray(array))
        for name, array in arrays.items()
    }


