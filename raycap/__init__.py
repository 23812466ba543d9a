"""raycap: rebuild RL training trajectories from LLM token captures, on Ray.

What users call:

- `rebuild(capture_dirs, rollout_ids, ...)`: rows as one Arrow table; `Rebuilder` keeps
  placement and actors between calls (a training loop's session);
- `rebuild_to_output(capture_dirs, output, ...)`: the durable dataset writer (commit,
  summary, mask gate, retirement); `dataset` and `read_manifest` read what it wrote;
- `retire(capture_dirs, output)`: drop the captures a committed dataset holds;
- `token_source(capture_dir)` / `token_sink(capture_dir)`: the Ray-served TokenSource
  and TokenSink of one directory (NeMo Gym's `install_token_source`/`install_token_sink`
  take them);
- `DataParallelFeed`, `shard_batches`: fixed-shape token batches for data-parallel
  trainers, every rank the same number of steps;
- `RebuildOptions`, `CaptureDir`, `ExecutorChoice`: the values the calls take and report;
- the capture format (`TokenCaptureStore`, `TokenEntry`) and the seed's single-rollout
  API (`trajectories_for_rollout`, `trajectories_from_source`,
  `clear_token_captures_for_rollouts`, `token_id_capture_dirs_from_config`).

The core (records, store, builders, consumer, Arrow conversion) imports without Ray so
inference workers can use it; `rebuild` imports Ray only when a call runs on Ray, and the
cluster layer loads on first use.
"""

from raycap.builders import (
    BuildNotes,
    BuildOutput,
    Chain,
    ChainLink,
    assert_prefix_contiguity,
    per_request,
    prefix_merging,
    project_chain_to_output_items,
    project_main_chain_response,
    run_builder,
)
from raycap.capturedir import CaptureDir
from raycap.consumer import (
    TokenIdCaptureConfig,
    clear_token_captures_for_rollouts,
    rollout_id_from_record,
    token_id_capture_dirs_from_config,
    trajectories_for_rollout,
    trajectories_from_source,
)
from raycap.executor import ExecutorChoice
from raycap.options import RebuildOptions
from raycap.protocols import (
    TokenCaptureSnapshot,
    TokenSink,
    TokenSource,
    install_token_sink,
    install_token_source,
    installed_token_sink,
    installed_token_source,
)
from raycap.records import TOKEN_ENTRY_RECORD_SCHEMA_VERSION, TOKEN_FIELDS, TokenEntry, extract_token_fields
from raycap.store import TokenCaptureStore, validate_rollout_id

__all__ = [
    "BuildNotes",
    "BuildOutput",
    "Chain",
    "ChainLink",
    "DataParallelFeed",
    "TOKEN_ENTRY_RECORD_SCHEMA_VERSION",
    "TOKEN_FIELDS",
    "CaptureDir",
    "ExecutorChoice",
    "RebuildOptions",
    "Rebuilder",
    "Stream",
    "TokenCaptureSnapshot",
    "TokenCaptureStore",
    "TokenEntry",
    "TokenIdCaptureConfig",
    "TokenSink",
    "TokenSource",
    "assert_prefix_contiguity",
    "builds_from_table",
    "clear_token_captures_for_rollouts",
    "dataset",
    "extract_token_fields",
    "install_token_sink",
    "install_token_source",
    "installed_token_sink",
    "installed_token_source",
    "per_request",
    "prefix_merging",
    "project_chain_to_output_items",
    "project_main_chain_response",
    "read_manifest",
    "rebuild",
    "rebuild_to_output",
    "retire",
    "rollout_id_from_record",
    "run_builder",
    "shard_batches",
    "token_id_capture_dirs_from_config",
    "token_sink",
    "token_source",
    "trajectories_for_rollout",
    "trajectories_from_source",
    "validate_rollout_id",
]


def __getattr__(name: str):
    # Ray, pyarrow and the dataset layer load only when their API is used.
    if name == "builds_from_table":
        from raycap.arrow import builds_from_table

        return builds_from_table
    if name in ("dataset", "DataParallelFeed", "shard_batches"):
        from raycap import feed

        return getattr(feed, name)
    if name == "rebuild":
        # Decides without importing Ray whether the call runs in this process.
        from raycap.api import rebuild

        return rebuild
    if name == "Stream":
        from raycap.stream import Stream

        return Stream
    if name == "rebuild_to_output":
        from raycap.handoff import rebuild_to_output

        return rebuild_to_output
    if name == "read_manifest":
        from raycap.manifest import read_manifest

        return read_manifest
    if name in ("retire", "Rebuilder", "token_source"):
        from raycap.cluster import rebuild as _rebuild

        return getattr(_rebuild, name)
    if name == "token_sink":
        from raycap.cluster.sink import token_sink

        return token_sink
    raise AttributeError(f"module 'raycap' has no attribute {name!r}")
