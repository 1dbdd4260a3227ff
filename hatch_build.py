"""Build hook: ship ``mergekit_ram_autoload.pth`` at the top of site-packages.

The file's one line imports ``mergekit_ram._autoload`` at interpreter start, which lets
the unmodified ``mergekit-yaml`` find the methods. Editable installs get it too; their
own path file, which maps the package (``dev-mode-exact``), sorts first
(``_editable_impl_mergekit_ram.pth``), so the package is importable by then.
"""

import os
import tempfile

from hatchling.builders.hooks.plugin.interface import BuildHookInterface

PTH_NAME = "mergekit_ram_autoload.pth"
PTH_LINE = "import mergekit_ram._autoload\n"


class AutoloadPthHook(BuildHookInterface):
    PLUGIN_NAME = "custom"

    def initialize(self, version: str, build_data: dict) -> None:
        directory = tempfile.mkdtemp(prefix="mergekit-ram-build-")
        path = os.path.join(directory, PTH_NAME)
        with open(path, "w", encoding="utf-8") as handle:
            handle.write(PTH_LINE)
        key = "force_include_editable" if version == "editable" else "force_include"
        build_data.setdefault(key, {})[path] = PTH_NAME
