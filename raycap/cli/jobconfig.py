"""The YAML configs of the jobs (`jobs/rebuild.py`, `jobs/finalize.py`, `jobs/clear.py`, `jobs/sweep.py`).

- A config is one YAML mapping validated by a pydantic model; unknown keys are refused,
  so a misspelt option fails the job instead of keeping its default.
- Relative paths are resolved against the config file's directory, so a config means
  the same wherever the job starts. A URI output (`s3://BUCKET/KEY`) is never taken for
  a relative path; a malformed one is a ConfigError.
- A capture directory is "/abs/path", "NODE:/abs/path" or a mapping with `path` and
  `node`; only a plain path may be relative.
- The `ray` block says where the job runs (`address`, or an embedded Ray of `num_cpus`;
  both together are refused); the rebuild's `executor` says whether rows are built on Ray.
- A key given twice and YAML aliases are refused. The config and a `rollout_ids_file`
  are read as capture files are: regular files only, never through a link, bounded
  (`MAX_CONFIG_BYTES`, `MAX_IDS_FILE_BYTES`).
- Every error is a one-line `ConfigError` naming the file, the key and the way out; the
  jobs print it and exit with status 2.

The long form: docs/internals.md ("Job configs").
"""

from __future__ import annotations

import os
from collections import Counter
from pathlib import Path
from typing import Any, Literal, TypeVar

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, ValidationInfo, field_validator, model_validator

from raycap.capture.builder import BUILDERS
from raycap.capture.directory import CaptureDir
from raycap.capture.store import validate_rollout_id
from raycap.capture.untrusted import bounded, bounded_repr, read_small_file
from raycap.errors import ConfigError  # noqa: F401 - raised here, declared with the others
from raycap.rows.batch import MAX_CAPTURE_BYTES
from raycap.rows.options import RebuildOptions
from raycap.runs.handoff import DEFAULT_MASK_FRACTION_MIN_SAMPLES

# The most raycap reads of a job config and of a rollout id file: long id lists belong
# in the file (about 40 bytes an id: tens of millions of ids).
MAX_CONFIG_BYTES = 8 << 20
MAX_IDS_FILE_BYTES = 1 << 30
# How many problems of one config the error line lists, and how long it may be.
_PROBLEMS_SHOWN = 3
_PROBLEM_CHARS = 300


def read_regular_file(path: Path, what: str, limit: int = MAX_CONFIG_BYTES) -> str:
    """The UTF-8 text of `path`, which must be a regular file of at most `limit` bytes
    (`raycap.capture.untrusted.read_small_file`: a link, FIFO, socket, device or directory is
    refused, never followed or waited on); OSError or ValueError with a one-line reason
    naming `what` and the path."""
    data = read_small_file(path, limit=limit, what=what)
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ValueError(f"{what} {path} is not UTF-8 text ({exc.reason} at byte {exc.start})") from None


class _AliasRefused(yaml.YAMLError):
    """A YAML alias in a job config (see the module docstring)."""

    def __init__(self, anchor: str, mark: Any) -> None:
        super().__init__(anchor)
        self.anchor, self.problem_mark = anchor, mark


class _UniqueKeyLoader(getattr(yaml, "CSafeLoader", yaml.SafeLoader)):  # type: ignore[misc]
    """yaml's safe loader (libyaml's when installed: several times faster), refusing a
    key given twice in one mapping."""


def _construct_unique_mapping(loader: _UniqueKeyLoader, node: yaml.MappingNode, deep: bool = False) -> Any:
    first_line: dict[Any, int] = {}
    for key_node, _ in node.value:
        key = loader.construct_object(key_node, deep=deep)
        try:
            if key in first_line:
                raise yaml.constructor.ConstructorError(
                    None, None, f"key {bounded_repr(key)} is given twice (first on line {first_line[key]}); keep one",
                    key_node.start_mark,
                )
            first_line[key] = key_node.start_mark.line + 1
        except TypeError:
            continue  # an unhashable key: the base constructor reports it
    return yaml.constructor.SafeConstructor.construct_mapping(loader, node, deep=deep)


_UniqueKeyLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _construct_unique_mapping)


def _load_yaml(text: str) -> Any:
    """The document `text` holds. Its events are read first, and an alias refused there
    (_AliasRefused, with the alias's line): events are as many as the text's nodes, so
    nothing is expanded before the document is known to hold no alias."""
    for event in yaml.parse(text, Loader=_UniqueKeyLoader):
        if isinstance(event, yaml.AliasEvent):
            raise _AliasRefused(event.anchor, event.start_mark)
    return yaml.load(text, Loader=_UniqueKeyLoader)  # noqa: S506 - a safe loader


def _base_dir(info: ValidationInfo) -> Path:
    context = info.context or {}
    return Path(context.get("base_dir") or os.getcwd())


def _resolve(value: Any, info: ValidationInfo) -> Any:
    if value is None:
        return None
    path = Path(os.path.expanduser(os.fspath(value)))
    return path if path.is_absolute() else (_base_dir(info) / path).resolve()


def _checked_output(value: Any, info: ValidationInfo) -> Any:
    """An output: a URI is kept as its text once its syntax is checked (no network:
    the store is asked when the job starts), `file://` becomes its path; a path is
    resolved as every path is."""
    from raycap.output.faults import OutputError
    from raycap.output.location import is_uri, parse_location
    from raycap.output.protocol import backend_of

    if not isinstance(value, (str, os.PathLike)):
        raise ValueError(f"give the output as a path or a URI (s3://BUCKET/KEY), not {bounded_repr(value)}")
    if isinstance(value, str) and is_uri(value):
        try:
            location = parse_location(value)
        except OutputError as exc:
            raise ValueError(str(exc)) from None
        return backend_of(location).named(location)
    return _resolve(value, info)


def _resolve_file(value: Any, info: ValidationInfo) -> Any:
    """`_resolve` for a file the job reads: its directory is resolved, its own name is
    kept, so that a link there is refused when it is opened, not followed here."""
    if value is None:
        return None
    path = Path(os.path.expanduser(os.fspath(value)))
    return path if path.is_absolute() else _resolve(path.parent, info) / path.name


def _capture_dir(spec: Any, info: ValidationInfo) -> CaptureDir:
    if isinstance(spec, dict):
        path = spec.get("path")
        if isinstance(path, str) and not os.path.isabs(path) and spec.get("node") is None:
            spec = {**spec, "path": str(_resolve(path, info))}
    elif isinstance(spec, str):
        # NODE:path stays as given: CaptureDir refuses a path on a node that is not absolute.
        if not spec.startswith("/") and ":" not in spec.split("/", 1)[0]:
            spec = str(_resolve(spec, info))
    else:
        raise ValueError(
            f"capture directory {bounded_repr(spec)}: give a path string, NODE:/path, or a mapping with 'path' and 'node'"
        )
    return CaptureDir.parse(spec)


class RayOptions(BaseModel):
    """Where the job's Ray runs."""

    model_config = ConfigDict(extra="forbid")

    address: str | None = None
    num_cpus: int | None = Field(default=None, ge=1)

    @model_validator(mode="after")
    def _resources_only_when_embedded(self) -> "RayOptions":
        if self.address and self.num_cpus is not None:
            raise ValueError(
                "ray.num_cpus sizes an embedded Ray only; a cluster at ray.address has its own "
                "resources: remove ray.num_cpus or ray.address"
            )
        return self


class CaptureJobConfig(BaseModel):
    """What every job config has: the capture directories and where Ray runs."""

    model_config = ConfigDict(extra="forbid")

    capture_dirs: list[CaptureDir] = Field(min_length=1)
    ray: RayOptions = Field(default_factory=RayOptions)

    @field_validator("capture_dirs", mode="before")
    @classmethod
    def _parse_dirs(cls, value: Any, info: ValidationInfo) -> Any:
        if isinstance(value, (str, dict)):
            value = [value]
        if not isinstance(value, list):
            raise ValueError("capture_dirs must be a list of directories")
        dirs = [_capture_dir(spec, info) for spec in value]
        labels = [d.label for d in dirs]
        duplicates = sorted({label for label in labels if labels.count(label) > 1})
        if duplicates:
            raise ValueError(f"capture directories listed twice: {', '.join(duplicates)}")
        return dirs

    @property
    def labels(self) -> list[str]:
        return [d.label for d in self.capture_dirs]

    def missing_local_dirs(self) -> list[str]:
        """Plain paths that do not exist here; meaningful only when Ray runs on this machine."""
        return [d.path for d in self.capture_dirs if d.node is None and not os.path.isdir(d.path)]


def _refuse_local_with_nodes(dirs: list[CaptureDir], executor: str) -> None:
    pinned = [d.label for d in dirs if d.node is not None]
    if executor == "local" and pinned:
        raise ValueError(
            f"executor local reads capture directories in this process, but {pinned[0]} names a node; "
            "use executor ray (or auto), or give plain paths"
        )


class OutputJobConfig(CaptureJobConfig):
    """The keys of a job that writes one durable dataset (`jobs.rebuild`, `jobs.finalize`):
    where it goes, how it is built, the mask gate and retirement."""

    output: Path | str
    storage_options: dict[str, Any] | None = None
    builder: str = "prefix_merging"
    overwrite: bool = False
    retire: bool = False
    max_mask_fraction: float | None = Field(default=None, ge=0.0, le=1.0)
    mask_fraction_min_samples: int = Field(default=DEFAULT_MASK_FRACTION_MIN_SAMPLES, ge=0)
    batch_size: int | None = Field(default=None, ge=1)
    max_in_flight: int | None = Field(default=None, ge=1)
    executor: Literal["auto", "ray", "local"] = "auto"
    max_capture_bytes: int | None = Field(default=MAX_CAPTURE_BYTES, ge=1)

    @field_validator("output", mode="before")
    @classmethod
    def _resolve_output(cls, value: Any, info: ValidationInfo) -> Any:
        return _checked_output(value, info)

    @field_validator("builder")
    @classmethod
    def _known_builder(cls, value: str) -> str:
        if value not in BUILDERS:
            raise ValueError(f"unknown builder {value!r}; known builders: {', '.join(BUILDERS)}")
        return value

    @model_validator(mode="after")
    def _local_needs_local_paths(self) -> "OutputJobConfig":
        _refuse_local_with_nodes(self.capture_dirs, self.executor)
        return self


class RebuildJobConfig(OutputJobConfig):
    """`python -m jobs.rebuild`: capture directories in, one durable Parquet dataset out
(the keys are the arguments of `raycap.runs.handoff.rebuild_to_output`)."""

    rollout_ids: list[str] | None = None
    rollout_ids_file: Path | None = None
    model: str = ""
    delivery: Literal["rollout", "chains"] = "rollout"
    allow_empty: bool = False

    @field_validator("rollout_ids_file", mode="before")
    @classmethod
    def _resolve_files(cls, value: Any, info: ValidationInfo) -> Any:
        return _resolve_file(value, info)

    @model_validator(mode="after")
    def _one_rollout_id_source(self) -> "RebuildJobConfig":
        if self.rollout_ids is not None and self.rollout_ids_file is not None:
            raise ValueError("give rollout_ids or rollout_ids_file, not both")
        if self.rollout_ids_file is not None:
            self.rollout_ids = _read_rollout_ids(self.rollout_ids_file)
        if self.rollout_ids is not None:
            for rollout_id in self.rollout_ids:
                validate_rollout_id(rollout_id)
            repeated = sorted(r for r, n in Counter(self.rollout_ids).items() if n > 1)
            if repeated:
                # A repeated id would be built, written and retired twice.
                raise ValueError(f"rollout ids listed twice: {', '.join(repeated[:5])}")
        return self


def _read_rollout_ids(path: Path) -> list[str]:
    """One id per line; blank lines and lines starting with '#' are skipped."""
    try:
        text = read_regular_file(path, "rollout_ids_file", MAX_IDS_FILE_BYTES)
    except OSError as exc:
        raise ValueError(f"cannot read rollout_ids_file {path}: {exc.strerror or exc}") from None
    lines = (line.strip() for line in text.splitlines())
    return [line for line in lines if line and not line.startswith("#")]


class FinalizeJobConfig(OutputJobConfig):
    """`python -m jobs.finalize`: a rollout collection's results file finalized into one
    durable dataset (the keys are the arguments of `raycap.finalize_rollouts`)."""

    results: Path
    records_file: Path | None = None
    record_fields: list[str] | None = None
    worker_stall_s: float = Field(default=RebuildOptions.worker_stall_s, gt=0, allow_inf_nan=False)

    @field_validator("records_file", mode="before")
    @classmethod
    def _resolve_paths(cls, value: Any, info: ValidationInfo) -> Any:
        return _resolve(value, info)

    @field_validator("results", mode="before")
    @classmethod
    def _resolve_files(cls, value: Any, info: ValidationInfo) -> Any:
        return _resolve_file(value, info)


class ClearJobConfig(CaptureJobConfig):
    """`python -m jobs.clear`: delete the captures of the rollouts about to be dispatched."""

    records: Path

    @field_validator("records", mode="before")
    @classmethod
    def _resolve_paths(cls, value: Any, info: ValidationInfo) -> Any:
        return _resolve(value, info)

    @field_validator("records")
    @classmethod
    def _records_exist(cls, value: Path) -> Path:
        if not value.is_file():
            raise ValueError(f"records file {value} does not exist; give the JSONL of run records to dispatch")
        return value


class SweepJobConfig(CaptureJobConfig):
    """`python -m jobs.sweep`: remove retired tombstones older than a retention period."""

    older_than_seconds: float = Field(ge=0.0)


Config = TypeVar("Config", bound=BaseModel)

# The config model of each job, by the job's name.
JOB_CONFIGS: dict[str, type[BaseModel]] = {
    "rebuild": RebuildJobConfig, "finalize": FinalizeJobConfig, "clear": ClearJobConfig, "sweep": SweepJobConfig,
}


def _known_keys(model: type[BaseModel], loc: tuple) -> list[str]:
    """The keys allowed where an unknown key was found (top level or a nested block)."""
    for part in loc[:-1]:
        annotation = model.model_fields[str(part)].annotation if str(part) in model.model_fields else None
        if not (isinstance(annotation, type) and issubclass(annotation, BaseModel)):
            return []
        model = annotation
    return list(model.model_fields)


def _error_line(
    source: str, exc: ValidationError, model: type[BaseModel], flags: dict[str, str] | None = None,
    given: dict[str, str] | None = None,
) -> str:
    """One line for every problem of a config, from `source` ("config FILE", or the
    arguments). A key given by a flag is named by the flag (`given`: key -> flag), and a
    missing key says which flag gives it (`flags`)."""
    flags, given = flags or {}, given or {}
    problems = []
    for error in exc.errors(include_url=False):
        where = ".".join(str(part) for part in error["loc"])
        if error["type"] == "extra_forbidden":
            known = _known_keys(model, error["loc"])
            problems.append(f"unknown key {where!r}" + (f" (known keys: {', '.join(known)})" if known else ""))
        elif error["type"] == "missing":
            problems.append(f"missing required key {where!r}" + (f" (give {flags[where]})" if where in flags else ""))
        else:
            where = given.get(where, where)
            message = str(error["msg"]).removeprefix("Value error, ")
            problems.append(f"{where}: {message}" if where and not message.startswith(where) else message)
    shown = [bounded(problem, _PROBLEM_CHARS) for problem in problems[:_PROBLEMS_SHOWN]]
    more = len(problems) - len(shown)
    return f"{source}: " + "; ".join(shown) + (f"; and {more} more problems" if more else "")


def _read_config(path: Path) -> dict:
    """The mapping a config file holds, or ConfigError with a one-line reason."""
    try:
        raw = _load_yaml(read_regular_file(path, "config"))
    except OSError as exc:
        raise ConfigError(f"cannot read config {path}: {exc.strerror or exc}") from None
    except ValueError as exc:
        raise ConfigError(bounded(exc, 1000)) from None
    except RecursionError:
        raise ConfigError(f"config {path} nests its values too deeply to be a job config; flatten it") from None
    except yaml.YAMLError as exc:
        where = getattr(exc, "problem_mark", None)
        line = f" line {where.line + 1}" if where is not None else ""
        if isinstance(exc, _AliasRefused):
            raise ConfigError(
                f"config {path}{line} uses the YAML alias *{bounded(exc.anchor, 40)}; job configs refuse aliases (a few "
                "bytes of them can expand to gigabytes): write the value out in full"
            ) from None
        problem = bounded(getattr(exc, "problem", None) or exc)
        raise ConfigError(f"config {path}{line} is not valid YAML: {problem}") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"config {path} must be a YAML mapping of keys to values")
    return raw


def load_config(path: str | os.PathLike, model: type[Config]) -> Config:
    """Read and validate a job config; relative paths are taken from the file's directory."""
    return load_job_config(path, model)


def load_job_config(
    path: str | os.PathLike | None,
    model: type[Config],
    overrides: dict[str, Any] | None = None,
    flags: dict[str, str] | None = None,
    base_dir: str | os.PathLike | None = None,
) -> Config:
    """A job config from a file, from `overrides` (config keys given on the command line,
    "ray.address" for a nested one), or both, the overrides winning key by key. Both go
    through the one validation, so a value is refused with the same words whichever way
    it came; a problem with a key that came from a flag names the flag (`flags`: key ->
    flag). Relative paths in the file are taken from its directory; give the overrides'
    paths absolute (the command line's are taken from the current directory). `base_dir`
    takes the file's relative paths from elsewhere (the demo's folder, for its packaged
    config)."""
    raw: dict[str, Any] = {} if path is None else _read_config(Path(path))
    given: dict[str, str] = {}
    for key, value in (overrides or {}).items():
        block, _, name = key.rpartition(".")
        if block:
            nested = raw.get(block)
            raw[block] = {**nested, name: value} if isinstance(nested, dict) else {name: value}
        else:
            raw[key] = value
        if flags and key in flags:
            given[key] = flags[key]
    source = "arguments" if path is None else f"config {path}"
    if base_dir is None:
        base_dir = Path(path).resolve().parent if path is not None else Path.cwd()
    try:
        return model.model_validate(raw, context={"base_dir": base_dir})
    except ValidationError as exc:
        raise ConfigError(_error_line(source, exc, model, flags, given)) from None
