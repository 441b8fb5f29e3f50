"""Files left as they are, as a whole, and why (kind "refused"): never a mix of FSDP1 and FSDP2.

Subclasses of FSDP1's class (`class MyFSDP(FSDP):`): a file that defines one, or uses one defined in another file
of the program, is left as it is, as a whole, and says why. So is a file whose FSDP(...) calls stay FSDP1 beside
code the rewrite would change (kept_constructions).

FSDP2 has no class to subclass (fully_shard swaps the module's class in place), so such a class stays FSDP1's; its
objects would then meet `isinstance(x, FSDP)` and `FSDP.fsdp_modules(m)` rewritten for FSDP2, which match nothing,
and state-dict calls rewritten onto FSDP2's helpers, which do not know FSDP1 modules: a program neither FSDP1 nor
FSDP2. Following a subclass would mean moving what it overrides onto fully_shard's modules, which is a person's
call; refusing it keeps the program FSDP1 and says where to start."""

from __future__ import annotations

from dataclasses import dataclass

import libcst as cst
from libcst.metadata import PositionProvider, QualifiedNameProvider

from .names import fsdp1_name
from .report import Finding

_FSDP = "FullyShardedDataParallel"
REFUSED = "refused"  # Finding.kind of a file left as it is as a whole

_WHY = (
    "FSDP2 has no class to subclass (fully_shard changes the module's class in place), so the subclass stays FSDP1's, "
    "and its objects would meet `isinstance(x, FSDP)`, `FSDP.fsdp_modules(...)` and state-dict calls rewritten for "
    "FSDP2, which match nothing or fail: the file is left as it is, as a whole"
)
_FIX = (
    "move what the subclass adds onto the module itself (or a function around fully_shard), build the model with "
    "FSDP(...) or fully_shard, then migrate again"
)


@dataclass(frozen=True)
class Subclass:
    """`class name(base)` where base is FSDP1's class or another such subclass."""

    name: str
    line: int
    base: str  # as written


def _last(node: cst.BaseExpression) -> str | None:
    """The name a base is known by: `MyFSDP` for `MyFSDP` and for `utils.MyFSDP`."""
    if isinstance(node, cst.Name):
        return node.value
    if isinstance(node, cst.Attribute):
        return node.attr.value
    return None


class Subclasses(cst.CSTVisitor):
    """Visits one file: the FSDP1 subclasses it defines (a base that is FSDP1's class, one defined before in the
    file, or one of `known`, defined in other files of the program), and the first line naming one of `known`."""

    METADATA_DEPENDENCIES = (QualifiedNameProvider, PositionProvider)

    def __init__(self, known: frozenset[str] = frozenset()) -> None:
        super().__init__()
        self.known = known
        self.defined: list[Subclass] = []
        self.used: dict[str, int] = {}  # a name of `known` -> the first line that names it

    def visit_ClassDef(self, node: cst.ClassDef) -> None:
        ours = {s.name for s in self.defined}
        for base in node.bases:
            qualified = {q.name for q in self.get_metadata(QualifiedNameProvider, base.value, set())}
            name = _last(base.value)
            if any(fsdp1_name(q) == _FSDP for q in qualified) or (name is not None and name in ours | self.known):
                line = self.get_metadata(PositionProvider, node).start.line
                base_code = cst.Module([]).code_for_node(base.value)
                self.defined.append(Subclass(node.name.value, line, base_code))
                return

    def visit_Name(self, node: cst.Name) -> None:
        self._use(node.value, node)

    def visit_Attribute(self, node: cst.Attribute) -> None:
        self._use(node.attr.value, node)

    def _use(self, name: str, node: cst.CSTNode) -> None:
        if name in self.known and name not in self.used:
            self.used[name] = self.get_metadata(PositionProvider, node).start.line


def refusals(found: Subclasses, elsewhere: dict[str, str]) -> list[Finding]:
    """The findings of a file refused for FSDP1 subclasses: each it defines, and each it uses from `elsewhere`
    (name -> where it is defined, `path:line`); empty if there is none."""
    findings = [
        Finding(s.line, f"`class {s.name}({s.base})`, a subclass of FSDP1's class", _WHY, _FIX, REFUSED)
        for s in found.defined
    ]
    for name, line in found.used.items():
        if name in {s.name for s in found.defined}:
            continue
        what = f"`{name}`, a subclass of FSDP1's class defined at {elsewhere.get(name, 'another file')}"
        findings.append(Finding(line, what, _WHY, _FIX, REFUSED))
    return sorted(findings, key=lambda f: f.line)


def program_refusal(defined: dict[str, str]) -> Finding:
    """For a file of a program whose other files define FSDP1 subclasses (name -> `path:line`): their objects may
    reach this file's FSDP1 calls, so it stays FSDP1 with them."""
    listed = ", ".join(f"`{name}` ({where})" for name, where in sorted(defined.items()))
    why = (
        f"the program defines {listed}, a subclass of FSDP1's class, which stays FSDP1: its objects may reach this "
        "file's FSDP1 calls (`isinstance(x, FSDP)`, `FSDP.fsdp_modules(...)`, state-dict calls), which rewritten for "
        "FSDP2 would match nothing; the file is left as it is, as a whole"
    )
    return Finding(1, "a program with a subclass of FSDP1's class", why, _FIX, REFUSED)


def kept_constructions(lines: list[int]) -> Finding:
    """For a file with FSDP(...) calls that stay FSDP1 (reported at their lines) beside code the rewrite would
    change: that code is left FSDP1's too."""
    where = ", ".join(map(str, lines))
    why = (
        f"FSDP(...), wrap() or FSDP1's class handed on as a value (`partial(FSDP, ...)`, `wrapper = FSDP`) at "
        f"line{'s' if len(lines) > 1 else ''} {where} stays FSDP1 (the findings there say "
        "why), and rewriting the rest of the file for FSDP2 would mix the two: its model's methods (`clip_grad_norm_`, "
        "`no_sync`), `FSDP.fsdp_modules(...)`, `isinstance(x, FSDP)`, its policies and state-dict calls would be "
        "FSDP2's around an FSDP1 model; the file is left as it is, as a whole"
    )
    fix = "make those constructions ones this tool maps (keywords it can read), then migrate again"
    return Finding(lines[0], "FSDP1 constructions kept", why, fix, REFUSED)


def kept_state_dict_calls(lines: list[int]) -> Finding:
    """For a file whose wrapped models' state-dict calls stay as written (reported at their lines, arguments with no
    FSDP2 counterpart) beside code the rewrite would change: that code is left FSDP1's too."""
    where = ", ".join(map(str, lines))
    many = len(lines) > 1
    them = "them" if many else "it"
    why = (
        f"the state-dict call{'s' if many else ''} at line{'s' if many else ''} {where} on a wrapped model "
        f"stay{'' if many else 's'} as written (the findings there say why), and rewriting the rest of the file for "
        f"FSDP2 would give {them} an FSDP2 model, whose own state_dict()/load_state_dict() work on each rank's "
        "DTensor shards, where FSDP1's state-dict type decided; the file is left as it is, as a whole"
    )
    fix = "write those calls onto get_/set_model_state_dict with StateDictOptions, then migrate again"
    return Finding(lines[0], "FSDP1 state-dict calls kept", why, fix, REFUSED)


def kept_type_blocks(lines: list[int]) -> Finding:
    """For a file with `state_dict_type` blocks that stay (reported at their lines) beside code the rewrite would
    change: that code is left FSDP1's too."""
    where = ", ".join(map(str, lines))
    many = len(lines) > 1
    why = (
        f"the `FSDP.state_dict_type(...)` block{'s' if many else ''} at line{'s' if many else ''} {where} "
        f"stay{'' if many else 's'} FSDP1 (the findings there say why), and rewriting the rest of the file for FSDP2 "
        "would mix the two: on an FSDP2 model FSDP1's block sets nothing (the calls under it get each rank's DTensor "
        "shards, where FSDP1 gave the type's state dict) and fails on leaving; the file is left as it is, as a whole"
    )
    fix = "write the calls under those blocks onto get_/set_model_state_dict with StateDictOptions, then migrate again"
    return Finding(lines[0], "FSDP1 state_dict_type blocks kept", why, fix, REFUSED)
