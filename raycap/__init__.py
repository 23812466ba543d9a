"""raycap: rebuild RL training trajectories from LLM token captures, on Ray.

What users call:

- `rebuild(capture_dirs, rollout_ids, ...)`: rows as one Arrow table; `Rebuilder` keeps
  placement and actors between calls (a training loop's session);
- `rebuild_to_output(capture_dirs, output, ...)`: the durable dataset writer (commit,
  summary, mask gate, retirement); `dataset` and `read_manifest` read what it wrote;
- `finalize_rollouts(capture_dirs, results, output, ...)`: a rollout collection's
  results file finalized at once, as NeMo Gym finalizes each record, into the same kind
  of dataset, the finalized records beside the rows; `read_records` reads them back;
- `retire(capture_dirs, output)`: drop the captures a committed dataset holds;
- `Stream(capture_dirs, ...)`: rows as rollouts finish, for asynchronous training
  (finished rollouts given by id or by their result records), retired after commit;
- `token_source(capture_dir)` / `token_sink(capture_dir)`: the Ray-served TokenSource
  and TokenSink of one directory (NeMo Gym's `install_token_source`/`install_token_sink`
  take them);
- `DataParallelFeed`, `shard_batches`: fixed-shape token batches for data-parallel
  trainers, every rank the same number of steps;
- `RebuildOptions`, `CaptureDir`, `ExecutorChoice`: the values the calls take and report;
- `Location`: where an output lives, a path or a URI such as `s3://bucket/run-1/step-1`
  (`Location.parse(uri, storage_options)`); every call that takes an output takes one;
- `RayTokenSink` / `RayTokenSource`: the same, constructed from keyword arguments, so a
  run's config names them (`token_id_capture.sink: raycap.cluster.sink:RayTokenSink`);
- every public name of NeMo Gym's `nemo_gym.token_id_capture` package, each also in the
  module of the same name in `raycap.capture`: `records`, `store`, `builder`, `consumer`,
  `protocols`, `config`, `sink` and `delivery` (`raycap.<name>` stays an alias of
  `raycap.capture.<name>` for one release);
- every exception raycap raises of its own (`raycap.errors`).

The packages, one concern each, in the order data flows: `capture` (NeMo Gym's modules
and the capture directory; no Ray, no pyarrow), `rows` (captures to Arrow rows), `output`
(the committed output, local or on an object store), `finalize` (results files),
`stream` (asynchronous training), `train` (trainer feeds), `cluster` (Ray) and `cli` (the
command and its jobs). Each package's `__init__` says what it owns and may import.
`capture` and the Arrow conversion import without Ray, so model servers and inference
workers can use them; `rebuild` imports Ray only when a call runs on Ray.
"""

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
