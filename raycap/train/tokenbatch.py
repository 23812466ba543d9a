"""The fixed-shape token arrays a trainer takes: `TokenBatch`.

Every array has shape (lines, seq_len); padding lines and padding tokens carry attention 0
and loss weight 0. Only numpy is used; torch is imported only by `tensors()`.

The arrays of a `TokenBatch`:

- `token_ids` int64: the rows' tokens, `pad_id` after them;
- `loss_mask` int8: 1 on generated (trained) tokens, 0 on prompt, tool and padding;
- `logprobs` float64: the captured log probs on generated tokens, 0.0 elsewhere;
- `attention_mask` int8: 1 on real tokens, 0 on padding;
- `segment_ids` int32: which row of the line a token belongs to, 1, 2, ... in packing
  order, 0 on padding. Packed rows must not attend to each other: build block-diagonal
  attention from it (or varlen attention from its run lengths);
- `position_ids` int64: the position within the token's own row (restarts at 0 for each
  packed row), 0 on padding;
- `loss_weights` float32: `loss_mask` times the row's `weight` (chain delivery gives each
  chain 1 / the rollout's unmasked chains; 1.0 when the rows have no `weight`);
- `versions` int64, only when the rows carry version columns (built with a
  `version_key`, as `raycap.Stream` rows are; see `raycap.rows.arrow`), else None: the policy
  version that generated each token, from each call's generated span
  (`call_gen_start`..`call_gen_end`) and its `call_versions` entry. `NO_VERSION` (-1)
  everywhere else: prompt, tool and padding tokens, a call without a version, and every
  token of a row without versions. A trainer bounding staleness per token (or weighting
  by it) reads this; `versions >= 0` is a subset of `loss_mask == 1`.

`TokenBatch.rollout_ids` lists, per line, the rollout ids packed into it, in segment
order; `TokenBatch.padding_lines` counts its empty lines (attention and loss weight 0).

Rows built from rollout records carry the record columns (SPEC §10.7). When the rows
have a `reward` column, `TokenBatch.rewards` and `TokenBatch.groups` give, per line and
aligned with `rollout_ids`, each packed row's reward (a float; None when the row has
none, or a value that is not a finite number) and its GRPO group: `"task:<task_index>"`,
shared by the rollouts of one task, or, for a row without a task index, a key of its own
that no other row has (`"rollout:<id>:<random hex>"`, drawn anew for each batch). Without a
`reward` column both are None. The feed does not judge rewards: a trainer that uses them
must not train on a row whose reward is None (`raycap.train.trainers` masks it).

Token counts, for normalising a loss: `TokenBatch.total_tokens` (attention 1) and
`TokenBatch.trained_tokens` (loss mask 1) count this batch; `step_total_tokens` and
`step_trained_tokens` count the whole step, which for `collate` and `token_batches` is
this batch, and for `DataParallelFeed` is every rank's batch of that step, from the plan.

For torch: the arrays' default dtypes are numpy's; `TokenBatch.arrays(torch_dtypes=True)`
gives the dtypes a torch trainer feeds its model and loss (`logprobs` float32,
`loss_mask` and `attention_mask` bool, which `scaled_dot_product_attention` and boolean
indexing take; the rest as above), and `TokenBatch.tensors()` gives those as CPU torch
tensors (torch is not a dependency: it is imported only there).
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


