"""Shared helpers of the benchmarks: paths, measured child processes, machine facts, number formats.

Every figure the benchmarks report about a whole program (a merge, the in-memory baseline)
comes from :func:`run_measured`, so all of them are taken the same way: wall time around
the child, its CPU time and kernel-exact peak RSS from ``wait4``, and its peak anonymous
memory polled from ``/proc`` (the peak RSS also counts the pages of memory-mapped input
files, which the kernel can drop at any time; anonymous memory is what a merge needs).
"""

from __future__ import annotations

import argparse
import contextlib
import functools
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
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Any, Iterable, Iterator, Mapping, Optional, Sequence

import psutil

from mergekit_ram.stats.schema import INFINITY

LOG = logging.getLogger(__name__)

BENCH_DIR = Path(__file__).resolve().parent
REPO_ROOT = BENCH_DIR.parent
CACHE_DIR = BENCH_DIR / ".cache"
GIB = 1024**3
MIB = 1024**2

#: Environment variables that change how torch's OpenMP threads behave; recorded with every result.
THREAD_ENV_PREFIXES = ("OMP_", "GOMP_", "KMP_", "MKL_")
#: Nothing may come from the Hugging Face Hub: mergekit's model card code otherwise asks it
#: whether a local path is a repository.
OFFLINE_ENV = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}


def console_script(name: str) -> str:
    """The path of an installed console script, next to this interpreter first."""
    found = shutil.which(name, path=os.path.dirname(sys.executable)) or shutil.which(name)
    if found is None:
        raise SystemExit(f"{name} is not installed in this environment: pip install mergekit")
    return found


def plugin_checkout(value: str) -> Path:
    """``--plugin``'s type: a checkout holding ``mergekit_ram/``, refused before anything runs (else the children
    would silently import the editable install's)."""
    path = Path(value)
    if not (path / "mergekit_ram" / "__init__.py").is_file():
        raise argparse.ArgumentTypeError(f"{value}: no mergekit_ram/ there; name a checkout of mergekit-ram")
    return path


def child_env(plugin: Optional[Path] = None, extra: Optional[Mapping[str, str]] = None) -> dict[str, str]:
    """The environment of every measured child: offline, plugin from ``plugin``, no pre-pass cache.

    ``plugin`` is a checkout whose ``mergekit_ram`` the children import (first on PYTHONPATH,
    ahead of the editable install); by default the checkout holding these benchmarks. The
    pre-pass cache is off: a cached pre-pass would skip the work being measured.
    """
    env = {**os.environ, **OFFLINE_ENV}
    paths = [str(plugin or REPO_ROOT), str(REPO_ROOT), *([env["PYTHONPATH"]] if env.get("PYTHONPATH") else [])]
    env["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(paths))
    env["MERGEKIT_RAM_CACHE"] = "off"
    env["MERGEKIT_RAM_CACHE_DIR"] = str(CACHE_DIR / "prepass-cache")
    return {**env, **(extra or {})}


def use_plugin(module: str, plugin: Optional[Path], argv: Sequence[str]) -> None:
    """Re-execute ``python -m module argv`` under :func:`child_env` unless this process already uses ``plugin``.

    The start-up hook imports ``mergekit_ram`` before ``python -m`` puts the current directory
    on ``sys.path``, so an in-process measurement would otherwise time the installed checkout.
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


def _poll_anon(pid: int, interval_s: float, stopped: threading.Event, peak: list[int]) -> None:
    """Keep in ``peak[0]`` the largest anonymous resident memory of ``pid`` and its children (no kernel peak)."""
    try:
        root = psutil.Process(pid)
        while not stopped.is_set():
            total = 0
            for process in [root, *root.children(recursive=True)]:
                try:
                    info = process.memory_info()
                except psutil.Error:
                    continue
                total += max(0, info.rss - info.shared)  # shared = RssFile + RssShmem on Linux
            peak[0] = max(peak[0], total)
            stopped.wait(interval_s)
    except psutil.Error:
        return


def run_measured(
    argv: Sequence[str],
    *,
    env: Optional[Mapping[str, str]] = None,
    log_path: Optional[Path] = None,
    data_limit_bytes: Optional[int] = None,
) -> dict[str, Any]:
    """Run ``argv`` to completion and measure it; stdout and stderr go to ``log_path``.

    ``data_limit_bytes`` sets RLIMIT_DATA in the child (private writable memory), so a run
    that needs more fails with an allocation error instead of calling the OOM killer.
    The measurement's ``extra`` holds what the caller reads from the run's output.
    """

    cap = data_limit_bytes
    log_path = log_path or CACHE_DIR / "logs" / f"run-{os.getpid()}-{time.time_ns()}.log"
    log_path.parent.mkdir(parents=True, exist_ok=True)
    load_before = os.getloadavg()[0]
    peak, stopped = [0], threading.Event()
    with open(log_path, "wb") as log:
        started = time.perf_counter()
        process = subprocess.Popen(
            list(argv),
            env=dict(env) if env is not None else None,
            stdout=log,
            stderr=subprocess.STDOUT,
            preexec_fn=None if cap is None else functools.partial(resource.setrlimit, resource.RLIMIT_DATA, (cap, cap)),
        )
        poller = threading.Thread(target=_poll_anon, args=(process.pid, 0.05, stopped, peak), daemon=True)
        poller.start()
        _, status, usage = os.wait4(process.pid, 0)
        wall = time.perf_counter() - started
        process.returncode = os.waitstatus_to_exitcode(status)
        stopped.set()
        poller.join()
    with open(log_path, "rb") as handle:
        handle.seek(max(0, log_path.stat().st_size - 2000))
        log_tail = handle.read().decode("utf-8", errors="replace")
    if process.returncode:
        LOG.warning("%s exited with %d; log: %s", argv[0], process.returncode, log_path)
    return {
        "argv": list(argv),
        "returncode": process.returncode,
        "wall_s": wall,
        "user_s": usage.ru_utime,
        "sys_s": usage.ru_stime,
        "max_rss_bytes": usage.ru_maxrss * 1024,  # KiB on Linux; counts mapped file pages
        "peak_anon_bytes": peak[0],
        "load_before": load_before,
        "load_after": os.getloadavg()[0],
        "log_path": str(log_path),
        "log_tail": log_tail,
        "extra": {},
    }


#: What each background process of a loaded run does: spin on one core.
BUSY_LOOP = "while True: pass"


@contextlib.contextmanager
def background_load(processes: int, limit_s: float = 3600.0) -> Iterator[list[int]]:
    """``processes`` busy interpreters (one core each) while the block runs; each is bounded by ``timeout`` and
    ended by its own id afterwards. Yields their ids (none for 0)."""
    started = [
        subprocess.Popen(["timeout", str(int(limit_s)), sys.executable, "-c", BUSY_LOOP], stdin=subprocess.DEVNULL)
        for _ in range(processes)
    ]
    try:
        yield [process.pid for process in started]
    finally:
        for process in started:
            process.terminate()  # timeout passes SIGTERM on to its child
        for process in started:
            process.wait()


def ratio_or_none(value: Any) -> Optional[float]:
    """A rho of a ``ram_statistics.json`` (infinite: ``null`` in schema 1, ``"inf"`` in 2), None if infinite."""
    return None if value is None or value == INFINITY else float(value)


def cpu_s(measurement: Mapping[str, Any]) -> float:
    return measurement["user_s"] + measurement["sys_s"]


def median(values: Iterable[float]) -> float:
    values = list(values)
    return statistics.median(values) if values else float("nan")


def git_state(checkout: Path, pathspec: str = ".") -> dict[str, Any]:
    """Commit of ``checkout``, the last to change ``pathspec``, and whether that had uncommitted changes."""

    def git(*args: str) -> str:
        result = subprocess.run(["git", "-C", str(checkout), *args], capture_output=True, text=True, check=False)
        return result.stdout.strip()

    commit = git("rev-parse", "HEAD")
    return {
        "path": str(checkout),
        "commit": commit or None,
        "branch": git("rev-parse", "--abbrev-ref", "HEAD") or None,
        "last_change": git("log", "-1", "--format=%H", "--", pathspec) or None,
        "dirty": bool(git("status", "--porcelain", "--untracked-files=all", "--", pathspec)) if commit else None,
    }


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as handle:
            for line in handle:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _version(distribution: str) -> Optional[str]:
    try:
        return version(distribution)
    except PackageNotFoundError:
        return None


def machine_info(env: Optional[Mapping[str, str]] = None) -> dict[str, Any]:
    """The facts a reader needs to compare figures between machines and runs, and which code they are of."""
    import torch

    plugin = subprocess.run(  # where children started with ``env`` import mergekit_ram from
        [sys.executable, "-c", "import os, mergekit_ram as m; print(os.path.dirname(os.path.dirname(m.__file__)))"],
        capture_output=True,
        text=True,
        check=True,
        cwd="/",
        env=dict(env or child_env()),
    ).stdout.strip()
    return {
        "hostname": platform.node(),
        "cpu": cpu_model(),
        "cpu_count": os.cpu_count() or 1,
        "affinity": len(os.sched_getaffinity(0)),
        "memory_bytes": psutil.virtual_memory().total,
        "memory_available_bytes": psutil.virtual_memory().available,
        "disk_free_bytes": shutil.disk_usage(BENCH_DIR).free,
        "load_average": list(os.getloadavg()),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "mergekit": _version("mergekit"),
        "mergekit_ram": _version("mergekit-ram"),
        "thread_env": {key: value for key, value in os.environ.items() if key.startswith(THREAD_ENV_PREFIXES)},
        "plugin": git_state(Path(plugin), "mergekit_ram"),
        "benchmarks": git_state(REPO_ROOT, "benchmarks"),
        "time": time.strftime("%Y-%m-%d %H:%M:%S %z"),
    }


def machine_line(machine: Mapping[str, Any]) -> str:
    """Where and when a run was measured, and the plugin's code (its last commit to ``mergekit_ram/``), in a line."""
    threads = "".join(f", {key}={value}" for key, value in (machine.get("thread_env") or {}).items())
    plugin = machine["plugin"]
    commit = (plugin.get("last_change") or plugin["commit"] or "?")[:10]
    return (
        f"{machine['cpu_count']} x {machine['cpu']}, {fmt_bytes(machine['memory_bytes'])}, Python {machine['python']}, "
        f"torch {machine['torch']}, mergekit {machine['mergekit']}; {machine['time']}, load at start "
        f"{machine['load_average'][0]:.2f}{threads}; mergekit_ram `{commit}`"
        + (" (modified)" if plugin["dirty"] else "")
    )


def fmt_bytes(value: Optional[float]) -> str:
    if value is None or value != value:
        return "n/a"
    return f"{value / GIB:.2f} GiB" if value >= GIB else f"{value / MIB:.0f} MiB"


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
    return f"{value / 1e6:.1f}M" if value >= 1e6 else f"{value:,.0f}"


def setup_logging(verbose: bool) -> None:
    """Command-line entry points only: modules log, the commands print tables."""
    logging.basicConfig(level=logging.DEBUG if verbose else logging.INFO, format="%(levelname)s %(name)s: %(message)s")
