"""Shared fixtures: tiny models on disk, recipes, and the real mergekit console scripts."""

from __future__ import annotations

import contextlib
import fcntl
import functools
import glob
import importlib
import io
import json
import logging
import os
import re
import resource
import signal
import subprocess
import sys
import threading
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator, Optional, TypeVar

import pytest
import torch
import yaml
from safetensors.torch import load_file

from mergekit_ram.synthetic import PAPER_AGENTS, PAPER_OVERLAP, Agents, build_agents, tiny_config

os.environ["HF_HUB_OFFLINE"] = "1"
# The pre-pass cache is tested on its own (test_statistics.py); elsewhere every pre-pass really runs.
os.environ["MERGEKIT_RAM_CACHE"] = "off"

T = TypeVar("T")


def script(name: str) -> str:
    """The console script installed beside this interpreter (the real mergekit-yaml, ...)."""
    return os.path.join(os.path.dirname(sys.executable), name)


#: The console scripts the tests run in this process: name -> the module whose ``main`` is its click command.
SCRIPTS = {
    "mergekit-yaml": "mergekit.scripts.run_yaml",
    "mergekit-multi": "mergekit.scripts.multimerge",
    "mergekit-pytorch": "mergekit.scripts.merge_raw_pytorch",
    "mergekit-ram": "mergekit_ram.cli",
}


def run_script(
    name: str, *args: str, env: Optional[dict[str, str]] = None, check: bool = True
) -> subprocess.CompletedProcess:
    """The console script ``name`` run on ``args`` in this process as its entry point runs it: its click
    command through click's ``CliRunner`` (the ``Error:`` lines, the exit status), ``env`` set meanwhile, and in
    its stderr what a fresh process would print there: the log records its logging shows (WARNING and up, INFO
    under ``-v``) and the traceback of an error nothing caught. What happens while a script starts (the start-up
    hook, signals) is tested in processes of their own (``run_process``)."""
    import click.testing

    from mergekit_ram.interrupts import PlainWarnings

    command = importlib.import_module(SCRIPTS[name]).main
    fresh_loaders()
    handler = ScriptStderr()
    handler.setFormatter(logging.Formatter(logging.BASIC_FORMAT))
    root, plugin = logging.getLogger(), logging.getLogger("mergekit_ram")
    level, threads = root.level, torch.get_num_threads()
    verbose = any(re.fullmatch(r"-v+|--verbose", argument) for argument in args)
    root.setLevel(logging.INFO if verbose else logging.WARNING)
    root.addHandler(handler)
    plain = PlainWarnings.install()  # as the start-up hook (and mergekit-ram's main) does in a fresh process
    try:
        result = click.testing.CliRunner().invoke(command, list(args), env=env, prog_name=name)
    finally:
        root.removeHandler(handler)
        plugin.removeHandler(plain)
        plugin.propagate = True
        root.setLevel(level)
        torch.set_num_threads(threads)  # mergekit's -j sets this process's
    stderr = result.stderr
    if result.exception is not None and not isinstance(result.exception, SystemExit):
        stderr += "".join(traceback.format_exception(result.exception))
    completed = subprocess.CompletedProcess([name, *args], result.exit_code, result.stdout, stderr)
    if check and completed.returncode != 0:
        raise AssertionError(f"{name} {' '.join(args)} failed ({completed.returncode}):\n{completed.stderr[-6000:]}")
    return completed


class ScriptStderr(logging.StreamHandler):
    """Log records written to the standard error of the moment: CliRunner's while a script runs, in order with
    what the script prints there."""

    @property
    def stream(self) -> Any:
        return sys.stderr

    @stream.setter
    def stream(self, _value: Any) -> None:
        pass


@contextlib.contextmanager
def hang_fails(seconds: int = 120) -> Iterator[None]:
    """A block that waits longer than ``seconds`` (on a FIFO, a lock) fails instead of hanging the test run: an
    alarm interrupts the wait and raises ``TimeoutError``."""

    def expired(_number: int, _frame: Any) -> None:
        raise TimeoutError(f"still waiting after {seconds} s")

    previous = signal.signal(signal.SIGALRM, expired)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


def fresh_loaders() -> None:
    """mergekit's loaders forgotten, as in a new process: mergekit keeps every model's index and open files in
    one class-level table for the life of the process."""
    tasks = sys.modules.get("mergekit.io.tasks")  # none yet (or made unimportable): nothing to forget
    if tasks is not None:
        tasks.LoaderCache().flush_all()
        tasks.LoaderCache.loaders.clear()


def lower_limits(limits: dict[int, int]) -> None:
    """Each soft resource limit of ``limits`` (a ``resource.RLIMIT_*`` number) set."""
    for which, soft in limits.items():
        resource.setrlimit(which, (soft, resource.getrlimit(which)[1]))


def run_process(
    command: list[str],
    environment: Optional[dict[str, str]] = None,
    timeout: Optional[float] = None,
    limits: Optional[dict[int, int]] = None,
) -> subprocess.CompletedProcess:
    """``command`` (a console script's path or a ``.py`` file, and its arguments) in a new interpreter, as
    ``subprocess.run(capture_output=True, text=True)`` runs it: only for what a process of its own is the subject
    of (start-up, signals, crash states, resource limits), in tests marked ``process``."""
    started = [sys.executable, *command] if command[0].endswith(".py") else command
    lower = functools.partial(lower_limits, limits) if limits else None
    environment = {**os.environ, "HF_HUB_OFFLINE": "1", **(environment or {})}
    return subprocess.run(started, env=environment, capture_output=True, text=True, timeout=timeout, preexec_fn=lower)


def merge_in_process(recipe: dict[str, Any] | str, out: str, **options: Any) -> None:
    """``recipe`` merged by mergekit's run_merge in this process (the plugin registered as users get it).

    A recipe file's path is merged as mergekit-yaml merges it: its text is the config source
    mergekit copies into the output, so the folder equals mergekit-yaml's byte for byte.
    mergekit is imported here, not at the top: tests/test_layers.py runs the plain layers' tests
    with mergekit unimportable, and they share this conftest."""
    from mergekit.config import MergeConfiguration
    from mergekit.merge import run_merge
    from mergekit.options import MergeOptions

    source = None
    if isinstance(recipe, str):
        with open(recipe, encoding="utf-8") as handle:
            source = handle.read()
        recipe = yaml.safe_load(source)
    config = MergeConfiguration.model_validate(recipe)
    fresh_loaders()
    run_merge(config, out, options=MergeOptions(quiet=True, **options), config_source=source)


@contextlib.contextmanager
def plugin_log(level: int = logging.INFO, this_thread: bool = False) -> Iterator[io.StringIO]:
    """What mergekit-ram logs at ``level`` and above meanwhile (INFO: what -v shows; WARNING: what a new
    interpreter prints), only this thread's records where asked."""
    logger, text, thread = logging.getLogger("mergekit_ram"), io.StringIO(), threading.get_ident()
    handler, previous = logging.StreamHandler(text), logger.level
    handler.setLevel(level)
    if this_thread:
        handler.addFilter(lambda record: record.thread == thread)
    logger.addHandler(handler)
    if logger.getEffectiveLevel() > level:
        logger.setLevel(level)
    try:
        yield text
    finally:
        logger.removeHandler(handler)
        logger.setLevel(previous)


def command_refusal(command: Any, *args: str) -> str:
    """The message a console script's click command (``mergekit.scripts.run_yaml.main``, ...)
    refuses ``args`` with, run in this process: what the script prints after "Error: " (the
    printing itself, one line, is tested through subprocesses in tests/test_cli.py)."""
    import click

    with pytest.raises(click.ClickException) as refused:
        command.main(args=list(args), standalone_mode=False)
    return refused.value.format_message()


def write_recipe(path: str, recipe: dict[str, Any]) -> str:
    with open(path, "w", encoding="utf-8") as handle:
        yaml.safe_dump(recipe, handle, sort_keys=False)
    return path


def load_weights(path: str) -> dict[str, torch.Tensor]:
    weights: dict[str, torch.Tensor] = {}
    for file in sorted(glob.glob(os.path.join(path, "*.safetensors"))):
        weights.update(load_file(file))
    return weights


def load_statistics(path: str) -> dict[str, Any]:
    with open(os.path.join(path, "ram_statistics.json"), encoding="utf-8") as handle:
        return json.load(handle)


@dataclass(frozen=True)
class ModelSet:
    """A base and fine-tunes on disk, with the masks they were built from."""

    base: str
    agents: list[str]
    design: Agents

    def recipe(self, method: str, **extra: Any) -> dict[str, Any]:
        return {
            "merge_method": method,
            "base_model": self.base,
            "models": [{"model": path} for path in self.agents],
            **extra,
        }


#: Elements in each model of ``bf16_models`` / ``fp32_models`` (2 layers, hidden 32, MLP 48, vocabulary 64).
BF16_MODELS_ELEMENTS = 19_616
#: Elements of ``bf16_models.recipe("ram")`` that mergekit 0.1.5's built-in ``ram`` (arithmetic in
#: bfloat16) writes differently from the exact result (tests/reference.py in float32, rounded once
#: to bfloat16). The models are built from fixed seeds, so the count is a constant: measured once
#: with torch 2.13.0 (CPU) by counting ``builtin != exact`` over every tensor of the merge
#: (tests/test_merge_exact.py::test_plugin_ram_matches_builtin_ram_in_float32).
BUILTIN_RAM_BF16_WRONG_ELEMENTS = 463  # 2.4% of BF16_MODELS_ELEMENTS


def _build(directory: str, dtype: torch.dtype, architecture: str = "llama") -> ModelSet:
    config = tiny_config(architecture, hidden_size=32, intermediate_size=48, num_layers=2, vocab_size=64)
    base, agents, design = build_agents(directory, config, PAPER_OVERLAP, PAPER_AGENTS, dtype=dtype, seed=3)
    return ModelSet(base=base, agents=agents, design=design)


#: The test files that take longest in ``make test``, longest first (measured): with ``--dist loadfile
#: --no-loadscope-reorder`` pytest-xdist hands them out first, so no worker is left alone with one at the end.
SLOWEST_FIRST = (
    "test_output.py",
    "test_transaction.py",
    "test_interrupts.py",
    "test_resources.py",
    "test_entry_points.py",
    "test_layers.py",
    "test_moved_mergekit.py",
    "test_kernel.py",
    "test_reliability.py",
    "test_packaging.py",
    "test_statistics.py",
    "test_variants.py",
)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    rank = {name: index for index, name in enumerate(SLOWEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: each file's order kept


#: The audit events by which Python starts another program (or a copy of this one).
PROCESS_EVENTS = frozenset(
    {"subprocess.Popen", "os.fork", "os.forkpty", "os.posix_spawn", "os.spawn", "os.exec", "os.system"}
)


#: This checkout's code: a module of it that starts a process while imported is the project's doing, not a library's.
PROJECT_CODE = tuple(str(Path(__file__).resolve().parent.parent / part) + os.sep for part in ("mergekit_ram", "tests"))


def library_start_up(frame: Optional[Any]) -> bool:
    """Whether ``frame`` runs inside the import of a module from outside this project: a library's own start-up
    (matplotlib runs ``fc-list`` while importing its font manager the first time, with an empty MPLCONFIGDIR), which
    the test does not start and a warm cache would skip."""
    while frame is not None:
        caller = frame.f_back
        importing = caller is not None and caller.f_code.co_filename.startswith("<frozen importlib")
        if frame.f_code.co_name == "<module>" and importing:
            return not os.path.realpath(frame.f_code.co_filename).startswith(PROJECT_CODE)
        frame = caller
    return False


class ProcessAudit:
    """Refuses a new process in a test without the ``process`` mark, so the marked tests are every test that
    starts one (``pytest -m process`` runs them alone; at most 20 such functions); a library's start-up while it is
    imported is not the test's (``library_start_up``)."""

    def __init__(self) -> None:
        self.item: Optional[pytest.Item] = None

    def __call__(self, event: str, args: tuple[Any, ...]) -> None:
        if event not in PROCESS_EVENTS or self.item is None or self.item.get_closest_marker("process") is not None:
            return
        if not library_start_up(sys._getframe(1)):
            raise RuntimeError(f"{self.item.nodeid} starts a process ({event}): mark it @pytest.mark.process")

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_protocol(self, item: pytest.Item) -> Iterator[None]:
        self.item = item
        yield
        self.item = None


def pytest_configure(config: pytest.Config) -> None:
    audit = ProcessAudit()
    sys.addaudithook(audit)
    config.pluginmanager.register(audit, "mergekit-ram-process-audit")


@pytest.fixture(scope="session")
def run_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A folder of this test run that every xdist worker shares (the session's own without xdist)."""
    base = tmp_path_factory.getbasetemp()
    return base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base


def built_once(root: Path, name: str, build: Callable[[str], T]) -> T:
    """``build(root / name)``, run by the first worker of the test run that asks; the others wait
    for it and read its result (saved beside the folder with torch.save: it may hold tensors)."""
    folder, result = root / name, root / f"{name}.result"
    with open(root / f"{name}.lock", "w", encoding="utf-8") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not result.exists():
            built = build(str(folder))
            torch.save(built, result)
            return built
    return torch.load(result, weights_only=False)


@pytest.fixture(scope="session")
def bf16_models(run_root: Path) -> ModelSet:
    return built_once(run_root, "bf16", lambda folder: _build(folder, torch.bfloat16))


@pytest.fixture(scope="session")
def fp32_models(run_root: Path) -> ModelSet:
    return built_once(run_root, "fp32", lambda folder: _build(folder, torch.float32))


@dataclass(frozen=True)
class Merged:
    """A finished mergekit-yaml run: its output folder, recipe file and stderr."""

    out: str
    recipe: str
    stderr: str


def upstream_ram_recipe(models: ModelSet) -> dict[str, Any]:
    """The shape of mergekit 0.1.5's tests/test_basic_merges.py::TestBasicMerges::test_ram_merge:
    ``weight`` on every model (its helper sets it for every method), bfloat16, a base, no parameters."""
    recipe = models.recipe("ram", dtype="bfloat16")
    for entry, weight in zip(recipe["models"], (0.6, 0.4, 0.2)):
        entry["parameters"] = {"weight": weight}
    return recipe


def merge_once(root: Path, name: str, recipe: dict[str, Any], alone: bool = False) -> Merged:
    """``recipe`` merged by the real mergekit-yaml into ``root/name``, once per test run (``alone``: as mergekit
    alone merges it): what the shared merges below hold."""

    def merge(folder: str) -> Merged:
        os.makedirs(folder)
        path = write_recipe(os.path.join(folder, "recipe.yml"), recipe)
        with mergekit_alone() if alone else contextlib.nullcontext():
            completed = run_script("mergekit-yaml", path, os.path.join(folder, "out"))
        return Merged(out=os.path.join(folder, "out"), recipe=path, stderr=completed.stderr)

    return built_once(root, name, merge)


@contextlib.contextmanager
def mergekit_alone() -> Iterator[None]:
    """mergekit as it runs without the plugin (``MERGEKIT_RAM_AUTOLOAD=0``), in this process meanwhile: the
    seams' originals in every module that holds them, the registry without the four methods and with the
    built-in ``ram``."""
    from mergekit.merge_methods import ram_merge
    from mergekit.merge_methods.registry import _METHODS

    from mergekit_ram.parameters import METHOD_NAMES

    with pytest.MonkeyPatch.context() as patch:
        for module, name in [(SCRIPTS[script], "run_merge") for script in ("mergekit-yaml", "mergekit-multi")] + [
            ("mergekit.merge", "run_merge"),
            ("mergekit.scripts.merge_raw_pytorch", "plan_flat_merge"),
        ]:
            seam = getattr(importlib.import_module(module), name)
            patch.setattr(f"{module}.{name}", getattr(seam, "__wrapped__", seam))
        for method in METHOD_NAMES:
            patch.delitem(_METHODS, method, raising=False)
        patch.setitem(_METHODS, "ram", ram_merge)
        yield


# Shared merges: each runs once per test run (for all xdist workers), the first time a test asks
# for it. A test that reads one must not change its folder (copy it first); a test that needs a
# fresh run, another recipe or other options runs its own.


@pytest.fixture(scope="session")
def upstream_ram_merge(bf16_models: ModelSet, run_root: Path) -> Merged:
    """One plugin ``ram`` merge of that shape through the real mergekit-yaml, shared by several tests."""
    return merge_once(run_root, "upstream-ram", upstream_ram_recipe(bf16_models))


@pytest.fixture(scope="session")
def ram_plus_merge(bf16_models: ModelSet, run_root: Path) -> Merged:
    """The plugin's ``ram_plus`` with its default parameters on the bfloat16 models (``recipe("ram_plus")``)."""
    return merge_once(run_root, "ram-plus", bf16_models.recipe("ram_plus"))


@pytest.fixture(scope="session")
def ram_merge(bf16_models: ModelSet, run_root: Path) -> Merged:
    """The plugin's ``ram`` on the bfloat16 models (``recipe("ram")``)."""
    return merge_once(run_root, "ram", bf16_models.recipe("ram"))


@pytest.fixture(scope="session")
def builtin_ram_merge(bf16_models: ModelSet, run_root: Path) -> Merged:
    """mergekit 0.1.5's built-in ``ram`` (MERGEKIT_RAM_AUTOLOAD=0) on the bfloat16 models (``recipe("ram")``)."""
    return merge_once(run_root, "builtin-ram", bf16_models.recipe("ram"), alone=True)
