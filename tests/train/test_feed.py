"""Tests for raycap.train.feed: fixed-shape token batches for a trainer, and the Ray Dataset feed."""

from __future__ import annotations

import importlib.util
import shutil

import numpy as np
import pyarrow as pa
import pytest

from raycap.capture.consumer import build_local
from raycap.capture.records import TokenEntry
from raycap.capture.store import TokenCaptureStore
from raycap.rows.arrow import builds_to_table
from raycap.train.feed import TokenBatch, collate, token_batches


@pytest.fixture(scope="module")
def rows(fault_corpus, tmp_path_factory) -> pa.Table:
    directory = tmp_path_factory.mktemp("feed-rows") / "captures"
    shutil.copytree(fault_corpus.directory, directory)
    ids = TokenCaptureStore(directory).rollout_ids()
    return builds_to_table([build_local(rid, directory, model="m") for rid in ids])


def _trainable(table: pa.Table) -> list[dict]:
    listed = table.select(["rollout_id", "mask_sample", "token_ids", "loss_mask", "logprobs"]).to_pylist()
    return [r for r in listed if r["mask_sample"] is False and r["token_ids"] is not None]


def _unpacked(batch: TokenBatch) -> dict[str, tuple[list, list, list]]:
    """Each packed row back out of the arrays, by rollout id, using only segment_ids."""
    out = {}
    for line, ids in enumerate(batch.rollout_ids):
        for segment, rid in enumerate(ids, start=1):
            at = batch.segment_ids[line] == segment
            positions = batch.position_ids[line][at]
            assert positions.tolist() == list(range(int(at.sum())))
            out[rid] = (batch.token_ids[line][at].tolist(), batch.loss_mask[line][at].tolist(), batch.logprobs[line][at].tolist())
    return out


def test_collate_packs_every_trainable_row_exactly_and_leaves_masked_rows_out(rows):
    trainable = _trainable(rows)
    longest = max(len(r["token_ids"]) for r in trainable)
    seq_len = longest + 100
    batch = collate(rows, seq_len=seq_len)
    lines, width = batch.shape
    assert width == seq_len and lines < len(trainable)  # several rows share a line
    for name, array in batch.arrays().items():
        assert array.shape == (lines, seq_len), name
    assert batch.token_ids.dtype == np.int64 and batch.loss_mask.dtype == np.int8 and batch.logprobs.dtype == np.float64
    assert _unpacked(batch) == {r["rollout_id"]: (r["token_ids"], r["loss_mask"], r["logprobs"]) for r in trainable}
    # Padding: pad id, no attention, no loss.
    pad = batch.segment_ids == 0
    assert (batch.token_ids[pad] == 0).all() and (batch.attention_mask[pad] == 0).all() and (batch.loss_mask[pad] == 0).all()
    assert (batch.attention_mask[~pad] == 1).all()
    assert (batch.loss_weights == batch.loss_mask).all()  # rollout rows weigh 1
    assert int(batch.attention_mask.sum()) == sum(len(r["token_ids"]) for r in trainable)


def test_padding_mode_puts_one_row_per_line(rows):
    trainable = _trainable(rows)
    seq_len = max(len(r["token_ids"]) for r in trainable)
    batch = collate(rows, seq_len=seq_len, pack=False, pad_id=-1)
    assert batch.shape == (len(trainable), seq_len)
    assert [ids for ids in batch.rollout_ids] == [[r["rollout_id"]] for r in trainable]
    assert (batch.token_ids[batch.attention_mask == 0] == -1).all()


def test_a_row_longer_than_the_budget_is_never_truncated(rows):
    trainable = _trainable(rows)
    lengths = sorted(len(r["token_ids"]) for r in trainable)
    seq_len = lengths[len(lengths) // 2]
    too_long = {r["rollout_id"] for r in trainable if len(r["token_ids"]) > seq_len}
    with pytest.raises(ValueError, match=r"rollout \S+ has \d+ tokens, more than seq_len .* never truncated"):
        collate(rows, seq_len=seq_len)
    batch = collate(rows, seq_len=seq_len, too_long="skip")
    assert set(batch.skipped) == too_long
    assert set(_unpacked(batch)) == {r["rollout_id"] for r in trainable} - too_long


def test_token_batches_have_a_fixed_shape_and_keep_every_row_once(rows):
    trainable = _trainable(rows)
    seq_len = max(len(r["token_ids"]) for r in trainable) + 1
    stream = [rows.slice(i, 6) for i in range(0, rows.num_rows, 6)]
    batches = list(token_batches(stream, seq_len=seq_len, lines=2))
    assert len(batches) > 1 and all(b.shape == (2, seq_len) for b in batches)
    seen: dict = {}
    for b in batches:
        unpacked = _unpacked(b)
        assert not set(unpacked) & set(seen)
        seen.update(unpacked)
    assert seen == {r["rollout_id"]: (r["token_ids"], r["loss_mask"], r["logprobs"]) for r in trainable}
    assert [rid for b in batches for line in b.rollout_ids for rid in line] != []
    dropped = list(token_batches(stream, seq_len=seq_len, lines=2, drop_last=True))
    assert len(dropped) in (len(batches), len(batches) - 1)


def test_collate_reads_numpy_batches_and_chain_weights():
    batch = {
        "rollout_id": np.array(["a", "b", "c"], dtype=object),
        "mask_sample": np.array([False, True, False]),
        "weight": np.array([0.5, 0.0, 1.0]),
        "token_ids": np.array([np.array([1, 2, 3]), np.array([4]), np.array([5, 6])], dtype=object),
        "loss_mask": np.array([np.array([0, 1, 1], dtype=np.int8), np.array([1], dtype=np.int8), np.array([0, 1], dtype=np.int8)], dtype=object),
        "logprobs": np.array([np.array([0.0, -0.1, -0.2]), np.array([-1.0]), np.array([0.0, -0.3])], dtype=object),
    }
    out = collate(batch, seq_len=5)
    assert out.shape == (1, 5) and out.rollout_ids == [["a", "c"]]
    assert out.token_ids.tolist() == [[1, 2, 3, 5, 6]]
    assert out.segment_ids.tolist() == [[1, 1, 1, 2, 2]] and out.position_ids.tolist() == [[0, 1, 2, 0, 1]]
    assert out.loss_weights.tolist() == [[0.0, 0.5, 0.5, 0.0, 1.0]]
    with pytest.raises(ValueError, match="missing: logprobs"):
        collate({k: v for k, v in batch.items() if k != "logprobs"}, seq_len=5)


def test_two_training_workers_read_the_committed_rows_through_streaming_split(ray_shared, rows, tmp_path):
    """Ray Data's row split feeds two workers each row exactly once (their step counts may
    differ: `raycap.DataParallelFeed` is the feed for ranks that must step together)."""
    import ray

    import raycap
    from raycap.output.commit import Inputs, StagedOutput
    from raycap.output.shards import write_shard

    out = tmp_path / "rows"
    with StagedOutput(out, inputs=Inputs(("/c",), None, "prefix_merging", "m")) as staged:
        staged.commit([write_shard(staged.staging, i, rows.slice(s, 8)) for i, s in enumerate(range(0, rows.num_rows, 8))])
    seq_len = max(len(r["token_ids"]) for r in _trainable(rows)) + 1

    @ray.remote(num_cpus=0)  # a trainer would ask for its GPU here
    class Trainer:
        def fit(self, shard) -> list:
            seen = []
            for batch in token_batches(shard.iter_batches(batch_size=8, batch_format="pyarrow"), seq_len=seq_len, lines=2):
                assert batch.shape == (2, seq_len)
                seen.extend(rid for line in batch.rollout_ids for rid in line)
            return seen

    columns = ["rollout_id", "mask_sample", "token_ids", "loss_mask", "logprobs"]
    shards = raycap.dataset(out, columns=columns).streaming_split(2, equal=False)
    trainers = [Trainer.remote() for _ in shards]
    seen = ray.get([t.fit.remote(s) for t, s in zip(trainers, shards)])
    assert sorted(seen[0] + seen[1]) == sorted(r["rollout_id"] for r in _trainable(rows))


def test_dataset_selects_columns_without_the_deprecated_read_argument(ray_shared, rows, tmp_path):
    import warnings

    import raycap
    from raycap.output.commit import Inputs, StagedOutput
    from raycap.output.shards import write_shard

    out = tmp_path / "rows"
    with StagedOutput(out, inputs=Inputs(("/c",), None, "prefix_merging", "m")) as staged:
        staged.commit([write_shard(staged.staging, 0, rows)])
    columns = ["rollout_id", "token_ids"]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        selected = raycap.dataset(out, columns=columns)
        assert selected.columns() == columns
        assert selected.count() == rows.num_rows
    deprecated = [str(w.message) for w in caught if issubclass(w.category, DeprecationWarning) and "columns" in str(w.message)]
    assert deprecated == []


# --- per-token versions ------------------------------------------------------------------------


def _versioned_rows() -> pa.Table:
    """Two hand-built rows with version columns: r1's calls generated positions 3..5 at
    version 4 and 7..8 at version 9; r2 has a call without a version; r3 no versions."""
    return pa.table(
        {
            "rollout_id": ["r1", "r2", "r3"],
            "mask_sample": [False, False, False],
            "token_ids": [[1, 2, 3, 10, 11, 7, 5, 12, 13], [1, 2, 20, 21], [1, 30]],
            "loss_mask": [[0, 0, 0, 1, 1, 0, 0, 1, 1], [0, 0, 1, 1], [0, 1]],
            "logprobs": [[0.0, 0.0, 0.0, -0.1, -0.2, 0.0, 0.0, -0.3, -0.4], [0.0, 0.0, -0.5, -0.6], [0.0, -0.7]],
            "call_gen_start": [[3, 7], [2], [1]],
            "call_gen_end": [[5, 9], [4], [2]],
            "call_versions": pa.array([[4, 9], [None], None], pa.list_(pa.int64())),
        }
    )


def _line_versions(batch: TokenBatch) -> dict[str, list[int]]:
    out = {}
    for line, ids in enumerate(batch.rollout_ids):
        for segment, rid in enumerate(ids, start=1):
            out[rid] = batch.versions[line][batch.segment_ids[line] == segment].tolist()
    return out


def test_collated_versioned_rows_carry_each_generated_tokens_call_version_and_minus_one_elsewhere():
    batch = collate(_versioned_rows(), seq_len=12)
    assert batch.versions is not None and batch.versions.dtype == np.int64 and batch.versions.shape == batch.shape
    assert _line_versions(batch) == {
        "r1": [-1, -1, -1, 4, 4, -1, -1, 9, 9],
        "r2": [-1, -1, -1, -1],  # its only call has no version
        "r3": [-1, -1],  # the row has no versions
    }
    assert (batch.versions[batch.segment_ids == 0] == -1).all()  # padding
    assert "versions" in batch.arrays()


def test_rows_without_version_columns_give_batches_without_versions(rows):
    batch = collate(rows, seq_len=4096, too_long="skip")
    assert batch.versions is None and "versions" not in batch.arrays()


def test_token_batches_carry_versions_through_every_fixed_shape_batch():
    table = _versioned_rows()
    batches = list(token_batches(table.to_batches(max_chunksize=1), seq_len=10, lines=1))
    assert [b.shape for b in batches] == [(1, 10)] * len(batches)
    seen = {}
    for batch in batches:
        seen.update(_line_versions(batch))
    assert seen["r1"] == [-1, -1, -1, 4, 4, -1, -1, 9, 9] and seen["r3"] == [-1, -1]


def test_a_call_span_outside_its_row_is_refused_naming_the_rollout():
    table = _versioned_rows()
    damaged = table.set_column(table.column_names.index("call_gen_end"), "call_gen_end", pa.array([[5, 99], [4], [2]]))
    with pytest.raises(ValueError, match="rollout r1"):
        collate(damaged, seq_len=12)


def test_rows_from_a_versioned_stream_feed_the_versions_their_calls_were_served_at(tmp_path):
    from raycap import Stream
    from raycap.rows.arrow import token_versions

    store = TokenCaptureStore(tmp_path)
    for rid, versions in (("a", [4, 9, 9]), ("b", [7, None, 8])):
        prompt = [1, 2, 3]
        for index, version in enumerate(versions):
            extra = {} if version is None else {"policy_version": version}
            generation = [10 + index, 20 + index]
            store.append(
                TokenEntry(rollout_id=rid, model_call_id=f"call-{index}", prompt_token_ids=prompt,
                           generation_token_ids=generation, generation_log_probs=[-0.25, -0.5],
                           created_at=float(index), **extra)
            )
            prompt = prompt + generation + [5]
    with Stream([tmp_path], executor="local", version_key="policy_version") as stream:
        stream.submit(["a", "b"])
        taken = stream.take(2, timeout=30)
    batch = collate(taken, seq_len=64)
    fed = _line_versions(batch)
    # Each generated token carries its own call's version; the rest -1.
    assert fed["a"] == [-1, -1, -1, 4, 4, -1, 9, 9, -1, 9, 9]
    assert fed["b"] == [-1, -1, -1, 7, 7, -1, -1, -1, -1, 8, 8]
    # The same as the Arrow form, nulls as -1, and only on trained tokens.
    arrow = {rid: [-1 if v is None else v for v in vs]
             for rid, vs in zip(taken.column("rollout_id").to_pylist(), token_versions(taken).to_pylist())}
    assert fed == arrow
    assert ((batch.versions >= 0) <= (batch.loss_mask == 1)).all()


# --- record columns, token counts, empty rows, torch dtypes ---------------------------------------


def _record_rows() -> pa.Table:
    """Four hand-built rows with the record columns: a and b of task 5, c without a task,
    d without a reward; e has an empty token list though mask_sample is false."""
    return pa.table(
        {
            "rollout_id": ["a", "b", "c", "d", "e"],
            "mask_sample": [False, False, False, False, False],
            "token_ids": [[1, 2, 3], [4, 5], [6, 7, 8, 9], [10], []],
            "loss_mask": pa.array([[0, 1, 1], [0, 1], [0, 0, 1, 1], [1], []], pa.list_(pa.int8())),
            "logprobs": [[0.0, -0.1, -0.2], [0.0, -0.3], [0.0, 0.0, -0.4, -0.5], [-0.6], []],
            "reward": pa.array([1.0, 0.5, -1.0, None, 2.0], pa.float64()),
            "task_index": pa.array([5, 5, None, 5, 6], pa.int64()),
        }
    )


def test_a_batch_gives_each_packed_rows_reward_and_group_aligned_with_its_rollout_ids():
    batch = collate(_record_rows(), seq_len=6)
    assert batch.rollout_ids == [["a", "b", "d"], ["c"]]
    assert batch.rewards == [[1.0, 0.5, None], [-1.0]]
    assert batch.groups[0] == ["task:5", "task:5", "task:5"]
    (own,) = batch.groups[1]
    assert own.startswith("rollout:c:") and own != collate(_record_rows(), seq_len=6).groups[1][0]
    # Rows without a reward column report none.
    plain = collate(_record_rows().drop_columns(["reward", "task_index"]), seq_len=6)
    assert plain.rewards is None and plain.groups is None and plain.rollout_ids == batch.rollout_ids


def test_a_row_with_an_empty_token_list_is_never_fed_and_is_named():
    batch = collate(_record_rows(), seq_len=6)
    assert "e" not in [rid for ids in batch.rollout_ids for rid in ids] and batch.empty_rows == ["e"]
    assert all(int((batch.segment_ids[line] == seg).sum()) > 0 for line, ids in enumerate(batch.rollout_ids) for seg in range(1, len(ids) + 1))
    streamed = list(token_batches(_record_rows().to_batches(max_chunksize=2), seq_len=6, lines=1))
    assert [rid for b in streamed for rid in b.empty_rows] == ["e"]
    assert "e" not in [rid for b in streamed for ids in b.rollout_ids for rid in ids]


def test_a_batch_counts_its_tokens_and_for_one_process_its_step_is_itself():
    batch = collate(_record_rows(), seq_len=6, pack=False)
    assert batch.total_tokens == 3 + 2 + 4 + 1 and batch.trained_tokens == 2 + 1 + 2 + 1
    assert (batch.step_total_tokens, batch.step_trained_tokens) == (batch.total_tokens, batch.trained_tokens)
    padded = list(token_batches([_record_rows().slice(0, 1)], seq_len=6, lines=3))[0]
    assert padded.padding_lines == 2 and (padded.total_tokens, padded.trained_tokens) == (3, 2)


def test_torch_dtypes_are_float32_log_probs_and_bool_masks_with_the_same_values():
    batch = collate(_record_rows(), seq_len=6)
    plain, cast = batch.arrays(), batch.arrays(torch_dtypes=True)
    assert plain["logprobs"].dtype == np.float64 and plain["attention_mask"].dtype == np.int8  # the default keeps them
    assert cast["logprobs"].dtype == np.float32 and cast["loss_mask"].dtype == np.bool_ and cast["attention_mask"].dtype == np.bool_
    assert list(cast) == list(plain)
    for name in plain:
        assert cast[name].shape == plain[name].shape
        assert np.array_equal(cast[name], plain[name].astype(cast[name].dtype)), name
        if name not in ("logprobs", "loss_mask", "attention_mask"):
            assert cast[name].dtype == plain[name].dtype, name
    assert np.array_equal(cast["attention_mask"], plain["attention_mask"] == 1)
    assert np.allclose(cast["logprobs"], plain["logprobs"], atol=1e-7)


@pytest.mark.skipif(importlib.util.find_spec("torch") is not None, reason="torch is installed here")
def test_tensors_without_torch_is_one_clear_error():
    with pytest.raises(ImportError, match=r"TokenBatch\.tensors\(\) needs torch.*pip install torch"):
        collate(_record_rows(), seq_len=6).tensors()


@pytest.mark.skipif(importlib.util.find_spec("torch") is None, reason="torch is not installed here")
def test_tensors_feed_scaled_dot_product_attention_which_refuses_int8_masks():
    import torch
    import torch.nn.functional as F

    batch = collate(_record_rows(), seq_len=6)
    tensors = batch.tensors()
    assert tensors["logprobs"].dtype == torch.float32 and tensors["attention_mask"].dtype == torch.bool
    assert tensors["token_ids"].dtype == torch.int64 and tensors["loss_mask"].dtype == torch.bool
    lines, width = batch.shape
    q = torch.randn(lines, 1, width, 8)
    segments = tensors["segment_ids"]
    # Block-diagonal attention from segment_ids, causal, and each token may see itself.
    same = (segments[:, :, None] == segments[:, None, :]) & torch.ones(width, width, dtype=torch.bool).tril()
    mask = (same & tensors["attention_mask"][:, None, :]) | torch.eye(width, dtype=torch.bool)
    out = F.scaled_dot_product_attention(q, q, q, attn_mask=mask[:, None])
    assert torch.isfinite(out).all()
    with pytest.raises(RuntimeError):
        F.scaled_dot_product_attention(q, q, q, attn_mask=torch.from_numpy(batch.attention_mask)[:, None, None, :])
