"""The `fsdp-legacy` command (also `python -m fsdp_legacy`): its parser, and errors turned into one line and an exit
code."""

from __future__ import annotations

import argparse
import os
import sys

from ..convert import CheckpointError
from . import convert, inspect_checkpoint, mem_report, migrate
from .common import EXIT_CODES, EXIT_FAILED, EXIT_USAGE, UsageError, error_line

DESCRIPTION = """fsdp_legacy's commands: checkpoints converted and inspected offline (CPU, one process, no process
group, no model code), and memory predicted before a run. `fsdp-legacy COMMAND --help` says more about each."""

EXAMPLES = f"""examples:
  fsdp-legacy inspect ckpt/local                              # format, world size, parameters, dtypes, size
  fsdp-legacy convert ckpt/local ckpt/fsdp2 --to dcp          # an FSDP1 LOCAL checkpoint -> FSDP2's layout
  fsdp-legacy convert ckpt/fsdp2 hf/ --to safetensors --dtype bfloat16
  fsdp-legacy mem-report --model gpt-7b --world-sizes 8,64 --mixed-precision bf16
  fsdp-legacy migrate train.py --write                        # an FSDP1 program rewritten onto FSDP2
  python -m fsdp_legacy inspect ckpt/model.pt --json          # the same commands without the script on PATH

{EXIT_CODES}"""


# A destination whose directory does not exist, or a file where a directory is to be written (the converter's
# errors for them are these too): bad paths, exit code 2. Any other error of a checkpoint or of the file system
# (a damaged checkpoint, a full disk) is 1.
_PATH_ERRORS = (FileNotFoundError, FileExistsError, NotADirectoryError, IsADirectoryError)


def build_parser(prog: str | None = None) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=prog or _prog(),
        description=DESCRIPTION,
        epilog=EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    commands = parser.add_subparsers(title="commands", dest="command", metavar="COMMAND")
    for command in (inspect_checkpoint, convert, mem_report, migrate):
        command.add_parser(commands)
    return parser


def _prog() -> str:
    name = os.path.basename(sys.argv[0]) if sys.argv and sys.argv[0] else ""
    return "python -m fsdp_legacy" if name in ("__main__.py", "-c", "") else name


def main(argv: list[str] | None = None, prog: str | None = None) -> int:
    """Run the command `argv` (default: the process's arguments); returns the exit code."""
    parser = build_parser(prog)
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help(sys.stderr)
        return EXIT_USAGE
    where = f"{parser.prog} {args.command}"
    try:
        return int(args.run(args))
    except UsageError as error:
        print(error_line(where, str(error)), file=sys.stderr)
        return EXIT_USAGE
    except BrokenPipeError:  # `... | head`: the reader is gone; quietly, without a second error at exit
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return EXIT_FAILED
    except (CheckpointError, OSError) as error:
        print(error_line(where, str(error)), file=sys.stderr)
        return EXIT_USAGE if isinstance(error, _PATH_ERRORS) else EXIT_FAILED
    except KeyboardInterrupt:
        print(f"{where}: interrupted", file=sys.stderr)
        return 130
    except Exception as error:  # a checkpoint no check foresaw: still one line, never a traceback
        message = f"unexpected {type(error).__name__} ({error}): a case fsdp_legacy's checks missed, please report it"
        print(error_line(where, message), file=sys.stderr)
        return EXIT_FAILED
