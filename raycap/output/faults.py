"""What goes wrong with an output: OutputError, whose one-line message names it and the way out.

`OutputWriteError` is a fault of the output's file system while writing (disk full, I/O
error, read-only): a fault of the machine, never a rollout's masked row, so the run fails
and nothing is committed or retired. `write_fault` makes one from the OSError, naming the
output the user chose rather than only its hidden staging directory.

The errors sit below every module that writes or reads an output (`raycap.output.durable`,
`raycap.output.shards`, `raycap.output.manifest`, `raycap.output.commit`), so that each can raise them.

This module does not import Ray.
"""

from __future__ import annotations

import os
from pathlib import Path

from raycap.errors import (
    NoRollouts,  # noqa: F401 - raised here, declared with the others
    OutputError,  # noqa: F401 - raised here, declared with the others
    OutputWriteError,  # noqa: F401 - raised here, declared with the others
)


def write_fault(path: str | os.PathLike, exc: OSError) -> OutputWriteError:
    path = Path(path)
    reason = exc.strerror or str(exc) or type(exc).__name__
    code = f" (errno {exc.errno})" if exc.errno else ""
    what = str(path)
    for part in (path, *path.parents):
        if part.name.startswith(".") and part.name.endswith(".staging"):
            # Name the output the user chose, not only its hidden staging directory.
            what = f"output {part.with_name(part.name[1 : -len('.staging')])} ({path})"
            break
    return OutputWriteError(
        f"cannot write {what}: {reason}{code}; free space on (or fix) that file system, or choose another "
        "output, and rerun"
    )


def store_fault(location: object, exc: BaseException) -> OutputWriteError:
    """A fault of an object store while writing the output at `location` (its URI)."""
    from raycap.capture.untrusted import bounded

    return OutputWriteError(
        f"cannot write output {location} on its store: {bounded(exc, 240)}; check the store (endpoint, "
        "credentials, permissions) and rerun"
    )
