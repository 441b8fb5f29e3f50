"""A wrapped model handed to an FSDP helper outside the files migrated: TransformerEngine's
`prepare_te_modules_for_fsdp(model)` asserts `isinstance(model, FullyShardedDataParallel)`; distributed_shampoo's
`compile_fsdp_parameter_metadata(model)` reads FSDP1's flat parameters. Such a helper is written for FSDP1's model,
which the rewrite would turn into FSDP2's, so the call is reported and its file left as it is, as a whole
(rewriter.py). A helper is a function imported from outside torch, fsdp_legacy and the files migrated together (a
file of the program not given to the tool counts: what it does is not in the text) whose name or module path speaks
of FSDP. The plain module handed to one ahead of its wrapping (SLAM-LLM's `fsdp_auto_wrap_policy(model, ...)`) is
not the wrapped model."""

from __future__ import annotations

from collections.abc import Collection

import libcst as cst
from libcst.metadata import QualifiedName, QualifiedNameSource

from .report import Finding
from .subclasses import REFUSED

_OURS = ("torch.", "fsdp_legacy.")


def helper_of_another_library(
    call: cst.Call, qualified: Collection[QualifiedName], program_names: Collection[str]
) -> str | None:
    """The qualified name of the function `call` calls where it is another library's FSDP helper."""
    root: cst.BaseExpression = call.func
    while isinstance(root, cst.Attribute):
        root = root.value
    if isinstance(root, cst.Name) and root.value in program_names:
        return None  # (a function of the program's own files: followed there, handed_models.py)
    for name in qualified:
        dotted = name.name
        if name.source is not QualifiedNameSource.IMPORT or dotted.startswith(_OURS):
            continue
        if "fsdp" in dotted.lower():
            return dotted
    return None


WHY = (
    "`{helper}` is a function outside the files migrated (another library's, or a file of the program not given to "
    "the tool) whose name speaks of FSDP: written for FSDP1's FullyShardedDataParallel (its type, its flat parameters "
    "or its state-dict types), it would be handed an FSDP2 model after the rewrite"
)
FIX = (
    "migrate the file defining it together with this one (then it is followed); for another library's helper, use "
    "its FSDP2 form (or drop it where FSDP2 needs none), then migrate again"
)


def kept_handovers(lines: list[int]) -> Finding:
    """For a file handing its wrapped model to another library's FSDP helper: it stays FSDP1's as a whole."""
    many, where = len(lines) > 1, ", ".join(map(str, lines))
    why = (
        f"the call{'s' if many else ''} at line{'s' if many else ''} {where} hand{'' if many else 's'} "
        "a wrapped model to an FSDP helper outside the files migrated (the findings there say which), and rewriting "
        "the rest of the file for FSDP2 would hand it an FSDP2 model; the file is left as it is, as a whole"
    )
    return Finding(lines[0], "wrapped model handed to an FSDP helper outside the program", why, FIX, REFUSED)
