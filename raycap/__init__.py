"""raycap: rebuild RL training trajectories from LLM token captures, on Ray.

What users call:

- `rebuild`, and `Rebuilder` (a session kept between calls): rows as one Arrow table;
- `rebuild_to_output`: the durable dataset writer (commit, summary, mask gate,
  retirement); `dataset` and `read_manifest` read what it wrote;
- `finalize_rollouts`: a collection's results file finalized at once, as NeMo Gym
  finalizes each record, into the same kind of dataset; `read_records` reads them back;
- `retire(capture_dirs, output)`: drop the captures a committed dataset holds;
- `Stream`: rows as rollouts finish, for asynchronous training, retired after commit;
- `token_source`/`token_sink` and `RayTokenSource`/`RayTokenSink`: a directory's
  TokenSource and TokenSink served on Ray (configs name `raycap.cluster.sink:RayTokenSink`);
- `DataParallelFeed`, `shard_batches`: fixed-shape token batches for trainers;
- `RebuildOptions`, `CaptureDir`, `ExecutorChoice`, `Location`: the values calls take;
- every public name of NeMo Gym's `nemo_gym.token_id_capture`, each also in its module
  of the same name in `raycap.capture` (`raycap.<name>` is that module too, for one
  release: `_FORMER_NAMES`); every exception raycap raises (`raycap.errors`).

Only `capture` and the values load here; the rest loads on first use (`__getattr__`), so
`import raycap` does not import Ray. The packages and their order: docs/development.md.
"""

import sys as _sys

__version__ = "0.1.0"  # the distribution's, as pyproject.toml says (`raycap --version`)

from raycap.capture.builder import (
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
from raycap.capture.config import (
    TOKEN_ID_CAPTURE_BLOCK,
    TokenIdCaptureConfig,
    TokenIdCaptureSettings,
    token_id_capture_config,
    token_id_capture_enabled_for_agent,
)
from raycap.capture.consumer import (
    ROLLOUT_ID_PATTERN,
    clear_token_captures_for_rollouts,
    maybe_rollout_id_from_run_body,
    rollout_id_from_record,
    token_id_capture_dirs_from_config,
    trajectories_for_rollout,
    trajectories_from_source,
)
from raycap.capture.delivery import (
    MASK_SAMPLE_KEY,
    TOKEN_CAPTURE_KEY,
    capture_build_can_retire,
    finalize_rollout_token_capture,
    retire_rollout_token_capture,
    rollout_carries_token_ids,
)
from raycap.capture.directory import CaptureDir
from raycap.capture.protocols import (
    TokenCaptureSnapshot,
    TokenSink,
    TokenSource,
    install_token_sink,
    install_token_source,
    installed_token_sink,
    installed_token_source,
)
from raycap.capture.records import (
    TOKEN_ENTRY_RECORD_SCHEMA_VERSION,
    TOKEN_FIELDS,
    TokenEntry,
    extract_token_fields,
    response_to_output_items,
    strip_token_fields,
)
from raycap.capture.sink import (
    CaptureContext,
    capture_tokens,
    commit_entry,
    current_capture_context,
    register_call_intent,
    reset_token_sink,
    set_token_sink,
)
from raycap.capture.store import TokenCaptureStore, make_token_store, validate_rollout_id
from raycap.errors import (
    CannotStart,
    CaptureFileError,
    CaptureTooLarge,
    ConfigError,
    DirectoryBusy,
    InspectError,
    NodesLost,
    NoRollouts,
    OutputError,
    OutputWriteError,
    PiecesLost,
    RecordFileError,
    ResultsError,
    StepRefused,
    UnknownSubscription,
    UnsafeFileError,
    UntrustedJSONError,
    UsageError,
)
from raycap.rows.collector import collector_paused as _collector_paused
from raycap.rows.executor import ExecutorChoice
from raycap.rows.options import RebuildOptions

# The former names of NeMo Gym's modules, `raycap.<name>`, kept for one release: each is
# the module object of `raycap.capture.<name>` (imported above already), so
# `import raycap.store` and `from raycap.records import TokenEntry` keep working.
_FORMER_NAMES = {name: name for name in ("builder", "config", "consumer", "delivery", "protocols", "records", "sink", "store")}
_FORMER_NAMES["builders"] = "builder"
for _former, _current in _FORMER_NAMES.items():
    _sys.modules[f"{__name__}.{_former}"] = _sys.modules[f"raycap.capture.{_current}"]

__all__ = [
    "BuildNotes",
    "BuildOutput",
    "CannotStart",
    "CaptureContext",
    "CaptureDir",
    "CaptureFileError",
    "CaptureTooLarge",
    "Chain",
    "ChainLink",
    "ConfigError",
    "DataParallelFeed",
    "DirectoryBusy",
    "ExecutorChoice",
    "InspectError",
    "Location",
    "MASK_SAMPLE_KEY",
    "NodesLost",
    "OutputError",
    "OutputWriteError",
    "NoRollouts",
    "PiecesLost",
    "ROLLOUT_ID_PATTERN",
    "RayTokenSink",
    "RayTokenSource",
    "RebuildOptions",
    "Rebuilder",
    "RecordFileError",
    "ResultsError",
    "StepRefused",
    "Stream",
    "TOKEN_CAPTURE_KEY",
    "TOKEN_ENTRY_RECORD_SCHEMA_VERSION",
    "TOKEN_FIELDS",
    "TOKEN_ID_CAPTURE_BLOCK",
    "TokenCaptureSnapshot",
    "TokenCaptureStore",
    "TokenEntry",
    "TokenIdCaptureConfig",
    "TokenIdCaptureSettings",
    "TokenSink",
    "TokenSource",
    "UnknownSubscription",
    "UnsafeFileError",
    "UntrustedJSONError",
    "UsageError",
    "assert_prefix_contiguity",
    "builds_from_table",
    "capture_build_can_retire",
    "capture_tokens",
    "clear_token_captures_for_rollouts",
    "commit_entry",
    "current_capture_context",
    "dataset",
    "extract_token_fields",
    "finalize_rollout_token_capture",
    "finalize_rollouts",
    "install_token_sink",
    "install_token_source",
    "installed_token_sink",
    "installed_token_source",
    "make_token_store",
    "maybe_rollout_id_from_run_body",
    "per_request",
    "prefix_merging",
    "project_chain_to_output_items",
    "project_main_chain_response",
    "read_manifest",
    "read_records",
    "rebuild",
    "rebuild_to_output",
    "register_call_intent",
    "reset_token_sink",
    "response_to_output_items",
    "retire",
    "retire_rollout_token_capture",
    "rollout_carries_token_ids",
    "rollout_id_from_record",
    "run_builder",
    "set_token_sink",
    "shard_batches",
    "strip_token_fields",
    "token_id_capture_config",
    "token_id_capture_dirs_from_config",
    "token_id_capture_enabled_for_agent",
    "token_sink",
    "token_source",
    "trajectories_for_rollout",
    "trajectories_from_source",
    "validate_rollout_id",
]


def __getattr__(name: str):
    # Ray, pyarrow and the dataset layer load only when their API is used. Loading them
    # makes tens of thousands of objects, and in a process that holds many (a Ray driver
    # holds about 100,000, a trainer often more) the cyclic collector's passes during the
    # load would walk them all: 0.07 s of a Ray driver's first finalize_rollouts. Nothing
    # a module load makes needs collecting at once, so the collector waits until it ends.
    with _collector_paused():
        return _lazy(name)


def _lazy(name: str):
    if name in _FORMER_NAMES:
        return _sys.modules[f"raycap.capture.{_FORMER_NAMES[name]}"]
    if name == "builds_from_table":
        from raycap.rows.arrow import builds_from_table

        return builds_from_table
    if name in ("dataset", "DataParallelFeed", "shard_batches"):
        from raycap.train import feed

        return getattr(feed, name)
    if name == "rebuild":
        # Decides without importing Ray whether the call runs in this process.
        from raycap.api import rebuild

        return rebuild
    if name == "Stream":
        from raycap.runs.stream import Stream

        return Stream
    if name == "rebuild_to_output":
        from raycap.runs.handoff import rebuild_to_output

        return rebuild_to_output
    if name in ("finalize_rollouts", "read_records"):
        from raycap.runs import rollouts as finalize

        return getattr(finalize, name)
    if name == "read_manifest":
        from raycap.output.manifest import read_manifest

        return read_manifest
    if name == "Location":
        from raycap.output.location import Location

        return Location
    if name == "retire":
        from raycap.runs.directories import retire

        return retire
    if name == "Rebuilder":
        from raycap.runs.rebuilder import Rebuilder

        return Rebuilder
    if name == "token_source":
        from raycap.cluster.nodes.fleet import token_source

        return token_source
    if name in ("token_sink", "RayTokenSink"):
        from raycap.cluster import sink as _sink

        return getattr(_sink, name)
    if name == "RayTokenSource":
        from raycap.cluster.nodes.fleet import RayTokenSource

        return RayTokenSource
    raise AttributeError(f"module 'raycap' has no attribute {name!r}")
