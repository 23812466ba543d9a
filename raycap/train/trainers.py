"""Trainer conventions: raycap rows as the batch dict veRL, NeMo RL and OpenRLHF expect.

Each function takes rows (a pyarrow Table or RecordBatch, a dict of numpy columns) or a
`raycap.train.feed.TokenBatch`, and returns a dict of numpy arrays, or of torch tensors
with `torch=True` (imported only then). What must be exact is what each framework
expects (SPEC 8):

- Samples keep the rows' order. Rows not to train on (`mask_sample` true or null, no
  tokens, an empty token list, a missing reward when the batch carries rewards) follow
  `masked`: "drop" leaves them out, "keep" keeps them with every loss position off.
- The prompt is the tokens before the first generated span; the rest is the response.
- Widths default to the batch's longest sample; pin them (`prompt_length`,
  `response_length`, `length`) for a fixed shape. A sample wider than a fixed width
  raises ValueError naming the rollout: a sample is never truncated.
- Rewards (`rewards=None|True|False`): each framework's reward fields, grouped by task;
  a sample without a reward (only ever a masked one) carries 0.0.
- No framework is imported; each function cites the sources its convention was read from.

The conventions in full: docs/internals.md ("Trainer conventions").
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Any

import numpy as np

from raycap.train.collate import _column
from raycap.train.rewards import group_key, own_group, reward_value
from raycap.train.tokenbatch import TokenBatch, torch_tensors

MASKED_CHOICES = ("drop", "keep")
# How many rollout ids a warning quotes before it only counts the rest.
WARN_IDS = 5


@dataclass
class _Sample:
    rollout_id: str
    tokens: np.ndarray  # int64
    loss_mask: np.ndarray  # int8, 1 on trained (generated) tokens
    logprobs: np.ndarray  # float64, 0.0 off generated tokens
    prompt_length: int
    trainable: bool
    reward: float | None = None
    group: str | None = None


def _samples(source: Any, masked: str, rewards: bool | None) -> tuple[list[_Sample], bool]:
    """The samples to convert, and whether the batch carries rewards."""
    if masked not in MASKED_CHOICES:
        raise ValueError(f"masked must be one of {MASKED_CHOICES}, not {masked!r}")
    if rewards is not None and not isinstance(rewards, bool):
        raise TypeError(f"rewards must be None, True or False, not {type(rewards).__name__}")
    if isinstance(source, TokenBatch):
        samples, has_column = _from_token_batch(source), source.rewards is not None
    else:
        samples, has_column = _from_rows(source), _column(source, "reward") is not None
    if rewards and not has_column:
        raise ValueError(
            "rewards=True needs rows with a reward column (rows built from rollout records); these have none: "
            "pass rewards=None to convert them without rewards"
        )
    rewarded = has_column and (rewards or (rewards is None and any(s.reward is not None for s in samples)))
    # Fail closed: nothing to train on, or no reward to train towards, is never trained on.
    _untrain(
        samples, lambda s: not len(s.tokens),
        "an empty token list though mask_sample is false (a damaged row: rebuild it)",
    )
    if rewarded:
        _untrain(
            samples, lambda s: s.reward is None,
            "no reward though the batch carries rewards (give their records a reward, or pass rewards=False)",
        )
    if masked == "drop":
        return [s for s in samples if s.trainable], rewarded
    for s in samples:
        if not s.trainable:
            # A masked row is carried for shape only, never trained on, and in no group.
            s.loss_mask = np.zeros_like(s.loss_mask)
            s.group = own_group(s.rollout_id)
    return samples, rewarded


def _untrain(samples: list[_Sample], wrong: Any, why: str) -> None:
    """Mask the trainable samples `wrong` picks, and warn naming them."""
    hit = [s for s in samples if s.trainable and wrong(s)]
    for s in hit:
        s.trainable = False
    if hit:
        named = ", ".join(s.rollout_id for s in hit[:WARN_IDS]) + (f" and {len(hit) - WARN_IDS} more" if len(hit) > WARN_IDS else "")
        warnings.warn(f"{len(hit)} row(s) with {why} are masked, not trained on: {named}", RuntimeWarning, stacklevel=4)


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
    rewards, tasks = _column(rows, "reward"), _column(rows, "task_index")
    out = []
    for i in range(n):
        rid = str(ids[i])
        if tokens[i] is None:
            out.append(_Sample(rid, np.empty(0, np.int64), np.empty(0, np.int8), np.empty(0, np.float64), 0, False))
        else:
            t = np.asarray(tokens[i], dtype=np.int64)
            m = np.asarray(masks[i], dtype=np.int8)
            lp = np.asarray(logprobs[i], dtype=np.float64)
            if not len(t) == len(m) == len(lp):
                raise ValueError(f"rollout {rid}: token_ids, loss_mask and logprobs differ in length; the row is damaged")
            trainable = verdicts is None or (verdicts[i] is not None and not bool(verdicts[i]))
            start = None if starts is None or starts[i] is None or not len(starts[i]) else int(np.min(starts[i]))
            out.append(_Sample(rid, t, m, lp, _prompt_length(t, m, start), trainable))
        if rewards is not None:
            out[-1].reward = reward_value(rewards[i])
            out[-1].group = group_key(None if tasks is None else tasks[i], rid)
    return out


def _from_token_batch(batch: TokenBatch) -> list[_Sample]:
    out = []
    for line, ids in enumerate(batch.rollout_ids):
        for segment, rid in enumerate(ids, start=1):
            at = batch.segment_ids[line] == segment
            t = batch.token_ids[line][at].astype(np.int64)
            m = batch.loss_mask[line][at].astype(np.int8)
            sample = _Sample(rid, t, m, batch.logprobs[line][at].astype(np.float64), _prompt_length(t, m, None), True)
            if batch.rewards is not None and batch.groups is not None:
                sample.reward, sample.group = batch.rewards[line][segment - 1], batch.groups[line][segment - 1]
            out.append(sample)
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
    return torch_tensors(arrays, asked="torch=True") if torch else arrays


def _reward_column(samples: list[_Sample]) -> np.ndarray:
    """Each sample's reward as float32 (B,), 0.0 for one without (a masked sample)."""
    return np.asarray([0.0 if s.reward is None else s.reward for s in samples], dtype=np.float32)


def to_verl(
    rows: Any,
    *,
    prompt_length: int | None = None,
    response_length: int | None = None,
    pad_id: int = 0,
    masked: str = "drop",
    rewards: bool | None = None,
    torch: bool = False,
) -> dict[str, Any]:
    """veRL's rollout `DataProto` batch, as its agent loop builds it
    (`verl/experimental/agent_loop/agent_loop.py`: `AgentLoopWorker._agent_loop_postprocess`
    pads each sample, `_postprocess` stacks them; veRL's old vLLM SPMD rollout, which
    this layout came from, is gone). Tensors:

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

    When the batch carries rewards (see the module docstring):

    - `rm_scores` (B, R) float32: the sample's reward on its last response token (index
      response length - 1, before the right padding), 0.0 everywhere else, as
      `_postprocess` places a `reward_score`; `verl/trainer/ppo/reward.py`
      (`extract_reward`) takes it as the reward tensor, which `verl/trainer/ppo/ray_trainer.py`
      makes `token_level_scores`. A sample without response tokens has nowhere to hold it;
    - `uid` (B,) numpy object array of str, a non-tensor field (numpy even with
      `torch=True`, as veRL's `non_tensor_batch` holds it): the GRPO group that
      `ray_trainer.py` gives `compute_grpo_outcome_advantage` (`verl/trainer/ppo/core_algos.py`)
      as `index`. Rows of one task share it (`task:<task_index>`); a row without a task
      index, or a masked row kept for shape, has one no other row has.

    P and R default to the batch's longest prompt and response; pin them (veRL's own
    `rollout.prompt_length` and `rollout.response_length`) so calls concatenate."""
    samples, rewarded = _samples(rows, masked, rewards)
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
    scores = np.zeros((b, r), dtype=np.float32)
    for i, (s, (plen, rlen)) in enumerate(zip(samples, splits)):
        prompts[i, p - plen :] = s.tokens[:plen]
        prompt_attention[i, p - plen :] = 1
        responses[i, :rlen] = s.tokens[plen:]
        response_attention[i, :rlen] = 1
        response_mask[i, :rlen] = s.loss_mask[plen:]
        log_probs[i, :rlen] = s.logprobs[plen:]
        if rlen and s.reward is not None:
            scores[i, rlen - 1] = s.reward
    attention = np.concatenate([prompt_attention, response_attention], axis=1)
    positions = np.clip(np.cumsum(attention, axis=1) - 1, 0, None).astype(np.int64)
    arrays = {
        "prompts": prompts,
        "responses": responses,
        "input_ids": np.concatenate([prompts, responses], axis=1),
        "attention_mask": attention,
        "position_ids": positions,
        "response_mask": response_mask,
        "rollout_log_probs": log_probs,
    }
    if rewarded:
        uid = np.empty(b, dtype=object)
        uid[:] = [s.group or own_group(s.rollout_id) for s in samples]
        arrays.update(rm_scores=scores, uid=uid)
    return _finish(arrays, torch)


def to_nemo_rl(
    rows: Any,
    *,
    length: int | None = None,
    pad_id: int = 0,
    masked: str = "keep",
    rewards: bool | None = None,
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
      do not; the opposite polarity of raycap's `mask_sample`;
    - `total_reward` (B,) float32, when the batch carries rewards: each sample's reward,
      as `run_multi_turn_rollout` of `nemo_rl/experience/rollouts.py` accumulates it and
      the GRPO step reads `repeated_batch["total_reward"]`. NeMo RL groups by prompt
      (`calculate_baseline_and_std_per_prompt`, `nemo_rl/algorithms/utils.py`), not by an
      id, and its GRPO step counts every sample of the batch in the baseline: a masked
      sample kept for shape (reward 0.0 when it has none) counts too, so pass
      `masked="drop"` to keep untrained samples out of their prompt's baseline.

    L defaults to the batch's longest sample; pin `length` so calls concatenate."""
    samples, rewarded = _samples(rows, masked, rewards)
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
    arrays = {
        "input_ids": input_ids,
        "input_lengths": np.asarray(lengths, dtype=np.int32),
        "token_mask": token_mask,
        "generation_logprobs": logprobs,
        "sample_mask": np.asarray([1.0 if s.trainable else 0.0 for s in samples], dtype=np.float32),
    }
    if rewarded:
        arrays["total_reward"] = _reward_column(samples)
    return _finish(arrays, torch)


def to_openrlhf(
    rows: Any,
    *,
    length: int | None = None,
    pad_id: int = 0,
    masked: str = "drop",
    rewards: bool | None = None,
    torch: bool = False,
) -> dict[str, Any]:
    """The tensors of OpenRLHF's `Experience` (`openrlhf/trainer/ppo_utils/experience.py`),
    as `openrlhf/trainer/ppo_utils/samples_generator.py` (`_process_response_into_experience`)
    fills them and `make_experience_batch` right-pads them:

    - `sequences` (B, T) int64: the tokens, RIGHT-padded with `pad_id`;
    - `attention_mask` (B, T) int64: 1 on real tokens, 0 on padding;
    - `action_mask` (B, T - 1) int64, 0 or 1, as the producer makes it (a zeros-like of
      the attention mask with the action spans set to 1; the `Experience` field's
      annotation says BoolTensor, the producer's tensor is long): SHIFTED by one,
      `action_mask[:, t]` says whether token t + 1 is an action (a generated token):
      the logits at t predict it;
    - `rollout_log_probs` (B, T - 1) float32: shifted the same way, the captured log prob
      of token t + 1, 0.0 off actions and on padding;
    - `rewards` (B,) float32, when the batch carries rewards: each sample's reward, the
      episode field the producer fills from the response's reward. OpenRLHF groups a
      prompt's samples by position, `n_samples_per_prompt` consecutive samples each
      (`openrlhf/trainer/ppo_utils/experience_maker.py`): give it the rows of one task
      together, and with `masked="keep"` a kept masked sample (reward 0.0 when it has
      none) counts in its neighbours' group.

    T defaults to the batch's longest sample; pin `length` so calls concatenate."""
    samples, rewarded = _samples(rows, masked, rewards)
    lengths = [len(s.tokens) for s in samples]
    width = _width(samples, lengths, length, "sequence")
    b = len(samples)
    sequences = np.full((b, width), pad_id, dtype=np.int64)
    attention = np.zeros((b, width), dtype=np.int64)
    action_mask = np.zeros((b, max(width - 1, 0)), dtype=np.int64)
    log_probs = np.zeros((b, max(width - 1, 0)), dtype=np.float32)
    for i, s in enumerate(samples):
        n = len(s.tokens)
        sequences[i, :n] = s.tokens
        attention[i, :n] = 1
        if n > 1:
            action_mask[i, : n - 1] = s.loss_mask[1:] == 1
            log_probs[i, : n - 1] = np.where(s.loss_mask[1:] == 1, s.logprobs[1:], 0.0)
    arrays = {"sequences": sequences, "attention_mask": attention, "action_mask": action_mask, "rollout_log_probs": log_probs}
    if rewarded:
        arrays["rewards"] = _reward_column(samples)
    return _finish(arrays, torch)
