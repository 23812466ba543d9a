"""The writer side on Ray: the TokenSink of a capture directory, served by its node actor.

- `token_sink(capture_dir)` gives a sink whose calls travel to the directory's node
  actor (`raycap.cluster.nodes.actor`), which writes through the directory's store: the
  store's guarantees hold (a put returns once its line is fsynced there; a reused call
  id with another payload fails; a put after freeze or retire fails).
- Errors keep their type: what the store raised is raised here, not Ray's wrapper.
- The sink is a small picklable value; tasks and actors may install it as their default.
- A process outside Ray builds one from configuration (`RayTokenSink`, keyword
  arguments only), as NeMo Gym's `token_id_capture.sink` names it:

    token_id_capture:
      enabled: true
      sink: raycap.cluster.sink:RayTokenSink
      sink_kwargs: {capture_dir: "rack=a3:/data/captures", address: "10.0.0.1:6379", connect_timeout_s: 30}

  Constructing it joins the cluster and finds or starts the actor, so a wrong address
  or directory fails at start-up; an address that does not answer within
  `connect_timeout_s` raises a one-line ConnectionError.
- Records are validated as raycap's `TokenEntry` in the writer, not in the actor.

The contract in full: docs/internals.md ("The Ray-served sink").
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
