"""Typed records of the benchmark results (``benchmarks/results/*.json``), with explicit load and save.

Every part writes one record per run (:class:`MethodsRun`, :class:`KernelRun`,
:class:`OutOfCoreRun`, :class:`InMemoryRun`); :mod:`benchmarks.report` reads them back with
:func:`load_record`. ``to_dict`` writes the layout the stored files have always had (the
same keys; optional keys left out where they were) and ``from_dict`` reads it, so a load and
save round trip gives the same JSON. This module imports nothing else of the benchmarks:
they all import it.
"""

from __future__ import annotations

import json
import sys
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path
from typing import Any, ClassVar, Mapping, Optional, Sequence, TypeVar, Union

JSON = dict[str, Any]
#: Where the runs write their records (``optimisations/`` and ``history/`` below it hold older ones).
RESULTS_DIR = Path(__file__).resolve().parent / "results"

F = TypeVar("F", bound="FlatRecord")


def json_text(payload: Any, indent: Optional[int] = 2) -> str:
    """``payload`` as JSON (indented unless ``indent`` is None) and a final newline: how every file is written."""
    return json.dumps(payload, indent=indent, sort_keys=False, default=str) + "\n"


def write_json(path: Union[str, Path], payload: Any, indent: Optional[int] = 2) -> Path:
    """Write :func:`json_text` of ``payload`` to ``path``, the folder created if need be."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json_text(payload, indent), encoding="utf-8")
    return path


def read_json(path: Union[str, Path]) -> Any:
    """The JSON document at ``path`` (every JSON file the benchmarks read goes through here)."""
    with open(path, encoding="utf-8") as handle:
        return json.load(handle)


@dataclass(frozen=True)
class FlatRecord:
    """A record stored as its fields, as they are: ``from_dict`` and ``to_dict`` need no code of their own."""

    @classmethod
    def from_dict(cls: type[F], data: Mapping[str, Any]) -> F:
        return cls(**data)

    def to_dict(self) -> JSON:
        return asdict(self)


def _without_none(data: JSON, keys: Sequence[str]) -> JSON:
    """``data`` less those of ``keys`` whose value is None (optional entries the files leave out)."""
    return {key: value for key, value in data.items() if not (key in keys and value is None)}


def _ratio(value: float, reference: float) -> Optional[float]:
    return value / reference if reference else None


# Where and how a figure was taken --------------------------------------------------


@dataclass(frozen=True, kw_only=True)
class GitState(FlatRecord):
    """Commit of a checkout, and whether a path in it had uncommitted changes: which code a figure is of."""

    path: str
    commit: Optional[str]
    branch: Optional[str]
    last_change: Optional[str] = None  # last commit touching the path; not recorded by the oldest runs
    dirty: Optional[bool]

    def to_dict(self) -> JSON:
        return _without_none(asdict(self), ("last_change",))

    @property
    def label(self) -> str:
        """``COMMIT`` (the last to change the path) with ``(modified)`` when the path had uncommitted changes.

        The checkout's location is left out: it means nothing outside the machine that measured.
        """
        commit = (self.last_change or self.commit or "?")[:10]
        return f"`{commit}`" + (" (modified)" if self.dirty else "")


@dataclass(frozen=True, kw_only=True)
class Machine:
    """The facts a reader needs to compare figures between machines and runs."""

    hostname: str
    cpu: str
    cpu_count: int
    affinity: int
    memory_bytes: int
    memory_available_bytes: int
    disk_free_bytes: int
    load_average: tuple[float, ...]
    python: str
    torch: str
    torch_threads: int
    mergekit: Optional[str]
    mergekit_ram: Optional[str]
    thread_env: Optional[dict[str, str]] = None  # OMP_*, GOMP_*, KMP_*, MKL_*; not recorded by the oldest runs
    plugin: GitState
    benchmarks: GitState
    time: str

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Machine:
        return cls(
            **{
                **data,
                "load_average": tuple(data["load_average"]),
                "plugin": GitState.from_dict(data["plugin"]),
                "benchmarks": GitState.from_dict(data["benchmarks"]),
            }
        )

    def to_dict(self) -> JSON:
        data = asdict(self)
        data["load_average"] = list(self.load_average)
        data["plugin"], data["benchmarks"] = self.plugin.to_dict(), self.benchmarks.to_dict()
        return _without_none(data, ("thread_env",))

    @property
    def load(self) -> float:
        """One-minute load average when the run started."""
        return self.load_average[0]

    def description(self) -> str:
        """``AMD EPYC, 2 CPU cores visible, Python 3.11.7, torch 2.13.0+cpu``: the machine in one line."""
        return f"{self.cpu}, {self.cpu_count} CPU cores visible, Python {self.python}, torch {self.torch}"

    def thread_settings(self) -> str:
        """``, OMP_WAIT_POLICY=PASSIVE...`` (empty without thread variables)."""
        return "".join(f", {key}={value}" for key, value in (self.thread_env or {}).items())


@dataclass(frozen=True)
class Measurement:
    """One measured child process, and what its caller read from its output.

    Stored with the caller's findings under ``extra``: ``prepass_s``, and ``statistics``, which
    holds either a merge's per-model figures or the in-memory baseline's own report (the
    baseline's has ``merge_s``).
    """

    argv: list[str]
    returncode: int
    wall_s: float
    user_s: float
    sys_s: float
    max_rss_bytes: int  # kernel high-water mark (ru_maxrss): includes mapped file pages
    peak_anon_bytes: int  # polled: RSS minus file-backed and shared pages, summed over the process tree
    load_before: float
    load_after: float
    log_path: Optional[str] = None
    log_tail: str = ""
    prepass_s: Optional[float] = None  # the ram_plus pre-pass time its -v log reported
    statistics: Optional[dict[str, ModelFigures]] = None  # a ram / ram_plus merge: per model, its ram_statistics.json
    baseline: Optional[BaselineFigures] = None  # the in-memory baseline: its inmemory_statistics.json

    EXTRA: ClassVar[tuple[str, ...]] = ("prepass_s", "statistics", "baseline")

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Measurement:
        extra = data.get("extra", {})
        statistics = extra.get("statistics")
        baseline = statistics is not None and "merge_s" in statistics
        return cls(
            **{key: value for key, value in data.items() if key != "extra"},
            prepass_s=extra.get("prepass_s"),
            statistics=None
            if statistics is None or baseline
            else {model: ModelFigures.from_dict(entry) for model, entry in statistics.items()},
            baseline=BaselineFigures.from_dict(statistics) if baseline else None,
        )

    def to_dict(self) -> JSON:
        data = {item.name: getattr(self, item.name) for item in fields(self) if item.name not in self.EXTRA}
        extra: JSON = {}
        if self.prepass_s is not None:
            extra["prepass_s"] = self.prepass_s
        if self.statistics is not None:
            extra["statistics"] = {model: figures.to_dict() for model, figures in self.statistics.items()}
        elif self.baseline is not None:
            extra["statistics"] = self.baseline.to_dict()
        return {**data, "extra": extra}

    @property
    def ok(self) -> bool:
        return self.returncode == 0

    @property
    def cpu_s(self) -> float:
        return self.user_s + self.sys_s


@dataclass(frozen=True)
class ModelSet:
    """A generated base and its agents on disk (``benchmarks.models``)."""

    size: str
    root: str
    base: str
    agents: tuple[str, ...]
    parameters: int
    largest_tensor: int
    disk_bytes: int
    generation_s: float
    densities: tuple[float, ...]  # measured share of elements each agent changed
    unique_shares: tuple[float, ...]  # measured share of each agent's changes no other agent made

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> ModelSet:
        return cls(
            size=data["size"],
            root=data["root"],
            base=data["base"],
            agents=tuple(data["agents"]),
            parameters=data["parameters"],
            largest_tensor=data["largest_tensor"],
            disk_bytes=data["disk_bytes"],
            generation_s=data["generation_s"],
            densities=tuple(data["densities"]),
            unique_shares=tuple(data["unique_shares"]),
        )

    def to_dict(self) -> JSON:
        return {key: list(value) if isinstance(value, tuple) else value for key, value in asdict(self).items()}

    @classmethod
    def load(cls, root: Path) -> ModelSet:
        """The set described by ``root/complete.json``, its paths under ``root`` wherever the cache now lives."""
        found = cls.from_dict(read_json(root / "complete.json")["set"])
        return replace(
            found,
            root=str(root),
            base=str(root / Path(found.base).name),
            agents=tuple(str(root / Path(agent).name) for agent in found.agents),
        )


# methods: mergekit-yaml, method against method -------------------------------------


@dataclass(frozen=True)
class ModelFigures:
    """density, rho and lambda of one model, from a merge's ``ram_statistics.json``."""

    density: Optional[float]
    rho: Optional[float]  # None: infinite (no unique change)
    lambda_: Optional[float]

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> ModelFigures:
        return cls(density=data.get("density"), rho=data.get("rho"), lambda_=data.get("lambda"))

    def to_dict(self) -> JSON:
        return {"density": self.density, "rho": self.rho, "lambda": self.lambda_}


@dataclass(frozen=True)
class BaselineFigures:
    """The in-memory baseline's report of its own merge (``inmemory_statistics.json``, ``benchmarks.inmemory``)."""

    rho: list[float]  # per agent
    lambda_: list[float]
    merge_s: float  # reading and merging, without saving
    total_s: float

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> BaselineFigures:
        return cls(rho=data["rho"], lambda_=data["lambda"], merge_s=data["merge_s"], total_s=data["total_s"])

    def to_dict(self) -> JSON:
        return {"rho": self.rho, "lambda": self.lambda_, "merge_s": self.merge_s, "total_s": self.total_s}


@dataclass(frozen=True, kw_only=True)
class MethodSummary:
    """One method's medians over a run's rounds, and their ratios to the reference method."""

    runs: int
    wall_s: float
    wall_min_s: float
    cpu_s: float
    max_rss_bytes: float
    peak_anon_bytes: float
    prepass_s: Optional[float] = None  # ram_plus only
    prepass_share: Optional[float] = None  # of the wall time
    statistics: Optional[dict[str, ModelFigures]] = None  # ram and ram_plus: per model, the last round's
    wall_s_ratio: Optional[float] = None
    cpu_s_ratio: Optional[float] = None
    max_rss_bytes_ratio: Optional[float] = None
    peak_anon_bytes_ratio: Optional[float] = None

    OPTIONAL: ClassVar[tuple[str, ...]] = (
        "prepass_s",
        "prepass_share",
        "statistics",
        "wall_s_ratio",
        "cpu_s_ratio",
        "max_rss_bytes_ratio",
        "peak_anon_bytes_ratio",
    )

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> MethodSummary:
        statistics = data.get("statistics")
        return cls(
            **{
                **data,
                "statistics": None
                if statistics is None
                else {model: ModelFigures.from_dict(entry) for model, entry in statistics.items()},
            }
        )

    def to_dict(self) -> JSON:
        data = asdict(self)
        if self.statistics is not None:
            data["statistics"] = {model: figures.to_dict() for model, figures in self.statistics.items()}
        return _without_none(data, self.OPTIONAL)

    def with_ratios(self, reference: MethodSummary) -> MethodSummary:
        """This summary with each metric divided by ``reference``'s (None where the reference is 0)."""
        return replace(
            self,
            wall_s_ratio=_ratio(self.wall_s, reference.wall_s),
            cpu_s_ratio=_ratio(self.cpu_s, reference.cpu_s),
            max_rss_bytes_ratio=_ratio(self.max_rss_bytes, reference.max_rss_bytes),
            peak_anon_bytes_ratio=_ratio(self.peak_anon_bytes, reference.peak_anon_bytes),
        )


@dataclass(frozen=True)
class MethodsOptions(FlatRecord):
    repeats: int
    out_shard_size: str
    out_dtype: Optional[str]
    extra_args: list[str]
    warmup: bool
    method_parameters: dict[str, dict[str, float]]


@dataclass(frozen=True, kw_only=True)
class MethodsRun:
    """``benchmarks.methods``: every method's rounds and summary at one size (``methods-SIZE.json``)."""

    KIND: ClassVar[str] = "methods"
    size: str
    models: ModelSet
    options: MethodsOptions
    machine: Machine
    runs: dict[str, list[Measurement]]
    summary: dict[str, MethodSummary]
    source: str = field(default="", compare=False)  # the file it was loaded from; not saved

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], source: str = "") -> MethodsRun:
        return cls(
            size=data["size"],
            models=ModelSet.from_dict(data["models"]),
            options=MethodsOptions.from_dict(data["options"]),
            machine=Machine.from_dict(data["machine"]),
            runs={method: [Measurement.from_dict(m) for m in runs] for method, runs in data["runs"].items()},
            summary={method: MethodSummary.from_dict(entry) for method, entry in data["summary"].items()},
            source=source,
        )

    def to_dict(self) -> JSON:
        return {
            "kind": self.KIND,
            "size": self.size,
            "models": self.models.to_dict(),
            "options": self.options.to_dict(),
            "machine": self.machine.to_dict(),
            "runs": {method: [m.to_dict() for m in runs] for method, runs in self.runs.items()},
            "summary": {method: entry.to_dict() for method, entry in self.summary.items()},
        }


# kernel: the kernel alone ---------------------------------------------------------


@dataclass(frozen=True)
class KernelTiming(FlatRecord):
    """One kernel call measured: N fine-tunes of ``numel`` elements."""

    n: int
    variant: str
    numel: int
    seconds: float  # median
    min_seconds: float
    times: list[float]
    ns_per_element: float
    scratch_bytes: int
    scratch_bytes_per_element: float


@dataclass(frozen=True)
class StartupCost(FlatRecord):
    """Cumulative import time of the start-up hook's modules, medians over fresh interpreters."""

    repeats: int
    cumulative_us: dict[str, Optional[float]]  # None: the module was not imported
    interpreter_wall_s: float


@dataclass(frozen=True, kw_only=True)
class KernelRun:
    """``benchmarks.kernel`` (``kernel.json``)."""

    KIND: ClassVar[str] = "kernel"
    machine: Machine
    kernel_module: str
    numel: int
    kernel: list[KernelTiming]
    startup: StartupCost
    source: str = field(default="", compare=False)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], source: str = "") -> KernelRun:
        return cls(
            machine=Machine.from_dict(data["machine"]),
            kernel_module=data["kernel_module"],
            numel=data["numel"],
            kernel=[KernelTiming.from_dict(row) for row in data["kernel"]],
            startup=StartupCost.from_dict(data["startup"]),
            source=source,
        )

    def to_dict(self) -> JSON:
        return {
            "kind": self.KIND,
            "machine": self.machine.to_dict(),
            "kernel_module": self.kernel_module,
            "numel": self.numel,
            "kernel": [row.to_dict() for row in self.kernel],
            "startup": self.startup.to_dict(),
        }


# scale: out-of-core, and the in-memory baseline against ours -----------------------


@dataclass(frozen=True)
class ScaleOptions(FlatRecord):
    repeats: int
    out_shard_size: str
    cap_bytes: Optional[int] = None  # inmemory only: RLIMIT_DATA of both children


@dataclass(frozen=True)
class OutOfCoreSummary(FlatRecord):
    """Medians of the out-of-core ``ram_plus`` runs."""

    wall_s: float
    cpu_s: float
    max_rss_bytes: float
    peak_anon_bytes: float
    prepass_s: float  # NaN where no run reported it
    seconds_per_billion: float


@dataclass(frozen=True, kw_only=True)
class OutOfCoreRun:
    """``benchmarks.scale outofcore`` (``scale-outofcore-SIZE.json``)."""

    KIND: ClassVar[str] = "outofcore"
    size: str
    models: ModelSet
    machine: Machine
    options: ScaleOptions
    inputs_exceed_memory: bool
    runs: list[Measurement]
    summary: OutOfCoreSummary
    source: str = field(default="", compare=False)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], source: str = "") -> OutOfCoreRun:
        return cls(
            size=data["size"],
            models=ModelSet.from_dict(data["models"]),
            machine=Machine.from_dict(data["machine"]),
            options=ScaleOptions.from_dict(data["options"]),
            inputs_exceed_memory=data["inputs_exceed_memory"],
            runs=[Measurement.from_dict(m) for m in data["runs"]],
            summary=OutOfCoreSummary.from_dict(data["summary"]),
            source=source,
        )

    def to_dict(self) -> JSON:
        return {
            "kind": self.KIND,
            "size": self.size,
            "models": self.models.to_dict(),
            "machine": self.machine.to_dict(),
            "options": {"out_shard_size": self.options.out_shard_size, "repeats": self.options.repeats},
            "inputs_exceed_memory": self.inputs_exceed_memory,
            "runs": [m.to_dict() for m in self.runs],
            "summary": self.summary.to_dict(),
        }


@dataclass(frozen=True)
class ApproachSummary(FlatRecord):
    """Medians of one approach's completed runs (NaN when none completed)."""

    completed: int
    failed: int
    wall_s: float
    max_rss_bytes: float
    peak_anon_bytes: float


@dataclass(frozen=True)
class OutputComparison(FlatRecord):
    """Element-wise agreement of the two merged checkpoints."""

    elements: int
    differing_elements: int
    max_abs_difference: float
    only_in_baseline: list[str]
    tensors: int


@dataclass(frozen=True)
class MemoryLimit(FlatRecord):
    """The largest model the in-memory approach merges in the machine's memory, and the first named size beyond."""

    bytes_per_parameter: float
    memory_bytes: int
    largest_parameters: float
    first_size_beyond: Optional[str]
    first_size_beyond_parameters: Optional[int]
    needed_for_first_size_bytes: Optional[float]


@dataclass(frozen=True, kw_only=True)
class InMemoryRun:
    """``benchmarks.scale inmemory`` (``scale-inmemory-SIZE.json``): the baseline and ours, in turns."""

    KIND: ClassVar[str] = "inmemory"
    size: str
    models: ModelSet
    machine: Machine
    options: ScaleOptions
    interpreter_overhead: Measurement
    runs: dict[str, list[Measurement]]  # by approach label
    summary: dict[str, ApproachSummary]
    comparison: Optional[OutputComparison]
    rho: dict[str, Optional[Sequence[Optional[float]]]]  # per approach, per agent (last round); None: infinite
    limit: Optional[MemoryLimit]
    source: str = field(default="", compare=False)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], source: str = "") -> InMemoryRun:
        comparison, limit = data.get("comparison"), data.get("limit")
        return cls(
            size=data["size"],
            models=ModelSet.from_dict(data["models"]),
            machine=Machine.from_dict(data["machine"]),
            options=ScaleOptions.from_dict(data["options"]),
            interpreter_overhead=Measurement.from_dict(data["interpreter_overhead"]),
            runs={label: [Measurement.from_dict(m) for m in runs] for label, runs in data["runs"].items()},
            summary={label: ApproachSummary.from_dict(entry) for label, entry in data["summary"].items()},
            comparison=None if comparison is None else OutputComparison.from_dict(comparison),
            rho=dict(data["rho"]),
            limit=None if limit is None else MemoryLimit.from_dict(limit),
            source=source,
        )

    def to_dict(self) -> JSON:
        return {
            "kind": self.KIND,
            "size": self.size,
            "models": self.models.to_dict(),
            "machine": self.machine.to_dict(),
            "options": self.options.to_dict(),
            "interpreter_overhead": self.interpreter_overhead.to_dict(),
            "runs": {label: [m.to_dict() for m in runs] for label, runs in self.runs.items()},
            "summary": {label: entry.to_dict() for label, entry in self.summary.items()},
            "comparison": None if self.comparison is None else self.comparison.to_dict(),
            "rho": self.rho,
            "limit": None if self.limit is None else self.limit.to_dict(),
        }


Record = Union[MethodsRun, KernelRun, OutOfCoreRun, InMemoryRun]
RECORD_TYPES: dict[str, type[MethodsRun] | type[KernelRun] | type[OutOfCoreRun] | type[InMemoryRun]] = {
    record.KIND: record for record in (MethodsRun, KernelRun, OutOfCoreRun, InMemoryRun)
}


def load_record(path: Path) -> Record:
    """The record stored at ``path``, by its ``kind``."""
    data = read_json(path)
    kind = data.get("kind")
    if kind not in RECORD_TYPES:
        raise ValueError(f"{path}: unknown results kind {kind!r}; expected one of {', '.join(RECORD_TYPES)}")
    return RECORD_TYPES[kind].from_dict(data, source=path.name)


def save_record(path: Path, record: Record) -> Path:
    return write_json(path, record.to_dict())


def round_trips(path: Path) -> bool:
    """Whether the file at ``path`` loads and saves back to the same bytes (the format stays compatible)."""
    return json_text(load_record(path).to_dict()) == path.read_text(encoding="utf-8")


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Check that every results file loads into its record and saves back unchanged."""
    paths = [Path(arg) for arg in argv] if argv else sorted(RESULTS_DIR.rglob("*.json"))
    failed = [path for path in paths if not round_trips(path)]
    for path in failed:
        print(f"{path}: does not save back to the same bytes")
    print(f"{len(paths) - len(failed)} of {len(paths)} results files load and save back byte-identical")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
