"""Tests for raycap.train.trainers: each framework's batch convention, checked on hand-built rows
whose expected arrays are written out in full."""

from __future__ import annotations

import importlib.util

import numpy as np
import pyarrow as pa
import pytest

from collection import with_columns
from raycap.train.feed import collate
from raycap.train.trainers import to_nemo_rl, to_openrlhf, to_verl

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
            # action_mask[t] is about token t + 1: length T - 1; int64 0/1, as OpenRLHF's producer makes it.
            "action_mask": (np.int64, [[0, 0, 1, 1, 0, 1], [0, 1, 0, 0, 0, 0]]),
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
    assert to_openrlhf(_rows(), torch=True)["action_mask"].dtype == torch.int64  # long, as OpenRLHF's producer
    grpo = to_verl(_grpo_rows(), torch=True)
    assert grpo["rm_scores"].dtype == torch.float32
    assert isinstance(grpo["uid"], np.ndarray) and grpo["uid"].dtype == object  # veRL's non_tensor_batch holds numpy
    assert to_nemo_rl(_grpo_rows(), torch=True)["total_reward"].dtype == torch.float32
    assert to_openrlhf(_grpo_rows(), torch=True)["rewards"].dtype == torch.float32


# --- rewards and groups (rows built from rollout records) -------------------------------------


def _with_record_columns(table: pa.Table, rewards: list, tasks: list) -> pa.Table:
    """Rows as the record columns of SPEC §10.7 extend them: reward float64, task_index int64."""
    return with_columns(table, reward=pa.array(rewards, pa.float64()), task_index=pa.array(tasks, pa.int64()))



def _grpo_rows() -> pa.Table:
    """Seven rows: t1..t3 are three rollouts of task 7, u1/u2 two of task 3, and n1/n2 have
    no task index. Responses differ in length, so padding moves the last response token."""
    prompt = [1, 2]
    responses = {"t1": [10, 11, 12], "t2": [20], "t3": [30, 31, 32, 33, 34], "u1": [40, 41], "u2": [50, 51, 52], "n1": [60], "n2": [70, 71]}
    ids = list(responses)
    table = pa.table(
        {
            "rollout_id": ids,
            "mask_sample": [False] * len(ids),
            "token_ids": [prompt + responses[r] for r in ids],
            "loss_mask": pa.array([[0, 0] + [1] * len(responses[r]) for r in ids], type=pa.list_(pa.int8())),
            "logprobs": [[0.0, 0.0] + [-0.5] * len(responses[r]) for r in ids],
            "call_gen_start": [[2] for _ in ids],
        }
    )
    return _with_record_columns(table, [1.0, 0.0, 0.5, -1.0, 2.0, 0.25, 0.75], [7, 7, 7, 3, 3, None, None])


def test_verl_uid_is_shared_within_a_task_and_unique_for_every_row_without_one():
    batch = to_verl(_grpo_rows())
    uid = batch["uid"]
    assert uid.dtype == object and uid.shape == (7,) and all(isinstance(u, str) for u in uid)
    t1, t2, t3, u1, u2, n1, n2 = uid.tolist()
    assert t1 == t2 == t3 and u1 == u2  # one GRPO group per task
    assert len({t1, u1, n1, n2}) == 4  # tasks apart, and each task-less row alone
    # A task-less row's uid is no other row's, in this batch or the next.
    again = to_verl(_grpo_rows())["uid"].tolist()
    assert again[:5] == [t1, t2, t3, u1, u2] and not {n1, n2} & set(again)


def test_verl_rm_scores_hold_each_reward_on_its_last_response_token_after_padding():
    rows = _grpo_rows()
    rewards = rows.column("reward").to_pylist()
    for widths in ({}, {"prompt_length": 4, "response_length": 9}):
        batch = to_verl(rows, pad_id=PAD, **widths)
        scores, responses = batch["rm_scores"], batch["responses"]
        assert scores.dtype == np.float32 and scores.shape == responses.shape
        prompt_width = batch["prompts"].shape[1]
        for i, (reward, tokens) in enumerate(zip(rewards, rows.column("token_ids").to_pylist())):
            last = int(batch["attention_mask"][i, prompt_width:].sum()) - 1  # veRL's own index
            assert responses[i, last] == tokens[-1] and (last + 1 == scores.shape[1] or responses[i, last + 1] == PAD)
            expected = np.zeros(scores.shape[1], dtype=np.float32)
            expected[last] = reward
            assert scores[i].tolist() == expected.tolist()


def test_nemo_rl_gets_total_reward_and_openrlhf_rewards_in_sample_order():
    rows = _grpo_rows()
    rewards = rows.column("reward").to_pylist()
    nemo = to_nemo_rl(rows)
    assert nemo["total_reward"].dtype == np.float32 and nemo["total_reward"].tolist() == rewards
    openrlhf = to_openrlhf(rows)
    assert openrlhf["rewards"].dtype == np.float32 and openrlhf["rewards"].tolist() == rewards
    assert openrlhf["action_mask"].dtype == np.int64 and set(np.unique(openrlhf["action_mask"]).tolist()) == {0, 1}


def test_rows_without_rewards_give_the_dicts_they_gave_before():
    plain = _rows()
    all_null = _with_record_columns(plain, [None] * 4, [None] * 4)  # built without records
    for convert, added in ((to_verl, {"rm_scores", "uid"}), (to_nemo_rl, {"total_reward"}), (to_openrlhf, {"rewards"})):
        expected = {k: v.tolist() for k, v in convert(plain, pad_id=PAD).items()}
        assert not added & set(expected)
        assert {k: v.tolist() for k, v in convert(all_null, pad_id=PAD).items()} == expected
        assert not added & set(convert(_grpo_rows(), rewards=False))
        with pytest.warns(RuntimeWarning, match="no reward"):  # asked for, so every row is masked
            assert added <= set(convert(all_null, rewards=True, masked="keep"))


def test_rewards_true_needs_a_reward_column_and_rewards_is_a_bool():
    with pytest.raises(ValueError, match="rewards=True needs rows with a reward column"):
        to_verl(_rows(), rewards=True)
    with pytest.raises(TypeError, match="rewards must be None, True or False"):
        to_openrlhf(_grpo_rows(), rewards="yes")


def test_a_trainable_row_without_a_reward_is_masked_and_named_never_trained_on():
    rewards = [1.0, None, 0.5, -1.0, float("nan"), 0.25, 0.75]  # t2 has none; u2's is not a number
    rows = _grpo_rows().set_column(6, "reward", pa.array(rewards, pa.float64()))
    with pytest.warns(RuntimeWarning, match=r"2 row\(s\) with no reward .* masked, not trained on: t2, u2$"):
        dropped = to_verl(rows)
    assert dropped["uid"].shape == (5,) and dropped["rm_scores"].sum() == pytest.approx(1.0 + 0.5 - 1.0 + 0.25 + 0.75)
    with pytest.warns(RuntimeWarning, match="t2, u2"):
        kept = to_verl(rows, masked="keep")
    uid = kept["uid"].tolist()
    assert kept["response_mask"][[1, 4]].sum() == 0 and kept["rm_scores"][[1, 4]].sum() == 0
    assert uid[0] == uid[2] and uid[1] not in uid[:1] + uid[2:] and uid[4] != uid[3]  # out of their groups
    with pytest.warns(RuntimeWarning):
        nemo = to_nemo_rl(rows)
    assert nemo["sample_mask"].tolist() == [1, 0, 1, 1, 0, 1, 1] and nemo["total_reward"].tolist() == [1.0, 0, 0.5, -1.0, 0, 0.25, 0.75]
    assert nemo["token_mask"][[1, 4]].sum() == 0
    with pytest.warns(RuntimeWarning):
        assert to_openrlhf(rows)["rewards"].tolist() == [1.0, 0.5, -1.0, 0.25, 0.75]
    # Asked for rewards, a batch where none has one trains nothing, and the warning stays one line.
    unrewarded = _grpo_rows().set_column(6, "reward", pa.nulls(7, pa.float64()))
    with pytest.warns(RuntimeWarning, match=r"^7 row\(s\) with no reward .*: t1, t2, t3, u1, u2 and 2 more$"):
        assert to_openrlhf(unrewarded, rewards=True)["rewards"].shape == (0,)


def test_an_empty_token_list_is_never_trainable_whatever_mask_sample_says():
    rows = _rows().slice(0, 2)
    empty = pa.table({"rollout_id": ["e"], "mask_sample": [False], "token_ids": [[]], "loss_mask": pa.array([[]], pa.list_(pa.int8())),
                      "logprobs": pa.array([[]], pa.list_(pa.float64())), "call_gen_start": pa.array([[]], pa.list_(pa.int64()))})
    rows = pa.concat_tables([rows, empty.cast(rows.schema)])
    for convert in (to_verl, to_openrlhf):
        with pytest.warns(RuntimeWarning, match=r"1 row\(s\) with an empty token list .* rebuild it\) are masked, not trained on: e$"):
            batch = convert(rows, pad_id=PAD)
        assert next(iter(batch.values())).shape[0] == 2
    with pytest.warns(RuntimeWarning, match="empty token list"):
        nemo = to_nemo_rl(rows)
    assert nemo["sample_mask"].tolist() == [1.0, 1.0, 0.0] and nemo["input_lengths"].tolist() == [7, 3, 0]


def test_pinned_widths_give_every_call_the_same_shapes_so_batches_concatenate():
    rows = _grpo_rows()
    first, second = rows.slice(0, 3), rows.slice(3, 4)  # longest responses 5 and 3
    pins = {to_verl: {"prompt_length": 4, "response_length": 8}, to_nemo_rl: {"length": 10}, to_openrlhf: {"length": 10}}
    for convert, pinned in pins.items():
        loose = convert(first), convert(second)
        assert any(loose[0][k].shape[1:] != loose[1][k].shape[1:] for k in loose[0] if loose[0][k].ndim == 2)
        a, b = convert(first, **pinned), convert(second, **pinned)
        assert list(a) == list(b)
        for name in a:
            assert a[name].shape[1:] == b[name].shape[1:], (convert.__name__, name)
            assert np.concatenate([a[name], b[name]]).shape[0] == 7
        whole = convert(rows, **pinned)
        for name in a:
            if name != "uid":
                assert np.concatenate([a[name], b[name]]).tolist() == whole[name].tolist(), name


def test_a_token_batch_gives_each_packed_rows_reward_and_group_to_the_conventions():
    rows = _grpo_rows()
    packed = collate(rows, seq_len=16)
    assert len(packed.rollout_ids) > 1 and any(len(ids) > 1 for ids in packed.rollout_ids)
    by_id = dict(zip(rows.column("rollout_id").to_pylist(), rows.column("reward").to_pylist()))
    order = [rid for ids in packed.rollout_ids for rid in ids]
    assert [r for line in packed.rewards for r in line] == [by_id[rid] for rid in order]
    groups = dict(zip(order, [g for line in packed.groups for g in line]))
    assert groups["t1"] == groups["t2"] == groups["t3"] == "task:7" and groups["u1"] == groups["u2"] == "task:3"
    assert groups["n1"] != groups["n2"] and not {groups["n1"], groups["n2"]} & {"task:7", "task:3"}
    verl = to_verl(packed)
    assert verl["uid"].tolist() == [groups[rid] for rid in order]
    assert verl["rm_scores"].sum(axis=1).tolist() == [by_id[rid] for rid in order]
    assert to_openrlhf(packed)["rewards"].tolist() == [by_id[rid] for rid in order]


def test_numpy_batches_with_nan_for_null_read_like_tables():
    table = _grpo_rows()
    columns = {name: np.array(table.column(name).to_pylist(), dtype=object) for name in table.column_names}
    columns["task_index"] = np.array([7, 7, 7, 3, 3, np.nan, np.nan])  # how a numpy batch holds a null
    columns["reward"] = np.array(table.column("reward").to_pylist(), dtype=np.float64)
    a, b = to_verl(columns), to_verl(table)
    assert {k: v.tolist() for k, v in a.items() if k != "uid"} == {k: v.tolist() for k, v in b.items() if k != "uid"}
    assert a["uid"].tolist()[:5] == b["uid"].tolist()[:5] and len(set(a["uid"].tolist()[5:]) | set(b["uid"].tolist()[5:])) == 4


def test_a_task_index_that_is_not_a_whole_number_is_a_damaged_row_named():
    table = _grpo_rows()
    columns = {name: np.array(table.column(name).to_pylist(), dtype=object) for name in table.column_names}
    columns["task_index"] = np.array([7, 7, 7, 3, 3.5, None, None], dtype=object)
    with pytest.raises(ValueError, match=r"rollout u2: task_index 3\.5 is not a whole number"):
        to_verl(columns)


def test_rows_from_a_rebuild_with_record_columns_keep_their_groups_and_rewards(fault_corpus, tmp_path):
    """Rows of a real rebuild, extended with the record columns: every trainable row keeps
    its reward, and the uid partitions the samples exactly as task_index does."""
    import shutil

    from raycap.capture.consumer import build_local
    from raycap.capture.store import TokenCaptureStore
    from raycap.rows.arrow import builds_to_table

    directory = tmp_path / "captures"
    shutil.copytree(fault_corpus.directory, directory)
    ids = TokenCaptureStore(directory).rollout_ids()
    built = builds_to_table([build_local(rid, directory, model="m") for rid in ids])
    n = built.num_rows
    tasks = [None if i % 5 == 4 else i // 3 for i in range(n)]
    rows = _with_record_columns(built, [float(i % 4) / 2 for i in range(n)], tasks)
    trainable = [i for i, (m, t) in enumerate(zip(rows.column("mask_sample").to_pylist(), rows.column("token_ids").to_pylist())) if m is False and t]
    assert 3 < len(trainable) < n
    batch = to_verl(rows)
    assert batch["uid"].shape == (len(trainable),)
    uid = batch["uid"].tolist()
    for a, i in enumerate(trainable):
        assert batch["rm_scores"][a].sum() == pytest.approx(float(i % 4) / 2)
        for b_, j in enumerate(trainable):
            assert (uid[a] == uid[b_]) == (a == b_ or (tasks[i] is not None and tasks[i] == tasks[j]))
    assert to_nemo_rl(rows, masked="drop")["total_reward"].tolist() == [float(i % 4) / 2 for i in trainable]
