"""The FSDP1 names a migrated file still uses (plain values: ShardingStrategy and StateDictType members kept as data,
a MixedPrecision or CPUOffload that fsdp1_options reads at run time, the policies apply_fully_shard evaluates),
imported from fsdp_legacy instead of torch's FSDP1 modules, which are deprecated and going: fsdp_legacy exports the
same names, and its enums equal torch's members of the same name both ways (api.FSDPEnum)."""

from __future__ import annotations

import libcst as cst

from .names import WRAP_POLICIES

# What a migrated file may keep using: values and policies, never the wrapper or manual wrapping.
MOVABLE = WRAP_POLICIES | {
    "ShardingStrategy",
    "StateDictType",
    "BackwardPrefetch",
    "OptimStateKeyType",
    "MixedPrecision",
    "CPUOffload",
}
_TORCH = ("torch.distributed.fsdp", "torch.distributed.fsdp.api", "torch.distributed.fsdp.fully_sharded_data_parallel")
_TORCH_WRAP = "torch.distributed.fsdp.wrap"


def _module_code(node: cst.ImportFrom) -> str:
    return cst.Module([]).code_for_node(node.module) if node.module is not None and not node.relative else ""


class Rehome(cst.CSTTransformer):
    """`from torch.distributed.fsdp import ShardingStrategy, fully_shard` -> `from fsdp_legacy import
    ShardingStrategy` and `from torch.distributed.fsdp import fully_shard` (run on the rewritten tree, whose unused
    imports are gone already)."""

    def leave_SimpleStatementLine(
        self, original: cst.SimpleStatementLine, updated: cst.SimpleStatementLine
    ) -> cst.BaseStatement | cst.FlattenSentinel[cst.BaseStatement]:
        if len(updated.body) != 1 or not isinstance(updated.body[0], cst.ImportFrom):
            return updated
        node = updated.body[0]
        module = _module_code(node)
        if module not in (*_TORCH, _TORCH_WRAP) or isinstance(node.names, cst.ImportStar):
            return updated
        moved = [a for a in node.names if isinstance(a.name, cst.Name) and a.name.value in MOVABLE]
        if not moved:
            return updated
        stay = [a for a in node.names if a not in moved]
        target = "fsdp_legacy.wrap" if module == _TORCH_WRAP else "fsdp_legacy"
        new = [_line(target, moved, updated)]
        if stay:
            new.append(updated.with_changes(body=[_import(node, stay)], leading_lines=[]))
        return cst.FlattenSentinel(new)


def _import(node: cst.ImportFrom, aliases: list[cst.ImportAlias]) -> cst.ImportFrom:
    last = aliases[-1].with_changes(comma=cst.MaybeSentinel.DEFAULT)
    return node.with_changes(names=[*aliases[:-1], last])


def _line(module: str, aliases: list[cst.ImportAlias], like: cst.SimpleStatementLine) -> cst.SimpleStatementLine:
    names = ", ".join(cst.Module([]).code_for_node(a.with_changes(comma=cst.MaybeSentinel.DEFAULT)) for a in aliases)
    statement = cst.parse_statement(f"from {module} import {names}\n")
    assert isinstance(statement, cst.SimpleStatementLine)
    return statement.with_changes(leading_lines=like.leading_lines)
