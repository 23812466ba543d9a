"""Tests for raycap.trainers: each framework's batch convention, checked on hand-built rows
whose expected arrays are written out in full."""

from __future__ import annotations

import importlib.util

import numpy as np
import pyarrow as pa
import pytest

from raycap.feed import collate
from raycap.trainers import to_nemo_rl, to_openrlhf, to_verl

PAD = 99


def _rows() -> pa.Table:
    """a: prompt of 3, two generated spans around a tool token. b: its first generated
    token is not trained (loss mask 0), so only call_gen_start marks the prompt's end.
    c: masked. d: a failed build without tokens."""
    return pa.table(
        {
            "rollout_id": ["a", "b", "c", "d"],
            "mask_sample": [False, False, True, True],
            "token_ids": [[11, 12, 13, 21, 22, 31, 23], [41, 51, 52], [61, 62], None],
            "loss_mask": pa.array([[0, 0, 0, 1, 1, 0, 1], [0, 0, 1], [0, 1], None], type=pa.list_(pa.int8())),
            "logprobs": [[0.0, 0.0, 0.0, -0.5, -0.25, 0.0, -1.0], [0.0, -0.125, -0.75], [0.0, -2.0], None],
            "call_gen_start": [[3, 6], [1], [1], None],
        }
    )


def _check(batch: dict, expected: dict) -> None:
    assert list(batch) == list(expected)
    for name, (dtype, values) in expected.items():
        assert batch[name].dtype == dtype, name
        assert batch[name].tolist() == values, name


def test_verl_pads_prompts_left_and_responses_right_with_a_response_mask_off_tool_tokens():
    batch = to_verl(_rows(), pad_id=PAD)
    _check(
        batch,
        {
            "prompts": (np.int64, [[11, 12, 13], [PAD, PAD, 41]]),
            "responses": (np.int64, [[21, 22, 31, 23], [51, 52, PAD, PAD]]),
            "input_ids": (np.int64, [[11, 12, 13, 21, 22, 31, 23], [PAD, PAD, 41, 51, 52, PAD, PAD]]),
            "attention_mask": (np.int64, [[1, 1, 1, 1, 1, 1, 1], [0, 0, 1, 1, 1, 0, 0]]),
            # veRL's compute_position_id_with_mask: left padding is 0, right padding repeats the last.
            "position_ids": (np.int64, [[0, 1, 2, 3, 4, 5, 6], [0, 0, 0, 1, 2, 2, 2]]),
            "response_mask": (np.int64, [[1, 1, 0, 1], [0, 1, 0, 0]]),
            "rollout_log_probs": (np.float32, [[-0.5, -0.25, 0.0, -1.0], [-0.125, -0.75, 0.0, 0.0]]),
        },
    )


def test_verl_fixed_widths_pad_further_and_never_truncate():
    batch = to_verl(_rows(), prompt_length=4, response_length=5, pad_id=PAD)
    assert batch["prompts"].tolist() == [[PAD, 11, 12, 13], [PAD, PAD, PAD, 41]]
    assert batch["responses"].tolist() == [[21, 22, 31, 23, PAD], [51, 52, PAD, PAD, PAD]]
    assert batch["position_ids"].tolist()[0] == [0, 0, 1, 2, 3, 4, 5, 6, 6]
    with pytest.raises(ValueError, match=r"rollout a has a response of 4 tokens, more than 3; .*never truncated"):
        to_verl(_rows(), response_length=3)


def test_verl_keeps_masked_rows_only_when_asked_and_then_trains_none_of_their_tokens():
    batch = to_verl(_rows(), pad_id=PAD, masked="keep")
    assert batch["input_ids"].shape == (4, 7)
    assert batch["prompts"].tolist()[2:] == [[PAD, PAD, 61], [PAD, PAD, PAD]]
    assert batch["responses"].tolist()[2:] == [[62, PAD, PAD, PAD], [PAD, PAD, PAD, PAD]]
    assert batch["response_mask"].tolist()[2:] == [[0, 0, 0, 0], [0, 0, 0, 0]]
    assert batch["attention_mask"].tolist()[3] == [0] * 7


def test_nemo_rl_right_pads_with_lengths_and_a_sample_mask_of_the_opposite_polarity():
    batch = to_nemo_rl(_rows(), pad_id=PAD)
    _check(
        batch,
        {
            "input_ids": (
                np.int64,
                [
                    [11, 12, 13, 21, 22, 31, 23],
                    [41, 51, 52, PAD, PAD, PAD, PAD],
                    [61, 62, PAD, PAD, PAD, PAD, PAD],
                    [PAD] * 7,
                ],
            ),
            "input_lengths": (np.int32, [7, 3, 2, 0]),
            "token_mask": (np.int64, [[0, 0, 0, 1, 1, 0, 1], [0, 0, 1, 0, 0, 0, 0], [0] * 7, [0] * 7]),
            "generation_logprobs": (
                np.float32,
                [
                    [0.0, 0.0, 0.0, -0.5, -0.25, 0.0, -1.0],
                    [0.0, -0.125, -0.75, 0.0, 0.0, 0.0, 0.0],
                    [0.0, -2.0, 0.0, 0.0, 0.0, 0.0, 0.0],
                    [0.0] * 7,
                ],
            ),
            # 1 = train: raycap's mask_sample False, True, True, True(failed) -> 1, 1, 0, 0.
            "sample_mask": (np.float32, [1.0, 1.0, 0.0, 0.0]),
        },
    )


def test_nemo_rl_can_drop_masked_rows_and_refuses_a_width_below_a_sample():
    batch = to_nemo_rl(_rows(), masked="drop", length=8)
    assert batch["input_ids"].shape == (2, 8) and batch["sample_mask"].tolist() == [1.0, 1.0]
    with pytest.raises(ValueError, match=r"rollout a has a sequence of 7 tokens, more than 6"):
        to_nemo_rl(_rows(), length=6)


def test_openrlhf_shifts_the_action_mask_and_log_probs_by_one():
    batch = to_openrlhf(_rows(), pad_id=PAD)
    _check(
        batch,
        {
            "sequences": (np.int64, [[11, 12, 13, 21, 22, 31, 23], [41, 51, 52, PAD, PAD, PAD, PAD]]),
            "attention_mask": (np.int64, [[1, 1, 1, 1, 1, 1, 1], [1, 1, 1, 0, 0, 0, 0]]),
            # action_mask[t] is about token t + 1: length T - 1.
            "action_mask": (bool, [[False, False, True, True, False, True], [False, True, False, False, False, False]]),
            "rollout_log_probs": (np.float32, [[0.0, 0.0, -0.5, -0.25, 0.0, -1.0], [0.0, -0.75, 0.0, 0.0, 0.0, 0.0]]),
        },
    )


def test_a_token_batch_gives_one_sample_per_packed_segment():
    packed = collate(_rows(), seq_len=12)
    assert packed.rollout_ids == [["a", "b"]]
    from_batch = to_openrlhf(packed, pad_id=PAD)
    from_rows = to_openrlhf(_rows(), pad_id=PAD)
    assert from_batch["sequences"].tolist() == from_rows["sequences"].tolist()
    assert from_batch["action_mask"].tolist() == from_rows["action_mask"].tolist()
    # A token batch has no call_gen_start: the prompt ends at the first trained token,
    # which for b is one token later than its generated span starts.
    verl = to_verl(packed, pad_id=PAD)
    assert verl["prompts"].tolist() == [[11, 12, 13], [PAD, 41, 51]]
    assert verl["responses"].tolist() == [[21, 22, 31, 23], [52, PAD, PAD, PAD]]
    assert verl["response_mask"].tolist() == [[1, 1, 0, 1], [1, 0, 0, 0]]


def test_numpy_column_batches_are_read_like_tables():
    table = _rows().slice(0, 3)
    columns = {name: np.array(table.column(name).to_pylist(), dtype=object) for name in table.column_names}
    columns["mask_sample"] = np.array([False, False, True])
    for convert in (to_verl, to_nemo_rl, to_openrlhf):
        a, b = convert(columns, pad_id=PAD), convert(table, pad_id=PAD)
        assert {k: v.tolist() for k, v in a.items()} == {k: v.tolist() for k, v in b.items()}


@pytest.mark.skipif(importlib.util.find_spec("torch") is not None, reason="torch is installed here")
def test_asking_for_torch_without_torch_is_one_clear_error():
    with pytest.raises(ImportError, match="torch=True needs torch.*pip install torch"):
        to_nemo_rl(_rows(), torch=True)


@pytest.mark.skipif(importlib.util.find_spec("torch") is None, reason="torch is not installed here")
def test_torch_tensors_carry_the_same_values_and_dtypes():
    import torch

    batch = to_verl(_rows(), torch=True)
    assert isinstance(batch["input_ids"], torch.Tensor) and batch["input_ids"].dtype == torch.int64
    assert batch["rollout_log_probs"].dtype == torch.float32
