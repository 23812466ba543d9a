"""Tests for the data-parallel feed: ranks fed from one committed output step together,
and every trainable row reaches exactly one rank, unchanged."""

from __future__ import annotations

from collections import Counter

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from collection import with_columns
from raycap.cli.synth import CorpusSpec, generate_corpus
from raycap.output.manifest import shard_paths
from raycap.runs.handoff import rebuild_to_output
from raycap.train.feed import DataParallelFeed, TokenBatch, _first_fit, _Packer, _Row, collate, shard_batches

SMALL = dict(system_tokens=(20, 120), turns=(4, 7), generation_tokens=(1, 40), tool_tokens=(1, 40), fault_share=0.3)


def _committed(tmp_path_factory, name: str, delivery: str = "rollout") -> str:
    root = tmp_path_factory.mktemp(name)
    corpus = generate_corpus(root / "captures", CorpusSpec(rollouts=36, seed=11, **SMALL))
    outcome = rebuild_to_output([corpus.directory], root / "out", executor="local", batch_size=5, delivery=delivery)
    assert outcome.ok, outcome.message
    return str(root / "out")


@pytest.fixture(scope="module")
def output(tmp_path_factory) -> str:
    return _committed(tmp_path_factory, "dp-rollouts")


@pytest.fixture(scope="module")
def chain_output(tmp_path_factory) -> str:
    return _committed(tmp_path_factory, "dp-chains", delivery="chains")


def _output_rows(output: str) -> pa.Table:
    return pa.concat_tables([pq.read_table(p) for p in shard_paths(output)])


def _trainable(output: str) -> list[tuple]:
    """(rollout id, tokens, loss mask, log probs, weight) of every row a trainer must see."""
    table = _output_rows(output)
    weights = table.column("weight").to_pylist() if "weight" in table.column_names else [1.0] * table.num_rows
    out = []
    for row, weight in zip(table.select(["rollout_id", "mask_sample", "token_ids", "loss_mask", "logprobs"]).to_pylist(), weights):
        if row["mask_sample"] is False and row["token_ids"] is not None:
            out.append((row["rollout_id"], tuple(row["token_ids"]), tuple(row["loss_mask"]), tuple(row["logprobs"]), weight))
    return out


def _fed(batch: TokenBatch) -> list[tuple]:
    """The rows of a batch, read back from its arrays by segment alone."""
    out = []
    for line, ids in enumerate(batch.rollout_ids):
        for segment, rid in enumerate(ids, start=1):
            at = batch.segment_ids[line] == segment
            assert batch.position_ids[line][at].tolist() == list(range(int(at.sum())))
            assert (batch.attention_mask[line][at] == 1).all()
            mask = batch.loss_mask[line][at]
            weights = batch.loss_weights[line][at][mask == 1]
            weight = float(weights[0]) if len(weights) else None
            assert (weights == np.float32(weight)).all() if len(weights) else True
            out.append((rid, tuple(batch.token_ids[line][at].tolist()), tuple(mask.tolist()), tuple(batch.logprobs[line][at].tolist()), weight))
    return out


def _seq_len(output: str, slack: int = 40) -> int:
    return max(len(r[1]) for r in _trainable(output)) + slack


@pytest.mark.slow
@pytest.mark.parametrize("pack", [True, False])
@pytest.mark.parametrize("world_size", [2, 3])
def test_every_rank_takes_the_same_number_of_fixed_shape_steps_and_all_rows_once(output, world_size, pack):
    trainable = _trainable(output)
    assert len(trainable) > 10 and len(trainable) < len(_output_rows(output))  # some rows are masked
    seq_len = _seq_len(output)
    per_rank = [list(shard_batches(output, rank, world_size, seq_len=seq_len, lines=2, pack=pack)) for rank in range(world_size)]
    steps = {len(batches) for batches in per_rank}
    assert len(steps) == 1 and steps.pop() > 1
    assert all(b.shape == (2, seq_len) for batches in per_rank for b in batches)
    for name, dtype in [("token_ids", np.int64), ("loss_mask", np.int8), ("loss_weights", np.float32)]:
        assert all(getattr(b, name).dtype == dtype for batches in per_rank for b in batches)
    fed = [row for batches in per_rank for b in batches for row in _fed(b)]
    # The multiset of fed rows is the output's trainable rows, each exactly once, token for token.
    expected = [(rid, tokens, mask, logprobs, weight if any(mask) else None) for rid, tokens, mask, logprobs, weight in trainable]
    assert Counter(fed) == Counter(expected)
    assert len(fed) == len(expected)


@pytest.mark.parametrize("world_size", [2, 3])
def test_ranks_get_their_share_and_lagging_ranks_are_padded_with_counted_zero_weight_lines(output, world_size):
    seq_len = _seq_len(output)
    feed = DataParallelFeed(output, world_size, seq_len=seq_len, lines=3)
    loads = [feed.rank_lines(rank) for rank in range(world_size)]
    assert max(loads) - min(loads) <= 1 and sum(loads) == feed.total_lines
    for rank in range(world_size):
        batches = list(feed.batches(rank))
        assert len(batches) == feed.steps
        real = sum(1 for b in batches for ids in b.rollout_ids if ids)
        padding = sum(b.padding_lines for b in batches)
        assert real == loads[rank]
        assert padding == feed.padding_lines(rank) == feed.steps * 3 - loads[rank]
        for b in batches:
            empty = [i for i, ids in enumerate(b.rollout_ids) if not ids]
            assert len(empty) == b.padding_lines
            for i in empty:
                assert not b.attention_mask[i].any() and not b.loss_mask[i].any() and not b.loss_weights[i].any()
                assert not b.segment_ids[i].any()


def test_more_ranks_than_lines_still_step_together_on_padding(output):
    seq_len = _seq_len(output)
    lines = DataParallelFeed(output, 1, seq_len=seq_len, lines=1).total_lines
    feed = DataParallelFeed(output, lines + 2, seq_len=seq_len, lines=1)
    assert feed.steps == 1
    counts = [feed.padding_lines(rank) for rank in range(lines + 2)]
    assert counts == [0] * lines + [1, 1]
    last = list(feed.batches(lines + 1))
    assert len(last) == 1 and last[0].padding_lines == 1 and not last[0].loss_weights.any()


def test_one_rank_packs_exactly_as_collate_packs_the_whole_output(output):
    seq_len = _seq_len(output, slack=200)
    whole = collate(_output_rows(output), seq_len=seq_len)
    feed = DataParallelFeed(output, 1, seq_len=seq_len, lines=whole.shape[0])
    (batch,) = list(feed.batches(0))
    assert batch.rollout_ids == whole.rollout_ids and batch.padding_lines == 0
    for name, array in whole.arrays().items():
        assert np.array_equal(getattr(batch, name), array), name


@pytest.mark.slow
def test_chain_rows_keep_their_weight_on_every_rank(chain_output):
    seq_len = _seq_len(chain_output)
    fed = [row for rank in range(2) for b in shard_batches(chain_output, rank, 2, seq_len=seq_len, lines=2) for row in _fed(b)]
    expected = [(rid, t, m, lp, np.float32(w).item() if any(m) else None) for rid, t, m, lp, w in _trainable(chain_output)]
    assert any(w is not None and w < 1.0 for *_, w in expected)  # some rollouts have several chains
    assert Counter(fed) == Counter(expected)


def test_a_seq_len_below_the_longest_row_names_the_rollout_and_its_length_and_never_truncates(output):
    trainable = _trainable(output)
    rid, tokens, *_ = max(trainable, key=lambda r: len(r[1]))
    seq_len = len(tokens) - 1
    with pytest.raises(ValueError, match=rf"rollout {rid} has {len(tokens)} tokens, the longest .* at least {len(tokens)}.*never truncated"):
        DataParallelFeed(output, 2, seq_len=seq_len, lines=2)
    feed = DataParallelFeed(output, 2, seq_len=seq_len, lines=2, too_long="skip")
    too_long = sorted(r[0] for r in trainable if len(r[1]) > seq_len)
    assert sorted(feed.skipped) == too_long
    fed = {row[0] for rank in range(2) for b in feed.batches(rank) for row in _fed(b)}
    assert fed == {r[0] for r in trainable} - set(too_long)


def test_a_pyarrow_table_feeds_like_its_output(output):
    seq_len = _seq_len(output)
    from_output = [b.rollout_ids for b in shard_batches(output, 1, 2, seq_len=seq_len, lines=2)]
    from_table = [b.rollout_ids for b in shard_batches(_output_rows(output), 1, 2, seq_len=seq_len, lines=2)]
    assert from_output == from_table


@pytest.mark.parametrize("seed", range(5))
def test_the_first_fit_plan_places_rows_as_the_packer_does(seed):
    lengths = np.random.default_rng(seed).integers(0, 50, size=200)
    packer = _Packer(64, pack=True, too_long="error")
    expected = []
    for i, length in enumerate(lengths.tolist()):
        row = _Row(str(i), np.zeros(length), np.zeros(length), np.zeros(length), 1.0)
        index = packer.fits(row)
        packer.place(row, index)
        expected.append(index)
    assert _first_fit(lengths, 64).tolist() == expected


def test_a_rank_outside_the_world_is_refused(output):
    feed = DataParallelFeed(output, 2, seq_len=_seq_len(output), lines=2)
    with pytest.raises(ValueError, match=r"rank must be in \[0, 2\), not 2"):
        list(feed.batches(2))


def _nearest_rank(sorted_lengths: list[int], q: float) -> int:
    import math

    return sorted_lengths[max(math.ceil(q / 100 * len(sorted_lengths)) - 1, 0)]


def test_the_summary_reports_token_length_percentiles_and_the_longest_row_to_pick_seq_len(output):
    import json

    from raycap.output.manifest import read_manifest
    from raycap.output.summary import ShardStats, summarize

    trainable = _trainable(output)
    lengths = sorted(len(r[1]) for r in trainable)
    rid, tokens, *_ = max(trainable, key=lambda r: len(r[1]))
    summary = summarize(read_manifest(output))  # read back from the manifest, not the rows
    t = summary.token_lengths
    assert (t.rows, t.max, t.longest_rollout) == (len(trainable), len(tokens), rid)
    assert (t.p50, t.p90, t.p99) == tuple(_nearest_rank(lengths, q) for q in (50, 90, 99))
    assert t.p50 < t.max  # the rows differ in length, so the percentiles say something
    text = summary.render()
    assert "token length" in text and f"p50 {t.p50:,}  p90 {t.p90:,}  p99 {t.p99:,}  max {t.max:,} (rollout {rid})" in text
    # A length picked from the summary feeds every row; one below it is refused.
    assert DataParallelFeed(output, 2, seq_len=t.max, lines=2).steps > 0
    with pytest.raises(ValueError, match=rf"rollout {rid} has {t.max} tokens"):
        DataParallelFeed(output, 2, seq_len=t.max - 1, lines=2)
    # Shards merge to the whole exactly, and the JSON keeps the lengths.
    table = _output_rows(output)
    whole = ShardStats.from_table(table)
    parts = ShardStats.merge(ShardStats.from_table(table.slice(i, 7)) for i in range(0, table.num_rows, 7))
    assert parts.token_lengths == whole.token_lengths == t
    assert ShardStats.from_json(json.loads(json.dumps(whole.to_json()))).token_lengths == t


README_MARKER = "<!-- runs: feeding-a-trainer -->"


@pytest.mark.slow  # a subprocess (a trainer killed at random, or a README program with its own Ray)
def test_the_readme_feeding_example_runs_as_written(tmp_path, ray_cluster):
    """The data-parallel and adapter blocks of docs/training.md, run as one script in a fresh process."""
    import os
    import re
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    text = (root / "docs" / "training.md").read_text(encoding="utf-8")
    blocks = re.findall(re.escape(README_MARKER) + r"\s*```python\n(.*?)```", text, flags=re.S)
    assert len(blocks) == 2 and text.count(README_MARKER) == 2
    script = tmp_path / "feeding.py"
    script.write_text("\n".join(blocks), encoding="utf-8")
    env = dict(os.environ, PYTHONPATH=str(root), RAY_USAGE_STATS_ENABLED="0")
    # Joins the session's test cluster, as a user's program would join theirs.
    env["RAY_ADDRESS"] = ray_cluster.address
    done = subprocess.run([sys.executable, str(script)], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    printed = eval(done.stdout.strip().splitlines()[-1])  # the example prints [(steps, padding lines), ...]
    assert len(printed) == 2 and printed[0][0] == printed[1][0] > 0


def test_every_rank_feeds_the_per_token_versions_of_a_versioned_step_dataset(tmp_path):
    from raycap import Stream, TokenCaptureStore, TokenEntry

    store = TokenCaptureStore(tmp_path / "captures")
    expected = {}
    for r in range(6):
        rid, prompt, versions = f"r{r}", [1, 2, 3], []
        for index in range(3):
            generation = [10 + index] * (1 + (r + index) % 3)
            version = None if (r, index) == (2, 1) else 10 * r + index
            extra = {} if version is None else {"policy_version": version}
            store.append(TokenEntry(rollout_id=rid, model_call_id=f"call-{index}", prompt_token_ids=prompt,
                                    generation_token_ids=generation, generation_log_probs=[-0.5] * len(generation),
                                    created_at=float(index), **extra))
            versions += [-1] * (len(prompt) - len(versions)) + [-1 if version is None else version] * len(generation)
            prompt = prompt + generation + [5]
        expected[rid] = versions
    with Stream([store.directory], executor="local", version_key="policy_version") as stream:
        stream.submit(list(expected))
        stream.commit(stream.take(6, timeout=30), output=tmp_path / "step-0")
    feed = DataParallelFeed(str(tmp_path / "step-0"), 2, seq_len=24, lines=2)
    fed = {}
    for rank in range(2):
        for batch in feed.batches(rank):
            assert batch.versions is not None and batch.versions.shape == batch.shape
            assert (batch.versions[batch.segment_ids == 0] == -1).all()  # padding, padding lines included
            for line, ids in enumerate(batch.rollout_ids):
                for segment, rid in enumerate(ids, start=1):
                    fed[rid] = batch.versions[line][batch.segment_ids[line] == segment].tolist()
    assert fed == expected


def test_a_feed_over_rows_without_versions_has_none(output):
    batch = next(DataParallelFeed(output, 2, seq_len=_seq_len(output), lines=2).batches(0))
    assert batch.versions is None


# --- token counts for a global loss normaliser, rewards, empty rows -------------------------------


@pytest.mark.parametrize("world_size", [2, 3])
def test_the_plans_step_token_counts_are_what_the_ranks_batches_hold(output, world_size):
    trainable = _trainable(output)
    feed = DataParallelFeed(output, world_size, seq_len=_seq_len(output), lines=2)
    per_rank = [list(feed.batches(rank)) for rank in range(world_size)]
    for step in range(feed.steps):
        batches = [per_rank[rank][step] for rank in range(world_size)]
        counted = feed.step_tokens(step)
        assert counted.trained == sum(b.trained_tokens for b in batches) > 0
        assert counted.total == sum(b.total_tokens for b in batches)
        # Every rank knows the step's counts without a collective.
        assert {(b.step_total_tokens, b.step_trained_tokens) for b in batches} == {(counted.total, counted.trained)}
    assert sum(feed.step_tokens(s).total for s in range(feed.steps)) == sum(len(r[1]) for r in trainable)
    assert sum(feed.step_tokens(s).trained for s in range(feed.steps)) == sum(sum(r[2]) for r in trainable)


def test_a_rank_of_only_padding_counts_zero_while_the_step_counts_the_others(output):
    seq_len = _seq_len(output)
    lines = DataParallelFeed(output, 1, seq_len=seq_len, lines=1).total_lines
    world = lines + 1
    feed = DataParallelFeed(output, world, seq_len=seq_len, lines=1)
    (idle,) = list(feed.batches(world - 1))
    (busy,) = list(feed.batches(0))
    assert idle.padding_lines == 1 and idle.trained_tokens == 0 and idle.total_tokens == 0
    assert idle.step_trained_tokens == busy.step_trained_tokens == feed.step_tokens(0).trained > 0
    # The per-rank mean is 0/0 on the idle rank; the step's normaliser keeps its loss at 0.
    token_loss = -idle.logprobs
    with np.errstate(invalid="ignore"):
        assert np.isnan((token_loss * idle.loss_mask).sum() / idle.loss_mask.sum())
    assert (token_loss * idle.loss_weights).sum() * world / idle.step_trained_tokens == 0.0


def test_step_tokens_takes_a_step_of_the_plan(output):
    feed = DataParallelFeed(output, 2, seq_len=_seq_len(output), lines=2)
    with pytest.raises(ValueError, match=rf"step must be in \[0, {feed.steps}\), not {feed.steps}"):
        feed.step_tokens(feed.steps)
    with pytest.raises(TypeError, match="step must be an int"):
        feed.step_tokens(1.0)


def test_every_rank_feeds_each_rows_reward_and_its_tasks_group(output):
    table = _output_rows(output)
    n = table.num_rows
    ids = table.column("rollout_id").to_pylist()
    rewards = [None if i % 7 == 3 else i / 4 for i in range(n)]
    tasks = [None if i % 5 == 0 else i // 4 for i in range(n)]
    rows = with_columns(table, reward=pa.array(rewards, pa.float64()), task_index=pa.array(tasks, pa.int64()))
    feed = DataParallelFeed(rows, 2, seq_len=_seq_len(output), lines=2)
    fed = {}
    for rank in range(2):
        for batch in feed.batches(rank):
            assert len(batch.rewards) == len(batch.groups) == len(batch.rollout_ids)
            for line, rids in enumerate(batch.rollout_ids):
                assert len(batch.rewards[line]) == len(batch.groups[line]) == len(rids)
                fed.update({rid: (batch.rewards[line][k], batch.groups[line][k]) for k, rid in enumerate(rids)})
    assert set(fed) == {r[0] for r in _trainable(output)}
    at = {rid: i for i, rid in enumerate(ids)}
    for rid, (reward, group) in fed.items():
        i = at[rid]
        assert reward == rewards[i]
        if tasks[i] is None:
            assert group.startswith(f"rollout:{rid}:")  # a group of its own
        else:
            assert group == f"task:{tasks[i]}"  # the same on every rank
    own = [g for g in (group for _, group in fed.values()) if g.startswith("rollout:")]
    assert len(own) == len(set(own)) > 0


def test_a_row_with_an_empty_token_list_is_never_fed_by_any_rank_and_is_named(output):
    table = _output_rows(output)
    empty = table.slice(0, 1).to_pylist()[0]
    empty.update(rollout_id="hollow", mask_sample=False, token_ids=[], loss_mask=[], logprobs=[])
    rows = pa.concat_tables([table, pa.Table.from_pylist([empty], schema=table.schema)])
    feed = DataParallelFeed(rows, 2, seq_len=_seq_len(output), lines=2)
    assert feed.empty_rows == ["hollow"]
    fed = [rid for rank in range(2) for b in feed.batches(rank) for ids in b.rollout_ids for rid in ids]
    assert "hollow" not in fed and sorted(fed) == sorted(r[0] for r in _trainable(output))
    assert [next(feed.batches(rank)).empty_rows for rank in range(2)] == [["hollow"], ["hollow"]]


def test_a_feed_gives_each_step_s_figures_as_a_flat_dict_equal_to_what_its_batches_hold(output):
    seq_len = _seq_len(output)
    feed = DataParallelFeed(output, 2, seq_len=seq_len, lines=2)
    per_rank = [list(feed.batches(rank)) for rank in range(2)]
    for step in range(feed.steps):
        figures = feed.metrics(step)
        attended = sum(int(batches[step].attention_mask.sum()) for batches in per_rank)
        trained = sum(int(batches[step].loss_mask.sum()) for batches in per_rank)
        assert figures["raycap/step_tokens"] == attended and figures["raycap/step_trained_tokens"] == trained
        assert figures["raycap/token_fill"] == attended / (2 * 2 * seq_len)
        assert figures["raycap/steps"] == feed.steps and figures["raycap/rows_skipped"] == 0
