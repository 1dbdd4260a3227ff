"""Shared fixtures: tiny models on disk, recipes, and the real mergekit console scripts."""

from __future__ import annotations

import atexit
import contextlib
import errno
import fcntl
import functools
import glob
import hashlib
import importlib.metadata
import json
import locale
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional, TypeVar

import pytest
import torch
import yaml
from safetensors.torch import load_file

from mergekit_ram import cache
from mergekit_ram.synthetic import PAPER_AGENTS, PAPER_OVERLAP, Agents, build_agents, tiny_config
from tests.warm_interpreter import lower_limits

os.environ["HF_HUB_OFFLINE"] = "1"
# The pre-pass cache is tested on its own (test_statistics.py); elsewhere every pre-pass really runs.
os.environ["MERGEKIT_RAM_CACHE"] = "off"

T = TypeVar("T")


def script(name: str) -> str:
    """The console script installed beside this interpreter (the real mergekit-yaml, ...)."""
    return os.path.join(os.path.dirname(sys.executable), name)


#: What a forked run takes on after the fork: variables read only once the script runs, and the fault
#: hook's (``tests/faults``, installed again in each forked run). The xdist worker's name, so that the
#: workers of a test run share their warm interpreters.
FORK_VARIABLES = frozenset(
    {
        "PYTEST_CURRENT_TEST",
        "PYTEST_XDIST_WORKER",
        cache.MODE_VARIABLE,
        cache.DIRECTORY_VARIABLE,
        cache.SHARED_VARIABLE,
        "MERGEKIT_RAM_TEST_FAULT",
        "MERGEKIT_RAM_TEST_COUNT",
        "MERGEKIT_RAM_TEST_RELEASE",
    }
)
#: Set to 1 to start every run afresh (``run_python``).
COLD_VARIABLE = "MERGEKIT_RAM_TEST_COLD"
WARM_SERVER = os.path.join(os.path.dirname(__file__), "warm_interpreter.py")
#: What ``mergekit-ram``'s commands import once they run (inside the command), by command.
MERGE_SCRIPTS = ("mergekit.scripts.run_yaml", "mergekit.scripts.multimerge", "mergekit.scripts.merge_raw_pytorch")
COMMAND_IMPORTS = {
    "yaml": MERGE_SCRIPTS,
    "multi": MERGE_SCRIPTS,
    "pytorch": MERGE_SCRIPTS,
    "probe": ("mergekit_ram.probe", "mergekit_ram.integration.scripts", "mergekit_ram.integration.recipes"),
    "check": ("torch", "mergekit_ram.sharing"),
}


#: The folder of this test run's warm interpreters, made by the pytest process that starts the xdist workers
#: (``pytest_configure``), so that the workers share them; removed once the run ends.
WARM_FOLDER_VARIABLE = "MERGEKIT_RAM_TEST_WARM_FOLDER"


def pytest_configure(config: pytest.Config) -> None:
    if not hasattr(config, "workerinput"):  # not an xdist worker: before any worker starts
        os.environ[WARM_FOLDER_VARIABLE] = tempfile.mkdtemp(prefix="warm-")


def pytest_unconfigure(config: pytest.Config) -> None:
    if not hasattr(config, "workerinput"):
        shutil.rmtree(os.environ.pop(WARM_FOLDER_VARIABLE), ignore_errors=True)


@functools.cache
def launcher_folder() -> str:
    """Where the warm interpreters are started from: the test run's, or outside pytest this process's own."""
    if WARM_FOLDER_VARIABLE in os.environ:
        return os.environ[WARM_FOLDER_VARIABLE]
    folder = tempfile.mkdtemp(prefix="warm-")
    atexit.register(shutil.rmtree, folder, True)
    return folder


class WarmInterpreter:
    """A ``tests/warm_interpreter.py`` server: started as ``argv``, with ``environment``, ``preload`` imported,
    listening on an abstract socket name that every worker of the test run connects to. The worker that
    started it keeps it running (``keepalive``); a worker finding none listening (never started, or gone
    with its starter) starts one."""

    def __init__(
        self, argv: tuple[str, ...], preload: tuple[str, ...], environment: tuple[tuple[str, str], ...]
    ) -> None:
        self.argv, self.preload, self.environment = argv, preload, environment
        key = hashlib.sha256(repr((launcher_folder(), argv, preload, environment)).encode()).hexdigest()
        self.address = f"\0mergekit-ram-warm-{key}"  # Linux's abstract namespace: gone with the server
        self.keepalive: Optional[socket.socket] = None
        self.process: Optional[subprocess.Popen] = None  # held: a dropped Popen warns of a running child

    def connect(self) -> socket.socket:
        """A connection to the server, started first where none listens."""
        with open(os.path.join(launcher_folder(), "start.lock"), "w", encoding="utf-8") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            connection = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
            try:
                connection.connect(self.address)
            except ConnectionRefusedError:
                connection.connect(self.start())
            return connection

    def start(self) -> str:
        """The server started, listening on ``address`` (taken over from one still ending)."""
        launcher = os.path.join(launcher_folder(), self.argv[0])  # argv[0] named as the real script's
        with contextlib.suppress(FileExistsError):
            os.symlink(WARM_SERVER, launcher)
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        for _ in range(200):
            try:
                listener.bind(self.address)
                break
            except OSError as error:  # EADDRINUSE: a server told to end has not yet ended
                if error.errno != errno.EADDRINUSE:
                    raise
                time.sleep(0.05)
        else:
            raise AssertionError(f"the warm interpreter for {self.argv[0]} before this one does not end")
        listener.listen(64)
        self.keepalive, theirs = socket.socketpair()
        descriptors = (listener.fileno(), theirs.fileno())
        variables = {
            "MERGEKIT_RAM_TEST_WARM": ",".join(map(str, descriptors)),
            "MERGEKIT_RAM_TEST_PRELOAD": ",".join(self.preload),
        }
        self.process = subprocess.Popen(
            [sys.executable, launcher, *self.argv[1:]],
            env={**dict(self.environment), **variables},
            pass_fds=descriptors,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
        )
        listener.close()
        theirs.close()
        return self.address

    def run(
        self, command: list[str], environment: dict[str, str], timeout: Optional[float], limits: dict[int, int]
    ) -> Optional[subprocess.CompletedProcess]:
        """``command`` (a script and its arguments) forked from the server, under the soft resource
        ``limits``; None where it answers that a fresh start is needed, or does not answer. Safe from
        several threads at once."""
        request = {"script": command[0], "args": command[1:], "env": environment, "cwd": os.getcwd(), "limits": limits}
        for _ in range(3):  # a server ending (its starter's ``keepalive`` closed) drops requests unanswered
            reply, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
            with reply, open(os.devnull, "rb") as stdin, tempfile.TemporaryFile() as out:
                with tempfile.TemporaryFile() as err:
                    with theirs, self.connect() as connection:
                        descriptors = [handle.fileno() for handle in (stdin, out, err, theirs)]
                        socket.send_fds(connection, [json.dumps(request).encode()], descriptors)
                    pid = reply.recv(64)
                    if pid == b"cold":
                        return None
                    if not pid:
                        time.sleep(0.1)
                        continue
                    reply.settimeout(timeout)
                    try:
                        status = reply.recv(64)
                    except TimeoutError:
                        os.kill(int(pid), signal.SIGKILL)  # as subprocess.run does at its timeout
                        raise subprocess.TimeoutExpired(command, timeout or 0) from None
                    return subprocess.CompletedProcess(command, int(status), text(out), text(err))
        return None  # a server that keeps dropping requests: a fresh start (``test_a_warm_run_is_a_fresh_run``)


def text(handle: Any) -> str:
    """A captured stream as ``subprocess.run(text=True)`` returns it."""
    handle.seek(0)
    data = handle.read().decode(locale.getpreferredencoding(False))
    return data.replace("\r\n", "\n").replace("\r", "\n")


@functools.lru_cache(maxsize=10)  # about 420 MB each, per xdist worker
def warm_interpreter(
    argv: tuple[str, ...], preload: tuple[str, ...], environment: tuple[tuple[str, str], ...]
) -> WarmInterpreter:
    return WarmInterpreter(argv, preload, environment)


def warm_run(
    command: list[str],
    environment: dict[str, str],
    timeout: Optional[float] = None,
    limits: Optional[dict[int, int]] = None,
) -> Optional[subprocess.CompletedProcess]:
    """``command`` (a console script's path or a Python script's, and its arguments) forked from a warm
    interpreter started with ``environment`` (``FORK_VARIABLES`` aside); None where a fresh start is needed."""
    name, first = os.path.basename(command[0]), tuple(command[1:2])
    if command[0] == script(name):
        (entry,) = importlib.metadata.entry_points(group="console_scripts", name=name)
        imports = COMMAND_IMPORTS.get(first[0], ()) if name == "mergekit-ram" and first else ()
        argv = (name, *first) if imports else (name,)  # as the start-up hook reads it
        preload = (entry.module, *imports)
    else:  # a Python script: the modules it imports from this repository
        with open(command[0], encoding="utf-8") as handle:
            source = handle.read()
        argv, preload = (name,), tuple(re.findall(r"^(?:from|import) (mergekit_ram[\w.]*)", source, re.MULTILINE))
    start = tuple(sorted((key, value) for key, value in environment.items() if key not in FORK_VARIABLES))
    return warm_interpreter(argv, preload, start).run(command, environment, timeout, limits or {})


def run_python(
    command: list[str],
    environment: dict[str, str],
    timeout: Optional[float] = None,
    limits: Optional[dict[int, int]] = None,
) -> subprocess.CompletedProcess:
    """``command`` (a console script or a ``.py`` file, and its arguments) in a process of its own, as
    ``subprocess.run(capture_output=True, text=True)`` runs it.

    Forked from a warm interpreter that has done its imports (``tests/warm_interpreter.py``), one per
    script and start-up environment (``environment`` but ``FORK_VARIABLES``), which saves a console
    script 5.5 s of CPU. A run whose fault is during the imports starts afresh, as does every run under
    ``MERGEKIT_RAM_TEST_COLD=1``. Tests of what happens while a script starts (entry points, Ctrl-C)
    start their processes themselves. ``limits``: soft resource limits of the run (``resource``), set
    once the imports are done (afresh: as it starts)."""
    cold = "1" in (environment.get(COLD_VARIABLE), os.environ.get(COLD_VARIABLE))
    if not cold and not environment.get("MERGEKIT_RAM_TEST_FAULT", "").startswith("import:"):
        completed = warm_run(command, environment, timeout, limits)
        if completed is not None:
            return completed
    started = [sys.executable, *command] if command[0].endswith(".py") else command
    lower = functools.partial(lower_limits, limits) if limits else None
    return subprocess.run(started, env=environment, capture_output=True, text=True, timeout=timeout, preexec_fn=lower)


def run_script(
    name: str, *args: str, env: Optional[dict[str, str]] = None, check: bool = True
) -> subprocess.CompletedProcess:
    """The real console script ``name`` run on ``args`` in a process of its own (``run_python``)."""
    completed = run_python([script(name), *args], {**os.environ, "HF_HUB_OFFLINE": "1", **(env or {})})
    if check and completed.returncode != 0:
        raise AssertionError(f"{name} {' '.join(args)} failed ({completed.returncode}):\n{completed.stderr[-6000:]}")
    return completed


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
    run_merge(config, out, options=MergeOptions(quiet=True, **options), config_source=source)


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
    "test_cli.py",
    "test_interrupts.py",
    "test_moved_mergekit.py",
    "test_output.py",
    "test_entry_points.py",
    "test_transaction.py",
    "test_reliability.py",
    "test_layers.py",
    "test_inputs.py",
    "test_packaging.py",
    "test_kernel.py",
    "test_recipe_checks.py",
    "test_statistics.py",
    "test_check.py",
)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    rank = {name: index for index, name in enumerate(SLOWEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: each file's order kept


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


def merge_once(root: Path, name: str, recipe: dict[str, Any], env: Optional[dict[str, str]] = None) -> Merged:
    """``recipe`` merged by the real mergekit-yaml into ``root/name``, once per test run: what the
    shared merges below hold."""

    def merge(folder: str) -> Merged:
        os.makedirs(folder)
        path = write_recipe(os.path.join(folder, "recipe.yml"), recipe)
        completed = run_script("mergekit-yaml", path, os.path.join(folder, "out"), env=env)
        return Merged(out=os.path.join(folder, "out"), recipe=path, stderr=completed.stderr)

    return built_once(root, name, merge)


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
    return merge_once(run_root, "builtin-ram", bf16_models.recipe("ram"), env={"MERGEKIT_RAM_AUTOLOAD": "0"})
