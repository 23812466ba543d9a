"""raycap: rebuild RL training trajectories from LLM token captures, on Ray.

The core (records, store, builders, consumer, Arrow conversion) imports without Ray so
inference workers can use it; `rebuild` and the cluster layer import Ray on first use.
"""

from raycap.builders import (
    assert_prefix_contiguity,
    per_request,
    prefix_merging,
    project_chain_to_output_items,
    project_main_chain_response,
    run_builder,
)
from raycap.consumer import (
    TokenIdCaptureConfig,
    clear_token_captures_for_rollouts,
    rollout_id_from_record,
    token_id_capture_dirs_from_config,
    trajectories_for_rollout,
    trajectories_from_source,
)
from raycap.protocols import TokenCaptureSnapshot, TokenSink, TokenSource
from raycap.records import TOKEN_ENTRY_RECORD_SCHEMA_VERSION, TOKEN_FIELDS, TokenEntry, extract_token_fields
from raycap.store import TokenCaptureStore, validate_rollout_id

__all__ = [
    "TOKEN_ENTRY_RECORD_SCHEMA_VERSION",
    "TOKEN_FIELDS",
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
    "per_request",
    "prefix_merging",
    "project_chain_to_output_items",
    "project_main_chain_response",
    "rebuild",
    "retire",
    "rollout_id_from_record",
    "run_builder",
    "token_id_capture_dirs_from_config",
    "trajectories_for_rollout",
    "trajectories_from_source",
    "validate_rollout_id",
]


def __getattr__(name: str):
    # Ray and pyarrow load only when the distributed API is used.
    if name == "builds_from_table":
        from raycap.arrow import builds_from_table

        return builds_from_table
    if name == "dataset":
        from raycap.feed import dataset

        return dataset
    if name == "rebuild":
        # Decides without importing Ray whether the call runs in this process.
        from raycap.local import rebuild

        return rebuild
    if name == "Stream":
        from raycap.stream import Stream

        return Stream
    if name in ("retire", "Rebuilder"):
        from raycap.cluster import rebuild as _rebuild

        return getattr(_rebuild, name)
    raise AttributeError(f"module 'raycap' has no attribute {name!r}")
