"""An output's bulk files moved around the page cache (`raycap.output.unbuffered`, `replace_durably(direct=True)`)."""

from __future__ import annotations

import errno
import fcntl
import hashlib
import os
import random

import pytest

from raycap.output import unbuffered
from raycap.output.durable import replace_durably
from raycap.output.faults import OutputWriteError
from raycap.output.shards import write_staged
from raycap.output.unbuffered import CHUNK as _CHUNK
from raycap.output.unbuffered import read_chunks

SIZES = [0, 1, 4095, 4096, 4097, _CHUNK - 1, _CHUNK, _CHUNK + 1, 3 * _CHUNK + 12345]


def _pieces(data: bytes, rng: random.Random) -> list[bytes]:
    """`data` cut at random places, as a writer hands over lines and their newlines."""
    out, at = [], 0
    while at < len(data):
        step = rng.choice([1, 7, 4096, 65_537, _CHUNK + 3])
        out.append(data[at : at + step])
        at += step
    return out


@pytest.mark.parametrize("size", SIZES)
def test_a_direct_file_holds_exactly_its_bytes_whatever_the_writes(tmp_path, size):
    rng = random.Random(size)
    data = rng.randbytes(size)
    target = tmp_path / "part.jsonl"
    target.write_bytes(b"an older attempt")

    def write(handle):
        for piece in _pieces(data, rng):
            assert handle.write(memoryview(piece)) == len(piece)
        assert handle.tell() == size

    assert replace_durably(target, write, direct=True) == size
    assert target.read_bytes() == data
    assert os.listdir(tmp_path) == ["part.jsonl"]  # no temp file left beside it


def test_the_staged_digest_and_size_are_those_of_the_file(tmp_path):
    data = random.Random(3).randbytes(2 * _CHUNK + 999)
    (tmp_path / ".records").mkdir()
    size, digest = write_staged(tmp_path, ".records/part-00000.jsonl", lambda handle: handle.write(data), "finalizes")
    written = (tmp_path / ".records" / "part-00000.jsonl").read_bytes()
    assert (size, digest) == (len(written), hashlib.sha256(written).hexdigest())
    assert written == data


def test_a_large_file_goes_around_the_page_cache_and_a_small_one_through_it(tmp_path, monkeypatch):
    probe = os.open(tmp_path / "probe", os.O_WRONLY | os.O_CREAT | os.O_DIRECT, 0o600)
    os.close(probe)  # this file system takes O_DIRECT (else the open raised)
    real = unbuffered.UnbufferedFile._out
    flags: list[int] = []

    def out(self, length):
        flags.append(fcntl.fcntl(self.fd, fcntl.F_GETFL))
        real(self, length)

    monkeypatch.setattr(unbuffered.UnbufferedFile, "_out", out)
    replace_durably(tmp_path / "part", lambda handle: handle.write(b"x" * (2 * _CHUNK + 10_000)), direct=True)
    assert len(flags) == 3 and all(f & os.O_DIRECT for f in flags)
    flags.clear()
    replace_durably(tmp_path / "shard", lambda handle: handle.write(b"x" * 10_000), direct=True)
    assert len(flags) == 1 and not flags[0] & os.O_DIRECT
    assert (tmp_path / "part").stat().st_size == 2 * _CHUNK + 10_000 and (tmp_path / "shard").stat().st_size == 10_000


def test_a_file_system_that_refuses_o_direct_at_the_open_gets_the_file_through_the_page_cache(tmp_path, monkeypatch):
    real_open = os.open

    def refusing(path, flags, *args, **kwargs):
        if flags & os.O_DIRECT:
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_open(path, flags, *args, **kwargs)

    monkeypatch.setattr(unbuffered.os, "open", refusing)
    data = random.Random(5).randbytes(_CHUNK + 5000)
    assert replace_durably(tmp_path / "p", lambda handle: handle.write(data), direct=True) == len(data)
    assert (tmp_path / "p").read_bytes() == data


def test_a_file_system_that_refuses_an_o_direct_write_gets_the_rest_through_the_page_cache(tmp_path, monkeypatch):
    real_write = os.write
    refused = []

    def refusing(fd, data):
        if fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_DIRECT and len(refused) < 1:
            refused.append(len(data))
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_write(fd, data)

    monkeypatch.setattr(unbuffered.os, "write", refusing)
    data = random.Random(6).randbytes(2 * _CHUNK + 77)
    assert replace_durably(tmp_path / "p", lambda handle: handle.write(data), direct=True) == len(data)
    assert refused and (tmp_path / "p").read_bytes() == data


def test_a_write_that_fails_leaves_no_file_and_raises_the_outputs_write_error(tmp_path, monkeypatch):
    def full(fd, data):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(unbuffered.os, "write", full)
    with pytest.raises(OutputWriteError, match="No space left on device"):
        replace_durably(tmp_path / "p", lambda handle: handle.write(b"y" * (_CHUNK + 1)), direct=True)
    assert os.listdir(tmp_path) == []
    monkeypatch.undo()
    # The buffer went back for the next file, which is whole.
    data = b"z" * 70_000
    assert replace_durably(tmp_path / "p", lambda handle: handle.write(data), direct=True) == len(data)
    assert (tmp_path / "p").read_bytes() == data


def test_a_fork_and_its_parent_writing_at_once_each_write_their_own_bytes(tmp_path):
    # A buffer made before a fork, then used by both processes at once: the bytes that
    # reached the files were sometimes the other process's (forked finalize workers on a
    # second call in one process wrote records parts that failed their own digests).
    def write_files(tag: str, seed: int) -> None:
        rng = random.Random(seed)
        for k in range(6):
            data = rng.randbytes(_CHUNK + rng.randrange(3 * _CHUNK))
            replace_durably(tmp_path / f"{tag}-{k}", lambda handle, data=data: handle.write(data), direct=True)

    write_files("warm", 0)  # the buffers exist before the fork
    pid = os.fork()
    if pid == 0:
        try:
            write_files("child", 1)
        finally:
            os._exit(0)
    write_files("parent", 2)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    for tag, seed in (("warm", 0), ("child", 1), ("parent", 2)):
        rng = random.Random(seed)
        for k in range(6):
            assert (tmp_path / f"{tag}-{k}").read_bytes() == rng.randbytes(_CHUNK + rng.randrange(3 * _CHUNK)), (tag, k)


@pytest.mark.parametrize("size", SIZES)
def test_chunks_read_around_the_page_cache_are_the_files_bytes_up_to_the_limit(tmp_path, size):
    data = random.Random(size + 1).randbytes(size)
    (tmp_path / "f").write_bytes(data)
    for limit in (size + 1, size, max(0, size - 5000)):
        fd = os.open(tmp_path / "f", os.O_RDONLY)
        try:
            got = b"".join(bytes(chunk) for chunk in read_chunks(fd, limit))
        finally:
            os.close(fd)
        assert got == data[:limit], (size, limit)


def test_a_file_system_that_refuses_an_o_direct_read_gets_read_through_the_page_cache(tmp_path, monkeypatch):
    data = random.Random(9).randbytes(2 * _CHUNK + 3)
    (tmp_path / "f").write_bytes(data)
    real_readv = os.readv
    refused = []

    def refusing(fd, buffers):
        if fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_DIRECT:
            refused.append(fd)
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_readv(fd, buffers)

    monkeypatch.setattr(unbuffered.os, "readv", refusing)
    fd = os.open(tmp_path / "f", os.O_RDONLY)
    try:
        assert b"".join(bytes(chunk) for chunk in read_chunks(fd, len(data) + 1)) == data
    finally:
        os.close(fd)
    assert refused


def test_a_parquet_file_larger_than_a_buffer_reads_back_whole(tmp_path):
    # pyarrow's writer hands the file its own buffers, in pieces of its choosing.
    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq

    rng = np.random.default_rng(4)
    table = pa.table({"token_ids": pa.array(list(rng.integers(0, 1 << 40, size=(400, 4000))), type=pa.list_(pa.int64()))})
    (tmp_path / "data").mkdir()
    size, digest = write_staged(tmp_path, "data/part-000000.parquet", lambda handle: pq.write_table(table, handle), "builds")
    written = tmp_path / "data" / "part-000000.parquet"
    assert size == written.stat().st_size > 2 * _CHUNK
    assert digest == hashlib.sha256(written.read_bytes()).hexdigest()
    assert pq.read_table(written).equals(table)
