"""The `fsdp-legacy` command, installed with the package (also `python -m fsdp_legacy`):

    fsdp-legacy inspect PATH [--json]                       what a checkpoint holds, its seals checked first
    fsdp-legacy convert SOURCE DESTINATION --to FORMAT      offline checkpoint conversion (fsdp_legacy.convert)
    fsdp-legacy mem-report --model gpt-7b --world-sizes 8   predicted peak memory (fsdp_legacy.memory)

One module per command (inspect_checkpoint.py, convert.py, mem_report.py), main.py the parser and exit codes,
common.py what they share. `main(argv)` returns the exit code: 0 done, 1 a checkpoint that cannot be read or
converted, 2 bad arguments, a missing path or something that is not a checkpoint.
"""

from .main import build_parser, main

__all__ = ["build_parser", "main"]
