"""Misuse and faulty machines: what a hostile caller or a failing disk must never get
past the front door (raycap.rebuild, Rebuilder, rebuild_to_output, raycap.retire) or
the jobs. Run in this process (executor "local") except where the Ray executor is the
point."""

from __future__ import annotations

import errno
import json
import os
import random
import shutil
import subprocess
import sys
from pathlib import Path

import pyarrow.parquet as pq
import pytest
import yaml

import raycap
from raycap.capture.records import TokenEntry
from raycap.capture.store import TokenCaptureStore
from raycap.cli import rebuild as rebuild_job
from raycap.output.commit import rejected_path, staging_path, summary_path
from raycap.output.faults import OutputError
from raycap.output.manifest import RETIRE_MARKER_NAME
from raycap.runs.handoff import rebuild_to_output

GOOD = ["r1", "r2", "r3", "r4"]
BROKEN = "r5"  # its call left only begin_call: a masked row


def small_corpus(directory: Path) -> str:
    store = TokenCaptureStore(str(directory))
    for rid in GOOD:
        store.append(
            TokenEntry(rollout_id=rid, model_call_id="c1", prompt_token_ids=[1, 2], generation_token_ids=[3, 4],
                       generation_log_probs=[-0.5, -0.25])
        )
    store.begin_call_now(BROKEN, "c1")
    return str(directory)


def state(directory: str, rid: str) -> dict:
    path = Path(directory) / f"{rid}.tokens.state.json"
    return json.loads(path.read_text()) if path.exists() else {}


def unmasked_rows_anywhere(root: Path) -> set[str]:
    """Rollout ids with an unmasked row in any Parquet file under `root`."""
    found: set[str] = set()
    for shard in root.rglob("*.parquet"):
        for row in pq.read_table(shard, columns=["rollout_id", "mask_sample"]).to_pylist():
            if row["mask_sample"] is False:
                found.add(row["rollout_id"])
    return found


def files_under(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def job(tmp_path: Path, name: str, capsys, **keys) -> tuple[int, str, str]:
    config = tmp_path / f"{name}.yaml"
    config.write_text(yaml.safe_dump(keys, sort_keys=False))
    code = rebuild_job.main(["--config", str(config)])
    out, err = capsys.readouterr()
    return code, out, err


# --- retirement only from a committed output ----------------------------------------------------


def test_retire_then_two_rejected_reruns_keep_a_row_or_a_capture_of_every_good_rollout(tmp_path, capsys):
    captures = small_corpus(tmp_path / "caps")
    keys = dict(capture_dirs=[captures], output="out/rows", model="m", executor="local",
                rollout_ids=GOOD + [BROKEN])
    code, _, err = job(tmp_path, "first", capsys, retire=False, **keys)
    assert code == 0, err
    output = tmp_path / "out" / "rows"

    report = raycap.retire([captures], output)
    assert report.dropped == len(GOOD)
    marker = json.loads((output / RETIRE_MARKER_NAME).read_text())
    assert marker["state"] == "finished" and marker["dropped"] == len(GOOD)

    gate = dict(retire=True, max_mask_fraction=0.1, mask_fraction_min_samples=1)
    for attempt in ("second", "third"):
        code, _, err = job(tmp_path, attempt, capsys, **gate, **keys)
        assert code == 3, err
        assert "captures are kept" not in err
        summary = json.loads(summary_path(rejected_path(output)).read_text())
        assert "captures are kept" not in summary["retire_skipped"]

    retired = {rid for rid in GOOD if state(captures, rid).get("retired")}
    with_capture = set(GOOD) - retired
    assert with_capture | unmasked_rows_anywhere(tmp_path / "out") >= set(GOOD)
    # The rows are still where the first rejection put them, beside a later one.
    assert unmasked_rows_anywhere(tmp_path / "out") >= retired


def test_retire_refuses_a_staging_copy_and_drops_nothing(tmp_path):
    captures = small_corpus(tmp_path / "caps")
    output = tmp_path / "rows"
    assert rebuild_to_output([captures], output, GOOD, model="m", executor="local").ok
    copy = staging_path(output)
    shutil.copytree(output, copy)
    before = files_under(tmp_path / "caps")
    with pytest.raises(OutputError, match=r"not a committed output.*nothing was retired"):
        raycap.retire([captures], copy)
    assert files_under(tmp_path / "caps") == before
    assert not (copy / RETIRE_MARKER_NAME).exists()


def test_a_retired_dataset_left_in_a_staging_directory_is_moved_aside_not_deleted(tmp_path):
    captures = small_corpus(tmp_path / "caps")
    output = tmp_path / "rows"
    assert rebuild_to_output([captures], output, GOOD, model="m", executor="local", retire=True).ok
    shutil.copytree(output, staging_path(output))
    shutil.rmtree(output)
    assert rebuild_to_output([captures], output, GOOD, model="m", executor="local").ok
    kept = [p for p in tmp_path.iterdir() if p.name.startswith(staging_path(output).name + ".retired-superseded-")]
    assert len(kept) == 1 and unmasked_rows_anywhere(kept[0]) == set(GOOD)


@pytest.mark.parametrize("where", ["rows.rejected", "elsewhere/rows", "rows-renamed"])
def test_retire_refuses_a_set_aside_copied_or_renamed_output(tmp_path, where):
    captures = small_corpus(tmp_path / "caps")
    output = tmp_path / "rows"
    assert rebuild_to_output([captures], output, GOOD, model="m", executor="local").ok
    moved = tmp_path / where
    moved.parent.mkdir(parents=True, exist_ok=True)
    if where == "rows-renamed":
        output.rename(moved)
    else:
        shutil.copytree(output, moved)
    before = files_under(tmp_path / "caps")
    with pytest.raises(OutputError, match="committed as"):
        raycap.retire([captures], moved)
    assert files_under(tmp_path / "caps") == before


def test_retire_accepts_the_committed_output_through_a_symlink(tmp_path):
    captures = small_corpus(tmp_path / "caps")
    output = tmp_path / "rows"
    assert rebuild_to_output([captures], output, GOOD, model="m", executor="local").ok
    link = tmp_path / "link"
    link.symlink_to(output)
    assert raycap.retire([captures], link).dropped == len(GOOD)
    assert json.loads((output / RETIRE_MARKER_NAME).read_text())["state"] == "finished"


def test_retire_writes_its_marker_before_the_first_drop(tmp_path):
    captures = small_corpus(tmp_path / "caps")
    output = tmp_path / "rows"
    assert rebuild_to_output([captures], output, GOOD, model="m", executor="local").ok
    seen = []
    raycap.retire([captures], output, on_shard=lambda shard, report: seen.append(
        json.loads((output / RETIRE_MARKER_NAME).read_text())["state"]))
    assert seen and seen[0] == "started"


# --- environmental faults fail the run --------------------------------------------------------


def test_disk_full_at_a_shard_write_fails_the_job_with_one_line_and_commits_nothing(tmp_path, capsys, monkeypatch):
    captures = small_corpus(tmp_path / "caps")
    import pyarrow.parquet as pq

    real = pq.write_table

    def full(table, where, **kwargs):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(pq, "write_table", full)
    keys = dict(capture_dirs=[captures], output="out/rows", model="m", executor="local", retire=True, rollout_ids=GOOD)
    code, _, err = job(tmp_path, "full", capsys, **keys)
    lines = [line for line in err.splitlines() if line.strip()]
    assert code == 1 and len(lines) == 1 and "Traceback" not in err
    assert "No space left on device" in lines[0] and "out/rows" in lines[0] and "rerun" in lines[0]
    output = tmp_path / "out" / "rows"
    assert not output.exists() and not staging_path(output).exists()
    assert not any(state(captures, rid).get("retired") for rid in GOOD)

    monkeypatch.setattr(pq, "write_table", real)
    code, _, err = job(tmp_path, "cleared", capsys, **keys)
    assert code == 0, err
    assert unmasked_rows_anywhere(output) == set(GOOD)


def test_a_row_of_one_rollouts_own_capture_error_stays_a_masked_row(tmp_path):
    captures = small_corpus(tmp_path / "caps")
    (Path(captures) / "r9.tokens.jsonl").write_text("not json\n")
    outcome = rebuild_to_output([captures], tmp_path / "rows", GOOD + ["r9"], model="m", executor="local")
    assert outcome.ok
    rows = {r["rollout_id"]: r for r in pq.read_table(tmp_path / "rows").to_pylist()}
    assert rows["r9"]["mask_sample"] is True and rows["r9"]["error"]


def test_a_shard_write_failing_in_a_ray_builder_task_fails_the_job_not_a_masked_row(fresh_ray, tmp_path, capsys):
    def full_disk_in_workers():
        # Only the builder tasks' shard writes fail, as on a node whose output disk is full:
        # the driver, which would write the masked rows of a failed batch, is untouched.
        # (Defined here so that Ray ships it by value: the workers cannot import this module.)
        import errno

        import pyarrow.parquet as pq

        def full(table, where, **kwargs):
            raise OSError(errno.ENOSPC, "No space left on device")

        pq.write_table = full

    # A new Ray job on the shared cluster whose worker processes run the hook: no Ray start of its own.
    fresh_ray({"worker_process_setup_hook": full_disk_in_workers})
    captures = small_corpus(tmp_path / "caps")
    output = tmp_path / "rows"
    code, _, err = job(tmp_path, "job", capsys, capture_dirs=[captures], output=str(output), model="m",
                       executor="ray", retire=True, rollout_ids=GOOD)
    own = [line for line in err.splitlines() if line.startswith("jobs.rebuild:")]
    assert code == 1, err
    assert len(own) == 1 and "No space left on device" in own[0] and str(output) in own[0]
    assert not output.exists() and not staging_path(output).exists()
    assert not any(state(captures, rid).get("retired") for rid in GOOD)


@pytest.fixture
def tiny_disk(tmp_path):
    """A 1 MiB tmpfs, or skip when this machine cannot mount one."""
    mount = tmp_path / "disk"
    mount.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mount)], capture_output=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.decode().strip()}")
    try:
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], capture_output=True)


def fill(directory: Path, room: int = 8192) -> None:
    """Fill the file system of `directory` but for `room` bytes: the lock and probe
    files still fit, a shard does not."""
    fd = os.open(directory / "filler", os.O_WRONLY | os.O_CREAT)
    try:
        size = 0
        while True:
            try:
                size += os.write(fd, b"\0" * 4096)
            except OSError:
                break
        os.ftruncate(fd, max(0, size - room))
    finally:
        os.close(fd)


def bigger_corpus(directory: Path, n: int = 40) -> tuple[str, list[str]]:
    store = TokenCaptureStore(str(directory))
    ids = [f"b{i:03d}" for i in range(n)]
    rng = random.Random(7)  # incompressible tokens: every shard is bigger than the room left
    for rid in ids:
        store.append(
            TokenEntry(rollout_id=rid, model_call_id="c1", prompt_token_ids=[rng.randrange(50000) for _ in range(300)],
                       generation_token_ids=[rng.randrange(50000) for _ in range(300)],
                       generation_log_probs=[-rng.random() for _ in range(300)])
        )
    return str(directory), ids


JOB_SCRIPT = """
import sys
from raycap.cli import rebuild
sys.exit(rebuild.main(sys.argv[1:]))
"""


@pytest.mark.slow  # a job subprocess on a filled tmpfs; the in-process disk-full test above stays fast
@pytest.mark.parametrize("executor", ["local", "ray"])
def test_a_full_file_system_fails_the_job_on_both_executors_and_a_rerun_builds(
    executor, request, tiny_disk, tmp_path, capsys
):
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    env.pop("RAY_ADDRESS", None)
    if executor == "ray":
        # The job joins the shared cluster, as a submitted job joins its own (no Ray start in
        # it); the rerun below runs in this process, connected to the same cluster.
        import ray

        request.getfixturevalue("ray_shared")
        env["RAY_ADDRESS"] = ray.get_runtime_context().gcs_address
    captures, ids = bigger_corpus(tmp_path / "caps")
    fill(tiny_disk)
    config = tmp_path / "job.yaml"
    config.write_text(yaml.safe_dump(dict(
        capture_dirs=[captures], output=str(tiny_disk / "rows"), model="m", executor=executor, retire=True,
        rollout_ids=ids, batch_size=10,
    )))
    run = subprocess.run([sys.executable, "-c", JOB_SCRIPT, "--config", str(config)], capture_output=True,
                         text=True, env=env, timeout=240)
    own = [line for line in run.stderr.splitlines() if line.startswith("jobs.rebuild:")]
    assert run.returncode == 1, run.stderr
    assert len(own) == 1 and "No space left on device" in own[0] and str(tiny_disk) in own[0]
    assert "Traceback" not in run.stderr
    assert not (tiny_disk / "rows").exists()
    assert not any(state(captures, rid).get("retired") for rid in ids)

    (tiny_disk / "filler").unlink()
    # The rerun needs no fresh process: what it must get past is what the failed run left on disk.
    code = rebuild_job.main(["--config", str(config)])
    assert code == 0, capsys.readouterr().err
    assert unmasked_rows_anywhere(tiny_disk / "rows") == set(ids)


# --- the API boundary ------------------------------------------------------------------------


@pytest.mark.parametrize("ids", ["r1", b"r1"])
def test_ids_given_as_one_string_raise_type_error_and_touch_nothing(tmp_path, ids):
    captures = small_corpus(tmp_path / "caps")
    before = files_under(tmp_path)
    with pytest.raises(TypeError, match="wrap a single id in a list"):
        raycap.rebuild([captures], ids, executor="local")
    with pytest.raises(TypeError, match="wrap a single id in a list"):
        rebuild_to_output([captures], tmp_path / "rows", ids, executor="local")
    with pytest.raises(TypeError, match="wrap a single id in a list"):
        raycap.Rebuilder([captures], executor="local").rebuild(ids)
    assert files_under(tmp_path) == before


@pytest.mark.parametrize(
    "call",
    [
        lambda c, o: raycap.rebuild([], ["r1"], executor="local"),
        lambda c, o: rebuild_to_output([], o, ["r1"], executor="local"),
        lambda c, o: raycap.retire([], o),
        lambda c, o: raycap.Rebuilder([], executor="local"),
        lambda c, o: raycap.rebuild([c], ["r1"], executor="local", batch_size=0),
        lambda c, o: raycap.rebuild([c], ["r1"], executor="local", batch_size=-1),
        lambda c, o: rebuild_to_output([c], o, ["r1"], executor="local", batch_size=-1),
        lambda c, o: rebuild_to_output([c], o, ["r1"], executor="local", max_in_flight=0),
        lambda c, o: raycap.Rebuilder([c], executor="local", max_in_flight=0),
        lambda c, o: raycap.rebuild([c], ["r1", "r2", "r1"], executor="local"),
        lambda c, o: rebuild_to_output([c], o, ["r1", "r1"], executor="local"),
    ],
    ids=["rebuild-no-dirs", "output-no-dirs", "retire-no-dirs", "rebuilder-no-dirs", "batch-0", "batch-neg",
         "output-batch-neg", "output-in-flight-0", "rebuilder-in-flight-0", "rebuild-dup-ids", "output-dup-ids"],
)
def test_bad_arguments_raise_value_error_before_anything_is_written(tmp_path, call):
    captures = small_corpus(tmp_path / "caps")
    output = tmp_path / "rows"
    before = files_under(tmp_path)
    with pytest.raises(ValueError):
        call(captures, output)
    assert files_under(tmp_path) == before and not output.exists()


def test_duplicate_ids_are_refused_naming_them(tmp_path):
    captures = small_corpus(tmp_path / "caps")
    with pytest.raises(ValueError, match=r"given more than once: r1"):
        raycap.rebuild([captures], ["r1", "r2", "r1"], executor="local")


def test_a_directory_and_a_symlink_to_it_are_one_directory(tmp_path):
    captures = small_corpus(tmp_path / "caps")
    link = tmp_path / "link"
    link.symlink_to(captures)
    table = raycap.rebuild([captures, str(link)], GOOD, model="m", executor="local")
    rows = table.to_pylist()
    assert [r["rollout_id"] for r in rows] == GOOD
    assert all(r["mask_sample"] is False for r in rows)


# --- where an output may be ------------------------------------------------------------------


def test_an_output_inside_a_capture_directory_is_refused_before_anything_is_created(tmp_path):
    captures = small_corpus(tmp_path / "caps")
    before = files_under(tmp_path)
    with pytest.raises(OutputError, match="inside capture directory"):
        rebuild_to_output([captures], Path(captures) / "sub" / "rows", GOOD, executor="local")
    assert files_under(tmp_path) == before and not (Path(captures) / "sub").exists()


def test_an_output_inside_a_committed_output_is_refused(tmp_path):
    captures = small_corpus(tmp_path / "caps")
    outer = tmp_path / "outer"
    assert rebuild_to_output([captures], outer, GOOD, model="m", executor="local").ok
    before = files_under(outer)
    with pytest.raises(OutputError, match="inside the committed output"):
        rebuild_to_output([captures], outer / "inner", GOOD[:2], model="m", executor="local")
    assert files_under(outer) == before
    assert pq.read_table(outer).num_rows == len(GOOD)


def test_an_output_named_like_a_capture_file_is_refused(tmp_path):
    captures = small_corpus(tmp_path / "caps")
    with pytest.raises(OutputError, match=r"named like a capture file"):
        rebuild_to_output([captures], tmp_path / "x.tokens.jsonl", GOOD, executor="local")
    assert not list(tmp_path.glob("*x.tokens*"))


def test_the_job_refuses_a_misplaced_output_with_exit_2(tmp_path, capsys):
    captures = small_corpus(tmp_path / "caps")
    code, _, err = job(tmp_path, "inside", capsys, capture_dirs=[captures], output=f"{captures}/rows", model="m",
                       executor="local")
    assert code == 2 and "inside capture directory" in err and len(err.strip().splitlines()) == 1


# --- configs ---------------------------------------------------------------------------------


def test_a_duplicate_yaml_key_is_refused_with_exit_2_naming_it(tmp_path, capsys):
    captures = small_corpus(tmp_path / "caps")
    config = tmp_path / "dup.yaml"
    config.write_text(f"capture_dirs: [{captures}]\noutput: rows\nretire: false\nretire: true\n")
    code = rebuild_job.main(["--config", str(config)])
    err = capsys.readouterr().err
    assert code == 2 and "'retire' is given twice" in err and str(config) in err
    assert not (tmp_path / "rows").exists()


@pytest.mark.slow
@pytest.mark.parametrize("which", ["config", "rollout_ids_file"])
def test_a_fifo_config_or_ids_file_is_refused_without_hanging(tmp_path, which):
    captures = small_corpus(tmp_path / "caps")
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    if which == "config":
        config = fifo
    else:
        config = tmp_path / "job.yaml"
        config.write_text(yaml.safe_dump(dict(capture_dirs=[captures], output="rows", rollout_ids_file=str(fifo))))
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    run = subprocess.run([sys.executable, "-c", JOB_SCRIPT, "--config", str(config)], capture_output=True,
                         text=True, env=env, timeout=60)
    assert run.returncode == 2 and "not a regular file" in run.stderr
