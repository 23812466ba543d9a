"""Outputs, manifests, job configs and the command line as a hostile user leaves them.

A manifest is untrusted input: a shard name that leaves the output is refused by every
reader and by retirement. Manifests, retire markers, configs and shards are opened
without following links and without blocking (a FIFO anywhere never hangs a read, a
rebuild's placement check or the feed), each size-bounded. A YAML alias bomb is refused
before anything is expanded. `raycap inspect` writes only its PNG, never inside an
output, among captures or through a link. The data-parallel feed checks each shard against the
manifest before any plan, and refuses to feed a shard that changed since its plan.

Every hang case runs under a bound (`no_hang`, or a subprocess with a timeout), so a
regression fails instead of hanging the suite.
"""

from __future__ import annotations

import json
import os
import shutil
import stat
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

import raycap
from hang import no_hang
from raycap.capture.records import TokenEntry
from raycap.capture.store import TokenCaptureStore
from raycap.cli.command import main as cli_main
from raycap.cli.inspection import InspectError, inspect_output
from raycap.cli.synth import CorpusSpec, generate_corpus
from raycap.output.faults import OutputError
from raycap.output.manifest import MANIFEST_NAME, RETIRE_MARKER_NAME, read_manifest, shard_paths
from raycap.runs.handoff import rebuild_to_output
from raycap.runs.rollouts import finalize_rollouts
from raycap.train.feed import DataParallelFeed, shard_batches

REPO = Path(__file__).resolve().parents[2]
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
SMALL = dict(system_tokens=(20, 120), turns=(4, 6), generation_tokens=(1, 40), tool_tokens=(1, 40), fault_share=0.2)


def small_captures(directory: Path, ids=("r1", "r2", "r3", "r4")) -> str:
    store = TokenCaptureStore(str(directory))
    for rid in ids:
        store.append(
            TokenEntry(rollout_id=rid, model_call_id="c1", prompt_token_ids=[1, 2], generation_token_ids=[3, 4],
                       generation_log_probs=[-0.5, -0.25])
        )
    return str(directory)


def retired(captures: str, rid: str) -> bool:
    path = Path(captures) / f"{rid}.tokens.state.json"
    return path.exists() and json.loads(path.read_text()).get("retired", False)


def edit_manifest(output: Path, change) -> None:
    path = output / MANIFEST_NAME
    raw = json.loads(path.read_text())
    change(raw)
    path.write_text(json.dumps(raw))


@pytest.fixture(scope="module")
def template(tmp_path_factory) -> Path:
    """A committed output of several shards (36 rollouts, 5 per batch), to copy per test."""
    root = tmp_path_factory.mktemp("hostile-outputs")
    corpus = generate_corpus(root / "captures", CorpusSpec(rollouts=36, seed=3, **SMALL))
    outcome = rebuild_to_output([corpus.directory], root / "out", executor="local", batch_size=5)
    assert outcome.ok, outcome.message
    return root / "out"


@pytest.fixture
def output(template, tmp_path) -> Path:
    copy = tmp_path / "work" / "out"
    shutil.copytree(template, copy, symlinks=True)
    return copy


def seq_len_of(output: Path) -> int:
    return read_manifest(output).totals.token_lengths.max + 8


# --- 2. shard names are untrusted ------------------------------------------------------------

BAD_NAMES = [
    "../y/data/part-000000.parquet",
    "/etc/passwd",
    "data/../../y/data/part-000000.parquet",
    "data/../part-000000.parquet",
    "./data/part-000000.parquet",
    "data//part-000000.parquet",
    "data/.part-000000.parquet",
    "data/_part-000000.parquet",
    ".hidden/part-000000.parquet",
    "data\\part-000000.parquet",
    "data/part-000000.parquet\x00",
    "data/part-000000.txt",
    "data/",
    "",
    "data/sub/part-000000.parquet",
    "other/part-000000.parquet",
]


@pytest.mark.slow
@pytest.mark.parametrize("name", BAD_NAMES)
def test_a_shard_name_that_is_not_a_plain_name_inside_the_output_is_refused_by_every_reader(output, name, tmp_path):
    victim = tmp_path / "y" / "data" / "part-000000.parquet"
    victim.parent.mkdir(parents=True)
    shutil.copy(output / "data" / "part-000000.parquet", victim)
    edit_manifest(output, lambda raw: raw["shards"][0].update(name=name))
    with no_hang():
        for read in (read_manifest, shard_paths, inspect_output, raycap.dataset,
                     lambda out: DataParallelFeed(out, 2, seq_len=4096, lines=2)):
            with pytest.raises((OutputError, InspectError)) as caught:
                read(output)
            message = str(caught.value)
            assert "shard" in message and len(message.splitlines()) == 1, message


def test_a_duplicate_shard_name_is_refused(output):
    edit_manifest(output, lambda raw: raw["shards"].__setitem__(1, raw["shards"][0]))
    with pytest.raises(OutputError, match="part-000000.parquet.*twice"):
        read_manifest(output)


def test_an_earlier_layout_with_shards_at_the_top_still_reads(output):
    for path in sorted((output / "data").iterdir()):
        path.rename(output / path.name)
    (output / "data").rmdir()
    edit_manifest(output, lambda raw: [s.update(name=s["name"].removeprefix("data/")) for s in raw["shards"]])
    os.rename(output / MANIFEST_NAME, output / "_manifest.json")
    manifest = read_manifest(output)
    assert [p.name for p in shard_paths(output)] == [s.name for s in manifest.shards]
    feed = DataParallelFeed(output, 2, seq_len=seq_len_of(output), lines=2)
    assert sum(1 for _ in feed.batches(0)) == feed.steps


@pytest.mark.parametrize("where", ["relative", "absolute", "rejected"])
def test_retire_never_follows_a_shard_name_into_another_output_and_drops_nothing(tmp_path, where):
    captures = small_captures(tmp_path / "caps")
    other = tmp_path / ("x.rejected" if where == "rejected" else "y")
    assert rebuild_to_output([captures], other, ["r1", "r2"], executor="local").ok
    target = tmp_path / "x"
    assert rebuild_to_output([captures], target, ["r3"], executor="local").ok
    name = {
        "relative": "../y/data/part-000000.parquet",
        "absolute": str(other / "data" / "part-000000.parquet"),
        "rejected": "../x.rejected/data/part-000000.parquet",
    }[where]
    edit_manifest(target, lambda raw: raw["shards"][0].update(name=name))
    with pytest.raises(OutputError, match="shard"):
        raycap.retire([captures], target, executor="local")
    assert not any(retired(captures, rid) for rid in ("r1", "r2", "r3"))
    assert not (target / RETIRE_MARKER_NAME).exists()


def test_retire_on_ray_refuses_a_shard_name_outside_the_output_before_any_drop(ray_shared, tmp_path):
    captures = small_captures(tmp_path / "caps")
    other, target = tmp_path / "y", tmp_path / "x"
    assert rebuild_to_output([captures], other, ["r1", "r2"], executor="local").ok
    assert rebuild_to_output([captures], target, ["r3"], executor="local").ok
    edit_manifest(target, lambda raw: raw["shards"][0].update(name="../y/data/part-000000.parquet"))
    with pytest.raises(OutputError, match="shard"):
        raycap.retire([captures], target, executor="ray")
    assert not any(retired(captures, rid) for rid in ("r1", "r2", "r3"))
    assert not (target / RETIRE_MARKER_NAME).exists()


# --- 6. no FIFO, link or device is followed or waited on ---------------------------------------


def _plant(path: Path, kind: str, tmp_path: Path) -> None:
    if path.exists() or path.is_symlink():
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path)
        else:
            path.unlink()
    if kind == "fifo":
        os.mkfifo(path)
    elif kind == "device":
        try:
            os.mknod(path, 0o666 | stat.S_IFCHR, os.makedev(1, 3))  # /dev/null's numbers
        except PermissionError:
            os.symlink("/dev/null", path)  # unprivileged: a link to the device instead
    else:  # a link to a valid copy elsewhere: following it would "work", and must not
        copy = tmp_path / f"elsewhere-{path.name}"
        if not copy.exists():
            raise AssertionError("plant the copy first")
        os.symlink(copy, path)


@pytest.mark.parametrize("kind", ["fifo", "link", "device"])
def test_a_manifest_that_is_not_a_regular_file_is_refused_without_hanging(output, tmp_path, kind):
    shutil.copy(output / MANIFEST_NAME, tmp_path / f"elsewhere-{MANIFEST_NAME}")
    _plant(output / MANIFEST_NAME, kind, tmp_path)
    with no_hang():
        with pytest.raises(OutputError, match=r"\.manifest\.json"):
            read_manifest(output)
        with pytest.raises(InspectError):
            inspect_output(output)
        assert cli_main(["inspect", str(output)]) == 2


def test_an_oversized_manifest_is_refused_before_it_is_read(output):
    import raycap.output.manifest

    limit = getattr(raycap.output.manifest, "MAX_MANIFEST_BYTES", 256 << 20)
    with open(output / MANIFEST_NAME, "r+b") as handle:
        handle.truncate(limit + 1)  # sparse: nothing of it needs reading to refuse it
    with no_hang():
        with pytest.raises(OutputError, match="bytes"):
            read_manifest(output)


@pytest.mark.parametrize("kind", ["fifo", "link", "device"])
def test_a_manifest_in_an_ancestor_that_is_not_a_regular_file_never_blocks_a_rebuild(tmp_path, kind):
    captures = small_captures(tmp_path / "caps")
    parent = tmp_path / "shared"
    parent.mkdir()
    # A link leads to a valid manifest: followed, it would make `shared` a committed output.
    assert rebuild_to_output([captures], tmp_path / "valid", executor="local").ok
    shutil.copy(tmp_path / "valid" / MANIFEST_NAME, tmp_path / f"elsewhere-{MANIFEST_NAME}")
    _plant(parent / MANIFEST_NAME, kind, tmp_path)
    with no_hang():
        outcome = rebuild_to_output([captures], parent / "a" / "rows", executor="local")
    assert outcome.ok and pq.read_table(parent / "a" / "rows").num_rows == 4


def test_the_placement_check_reads_only_the_head_of_a_huge_manifest_in_an_ancestor(tmp_path):
    import time

    captures = small_captures(tmp_path / "caps")
    parent = tmp_path / "shared"
    parent.mkdir()
    with open(parent / MANIFEST_NAME, "wb") as handle:
        handle.write(b'{"format": "raycap.dataset", "shards": [')
        handle.truncate(2 << 30)  # sparse; parsing it (or even reading it) would cost gigabytes
    started = time.monotonic()
    with pytest.raises(OutputError, match="inside the committed output"):
        rebuild_to_output([captures], parent / "a" / "rows", executor="local")
    assert time.monotonic() - started < 5


@pytest.mark.parametrize("what", ["fifo shard", "linked shard", "linked data"])
def test_a_shard_that_is_a_fifo_or_a_link_is_refused_by_every_reader_without_hanging(output, tmp_path, what):
    shard = output / "data" / "part-000001.parquet"
    if what == "linked data":
        shutil.copytree(output / "data", tmp_path / "elsewhere-data")
        shutil.rmtree(output / "data")
        os.symlink(tmp_path / "elsewhere-data", output / "data")
    else:
        shutil.copy(shard, tmp_path / f"elsewhere-{shard.name}")
        _plant(shard, "fifo" if what == "fifo shard" else "link", tmp_path)
    with no_hang():
        for read in (shard_paths, inspect_output, raycap.dataset,
                     lambda out: DataParallelFeed(out, 2, seq_len=4096, lines=2)):
            with pytest.raises((OutputError, InspectError), match="part-00000|data"):
                read(output)


def test_a_fifo_retire_marker_never_blocks_retirement(tmp_path):
    captures = small_captures(tmp_path / "caps")
    output = tmp_path / "rows"
    assert rebuild_to_output([captures], output, executor="local").ok
    os.mkfifo(output / RETIRE_MARKER_NAME)
    with no_hang():
        report = raycap.retire([captures], output, executor="local")
    assert report.dropped == 4
    marker = output / RETIRE_MARKER_NAME
    assert marker.is_file() and not marker.is_symlink()
    assert json.loads(marker.read_text())["state"] == "finished"


@pytest.mark.parametrize("kind", ["fifo", "link"])
def test_a_lock_file_that_is_not_a_regular_file_is_refused_never_followed_or_waited_on(tmp_path, kind):
    from raycap.output.commit import lock_path

    captures = small_captures(tmp_path / "caps")
    output = tmp_path / "rows"
    victim = tmp_path / "victim"
    if kind == "fifo":
        os.mkfifo(lock_path(output))
    else:
        os.symlink(victim, lock_path(output))
    with no_hang():
        with pytest.raises(OutputError, match=r"lock file .* is (a FIFO|a symbolic link)"):
            rebuild_to_output([captures], output, executor="local")
    assert not victim.exists() and not output.exists()


# --- 7. a YAML alias bomb, and bounded config errors ----------------------------------------------

BOMB = """\
a: &a ["lol","lol","lol","lol","lol","lol","lol","lol","lol"]
b: &b [*a,*a,*a,*a,*a,*a,*a,*a,*a]
c: &c [*b,*b,*b,*b,*b,*b,*b,*b,*b]
d: &d [*c,*c,*c,*c,*c,*c,*c,*c,*c]
e: &e [*d,*d,*d,*d,*d,*d,*d,*d,*d]
f: &f [*e,*e,*e,*e,*e,*e,*e,*e,*e]
g: &g [*f,*f,*f,*f,*f,*f,*f,*f,*f]
h: &h [*g,*g,*g,*g,*g,*g,*g,*g,*g]
i: &i [*h,*h,*h,*h,*h,*h,*h,*h,*h]
capture_dirs: [*i]
output: rows
"""


def _limited_memory() -> None:
    import resource

    resource.setrlimit(resource.RLIMIT_AS, (4 << 30, 4 << 30))


@pytest.mark.slow
def test_a_yaml_alias_bomb_is_refused_at_once_with_one_line_naming_the_file(tmp_path):
    config = tmp_path / "bomb.yaml"
    config.write_text(BOMB)
    assert len(BOMB) < 600
    env = {**os.environ, "PYTHONPATH": str(REPO), "RAY_USAGE_STATS_ENABLED": "0"}
    env.pop("RAY_ADDRESS", None)
    run = subprocess.run([sys.executable, "-m", "raycap", "rebuild", "--config", str(config)], capture_output=True,
                         text=True, env=env, timeout=60, preexec_fn=_limited_memory, cwd=tmp_path)
    assert run.returncode == 2, run.stderr[-2000:]
    lines = run.stderr.strip().splitlines()
    assert len(lines) == 1 and str(config) in lines[0] and "alias" in lines[0], run.stderr[-2000:]
    assert len(lines[0]) < 600
    assert not (tmp_path / "rows").exists()


@pytest.mark.slow
def test_a_large_wrong_value_gives_a_bounded_error_line(tmp_path):
    from raycap.cli.jobconfig import ConfigError, RebuildJobConfig, load_config

    config = tmp_path / "big.yaml"
    config.write_text(yaml_dump({"capture_dirs": [[f"/caps/{i}" for i in range(20000)]], "output": "rows"}))
    with pytest.raises(ConfigError) as caught:
        load_config(config, RebuildJobConfig)
    message = str(caught.value)
    assert str(config) in message and "capture" in message
    assert len(message) < 1000 and len(message.splitlines()) == 1


def yaml_dump(value) -> str:
    import yaml

    return yaml.safe_dump(value)


@pytest.mark.parametrize("which", ["config", "rollout_ids_file"])
def test_a_linked_config_or_ids_file_is_refused(tmp_path, which):
    from raycap.cli.jobconfig import ConfigError, RebuildJobConfig, load_config

    captures = small_captures(tmp_path / "caps")
    real = tmp_path / "real.txt"
    if which == "config":
        real.write_text(yaml_dump({"capture_dirs": [captures], "output": "rows"}))
        config = tmp_path / "job.yaml"
        os.symlink(real, config)
    else:
        real.write_text("r1\n")
        os.symlink(real, tmp_path / "ids.txt")
        config = tmp_path / "job.yaml"
        config.write_text(yaml_dump({"capture_dirs": [captures], "output": "rows", "rollout_ids_file": "ids.txt"}))
    with pytest.raises(ConfigError, match="symbolic link"):
        load_config(config, RebuildJobConfig)


# --- 8. inspect writes only its PNG, beside the output ---------------------------------------------


def _tree(root: Path) -> dict[str, tuple[int, int]]:
    out = {}
    for base, dirs, files in os.walk(root):
        for name in dirs + files:
            full = os.path.join(base, name)
            info = os.lstat(full)
            out[os.path.relpath(full, root)] = (info.st_size, info.st_mtime_ns)
    return out


@pytest.mark.slow
def test_inspect_never_writes_through_a_link_planted_at_its_png(output, tmp_path, capsys):
    victim = tmp_path / "victim.txt"
    victim.write_text("precious")
    png = output.with_name(output.name + ".lengths.png")
    os.symlink(victim, png)
    assert cli_main(["inspect", str(output)]) == 0
    assert victim.read_text() == "precious"
    assert not png.is_symlink() and png.read_bytes()[:8] == PNG_MAGIC
    assert not [p for p in png.parent.iterdir() if p.name.startswith(f".{png.name}")]  # no temp file left


@pytest.mark.slow
def test_inspect_of_a_shard_writes_its_png_beside_the_output_and_the_output_still_reads(output, capsys):
    before = _tree(output)
    assert cli_main(["inspect", str(output / "data" / "part-000000.parquet")]) == 0, capsys.readouterr().err
    assert _tree(output) == before
    png = output.with_name(output.name + ".lengths.png")
    assert png.read_bytes()[:8] == PNG_MAGIC
    assert pq.read_table(output).num_rows == read_manifest(output).rows
    import polars as pl

    assert pl.read_parquet(output / "data").height == read_manifest(output).rows


@pytest.mark.parametrize("inside", [".", "data"])
def test_a_png_asked_for_inside_an_output_is_refused_with_one_line(output, capsys, inside):
    before = _tree(output)
    png = output / inside / "lengths.png"
    assert cli_main(["inspect", str(output), "--png", str(png)]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "inside" in err and str(output) in err
    assert _tree(output) == before


def test_inspect_of_dot_reports_and_writes_its_png_beside_it(output, monkeypatch, capsys):
    before = _tree(output)
    monkeypatch.chdir(output)
    assert cli_main(["inspect", "."]) == 0, capsys.readouterr().err
    assert "rows" in capsys.readouterr().out
    assert _tree(output) == before
    assert output.with_name(output.name + ".lengths.png").read_bytes()[:8] == PNG_MAGIC


def test_inspect_of_the_data_directory_writes_nothing_inside_the_output(output, capsys):
    before = _tree(output)
    assert cli_main(["inspect", str(output / "data")]) == 0, capsys.readouterr().err
    assert _tree(output) == before
    assert output.with_name(output.name + ".lengths.png").read_bytes()[:8] == PNG_MAGIC


# --- 10. the feed checks what it reads -------------------------------------------------------------


def _rewrite(shard: Path, change) -> None:
    table = pq.read_table(shard)
    changed = change(table)
    temp = shard.with_name(".rewrite")
    pq.write_table(changed, temp)
    os.replace(temp, shard)


def _shorten_a_trainable_row(table: pa.Table) -> pa.Table:
    rows = table.to_pylist()
    row = next(r for r in rows if r["mask_sample"] is False and r["token_ids"] and len(r["token_ids"]) > 2)
    for column in ("token_ids", "loss_mask", "logprobs"):
        row[column] = row[column][:-1]
    return pa.Table.from_pylist(rows, schema=table.schema)


def test_a_shard_that_lost_a_row_is_refused_before_any_plan_naming_it(output):
    _rewrite(output / "data" / "part-000002.parquet", lambda t: t.slice(1))
    with pytest.raises(OutputError, match=r"part-000002\.parquet") as caught:
        DataParallelFeed(output, 2, seq_len=seq_len_of(output), lines=2)
    assert len(str(caught.value).splitlines()) == 1


def test_a_shard_changed_with_the_same_rows_is_refused_before_any_plan(output):
    _rewrite(output / "data" / "part-000001.parquet", _shorten_a_trainable_row)
    with pytest.raises(OutputError, match=r"part-000001\.parquet"):
        DataParallelFeed(output, 2, seq_len=seq_len_of(output), lines=2)


def test_a_shard_with_a_flipped_byte_is_refused(output):
    shard = output / "data" / "part-000000.parquet"
    data = bytearray(shard.read_bytes())
    data[len(data) // 3] ^= 0xFF
    shard.write_bytes(bytes(data))
    with pytest.raises(OutputError, match=r"part-000000\.parquet"):
        DataParallelFeed(output, 2, seq_len=seq_len_of(output), lines=2)


def test_a_shard_that_changes_after_the_plan_is_refused_by_every_rank(output):
    feed = DataParallelFeed(output, 2, seq_len=seq_len_of(output), lines=2)
    _rewrite(output / "data" / "part-000003.parquet", _shorten_a_trainable_row)
    for rank in range(2):
        with pytest.raises(OutputError, match=r"part-000003\.parquet.*(changed|plan)"):
            list(feed.batches(rank))


@pytest.mark.parametrize("world_size", [2.5, True, "2", None, 0, -1])
def test_a_world_size_that_is_not_a_positive_int_is_refused_before_anything_is_read(tmp_path, world_size):
    missing = tmp_path / "missing"  # never read: the argument is judged first
    error = ValueError if isinstance(world_size, int) and not isinstance(world_size, bool) else TypeError
    with pytest.raises(error, match="world_size"):
        DataParallelFeed(missing, world_size, seq_len=64, lines=2)
    with pytest.raises(error, match="world_size"):
        shard_batches(missing, 0, world_size, seq_len=64, lines=2)


@pytest.mark.parametrize("rank", [0.0, 1.5, True, "0", None, -1, 2])
def test_a_rank_that_is_not_an_int_in_the_world_is_refused_before_anything_is_read(output, tmp_path, rank):
    error = ValueError if isinstance(rank, int) and not isinstance(rank, bool) else TypeError
    with pytest.raises(error, match="rank"):
        shard_batches(tmp_path / "missing", rank, 2, seq_len=64, lines=2)
    feed = DataParallelFeed(output, 2, seq_len=seq_len_of(output), lines=2)
    with pytest.raises(error, match="rank"):
        feed.batches(rank)  # refused at the call, not at the first step


# --- inspect's PNG is never written over or among captures -------------------------------------------


def _snapshot(directory: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(Path(directory).iterdir()) if p.is_file()}


@pytest.mark.slow
def test_a_png_is_never_written_over_or_among_captures(collection, tmp_path, capsys):
    captures, _, results, _ = collection
    output = tmp_path / "out"
    finalize_rollouts([str(captures)], results, output, executor="local")
    before = _snapshot(captures)
    victim = next(p for p in captures.iterdir() if p.name.endswith(".tokens.jsonl"))
    for png in (victim, captures / "lengths.png", tmp_path / "x.tokens.jsonl"):
        assert cli_main(["inspect", str(output), "--png", str(png)]) == 2
        err = capsys.readouterr().err
        assert len(err.strip().splitlines()) == 1 and "capture" in err
    assert _snapshot(captures) == before and not (tmp_path / "x.tokens.jsonl").exists()
