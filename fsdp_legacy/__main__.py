"""`python -m fsdp_legacy COMMAND ...`: the `fsdp-legacy` command (fsdp_legacy.cli) without the script on PATH."""

import sys

from .cli import main

if __name__ == "__main__":
    sys.exit(main(prog="python -m fsdp_legacy"))
