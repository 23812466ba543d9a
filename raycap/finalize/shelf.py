"""A worker process's finalized records handed to the driver in shared memory, not read back from disk.

A records file drafted during a run (`raycap.finalize.recordsfile`) takes each batch's
records part in batch order. A part the driver wrote comes with its lines; a part a
fork wrote would otherwise be read back from the staging directory and hashed again:
for long agentic rollouts, half of 240 MB through the disk a second time, on the one
thread that drafts the file, which then finishes well after the last batch.

A `Shelf` is a shared anonymous mapping the driver makes before it forks a worker:
`SLOTS` page-aligned slots of `SLOT_BYTES`, each with a state byte in the first page.
Once a batch's part is durable, the worker copies the lines it was written from into a
free slot (`put`), marks it full and reports the slot with the batch
(`FinalizedBatch.handed`); the driver drafts from the slot (`Handed`) and frees it. One
writer and one reader per slot, so a byte of state is the whole protocol: the worker
sets it after the bytes, the driver clears it after its copy, and the report itself
crosses a pipe (a system call) between the two. A part larger than a slot, or one that
finds no slot free (the draft is behind), is not handed: the driver reads it back as
before. Slots are reused batch after batch, so a worker touches at most
`SLOTS * SLOT_BYTES` of new memory in a run, however large the file.

The mapping is never unmapped explicitly: a view still held by a draft keeps it, and
it goes with its last reference. This module does not import Ray.
"""

from __future__ import annotations

import mmap
from typing import Sequence

SLOTS = 2
SLOT_BYTES = 64 << 20
_HEADER = mmap.PAGESIZE  # the state bytes; the slots start page-aligned after it
FREE, FULL = 0, 1


class Shelf:
    """Slots shared between the driver and one fork of it (see the module docstring)."""

    def __init__(self, slots: int = SLOTS, slot_bytes: int = SLOT_BYTES) -> None:
        self.slots, self.slot_bytes = slots, slot_bytes
        self.memory = mmap.mmap(-1, _HEADER + slots * slot_bytes, flags=mmap.MAP_SHARED)

    def put(self, lines: Sequence[bytes]) -> tuple[int, int] | None:
        """In the worker: `lines`, each followed by a newline (as `write_records_part`
        writes them), copied into a free slot, which is then full: (slot, bytes). None
        when they do not fit a slot or no slot is free."""
        size = sum(len(line) for line in lines) + len(lines)
        if size > self.slot_bytes:
            return None
        memory = self.memory
        for slot in range(self.slots):
            if memory[slot] != FREE:
                continue
            at = _HEADER + slot * self.slot_bytes
            for line in lines:
                end = at + len(line)
                memory[at:end] = line
                memory[end] = 0x0A
                at = end + 1
            memory[slot] = FULL
            return slot, size
        return None

    def taken(self, slot: int, size: int) -> Handed:
        """In the driver: the bytes a worker reported in `slot`."""
        return Handed(self, slot, size)


class Handed:
    """A records part's bytes in a shelf's slot, as the driver holds them until the
    draft has copied them (`view`), then `release`d for the worker's next batch."""

    def __init__(self, shelf: Shelf, slot: int, size: int) -> None:
        self.shelf, self.slot, self.size = shelf, slot, size
        self.released = False

    def view(self) -> memoryview:
        """The part's bytes (release the view before `release`)."""
        start = _HEADER + self.slot * self.shelf.slot_bytes
        return memoryview(self.shelf.memory)[start : start + self.size]

    def release(self) -> None:
        """The slot is free again (once; later calls do nothing)."""
        if not self.released:
            self.released = True
            self.shelf.memory[self.slot] = FREE
