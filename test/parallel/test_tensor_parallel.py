"""FSDP1 with tensor parallelism (torch's 2-D recipe): DTensor parameters on mesh["tp"], FSDP over mesh["dp"].

Oracles: torch's FSDP1 on the same TP model (losses, local shards and gradients, summon_full_params, state-dict
formats) and an unsharded plain model trained on every data-parallel rank's batch (parameters, clip_grad_norm_'s
total norm, optimizer state resumed from a checkpoint), on 4 gloo ranks: dp x tp = 2 x 2, 1 x 4 and 4 x 1.
"""

import warnings

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.distributed.fsdp as torch_fsdp
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

import fsdp_legacy
from fsdp_legacy import FullyShardedDataParallel as FSDP
from fsdp_legacy import StateDictType
from fsdp_legacy.wrap import ModuleWrapPolicy
from harness import run_on_ranks

D, H = 8, 12  # H splits evenly over tp = 2 and 4


class Block(nn.Module):
    """An MLP block: `up` column-parallel, `down` row-parallel, `norm` plain (replicated over tp)."""

    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(D)
        self.up = nn.Linear(D, H)
        self.down = nn.Linear(H, D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.relu(self.up(self.norm(x))))


class Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(4, D)
        self.blocks = nn.ModuleList([Block(), Block()])
        self.out = nn.Linear(D, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.inp(x)
        for block in self.blocks:
            x = block(x)
        return self.out(x)


def _mesh(dp: int, tp: int):
    return init_device_mesh("cpu", (dp, tp), mesh_dim_names=("dp", "tp"))


def _build(which: str, mesh, strategy: str = "FULL_SHARD", uop: bool = True, mp: bool = False, seed: int = 0):
    """Our FSDP ("ours") or torch's ("torch") over mesh["dp"] of the TP model, or the plain model ("plain")."""
    torch.manual_seed(seed)
    model = Model()
    if which == "plain":
        return model
    for block in model.blocks:
        parallelize_module(block, mesh["tp"], {"up": ColwiseParallel(), "down": RowwiseParallel()})
    api = fsdp_legacy if which == "ours" else torch_fsdp
    kwargs = dict(
        device_mesh=mesh["dp"],
        use_orig_params=uop,
        sharding_strategy=api.ShardingStrategy[strategy],
        auto_wrap_policy=(ModuleWrapPolicy if which == "ours" else torch_fsdp.wrap.ModuleWrapPolicy)({Block}),
        mixed_precision=api.MixedPrecision(torch.bfloat16, torch.float32, torch.bfloat16) if mp else None,
    )
    if which == "torch":
        kwargs["device_id"] = torch.device("cpu")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return api.FullyShardedDataParallel(model, **kwargs)


def _batch(step: int, dp_rank: int) -> torch.Tensor:
    """The same data on the tp ranks of one dp rank, different across dp ranks and steps."""
    return torch.randn(3, 4, generator=torch.Generator().manual_seed(1000 * step + dp_rank))


def _loss(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return model(x).pow(2).sum()


def _full(model: nn.Module, summon=FSDP.summon_full_params) -> dict[str, torch.Tensor]:
    """Every parameter whole (DTensors gathered), by clean name, read through `summon` (ours or torch's)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with summon(model):
            return {
                name: (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone()
                for name, p in model.named_parameters()
            }


def _close(actual, expected, what: str, atol: float = 1e-6, rtol: float = 1e-5) -> None:
    torch.testing.assert_close(actual, expected, atol=atol, rtol=rtol, msg=lambda m: f"{what}: {m}")


def _shown(model: nn.Module, summon) -> dict[str, tuple]:
    """What summon_full_params shows: per parameter its type, placements and this rank's local values."""
    with summon(model):
        return {
            # (copies: the gathered storage is freed when the context exits)
            name: (
                type(p).__name__,
                getattr(p, "placements", None),
                (p.to_local() if isinstance(p, DTensor) else p).clone(),
            )
            for name, p in ((n, q.detach()) for n, q in model.named_parameters())
        }


# --------------------------------------------------------------------------------------------------------------------
# Training


def _train(dp: int, tp: int, strategy: str, uop: bool, mp: bool) -> None:
    mesh = _mesh(dp, tp)
    dp_rank, dp_size = mesh["dp"].get_local_rank(), dp
    # torch's FSDP1 + TP fails NO_SHARD with use_orig_params (its writeback sees a shape change): reference only
    with_torch = not ((strategy == "NO_SHARD" or dp == 1) and uop)  # (dp = 1 is NO_SHARD)
    ours, plain = _build("ours", mesh, strategy, uop, mp), _build("plain", mesh)
    theirs = _build("torch", mesh, strategy, uop, mp) if with_torch else plain
    opts = [torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9) for m in (ours, theirs, plain)]
    tol = dict(atol=2e-2, rtol=2e-2) if mp else {}
    ours_losses, their_losses = [], []
    for step in range(3):
        micro = [0, 1] if step == 1 else [0]  # step 1 accumulates a no_sync() micro-batch first
        for model in (ours, theirs) if with_torch else (ours,):
            for m in micro:
                x = _batch(10 * step + m, dp_rank)
                if m == len(micro) - 1:
                    loss = _loss(model, x)
                    loss.backward()
                elif model is ours or not uop:
                    with model.no_sync():
                        _loss(model, x).backward()
                else:  # torch's FSDP1 + TP, use_orig_params: its next forward fails after no_sync(); the same sum
                    _loss(model, x).backward()
            (ours_losses if model is ours else their_losses).append(loss.detach())
        losses = [_loss(plain, _batch(10 * step + m, r)) for m in micro for r in range(dp_size)]
        (sum(losses) / dp_size).backward()
        if not mp:
            _close(ours_losses[-1], losses[len(losses) - dp_size + dp_rank], f"loss at step {step} (reference)")
        if with_torch:
            _close(ours_losses[-1], their_losses[-1], f"loss at step {step} against torch's FSDP1", **tol)
        if step == 2 and with_torch:
            # (torch's FSDP1 with use_orig_params fails in the forward after its summon_full_params: compare last)
            ours_shown = _shown(ours, FSDP.summon_full_params)
            theirs_shown = _shown(theirs, torch_fsdp.FullyShardedDataParallel.summon_full_params)
            assert ours_shown.keys() == theirs_shown.keys()
            for name, (kind, placements, local) in theirs_shown.items():
                assert ours_shown[name][:2] == (kind, placements), f"summon shows {name} as {ours_shown[name][:2]}"
                _close(ours_shown[name][2], local, f"summon_full_params {name}", **tol)
        if step == 2:  # clip: torch's FSDP1 takes the norm over dp only (per tp rank), so only the reference here
            norm = ours.clip_grad_norm_(0.5)
            expected = torch.nn.utils.clip_grad_norm_(plain.parameters(), 0.5)
            _close(norm, expected, "clip_grad_norm_ total norm", **tol)
            opts[0].step(), opts[2].step()
            break
        if not mp and not uop:
            for a, b in zip(
                FSDP.fsdp_modules(ours), torch_fsdp.FullyShardedDataParallel.fsdp_modules(theirs), strict=True
            ):
                _close(a._handle.flat_param.detach(), b._flat_param.detach(), f"local shard at step {step}")
                _close(a._handle.flat_param.grad, b._flat_param.grad, f"sharded gradient at step {step}")
        for opt in opts if with_torch else (opts[0], opts[2]):
            opt.step()
            opt.zero_grad()
    if not mp:  # the fp32 reference is ours' oracle; torch's gave the same losses all along
        for name, value in _full(ours).items():
            _close(value, dict(plain.named_parameters())[name].detach(), f"parameter {name} against the reference")


TRAIN = [(2, 2, s, uop, False) for s in ("FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD") for uop in (True, False)] + [
    (2, 2, "FULL_SHARD", True, True),
    (2, 2, "SHARD_GRAD_OP", False, True),
    (1, 4, "FULL_SHARD", True, False),
    (4, 1, "FULL_SHARD", False, False),
]


@pytest.mark.parametrize(
    "dp,tp,strategy,uop,mp",
    TRAIN,
    ids=[f"{d}x{t}-{s}-{'uop' if u else 'flat'}{'-bf16' if m else ''}" for d, t, s, u, m in TRAIN],
)
def test_training_matches_torch_fsdp1_and_reference(dp: int, tp: int, strategy: str, uop: bool, mp: bool) -> None:
    run_on_ranks(_train, 4, dp, tp, strategy, uop, mp)


# --------------------------------------------------------------------------------------------------------------------
# State dicts


def _describe(value) -> tuple:
    if isinstance(value, DTensor):
        return ("DTensor", tuple(value.placements), tuple(value.device_mesh.mesh.shape), tuple(value.shape))
    return (type(value).__name__, None, None, tuple(value.shape))


def _assert_same_dict(ours: dict, theirs: dict, what: str, values: bool = True) -> None:
    """Same keys, types, placements and shapes as torch's; same local values too if `values`."""
    assert list(ours) == list(theirs), f"{what}: keys {list(ours)} != torch's {list(theirs)}"
    for key, value in theirs.items():
        assert _describe(ours[key]) == _describe(value), f"{what} {key}: {_describe(ours[key])} != {_describe(value)}"
        if not values:
            continue
        local = value.to_local() if isinstance(value, DTensor) else value
        _close(ours[key].to_local() if isinstance(ours[key], DTensor) else ours[key], local, f"{what} {key}")


def _state_dicts(uop: bool, path: str) -> None:
    mesh = _mesh(2, 2)
    dp_rank = mesh["dp"].get_local_rank()
    ours, theirs, plain = _build("ours", mesh, uop=uop), _build("torch", mesh, uop=uop), _build("plain", mesh)
    opts = [torch.optim.Adam(m.parameters(), lr=0.01) for m in (ours, theirs, plain)]
    for step in range(2):
        for model, opt in zip((ours, theirs), opts[:2], strict=True):
            _loss(model, _batch(step, dp_rank)).backward()
            opt.step()
            opt.zero_grad()
        (sum(_loss(plain, _batch(step, r)) for r in range(2)) / 2).backward()
        opts[2].step()
        opts[2].zero_grad()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for kind in ("FULL_STATE_DICT", "SHARDED_STATE_DICT"):
            with FSDP.state_dict_type(ours, StateDictType[kind]):
                our_sd, our_osd = ours.state_dict(), FSDP.optim_state_dict(ours, opts[0])
            with torch_fsdp.FullyShardedDataParallel.state_dict_type(theirs, torch_fsdp.StateDictType[kind]):
                their_sd = theirs.state_dict()
                their_osd = torch_fsdp.FullyShardedDataParallel.optim_state_dict(theirs, opts[1])
            _assert_same_dict(our_sd, their_sd, kind)
            reference = dict(plain.named_parameters())
            for fqn, state in their_osd["state"].items():
                # torch's format; the values against the reference (torch's differ for TP params, use_orig_params)
                _assert_same_dict(our_osd["state"][fqn], state, f"{kind} optimizer state of {fqn}", values=False)
                for name, value in our_osd["state"][fqn].items():
                    whole = value.full_tensor() if isinstance(value, DTensor) else value
                    _close(whole, opts[2].state[reference[fqn]][name], f"{kind} optimizer state {name} of {fqn}")
            _resume(mesh, uop, kind, our_sd, our_osd, plain, opts[2], dp_rank)
        for model, api in ((ours, fsdp_legacy), (theirs, torch_fsdp)):  # LOCAL: refused with a mesh, as torch does
            with pytest.raises(RuntimeError, match="DeviceMesh is not compatible with LOCAL_STATE_DICT"):
                with api.FullyShardedDataParallel.state_dict_type(model, api.StateDictType.LOCAL_STATE_DICT):
                    model.state_dict()
        # DCP: torch's SHARDED checkpoint loads into ours, and ours into torch's
        expected = _full(ours)
        for source, target, api in ((theirs, "ours", fsdp_legacy), (ours, "torch", torch_fsdp)):
            kind = api.StateDictType.SHARDED_STATE_DICT
            with type(source).state_dict_type(source, torch_fsdp.StateDictType.SHARDED_STATE_DICT):
                dcp.save(source.state_dict(), checkpoint_id=f"{path}/{target}")
            fresh = _build(target, mesh, uop=uop, seed=7)
            with api.FullyShardedDataParallel.state_dict_type(fresh, kind):
                state = fresh.state_dict()
                dcp.load(state, checkpoint_id=f"{path}/{target}")
                fresh.load_state_dict(state)
            summon = (FSDP if target == "ours" else torch_fsdp.FullyShardedDataParallel).summon_full_params
            for name, value in _full(fresh, summon).items():
                _close(value, expected[name], f"{name} loaded by {target} from DCP")


def _resume(mesh, uop: bool, kind: str, sd: dict, osd: dict, plain: nn.Module, plain_opt, dp_rank: int) -> None:
    """A fresh model loads the model and optimizer state and takes one more step: equal to the reference's step."""
    fresh = _build("ours", mesh, uop=uop, seed=5)
    opt = torch.optim.Adam(fresh.parameters(), lr=0.01)
    with FSDP.state_dict_type(fresh, StateDictType[kind]):
        fresh.load_state_dict(sd)
        opt.load_state_dict(FSDP.optim_state_dict_to_load(fresh, opt, osd))
    _loss(fresh, _batch(2, dp_rank)).backward()
    opt.step()
    reference = {n: p.detach().clone() for n, p in plain.named_parameters()}
    state = {k: {n: v.clone() for n, v in s.items()} for k, s in plain_opt.state_dict()["state"].items()}
    (sum(_loss(plain, _batch(2, r)) for r in range(2)) / 2).backward()
    plain_opt.step()
    plain_opt.zero_grad()
    for name, value in _full(fresh).items():
        _close(value, dict(plain.named_parameters())[name].detach(), f"{name} after resuming from {kind}")
    with torch.no_grad():  # undo the reference's step: the next kind resumes from the same point
        for name, p in plain.named_parameters():
            p.copy_(reference[name])
        plain_opt.load_state_dict({"state": state, "param_groups": plain_opt.state_dict()["param_groups"]})


@pytest.mark.parametrize("uop", [True, False], ids=["uop", "flat"])
def test_state_dicts_match_torch_and_resume_exactly(tmp_path, uop: bool) -> None:
    run_on_ranks(_state_dicts, 4, uop, str(tmp_path), timeout=240)


def _dcp_other_meshes(path: str) -> None:
    """A SHARDED checkpoint saved at dp x tp = 2 x 2 loads at 1 x 4 and 4 x 1 (DCP reshards the DTensors)."""
    source = _build("ours", _mesh(2, 2), seed=3)
    _loss(source, _batch(0, 0)).backward()  # (parameters that differ from any fresh model's)
    torch.optim.SGD(source.parameters(), lr=0.1).step()
    expected = _full(source)
    with FSDP.state_dict_type(source, StateDictType.SHARDED_STATE_DICT):
        dcp.save(source.state_dict(), checkpoint_id=path)
    for dp, tp, uop in ((1, 4, True), (4, 1, False)):
        target = _build("ours", _mesh(dp, tp), uop=uop, seed=9)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # (dp = 1: NO_SHARD, whose state dicts are FULL)
            with FSDP.state_dict_type(target, StateDictType.SHARDED_STATE_DICT):
                state = target.state_dict()
                dcp.load(state, checkpoint_id=path)
                target.load_state_dict(state)
        for name, value in _full(target).items():
            _close(value, expected[name], f"{name} loaded at {dp} x {tp}")


def test_sharded_checkpoint_loads_at_other_mesh_shapes(tmp_path) -> None:
    run_on_ranks(_dcp_other_meshes, 4, str(tmp_path))


# --------------------------------------------------------------------------------------------------------------------
# Bad input


def _refusals() -> None:
    from torch.distributed.tensor.placement_types import _StridedShard

    mesh = _mesh(2, 2)
    weight = torch.randn(6, 4)
    cases = [
        (lambda: distribute_tensor(weight, mesh["tp"], [Shard(0)]), {}, "without a device_mesh"),
        (lambda: DTensor.from_local(weight, mesh["tp"], [Partial()]), {}, "Partial parameter"),
        (  # (torch's FSDP1 fails on it in backward)
            lambda: DTensor.from_local(weight[:3], mesh["tp"], [_StridedShard(0, split_factor=2)], run_check=False),
            {},
            "Shard.dim. and Rep",
        ),
        (lambda: distribute_tensor(weight, mesh["dp"], [Shard(0)]), {}, "not compatible with FSDP's device_mesh"),
        (lambda: distribute_tensor(weight, mesh, [Replicate(), Shard(0)]), {}, "not compatible with FSDP's device"),
        (
            lambda: distribute_tensor(weight, mesh["tp"], [Shard(0)]),
            {"sharding_strategy": fsdp_legacy.ShardingStrategy.HYBRID_SHARD, "device_mesh": mesh},
            "HYBRID_SHARD",
        ),
    ]
    for index, (make, kwargs, expected) in enumerate(cases):
        module = nn.Module()
        module.weight = nn.Parameter(make())
        kwargs = {"device_mesh": mesh["dp"] if index else None, **kwargs}
        with pytest.raises(ValueError, match=expected) as error:
            FSDP(module, **kwargs)
        assert "Parameter 'weight' of Module is a DTensor" in str(error.value)


def test_bad_dtensor_parameters_are_refused_on_every_rank() -> None:
    run_on_ranks(_refusals, 4)


def _plain_model_layout_unchanged() -> None:
    """A model without DTensors on a sliced mesh trains as before (its layout is torch's)."""
    mesh = _mesh(2, 2)
    torch.manual_seed(0)
    ours = FSDP(Model(), device_mesh=mesh["dp"], auto_wrap_policy=ModuleWrapPolicy({Block}))
    torch.manual_seed(0)
    theirs = torch_fsdp.FullyShardedDataParallel(
        Model(), device_mesh=mesh["dp"], auto_wrap_policy=torch_fsdp.wrap.ModuleWrapPolicy({Block}), device_id="cpu"
    )
    for a, b in zip(FSDP.fsdp_modules(ours), torch_fsdp.FullyShardedDataParallel.fsdp_modules(theirs), strict=True):
        _close(a._handle.flat_param.detach(), b._flat_param.detach(), "local shard")
    with FSDP.state_dict_type(ours, StateDictType.SHARDED_STATE_DICT):
        our_sd = ours.state_dict()
    with torch_fsdp.FullyShardedDataParallel.state_dict_type(theirs, torch_fsdp.StateDictType.SHARDED_STATE_DICT):
        _assert_same_dict(our_sd, theirs.state_dict(), "SHARDED without DTensors")
    dist.barrier()


def test_plain_model_on_a_sliced_mesh_is_torchs() -> None:
    run_on_ranks(_plain_model_layout_unchanged, 4)
