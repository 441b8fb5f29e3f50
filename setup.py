"""The metadata lives in setup.cfg. This file adds one thing setup.cfg cannot: fsdp_legacy_autoinstall.pth at the
top of the installed files (site-packages), which honours FSDP_LEGACY=1 at interpreter start (docs/frameworks.md),
for regular and editable installs alike."""

import shutil
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

PTH = "fsdp_legacy_autoinstall.pth"
SOURCE = Path(__file__).resolve().parent / PTH


class BuildPyWithPth(build_py):
    """Regular installs: the .pth goes into the wheel's top level beside the packages."""

    def run(self) -> None:
        super().run()
        self.copy_file(str(SOURCE), str(Path(self.build_lib) / PTH))

    def get_outputs(self, include_bytecode: bool = True) -> list[str]:
        return [*super().get_outputs(include_bytecode), str(Path(self.build_lib) / PTH)]


commands: dict = {"build_py": BuildPyWithPth}
try:
    from setuptools.command.editable_wheel import editable_wheel

    class EditableWheelWithPth(editable_wheel):
        """Editable installs (pip install -e): setuptools builds the editable wheel from a directory of its own, into
        which this puts the .pth (the hook it imports is found through the editable install's own finder)."""

        def _install_namespaces(self, installation_dir, pth_prefix):
            super()._install_namespaces(installation_dir, pth_prefix)
            shutil.copy(SOURCE, Path(installation_dir) / PTH)

    commands["editable_wheel"] = EditableWheelWithPth
except ImportError:  # setuptools < 64 has no PEP 660 editable installs
    pass

setup(cmdclass=commands)
