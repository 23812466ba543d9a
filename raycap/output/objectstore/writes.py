"""An output on an object store: committed without a rename, with the guarantees of a local one.

1. Staging: each run attempt writes its shards and records parts into its own hidden
   prefix, `s3://B/P/.NAME.staging/<attempt>/`, straight from the tasks to the store.
2. The commit point: the driver checks every reported object, then writes the
   manifest with If-None-Match: * (`commit_point`). Of two writers exactly one wins;
   who won is read from the manifest, never from the answer alone.
3. Roll-forward: the listed objects are copied into place and the attempt removed
   (`roll_forward`). raycap's readers refuse an unfinished roll-forward; whoever finds
   the manifest finishes it first, and nothing is retired before it is finished.

No lock file: the commit point decides. Moving an output aside copies every object
(the manifest last), writes a `.moved.json` record, then deletes (`finish_move`
finishes a crashed move); nothing is deleted before its copy is whole.

`StoreBackend` is this module's side of the commit protocol. The protocol and its
guarantees in full: docs/internals.md ("An output on an object store"). No Ray.
"""

from __future__ import annotations

import json
import os
import tempfile
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator

from raycap.capture.untrusted import bounded, loads_untrusted
from raycap.output.backend import Backend, Inputs, OutputCheck, OutputLock
from raycap.output.faults import OutputError, store_fault
from raycap.output.location import Location
from raycap.output.manifestformat import MANIFEST_NAME, RETIRE_MARKER_NAME, Manifest, is_attempt_name
from raycap.output.objectstore import client
from raycap.output.objectstore.reads import (
    check_placement,
    move_target,
    open_store_shard,
    read_marker,
    read_store_manifest,
    read_store_part,
    store_committed_manifest,
    store_retired_outputs,
    store_shards,
    visible_parquet,
    was_retired_from,
    write_marker,
)

# Server-side copies in flight at once during a roll-forward.
COPY_THREADS = 8


# Written into an output while it is moved aside (`_move`): where its copy is.
MOVED_NAME = ".moved.json"


def staging_root(output: Location) -> Location:
    """The hidden sibling holding every attempt's staging: `.NAME.staging`."""
    return output.sibling(f".{output.name}.staging")


def new_attempt() -> str:
    return time.strftime("%Y%m%dT%H%M%SZ", time.gmtime()) + "-" + uuid.uuid4().hex[:12]


def attempt_location(output: Location, attempt: str) -> Location:
    return staging_root(output).child(attempt)


def _listed(manifest: Manifest) -> dict[str, int]:
    """Every object a manifest lists, with its size."""
    listed = {shard.name: shard.file_bytes for shard in manifest.shards}
    if manifest.records is not None:
        listed.update({part.name: part.file_bytes for part in manifest.records.parts})
    return listed


# --- the commit --------------------------------------------------------------------------------------


def check_staged(staging: Location, reported: dict[str, tuple[str, int]]) -> None:
    """Every object a task reported (name -> (what, size)) is in the attempt with that
    size (one listing); OutputError naming the first that is not."""
    try:
        present = client.files(staging)
    except OSError as exc:
        raise store_fault(staging, exc) from None
    for name, (what, size) in reported.items():
        if name not in present:
            raise OutputError(
                f"{what} {name} is missing from the staging {staging}: its task's write did not reach the store, or "
                "another run removed it; nothing was committed: rerun"
            )
        if present[name] != size:
            raise OutputError(
                f"{what} {name} in {staging} has {present[name]} bytes, its task reported {size}: another writer "
                "replaced it; nothing was committed: rerun"
            )
    try:
        client.delete_all(staging, (name for name in present if name not in reported))
    except OSError as exc:
        raise store_fault(staging, exc) from None


def commit_point(output: Location, manifest: Manifest) -> None:
    """Write the manifest if, and only if, no manifest is there (If-None-Match: *).

    A store may answer a write that succeeded with an error (a 500 whose retry gets 412,
    the first write being there), so the answer alone does not say who committed: after
    a refusal or a fault the manifest found there is read, and when it is this
    attempt's (the same bytes, which name this attempt in `staged_as`) this run
    committed. OutputError (one line) when another writer's is there; OutputWriteError
    when the store cannot say (the attempt's objects must then be kept: the manifest may
    be there, naming them)."""
    data = (json.dumps(manifest.to_json(), indent=2) + "\n").encode()
    target = output.child(MANIFEST_NAME)
    try:
        if client.put_if_absent(target, data):
            return
    except OSError as exc:
        if _holds(target, data, exc) is not True:
            raise store_fault(output, exc) from None
        return
    if _holds(target, data, None):
        return
    raise OutputError(
        f"another run committed {output} while this one was building (its manifest is there); nothing of this "
        "run was committed: reuse that output, or write to another one"
    )


def _holds(target: Location, data: bytes, fault: OSError | None) -> bool | None:
    """Whether the object at `target` is `data`: None when the store cannot say (then
    OutputWriteError after a refusal, naming `fault` or the read's own)."""
    try:
        return client.read_bytes(target, len(data), what="manifest") == data
    except FileNotFoundError:
        return False
    except OutputError:
        return False  # larger than ours: another writer's
    except OSError as exc:
        if fault is not None:
            return None
        raise store_fault(target, exc) from None


def roll_forward(
    output: Location, manifest: Manifest, after_first: Callable[[], None] | None = None, *, tidy: bool = True
) -> None:
    """Finish a commit: copy every listed object that is not in place (by size) from the
    attempt the manifest names, then (with `tidy`) remove every staging attempt of the
    output: the manifest's, now copied, and those no manifest names. Safe to repeat,
    and to run in two processes at once. OutputError when a listed object is neither in
    place nor in the staging: the output is damaged."""
    listed = _listed(manifest)
    try:
        present = client.files(output)
        if MOVED_NAME in present:
            raise OutputError(
                f"{output} was being moved aside when a run stopped (its {MOVED_NAME} names the copy); nothing of it is "
                "read or retired: rerun the run that moved it, which finishes the move"
            )
        missing = [name for name, size in listed.items() if present.get(name) != size]
        if missing:
            if not is_attempt_name(manifest.staged_as):
                raise OutputError(
                    f"{output.child(missing[0])} is missing from its committed output, whose manifest names no staging "
                    "to copy it from; restore it, or rebuild the output with overwrite: true"
                )
            source = attempt_location(output, manifest.staged_as)  # type: ignore[arg-type]
            staged = client.files(source)

            def copy(name: str) -> None:
                if staged.get(name) == listed[name]:
                    client.copy_to(source.child(name), output.child(name))
                elif client.info(output.child(name)).size != listed[name]:  # not copied meanwhile by another run
                    raise OutputError(
                        f"{output.child(name)} is missing from its committed output and from the staging it was "
                        f"committed from ({source}); restore it, or rebuild the output with overwrite: true"
                    )

            copy(missing[0])
            if after_first is not None:
                after_first()
            if missing[1:]:
                # Each copy is one request the store carries out: a few at once hide the round trips.
                with ThreadPoolExecutor(min(COPY_THREADS, len(missing) - 1)) as pool:
                    list(pool.map(copy, missing[1:]))
        if tidy:
            remove_dead_attempts(output)
        elif is_attempt_name(manifest.staged_as):
            client.delete_all(attempt_location(output, manifest.staged_as))  # type: ignore[arg-type]
    except OSError as exc:
        raise store_fault(output, exc) from None


def remove_dead_attempts(output: Location) -> None:
    """Remove every staging attempt of `output`: called once its manifest's objects are
    all in place, when no attempt holds anything a manifest still needs (another run's
    attempt in progress is a loser: the commit point is taken). The exception is a run
    that overwrites: it moves this output aside and may then commit from an attempt
    removed here; its copy then fails with one line and readers refuse its output,
    which fails closed (see the README's "Outputs on an object store")."""
    client.delete_all(staging_root(output))


# --- what is at an output, and moving it aside -----------------------------------------------------


def summary_location(output: Location) -> Location:
    return output.sibling(f"{output.name}.summary.json")


def holds_anything(output: Location) -> bool:
    try:
        return bool(client.files(output))
    except OSError as exc:
        raise OutputError(f"cannot list output {output} on its store: {bounded(exc, 240)}; check the store and rerun") from None


def _stamped(output: Location, suffix: str) -> Location:
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    taken = set(client.entries(output.parent))
    name, n = f"{output.name}.{suffix}-{stamp}", 1
    while name in taken or f"{name}.summary.json" in taken:
        n += 1
        name = f"{output.name}.{suffix}-{stamp}-{n}"
    return output.sibling(name)


def _move(output: Location, target: Location) -> Location:
    """Copy every object of `output` (and its summary) to `target`, the metadata last,
    then record the move in the output (`MOVED_NAME`) and delete the originals, the
    manifest last, the record of the move after it. A run that finds the record
    finishes the deletion (`finish_move`): the copy is whole by then."""
    try:
        files = client.files(output)
        last = [name for name in (RETIRE_MARKER_NAME, MANIFEST_NAME) if name in files]
        for name in [*sorted(set(files) - set(last) - {MOVED_NAME}), *last]:
            client.copy_to(output.child(name), target.child(name))
        summary = summary_location(output)
        if client.exists(summary):
            client.copy_to(summary, summary_location(target))
            client.delete(summary)
        client.put_bytes(output.child(MOVED_NAME), (json.dumps({"moved_to": target.uri}) + "\n").encode())
        _delete_moved(output)
    except OSError as exc:
        raise store_fault(output, exc) from None
    return target


def _delete_moved(output: Location) -> None:
    """The deletion half of a move: the data, the retire marker, the manifest, then the
    record of the move and the folder markers the store kept."""
    files = client.files(output)
    last = [name for name in (RETIRE_MARKER_NAME, MANIFEST_NAME, MOVED_NAME) if name in files]
    client.delete_all(output, [*sorted(set(files) - set(last)), *last])
    client.delete_all(output)


def _check_copy(output: Location, target: Location) -> None:
    """OutputError unless `target` holds a whole copy of what is left of `output`: its
    manifest (the same bytes as the output's, while the output still has one), every
    object its manifest lists with its size, and every object still in the output with
    the same size. A move copies the manifest last, so a copy holding it is whole."""
    files, copied = client.files(output), client.files(target)

    def refuse(why: str) -> OutputError:
        return OutputError(
            f"output {output} was being moved to {target}, which {why}; nothing was deleted: look at both, keep the "
            "whole one, and remove the other by hand"
        )

    if MANIFEST_NAME not in copied:
        raise refuse("does not hold its manifest")
    if MANIFEST_NAME in files and client.read_bytes(output.child(MANIFEST_NAME)) != client.read_bytes(target.child(MANIFEST_NAME)):
        raise refuse("holds another manifest")
    try:
        listed = _listed(read_store_manifest(target))
    except OutputError:
        listed = {}  # an unreadable manifest, moved as it was: the objects left are compared below
    wanted = {**listed, **{name: size for name, size in files.items() if name != MOVED_NAME}}
    wrong = [name for name, size in wanted.items() if copied.get(name) != size]
    if wrong:
        raise refuse(f"lacks {wrong[0]} (or holds it with another size; {len(wrong)} such objects)")


def finish_move(output: Location) -> bool:
    """Finish a move aside that a crash cut short (the output holds `MOVED_NAME`):
    delete what is left, once the copy it names is the move's own place and holds a
    whole copy (`_check_copy`); whether there was one. OutputError otherwise: nothing
    is deleted on the record's word alone."""
    record = output.child(MOVED_NAME)
    try:
        if not client.exists(record):
            return False
        try:
            target = move_target(output, loads_untrusted(client.read_bytes(record, 4096, what="move record"), "move record"))
        except (ValueError, RecursionError) as exc:
            raise OutputError(
                f"the move record {record} is not one raycap writes ({bounded(exc, 240)}); nothing was deleted: look "
                f"at {output}, and remove the record by hand if the output is whole"
            ) from None
        _check_copy(output, target)
        _delete_moved(output)
    except OSError as exc:
        raise OutputError(f"cannot finish the move aside of {output} ({bounded(exc)}); check the store and rerun") from None
    return True


def _finished_first(output: Location) -> None:
    """Roll an old output forward before it is moved, removing only its own staging
    attempt after: the run replacing it is writing into another one beside it."""
    try:
        manifest = read_store_manifest(output)
    except OutputError:
        return  # no readable manifest: nothing to roll forward; what is there is moved
    roll_forward(output, manifest, tidy=False)


def supersede(output: Location) -> Location:
    """Move an existing output aside, as `raycap.output.commit.supersede` does locally:
    `NAME.retired-superseded-<time>` when captures were retired from it, else
    `NAME.superseded-<time>`. Never deletes an object before its copy is made."""
    _finished_first(output)
    why = "retired-superseded" if was_retired_from(output) else "superseded"
    return _move(output, _stamped(output, why))


def set_aside(output: Location) -> Location:
    """Move a committed output that failed the mask check to `NAME.rejected`; an earlier
    `.rejected` is deleted when nothing was retired from it, else moved aside."""
    target = output.sibling(f"{output.name}.rejected")
    if holds_anything(target) or client.exists(summary_location(target)):
        if was_retired_from(target):
            supersede(target)
        else:
            client.delete_all(target)
            client.delete(summary_location(target))
    return _move(output, target)


def check_output(output: Location, fingerprint: str, *, overwrite: bool) -> tuple[bool, Manifest | None]:
    """`raycap.output.commit.check_output` on a store: (reuse, manifest read). A committed
    output of the same inputs is reused, after its roll-forward is finished; one of
    other inputs is refused unless `overwrite`; objects without a manifest are always
    refused (no raycap output, or one whose move aside was cut short)."""
    try:
        files = client.files(output)
    except OSError as exc:
        raise OutputError(f"cannot list output {output} on its store: {bounded(exc, 240)}; check the store and rerun") from None
    if MOVED_NAME in files and finish_move(output):
        return False, None  # the leftover of a move aside that was cut short, now gone
    if not files:
        return False, None
    if MANIFEST_NAME not in files:
        raise OutputError(
            f"output {output} holds objects but no raycap manifest ({MANIFEST_NAME}): it is no raycap output (or "
            "one whose move aside was cut short, whose copy stands beside it); choose another output, or remove "
            "those objects"
        )
    try:
        manifest: Manifest | None = read_store_manifest(output)
    except OutputError:
        manifest = None
    if manifest is not None and manifest.fingerprint == fingerprint:
        roll_forward(output, manifest)
        return True, manifest
    if not overwrite:
        what = "different inputs" if manifest is not None else "an unreadable manifest"
        raise OutputError(
            f"output {output} already exists and was written from {what} (capture dirs, rollout ids or results, "
            "builder, model, delivery or record fields differ); choose another output or set overwrite: true to "
            "replace it (the old one is moved aside, not deleted)"
        )
    return False, manifest


def write_json(location: Location, value: Any) -> None:
    """A small JSON object (the summary), whole in one PUT."""
    try:
        client.put_bytes(location, (json.dumps(value, indent=2, sort_keys=False) + "\n").encode())
    except OSError as exc:
        raise store_fault(location, exc) from None


def remove_staging(staging: Location, names: Iterable[str] | None = None) -> None:
    """Best effort: remove an attempt's objects (a run that did not commit)."""
    try:
        client.delete_all(staging, names)
    except OSError:
        pass  # the next run that commits removes it


# --- the commit protocol's primitives on a store (`raycap.output.protocol.Backend`) ------------------------


class StoreBackend(Backend):
    """The primitives on an object store (see the module docstring): no lock file (the
    commit point decides between two writers), an attempt's prefix as staging, the
    manifest's conditional write as commit point, a roll-forward to finish."""

    fault_may_have_committed = True
    staging_needs_shared_fs = False

    def where(self, location: Location) -> Location:
        return location

    def resolved(self, location: Location) -> Location:
        return location

    def empty(self, location: Location) -> bool:
        return not holds_anything(location)

    def has_manifest(self, location: Location) -> bool:
        try:
            return client.exists(location.child(MANIFEST_NAME))
        except OSError as exc:
            raise OutputError(f"manifest cannot be read from its store ({exc})") from None

    @contextmanager
    def lock(self, location: Location) -> Iterator[OutputLock]:
        held = OutputLock(location)
        try:
            yield held
        finally:
            held.held = False

    def check_placement(self, location: Location, dirs: Any, elsewhere: Any) -> None:
        check_placement(location)

    def check_output(self, location: Location, inputs: Inputs, overwrite: bool) -> OutputCheck:
        reuse, found = check_output(location, inputs.fingerprint(), overwrite=overwrite)
        return OutputCheck(reuse, found if reuse else None)

    def new_staging(self, location: Location) -> Location:
        return attempt_location(location, new_attempt())

    def for_tasks(self, staging: Location) -> Location:
        return staging

    def open_staging(self, staging: Location) -> None:
        pass  # an attempt's prefix exists once its first object does

    def abort_staging(self, staging: Location) -> None:
        remove_staging(staging)

    def staged_as(self, staging: Location) -> str:
        return staging.name

    def check_staged(self, staging: Location, reported: dict[str, tuple[str, int]], keep_records: bool) -> None:
        check_staged(staging, reported)

    def stage_manifest(self, staging: Location, manifest: Manifest) -> None:
        pass  # the manifest is the commit point itself

    def occupied(self, location: Location) -> bool:
        return holds_anything(location)

    def commit_point(self, staging: Location, location: Location, manifest: Manifest) -> None:
        commit_point(location, manifest)

    def finish(self, location: Location, manifest: Manifest, during: Callable[[], None] | None = None) -> None:
        roll_forward(location, manifest, during)

    def named(self, location: Location) -> str:
        return location.uri

    def real(self, location: Location) -> Location:
        return location

    # --- reading what was committed (`raycap.output.objectstore.reads`) ---

    def manifest(self, location: Location) -> Manifest:
        return read_store_manifest(location)

    def committed_as(self, location: Location) -> str:
        return location.uri

    def committed_manifest(self, location: Location, manifest: Manifest | None) -> Manifest:
        return store_committed_manifest(location, manifest)

    def shards(self, location: Location, manifest: Manifest | None = None) -> list[Location]:
        return store_shards(location, manifest)

    def open_part(self, part: Location) -> Any:
        return open_store_shard(part)

    def visible_parquet(self, location: Location) -> list[Location] | None:
        return visible_parquet(location)

    def read_part(self, location: Location, part: Any) -> bytes:
        return read_store_part(location, part)

    def stream_staged_part(self, staging: Any, part: Any, write: Callable[[Any], Any]) -> None:
        write(read_store_part(staging, part))

    def for_workers(self, location: Location, shards: Any) -> tuple[list[str], Any]:
        # The file system goes with the paths, so the workers read with its settings.
        return [shard.fs_path for shard in shards], client.filesystem(location)

    def from_tasks(self, part: Location, here: Any) -> Location:
        return part  # a store's object is the same on every node

    def was_retired_from(self, location: Location) -> bool:
        return was_retired_from(location)

    def read_marker(self, location: Location) -> bytes:
        return read_marker(location)

    def write_marker(self, location: Location, record: dict[str, Any]) -> None:
        write_marker(location, record)

    def retired_outputs(self, location: Location) -> list[Location]:
        return store_retired_outputs(location)

    def supersede(self, location: Location) -> Location:
        return supersede(location)

    def set_aside(self, location: Location) -> Location:
        return set_aside(location)

    def write_summary(self, location: Location, summary: dict[str, Any]) -> None:
        write_json(summary_location(location), summary)

    def part(self, output: Any, name: str) -> Location:
        return output.child(name)

    def present(self, part: Any) -> bool:
        try:
            return client.exists(part)
        except OSError:
            return True  # unknown: not said to be missing

    def local_home(self, location: Location) -> Path:
        return Path(os.path.abspath(location.name))

    def spool_path(self, location: Location) -> Path:
        return Path(tempfile.gettempdir()) / f".raycap-{os.getpid()}-{location.name}.results.jsonl"

    def holds(self, location: Location, path: Path) -> bool:
        return False  # a local file is never inside a store's output

    def run_file(self, location: Location, path: Path) -> str | None:
        # The summary, lock and staging are in the store: the spool is the one local file.
        spool = self.spool_path(location)
        same = os.path.realpath(path) == os.path.realpath(spool)
        return "the results spool of a run on the output" if same else None


STORE = StoreBackend()
