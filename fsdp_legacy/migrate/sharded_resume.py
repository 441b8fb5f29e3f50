"""The SHARDED resume of torch's FSDP1 DCP recipe as FSDP2's:

    optim_state = load_sharded_optimizer_state_dict(model_state_dict=..., optimizer_key="optim", storage_reader=r)
    optim.load_state_dict(FSDP.optim_state_dict_to_load(model, optim, optim_state["optim"]))

load_sharded_optimizer_state_dict gives ShardedTensors, which FSDP2's optimizer cannot step with; FSDP2 loads the
checkpoint into the optimizer's own state dict instead:

    optim_state = {"optim": get_optimizer_state_dict(model, optim, options=...)}
    torch.distributed.checkpoint.load(optim_state, storage_reader=r)
    set_optimizer_state_dict(model, optim, optim_state["optim"], options=...)

Mapped where the result is a name used once, as `name[key]` handed to that to-load call under a SHARDED type, or
under FSDP1's default FULL type (fms-fsdp calls it after its SHARDED block): FSDP1 gathers the ShardedTensors to full
tensors there and shards them again, so the optimizer ends up with the same state. Any other to-load call fed from
such a result stays, reported (with the load); under FULL with rank0_only, FSDP1's gather would wait for the other
ranks, which skip it."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import libcst as cst
from libcst.metadata import QualifiedNameProvider

from .bindings import Bindings
from .configs import may_be_full
from .names import fsdp1_name
from .optim_state import Refusal

Code = Callable[[cst.CSTNode], str]

LOADER = "load_sharded_optimizer_state_dict"
_PARAMS = ("model_state_dict", "optimizer_key", "storage_reader", "planner")
_TO_LOAD = "FullyShardedDataParallel.optim_state_dict_to_load"
_WHY = "load_sharded_optimizer_state_dict gives ShardedTensors, which FSDP2's optimizer cannot step with"
_FIX = (
    "load into FSDP2's own layout: `osd = {key: get_optimizer_state_dict(model, optim)}`, "
    "`dcp.load(osd, storage_reader=...)`, then `set_optimizer_state_dict(model, optim, osd[key])`"
)


@dataclass(frozen=True)
class _Resume:
    name: str
    key: str  # the optimizer key's code
    reader: str  # the storage reader's code
    to_load: cst.Call
    module: str  # where the loader was imported from


@dataclass
class _Loaded:
    model: str
    optim: str
    options: str


@dataclass
class ShardedResume(cst.CSTVisitor):
    """Visits the original tree first; the rewriter then asks `check` before a to-load call becomes
    set_optimizer_state_dict, tells `loaded`, and has `statements` rewrite the load."""

    code: Code
    bindings: Bindings
    plans: dict[cst.SimpleStatementLine, _Resume] = field(default_factory=dict)
    to_loads: set[cst.Call] = field(default_factory=set)  # every to-load call of the file
    loaders: int = 0  # how many load_sharded_optimizer_state_dict calls the file makes
    done: dict[cst.Call, _Loaded] = field(default_factory=dict)

    METADATA_DEPENDENCIES = (QualifiedNameProvider,)

    def __post_init__(self) -> None:
        super().__init__()

    def _names(self, node: cst.CSTNode) -> set[str]:
        return {q.name for q in self.get_metadata(QualifiedNameProvider, node, set())}

    def visit_Call(self, node: cst.Call) -> None:
        self.loaders += any(q.endswith("." + LOADER) for q in self._names(node.func))
        if not any(fsdp1_name(q) == _TO_LOAD for q in self._names(node.func)):
            return
        self.to_loads.add(node)
        osd = next(
            (
                a.value
                for i, a in enumerate(node.args)
                if (a.keyword and a.keyword.value == "optim_state_dict") or (not a.keyword and i == 2)
            ),
            None,
        )
        root = osd.value if isinstance(osd, cst.Subscript) else osd
        binding = self.bindings.single(root) if isinstance(root, cst.Name) else None
        value = binding.value if binding is not None else None
        loader = [q for q in self._names(value.func) if q.endswith("." + LOADER)] if isinstance(value, cst.Call) else []
        if not isinstance(value, cst.Call) or not loader:
            return
        args = {
            a.keyword.value if a.keyword else _PARAMS[i] if i < len(_PARAMS) else "": a.value
            for i, a in enumerate(value.args)
        }
        key = self.code(osd.slice[0].slice) if isinstance(osd, cst.Subscript) and len(osd.slice) == 1 else None
        if (
            binding is None
            or len(binding.uses) != 1
            or any(a.star for a in value.args)
            or set(args) - set(_PARAMS)
            or self.code(args.get("planner", cst.Name("None"))) != "None"
            or "optimizer_key" not in args
            or "storage_reader" not in args
            or key != self.code(args["optimizer_key"])
        ):
            return
        assert isinstance(root, cst.Name)
        reader = self.code(args["storage_reader"])
        self.plans[binding.statement] = _Resume(root.value, key, reader, node, loader[0].rsplit(".", 1)[0])

    def options(self, call: cst.Call, options: str) -> str:
        """The options a recipe's to-load call takes: FSDP2's sharded ones under FSDP1's default FULL type, whose
        gather and re-shard of the checkpoint's shards ends in the same optimizer state."""
        planned = call in {p.to_load for p in self.plans.values()}
        return "StateDictOptions()" if planned and options == "StateDictOptions(full_state_dict=True)" else options

    def check(self, call: cst.Call, options: str) -> Refusal | None:
        """Why a to-load call cannot be mapped, if it cannot: in a file that loads with
        load_sharded_optimizer_state_dict, any to-load call but the recipe's may be handed its ShardedTensors (through
        other names, a function's parameter), so only the recipe's is mapped."""
        if call not in self.to_loads or not self.loaders:
            return None
        if call in {p.to_load for p in self.plans.values()} and not may_be_full(options):
            return None
        why = (
            f"{_WHY}; in a file that calls it, only its recipe is mapped (its result a name used once, as `name[key]` "
            "in this call, under a SHARDED type or FSDP1's default FULL one)"
        )
        return Refusal("FSDP.optim_state_dict_to_load(...) of load_sharded_optimizer_state_dict's result", why, _FIX)

    def loaded(self, call: cst.Call, model: str, optim: str, options: str) -> None:
        self.done[call] = _Loaded(model, optim, options)

    def statements(self, statement: cst.SimpleStatementLine) -> list[cst.BaseStatement] | None:
        """FSDP2's statements for a planned `name = load_sharded_optimizer_state_dict(...)` whose load was mapped."""
        plan = self.plans.get(statement)
        done = self.done.get(plan.to_load) if plan is not None else None
        if plan is None or done is None:
            return None
        target = f"get_optimizer_state_dict({done.model}, {done.optim}, options={done.options})"
        code = (
            f"{plan.name} = {{{plan.key}: {target}}}  # FSDP2 loads into the optimizer's own state dict\n"
            f"torch.distributed.checkpoint.load({plan.name}, storage_reader={plan.reader})\n"
        )
        return list(cst.parse_module(code).body)
