"""Where things are, for the tests in every folder of test/: the repository, tools/, test/ and its folders.

The test files live in folders that mirror the package (runtime/, state/, convert/, memory/, parallel/, frameworks/,
torch_internals/, cuda/); the shared modules (harness, fsdp_utils, models, ...) stay in test/ itself. Every folder is
put on sys.path, by conftest.py in the pytest process and by harness.py in the rank processes, so that a test imports
the shared modules and another test file's helpers by module name, and the ranks find the functions they are sent.
"""

from __future__ import annotations

import sys
from pathlib import Path

TEST_DIR = Path(__file__).resolve().parent
REPO = TEST_DIR.parent
TOOLS = REPO / "tools"
TEST_FOLDERS = tuple(
    sorted(folder for folder in TEST_DIR.iterdir() if folder.is_dir() and any(folder.glob("test_*.py")))
)


def put_on_sys_path() -> None:
    """The repository (fsdp_legacy), test/ and its test folders, test/ first."""
    for path in (REPO, *reversed(TEST_FOLDERS), TEST_DIR):
        if str(path) not in sys.path:
            sys.path.insert(0, str(path))
