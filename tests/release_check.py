"""The release check: build the distributions and use them as a user would.

    make release-check                           # the full check (downloads the dependencies)
    python tests/release_check.py [--torch SPEC] [--work DIR]
    python tests/release_check.py --reuse-environment   # offline and fast (tests/test_packaging.py)

1. ``python -m build``: the sdist, then the wheel built from the unpacked sdist (so the sdist is
   complete enough to build from).
2. ``twine check --strict`` on both, and the README as the package index renders it (the
   wheel's long description through ``readme_renderer``): every link must be absolute.
3. Each distribution's file list against ``tests/release_contents.txt``: a file that no pattern
   admits, or a pattern that no file matches, fails the check.
4. A fresh virtual environment with the wheel installed; there, outside the checkout,
   ``mergekit-ram demo`` must merge through the unmodified ``mergekit-yaml`` (the wheel's
   start-up hook), with the wheel's code.

Dependencies of the fresh environment: by default pip resolves them from the package index as
for a user (``--torch torch==2.13.0`` picks a torch build first, e.g. the CPU one; the package
itself accepts any ``torch>=2.2``). With ``--reuse-environment`` the build runs without
isolation and the fresh environment sees the running environment's packages through a path
file instead (the wheel itself installed with ``--no-deps``, mergekit's console scripts written
beside its interpreter): nothing is downloaded. Needs ``build``, ``twine`` and
``readme-renderer[md]`` in the running interpreter (``pip install 'mergekit-ram[release]'``).
"""

from __future__ import annotations

import argparse
import importlib.metadata
import os
import re
import shutil
import subprocess
import sys
import sysconfig
import tarfile
import tempfile
import time
import zipfile
from collections.abc import Sequence

ROOT = os.path.normpath(os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir))
CONTENTS = os.path.join(ROOT, "tests", "release_contents.txt")
KINDS = ("sdist", "wheel")
#: What ``mergekit-ram demo`` printed in the fresh environment, kept in the work folder.
DEMO_OUTPUT = "demo-output.txt"


class CheckFailed(Exception):
    """One step of the release check failed; the message says which and why."""


def run(command: Sequence[str], cwd: str | None = None, env: dict[str, str] | None = None) -> str:
    """Run a command; its combined output, or CheckFailed with the output's end."""
    completed = subprocess.run(list(command), cwd=cwd, env=env, capture_output=True, text=True)
    output = completed.stdout + completed.stderr
    if completed.returncode != 0:
        raise CheckFailed(f"{' '.join(command)} exited with {completed.returncode}:\n{output[-4000:]}")
    return output


def build(dist: str, isolated: bool) -> tuple[str, str]:
    """The sdist and the wheel built from it, in ``dist``: (sdist path, wheel path)."""
    run([sys.executable, "-m", "build", "--outdir", dist, *([] if isolated else ["--no-isolation"]), ROOT])
    sdists = [name for name in os.listdir(dist) if name.endswith(".tar.gz")]
    wheels = [name for name in os.listdir(dist) if name.endswith(".whl")]
    if len(sdists) != 1 or len(wheels) != 1:
        raise CheckFailed(f"expected one sdist and one wheel in {dist}, found {sorted(os.listdir(dist))}")
    return os.path.join(dist, sdists[0]), os.path.join(dist, wheels[0])


def read_expected(path: str = CONTENTS) -> dict[str, list[str]]:
    """The patterns of ``release_contents.txt`` by distribution kind (``[sdist]``, ``[wheel]``)."""
    expected: dict[str, list[str]] = {kind: [] for kind in KINDS}
    kind = None
    with open(path, encoding="utf-8") as handle:
        for raw in handle:
            line = raw.split("#", 1)[0].strip()
            if not line:
                continue
            if line.startswith("[") and line.endswith("]"):
                kind = line[1:-1]
                if kind not in expected:
                    raise CheckFailed(f"{path}: unknown section {line}")
            elif kind is None:
                raise CheckFailed(f"{path}: pattern {line!r} before any section")
            else:
                expected[kind].append(line)
    return expected


def pattern_regex(pattern: str) -> re.Pattern[str]:
    """A path pattern as a regex: ``*`` matches within one path segment, nothing else is special."""
    parts = re.split(r"(\*)", pattern)
    return re.compile("".join("[^/]*" if part == "*" else re.escape(part) for part in parts) + r"\Z")


def compare(files: Sequence[str], patterns: Sequence[str]) -> list[str]:
    """Problems: each file that no pattern admits, each pattern that matches no file."""
    regexes = {pattern: pattern_regex(pattern) for pattern in patterns}
    problems = [f"unexpected file {file}" for file in files if not any(r.match(file) for r in regexes.values())]
    problems += [f"nothing matches {pattern}" for pattern, r in regexes.items() if not any(r.match(f) for f in files)]
    return problems


def sdist_files(path: str) -> list[str]:
    """Paths of the sdist's files, without its top folder (``mergekit_ram-VERSION/``)."""
    with tarfile.open(path) as archive:
        names = [member.name for member in archive.getmembers() if member.isfile()]
    return sorted(name.split("/", 1)[1] for name in names)


def wheel_files(path: str) -> list[str]:
    with zipfile.ZipFile(path) as archive:
        return sorted(name for name in archive.namelist() if not name.endswith("/"))


def check_contents(sdist: str, wheel: str, expected: dict[str, list[str]]) -> list[str]:
    problems = [f"sdist: {problem}" for problem in compare(sdist_files(sdist), expected["sdist"])]
    return problems + [f"wheel: {problem}" for problem in compare(wheel_files(wheel), expected["wheel"])]


def relative_links(wheel: str) -> list[str]:
    """Problems: links of the wheel's long description, rendered as on PyPI, that are relative."""
    import email.parser

    import readme_renderer.markdown

    with zipfile.ZipFile(wheel) as archive:
        (name,) = [name for name in archive.namelist() if name.endswith(".dist-info/METADATA")]
        description = email.parser.Parser().parsestr(archive.read(name).decode("utf-8")).get_payload()
    html = readme_renderer.markdown.render(description)
    if html is None:
        return ["the README could not be rendered as Markdown: pip install 'readme-renderer[md]'"]
    links = re.findall(r'(?:href|src)="([^"]*)"', html)
    return [f"README link {link}: relative, dead on the package index" for link in links if not _absolute(link)]


def _absolute(link: str) -> bool:
    """A link that works on the package index: another site, or an anchor of the page itself."""
    return bool(re.match(r"[a-z]+:", link)) or link.startswith("#")


def venv_python(venv: str) -> str:
    return os.path.join(venv, "bin", "python")


def console_script_text(python: str, entry_point: importlib.metadata.EntryPoint) -> str:
    """What pip writes for a console script: import the entry point, exit with its result."""
    function = entry_point.attr.split(".")[0]
    return f"#!{python}\nimport sys\nfrom {entry_point.module} import {function}\nsys.exit({entry_point.attr}())\n"


def reuse_running_environment(venv: str) -> None:
    """Let ``venv`` import the running environment's packages and run mergekit's scripts."""
    python = venv_python(venv)
    site = run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"]).strip()
    paths = dict.fromkeys(sysconfig.get_paths()[key] for key in ("purelib", "platlib"))
    with open(os.path.join(site, "zz_release_check_dependencies.pth"), "w", encoding="utf-8") as handle:
        handle.write("".join(f"{path}\n" for path in paths))
    for entry_point in importlib.metadata.distribution("mergekit").entry_points:
        if entry_point.group == "console_scripts":
            script = os.path.join(venv, "bin", entry_point.name)
            with open(script, "w", encoding="utf-8") as handle:
                handle.write(console_script_text(python, entry_point))
            os.chmod(script, 0o755)


def install(venv: str, wheel: str, torch: str | None, reuse: bool) -> None:
    """A fresh virtual environment at ``venv`` with the wheel installed."""
    run([sys.executable, "-m", "venv", "--without-pip", venv])
    pip = [sys.executable, "-m", "pip", "--python", venv_python(venv)]
    if reuse:
        run([*pip, "install", "--quiet", "--no-deps", "--no-index", wheel])
        reuse_running_environment(venv)
    else:
        run([*pip, "install", "--quiet", *([torch] if torch else []), wheel])
        run([*pip, "check"])


def clean_environment(venv: str, work: str) -> dict[str, str]:
    """The fresh environment's variables: its bin first on PATH, nothing of the checkout."""
    environment = {
        key: value
        for key, value in os.environ.items()
        if key not in ("PYTHONPATH", "VIRTUAL_ENV", "PYTHONHOME") and not key.startswith("MERGEKIT_RAM")
    }
    environment["PATH"] = os.pathsep.join([os.path.join(venv, "bin"), "/usr/local/bin", "/usr/bin", "/bin"])
    environment["HF_HUB_OFFLINE"] = "1"
    environment["MERGEKIT_RAM_CACHE_DIR"] = os.path.join(work, "cache")
    return environment


def try_the_wheel(venv: str, work: str) -> list[str]:
    """Problems met running the demo from the fresh environment, outside the checkout."""
    environment = clean_environment(venv, work)
    home = os.path.join(work, "user")
    os.makedirs(home, exist_ok=True)
    where = run(
        [venv_python(venv), "-c", "import mergekit_ram; print(mergekit_ram.__file__)"], cwd=home, env=environment
    ).strip()
    problems = []
    if not os.path.realpath(where).startswith(os.path.realpath(venv) + os.sep):
        problems.append(f"the fresh environment imports mergekit_ram from {where}, not from the wheel")
    output = run([os.path.join(venv, "bin", "mergekit-ram"), "demo", "demo"], cwd=home, env=environment)
    with open(os.path.join(work, DEMO_OUTPUT), "w", encoding="utf-8") as handle:
        handle.write(output)
    statistics = os.path.join(home, "demo", "merged", "ram_statistics.json")
    if not os.path.exists(statistics):
        problems.append(f"the demo wrote no {statistics}:\n{output[-2000:]}")
    return problems


def check(work: str, torch: str | None, reuse: bool, say=print) -> list[str]:
    """Every step in turn; the problems found (empty: the release check passed)."""
    started = time.perf_counter()

    def step(text: str) -> None:
        say(f"[{time.perf_counter() - started:5.1f} s] {text}")

    step("building the sdist, then the wheel from it" + (" (no isolation)" if reuse else ""))
    sdist, wheel = build(os.path.join(work, "dist"), isolated=not reuse)
    step(f"twine check --strict {os.path.basename(sdist)} {os.path.basename(wheel)}")
    run([sys.executable, "-m", "twine", "check", "--strict", sdist, wheel])
    step("rendering the README as the package index does")
    problems = relative_links(wheel)
    step(f"comparing the contents with {os.path.relpath(CONTENTS, ROOT)}")
    problems += check_contents(sdist, wheel, read_expected())
    venv = os.path.join(work, "venv")
    step(f"installing the wheel into a fresh environment {venv}" + (" (reusing this one's packages)" if reuse else ""))
    try:
        install(venv, wheel, torch, reuse)
        step("running mergekit-ram demo there")
        problems += try_the_wheel(venv, work)
    except CheckFailed as error:  # reported with the problems found so far
        problems.append(str(error))
    step("release check " + ("passed" if not problems else f"failed: {len(problems)} problem(s)"))
    return problems


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--work", help="folder for the distributions, the environment and the demo (kept)")
    parser.add_argument("--torch", help="torch requirement installed with the wheel, e.g. torch==2.13.0")
    parser.add_argument(
        "--reuse-environment", action="store_true", help="offline: build without isolation, reuse this environment"
    )
    arguments = parser.parse_args(argv)
    work = os.path.abspath(arguments.work) if arguments.work else tempfile.mkdtemp(prefix="mergekit-ram-release-")
    os.makedirs(work, exist_ok=True)
    try:
        problems = check(work, arguments.torch, arguments.reuse_environment)
    except CheckFailed as error:
        problems = [str(error)]
    finally:
        if not arguments.work:
            shutil.rmtree(work, ignore_errors=True)
    for problem in problems:
        print(f"problem: {problem}", file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
