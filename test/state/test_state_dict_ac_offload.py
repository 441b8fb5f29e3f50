"""State dicts with activation-checkpoint wrappers and with fp16 + CPU offload, and activation checkpointing end to end
with CPU offload (issue 20 parts 7, 8 and 18). Each case replays one of torch's own FSDP1 tests (test_fsdp_state_dict.py
`test_fsdp_state_dict_with_activation_checkpoint`, `test_state_dict_with_manual_ac_wrapper`,
`test_basic_save_and_load_state_dict`; test_fsdp_checkpoint.py `test_basic_checkpoint_end_to_end`,
`test_checkpoint_fsdp_wrapping`) on fsdp_legacy and on torch's FSDP1 side by side, and compares what both observe.

torch's FSDP1 cannot do two things on CPU (docs/compatibility.md): FullStateDictConfig(offload_to_cpu=True) and
CPUOffload(offload_params=True). Where ours uses them, torch's oracle runs the nearest thing it can: rank0_only alone,
and no parameter offload.
"""

from __future__ import annotations

import copy
import functools
import warnings
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.distributed.fsdp as torch_fsdp
from torch import nn
from torch.distributed._state_dict_utils import _gather_state_dict
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
    CheckpointImpl,
    apply_activation_checkpointing,
    checkpoint_wrapper,
    offload_wrapper,
)
from torch.utils.checkpoint import checkpoint

import fsdp_legacy
import models
from fsdp_utils import Config, assert_close, batch, loss_of, optimizer
from harness import run_on_ranks

LIBS = {"ours": fsdp_legacy, "torch": torch_fsdp}
RECORD_SUFFIX = "_flat_param_meta"  # our LOCAL layout record (issue 20 part 9 moves it out of the state dict)
WRAPS = ["source", "dest", "both", "source_after_wrap", "both_after_wrap"]


def _fsdp(lib: Any, module: nn.Module, **kwargs: Any) -> nn.Module:
    if lib is torch_fsdp:
        kwargs["device_id"] = torch.device("cpu")
        if "cpu_offload" in kwargs:  # CPU offload breaks torch's forward on CPU: its nearest is no offload
            kwargs["cpu_offload"] = torch_fsdp.CPUOffload(offload_params=False)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return lib.FullyShardedDataParallel(module, **kwargs)


# torch's test models (common_fsdp / test_fsdp_state_dict.py), built from either library.


def _simple(lib: Any, checkpoint_wrap: bool = False, **kwargs: Any) -> nn.Module:
    lin: nn.Module = nn.Linear(10, 10, bias=False)
    return _fsdp(lib, checkpoint_wrapper(lin) if checkpoint_wrap else lin, **kwargs)


def _nested(lib: Any, checkpoint_wrap: bool = False, **kwargs: Any) -> nn.Module:
    lin1: nn.Module = nn.Linear(10, 10, bias=False)
    lin2: nn.Module = nn.Linear(10, 10, bias=False)
    if checkpoint_wrap:
        lin1, lin2 = checkpoint_wrapper(lin1), checkpoint_wrapper(lin2)
    seq: nn.Module = nn.Sequential(_fsdp(lib, lin1, **kwargs), lin2)
    return _fsdp(lib, checkpoint_wrapper(seq) if checkpoint_wrap else seq, **kwargs)


class _Container(nn.Module):
    """A root that is not FSDP: a plain layer, then two nested FSDP models."""

    def __init__(self, lib: Any, **kwargs: Any) -> None:
        super().__init__()
        self.non_fsdp_lin = nn.Linear(10, 10, bias=False)
        self.fsdp_1 = _nested(lib, **kwargs)
        self.fsdp_2 = _nested(lib, **kwargs)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fsdp_2(self.fsdp_1(self.non_fsdp_lin(x)))


def _non_fsdp_root(lib: Any, **kwargs: Any) -> nn.Module:
    return _Container(lib, **kwargs)


def _state_dict_type(lib: Any, model: nn.Module, kind: str, rank0_only_and_offload: bool) -> Any:
    """torch's test's `_get_state_dict_mgr`."""
    offload = rank0_only_and_offload
    if kind == "FULL_STATE_DICT":
        # torch's FULL offload_to_cpu=True breaks on CPU (FSDP1_FACTS CPU bug 1): its oracle runs rank0_only alone.
        config = lib.FullStateDictConfig(rank0_only=offload, offload_to_cpu=offload and lib is fsdp_legacy)
    elif kind == "SHARDED_STATE_DICT":
        config = lib.ShardedStateDictConfig(offload_to_cpu=offload)
    else:
        config = lib.LocalStateDictConfig(offload_to_cpu=offload)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return lib.FullyShardedDataParallel.state_dict_type(model, lib.StateDictType[kind], config)


def _summoned(lib: Any, model: nn.Module) -> list[tuple[str, torch.Tensor]]:
    with lib.FullyShardedDataParallel.summon_full_params(model):
        return [(name, param.detach().clone()) for name, param in model.named_parameters()]


def _zero(lib: Any, model: nn.Module) -> None:
    with lib.FullyShardedDataParallel.summon_full_params(model), torch.no_grad():
        for param in model.parameters():
            param.zero_()


def _broadcast(state: dict) -> dict:
    """torch's test's `_broadcast_state_dict`: rank 0's (rank0_only) state dict to every rank."""
    box = [state if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(box)
    return box[0]


def _assert_same(ours: Any, theirs: Any, what: str) -> None:
    """Equal observations: the same structure, names and dtypes; tensors equal in value."""
    if isinstance(theirs, torch.Tensor):
        assert isinstance(ours, torch.Tensor), what
        assert ours.dtype == theirs.dtype, f"{what}: {ours.dtype} != {theirs.dtype}"
        assert_close(ours, theirs, what)
    elif isinstance(theirs, dict):
        assert list(ours) == list(theirs), f"{what}: keys {list(ours)} != {list(theirs)}"
        for key in theirs:
            _assert_same(ours[key], theirs[key], f"{what}[{key}]")
    elif isinstance(theirs, (list, tuple)):
        assert len(ours) == len(theirs), f"{what}: {len(ours)} entries != {len(theirs)}: {ours} vs {theirs}"
        for index, (mine, expected) in enumerate(zip(ours, theirs, strict=True)):
            _assert_same(mine, expected, f"{what}[{index}]")
    else:
        assert ours == theirs, f"{what}: {ours!r} != {theirs!r}"


# --------------------------------------------------------------------------------------------------------------------
# Part 7: checkpoint wrappers on the source, the destination, or both (before or after wrapping)


def _ac_linears(model: nn.Module) -> None:
    wrapper = functools.partial(checkpoint_wrapper, checkpoint_impl=CheckpointImpl.NO_REENTRANT)
    apply_activation_checkpointing(model, checkpoint_wrapper_fn=wrapper, check_fn=lambda m: isinstance(m, nn.Linear))


def _ac_round_trip(lib: Any, kind: str, wrap: str, rank0_only_and_offload: bool) -> list[dict]:
    """torch's test_fsdp_state_dict_with_activation_checkpoint on `lib`: what it observes, per model."""
    observed = []
    for index, build in enumerate((_simple, _nested)):
        torch.manual_seed(index)
        model = build(lib, checkpoint_wrap=wrap in ("source", "both"))
        if wrap in ("source_after_wrap", "both_after_wrap"):
            _ac_linears(model)
        with _state_dict_type(lib, model, kind, rank0_only_and_offload):
            saved = model.state_dict()
            devices = sorted({str(value.device) for value in saved.values()})
            state = _gather_state_dict(saved)
            torch.manual_seed(100 + index)
            model_new = build(lib, checkpoint_wrap=wrap in ("dest", "both"))
            if wrap == "both_after_wrap":
                _ac_linears(model_new)
            _zero(lib, model_new)
            source, destination = _summoned(lib, model), _summoned(lib, model_new)
            if rank0_only_and_offload:
                state = _broadcast(state)
            result = model_new.load_state_dict(state, strict=True)
            loaded = _summoned(lib, model_new)
        observed.append(
            {
                "saved keys": list(saved),
                "saved devices": devices,
                "parameters in summon_full_params (source)": [name for name, _ in source],
                "parameters in summon_full_params (destination)": [name for name, _ in destination],
                "incompatible keys": (list(result.missing_keys), list(result.unexpected_keys)),
                "parameters after loading": [name for name, _ in model_new.named_parameters()],
                "loaded values": [value for _, value in loaded],
                "loaded equals source": all(torch.equal(a, b) for (_, a), (_, b) in zip(source, loaded, strict=True)),
            }
        )
        model_new(torch.randn(3, 10)).sum().backward()  # still trains
    return observed


def _ac_round_trip_matches_torch(kind: str, wrap: str, rank0_only_and_offload: bool) -> None:
    ours = _ac_round_trip(fsdp_legacy, kind, wrap, rank0_only_and_offload)
    theirs = _ac_round_trip(torch_fsdp, kind, wrap, rank0_only_and_offload)
    for mine in ours:
        assert mine["loaded equals source"], "the checkpoint loaded"
        if rank0_only_and_offload:
            assert mine["saved devices"] in ([], ["cpu"])
    _assert_same(ours, theirs, f"{kind} {wrap}")


@pytest.mark.parametrize("rank0_only_and_offload", [False, True])
@pytest.mark.parametrize("wrap", WRAPS)
@pytest.mark.parametrize("kind", ["FULL_STATE_DICT", "SHARDED_STATE_DICT"])
def test_checkpoint_wrappers_on_either_side_match_torch(kind: str, wrap: str, rank0_only_and_offload: bool) -> None:
    run_on_ranks(_ac_round_trip_matches_torch, 2, kind, wrap, rank0_only_and_offload)


@pytest.mark.parametrize("world_size", [1, 4])
@pytest.mark.parametrize("wrap", ["dest", "both_after_wrap"])
def test_checkpoint_wrappers_at_one_and_four_ranks_match_torch(world_size: int, wrap: str) -> None:
    for kind in ("FULL_STATE_DICT", "SHARDED_STATE_DICT"):
        run_on_ranks(_ac_round_trip_matches_torch, world_size, kind, wrap, True)


class _SharedParamsTransformer(nn.Module):
    """torch's TransformerWithSharedParams (common_fsdp), without dropout: embedding and output projection tied."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed_tokens = nn.Embedding(23, 16)
        self.transformer = nn.Transformer(16, 2, 2, 2, dim_feedforward=8, dropout=0.0)
        self.output_proj = nn.Linear(16, 23)
        self.output_proj.weight = self.embed_tokens.weight
        self.register_buffer("vocab_bias", self.embed_tokens.weight.new_ones((16,)))

    def forward(self, src: torch.Tensor, tgt: torch.Tensor) -> torch.Tensor:
        x = self.transformer(self.embed_tokens(src) + self.vocab_bias, self.embed_tokens(tgt))
        return self.output_proj(x)


def _manual_ac(lib: Any, kind: str, rank0_only_and_offload: bool) -> dict:
    """torch's test_state_dict_with_manual_ac_wrapper on `lib`: FSDP(checkpoint_wrapper(layer)) by hand."""
    model_ac = _SharedParamsTransformer()
    model_no_ac = copy.deepcopy(model_ac)
    for model, wrapped in ((model_no_ac, False), (model_ac, True)):
        for stack in (model.transformer.encoder.layers, model.transformer.decoder.layers):
            for i, layer in enumerate(stack):
                stack[i] = _fsdp(lib, checkpoint_wrapper(layer) if wrapped else layer)
        model.transformer = _fsdp(lib, model.transformer)
    states = []
    for model in (model_no_ac, model_ac):
        with _state_dict_type(lib, model, kind, rank0_only_and_offload):
            states.append(model.state_dict())
    assert list(states[0]) == list(states[1]), "the same keys with and without the wrappers"
    for model, state in zip((model_no_ac, model_ac), states, strict=True):
        if rank0_only_and_offload:
            state = _broadcast(state)
        with _state_dict_type(lib, model, kind, rank0_only_and_offload):
            result = model.load_state_dict(state)
        assert not result.missing_keys and not result.unexpected_keys
    summoned = [_summoned(lib, model) for model in (model_ac, model_no_ac)]
    assert [v for _, v in summoned[0]] and all(torch.equal(a, b) for (_, a), (_, b) in zip(*summoned, strict=True)), (
        "the two models are equal after loading"
    )
    src, tgt = torch.arange(12).view(6, 2), torch.arange(8).view(4, 2)
    return {
        "keys": list(states[1]),
        "state": _gather_state_dict(states[1]),
        "parameters (checkpointed)": [name for name, _ in summoned[0]],
        "output": model_ac(src, tgt).detach(),
    }


def _manual_ac_matches_torch(kind: str, rank0_only_and_offload: bool) -> None:
    _assert_same(
        _manual_ac(fsdp_legacy, kind, rank0_only_and_offload),
        _manual_ac(torch_fsdp, kind, rank0_only_and_offload),
        "manual checkpoint wrappers",
    )


@pytest.mark.parametrize(
    ("kind", "rank0_only_and_offload"),
    [("FULL_STATE_DICT", False), ("FULL_STATE_DICT", True), ("SHARDED_STATE_DICT", False)],  # as torch's test
)
def test_manual_checkpoint_wrappers_inside_units_match_torch(kind: str, rank0_only_and_offload: bool) -> None:
    run_on_ranks(_manual_ac_matches_torch, 2, kind, rank0_only_and_offload)


# --------------------------------------------------------------------------------------------------------------------
# Part 8: fp16 (model.half() after wrapping) with CPU offload, FULL / SHARDED / LOCAL


def _describe(value: torch.Tensor) -> tuple:
    return type(value).__name__, value.dtype, str(value.device), tuple(value.shape)


def _fp16_round_trip(lib: Any, kind: str, offload: bool, rank0_only_and_offload: bool, use_orig_params: bool) -> list:
    """torch's test_basic_save_and_load_state_dict with fp16=True on `lib`: what it observes, per model."""
    observed = []
    kwargs = {"cpu_offload": lib.CPUOffload(offload_params=offload), "use_orig_params": use_orig_params}
    for index, build in enumerate((_non_fsdp_root, _nested, _simple)):
        torch.manual_seed(index)
        model = build(lib, **kwargs).half()
        inp = torch.randn(3, 10, generator=torch.Generator().manual_seed(dist.get_rank())).half()
        model(inp).sum().backward()
        with _state_dict_type(lib, model, kind, rank0_only_and_offload):
            state = model.half().state_dict()
        entries = {k: _describe(v) for k, v in state.items() if not k.endswith(RECORD_SUFFIX)}
        assert {dtype for _, dtype, _, _ in entries.values()} <= {torch.float16}, entries  # torch's test checks this
        torch.manual_seed(100 + index)
        model_new = build(lib, **kwargs).half()
        model_new(inp).sum().backward()
        _zero(lib, model_new)
        if rank0_only_and_offload:
            state = _broadcast(state)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            with lib.FullyShardedDataParallel.state_dict_type(model_new, lib.StateDictType[kind]):
                model_new.load_state_dict(state, strict=True)
        source, loaded = _summoned(lib, model), _summoned(lib, model_new)
        assert all(torch.equal(a, b) for (_, a), (_, b) in zip(source, loaded, strict=True)), "loaded"
        opt = torch.optim.SGD(model_new.parameters(), lr=0.1)
        losses = []
        for step in range(2):  # fp16 training goes on from the loaded state (offloaded: the step runs on the CPU)
            loss = model_new(inp * (step + 1)).float().pow(2).sum()
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.detach())
        observed.append(
            {
                "entries": entries,
                "summoned": [(name, value.dtype) for name, value in loaded],
                "values": [value for _, value in loaded],
                "losses": losses,
                "trained": [value for _, value in _summoned(lib, model_new)],
            }
        )
    return observed


def _fp16_matches_torch(kind: str, offload: bool, rank0_only_and_offload: bool, use_orig_params: bool) -> None:
    ours = _fp16_round_trip(fsdp_legacy, kind, offload, rank0_only_and_offload, use_orig_params)
    theirs = _fp16_round_trip(torch_fsdp, kind, offload, rank0_only_and_offload, use_orig_params)
    for mine in ours:
        if rank0_only_and_offload and dist.get_rank() == 0:  # ours offloads; torch's oracle cannot on CPU
            assert {device for _, _, device, _ in mine["entries"].values()} == {"cpu"}
        if offload:  # (the CPU is the compute device here too: the same devices as torch's)
            assert {device for _, _, device, _ in mine["entries"].values()} <= {"cpu"}
    _assert_same(ours, theirs, f"fp16 {kind}")


FP16_CASES = [
    (kind, offload, rank0, uop)
    for kind in ("FULL_STATE_DICT", "SHARDED_STATE_DICT", "LOCAL_STATE_DICT")
    for offload in (True, False)
    for rank0 in ((True, False) if kind == "FULL_STATE_DICT" else (False,))  # torch's test: rank0_only is FULL's
    for uop in ((False, True) if kind != "LOCAL_STATE_DICT" else (False,))
]


@pytest.mark.parametrize(("kind", "offload", "rank0_only_and_offload", "use_orig_params"), FP16_CASES)
def test_fp16_state_dicts_with_cpu_offload_match_torch(
    kind: str, offload: bool, rank0_only_and_offload: bool, use_orig_params: bool
) -> None:
    run_on_ranks(_fp16_matches_torch, 2, kind, offload, rank0_only_and_offload, use_orig_params)


def _half_converts_flat_parameters(use_orig_params: bool, offload: bool) -> None:
    """`.half()` after wrapping converts each unit's flat parameter (its local shard, kept on the CPU when
    offloaded); with use_orig_params the original parameters are views of it, as torch's FSDP1 shows them."""
    shown = []
    for lib in (fsdp_legacy, torch_fsdp):
        torch.manual_seed(0)
        model = _nested(lib, cpu_offload=lib.CPUOffload(offload_params=offload), use_orig_params=use_orig_params)
        model.half()
        shown.append([(name, param.dtype, tuple(param.shape)) for name, param in model.named_parameters()])
        if lib is fsdp_legacy:
            for unit in fsdp_legacy.FullyShardedDataParallel.fsdp_modules(model):
                shard = unit._handles[0].local_shard
                assert shard.dtype == torch.float16 and shard.device.type == "cpu"
                if use_orig_params:
                    for param in unit._handles[0].orig_params.values():
                        assert param.untyped_storage().data_ptr() == shard.untyped_storage().data_ptr()
    assert shown[0] == shown[1]


@pytest.mark.parametrize("offload", [False, True])
@pytest.mark.parametrize("use_orig_params", [False, True])
def test_half_after_wrapping_converts_flat_parameters(use_orig_params: bool, offload: bool) -> None:
    run_on_ranks(_half_converts_flat_parameters, 2, use_orig_params, offload)


# --------------------------------------------------------------------------------------------------------------------
# Part 18: activation checkpointing end to end with CPU offload


class _Sequential(nn.Module):
    """torch's TestFSDPCheckpoint.SequentialModule."""

    def __init__(self, lib: Any = None, checkpoint_layer: bool = False, offload_activations: bool = False, **kwargs):
        torch.manual_seed(0)
        super().__init__()
        layers: list[nn.Module] = [nn.Linear(3, 3) for _ in range(3)]
        if checkpoint_layer:
            layers = [(offload_wrapper if offload_activations else checkpoint_wrapper)(layer) for layer in layers]
        if lib is not None:
            layers = [_fsdp(lib, layer, **kwargs) for layer in layers]
        self.ffn = nn.Sequential(*layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.ffn(x)


def _run(models_: list[nn.Module], steps: int, reentrant_last: bool = False) -> list[list]:
    """Forward/backward of each model on the same input (gradients accumulate): per step, per model, the loss, the
    output and the gradients."""
    inp = torch.randn(10, 3, generator=torch.Generator().manual_seed(dist.get_rank()), requires_grad=True)
    observed = []
    for _ in range(steps):
        for index, model in enumerate(models_):
            if reentrant_last and index == len(models_) - 1:
                out = checkpoint(model, inp, use_reentrant=True)
            else:
                out = model(inp)
            loss = out.sum()
            loss.backward()
            grads = [p.grad.clone() for p in model.parameters() if p.grad is not None]
            observed.append([loss.detach(), out.detach(), grads])
    return observed


def _end_to_end(lib: Any, offload: bool, use_orig_params: bool, offload_activations: bool) -> list[list]:
    """torch's test_basic_checkpoint_end_to_end: FSDP alone, checkpoint_wrapper(FSDP), FSDP(checkpoint_wrapper),
    and FSDP under torch.utils.checkpoint (reentrant); six steps."""
    kwargs = {"cpu_offload": lib.CPUOffload(offload_params=offload), "use_orig_params": use_orig_params}
    wrapper = offload_wrapper if offload_activations else checkpoint_wrapper
    seq = _Sequential()
    models_ = [
        _fsdp(lib, copy.deepcopy(seq), **kwargs),
        wrapper(_fsdp(lib, copy.deepcopy(seq), **kwargs)),
        _fsdp(lib, wrapper(copy.deepcopy(seq)), **kwargs),
        _fsdp(lib, copy.deepcopy(seq), **kwargs),
    ]
    return _run(models_, 6, reentrant_last=True)


def _checkpointed_units(lib: Any, offload: bool, use_orig_params: bool, offload_activations: bool) -> list[list]:
    """torch's test_checkpoint_fsdp_wrapping: checkpoint(FSDP units), FSDP(checkpointed layers), no checkpointing."""
    kwargs = {"cpu_offload": lib.CPUOffload(offload_params=offload), "use_orig_params": use_orig_params}
    wrapper = offload_wrapper if offload_activations else checkpoint_wrapper
    models_ = [
        wrapper(_Sequential(lib, **kwargs)),
        _Sequential(lib, checkpoint_layer=True, offload_activations=offload_activations, **kwargs),
        _Sequential(lib, **kwargs),
    ]
    return _run(models_, 2)


def _checkpointing_matches_torch(test: str, offload: bool, use_orig_params: bool, offload_activations: bool) -> None:
    run = _end_to_end if test == "end_to_end" else _checkpointed_units
    ours = run(fsdp_legacy, offload, use_orig_params, offload_activations)
    per_step = 4 if test == "end_to_end" else 3
    for index, (loss, out, grads) in enumerate(ours):  # torch's own check: every model equals the first
        reference = ours[index - index % per_step]
        assert_close(loss, reference[0], f"loss {index}")
        assert_close(out, reference[1], f"output {index}")
        _assert_same(grads, reference[2], f"gradients {index}")
    _assert_same(ours, run(torch_fsdp, offload, use_orig_params, offload_activations), test)


@pytest.mark.parametrize("offload_activations", [False, True])
@pytest.mark.parametrize("use_orig_params", [False, True])
@pytest.mark.parametrize("offload", [True, False])
@pytest.mark.parametrize("test", ["end_to_end", "checkpointed_units"])
def test_activation_checkpointing_with_cpu_offload_matches_torch(
    test: str, offload: bool, use_orig_params: bool, offload_activations: bool
) -> None:
    run_on_ranks(_checkpointing_matches_torch, 2, test, offload, use_orig_params, offload_activations)


def test_activation_checkpointing_with_cpu_offload_at_one_and_four_ranks() -> None:
    for world_size in (1, 4):
        run_on_ranks(_checkpointing_matches_torch, world_size, "end_to_end", True, False, False)


def _training(lib: Any, checkpointed: bool, offload: bool) -> tuple[list, list]:
    """The transformer with one FSDP unit per block, blocks checkpointed inside their units or not, SGD steps."""
    torch.manual_seed(0)
    model = models.Transformer()
    if checkpointed:
        for i, block in enumerate(model.blocks):
            model.blocks[i] = checkpoint_wrapper(block, checkpoint_impl=CheckpointImpl.NO_REENTRANT)
    wrap = fsdp_legacy.wrap if lib is fsdp_legacy else torch_fsdp.wrap
    policy = wrap.ModuleWrapPolicy({models.TransformerBlock})
    model = _fsdp(lib, model, auto_wrap_policy=policy, cpu_offload=lib.CPUOffload(offload_params=offload))
    opt = optimizer(model)
    config = Config("transformer")
    losses = []
    for step in range(4):
        loss = loss_of(model(batch(config, step)))
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.detach())
    return losses, [(name.replace("_checkpoint_wrapped_module.", ""), value) for name, value in _summoned(lib, model)]


def _checkpointed_blocks_train_as_without() -> None:
    baseline = _training(fsdp_legacy, checkpointed=False, offload=False)
    for lib, checkpointed, offload in ((fsdp_legacy, True, True), (fsdp_legacy, False, True), (torch_fsdp, True, True)):
        _assert_same(_training(lib, checkpointed, offload), baseline, f"{lib.__name__} checkpointed={checkpointed}")


def test_checkpointed_blocks_inside_offloaded_units_train_as_without_checkpointing() -> None:
    run_on_ranks(_checkpointed_blocks_train_as_without, 2)


class _WithIgnored(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.first = nn.Linear(4, 4)
        self.mixed = nn.Linear(4, 4)
        self.mixed.extra = nn.Parameter(torch.randn(4))  # ignored: between managed parameters of one module
        self.mixed.register_parameter("weight", self.mixed._parameters.pop("weight"))  # after it
        self.tied = nn.Linear(4, 4)
        self.tied.other = nn.Parameter(torch.randn(4))  # ignored too
        self.tied.bias = self.mixed.bias  # a second reference to a managed parameter, before an ignored one
        self.tied.register_parameter("other", self.tied._parameters.pop("other"))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.tied(self.mixed(self.first(x)) + self.mixed.extra) + self.tied.other


def _half_keeps_parameter_order(use_orig_params: bool) -> None:
    """Parameters FSDP does not manage are converted as nn.Module converts them, and the parameters are listed in
    torch's FSDP1's order, before and after: with use_orig_params each module's managed parameters behind its
    ignored ones (torch's construction registers them again), tied references last."""
    shown = []
    for lib in (fsdp_legacy, torch_fsdp):
        torch.manual_seed(0)
        model = _WithIgnored()
        ignored = [model.mixed.extra, model.tied.other]
        model = _fsdp(lib, model, use_orig_params=use_orig_params, ignored_states=ignored)
        before = [name for name, _ in model.named_parameters(remove_duplicate=False)]
        model.half()
        after = [(n, p.dtype, tuple(p.shape)) for n, p in model.named_parameters(remove_duplicate=False)]
        assert [name for name, _, _ in after] == before, f"{lib.__name__}: the order changed"
        keys = list(model.state_dict().keys())
        out = model(torch.randn(2, 4, generator=torch.Generator().manual_seed(dist.get_rank())).half())
        shown.append((after, keys, out.detach()))
    _assert_same(shown[0], shown[1], "after .half()")


@pytest.mark.parametrize("use_orig_params", [False, True])
def test_half_keeps_parameter_order_and_converts_ignored_parameters(use_orig_params: bool) -> None:
    run_on_ranks(_half_keeps_parameter_order, 2, use_orig_params)
