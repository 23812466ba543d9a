"""What a builder returns: `BuildOutput(chains, quarantined, notes)` with typed
`BuildNotes`, its `Chain`s and their `ChainLink`s, NeMo Gym's shapes name for name.

`Chain.root_prompt` and `ChainLink.interstitial` read as lists of ints. Underneath they
hold slices of the reader's int64 arrays; a list is made only when someone reads the
attribute, so the bulk row path, which projects through the arrays, never makes one.
`ReadEntries` carries the entries a reader parsed together with their arrays.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Sequence

import numpy as np

from raycap.capture.records import CallArrays, TokenEntry, int_array


class _Ids:
    """A dataclass field of token ids that reads as `list[int]` and may be stored as an
    int64 array: the builders hand out slices of the reader's arrays, and only a caller
    who reads the attribute pays for a list. The list is made once, on first read.

    `array_of(obj, name)` gives the array form (converted once, the other way, when the
    field was given a list), so projection never goes through lists."""

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name
        self.slot = f"_{name}_ids"

    def __get__(self, obj: Any, owner: type | None = None) -> list[int]:
        if obj is None:
            raise AttributeError(self.name)  # a required field: no default
        value = obj.__dict__[self.slot]
        if isinstance(value, np.ndarray):
            value = value.tolist()
            obj.__dict__[self.slot] = value
        return value

    def __set__(self, obj: Any, value: Any) -> None:
        if isinstance(value, np.ndarray):
            obj.__dict__[self.slot + "_array"] = value
        else:
            value = list(value)
            obj.__dict__.pop(self.slot + "_array", None)
        obj.__dict__[self.slot] = value


def _array_of(obj: Any, name: str) -> np.ndarray:
    """The ids of an `_Ids` field as an array, without making a list."""
    slot = f"_{name}_ids"
    array = obj.__dict__.get(slot + "_array")
    if array is None:
        array = int_array(obj.__dict__[slot])
        obj.__dict__[slot + "_array"] = array
    return array


@dataclass(frozen=True)
class ChainLink:
    """One call of a chain. `interstitial` is the prompt ids added since the parent's
    prompt and generation (tool output, user turns); empty for the root."""

    entry: TokenEntry
    interstitial: list[int] = _Ids()  # type: ignore[assignment]
    # The call's arrays as the builder already converted them, so projection does not
    # convert the token lists again; None for links made by hand.
    arrays: CallArrays | None = field(default=None, repr=False, compare=False, kw_only=True)

    @property
    def interstitial_array(self) -> np.ndarray:
        return _array_of(self, "interstitial")


@dataclass(frozen=True)
class Chain:
    """One trajectory: `root_prompt`, then each link's interstitial ids and generation."""

    chain_id: str
    links: list[ChainLink]
    root_prompt: list[int] = _Ids()  # type: ignore[assignment]

    @property
    def root_prompt_array(self) -> np.ndarray:
        return _array_of(self, "root_prompt")

    def validate(self) -> None:
        """Refuse a chain whose links do not pair every generated id with one log prob:
        ValueError naming the first such call. Records are checked when read, so only a
        link made by hand (or a record changed since) can fail here."""
        for link in self.links:
            entry = link.entry
            n_logprobs, n_tokens = len(entry.generation_log_probs), len(entry.generation_token_ids)
            if n_logprobs != n_tokens:
                raise ValueError(f"log-prob/token length mismatch on {entry.model_call_id}: {n_logprobs} vs {n_tokens}")


@dataclass
class BuildNotes:
    """What a builder reports besides its chains (SPEC section 3).

    `per_request` records only `builder` and `chains`; its other fields keep their
    defaults and mean nothing (`merged` is False), so a metric never reads them as a
    measured zero. Typed, so a renamed field fails loudly instead of reading as zero."""

    builder: str
    roots: int = 0
    chains: int = 0
    generated_tokens_captured: int = 0
    generated_tokens_delivered: int = 0
    delivered_fraction: float = 0.0
    unresolved_retries: list[str] = field(default_factory=list)
    empty_generation_calls: list[str] = field(default_factory=list)

    @property
    def merged(self) -> bool:
        """Whether the builder chained calls, so roots and token counts were measured."""
        return self.builder != "per_request"


@dataclass(frozen=True)
class BuildOutput:
    chains: list[Chain]
    quarantined: list[str]
    notes: BuildNotes


class ReadEntries(list):
    """Entries as a reader parsed them, remembering the arrays it converted (one per
    entry), so a builder reached through a public seam (`run_builder(entries, builder)`)
    does not convert every token list again. The arrays are used only while the list
    still holds exactly the same entry objects: a caller that filters, reorders or
    replaces entries gets a fresh conversion. Entries are read-only to builders."""

    def __init__(self, entries: Sequence[TokenEntry], arrays: Sequence[CallArrays]) -> None:
        super().__init__(entries)
        self._entries = tuple(entries)
        self._arrays = list(arrays)

    def converted(self) -> list[CallArrays] | None:
        if len(self) != len(self._entries) or any(a is not b for a, b in zip(self, self._entries)):
            return None
        return list(self._arrays)


def call_arrays(entries: Sequence[TokenEntry]) -> list[CallArrays]:
    if isinstance(entries, ReadEntries) and (arrays := entries.converted()) is not None:
        return arrays
    return [CallArrays.of(entry) for entry in entries]
