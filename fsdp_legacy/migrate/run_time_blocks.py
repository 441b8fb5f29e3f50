"""`with FSDP.state_dict_type(model, type, config, optim_config):` whose type or configs the source does not show
(`state_dict_type=StateDictType.SHARDED_STATE_DICT if sharded else StateDictType.FULL_STATE_DICT`, a config chosen
by a conditional): the block becomes, where it starts,

    state_dict_options, optim_state_dict_options = state_dict_type_options(type, config, optim_config)

(fsdp_legacy.migrate.runtime, options_runtime.py), the arguments evaluated where FSDP1 evaluated them and the decision
made at run time as FSDP1 makes it, and the calls in its body take those options. Followed only where every config
is absent, written inline, a name bound once (bindings.py) to FSDP1's config classes (a conditional between them
too) and used only here, or an attribute `self.<name>` its class assigns once and reads only as state_dict_type
arguments (prismatic's `self.fsdp_save_policy`), or an attribute the file does not assign (Accelerate's
`fsdp_plugin.state_dict_config`, made elsewhere): the configs then stay, as data the helper reads. A type written as
LOCAL_STATE_DICT, or a config the tool cannot follow, leaves the block to type_blocks.py's report."""

from __future__ import annotations

from collections.abc import Callable

import libcst as cst

from .bindings import Bindings
from .state_dict_type import TypeOptions

RUNTIME = "fsdp_legacy.migrate.runtime"
HELPER = "state_dict_type_options"
MODEL_OPTIONS = "state_dict_options"
OPTIM_OPTIONS = "optim_state_dict_options"
_PARAMS = ("module", "state_dict_type", "state_dict_config", "optim_state_dict_config")
_CONFIGS = frozenset(
    {"FullStateDictConfig", "ShardedStateDictConfig", "FullOptimStateDictConfig", "ShardedOptimStateDictConfig"}
)
_FOLLOWED = ("StateDictType.FULL_STATE_DICT", "StateDictType.SHARDED_STATE_DICT")
_BLOCK = "FullyShardedDataParallel.state_dict_type"

Code = Callable[[cst.CSTNode], str]
Fsdp1 = Callable[[cst.CSTNode], "str | None"]


def _config_calls(node: cst.BaseExpression, fsdp1: Fsdp1) -> list[cst.Call] | None:
    """The FSDP1 config constructions `node` is made of (a call, a conditional between such, None); None where it
    is anything else."""
    if isinstance(node, cst.Name) and node.value == "None":
        return []
    if isinstance(node, cst.IfExp):
        body, orelse = _config_calls(node.body, fsdp1), _config_calls(node.orelse, fsdp1)
        return None if body is None or orelse is None else body + orelse
    if isinstance(node, cst.Call) and fsdp1(node.func) in _CONFIGS and not any(a.star for a in node.args):
        return [node]
    return None


def _attribute_config(
    block: cst.Call, node: cst.Attribute, code: Code, fsdp1: Fsdp1, bindings: Bindings
) -> cst.BaseExpression | None:
    """A config held as `self.<name>` (prismatic's `self.fsdp_save_policy = FullStateDictConfig(...)` in
    `__init__`, read by the block in `save_checkpoint`): the value of the one statement of the class that assigns
    it, where every read of it there is a state_dict_type call's argument; None where the class assigns it
    otherwise. An attribute the file does not assign (Accelerate's `fsdp_plugin.state_dict_config`) is an object made
    elsewhere, which the helper reads as it is: `None`'s node (no config data here)."""
    attribute = code(node)
    owner = bindings.enclosing(block, cst.ClassDef)
    if not attribute.startswith("self.") or owner is None:
        return cst.Name("None")
    assigned: list[cst.BaseExpression] = []
    ok = True

    class_level = attribute[len("self.") :]  # (StableCascade's `fsdp_fullstate_save_policy = ...` in the class body)
    class_body = owner.body

    class _Uses(cst.CSTVisitor):
        def visit_Assign(self, assign: cst.Assign) -> None:
            targets = [code(t.target) for t in assign.targets]
            in_body = bindings.parents.get(bindings.parents.get(assign) or assign) is class_body
            if attribute in targets or (in_body and class_level in targets):
                assigned.append(assign.value if len(assign.targets) == 1 else cst.Name("None"))

        def visit_AugAssign(self, assign: cst.AugAssign) -> None:
            nonlocal ok
            ok = ok and code(assign.target) != attribute

        def visit_Attribute(self, read: cst.Attribute) -> bool:
            nonlocal ok
            if code(read) != attribute:
                return True
            arg = bindings.parents.get(read)
            target = bindings.parents.get(arg) if isinstance(arg, cst.Arg) else None
            assigning = isinstance(arg, cst.AssignTarget)
            reader = isinstance(target, cst.Call) and (
                fsdp1(target.func) == _BLOCK or code(target.func).rpartition(".")[2] == HELPER
            )  # (the helper: a file migrated before)
            ok = ok and (assigning or reader)
            return False

    owner.visit(_Uses())
    if not assigned:
        return cst.Name("None")
    return assigned[0] if ok and len(assigned) == 1 else None


def parse(call: cst.Call, code: Code, fsdp1: Fsdp1, bindings: Bindings, taken: frozenset[str]) -> TypeOptions | None:
    """The block's options decided at run time, or None where it cannot be followed (`taken`: the names the file
    uses, which the options' names must not be)."""
    if MODEL_OPTIONS in taken or OPTIM_OPTIONS in taken:
        return None
    args: dict[str, cst.BaseExpression] = {}
    for index, arg in enumerate(call.args):
        key = arg.keyword.value if arg.keyword else _PARAMS[index] if index < len(_PARAMS) else ""
        if arg.star or key not in _PARAMS or key in args:
            return None
        args[key] = arg.value
    if "module" not in args or "state_dict_type" not in args:
        return None
    kind = fsdp1(args["state_dict_type"])
    if kind is not None and kind not in _FOLLOWED:
        return None  # LOCAL_STATE_DICT, or FSDP1 API that is no type: reported where it is
    data: list[cst.CSTNode] = []
    for key in _PARAMS[2:]:
        node = args.get(key)
        if node is None:
            continue
        binding = bindings.single(node) if isinstance(node, cst.Name) and node.value != "None" else None
        if isinstance(node, cst.Name) and node.value != "None" and (binding is None or len(binding.uses) != 1):
            return None  # a config bound elsewhere or used again: its other uses are not the helper's
        value: cst.BaseExpression | None = binding.value if binding is not None else node
        if isinstance(node, cst.Attribute):
            value = _attribute_config(call, node, code, fsdp1, bindings)
        found = _config_calls(value, fsdp1) if value is not None else None
        if found is None:
            return None
        data.extend(found)
    given = ", ".join(f"{key}={code(args[key])}" for key in _PARAMS[1:] if key in args)
    return TypeOptions(
        code(args["module"]), MODEL_OPTIONS, OPTIM_OPTIONS, run_time=f"{HELPER}({given})", data=tuple(data)
    )


def started(
    options: TypeOptions | None, body: list[cst.BaseStatement], need: Callable[[str, str], None]
) -> list[cst.BaseStatement]:
    """The body of a block taken away, started by the helper call where it is decided at run time."""
    if options is None or not options.run_time:
        return body
    need(RUNTIME, HELPER)
    return [cst.parse_statement(f"{MODEL_OPTIONS}, {OPTIM_OPTIONS} = {options.run_time}\n"), *body]


def read_at_run_time(
    call: cst.Call,
    qualified: set[str],
    value_of: Callable[[cst.BaseExpression], cst.BaseExpression],
    fsdp1: Fsdp1,
    code: Code,
    bindings: Bindings,
) -> list[cst.CSTNode]:
    """In a migrated file, the FSDP1 configs a `state_dict_type_options(...)` call reads (data, not left over)."""
    if f"{RUNTIME}.{HELPER}" not in qualified:
        return []
    found: list[cst.CSTNode] = []
    for arg in call.args:
        value: cst.BaseExpression | None = value_of(arg.value)
        if isinstance(arg.value, cst.Attribute):
            value = _attribute_config(call, arg.value, code, fsdp1, bindings)
        found.extend(_config_calls(value, fsdp1) or () if value is not None else ())
    return found
