"""The distributions as a packager and a user get them, and the editable install.

One run of the release check (tests/release_check.py --reuse-environment: build, twine, the
contents list, a fresh environment with the wheel, the demo there; about 30 s) serves every
test here that reads a distribution.
"""

from __future__ import annotations

import email.parser
import json
import os
import re
import subprocess
import sys
import tarfile
import zipfile
from dataclasses import dataclass
from email.message import Message
from pathlib import Path

import pytest

try:
    import tomllib
except ImportError:  # Python 3.10
    import tomli as tomllib

from mergekit_ram.integration.internals import SUPPORTED_MERGEKIT, TESTED_MERGEKIT
from tests.release_check import DEMO_OUTPUT, compare, read_expected, sdist_files, wheel_files
from tests.test_docs import LINKED_PAGES, REPOSITORY, link_problems, sdist_leaves_out

ROOT = os.path.normpath(os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir))
LICENCES = {
    "COPYING.LESSER": "GNU LESSER GENERAL PUBLIC LICENSE\n                       Version 3, 29 June 2007",
    "COPYING": "GNU GENERAL PUBLIC LICENSE\n                       Version 3, 29 June 2007",
}


@dataclass(frozen=True)
class Release:
    work: str
    completed: subprocess.CompletedProcess

    def dist(self, suffix: str) -> str:
        folder = os.path.join(self.work, "dist")
        (name,) = [name for name in os.listdir(folder) if name.endswith(suffix)]
        return os.path.join(folder, name)

    @property
    def sdist(self) -> str:
        return self.dist(".tar.gz")

    @property
    def wheel(self) -> str:
        return self.dist(".whl")


@pytest.fixture(scope="module")
def release(tmp_path_factory: pytest.TempPathFactory) -> Release:
    work = str(tmp_path_factory.mktemp("release"))
    script = os.path.join(ROOT, "tests", "release_check.py")
    completed = subprocess.run(
        [sys.executable, script, "--reuse-environment", "--work", work],
        env={**os.environ, "HF_HUB_OFFLINE": "1"},
        capture_output=True,
        text=True,
    )
    return Release(work, completed)


def sdist_member(path: str, name: str) -> bytes:
    with tarfile.open(path) as archive:
        (member,) = [m for m in archive.getmembers() if m.name.split("/", 1)[-1] == name]
        handle = archive.extractfile(member)
        assert handle is not None
        return handle.read()


def wheel_member(path: str, suffix: str) -> bytes:
    with zipfile.ZipFile(path) as archive:
        (name,) = [name for name in archive.namelist() if name.endswith(suffix)]
        return archive.read(name)


def metadata(text: bytes) -> Message:
    return email.parser.Parser().parsestr(text.decode("utf-8"))


def release_check_passes(release: Release) -> None:
    assert release.completed.returncode == 0, release.completed.stdout + release.completed.stderr
    steps = release.completed.stdout
    steps_named = ("twine check --strict", "rendering the README", "release_contents.txt", "fresh environment")
    for step in (*steps_named, "mergekit-ram demo"):
        assert step in steps
    assert steps.rstrip().endswith("release check passed")
    with open(os.path.join(release.work, "user", "demo", "merged", "ram_statistics.json"), encoding="utf-8") as f:
        statistics = json.load(f)
    assert statistics["method"] == "ram_plus" and len(statistics["models"]) == 3


def demo_reports_the_seeded_agents(release: Release) -> None:
    """What ``mergekit-ram demo`` printed and wrote, run from the wheel in the fresh environment."""
    with open(os.path.join(release.work, DEMO_OUTPUT), encoding="utf-8") as handle:
        lines = handle.read().splitlines()
    capped = [line for line in lines if line.endswith(" (cap)") and not line.startswith("rho =")]
    assert capped == [next(line for line in lines if "coding-agent" in line)]
    cells = [line.removesuffix(" (cap)").split() for line in lines]
    rows = {row[0]: row[1:] for row in cells if row and row[0].endswith("-agent")}
    # density, changed, shared, unique, rho, lambda of the seeded demo (seed 0). The paper's agents:
    # density 3.2% / 46.2% / 54.3%, rho about 14.9 / 1.45 / 1.11. The coding agent's rho is above
    # alpha = 2: its lambda is clipped to 1 + 0.1 * 2 (marked "(cap)").
    assert rows == {
        "coding-agent": ["3.20%", "27,312", "25,599", "1,713", "14.9440", "1.2000"],
        "tool-agent": ["46.18%", "394,482", "232,963", "161,519", "1.4423", "1.1442"],
        "memory-agent": ["54.05%", "461,651", "241,449", "220,202", "1.0965", "1.1096"],
    }
    with open(os.path.join(release.work, "user", "demo", "merged", "ram_statistics.json"), encoding="utf-8") as f:
        statistics = json.load(f)
    order = ("coding-agent", "tool-agent", "memory-agent")
    assert [round(m["lambda"], 4) for m in statistics["models"]] == [float(rows[name][-1]) for name in order]


def both_distributions_hold_the_licence_texts(release: Release) -> None:
    for name, heading in LICENCES.items():
        with open(os.path.join(ROOT, name), "rb") as handle:
            text = handle.read()
        assert text.decode("utf-8").lstrip().startswith(heading)
        assert sdist_member(release.sdist, name) == text
        assert wheel_member(release.wheel, f".dist-info/licenses/{name}") == text


def metadata_names_licence_project_urls_and_authors(release: Release) -> None:
    for found in (
        metadata(wheel_member(release.wheel, ".dist-info/METADATA")),
        metadata(sdist_member(release.sdist, "PKG-INFO")),
    ):
        assert found["License-Expression"] == "LGPL-3.0-only"
        assert found.get_all("License-File") == ["COPYING", "COPYING.LESSER"]
        assert found["Author"] == "mergekit-ram developers"
        urls = dict(entry.split(", ", 1) for entry in found.get_all("Project-URL"))
        assert set(urls) == {"Homepage", "Repository", "Documentation", "Issues"}
        assert all(url.startswith(REPOSITORY) for url in urls.values())
        classifiers = found.get_all("Classifier")
        assert "Programming Language :: Python :: 3" in classifiers
        assert not [c for c in classifiers if c.startswith("License ::")]  # PEP 639: the expression only
        torch = [r for r in found.get_all("Requires-Dist") if r.startswith("torch")]
        assert torch == ["torch>=2.2"]  # the CPU build is the installer's choice, never pinned here


def contents_lists_are_exact(release: Release) -> None:
    """Nothing unexpected and nothing missing; results and images stay out of the sdist."""
    expected = read_expected()
    sdist, wheel = sdist_files(release.sdist), wheel_files(release.wheel)
    assert compare(sdist, expected["sdist"]) == [] and compare(wheel, expected["wheel"]) == []
    left_out = sdist_leaves_out()
    assert set(left_out) == {"benchmarks/results", "benchmarks/agents/results", "docs/img"}
    assert not [f for f in sdist if f.startswith(left_out) or f.endswith((".png", ".json"))]
    for needed in ("Makefile", "hatch_build.py", "tests/conftest.py", "docs/contributing.md", "recipes/README.md"):
        assert needed in sdist
    assert "mergekit_ram/py.typed" in wheel and "mergekit_ram_autoload.pth" in wheel
    assert not [f for f in wheel if f.startswith(("tests/", "benchmarks/", "docs/"))]


@pytest.mark.process
def test_the_release(release: Release, tmp_path: Path) -> None:
    """The release check (``tests/release_check.py``: the distributions built, checked, installed into a fresh
    environment where the demo runs), then what the distributions hold."""
    release_check_passes(release)
    demo_reports_the_seeded_agents(release)
    both_distributions_hold_the_licence_texts(release)
    metadata_names_licence_project_urls_and_authors(release)
    contents_lists_are_exact(release)
    links_resolve_in_the_unpacked_sdist(release, tmp_path)


def test_contents_check_refuses_unexpected_and_missing_files() -> None:
    files = ["mergekit_ram/a.py", "mergekit_ram/sub/b.py", "docs/img/plot.png"]
    assert compare(files, ["mergekit_ram/*.py", "COPYING"]) == [
        "unexpected file mergekit_ram/sub/b.py",
        "unexpected file docs/img/plot.png",
        "nothing matches COPYING",
    ]


def links_resolve_in_the_unpacked_sdist(release: Release, tmp_path: Path) -> None:
    """The sdist's pages link to what it holds; only links into what it leaves out are excused."""
    with tarfile.open(release.sdist) as archive:
        archive.extractall(tmp_path, filter="data")
    (root,) = [str(path) for path in tmp_path.iterdir()]
    assert not os.path.exists(os.path.join(root, "docs", "img"))  # docs/quality.md shows an image from there
    for page in LINKED_PAGES:
        assert link_problems(page, root) == [], page


def _editable_from_this_checkout() -> bool:
    from importlib.metadata import distribution

    text = distribution("mergekit-ram").read_text("direct_url.json")
    found = json.loads(text) if text else {}
    return found.get("dir_info", {}).get("editable", False) and found.get("url") == f"file://{ROOT}"


@pytest.mark.process
def test_editable_install_exposes_only_mergekit_ram(tmp_path) -> None:
    """`pip install -e .` maps the package, not the repository root: no `tests` or `benchmarks`."""
    if not _editable_from_this_checkout():
        pytest.skip("mergekit-ram is not installed editable from this checkout")
    code = (
        "import importlib.util as u\n"
        "print(u.find_spec('tests'), u.find_spec('benchmarks'), u.find_spec('mergekit_ram').origin)"
    )
    environment = {key: value for key, value in os.environ.items() if key != "PYTHONPATH"}
    completed = subprocess.run(
        [sys.executable, "-c", code], cwd=tmp_path, env=environment, capture_output=True, text=True, check=True
    )
    assert completed.stdout.split() == ["None", "None", os.path.join(ROOT, "mergekit_ram", "__init__.py")]


def test_the_mergekit_range_is_one_everywhere() -> None:
    """pyproject.toml's mergekit range is the one the plugin's messages name, and the Makefile installs its
    lower bound (the oldest release supported, the first tested) for `make test`."""
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as handle:
        dependencies = tomllib.load(handle)["project"]["dependencies"]
    assert [d for d in dependencies if d.startswith("mergekit")] == [f"mergekit{SUPPORTED_MERGEKIT}"]
    with open(os.path.join(ROOT, "Makefile"), encoding="utf-8") as handle:
        (oldest,) = re.findall(r"^MERGEKIT_OLDEST \?= (\S+)$", handle.read(), flags=re.MULTILINE)
    assert SUPPORTED_MERGEKIT.split(",")[0] == f">={oldest}" and TESTED_MERGEKIT[0] == oldest
