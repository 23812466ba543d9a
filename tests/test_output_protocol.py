"""The commit protocol of an output holds for both of its backends (a local directory and
an object store), and nothing outside the backends chooses between them.

The same test runs on a local tmp dir and on the `s3` test server: parts are staged,
committed, verified whole; a part gone missing or altered afterwards is caught by
`verify`, and retirement refuses (nothing marked, nothing dropped) until it passes.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import raycap
from raycap.capture.store import TokenCaptureStore
from raycap.output.faults import OutputError
from raycap.output.location import parse_location
from raycap.output.manifest import read_manifest, shard_paths, was_retired_from
from raycap.output.protocol import Inputs, StagedOutput, backend_of, verify
from raycap.output.recordparts import RecordCounts, RecordsManifest, write_records_part
from raycap.output.shards import write_shard
from raycap.rows.batch import schema_of

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
    with target.filesystem.open_output_stream(target.fs_path) as stream:
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
    original = shard.read_bytes()
    _put(shard, bytes([original[0] ^ 0xFF]) + original[1:])
    with pytest.raises(OutputError, match="is not the one its manifest lists"):
        verify(location, manifest, shard_paths(output, manifest))
    with pytest.raises(OutputError, match="nothing was retired"):
        raycap.retire([captures], place, executor="local")
    assert not was_retired_from(location)
    _put(shard, original)

    # A records part gone missing is caught, and retirement refuses.
    part = location.child(manifest.records.parts[0].name)
    kept = part.read_bytes()
    part.filesystem.delete_file(part.fs_path)
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

# The two backends, and the value that says which a place is.
BACKENDS = {"output/localstore.py", "output/objectstore.py", "output/location.py"}
# Readers not yet on the protocol's primitives: this set may only shrink.
NOT_YET = {
    "output/manifest.py", "output/recordparts.py", "output/shards.py", "cli/inspection.py", "cli/jobconfig.py",
    "cluster/retirement.py", "cluster/nodestream.py",
}
# The protocol and its writers: never a branch on where the output is.
WRITERS = {
    "output/protocol.py", "output/commit.py", "output/handoff.py", "finalize/rollouts.py", "stream/steps.py",
    "stream/commit.py", "cluster/session.py", "train/feed.py",
}


def _branches_on_place(tree: ast.AST) -> list[int]:
    """Lines whose condition asks whether a place is local (`x.local`, `x.remote`) or a
    store's (`isinstance(x, Location)`)."""
    lines = []
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
                if isinstance(sub, ast.Attribute) and sub.attr in ("local", "remote"):
                    lines.append(sub.lineno)
                elif (isinstance(sub, ast.Call) and isinstance(sub.func, ast.Name) and sub.func.id == "isinstance"
                      and len(sub.args) == 2 and isinstance(sub.args[1], ast.Name) and sub.args[1].id == "Location"):
                    lines.append(sub.lineno)
    return sorted(set(lines))


@pytest.mark.slow
def test_no_module_outside_the_backends_branches_on_local_or_store():
    branching = {}
    for path in sorted(RAYCAP.rglob("*.py")):
        name = path.relative_to(RAYCAP).as_posix()
        lines = _branches_on_place(ast.parse(path.read_text(), filename=str(path)))
        if lines and name not in BACKENDS:
            branching[name] = lines
    assert not {name: lines for name, lines in branching.items() if name in WRITERS}, "writers must use the backend"
    assert set(branching) <= NOT_YET, f"new branches on local vs store outside the backends: {branching}"
