"""The writer side on Ray: the TokenSink of a capture directory, served by its node actor.

A model server or an inference worker running as a Ray task or actor, on any node,
writes its captures through `token_sink(capture_dir)`: each call travels to the actor
pinned to the directory's node (`raycap.cluster.nodes.actor`), which writes through the
directory's `TokenCaptureStore`. The sink so makes the store's guarantees, not weaker
ones:

- `put(entry)` returns only once the record's line is fsynced on the directory's node;
- the same model call id with the same payload is a no-op, and a different payload
  fails with the store's ValueError (the rollout is marked incomplete);
- a put or begin_call after the rollout was frozen, or after it was retired, fails
  with the store's RuntimeError;
- `mark_incomplete` and `begin_call` are durable before they return.

Errors keep their type: what the store raised in the actor is raised here, not Ray's
wrapper, so a writer handles a local store and this sink alike. Only a lost actor or
node surfaces as a Ray error. Every call is safe for Ray to retry after an actor
restart, because the store makes each one idempotent or harmless to repeat.

The sink is a small value (the actor's handle and the path): it pickles, so a driver
can create it once and pass it to tasks and actors on every node, and each of them may
install it as its process-wide default (NeMo Gym's `install_token_sink`). It holds no
connection of its own. The node actor is detached and found by name (see
`raycap.cluster.nodes.actor`), so it outlives whoever started it.

A process outside Ray (a model server) builds one by configuration alone: `RayTokenSink`
takes keyword arguments only, the capture directory, an optional Ray address and an
optional connect timeout, which is what NeMo Gym's `token_id_capture.sink` /
`sink_kwargs` give:

    token_id_capture:
      enabled: true
      sink: raycap.cluster.sink:RayTokenSink
      sink_kwargs: {capture_dir: "rack=a3:/data/captures", address: "10.0.0.1:6379", connect_timeout_s: 30}

Constructing it joins the cluster (unless this process is connected already) and finds
the directory's node actor, or starts it: a wrong address or directory fails when the
server starts, not on its first request. A cluster address that does not answer within
`connect_timeout_s` seconds (default 30, `raycap.cluster.plumbing.connect.CONNECT_TIMEOUT_S`),
including one that accepts the connection and then says nothing, fails it with a
one-line ConnectionError naming the address, and leaves Ray unconnected in the process. Its calls are coroutines, awaited on whatever
event loop the server runs.

Records are converted to raycap's `TokenEntry` before they leave the caller: a record
of NeMo Gym's own `TokenEntry` class (the same fields) is accepted, and one that fails
validation raises pydantic's ValidationError in the writer, not in the actor.
"""

from __future__ import annotations

from typing import Any

import ray

from raycap.capture.records import TokenEntry
from raycap.cluster.nodes.actor import DirectoryHandle, _unwrapped
from raycap.cluster.nodes.fleet import serve_one


def _as_entry(entry: Any) -> TokenEntry:
    if isinstance(entry, TokenEntry):
        return entry
    if hasattr(entry, "model_dump"):  # another TokenEntry class of the same format
        return TokenEntry.model_validate(entry.model_dump())
    if isinstance(entry, dict):
        return TokenEntry.model_validate(entry)
    raise TypeError(f"a token sink takes a TokenEntry (or its dict), not {type(entry).__name__}")


class ActorTokenSink:
    """The async TokenSink protocol over one directory of a node actor."""

    def __init__(self, handle: DirectoryHandle):
        self.handle = handle

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.handle.path!r})"

    @staticmethod
    async def _wait(ref: Any) -> Any:
        try:
            return await ref
        except ray.exceptions.RayTaskError as exc:
            raise _unwrapped(exc) from None

    async def put(self, entry: TokenEntry) -> None:
        await self._wait(self.handle.put(_as_entry(entry)))

    async def mark_incomplete(self, rollout_id: str, model_call_id: str = "") -> None:
        await self._wait(self.handle.mark_incomplete(rollout_id, model_call_id))

    async def begin_call(self, rollout_id: str, model_call_id: str) -> None:
        await self._wait(self.handle.begin_call(rollout_id, model_call_id))

    async def close(self) -> None:
        """Nothing to release: every acknowledged call is already durable, and the actor
        is shared with other writers and readers, so it stays up."""


class RayTokenSink(ActorTokenSink):
    """The TokenSink of one capture directory (`NODE:PATH` or a plain absolute path),
    served by the actor of the node that holds it; `address` is the cluster to join
    (RAY_ADDRESS, or an embedded Ray, when None and this process is not connected yet),
    refused when it does not answer within `connect_timeout_s` seconds (default 30).
    The directory must exist on its node."""

    def __init__(self, capture_dir: Any, address: str | None = None, connect_timeout_s: float | None = None) -> None:
        super().__init__(serve_one(capture_dir, address=address, caller="RayTokenSink",
                                   connect_timeout_s=connect_timeout_s))


def token_sink(capture_dir: Any, *, address: str | None = None, connect_timeout_s: float | None = None) -> RayTokenSink:
    """The TokenSink of one capture directory, served by the actor of its node
    (`RayTokenSink(capture_dir, address=address, connect_timeout_s=connect_timeout_s)`)."""
    return RayTokenSink(capture_dir, address=address, connect_timeout_s=connect_timeout_s)
