"""Moved into the package: `fsdp-legacy mem-report ...` (or `python -m fsdp_legacy mem-report`), installed with it
(fsdp_legacy/cli/mem_report.py). This runs the same from a checkout, for scripts that call it here.

    python tools/mem_report.py --model gpt-7b --world-sizes 8,64 --mixed-precision bf16   # = fsdp-legacy mem-report
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # fsdp_legacy from the checkout
from fsdp_legacy.cli import main

if __name__ == "__main__":
    sys.exit(main(["mem-report", *sys.argv[1:]], prog="fsdp-legacy"))
