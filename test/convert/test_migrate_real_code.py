"""`fsdp-legacy migrate` over real code nobody here wrote: the installed torch (and transformers and accelerate where
they are installed). The tool must never fail on valid Python, and must leave byte for byte every file that does not
mention FSDP at all (an empty `__init__.py` became `pass`; an argument's own comma once made its rewritten call
unparsable). Files without FSDP take a shortcut (nothing there can be FSDP1's), so some of them are also run through
every pass with an FSDP1 import put in front, which must change nothing either."""

import importlib.util
import random
from pathlib import Path

import pytest

from fsdp_legacy.migrate.rewriter import migrate_source

_PACKAGES = ("torch", "transformers", "accelerate")
_WITH_FSDP = 40  # files that mention FSDP (torch alone has about 60 under the size limit): every pass, 1-3 s each
_WITHOUT_FSDP = 200  # files that do not: the shortcut, milliseconds each
_WITH_AN_IMPORT_PUT_IN = 20  # of those, run through every pass with an unused FSDP1 import in front
_IMPORT = "from torch.distributed.fsdp import FullyShardedDataParallel as FSDP\n"
_SEED = 20261201


def _sample() -> tuple[list[Path], list[Path]]:
    """A seeded sample of the files that mention FSDP and of those that do not."""
    roots = []
    for name in _PACKAGES:
        spec = importlib.util.find_spec(name)
        if spec is not None and spec.origin is not None:
            roots.append(Path(spec.origin).parent)
    files = sorted(p for root in roots for p in root.rglob("*.py") if p.stat().st_size < 60_000)
    random.Random(_SEED).shuffle(files)
    with_fsdp = [p for p in files if "fsdp" in p.read_text(encoding="utf-8").lower()]
    without = [p for p in files if p not in set(with_fsdp)]
    return with_fsdp[:_WITH_FSDP], without[:_WITHOUT_FSDP]


@pytest.mark.heavy  # a hundred files through LibCST's passes: CI runs it after the README's tests (pytest -m heavy)
def test_migrate_never_fails_and_leaves_files_without_fsdp_alone() -> None:
    import libcst

    with_fsdp, without = _sample()
    assert with_fsdp and without, "the sample found no files"
    inputs = [(p, p.read_text(encoding="utf-8")) for p in (*with_fsdp, *without)]
    inputs += [(p, _IMPORT + p.read_text(encoding="utf-8")) for p in without[:_WITH_AN_IMPORT_PUT_IN]]
    crashed, changed = [], []
    for path, source in inputs:
        try:
            result = migrate_source(source)
        except libcst.ParserSyntaxError:
            continue  # syntax newer than LibCST's parser: the command reports "cannot parse", a clean error
        except Exception as error:  # every failure is collected and named
            crashed.append(f"{path}: {type(error).__name__}: {error}"[:300])
            continue
        untouched = "fsdp" not in source.lower() or source.startswith(_IMPORT)  # (an unused import changes nothing)
        if untouched and result.migrated != source:
            changed.append(f"{path}{' (the import put in)' if source.startswith(_IMPORT) else ''}")
        elif result.changed:
            compile(result.migrated, str(path), "exec")  # what it wrote is Python
    assert not crashed, "the tool failed on valid Python:\n" + "\n".join(crashed)
    assert not changed, "files without FSDP code were changed:\n" + "\n".join(changed)


def test_an_argument_followed_by_a_keyword_keeps_the_rewritten_call_valid() -> None:
    source = (
        "from torch.distributed.fsdp import FullyShardedDataParallel as FSDP\n\n\n"
        "def main(net):\n    model = FSDP(net)\n    model.clip_grad_norm_(1.0, norm_type=2.0)\n"
    )
    migrated = migrate_source(source).migrated
    compile(migrated, "train.py", "exec")
    assert "torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0, norm_type=2.0)" in migrated


@pytest.mark.parametrize("source", ["", "\n", "# only a comment\n", "x = 1   \n\n\n", "import os\r\nx = 1  \r\n"])
def test_a_file_without_fsdp_is_left_byte_for_byte(source: str) -> None:
    assert migrate_source(source).migrated == source
