"""Auto-wrap policies, ``enable_wrap``/``wrap``, and the traversal that picks the FSDP units.

A ``_Policy`` object (``ModuleWrapPolicy``, ``CustomPolicy``) maps every module to wrap to its kwargs up front;
the units are then built bottom-up in one post-order pass. A legacy callable ``policy(module=, recurse=,
nonwrapped_numel=) -> bool`` is asked top-down whether to descend into a module (``recurse=True``) and, on the
way back up, whether to wrap what is left of it (``recurse=False``), so size-based decisions count only
parameters not yet wrapped below. The root is never wrapped here: the wrapper's constructor does that.
"""

from __future__ import annotations

import collections
import contextlib
import functools
import warnings
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Iterator
from typing import Any, cast

import torch
import torch.nn as nn
from torch.torch_version import TorchVersion
from torch.utils._pytree import tree_leaves, tree_map_only

__all__ = [
    "always_wrap_policy",
    "lambda_auto_wrap_policy",
    "transformer_auto_wrap_policy",
    "size_based_auto_wrap_policy",
    "enable_wrap",
    "wrap",
    "CustomPolicy",
    "ModuleWrapPolicy",
]

Kwargs = dict[str, Any]
Targets = dict[nn.Module, Kwargs]  # module to wrap -> its wrapper's kwargs
LegacyPolicy = Callable[..., bool]


def always_wrap_policy(*args: Any, **kwargs: Any) -> bool:
    """Wrap every submodule, parameterless ones included."""
    return True


def _module_wrap_policy(
    module: nn.Module, recurse: bool, nonwrapped_numel: int, module_classes: Iterable[type]
) -> bool:
    """Always descend; wrap instances of ``module_classes``."""
    return recurse or isinstance(module, tuple(module_classes))


def lambda_auto_wrap_policy(
    module: nn.Module, recurse: bool, nonwrapped_numel: int, lambda_fn: Callable[[nn.Module], bool]
) -> bool:
    """Always descend; wrap the modules for which ``lambda_fn(module)`` is true."""
    return recurse or lambda_fn(module)


def transformer_auto_wrap_policy(
    module: nn.Module, recurse: bool, nonwrapped_numel: int, transformer_layer_cls: Iterable[type[nn.Module]]
) -> bool:
    """Always descend; wrap instances of ``transformer_layer_cls``. Modules sharing a parameter (a tied
    embedding) must end up in one unit, which this leaves to their common ancestor."""
    return _module_wrap_policy(module, recurse, nonwrapped_numel, transformer_layer_cls)


def size_based_auto_wrap_policy(
    module: nn.Module,
    recurse: bool,
    nonwrapped_numel: int,
    min_num_params: int = int(1e8),
    force_leaf_modules: set[type[nn.Module]] | None = None,
    exclude_wrap_modules: set[type[nn.Module]] | None = None,
) -> bool:
    """Descend into, and wrap, modules with at least ``min_num_params`` not-yet-wrapped parameters.

    ``force_leaf_modules`` are not descended into, hence not wrapped either; ``exclude_wrap_modules``
    are descended into but not wrapped. ``None`` means the function attributes of the same name."""
    if nonwrapped_numel < min_num_params:
        return False
    if recurse:
        leaves = size_based_auto_wrap_policy.FORCE_LEAF_MODULES  # type: ignore[attr-defined]
        return not isinstance(module, tuple(leaves if force_leaf_modules is None else force_leaf_modules))
    excluded = size_based_auto_wrap_policy.EXCLUDE_WRAP_MODULES  # type: ignore[attr-defined]
    return not isinstance(module, tuple(excluded if exclude_wrap_modules is None else exclude_wrap_modules))


# Containers have no forward to gather for; MultiheadAttention reads its submodule's weights directly.
size_based_auto_wrap_policy.EXCLUDE_WRAP_MODULES = {nn.ModuleList, nn.ModuleDict}  # type: ignore[attr-defined]
size_based_auto_wrap_policy.FORCE_LEAF_MODULES = {nn.MultiheadAttention}  # type: ignore[attr-defined]


def _or_policy(module: nn.Module, recurse: bool, nonwrapped_numel: int, policies: Iterable[LegacyPolicy]) -> bool:
    """True if any of ``policies`` is."""
    return any(p(module=module, recurse=recurse, nonwrapped_numel=nonwrapped_numel) for p in policies)


class _Policy(ABC):
    """A policy that maps each module to wrap to the kwargs of its wrapper."""

    @abstractmethod
    def _run_policy(self, root_module: nn.Module, ignored_modules: set[nn.Module], root_kwargs: Kwargs) -> Targets:
        """Return ``{module: wrapper kwargs}`` for the modules of ``root_module``'s tree to wrap."""


class ModuleWrapPolicy(_Policy):
    """Wrap every instance of ``module_classes`` with the root's kwargs."""

    def __init__(self, module_classes: Iterable[type[nn.Module]]):
        self._module_classes = set(module_classes)
        self._module_classes_str = str(self._module_classes)

    def _run_policy(self, root_module: nn.Module, ignored_modules: set[nn.Module], root_kwargs: Kwargs) -> Targets:
        classes = tuple(self._module_classes)
        return {
            m: dict(root_kwargs)  # one dict per unit, so later per-unit edits stay local
            for m in root_module.modules()
            if m not in ignored_modules and isinstance(m, classes)
        }

    def __call__(self, module: nn.Module, recurse: bool, *args: Any, **kwargs: Any) -> bool:
        """The same policy as a legacy callable."""
        return _module_wrap_policy(module, recurse, -1, self._module_classes)

    def __repr__(self) -> str:
        return f"{super().__repr__()}({self._module_classes_str})"


class CustomPolicy(_Policy):
    """Wrap by ``lambda_fn(module)``: ``False`` or ``{}`` skips the module, ``True`` wraps it with
    the root's kwargs, and a non-empty dict wraps it with the root's kwargs updated by that dict."""

    def __init__(self, lambda_fn: Callable[[nn.Module], bool | Kwargs]):
        self._lambda_fn = lambda_fn

    def _run_policy(self, root_module: nn.Module, ignored_modules: set[nn.Module], root_kwargs: Kwargs) -> Targets:
        targets: Targets = {}
        for module in root_module.modules():
            if module in ignored_modules:
                continue
            decision = self._lambda_fn(module)
            if not isinstance(decision, (bool, dict)):
                raise ValueError(
                    "The lambda_fn passed to CustomPolicy should return False/True or a kwarg dict, "
                    f"but it returned {decision}"
                )
            if decision:
                targets[module] = {**root_kwargs, **(decision if isinstance(decision, dict) else {})}
        return targets


_wrap_context: tuple[Callable[..., nn.Module], Kwargs] | None = None  # (wrapper_cls, kwargs) inside enable_wrap


@contextlib.contextmanager
def enable_wrap(*, wrapper_cls: Any, **wrapper_kwargs: Any) -> Iterator[None]:
    """Make ``wrap(module)`` build ``wrapper_cls(module, **wrapper_kwargs)`` inside this context."""
    global _wrap_context
    if _wrap_context is not None:
        raise NotImplementedError(
            "You are already within an autowrap context and we currently do not supported nested autowrap."
        )
    _wrap_context = (wrapper_cls, wrapper_kwargs)
    try:
        yield
    finally:
        _wrap_context = None


def wrap(module: nn.Module, **wrap_overrides: Any) -> nn.Module:
    """Inside ``enable_wrap``, wrap ``module`` with the context's kwargs updated by ``wrap_overrides``;
    outside it, return ``module`` unchanged."""
    if _wrap_context is None:
        return module
    wrapper_cls, kwargs = _wrap_context
    return _wrap(module, wrapper_cls, **{**kwargs, **wrap_overrides})


def _wrap(module: nn.Module, wrapper_cls: Callable[..., nn.Module], **kwargs: Any) -> nn.Module:
    # A module's own `_wrap_overrides` (set for mixed-precision-excluded modules) beats everything.
    return wrapper_cls(module, **{**kwargs, **getattr(module, "_wrap_overrides", {})})


def auto_wrap(
    root: nn.Module,
    policy: _Policy | LegacyPolicy,
    wrapper_cls: type,
    ignored_modules: set[nn.Module],
    ignored_params: set[nn.Parameter],
    root_kwargs: Kwargs,
) -> None:
    """Replace submodules of `root` (never root itself) in place with wrapper_cls(child, **kwargs),
    bottom-up (post-order), as decided by `policy` (a _Policy or a legacy callable
    (module, recurse, nonwrapped_numel) -> bool)."""
    for name, module in root.named_modules():
        if isinstance(module, wrapper_cls):
            msg = f"FSDP auto wrapping requires modules to not already have FSDP applied but found {name} in\n{root}"
            raise ValueError(msg)
    # Whole subtrees are ignored, with their parameters, even if the caller listed only their roots.
    ignored_modules = {m for top in ignored_modules for m in top.modules()}
    ignored_params = set(ignored_params) | {p for m in ignored_modules for p in m.parameters()}
    kwargs = {**root_kwargs, "auto_wrap_policy": None}  # children must not auto-wrap again

    # Duck-typed so torch's own ModuleWrapPolicy/CustomPolicy objects work as well.
    targets = policy._run_policy(root, ignored_modules, kwargs) if hasattr(policy, "_run_policy") else None
    # Modules that mixed precision skips (BatchNorm by default) become units of their own, in fp32.
    mixed_precision = kwargs.get("mixed_precision")
    fp32_classes = tuple(getattr(mixed_precision, "_module_classes_to_ignore", ()))
    if mixed_precision is not None:
        _mark_fp32_modules(root, fp32_classes)

    if targets is None:
        legacy = cast(LegacyPolicy, policy)
        if mixed_precision is not None:
            # As in torch, this OR also makes the policy descend everywhere: the class policy always recurses.
            fp32_policy = functools.partial(_module_wrap_policy, module_classes=fp32_classes)
            legacy = functools.partial(_or_policy, policies=[legacy, fp32_policy])
        _wrap_recursively(root, legacy, wrapper_cls, ignored_modules, ignored_params, kwargs, is_root=True)
        return

    for module in root.modules():
        if isinstance(module, fp32_classes) and module not in ignored_modules:
            targets[module] = {**targets.get(module, kwargs), "mixed_precision": None}
    order = _post_order(root)
    _check_uniform_requires_grad(order, targets, ignored_params, kwargs.get("use_orig_params", False))
    for _, module, parent, attr in order:
        if module in targets and parent is not None:
            setattr(parent, attr, wrapper_cls(module, **targets[module]))


def _wrap_recursively(
    module: nn.Module,
    policy: LegacyPolicy,
    wrapper_cls: type,
    ignored_modules: set[nn.Module],
    ignored_params: set[nn.Parameter],
    kwargs: Kwargs,
    is_root: bool = False,
) -> tuple[nn.Module, int]:
    """Wrap within ``module`` (and ``module`` itself unless it is the root) as the legacy policy
    says; return the module to put in its place and the parameter numel now wrapped."""
    numel = sum(p.numel() for p in module.parameters() if p not in ignored_params)
    if not policy(module=module, recurse=True, nonwrapped_numel=numel):
        return module, 0
    wrapped_numel = 0
    for name, child in module.named_children():
        if child in ignored_modules:
            continue
        new_child, child_wrapped = _wrap_recursively(
            child, policy, wrapper_cls, ignored_modules, ignored_params, kwargs
        )
        setattr(module, name, new_child)
        wrapped_numel += child_wrapped
    if not is_root and policy(module=module, recurse=False, nonwrapped_numel=numel - wrapped_numel):
        return _wrap(module, wrapper_cls, **kwargs), numel
    return module, wrapped_numel


def _mark_fp32_modules(root: nn.Module, classes: tuple[type[nn.Module], ...]) -> None:
    """Make instances of ``classes`` wrap with ``mixed_precision=None`` (also under ``wrap()``) and
    run in fp32, and warn once about the classes found."""
    found: set[type[nn.Module]] = set()
    for module in root.modules():
        if isinstance(module, classes):
            found.add(type(module))
            module._wrap_overrides = {"mixed_precision": None}  # type: ignore[assignment]
            _run_in_fp32(module)
    if found:
        warnings.warn(
            "Both mixed precision and an auto_wrap_policy were specified to FSDP, where the wrapped "
            f"module has submodules of type:\n{found}\n"
            f"These modules will be wrapped as separate FSDP {_INSTANCES} with mixed precision disabled.",
            stacklevel=4,  # _mark_fp32_modules -> auto_wrap -> wrapper ctor -> user
        )


# torch's wording of that warning: "instacnes" until torch 2.14 corrected it.
_INSTANCES = "instances" if TorchVersion(torch.__version__) >= "2.14" else "instacnes"


def _run_in_fp32(module: nn.Module) -> None:
    """Cast floating inputs to fp32 and outputs back to the input dtype, so that a full-precision
    unit sits between low-precision neighbours."""
    input_dtype: list[torch.dtype] = []  # the current call's non-fp32 floating input dtype, if any

    def cast_inputs(_: nn.Module, args: Any) -> Any:
        tensors = [t for t in tree_leaves(args) if isinstance(t, torch.Tensor)]
        input_dtype[:] = [t.dtype for t in tensors if t.is_floating_point() and t.dtype != torch.float32][-1:]
        return _cast_floats(args, torch.float32)

    module.register_forward_pre_hook(cast_inputs)
    module.register_forward_hook(lambda _, args, out: _cast_floats(out, input_dtype[0]) if input_dtype else None)


def _cast_floats(tree: Any, dtype: torch.dtype) -> Any:
    return tree_map_only(torch.Tensor, lambda t: t.to(dtype) if t.is_floating_point() else t, tree)


Visit = tuple[str, nn.Module, "nn.Module | None", str]  # (fqn, module, parent, attribute name in parent)


def _post_order(root: nn.Module) -> list[Visit]:
    """Every module once (a shared one under its first parent), children first, in registration order."""
    seen = {root}
    order: list[Visit] = []

    def visit(module: nn.Module, fqn: str, parent: nn.Module | None, attr: str) -> None:
        for name, child in module.named_children():
            if child not in seen:
                seen.add(child)
                visit(child, f"{fqn}.{name}" if fqn else name, module, name)
        order.append((fqn, module, parent, attr))

    visit(root, "", None, "")
    return order


def _check_uniform_requires_grad(
    order: list[Visit],
    targets: Targets,
    ignored_params: set[nn.Parameter],
    use_orig_params: bool,
) -> None:
    """Each unit flattens its own parameters (those not inside a nested unit) of one dtype together, which needs
    one requires_grad value when use_orig_params=False, and wastes gradient memory otherwise."""
    claimed: set[nn.Module] = set()  # modules whose parameters an earlier (nested) unit owns
    for fqn, unit, _, _ in order:
        if unit not in targets:
            continue
        by_dtype: dict[torch.dtype, dict[nn.Parameter, str]] = {}
        for param, name in _unit_params(unit, fqn, claimed, ignored_params).items():
            by_dtype.setdefault(param.dtype, {})[param] = name
        for params in by_dtype.values():
            _check_one_flat_param(fqn, params, use_orig_params)


def _check_one_flat_param(fqn: str, params: dict[nn.Parameter, str], use_orig_params: bool) -> None:
    trainable = [name for p, name in params.items() if p.requires_grad]
    frozen = [name for p, name in params.items() if not p.requires_grad]
    if not (trainable and frozen):
        return
    msg = f"{fqn} has both parameters with requires_grad=True and False."
    if use_orig_params:
        numel, trainable_numel = sum(p.numel() for p in params), sum(p.numel() for p in params if p.requires_grad)
        msg += (
            " We do not recommend wrapping such modules since the gradient memory usage will be higher than "
            f"expected ({numel} numel instead of {trainable_numel} numel before sharding via reduce-scatter). "
        )
    else:
        msg += " FSDP does not support wrapping such modules when use_orig_params=False. "
    msg += (
        "If possible, wrap the frozen parameters with FSDP separately.\n"
        f"The following parameters have requires_grad=True:\n{trainable}\n"
        f"The following parameters have requires_grad=False:\n{frozen}"
    )
    if not use_orig_params:
        raise ValueError(msg)
    warnings.warn(msg, stacklevel=5)  # _check_one_flat_param -> _check_uniform_requires_grad -> auto_wrap -> ctor


def _unit_params(
    unit: nn.Module, fqn: str, claimed: set[nn.Module], ignored: set[nn.Parameter]
) -> dict[nn.Parameter, str]:
    """The parameters ``unit`` would own, with FQNs from the root, breadth-first (the order of torch's
    message); claims the modules visited."""
    params: dict[nn.Parameter, str] = {}
    queue = collections.deque([(unit, fqn)])
    claimed.add(unit)
    while queue:
        module, prefix = queue.popleft()
        for name, p in module.named_parameters(recurse=False):
            if p not in ignored:
                params[p] = f"{prefix}.{name}" if prefix else name
        for name, child in module.named_children():
            if child not in claimed:
                claimed.add(child)
                queue.append((child, f"{prefix}.{name}" if prefix else name))
    return params
