"""`fsdp-legacy migrate`: FSDP1 programs rewritten onto FSDP2 (fsdp_legacy.migrate), as a diff, in place, or checked."""

from __future__ import annotations

import argparse
import difflib
import os
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from .common import EXIT_FAILED, EXIT_OK, UsageError

HELP = "rewrite FSDP1 programs onto FSDP2 (fully_shard) and torch.distributed.checkpoint.state_dict"

DESCRIPTION = """Rewrite Python programs written against torch's FSDP1 API (or fsdp_legacy's, the same names) onto
FSDP2. `FSDP(model, ...)` becomes `fully_shard` calls over the units its auto-wrap policy picks (a meta-device model
is materialized unit by unit as FSDP1 does), and so does each `wrap(m)` inside `enable_wrap`; the keywords become
FSDP2's (MixedPrecisionPolicy, CPUOffloadPolicy, a 2-D mesh for HYBRID_SHARD, also over a pair of process groups);
`clip_grad_norm_` and `no_sync()` become FSDP2's equivalents, state_dict_type blocks and set_state_dict_type
torch.distributed.checkpoint.state_dict's helpers, as do the optimizer-state calls (the legacy
full_/sharded_/shard_full_/scatter_full_optim_state_dict included; rekey_optim_state_dict a helper), a
summon_full_params block that only reads fsdp_legacy.migrate.runtime.full_params; activation checkpointing applied
after wrapping moves before it. Comments and formatting are kept (LibCST). What cannot be mapped faithfully is left
as it was and reported as `file:line: what: why; fix: ...` on stderr. The files given are one program: a subclass of
FSDP1's class keeps every FSDP1 file of it as it is, a MixedPrecision policy of one file becomes FSDP2's only with
the constructions of the others that take it. By default the changes are printed as a
unified diff; nothing is written."""

EXAMPLES = """examples:
  fsdp-legacy migrate train.py                 # the diff, and what is left to a person
  fsdp-legacy migrate src/ --write             # rewrite every .py file under src/ in place
  fsdp-legacy migrate src/ --check             # CI: exit 1 while anything is left to migrate

exit codes:
  0  fully migrated: nothing is left to a person (with --check: and nothing would change)
  1  something is left to a person (reported on stderr), a file cannot be parsed, or with --check a file would change
  2  bad arguments, a path that does not exist, or the `migrate` extra (LibCST) is not installed"""


def add_parser(commands: argparse._SubParsersAction) -> None:
    p = commands.add_parser(
        "migrate",
        help=HELP,
        description=DESCRIPTION,
        epilog=EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("paths", nargs="+", metavar="PATH", help="Python files, or directories searched for *.py files")
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--write", action="store_true", help="rewrite the files in place instead of printing a diff")
    mode.add_argument(
        "--check", action="store_true", help="print nothing but the findings; exit 1 if any file would change"
    )
    p.set_defaults(run=run)


def _rewriter() -> Callable[[dict[str, str]], Any]:
    try:
        import libcst  # noqa: F401

        from ..migrate.program import migrate_program
    except ImportError as error:
        raise UsageError(
            f"fsdp-legacy migrate needs LibCST ({error}): pip install 'fsdp_legacy[migrate]' (or pip install libcst)"
        ) from error
    return migrate_program


def _files(paths: list[str]) -> Iterator[Path]:
    for name in paths:
        path = Path(name)
        if path.is_file():
            yield path
        elif path.is_dir():
            for root, dirs, files in os.walk(path):
                dirs[:] = sorted(d for d in dirs if not d.startswith(".") and d != "__pycache__")
                yield from (Path(root) / f for f in sorted(files) if f.endswith(".py"))
        else:
            raise UsageError(f"{name} does not exist: pass Python files or directories holding them.")


def run(args: argparse.Namespace) -> int:
    migrate_program = _rewriter()
    files = list(_files(args.paths))  # every path checked before anything is written
    # one program: what a file defines and another uses is decided the same way in both (migrate/program.py)
    sources = {str(path): path.read_text(encoding="utf-8") for path in files}
    program = migrate_program(sources)
    incomplete = changed = False
    for path in files:
        name, source = str(path), sources[str(path)]
        error = program.unparsable.get(name)
        if error is not None:
            print(f"{path}:{getattr(error, 'raw_line', 0)}: cannot parse: {error.message}", file=sys.stderr)
            incomplete = True
            continue
        result = program.results[name]
        for finding in result.findings:
            print(finding.format(name), file=sys.stderr)
        incomplete |= not result.complete
        changed |= result.changed
        if not result.changed:
            continue
        if args.write:
            path.write_text(result.migrated, encoding="utf-8")
            print(f"rewrote {path}", file=sys.stderr)
        elif not args.check:
            sys.stdout.writelines(
                difflib.unified_diff(
                    source.splitlines(keepends=True),
                    result.migrated.splitlines(keepends=True),
                    fromfile=f"a/{path}",
                    tofile=f"b/{path}",
                )
            )
    return EXIT_FAILED if incomplete or (args.check and changed) else EXIT_OK
