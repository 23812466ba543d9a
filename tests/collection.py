"""A rollout collection's results file with every case NeMo Gym's finalizer tells apart,
and the finalizer itself run record by record as the oracle (tests of raycap.runs.rollouts)."""

from __future__ import annotations

import asyncio
import copy
import json
import shutil
import warnings
from pathlib import Path

import pyarrow as pa

from raycap.capture.delivery import (
    capture_build_can_retire,
    finalize_rollout_token_capture,
    maybe_rollout_id_from_run_body,
)
from raycap.capture.records import TokenEntry
from raycap.capture.store import TokenCaptureStore


def with_columns(table: pa.Table, **columns: pa.Array) -> pa.Table:
    """`table` with these columns set (the record columns of SPEC §10.7, say): replaced
    where the rows carry them, appended where they do not."""
    for name, values in columns.items():
        index = table.schema.get_field_index(name)
        field = pa.field(name, values.type)
        table = table.append_column(field, values) if index < 0 else table.set_column(index, field, values)
    return table


MESSAGE = [{"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "served"}]}]


def _append_rollout(store: TokenCaptureStore, rollout_id: str, calls: int = 2) -> None:
    prompt = [1, 2, 3]
    for index in range(calls):
        generation = [40 + index, 41 + index]
        store.append(
            TokenEntry(
                rollout_id=rollout_id, model_call_id=f"call-{index}", prompt_token_ids=prompt,
                generation_token_ids=generation, generation_log_probs=[-0.5, -0.125],
                output_items=[{"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": f"t{index}"}]}],
                token_item_index=0, created_at=float(index),
            )
        )
        prompt = prompt + generation + [9, 9]


def _response(model: str = "policy") -> dict:
    return {"id": "resp-1", "model": model, "object": "response", "output": copy.deepcopy(MESSAGE), "usage": {"input_tokens": 3}}


def held_out_records(corpus_ids: list[str]) -> list:
    """A results file's records with every case the finalizer distinguishes."""
    records: list = []
    for n, rid in enumerate(corpus_ids):
        records.append({
            "_ng_task_index": n // 4, "_ng_rollout_index": n % 4, "_ng_rollout_id": rid, "reward": n / 8,
            "agent_ref": {"name": "swe"}, "response": _response("policy" if n % 3 else ""), "verdict": "pass" if n % 2 else "fail",
        })
    records += [
        # Index-derived ids, and attempts (0 adds nothing, a positive attempt "-a<n>").
        {"response": _response(), "_ng_task_index": 100, "_ng_rollout_index": 0, "reward": 1, "agent_ref": {"name": "é ✓"}},
        {"_ng_task_index": 100, "_ng_rollout_index": 1, "_ng_attempt_index": 1, "reward": 0.1 + 0.2, "response": _response()},
        {"_ng_task_index": 100, "_ng_rollout_index": 2, "_ng_attempt_index": 0, "reward": -0.0, "response": _response("")},
        # A record without a response.
        {"_ng_task_index": 100, "_ng_rollout_index": 3, "reward": True},
        # Malformed ids: masked as unusable, no row.
        {"_ng_rollout_id": "../etc", "reward": 2.0, "response": _response()},
        {"_ng_rollout_id": 7, "response": _response()},
        {"_ng_task_index": 1, "_ng_rollout_index": 1, "_ng_attempt_index": "x", "response": _response()},
        # No capture key.
        {"reward": 0.5, "response": _response(), "text": "🚀 ünïcödé \u2028"},
        # Inline token ids: with an id and a capture (redundant, retired), without an id
        # (left alone), and with an id whose capture is corrupt (left alone, kept).
        {"_ng_rollout_id": "inline-1", "response": {"model": "m", "output": [{"type": "message", "generation_token_ids": [5, 6]}]}},
        {"response": {"model": "m", "output": [{"type": "message", "generation_token_ids": [5]}]}},
        {"_ng_rollout_id": corpus_ids[9], "response": {"model": "m", "output": [{"generation_token_ids": [1]}]}},
        # No capture at all: a masked row ("capture contains no token records").
        {"_ng_rollout_id": "missing-1", "reward": 3, "response": _response()},
        # An id the store refuses (derived from a task index with a space).
        {"_ng_task_index": "a b", "_ng_rollout_index": 0, "response": _response()},
        # A repeated id: its own finalized copy and row.
        {"_ng_rollout_id": corpus_ids[0], "reward": 7.5, "response": _response("other"), "verdict": "rerun"},
        # Not an object, and a response that is not a dict.
        [1, 2.5, "three"],
        {"_ng_task_index": 100, "_ng_rollout_index": 4, "response": "served as text"},
    ]
    return records


def write_collection(fault_corpus, tmp_path: Path) -> tuple[Path, Path, Path, list]:
    """(captures, oracle copy of them, results file, its records)."""
    captures = tmp_path / "captures"
    shutil.copytree(fault_corpus.directory, captures)
    store = TokenCaptureStore(captures)
    for rid in ("100-0", "100-1-a1", "100-2", "100-3", "100-4", "inline-1"):
        _append_rollout(store, rid)
    oracle = tmp_path / "oracle"
    shutil.copytree(captures, oracle)
    records = held_out_records(list(fault_corpus.rollout_ids))
    results = tmp_path / "results.jsonl"
    with open(results, "wb") as handle:
        for n, record in enumerate(records):
            handle.write(json.dumps(record, ensure_ascii=False).encode() + b"\n")
            if n % 7 == 0:
                handle.write(b"   \n\n")  # whitespace-only lines are no records
    return captures, oracle, results, records


def gym_finalized(records: list, oracle: Path) -> tuple[list, set[str]]:
    """What NeMo Gym's finalizer makes of each record, one at a time on `oracle`, and the
    rollouts whose builds `capture_build_can_retire` allows."""
    store = TokenCaptureStore(oracle)
    out, retire = [], set()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for record in records:
            record = copy.deepcopy(record)
            built = asyncio.run(finalize_rollout_token_capture(record, store))
            if capture_build_can_retire(built):
                retire.add(maybe_rollout_id_from_run_body(record))
            out.append(record)
    return out, retire


def text(value, *paths) -> str:
    """JSON text of `value` (key order kept) with the capture directories' paths, which
    error texts name, made alike."""
    out = json.dumps(value, ensure_ascii=False)
    for path in paths:
        out = out.replace(str(path), "<dir>")
    return out
