"""Distributed correctness: rows over split directories, containment of one bad rollout,
and the Rebuilder session (issue-level contracts of SPEC section 6).

- The rows over N directories equal the rows over the merged directory, in both
  deliveries, whatever mix of holder sets a batch has.
- A rollout whose ids are valid records but do not fit int64 masks only itself.
- A Rebuilder keeps its placement and actors; a call with explicit ids neither lists nor
  stats the directories; the local executor gives the rows Ray gives.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import tempfile
from pathlib import Path
from unittest import mock

import pyarrow as pa
import pyarrow.compute as pc
import pytest
import ray
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import raycap
from conftest import write_entries
from raycap.capture.records import TokenEntry
from raycap.capture.store import TokenCaptureStore
from raycap.cluster.nodes import fleet as fleet_module
from raycap.cluster.plumbing.connect import SessionCache
from raycap.cluster.rebuild import session as cluster
from raycap.cluster.rebuild.cold import ColdPlan
from raycap.cluster.rebuild.scheduler import BatchScheduler
from raycap.rows.local import FreezeAhead
from strategies import rollout_with_id

# Columns that name where and when a rollout was frozen, not what it built.
_IDENTITY = ("capture_dirs", "snapshot_id", "snapshot_version", "snapshots")


def _content(table: pa.Table) -> list[dict]:
    return table.drop_columns(list(_IDENTITY)).to_pylist()


@st.composite
def _split_corpus(draw):
    """(rollouts: {id: entries}, assignment: {(id, call): directory index}, n_dirs)."""
    n_rollouts = draw(st.integers(1, 7))
    rollouts = {f"r{i}": draw(rollout_with_id(f"r{i}", max_calls=6)) for i in range(n_rollouts)}
    n_dirs = draw(st.integers(1, 3))
    assignment = {}
    for rid, entries in rollouts.items():
        # Some rollouts live in one directory, others are spread call by call.
        whole = draw(st.one_of(st.none(), st.integers(0, n_dirs - 1)))
        for entry in entries:
            where = whole if whole is not None else draw(st.integers(0, n_dirs - 1))
            assignment[(rid, entry.model_call_id)] = where
    return rollouts, assignment, n_dirs


def _batches_path(path: str):
    """Builder tasks freeze their own batches (directories on one node) or get the
    actors' freezes, frozen ahead (directories on several nodes): force the second on
    one node."""
    if path == "direct":
        return contextlib.nullcontext()
    return mock.patch.object(BatchScheduler, "_direct_batches", lambda self: False)


@pytest.mark.parametrize("path", ["direct", "ahead"])
@pytest.mark.parametrize("delivery", ["rollout", "chains"])
@settings(max_examples=4, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(corpus=_split_corpus(), batch_size=st.sampled_from([None, 1, 2, 3]), data=st.data())
def test_rows_over_split_directories_equal_rows_over_the_merged_directory(
    ray_shared, delivery, path, corpus, batch_size, data
):
    rollouts, assignment, n_dirs = corpus
    with tempfile.TemporaryDirectory() as root, _batches_path(path):
        root = Path(root)
        merged = write_entries(root / "merged", [e for entries in rollouts.values() for e in entries])
        parts = [root / f"part{k}" for k in range(n_dirs)]
        for k, part in enumerate(parts):
            TokenCaptureStore(part)
            write_entries(part, [e for rid, es in rollouts.items() for e in es if assignment[(rid, e.model_call_id)] == k])
        split = [str(p) for p in parts]

        listed = raycap.rebuild(split, delivery=delivery, batch_size=batch_size, executor="ray")
        want = raycap.rebuild([merged], delivery=delivery, batch_size=batch_size, executor="local")
        assert _content(listed) == _content(want)

        ids = data.draw(st.permutations(sorted(rollouts)))
        explicit = raycap.rebuild(split, ids, delivery=delivery, batch_size=batch_size, executor="ray")
        assert _content(explicit) == _content(
            raycap.rebuild([merged], ids, delivery=delivery, batch_size=batch_size, executor="ray")
        )
        # Every part of every rollout is in its row, so retirement drops all of them.
        for row in explicit.select(["rollout_id", "snapshots"]).to_pylist():
            holders = {split[assignment[(row["rollout_id"], e.model_call_id)]] for e in rollouts[row["rollout_id"]]}
            assert {s["capture_dir"] for s in row["snapshots"]} == holders


def _alternating(tmp_path, spec, one_call_every: int) -> tuple[TokenCaptureStore, list[str]]:
    """The rollouts of a generated corpus written twice: whole into a merged directory,
    and call by call alternating between two nodes' directories (every
    `one_call_every`-th rollout cut to one call, so only the first directory has it)."""
    from raycap.cli.synth import generate_corpus

    source = tmp_path / "source"
    generate_corpus(source, spec)
    merged, n1, n2 = (TokenCaptureStore(tmp_path / name) for name in ("merged", "n1", "n2"))
    for index, rid in enumerate(TokenCaptureStore(source).rollout_ids()):
        try:
            entries = sorted(TokenCaptureStore(source).freeze_now(rid).entries, key=lambda e: e.created_at)
        except (ValueError, RuntimeError):
            continue  # a corrupt or retired capture shape: no records to copy
        if index % one_call_every == 0:
            entries = entries[:1]
        for i, entry in enumerate(entries):
            merged.append(entry)
            (n1 if i % 2 == 0 else n2).append(entry)
    return merged, [str(n1.directory), str(n2.directory)]


@pytest.mark.parametrize("path", ["direct", "ahead"])
def test_alternating_directories_lose_no_chain_row(ray_shared, tmp_path, path):
    """The reported case: calls alternate between two nodes' directories, one-call
    rollouts exist only in the first, and batches mix both holder sets."""
    from raycap.cli.synth import CorpusSpec

    merged, dirs = _alternating(tmp_path, CorpusSpec(rollouts=30, seed=5, fault_share=0.3, turns=(4, 6)), 3)
    for delivery in ("chains", "rollout"):
        with _batches_path(path):
            got = raycap.rebuild(dirs, delivery=delivery, batch_size=4, executor="ray")
        want = raycap.rebuild([str(merged.directory)], delivery=delivery, batch_size=4, executor="ray")
        assert got.num_rows == want.num_rows
        assert _content(got) == _content(want)


# --- containment ---------------------------------------------------------------------------


def _poison_entry(rollout_id: str) -> TokenEntry:
    return TokenEntry(
        rollout_id=rollout_id,
        model_call_id="c0",
        prompt_token_ids=[1, 2**63 + 5, 3],
        generation_token_ids=[4, 5],
        generation_log_probs=[-0.5, -0.25],
    )


def _clean(directory: Path, count: int, seed: int) -> list[str]:
    from raycap.cli.synth import CorpusSpec, generate_corpus

    generate_corpus(directory, CorpusSpec(rollouts=count, seed=seed, fault_share=0.0, turns=(4, 5), system_tokens=(20, 60), generation_tokens=(1, 20), tool_tokens=(1, 20)))
    return TokenCaptureStore(directory).rollout_ids()


# Both deliveries on the local executor, and one Ray case: the Ray rows of the rollout
# delivery equal the local ones row for row (test_local_and_ray_executors_give_identical_rows),
# and what is Ray's own, a batch built in a task, is the same for both deliveries.
@pytest.mark.parametrize(
    "executor, delivery", [("local", "rollout"), ("local", "chains"), pytest.param("ray", "chains", marks=pytest.mark.slow)]
)
def test_a_rollout_whose_ids_do_not_fit_int64_masks_only_itself(request, tmp_path, delivery, executor):
    if executor == "ray":
        request.getfixturevalue("ray_shared")
    directory = tmp_path / "d"
    clean = _clean(directory, 6, seed=31)
    TokenCaptureStore(directory).append(_poison_entry("poison"))
    ids = clean[:3] + ["poison"] + clean[3:]

    table = raycap.rebuild([str(directory)], ids, delivery=delivery, batch_size=len(ids), executor=executor)

    rows = table.to_pylist()
    (poison,) = [r for r in rows if r["rollout_id"] == "poison"]
    assert poison["mask_sample"] is True
    assert poison["error"].startswith("OverflowError") and "int64" in poison["error"]
    assert poison["snapshots"], "a masked row keeps its snapshot identity as evidence"
    for rid in clean:
        alone = raycap.rebuild([str(directory)], [rid], delivery=delivery, executor=executor)
        mine = table.filter(pc.equal(table.column("rollout_id"), rid))
        assert mine.equals(alone), rid
    # The single-rollout API builds it, as the reference reader does.
    build = raycap.trajectories_for_rollout("poison", [str(directory)])
    assert build["mask_sample"] is False and build.get("error") is None


# --- the session ------------------------------------------------------------------------------


def test_local_and_ray_executors_give_identical_rows(ray_shared, corpus_copy):
    directory = corpus_copy("d")
    for delivery in ("rollout", "chains"):
        on_ray = raycap.rebuild([directory], delivery=delivery, executor="ray")
        local = raycap.rebuild([directory], delivery=delivery, executor="local")
        assert on_ray.equals(local)  # the same snapshots: freezing is idempotent
        # Many batches: each is frozen on a thread while the one before it builds.
        assert raycap.rebuild([directory], delivery=delivery, executor="local", batch_size=2).equals(local)


def test_freezing_ahead_hands_out_only_the_batch_asked_for(tmp_path):
    directory = tmp_path / "d"
    ids = _clean(directory, 6, seed=43)
    ahead = FreezeAhead([str(directory)], None)
    try:
        ahead.start(1, ids[2:4])
        first = ahead.take(0, ids[:2])  # not the batch frozen ahead: frozen now
        ahead.start(2, ids[4:])
        third = ahead.take(2, ids[4:])
    finally:
        ahead.close()
    assert [part.rollout_id for part in first[0]] == ids[:2]
    assert [part.rollout_id for part in third[0]] == ids[4:]
    assert all('"frozen": true' in TokenCaptureStore(directory).paths(rid).state.read_text() for rid in ids)


def _broken_cold_sources(monkeypatch) -> None:
    """Cold tasks get a directory that does not exist, so each one fails as a whole."""
    init = ColdPlan.__init__

    def broken(self, *args, **kwargs):
        init(self, *args, **kwargs)
        self.sources = [dataclasses.replace(s, path=s.path + "-gone") for s in self.sources]

    monkeypatch.setattr(ColdPlan, "__init__", broken)


def test_a_cold_calls_failed_task_is_built_by_the_driver(ray_shared, corpus_copy, monkeypatch, caplog):
    directory = corpus_copy("d")
    monkeypatch.setattr(fleet_module, "_KEPT", SessionCache())
    _broken_cold_sources(monkeypatch)
    rebuilder = raycap.Rebuilder([directory], batch_size=2)
    with caplog.at_level(logging.DEBUG, logger="raycap.cluster.rebuild.cold"):
        table = rebuilder.rebuild()
    assert rebuilder.last_executor.cold
    assert "cold builder task for batch" in caplog.text, "no cold task ran and failed"
    assert table.equals(raycap.rebuild([directory], executor="local"))


def test_a_cold_call_that_cannot_send_tasks_builds_everything_here(ray_shared, corpus_copy, monkeypatch):
    directory = corpus_copy("d")
    monkeypatch.setattr(fleet_module, "_KEPT", SessionCache())

    def refuse(self):
        raise RuntimeError("the scheduler is gone")

    monkeypatch.setattr(ColdPlan, "submit", refuse)
    rebuilder = raycap.Rebuilder([directory], batch_size=2)
    table = rebuilder.rebuild()
    assert rebuilder.last_executor.cold
    assert table.equals(raycap.rebuild([directory], executor="local"))


def test_auto_builds_the_first_call_on_a_ray_alongside_its_workers_then_uses_ray(ray_shared, corpus_copy, monkeypatch):
    directory = corpus_copy("d")
    monkeypatch.setattr(fleet_module, "_KEPT", SessionCache())  # as for a driver that has not built on this Ray yet
    rebuilder = raycap.Rebuilder([directory])
    first = rebuilder.rebuild()
    assert rebuilder.last_executor.cold and "first call on this Ray" in rebuilder.last_executor.reason
    rebuilder._warming.join(timeout=120)
    second = rebuilder.rebuild()
    assert rebuilder.last_executor.executor == "ray"
    assert second.equals(first)  # freezing is idempotent: the same rows and snapshots


def test_auto_builds_small_inputs_in_process_when_no_ray_runs(corpus_copy):
    directory = corpus_copy("d")
    ray.shutdown()
    rebuilder = raycap.Rebuilder([directory])
    table = rebuilder.rebuild()
    assert not ray.is_initialized(), "a small input must not start Ray"
    assert rebuilder.last_executor.executor == "local" and "MB of captures" in rebuilder.last_executor.reason
    assert table.num_rows == len(TokenCaptureStore(directory).rollout_ids())


def test_a_rebuilder_keeps_its_placement_and_explicit_ids_touch_only_them(ray_shared, tmp_path, monkeypatch):
    directory = tmp_path / "d"
    ids = _clean(directory, 12, seed=41)
    rebuilder = raycap.Rebuilder([str(directory)], executor="ray")
    rebuilder.rebuild(ids[:2])
    placed = rebuilder._fleet

    def refuse(*args, **kwargs):
        raise AssertionError("placement again")

    monkeypatch.setattr(fleet_module, "locate", refuse)
    monkeypatch.setattr(cluster, "fleet", refuse)
    table = rebuilder.rebuild(ids[5:9])
    assert rebuilder._fleet is placed
    assert table.column("rollout_id").to_pylist() == ids[5:9]
    # Nothing but the asked-for rollouts was frozen.
    frozen = {rid for rid in ids if '"frozen": true' in TokenCaptureStore(directory).paths(rid).state.read_text()}
    assert frozen == set(ids[:2]) | set(ids[5:9])


def test_rebuild_async_returns_the_table_or_refs(ray_shared, corpus_copy):
    directory = corpus_copy("d")
    rebuilder = raycap.Rebuilder([directory], executor="ray")
    ids = TokenCaptureStore(directory).rollout_ids()[:10]
    want = rebuilder.rebuild(ids)

    async def step():
        table = await rebuilder.rebuild_async(ids)
        refs = await rebuilder.rebuild_async(ids, refs=True)
        return table, refs

    table, refs = asyncio.run(step())
    assert table.equals(want)
    assert all(isinstance(ref, ray.ObjectRef) for ref in refs)
    assert pa.concat_tables(ray.get(refs)).equals(want)


def test_explicit_ids_over_several_directories_freeze_nothing_where_they_are_not(ray_shared, tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    in_a = _clean(a, 3, seed=51)
    TokenCaptureStore(b)
    rebuilder = raycap.Rebuilder([str(a), str(b)], executor="ray")
    table = rebuilder.rebuild(in_a + ["nowhere"])
    assert table.column("rollout_id").to_pylist() == in_a + ["nowhere"]
    assert TokenCaptureStore(b).rollout_ids() == []  # b held none of them: untouched
    nowhere = table.to_pylist()[-1]
    assert nowhere["error"] == "capture contains no token records"
    assert nowhere["capture_dirs"] == [str(a)]


@pytest.mark.slow
def test_the_chain_job_over_two_directories_writes_every_chain_and_retires_whole_rollouts(tmp_path, capsys):
    """The job with chain delivery over two nodes' directories (calls alternating
    between them) and retire: true: the committed rows equal those of the merged
    directory, and a rollout is retired in both directories iff all its chains are
    unmasked; masked rollouts keep their evidence in both.

    On the local executor. On Ray the same rows are checked by
    test_alternating_directories_lose_no_chain_row (chain rows over alternating
    directories, both batch paths), the job's chain delivery with whole-rollout
    retirement by system/test_jobs' test_chain_delivery_job_writes_one_row_per_chain_and_retires_whole_rollouts_only,
    and retirement from every directory of a split rollout by cluster/test_actor's
    test_a_rollout_split_over_two_directories_is_built_from_both."""
    executor = "local"
    import json

    import pyarrow.parquet as pq
    import yaml

    from raycap.cli import rebuild as rebuild_job
    from raycap.cli.synth import CorpusSpec

    # Fault shapes give masked rollouts and several chains per rollout.
    small = dict(system_tokens=(20, 60), generation_tokens=(1, 20), tool_tokens=(1, 20))
    merged, dirs = _alternating(tmp_path, CorpusSpec(rollouts=20, seed=8, fault_share=0.6, turns=(4, 7), **small), 4)
    want = raycap.rebuild([str(merged.directory)], delivery="chains", executor="local")

    config = tmp_path / "job.yaml"
    config.write_text(yaml.safe_dump({
        "capture_dirs": dirs, "output": str(tmp_path / "rows"), "delivery": "chains", "retire": True,
        "batch_size": 3, "executor": executor,
    }))
    assert rebuild_job.main(["--config", str(config)]) == 0, capsys.readouterr().err
    got = pq.read_table(tmp_path / "rows")
    assert got.num_rows == want.num_rows
    assert _content(got) == _content(want)

    verdicts: dict[str, bool] = {}
    for row in got.select(["rollout_id", "mask_sample"]).to_pylist():
        verdicts[row["rollout_id"]] = verdicts.get(row["rollout_id"], True) and not row["mask_sample"]
    for directory in dirs:
        store = TokenCaptureStore(directory)
        for rid in store.rollout_ids():
            state = json.loads(store.paths(rid).state.read_text())
            assert state["retired"] is verdicts[rid], (directory, rid)
            assert store.paths(rid).jsonl.exists() is not verdicts[rid]
    assert not all(verdicts.values()) and any(verdicts.values())


@pytest.mark.slow
def test_a_small_rebuild_with_no_ray_running_does_not_import_ray(corpus_copy):
    """A fresh process that rebuilds a small input pays neither for starting Ray nor
    for loading it."""
    import subprocess
    import sys

    directory = corpus_copy("d")
    script = (
        "import sys, raycap; t = raycap.rebuild([sys.argv[1]]); "
        "print(t.num_rows, 'ray' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", script, directory], capture_output=True, text=True, check=True)
    rows, imported = out.stdout.split()
    assert int(rows) == len(TokenCaptureStore(directory).rollout_ids()) and imported == "False"


def test_a_missing_directory_fails_at_once_without_starting_ray(tmp_path):
    ray.shutdown()
    with pytest.raises(FileNotFoundError, match="does not exist on this machine"):
        raycap.rebuild([str(tmp_path / "nowhere")])
    with pytest.raises(FileNotFoundError, match="does not exist on this machine"):
        raycap.Rebuilder([str(tmp_path / "nowhere")]).rebuild()
    assert not ray.is_initialized()
