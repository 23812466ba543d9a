"""The commit protocol of an output holds for both of its backends (a local directory and
an object store), and nothing outside the backends chooses between them.

The same test runs on a local tmp dir and on the `s3` test server: parts are staged,
committed, verified whole; a part gone missing or altered afterwards is caught by
`verify`, and retirement refuses (nothing marked, nothing dropped) until it passes: a
finalized output's records parts as its shards, locally as on the store.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import raycap
from conftest import retired_ids
from raycap.capture.store import TokenCaptureStore
from raycap.output.faults import OutputError
from raycap.output.location import parse_location
from raycap.output.manifest import RETIRE_MARKER_NAME, read_manifest, shard_paths, was_retired_from
from raycap.output.objectstore import client
from raycap.output.protocol import Inputs, StagedOutput, backend_of, verify
from raycap.output.recordparts import RecordCounts, RecordsManifest, write_records_part
from raycap.output.shards import write_shard
from raycap.rows.batch import schema_of
from raycap.runs.rollouts import finalize_rollouts

RAYCAP = Path(raycap.__file__).parent


@pytest.fixture(params=["local", "s3"])
def place(request, tmp_path):
    """Where an output goes: a local path, or a URI on the test store."""
    if request.param == "local":
        return str(tmp_path / "out" / "step")
    bucket = request.getfixturevalue("s3_bucket")
    return f"s3://{bucket}/run/step"


def _commit(place: str, captures: str):
    location = parse_location(place)
    inputs = Inputs((captures,), None, "prefix_merging", "")
    with StagedOutput(location, inputs=inputs) as staged:
        shards = [write_shard(staged.for_tasks, i, schema_of("rollout").empty_table()) for i in range(2)]
        part = write_records_part(staged.for_tasks, 0, [b'{"a": 1}', b'{"a": 2}'], first_index=0, records=2)
        committed = staged.commit(shards, records=RecordsManifest((part,), RecordCounts()))
    return location, committed


def _put(target, data: bytes) -> None:
    """Replace a committed part's bytes through the output's own file system."""
    with client.filesystem(target).open_output_stream(target.fs_path) as stream:
        stream.write(data)


@pytest.mark.slow
def test_the_protocol_holds_on_both_backends(place, tmp_path):
    captures = str(tmp_path / "captures")
    TokenCaptureStore(captures)
    location, committed = _commit(place, captures)
    backend = backend_of(location)
    output = backend.where(location)
    manifest = read_manifest(output)
    assert manifest.fingerprint == committed.manifest.fingerprint and len(manifest.shards) == 2
    verify(location, manifest, shard_paths(output, manifest))  # whole: passes

    # An altered shard (same size, other bytes) is caught, and retirement refuses.
    shard = location.child(manifest.shards[1].name)
    original = client.read_bytes(shard)
    _put(shard, bytes([original[0] ^ 0xFF]) + original[1:])
    with pytest.raises(OutputError, match="is not the one its manifest lists"):
        verify(location, manifest, shard_paths(output, manifest))
    with pytest.raises(OutputError, match="nothing was retired"):
        raycap.retire([captures], place, executor="local")
    assert not was_retired_from(location)
    _put(shard, original)

    # A records part gone missing is caught, and retirement refuses.
    part = location.child(manifest.records.parts[0].name)
    kept = client.read_bytes(part)
    client.filesystem(part).delete_file(part.fs_path)
    with pytest.raises(OutputError, match="records part .* is missing"):
        verify(location, manifest, shard_paths(output, manifest))
    # (On a store the finish, which comes first, already refuses: the part is nowhere.)
    with pytest.raises(OutputError, match="nothing was retired|is missing from its committed output"):
        raycap.retire([captures], place, executor="local")
    assert not was_retired_from(location)

    # Restored, the output verifies and retires.
    _put(part, kept)
    verify(location, manifest, shard_paths(output, manifest))
    report = raycap.retire([captures], place, executor="local")
    assert not report.errors and was_retired_from(location)


def test_a_second_commit_of_the_same_output_is_refused_on_both_backends(place, tmp_path):
    captures = str(tmp_path / "captures")
    TokenCaptureStore(captures)
    _commit(place, captures)
    with pytest.raises(OutputError, match="appeared while this run was building"):
        _commit(place, captures)


# --- nothing outside the backends chooses between a local output and a store's ----------------------

# The two backends (their writing and reading modules), and the value that says which a place is.
BACKENDS = {
    "output/local/writes.py", "output/local/reads.py", "output/objectstore/writes.py", "output/objectstore/reads.py",
    "output/objectstore/client.py", "output/location.py",
}
# The one branch left outside the backends, by module and function: the staging write of
# a part, which builder tasks call below the protocol. This set may only shrink.
NOT_YET = {("output/shards.py", "write_staged")}
# The protocol and its writers: never a branch on where the output is.
WRITERS = {
    "output/protocol.py", "output/commit.py", "runs/handoff.py", "runs/rollouts.py", "stream/steps.py",
    "stream/stepcommit.py", "cluster/rebuild/session.py", "train/feed.py",
}
# The readers: the manifest and parts of a committed output, `raycap inspect`, job
# configs, retirement (its checks and its drops), a node's stream. They read through the backend's primitives.
READERS = {
    "output/manifest.py", "output/manifestformat.py", "output/recordparts.py", "output/shards.py", "cli/inspection.py",
    "cli/jobconfig.py", "output/retiring.py", "runs/retirement.py", "cluster/nodes/node_stream.py",
}


def _asks_where(sub: ast.AST) -> bool:
    """Whether `sub`, inside a condition, asks where a place is: `x.local`, `x.remote`,
    `x.is_local`, `isinstance(x, Location)`, a comparison of `x.scheme`, or
    `text.startswith("s3://")` (any URI's beginning)."""
    if isinstance(sub, ast.Attribute) and sub.attr in ("local", "remote", "is_local"):
        return True
    if isinstance(sub, ast.Compare) and any(
        isinstance(side, ast.Attribute) and side.attr == "scheme" for side in [sub.left, *sub.comparators]
    ):
        return True
    if not isinstance(sub, ast.Call):
        return False
    if (isinstance(sub.func, ast.Name) and sub.func.id == "isinstance" and len(sub.args) == 2
            and isinstance(sub.args[1], ast.Name) and sub.args[1].id == "Location"):
        return True
    return (
        isinstance(sub.func, ast.Attribute) and sub.func.attr == "startswith"
        and any(isinstance(arg, ast.Constant) and "://" in str(arg.value) for arg in sub.args)
    )


def _branches_on_place(tree: ast.AST) -> list[tuple[str, int]]:
    """(function, line) of every condition that asks whether a place is local or a
    store's (`_asks_where`); the function is "" at module level."""
    found = set()
    functions = [(node.name, node) for node in ast.walk(tree) if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))]

    def owner(line: int) -> str:
        inside = [(node.lineno, name) for name, node in functions if node.lineno <= line <= node.end_lineno]
        return max(inside)[1] if inside else ""

    for node in ast.walk(tree):
        tests = []
        if isinstance(node, (ast.If, ast.IfExp, ast.While)):
            tests.append(node.test)
        elif isinstance(node, ast.comprehension):
            tests.extend(node.ifs)
        elif isinstance(node, ast.BoolOp):
            tests.extend(node.values)
        for test in tests:
            for sub in ast.walk(test):
                if _asks_where(sub):
                    found.add((owner(sub.lineno), sub.lineno))
    return sorted(found)


@pytest.mark.slow
def test_no_module_outside_the_backends_branches_on_local_or_store():
    listed = BACKENDS | WRITERS | READERS | {name for name, _ in NOT_YET}
    assert [name for name in sorted(listed) if not (RAYCAP / name).exists()] == [], "a module listed here has moved"
    branching = {}
    for path in sorted(RAYCAP.rglob("*.py")):
        name = path.relative_to(RAYCAP).as_posix()
        found = [(function, line) for function, line in _branches_on_place(ast.parse(path.read_text(), filename=str(path)))
                 if (name, function) not in NOT_YET]
        if found and name not in BACKENDS:
            branching[name] = found
    assert not {name: found for name, found in branching.items() if name in WRITERS}, "writers must use the backend"
    assert not {name: found for name, found in branching.items() if name in READERS}, "readers must use the backend"
    assert not branching, f"new branches on local vs store outside the backends: {branching}"


def test_the_branch_check_sees_each_way_of_asking_where_a_place_is():
    asked = [
        "if out.local: pass", "x = 1 if not out.remote else 2", "if isinstance(out, Location): pass",
        "if out.scheme == 's3': pass", "if text.startswith('s3://'): pass", "ok = [p for p in ps if p.is_local]",
    ]
    for source in asked:
        assert _branches_on_place(ast.parse(source)), source
    for source in ["backend = {'': 1}.get(out.scheme, 2)", "if out.name: pass", "if isinstance(out, (str, Location)): pass"]:
        assert not _branches_on_place(ast.parse(source)), source


def test_verify_names_the_first_damaged_part_in_the_manifests_order(tmp_path):
    """The parts are checked on several threads at once; the error is still the first
    damaged part's, in the manifest's order (shards before records parts)."""
    captures = str(tmp_path / "captures")
    TokenCaptureStore(captures)
    location, _ = _commit(str(tmp_path / "out" / "step"), captures)
    output = backend_of(location).where(location)
    manifest = read_manifest(output)
    part = location.child(manifest.records.parts[0].name)
    client.filesystem(part).delete_file(part.fs_path)
    later = location.child(manifest.shards[1].name)
    _put(later, b"not the shard")
    with pytest.raises(OutputError, match=f"shard .*{manifest.shards[1].name}.* is not the one"):
        verify(location, manifest, shard_paths(output, manifest))
    _put(later, b"")  # emptied: still the shard's error, never the part's
    with pytest.raises(OutputError, match=f"shard .*{manifest.shards[1].name}"):
        verify(location, manifest, shard_paths(output, manifest))


# --- retirement verifies the whole commit before it drops anything -----------------------------------


def _first_part(output: Path) -> Path:
    return output / read_manifest(output).records.parts[0].name


def _first_shard(output: Path) -> Path:
    return output / read_manifest(output).shards[0].name


@pytest.mark.slow
@pytest.mark.parametrize("damage", ["part missing", "part truncated", "part altered", "shard altered"])
def test_retire_drops_nothing_when_a_committed_part_is_missing_or_changed(collection, tmp_path, damage):
    captures, _, results, _ = collection
    output = tmp_path / "out"
    finalize_rollouts([str(captures)], results, output, executor="local", batch_size=5)
    assert read_manifest(output).records.redundant()  # a record carrying its own token ids
    before = retired_ids(captures)
    target = _first_shard(output) if damage.startswith("shard") else _first_part(output)
    data = target.read_bytes()
    if damage.endswith("missing"):
        target.unlink()
    elif damage.endswith("truncated"):
        target.write_bytes(data[:-7])
    else:
        middle = len(data) // 2
        target.write_bytes(data[:middle] + bytes([data[middle] ^ 0x01]) + data[middle + 1:])  # same size, other bytes
    with pytest.raises(OutputError) as refused:
        raycap.retire([str(captures)], output, executor="local")
    message = str(refused.value)
    assert "\n" not in message and str(target) in message and "nothing was retired" in message
    assert retired_ids(captures) == before
    assert not (output / RETIRE_MARKER_NAME).exists()
    # The run itself, asked to retire, refuses the same way (the job exits 2 on OutputError).
    with pytest.raises(OutputError, match="nothing was retired"):
        finalize_rollouts([str(captures)], results, output, executor="local", batch_size=5, retire=True)
    assert retired_ids(captures) == before


def test_retire_from_s3_drops_nothing_when_a_records_part_was_altered(s3, s3_bucket, collection):
    captures, _, results, _ = collection
    uri = f"s3://{s3_bucket}/fin/rows"
    assert finalize_rollouts([str(captures)], results, uri, executor="local", batch_size=5).ok
    part = read_manifest(uri).records.parts[0]
    key = f"fin/rows/{part.name}"
    data = s3.client.get_object(Bucket=s3_bucket, Key=key)["Body"].read()
    s3.client.put_object(Bucket=s3_bucket, Key=key, Body=data.replace(b"{", b"[", 1))  # same size
    before = retired_ids(captures)
    with pytest.raises(OutputError, match="nothing was retired") as refused:
        raycap.retire([str(captures)], uri, executor="local")
    assert part.name in str(refused.value) and "\n" not in str(refused.value)
    assert retired_ids(captures) == before
    assert "Contents" not in s3.client.list_objects_v2(Bucket=s3_bucket, Prefix=f"fin/rows/{RETIRE_MARKER_NAME}")


def test_a_backend_is_one_registration_line(monkeypatch):
    from raycap.output import protocol

    class Planted:
        pass

    planted = Planted()
    monkeypatch.setitem(protocol.BACKENDS, "mock", planted)
    assert backend_of(parse_location("mock://bucket/out")) is planted
    assert backend_of(parse_location("s3://bucket/out")) is protocol.STORE
    assert backend_of(parse_location("/tmp/out")) is protocol.LOCAL


def test_an_output_of_no_rows_is_committed_without_importing_pandas(tmp_path):
    # The one shard of an empty output is written from the schema alone: pyarrow's
    # Schema.empty_table would import pandas, a third of a second of a command's start.
    import subprocess
    import sys

    code = (
        "import sys; from raycap.output.location import parse_location; "
        "from raycap.output.protocol import Inputs, StagedOutput; "
        "from raycap.output.manifest import read_manifest; "
        "loc = parse_location(sys.argv[1]); staged = StagedOutput(loc, inputs=Inputs((sys.argv[2],), None, 'prefix_merging', '')); "
        "staged.__enter__(); staged.commit([]); staged.__exit__(None, None, None); "
        "print(read_manifest(sys.argv[1]).totals.rows, 'pandas' in sys.modules)"
    )
    (tmp_path / "captures").mkdir()
    run = subprocess.run([sys.executable, "-c", code, str(tmp_path / "out"), str(tmp_path / "captures")],
                         cwd=RAYCAP.parent, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    assert run.stdout.split() == ["0", "False"]
