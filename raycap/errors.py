"""Every exception raycap raises of its own, declared in one place and exported.

Each message is one line: what went wrong, naming the file, rollout or output, and the way
out. The classes derive from the built-in a caller would catch for that kind of fault
(ValueError for bad input, RuntimeError for a state that forbids the call).
"""

from __future__ import annotations

import json
from typing import Any

__all__ = [
    "OutputError",
    "OutputWriteError",
    "NoRollouts",
    "CaptureFileError",
    "CaptureTooLarge",
    "UnsafeFileError",
    "RecordFileError",
    "ResultsError",
    "ConfigError",
    "InspectError",
    "DirectoryBusy",
    "StepRefused",
    "PiecesLost",
    "NodesLost",
    "UnknownSubscription",
    "UntrustedJSONError",
    "UsageError",
    "CannotStart",
]


class OutputError(RuntimeError):
    """The output cannot be written or reused; the message is one line with the way out."""


class OutputWriteError(OutputError):
    """Writing the output failed on its file system (disk full, I/O error, read-only):
    a fault of the machine, not of any rollout, so the run fails and nothing is
    committed or retired; the message is one line naming the path and the way out."""


class NoRollouts(OutputError):
    """A rebuild asked not to commit an empty dataset (`allow_empty=False`) found no
    captured rollout in its capture directories: nothing was written."""


class CaptureFileError(ValueError):
    """A rollout's capture file is not a regular file (a symbolic link, FIFO, socket,
    device or directory). raycap never reads, writes, truncates or creates anything
    through such an entry, so the rollout fails to freeze and is masked."""


class CaptureTooLarge(ValueError):
    """A rollout's capture is larger than the caller's limit (reading: nothing of it was
    read), or a record would make it so (writing: nothing was written)."""


class UnsafeFileError(ValueError):
    """A file raycap was asked to read is not a regular file (a symbolic link, FIFO,
    socket, device or directory) or is larger than such a file may be; nothing of it was
    read. The message is one line naming the file and the way out."""


class RecordFileError(ValueError):
    """A record file that no stream wrote as it is: not a regular file, too large, or not
    in the record file's format. The rollout is held back, neither delivered nor
    retired, until someone looks."""


class ResultsError(ValueError):
    """A results file (or records iterable) that cannot be finalized as it is: a line
    that is not JSON, a record that is not a JSON value, fields of one name with two
    types, a file that is not a regular file or changed while it was read. The message
    is one line naming the file and the record, and the way out."""


class ConfigError(ValueError):
    """A job config that cannot be used; the message is one line."""


class InspectError(ValueError):
    """The path is not a readable raycap output; the message names it and the way out."""


class DirectoryBusy(RuntimeError):
    """Another stream consumes the directory."""


class StepRefused(OutputError, ValueError):
    """A commit's step output is refused: misplaced (the rules of
    `raycap.output.commit.check_placement`), or already holding other rows. Raised before the
    commit writes anything; the rows stay taken."""


class PiecesLost(Exception):
    """Built rollouts whose rows were lost with their node before they were taken: the
    stream does not deliver them (a stream that sees the node again does)."""

    def __init__(self, rollout_ids: list[str]):
        super().__init__(f"{len(rollout_ids)} built rollouts were lost with their node")
        self.rollout_ids = rollout_ids


class NodesLost(Exception):
    """A directory's node is gone: its pending work fails at once."""

    def __init__(self, nodes: set[str]):
        super().__init__(nodes)
        self.nodes = nodes


class UnknownSubscription(LookupError):
    """The subscription is not held by this actor (it ended, or the actor restarted)."""


class UntrustedJSONError(json.JSONDecodeError):
    """JSON raycap did not write cannot be read (see `loads_untrusted`). A
    `json.JSONDecodeError` (so a ValueError) whose text is one line without position."""

    def __init__(self, msg: str, doc: str = "", pos: int = 0) -> None:
        ValueError.__init__(self, msg)
        self.msg, self.doc, self.pos, self.lineno, self.colno = msg, doc, pos, 1, pos + 1

    def __reduce__(self) -> Any:
        return (type(self), (self.msg, self.doc, self.pos))

    def __str__(self) -> str:
        return self.msg


class UsageError(Exception):
    """Arguments the job cannot start with; the message is one line."""


class CannotStart(Exception):
    """The job could not start; the message is the one-line reason."""
