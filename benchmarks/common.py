"""Shared helpers of the benchmarks: paths, measured child processes, machine facts, number formats.

Every figure the benchmarks report about a whole program (a merge, the in-memory baseline)
comes from :func:`run_measured`, so all of them are taken the same way: wall time around
the child, its CPU time and kernel-exact peak RSS from ``wait4``, and its peak anonymous
memory polled from ``/proc`` (the peak RSS also counts the pages of memory-mapped input
files, which the kernel can drop at any time; anonymous memory is what a merge needs).
"""

from __future__ import annotations

import logging
import os
import platform
import resource
import shutil
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Iterable, Mapping, Optional, Sequence

import psutil

from benchmarks.records import GitState, Machine, Measurement

LOG = logging.getLogger(__name__)

BENCH_DIR = Path(__file__).resolve().parent
REPO_ROOT = BENCH_DIR.parent
CACHE_DIR = BENCH_DIR / ".cache"
DOC_PATH = REPO_ROOT / "docs" / "performance.md"

#: Environment variables that change how torch's OpenMP threads behave; recorded with every result.
#: ``OMP_WAIT_POLICY=PASSIVE`` matters on a loaded machine: see docs/performance.md.
THREAD_ENV_PREFIXES = ("OMP_", "GOMP_", "KMP_", "MKL_")

GIB = 1024**3
MIB = 1024**2

#: Nothing may come from the Hugging Face Hub: mergekit's model card code otherwise asks it
#: whether a local path is a repository.
OFFLINE_ENV = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}


def child_env(plugin: Optional[Path] = None, extra: Optional[Mapping[str, str]] = None) -> dict[str, str]:
    """The environment of every measured child: offline, plugin from ``plugin``, no pre-pass cache.

    ``plugin`` is a checkout whose ``mergekit_ram`` the children import (it goes first on
    PYTHONPATH, ahead of the editable install); by default the checkout holding these
    benchmarks, so a figure always belongs to the code next to it. mergekit-ram's pre-pass
    cache is switched off: a cached pre-pass would make every ram_plus run after the first
    skip the pre-pass the benchmark is meant to measure.
    """
    env = dict(os.environ)
    env.update(OFFLINE_ENV)
    paths = [str(plugin or REPO_ROOT), str(REPO_ROOT)]
    if env.get("PYTHONPATH"):
        paths.append(env["PYTHONPATH"])
    env["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(paths))
    env["MERGEKIT_RAM_CACHE"] = "off"
    env["MERGEKIT_RAM_CACHE_DIR"] = str(CACHE_DIR / "prepass-cache")
    env.update(extra or {})
    return env


def use_plugin(module: str, plugin: Optional[Path], argv: Sequence[str]) -> None:
    """Re-execute ``python -m module argv`` under :func:`child_env` unless this process already uses ``plugin``.

    The start-up hook imports ``mergekit_ram`` before ``python -m`` puts the current directory
    on ``sys.path``, so an in-process measurement would otherwise time the installed checkout
    rather than the one next to the benchmarks (or the one asked for).
    """
    import mergekit_ram

    wanted = Path(plugin or REPO_ROOT).resolve()
    if Path(mergekit_ram.__file__).resolve().parent.parent == wanted:
        return
    LOG.info("re-running under %s's mergekit_ram (this process has %s)", wanted, mergekit_ram.__file__)
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(sys.executable, [sys.executable, "-m", module, *argv], child_env(plugin))


def parse_size(text: str) -> int:
    """``1B``, ``500M``, ``64K`` or a plain integer (mergekit's notation for shard sizes)."""
    text = text.strip().upper()
    factors = {"K": 1000, "M": 1000**2, "B": 1000**3, "G": 1000**3}
    if text and text[-1] in factors:
        return int(float(text[:-1]) * factors[text[-1]])
    return int(text)


class _AnonPoller(threading.Thread):
    """Polls the anonymous resident memory of a process and its children (the kernel keeps no peak of it)."""

    def __init__(self, pid: int, interval_s: float):
        super().__init__(daemon=True)
        self.pid = pid
        self.interval_s = interval_s
        self.peak = 0
        self.stopped = threading.Event()

    def run(self) -> None:
        try:
            root = psutil.Process(self.pid)
        except psutil.Error:
            return
        while not self.stopped.is_set():
            total = 0
            try:
                processes = [root] + root.children(recursive=True)
            except psutil.Error:
                return
            for process in processes:
                try:
                    info = process.memory_info()
                except psutil.Error:
                    continue
                total += max(0, info.rss - info.shared)  # shared = RssFile + RssShmem on Linux
            self.peak = max(self.peak, total)
            self.stopped.wait(self.interval_s)


def run_measured(
    argv: Sequence[str],
    *,
    env: Optional[Mapping[str, str]] = None,
    cwd: Optional[Path] = None,
    log_path: Optional[Path] = None,
    poll_s: float = 0.05,
    data_limit_bytes: Optional[int] = None,
    timeout_s: Optional[float] = None,
) -> Measurement:
    """Run ``argv`` to completion and measure it; stdout and stderr go to ``log_path``.

    ``data_limit_bytes`` sets RLIMIT_DATA in the child (private writable memory, i.e. what
    the heap and anonymous mappings may take; read-only file mappings are not counted), so
    a run that needs more fails with an allocation error instead of pushing a shared
    machine into the OOM killer.
    """

    def limit() -> None:
        if data_limit_bytes is not None:
            resource.setrlimit(resource.RLIMIT_DATA, (data_limit_bytes, data_limit_bytes))

    if log_path is None:
        log_path = CACHE_DIR / "logs" / f"run-{os.getpid()}-{time.time_ns()}.log"
    log_path.parent.mkdir(parents=True, exist_ok=True)
    load_before = os.getloadavg()[0]
    with open(log_path, "wb") as log:
        started = time.perf_counter()
        process = subprocess.Popen(
            list(argv),
            env=dict(env) if env is not None else None,
            cwd=cwd,
            stdout=log,
            stderr=subprocess.STDOUT,
            preexec_fn=limit if data_limit_bytes is not None else None,
        )
        poller = _AnonPoller(process.pid, poll_s)
        poller.start()
        timer = None
        if timeout_s is not None:
            timer = threading.Timer(timeout_s, process.kill)
            timer.start()
        _, status, usage = os.wait4(process.pid, 0)
        wall = time.perf_counter() - started
        if timer is not None:
            timer.cancel()
        process.returncode = os.waitstatus_to_exitcode(status)
        poller.stopped.set()
        poller.join()
    measurement = Measurement(
        argv=list(argv),
        returncode=process.returncode,
        wall_s=wall,
        user_s=usage.ru_utime,
        sys_s=usage.ru_stime,
        max_rss_bytes=usage.ru_maxrss * 1024,  # KiB on Linux
        peak_anon_bytes=poller.peak,
        load_before=load_before,
        load_after=os.getloadavg()[0],
        log_path=str(log_path),
        log_tail=tail(log_path),
    )
    if not measurement.ok:
        LOG.warning("%s exited with %d; log: %s", argv[0], measurement.returncode, log_path)
    return measurement


def tail(path: Path, characters: int = 2000) -> str:
    """The end of a log file (for results files and error messages)."""
    with open(path, "rb") as handle:
        handle.seek(0, os.SEEK_END)
        size = handle.tell()
        handle.seek(max(0, size - characters))
        return handle.read().decode("utf-8", errors="replace")


def median(values: Iterable[float]) -> float:
    values = list(values)
    return statistics.median(values) if values else float("nan")


def linear_fit(points: Sequence[tuple[float, float]]) -> tuple[float, float]:
    """Least-squares intercept and slope of y over x (used to extrapolate time and memory by size)."""
    if len(points) < 2:
        raise ValueError("a fit needs at least two points")
    xs, ys = zip(*points)
    mean_x, mean_y = sum(xs) / len(xs), sum(ys) / len(ys)
    sxx = sum((x - mean_x) ** 2 for x in xs)
    if sxx == 0:
        raise ValueError("a fit needs two distinct x values")
    slope = sum((x - mean_x) * (y - mean_y) for x, y in zip(xs, ys)) / sxx
    return mean_y - slope * mean_x, slope


def git_state(checkout: Path, pathspec: str = ".") -> GitState:
    """Commit of ``checkout``, and whether ``pathspec`` in it has uncommitted changes: which code a figure is of."""

    def git(*args: str) -> str:
        return subprocess.run(
            ["git", "-C", str(checkout), *args], capture_output=True, text=True, check=False
        ).stdout.strip()

    commit = git("rev-parse", "HEAD")
    return GitState(
        path=str(checkout),
        commit=commit or None,
        branch=git("rev-parse", "--abbrev-ref", "HEAD") or None,
        last_change=git("log", "-1", "--format=%H", "--", pathspec) or None,
        dirty=bool(git("status", "--porcelain", "--untracked-files=all", "--", pathspec)) if commit else None,
    )


def plugin_location(env: Mapping[str, str]) -> Path:
    """Where children started with ``env`` import ``mergekit_ram`` from (asked outside any checkout)."""
    result = subprocess.run(
        [sys.executable, "-c", "import os, mergekit_ram as m; print(os.path.dirname(os.path.dirname(m.__file__)))"],
        capture_output=True,
        text=True,
        check=True,
        cwd="/",
        env=dict(env),
    )
    return Path(result.stdout.strip())


def cpu_model() -> str:
    """The processor's model name (from /proc/cpuinfo where there is one)."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as handle:
            for line in handle:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def machine_info(env: Optional[Mapping[str, str]] = None) -> Machine:
    """The facts a reader needs to compare figures between machines and runs."""
    import mergekit
    import torch

    plugin = plugin_location(env or child_env())
    return Machine(
        hostname=platform.node(),
        cpu=cpu_model(),
        cpu_count=os.cpu_count() or 1,
        affinity=len(os.sched_getaffinity(0)),
        memory_bytes=psutil.virtual_memory().total,
        memory_available_bytes=psutil.virtual_memory().available,
        disk_free_bytes=shutil.disk_usage(BENCH_DIR).free,
        load_average=os.getloadavg(),
        python=platform.python_version(),
        torch=torch.__version__,
        torch_threads=torch.get_num_threads(),
        mergekit=_version("mergekit", getattr(mergekit, "__version__", None)),
        mergekit_ram=_version("mergekit-ram", None),
        thread_env={key: value for key, value in os.environ.items() if key.startswith(THREAD_ENV_PREFIXES)},
        plugin=git_state(plugin, "mergekit_ram"),
        benchmarks=git_state(REPO_ROOT, "benchmarks"),
        time=time.strftime("%Y-%m-%d %H:%M:%S %z"),
    )


def _version(distribution: str, fallback: Optional[str]) -> Optional[str]:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(distribution)
    except PackageNotFoundError:
        return fallback


def fmt_bytes(value: Optional[float]) -> str:
    if value is None or value != value:
        return "n/a"
    if value >= GIB:
        return f"{value / GIB:.2f} GiB"
    return f"{value / MIB:.0f} MiB"


def fmt_seconds(value: Optional[float]) -> str:
    if value is None or value != value:
        return "n/a"
    return f"{value:.1f} s" if value >= 10 else f"{value:.2f} s"


def fmt_ratio(value: Optional[float]) -> str:
    return "n/a" if value is None else f"{value:.2f}x"


def fmt_count(value: float) -> str:
    """Parameters or elements: 123.4M, 3.40B."""
    if value >= 1e9:
        return f"{value / 1e9:.2f}B"
    if value >= 1e6:
        return f"{value / 1e6:.1f}M"
    return f"{value:,.0f}"


def setup_logging(verbose: bool) -> None:
    """Command-line entry points only: modules log, the commands print tables."""
    logging.basicConfig(level=logging.DEBUG if verbose else logging.INFO, format="%(levelname)s %(name)s: %(message)s")
