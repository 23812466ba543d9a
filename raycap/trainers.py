"""Trainer conventions: raycap rows as the batch dict veRL, NeMo RL and OpenRLHF expect.

Every framework pads on its own side and names its fields its own way; what must be exact
is what each expects (SPEC §8). Each function here takes rows (a pyarrow Table or
RecordBatch, or a dict of columns as `Dataset.iter_batches(batch_format="numpy")` gives)
or a `raycap.feed.TokenBatch` (each packed segment becomes one sample), and returns a
dict of numpy arrays, or of torch tensors with `torch=True` (torch is not a dependency:
it is imported only when asked for, and its absence is one clear error).

- Samples keep the order of the rows. Rows that must not be trained on (`mask_sample`
  true or null, fail closed; or no tokens) follow `masked`: "drop" leaves them out,
  "keep" keeps them with every loss position off (and, for NeMo RL, `sample_mask` 0).
  NeMo RL has a per-sample flag, so it keeps them by default; the others drop them.
- The prompt is the row's tokens before its first generated span (the smallest
  `call_gen_start`; without that column, the first loss-mask position). Everything from
  there on is the response: generated spans and the tool or user tokens between them.
- Widths default to the longest sample of the batch. A fixed width smaller than a sample
  raises ValueError naming the rollout: a sample is never truncated.
- No framework is imported; the conventions were read from the framework sources cited
  in each function.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from typing import Any

import numpy as np

from raycap.feed import TokenBatch, _column

MASKED_CHOICES = ("drop", "keep")


@dataclass
class _Sample:
    rollout_id: str
    tokens: np.ndarray  # int64
    loss_mask: np.ndarray  # int8, 1 on trained (generated) tokens
    logprobs: np.ndarray  # float64, 0.0 off generated tokens
    prompt_length: int
    trainable: bool


def _samples(source: Any, masked: str) -> list[_Sample]:
    if masked not in MASKED_CHOICES:
        raise ValueError(f"masked must be one of {MASKED_CHOICES}, not {masked!r}")
    samples = _from_token_batch(source) if isinstance(source, TokenBatch) else _from_rows(source)
    if masked == "drop":
        return [s for s in samples if s.trainable]
    for s in samples:
        if not s.trainable:
            # Fail closed: a masked row is carried for shape only, never trained on.
            s.loss_mask = np.zeros_like(s.loss_mask)
    return samples


def _from_rows(rows: Any) -> list[_Sample]:
    tokens = _column(rows, "token_ids")
    if tokens is None:
        raise ValueError("rows for a trainer need the columns token_ids, loss_mask and logprobs; missing: token_ids")
    n = len(tokens)
    ids = _column(rows, "rollout_id") or [f"row {i}" for i in range(n)]
    verdicts = _column(rows, "mask_sample")
    masks, logprobs = _column(rows, "loss_mask"), _column(rows, "logprobs")
    if masks is None or logprobs is None:
        missing = [name for name, col in (("loss_mask", masks), ("logprobs", logprobs)) if col is None]
        raise ValueError(f"rows for a trainer need the columns token_ids, loss_mask and logprobs; missing: {', '.join(missing)}")
    starts = _column(rows, "call_gen_start")
    out = []
    for i in range(n):
        rid = str(ids[i])
        if tokens[i] is None:
            out.append(_Sample(rid, np.empty(0, np.int64), np.empty(0, np.int8), np.empty(0, np.float64), 0, False))
            continue
        t = np.asarray(tokens[i], dtype=np.int64)
        m = np.asarray(masks[i], dtype=np.int8)
        lp = np.asarray(logprobs[i], dtype=np.float64)
        if not len(t) == len(m) == len(lp):
            raise ValueError(f"rollout {rid}: token_ids, loss_mask and logprobs differ in length; the row is damaged")
        trainable = verdicts is None or (verdicts[i] is not None and not bool(verdicts[i]))
        start = None if starts is None or starts[i] is None or not len(starts[i]) else int(np.min(starts[i]))
        out.append(_Sample(rid, t, m, lp, _prompt_length(t, m, start), trainable))
    return out


def _from_token_batch(batch: TokenBatch) -> list[_Sample]:
    out = []
    for line, ids in enumerate(batch.rollout_ids):
        for segment, rid in enumerate(ids, start=1):
            at = batch.segment_ids[line] == segment
            t = batch.token_ids[line][at].astype(np.int64)
            m = batch.loss_mask[line][at].astype(np.int8)
            out.append(_Sample(rid, t, m, batch.logprobs[line][at].astype(np.float64), _prompt_length(t, m, None), True))
    return out


def _prompt_length(tokens: np.ndarray, loss_mask: np.ndarray, gen_start: int | None) -> int:
    if gen_start is not None:
        return min(max(gen_start, 0), len(tokens))
    generated = np.flatnonzero(loss_mask)
    return int(generated[0]) if len(generated) else len(tokens)


def _width(samples: list[_Sample], lengths: list[int], fixed: int | None, what: str) -> int:
    longest = max(lengths, default=0)
    if fixed is None:
        return longest
    if longest > fixed:
        i = int(np.argmax(lengths))
        raise ValueError(
            f"rollout {samples[i].rollout_id} has a {what} of {longest} tokens, more than {fixed}; "
            f"raise the {what} width (samples are never truncated)"
        )
    return fixed


def _finish(arrays: dict[str, np.ndarray], torch: bool) -> dict[str, Any]:
    if not torch:
        return arrays
    if importlib.util.find_spec("torch") is None:
        raise ImportError("torch=True needs torch, which raycap does not install; pip install torch, or take numpy arrays")
    import torch as _torch

    return {name: _torch.from_numpy(np.ascontiguousarray(array)) for name, array in arrays.items()}


def to_verl(
    rows: Any,
    *,
    prompt_length: int | None = None,
    response_length: int | None = None,
    pad_id: int = 0,
    masked: str = "drop",
    torch: bool = False,
) -> dict[str, Any]:
    """The tensors of veRL's rollout `DataProto` batch, as its agent loop builds them
    (`verl/experimental/agent_loop/agent_loop.py`, `AgentLoopWorkerBase._run_agent_loop`
    and `_postprocess`; the same layout as `verl/workers/rollout/vllm_rollout/vllm_rollout_spmd.py`):

    - `prompts` (B, P) int64: the prompt, LEFT-padded with `pad_id`;
    - `responses` (B, R) int64: the response, RIGHT-padded with `pad_id`;
    - `input_ids` (B, P + R) int64: prompts and responses concatenated;
    - `attention_mask` (B, P + R) int64: 1 on real tokens, 0 on padding;
    - `position_ids` (B, P + R) int64: 0, 1, ... over real tokens (veRL's
      `compute_position_id_with_mask` of `verl/utils/model.py`: the running count of the
      attention mask, minus one, floored at 0; so left padding is 0 and right padding
      repeats the last position);
    - `response_mask` (B, R) int64: 1 on generated tokens, 0 on tool/observation tokens
      and on padding;
    - `rollout_log_probs` (B, R) float32: the captured log probs aligned with `responses`,
      0.0 elsewhere.

    P and R default to the batch's longest prompt and response."""
    samples = _samples(rows, masked)
    splits = [(s.prompt_length, len(s.tokens) - s.prompt_length) for s in samples]
    p = _width(samples, [a for a, _ in splits], prompt_length, "prompt")
    r = _width(samples, [b for _, b in splits], response_length, "response")
    b = len(samples)
    prompts = np.full((b, p), pad_id, dtype=np.int64)
    responses = np.full((b, r), pad_id, dtype=np.int64)
    prompt_attention = np.zeros((b, p), dtype=np.int64)
    response_attention = np.zeros((b, r), dtype=np.int64)
    response_mask = np.zeros((b, r), dtype=np.int64)
    log_probs = np.zeros((b, r), dtype=np.float32)
    for i, (s, (plen, rlen)) in enumerate(zip(samples, splits)):
        prompts[i, p - plen :] = s.tokens[:plen]
        prompt_attention[i, p - plen :] = 1
        responses[i, :rlen] = s.tokens[plen:]
        response_attention[i, :rlen] = 1
        response_mask[i, :rlen] = s.loss_mask[plen:]
        log_probs[i, :rlen] = s.logprobs[plen:]
    attention = np.concatenate([prompt_attention, response_attention], axis=1)
    positions = np.clip(np.cumsum(attention, axis=1) - 1, 0, None).astype(np.int64)
    return _finish(
        {
            "prompts": prompts,
            "responses": responses,
            "input_ids": np.concatenate([prompts, responses], axis=1),
            "attention_mask": attention,
            "position_ids": positions,
            "response_mask": response_mask,
            "rollout_log_probs": log_probs,
        },
        torch,
    )


def to_nemo_rl(
    rows: Any,
    *,
    length: int | None = None,
    pad_id: int = 0,
    masked: str = "keep",
    torch: bool = False,
) -> dict[str, Any]:
    """The train data of NeMo RL's GRPO step (`nemo_rl/algorithms/grpo.py`, the
    `BatchedDataDict` built from `batched_message_log_to_flat_message` of
    `nemo_rl/data/llm_message_utils.py`):

    - `input_ids` (B, L) int64: the tokens, RIGHT-padded with `pad_id`;
    - `input_lengths` (B,) int32: each sample's unpadded length;
    - `token_mask` (B, L) int64: 1 on generated (trained) tokens (its `token_loss_mask`);
    - `generation_logprobs` (B, L) float32: the captured log probs, 0.0 elsewhere. Not
      shifted: NeMo RL's loss drops the first position itself (`[:, 1:]`);
    - `sample_mask` (B,) float32: the per-sample `loss_multiplier`, 1.0 = TRAIN, 0.0 =
      do not; the opposite polarity of raycap's `mask_sample`.

    L defaults to the batch's longest sample."""
    samples = _samples(rows, masked)
    lengths = [len(s.tokens) for s in samples]
    width = _width(samples, lengths, length, "sequence")
    b = len(samples)
    input_ids = np.full((b, width), pad_id, dtype=np.int64)
    token_mask = np.zeros((b, width), dtype=np.int64)
    logprobs = np.zeros((b, width), dtype=np.float32)
    for i, s in enumerate(samples):
        input_ids[i, : len(s.tokens)] = s.tokens
        token_mask[i, : len(s.tokens)] = s.loss_mask
        logprobs[i, : len(s.tokens)] = s.logprobs
    return _finish(
        {
            "input_ids": input_ids,
            "input_lengths": np.asarray(lengths, dtype=np.int32),
            "token_mask": token_mask,
            "generation_logprobs": logprobs,
            "sample_mask": np.asarray([1.0 if s.trainable else 0.0 for s in samples], dtype=np.float32),
        },
        torch,
    )


def to_openrlhf(
    rows: Any,
    *,
    length: int | None = None,
    pad_id: int = 0,
    masked: str = "drop",
    torch: bool = False,
) -> dict[str, Any]:
    """The step tensors of OpenRLHF's `Experience` (`openrlhf/trainer/ppo_utils/experience.py`),
    as `openrlhf/trainer/ppo_utils/samples_generator.py` (`_process_response_into_experience`)
    fills them and `make_experience_batch` right-pads them:

    - `sequences` (B, T) int64: the tokens, RIGHT-padded with `pad_id`;
    - `attention_mask` (B, T) int64: 1 on real tokens, 0 on padding;
    - `action_mask` (B, T - 1) bool: SHIFTED by one, `action_mask[:, t]` says whether
      token t + 1 is an action (a generated token): the logits at t predict it;
    - `rollout_log_probs` (B, T - 1) float32: shifted the same way, the captured log prob
      of token t + 1, 0.0 off actions and on padding.

    T defaults to the batch's longest sample."""
    samples = _samples(rows, masked)
    lengths = [len(s.tokens) for s in samples]
    width = _width(samples, lengths, length, "sequence")
    b = len(samples)
    sequences = np.full((b, width), pad_id, dtype=np.int64)
    attention = np.zeros((b, width), dtype=np.int64)
    action_mask = np.zeros((b, max(width - 1, 0)), dtype=bool)
    log_probs = np.zeros((b, max(width - 1, 0)), dtype=np.float32)
    for i, s in enumerate(samples):
        n = len(s.tokens)
        sequences[i, :n] = s.tokens
        attention[i, :n] = 1
        if n > 1:
            action_mask[i, : n - 1] = s.loss_mask[1:] == 1
            log_probs[i, : n - 1] = np.where(s.loss_mask[1:] == 1, s.logprobs[1:], 0.0)
    return _finish(
        {"sequences": sequences, "attention_mask": attention, "action_mask": action_mask, "rollout_log_probs": log_probs},
        torch,
    )
