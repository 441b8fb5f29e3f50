"""FSDP1's `MixedPrecision(...)` where it stands on its own (a policy assigned to a name, a config's default): it
becomes FSDP2's MixedPrecisionPolicy only where that gives what FSDP1 did. It stays FSDP1's, reported, where an
FSDP(...) that takes it stays FSDP1 (an FSDP2 policy would break it), and where it sets a buffer_dtype that no
construction of the file casts the buffers to (FSDP2's policy has no buffer_dtype: dropped, the buffers would stay
in their own dtype without a word). The call is rewritten in place: its comments and layout are kept.

A literal `CPUOffload(...)` likewise becomes FSDP2's policy only where this file's constructions alone take it."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Collection, Mapping, Sequence
from typing import TYPE_CHECKING, cast

import libcst as cst
from libcst.metadata import ParentNodeProvider

if TYPE_CHECKING:
    from .transformer import Fsdp1ToFsdp2

Resolve = Callable[[cst.BaseExpression], cst.BaseExpression]

KEPT = ("param_dtype", "reduce_dtype")


def uses(
    calls: Sequence[tuple[cst.Call, bool]],
    value_of: Resolve,
    assigned: Mapping[str, Sequence[tuple[cst.SimpleStatementLine, cst.BaseExpression]]],
    name_count: Counter[str],
    external: Mapping[str, bool],
) -> dict[cst.CSTNode, bool]:
    """The MixedPrecision values the file's FSDP(...) calls take (`mixed_precision=`), each with whether every use
    becomes FSDP2's (`calls`: each FSDP call and whether it becomes fully_shard). A policy assigned to a name counts
    its other uses too: read anywhere but as a `mixed_precision=` (passed by position, returned, stored), it may
    reach a construction that stays FSDP1, so it is False; `external`: the uses other files of the program make of
    the file's names (facts.py)."""
    found: dict[cst.CSTNode, bool] = {}
    keyword_reads: Counter[str] = Counter()
    for call, migrated in calls:
        for arg in call.args:
            if arg.keyword is not None and arg.keyword.value == "mixed_precision":
                node = value_of(arg.value)
                found[node] = found.get(node, True) and migrated
                if isinstance(arg.value, cst.Name):
                    keyword_reads[arg.value.value] += 1
    for name, values in assigned.items():
        if len(values) != 1 or not isinstance(values[0][1], cst.Call):
            continue
        node = values[0][1]
        if name_count[name] > 1 + keyword_reads[name]:  # (the assignment's target, the keywords)
            found[node] = False
        if name in external:
            found[node] = found.get(node, True) and external[name]
    return found


def taken(call: cst.Call, policies: Collection[cst.CSTNode], value_of: Resolve) -> bool:
    """Whether FSDP(...) `call` takes one of `policies` as its `mixed_precision=`."""
    return any(
        a.keyword is not None and a.keyword.value == "mixed_precision" and value_of(a.value) in policies
        for a in call.args
    )


def _merged(
    before: cst.BaseParenthesizableWhitespace, dropped: cst.BaseParenthesizableWhitespace
) -> cst.BaseParenthesizableWhitespace:
    """The whitespace after a kept argument followed by a dropped one: its own line's comment, the comment lines
    between, and the dropped argument's, then the layout that followed the dropped one."""
    if not isinstance(dropped, cst.ParenthesizedWhitespace):
        return before
    if not isinstance(before, cst.ParenthesizedWhitespace):
        return dropped
    comment = dropped.first_line.comment
    own = [cst.EmptyLine(indent=True, whitespace=before.last_line, comment=comment)] if comment else []
    return dropped.with_changes(
        first_line=before.first_line, empty_lines=[*before.empty_lines, *own, *dropped.empty_lines]
    )


def policy_call(call: cst.Call) -> cst.Call:
    """`MixedPrecision(...)` as `MixedPrecisionPolicy(...)` with only the arguments FSDP2's policy takes (the caller
    has checked the others carry nothing over), every comment kept."""
    if not call.args:  # `MixedPrecision()`
        return call.with_changes(func=cst.Name("MixedPrecisionPolicy"))
    args: list[cst.Arg] = []
    before = call.whitespace_before_args
    for arg in call.args:
        if arg.keyword is not None and arg.keyword.value in KEPT:
            args.append(arg)
            continue
        after = arg.comma.whitespace_after if isinstance(arg.comma, cst.Comma) else arg.whitespace_after_arg
        if args:
            comma = args[-1].comma
            if isinstance(comma, cst.Comma):
                merged = _merged(comma.whitespace_after, after)
                args[-1] = args[-1].with_changes(comma=comma.with_changes(whitespace_after=merged))
        else:
            before = _merged(before, after)
    last_comma = args[-1].comma if args else None
    if not isinstance(call.args[-1].comma, cst.Comma) and isinstance(last_comma, cst.Comma):
        last = args[-1]
        ending = last_comma.whitespace_after
        if not isinstance(ending, cst.ParenthesizedWhitespace):  # (the line's own ending otherwise)
            ending = call.args[-1].whitespace_after_arg
        args[-1] = last.with_changes(comma=cst.MaybeSentinel.DEFAULT, whitespace_after_arg=ending)
    return call.with_changes(func=cst.Name("MixedPrecisionPolicy"), args=args, whitespace_before_args=before)


def kept(refused: list[str], used: bool | None) -> tuple[str, str]:
    """(why, fix) for a MixedPrecision(...) left as written."""
    if refused:
        return "FSDP2's MixedPrecisionPolicy has no counterpart", "set it per module by hand, or drop it"
    if used is False:
        why = (
            "an FSDP(...) that takes it stays FSDP1 (reported, in this file or another of the program), or it is used "
            "other than as FSDP(...)'s `mixed_precision=` (passed by position, returned, stored), where it may reach "
            "one; FSDP1 needs FSDP1's policy"
        )
        return why, "migrate those uses first, or pass the policy as `mixed_precision=` to constructions this tool maps"
    why = "FSDP2's MixedPrecisionPolicy has no buffer_dtype, and no construction of this file casts the buffers for it"
    fix = "after fully_shard, cast the floating-point buffers to that dtype (`buffer.data = buffer.data.to(dtype)`)"
    return why, fix


def offload_for_constructions(t: Fsdp1ToFsdp2, call: cst.Call) -> bool:
    """Whether only this file's FSDP(...) calls take a CPUOffload(...): as their `cpu_offload=`, or through a name
    bound to it once and read only there. Elsewhere (a dict handed on, a conditional, returned) it may reach an
    FSDP(...) that stays FSDP1, in this program or out of it."""
    parent = t.get_metadata(ParentNodeProvider, call, None)
    if isinstance(parent, cst.Arg):
        return _is_offload_keyword(t, parent)
    if not (isinstance(parent, cst.Assign) and len(parent.targets) == 1):
        return False
    target = parent.targets[0].target
    binding = t.resume.bindings.single(target) if isinstance(target, cst.Name) else None
    if binding is None or cast(cst.Name, target).value in t.facts.read_elsewhere:
        return False
    uses = [t.get_metadata(ParentNodeProvider, use, None) for use in binding.uses]
    return bool(uses) and all(isinstance(arg, cst.Arg) and _is_offload_keyword(t, arg) for arg in uses)


def _is_offload_keyword(t: Fsdp1ToFsdp2, arg: cst.Arg) -> bool:
    """`cpu_offload=...` of an FSDP(...) call."""
    call = t.get_metadata(ParentNodeProvider, arg, None)
    return (
        arg.keyword is not None
        and arg.keyword.value == "cpu_offload"
        and isinstance(call, cst.Call)
        and t.fsdp1(call.func) == "FullyShardedDataParallel"
        and not any(a.star == "**" for a in call.args)  # (fully_shard_fsdp1 takes FSDP1's values)
    )
