"""Moved into the package: `fsdp-legacy convert SOURCE DESTINATION --to FORMAT` (or `python -m fsdp_legacy convert`),
installed with it (fsdp_legacy/cli/convert.py). This runs the same from a checkout, for scripts that call it here.

    python tools/convert_checkpoint.py ckpt/local ckpt/fsdp2 --to dcp      # = fsdp-legacy convert ckpt/local ...
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # fsdp_legacy from the checkout
from fsdp_legacy.cli import main

if __name__ == "__main__":
    sys.exit(main(["convert", *sys.argv[1:]], prog="fsdp-legacy"))
