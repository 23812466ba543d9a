"""A worker's records part handed to its driver in shared memory (raycap.finalize.shelf)."""

from __future__ import annotations

import os

from raycap.finalize.shelf import Shelf


def test_a_fork_hands_a_parts_bytes_and_a_slot_comes_back_once_the_driver_released_it():
    shelf = Shelf(slots=2, slot_bytes=64)
    batches = [[b'{"a":1}', b'{"b":2}'], [b'{"c":3}'], [b'{"d":4}']]
    pipe_read, pipe_write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the worker: puts each batch's lines, reports where they went
        try:
            spots = [shelf.put(lines) for lines in batches]
            os.write(pipe_write, repr(spots).encode())
        finally:
            os._exit(0)
    os.close(pipe_write)
    spots = eval(os.read(pipe_read, 1024).decode())  # noqa: S307 - the fork's own repr of a list of tuples
    os.close(pipe_read)
    os.waitpid(pid, 0)
    # Two slots: the third batch found none free and is not handed (the driver reads it back).
    assert spots == [(0, 16), (1, 8), None]
    first, second = shelf.taken(*spots[0]), shelf.taken(*spots[1])
    with first.view() as view:
        assert bytes(view) == b'{"a":1}\n{"b":2}\n'
    with second.view() as view:
        assert bytes(view) == b'{"c":3}\n'
    first.release()
    first.release()  # once is enough; a second release does not free a slot it no longer has
    assert shelf.put([b'{"e":5}']) == (0, 8)
    assert shelf.put([b'{"f":6}']) is None  # slot 1 is still the driver's
    second.release()
    assert shelf.put([b'{"f":6}']) == (1, 8)


def test_lines_larger_than_a_slot_are_not_handed():
    shelf = Shelf(slots=1, slot_bytes=8)
    assert shelf.put([b"1234567"]) == (0, 8)  # exactly a slot, its newline included
    shelf.taken(0, 8).release()
    assert shelf.put([b"12345678"]) is None
    assert shelf.put([b"1234", b"567"]) is None  # each line's newline counts
