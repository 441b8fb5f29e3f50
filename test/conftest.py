"""pytest config for fsdp_legacy: puts the repo root, test/ and its test folders on sys.path (repo_paths.py) and
provides the ``ranks`` fixture backed by the session-wide rank pools in harness.py."""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from typing import Any

import pytest

_TEST_DIR = os.path.dirname(os.path.abspath(__file__))
if _TEST_DIR not in sys.path:
    sys.path.insert(0, _TEST_DIR)

import repo_paths  # noqa: E402  (needs the sys.path entry above)

repo_paths.put_on_sys_path()

import harness  # noqa: E402


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    harness.shutdown()  # stop the rank pools cleanly; atexit is only the backstop


@pytest.fixture
def ranks() -> Callable[..., list[Any]]:
    """``ranks(fn, world_size, *args, timeout=120, **kwargs)`` -> results by rank."""
    return harness.run_on_ranks


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Mark the tests of the seams between torch releases (seams.py) with `seams`."""
    import seams

    for item in items:
        if seams.seam_of(item.nodeid) is not None:
            item.add_marker(pytest.mark.seams)
    collected_files = {item.nodeid.split("::")[0].rsplit("/", 1)[-1] for item in items}
    stale = [p for p in seams.unmatched([item.nodeid for item in items]) if p.split("::")[0] in collected_files]
    if stale:
        raise pytest.UsageError(f"test/seams.py: these patterns match no test (renamed?): {stale}")
