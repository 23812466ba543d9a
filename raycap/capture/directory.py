"""Capture-directory specs, parsed once into a value: no layer parses a spec again.

A directory is given as a plain path (a relative one is resolved against the driver's
working directory when it is parsed), as `NODE:/abs/path` (NODE matched against
the Ray nodes, see `raycap.cluster.plumbing.placement`) or as a mapping {path, node}; its label is
the spec it was given as (a relative path: the absolute path it resolved to), which is
how rows, retirement and logs name it. A path with a `..` component is refused: the
kernel resolves `..` after the symlink before it, and on another node the links cannot be
seen from here, so no spelling of it could be trusted to name the directory the nodes
open. `.` components, repeated and trailing slashes are normalised away.
`capture_dirs` is the front door's check of a whole list: it refuses a lone string (a
path would be read as a list of one-character paths) and an empty list, and lists two
plain paths that resolve to the same real directory once, since their rollouts would
otherwise be built twice.

`local_paths` says whether the directories can be read in this process: their paths, or
the reason they cannot, as a value.

No file raycap writes lands among captures: `capture_dir_holding` is the one test of a
path (placed as the kernel will place it, `placed_path`) against the directories, a
`NODE:/path` as much as a plain one (on one machine or a shared file system its path is
this machine's), and `refuse_capture_place` applies it to a file raycap writes
(records_file, inspect's PNG). This module does not import Ray.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Iterable, Mapping

from raycap.capture.untrusted import bounded_repr


@dataclass(frozen=True)
class CaptureDir:
    """A capture directory and, optionally, the node matcher that says where it lives."""

    path: str
    node: str | None = None

    @property
    def label(self) -> str:
        """How rows, retirement and logs name this directory (the spec it was given as)."""
        return self.path if self.node is None else f"{self.node}:{self.path}"

    @classmethod
    def parse(cls, spec: Any) -> "CaptureDir":
        """Read `/abs/path`, `rel/path` (resolved against the working directory),
        `NODE:/abs/path`, a mapping {path, node} or a CaptureDir."""
        if isinstance(spec, CaptureDir):
            return spec
        if isinstance(spec, Mapping):
            unknown = set(spec) - {"path", "node"}
            if unknown or "path" not in spec:
                raise ValueError(
                    f"capture directory {bounded_repr(spec)}: expected keys 'path' and optionally 'node'"
                )
            path, node = os.fspath(spec["path"]), spec.get("node")
        else:
            text = os.fspath(spec)
            node, path = None, text
            # A plain path may itself contain ":/"; only a spec that does not start with
            # "/" carries a node part.
            if not text.startswith("/") and ":/" in text:
                node, rest = text.split(":/", 1)
                path = "/" + rest
        # Checked before a relative path is made absolute: abspath drops '..' by text.
        if ".." in path.split("/"):
            raise ValueError(
                f"capture directory {bounded_repr(spec)} has a '..' component, which the file system resolves after "
                "any symlink before it, so it may not name the directory it spells; give the path without '..'"
            )
        if not os.path.isabs(path):
            # A plain local path is resolved against this (the driver's) working
            # directory, as Ray Data and pyarrow resolve one. A path on a node must be
            # absolute, and so must anything that reads like NODE:path.
            if node is not None or ":" in path.split("/", 1)[0]:
                raise ValueError(
                    f"capture directory {bounded_repr(spec)} is not an absolute path; a directory on a node is "
                    "given as NODE:/abs/path"
                )
            path = os.path.abspath(path)
        if node is not None and not str(node).strip():
            raise ValueError(f"capture directory {bounded_repr(spec)} has an empty node part; give NODE:/abs/path")
        return cls(os.path.normpath(path), str(node).strip() if node is not None else None)


def capture_dirs(specs: Iterable[Any]) -> tuple[CaptureDir, ...]:
    """Parse a list of directory specs; plain paths that resolve to one real directory
    are one directory (the first spec's label is kept).

    Raises TypeError for a single str/bytes given as the list, ValueError for an empty
    list or a spec on a node that is not an absolute path."""
    if isinstance(specs, (str, bytes, os.PathLike)):
        raise TypeError(
            f"capture directories must be a list of paths, not the single {type(specs).__name__} {bounded_repr(specs)}; "
            "wrap it in a list"
        )
    parsed: list[CaptureDir] = []
    seen: set[str] = set()
    for spec in specs:
        d = CaptureDir.parse(spec)
        if d.node is None:
            real = os.path.realpath(d.path)
            if real in seen:
                continue
            seen.add(real)
        parsed.append(d)
    if not parsed:
        raise ValueError("no capture directories given; pass at least one capture directory")
    return tuple(parsed)


@dataclass(frozen=True)
class LocalPaths:
    """The directories as paths this process can read, or why it cannot read them."""

    paths: tuple[str, ...] = ()
    why_not: str = ""

    @property
    def readable(self) -> bool:
        return not self.why_not


def local_paths(dirs: Iterable[CaptureDir]) -> LocalPaths:
    """Whether every directory is a plain path that exists on this machine."""
    paths = []
    for d in dirs:
        if d.node is not None:
            return LocalPaths(why_not=f"capture directory {d.label} names a node")
        if not os.path.isdir(d.path):
            return LocalPaths(why_not=f"capture directory {d.path} is not on this machine")
        paths.append(d.path)
    return LocalPaths(tuple(paths))


def missing_plain_path(dirs: Iterable[CaptureDir]) -> str | None:
    """A plain-path directory (no node) that is not on this machine, if any."""
    return next((d.path for d in dirs if d.node is None and not os.path.isdir(d.path)), None)


# --- where raycap may write -------------------------------------------------------------------


def _within(path: str, directory: str) -> bool:
    return path == directory or path.startswith(directory.rstrip(os.sep) + os.sep)


def placed_path(path: str | os.PathLike) -> str:
    """Where the kernel puts a file written at `path`: its folder resolved the way the
    kernel walks it (each link before the `..` after it, so `lnk/..` is the link's
    target's parent, not the folder `lnk` sits in), then the name itself unresolved (a
    file renamed there replaces a link of that name rather than following it)."""
    path = os.fspath(path)
    if not os.path.isabs(path):
        path = os.path.join(os.getcwd(), path)  # not abspath: it would fold `..` before the links
    folder, name = os.path.split(path)
    if name in ("", ".", ".."):
        return os.path.realpath(path)
    return os.path.join(os.path.realpath(folder), name)


def capture_dir_holding(path: str | os.PathLike, dirs: Iterable[tuple[str, str]]) -> str | None:
    """The label of the capture directory among `dirs` ((label, path) pairs) that `path`
    is or lies inside, or None. Every directory counts, whichever way it was named: the
    path of a `NODE:/path` is this machine's too on one machine or a shared file system,
    and writing there would overwrite captures. `path` is resolved first, as the kernel
    will (`placed_path`, and through a link at its name too), and each directory both as
    written (absolute, normalized) and resolved, so neither a link nor `..` hides one in
    the other."""
    placed = placed_path(path)
    forms = {placed, os.path.realpath(placed)}
    for label, directory in dirs:
        bases = {os.path.normpath(os.fspath(directory)), os.path.realpath(os.fspath(directory))}
        if any(_within(form, base) for form in forms for base in bases):
            return label
    return None


def holds_captures(directory: str | os.PathLike) -> bool:
    """Whether `directory` directly holds an entry named like a capture file
    (`*.tokens.*`): a capture directory, whether or not this run was given it."""
    try:
        with os.scandir(directory) as entries:
            return any(".tokens." in entry.name for entry in entries)
    except OSError:
        return False


def refuse_capture_place(path: str | os.PathLike, dirs: Iterable[CaptureDir], what: str) -> None:
    """ValueError (one line) when a file raycap is asked to write at `path` (`what`
    names it: "records_file", "--png") would land among captures: named like a capture
    file, inside one of `dirs` (either form), or in a directory holding capture files."""
    placed, written = placed_path(path), os.path.abspath(os.fspath(path))
    shown = written if placed == written else f"{written} (placed at {placed})"
    label = capture_dir_holding(placed, [(d.label, d.path) for d in dirs])
    if label is None and ".tokens." in os.path.basename(placed):
        raise ValueError(f"{what} {shown} is named like a capture file (*.tokens.*); write it under another name")
    if label is None and holds_captures(os.path.dirname(placed)):
        label = os.path.dirname(placed)
    if label is not None:
        raise ValueError(f"{what} {shown} is inside capture directory {label}; write it outside every capture directory")
