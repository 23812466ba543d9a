"""An output's durable files: a reader sees the old file or the whole new one, and a rename survives a crash.

`replace_durably` writes through a hidden temp file beside the target: write, fsync,
rename, fsync the directory; `write_json_durably` does so with JSON. With `direct`, the
bytes go to the disk around the page cache (`raycap.output.unbuffered`), as shards,
records parts and records files are written. `rename_durably` renames and fsyncs the new
parent. A fault of the file system on the way raises `OutputWriteError` naming the path:
it must not become a rollout's row. (A capture directory's files are replaced by
`raycap.capture.files.replace_file`.)

This module does not import Ray.
"""

from __future__ import annotations

import json
import os
import uuid
from pathlib import Path
from typing import Any, Callable

from raycap.capture.files import fsync_dir
from raycap.output.faults import OutputError, write_fault
from raycap.output.unbuffered import UnbufferedFile


def replace_durably(path: Path, write: Callable[[Any], None], *, direct: bool = False) -> int:
    """Write `path` through a hidden temp file beside it: write, fsync, rename, fsync the
    directory. A reader sees the old file or the whole new one; returns the new size.
    `direct`: around the page cache where the file system allows it (see the module
    docstring)."""
    temp = path.with_name(f".{path.name}.tmp-{uuid.uuid4().hex}")
    try:
        if direct:
            with UnbufferedFile(temp) as handle:
                write(handle)
                size = handle.finish()
        else:
            with open(temp, "xb") as handle:
                write(handle)
                handle.flush()
                os.fsync(handle.fileno())
                size = os.fstat(handle.fileno()).st_size
        os.replace(temp, path)
        fsync_dir(path.parent)
    except BaseException as exc:
        try:
            temp.unlink(missing_ok=True)
        except OSError:
            pass  # the file system is failing already; the next run removes the temp file
        if isinstance(exc, OSError) and not isinstance(exc, OutputError):
            # Whatever the writer raised (pyarrow's ArrowIOError is an OSError too), the
            # fault is the output's file system's, and must not become a rollout's row.
            raise write_fault(path, exc) from None
        raise
    return size


def write_json_durably(path: str | os.PathLike, value: Any) -> None:
    """Replace `path` atomically with `value` as indented JSON (temp file, fsync, rename)."""
    data = (json.dumps(value, indent=2, sort_keys=False) + "\n").encode()
    replace_durably(Path(path), lambda handle: handle.write(data))


def rename_durably(source: Path, target: Path) -> None:
    try:
        os.rename(source, target)
        fsync_dir(target.parent)
    except OSError as exc:
        raise write_fault(target, exc) from None
