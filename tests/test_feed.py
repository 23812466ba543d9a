"""Tests for raycap.feed: fixed-shape token batches for a trainer, and the Ray Dataset feed."""

from __future__ import annotations

import shutil

import numpy as np
import pyarrow as pa
import pytest

from raycap.arrow import builds_to_table
from raycap.consumer import build_local
from raycap.feed import TokenBatch, collate, token_batches
from raycap.store import TokenCaptureStore


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
    from raycap.output import Inputs, StagedOutput, write_shard

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
    from raycap.output import Inputs, StagedOutput, write_shard

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
