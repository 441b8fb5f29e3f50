"""torch.compile over a wrapped model: the whole FSDP model compiled trains exactly as torch's FSDP1 under the same
compile, with no more graph breaks, graphs that cover the wrapped blocks' code, and nothing of our runtime traced.

Each case runs ours and torch's FSDP1 one after the other in the same rank processes, Dynamo reset in between (the
blocks' code is shared, so a graph compiled for one would otherwise serve the other), and compares losses, outputs
and full parameters. Inductor's on-disk cache makes the second and later compiles of the same graph cheap.
"""

import contextlib
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch._dynamo.utils import counters

from fsdp_utils import assert_close
from harness import run_on_ranks


class Attention(nn.Module):
    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(b, t, d))


class Block(nn.Module):
    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(d)
        self.attn = Attention(d, heads)
        self.ln2 = nn.LayerNorm(d)
        self.fc = nn.Linear(d, 4 * d)
        self.out = nn.Linear(4 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class GPT(nn.Module):
    """Embeddings, blocks (the FSDP units), final norm and a head tied to the token embedding: the issue's model."""

    vocab = 32

    def __init__(self, d: int = 32, heads: int = 2, layers: int = 2) -> None:
        super().__init__()
        self.tok = nn.Embedding(self.vocab, d)
        self.pos = nn.Embedding(16, d)
        self.blocks = nn.ModuleList(Block(d, heads) for _ in range(layers))
        self.norm = nn.LayerNorm(d)
        self.head = nn.Linear(d, self.vocab, bias=False)
        self.head.weight = self.tok.weight
        for module in (self.tok, self.pos):  # GPT-2's scale: losses near log(vocab), steps that stay small
            nn.init.normal_(module.weight, std=0.02)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.tok(idx) + self.pos(torch.arange(idx.shape[1]))
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.norm(x))
        return F.cross_entropy(logits.float().flatten(0, 1), idx.roll(-1, 1).flatten())


def tokens(step: int, seq: int = 8) -> torch.Tensor:
    """Different data on every rank and step."""
    generator = torch.Generator().manual_seed(1000 * step + dist.get_rank())
    return torch.randint(GPT.vocab, (2, seq), generator=generator)


@dataclass(frozen=True)
class Case:
    strategy: str = "FULL_SHARD"
    use_orig_params: bool = True
    mixed_precision: str | None = None  # param and reduce dtype
    offload: bool = False
    backward_prefetch: str | None = "BACKWARD_PRE"
    forward_prefetch: bool = False
    no_sync: bool = False  # accumulate one step's gradient under no_sync()
    recompile: bool = False  # switch to eval and to a new sequence length in between
    steps: int = 3
    backend: str = "inductor"

    def name(self) -> str:
        parts = [self.strategy, "uop" if self.use_orig_params else "flat", self.mixed_precision or ""]
        parts += [
            "offload" if self.offload else "",
            str(self.backward_prefetch),
            "fwdpf" if self.forward_prefetch else "",
        ]
        parts += ["nosync" if self.no_sync else "", "recompile" if self.recompile else "", self.backend]
        return "_".join(p for p in parts if p)


def _build(case: Case, ours: bool, before_wrap: Callable[[nn.Module], None] | None = None) -> nn.Module:
    if ours:
        import fsdp_legacy as fsdp
        from fsdp_legacy.wrap import ModuleWrapPolicy

        extra: dict[str, Any] = {}
    else:
        import torch.distributed.fsdp as fsdp  # type: ignore[no-redef]
        from torch.distributed.fsdp.wrap import ModuleWrapPolicy  # type: ignore[no-redef,assignment]

        extra = {"device_id": torch.device("cpu")}
    torch.manual_seed(0)
    model = GPT()
    if before_wrap is not None:
        before_wrap(model)
    if case.mixed_precision is not None:
        dtype = getattr(torch, case.mixed_precision)
        extra["mixed_precision"] = fsdp.MixedPrecision(param_dtype=dtype, reduce_dtype=dtype)
    if case.offload:
        extra["cpu_offload"] = fsdp.CPUOffload(offload_params=True)
    if case.strategy.startswith("HYBRID"):  # replicate over "nodes" of two ranks (one node below 4 ranks)
        world = dist.get_world_size()
        extra["device_mesh"] = dist.device_mesh.init_device_mesh("cpu", (world // 2, 2) if world >= 4 else (1, world))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return fsdp.FullyShardedDataParallel(
            model,
            auto_wrap_policy=ModuleWrapPolicy({Block}),
            sharding_strategy=fsdp.ShardingStrategy[case.strategy],
            use_orig_params=case.use_orig_params,
            backward_prefetch=fsdp.BackwardPrefetch[case.backward_prefetch] if case.backward_prefetch else None,
            forward_prefetch=case.forward_prefetch,
            **extra,
        )


@dataclass
class Run:
    model: nn.Module
    optimizer: torch.optim.Optimizer
    losses: list[torch.Tensor]
    outputs: list[torch.Tensor]  # eval forwards, gradient norms
    params: dict[str, torch.Tensor]  # full parameters by clean name after training
    graph_breaks: int
    graphs: int
    ops_captured: int


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield


def _full_params(model: nn.Module, ours: bool) -> dict[str, torch.Tensor]:
    if ours:
        from fsdp_legacy import FullyShardedDataParallel as FSDP
    else:
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP  # type: ignore[assignment]
    with FSDP.summon_full_params(model):
        return {n.replace("_fsdp_wrapped_module.", ""): p.detach().clone() for n, p in model.named_parameters()}


def _sgd(model: nn.Module) -> torch.optim.Optimizer:
    # SGD with momentum, the FSDP1 parity recipe: Adam would turn the round-off in gradients that are zero in exact
    # arithmetic (the key bias's) into whole steps, and compiled vs eager could then not be compared.
    return torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)


def _train(
    case: Case,
    ours: bool,
    compiled: bool = True,
    after_wrap: Callable[[nn.Module], None] | None = None,
    after_backward: Callable[[nn.Module], torch.Tensor] | None = None,
    backend: Any = None,
    **build: Any,
) -> Run:
    torch._dynamo.reset()
    counters.clear()
    model = _build(case, ours, **build)
    if after_wrap is not None:
        after_wrap(model)
    runner = torch.compile(model, backend=backend or case.backend) if compiled else model
    optimizer = _sgd(model)
    losses, outputs = [], []
    for step in range(case.steps):
        with _quiet():
            if case.no_sync and step % 2 == 0:
                with model.no_sync():
                    runner(tokens(100 + step)).backward()
            loss = runner(tokens(step))
            loss.backward()
        if after_backward is not None:
            outputs.append(after_backward(model))
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.detach())
        if case.recompile and step == 0:
            model.eval()
            with torch.no_grad(), _quiet():
                outputs.append(runner(tokens(50)))
            model.train()
            with _quiet():
                runner(tokens(60, seq=12)).backward()  # a new sequence length: a recompile (dynamic shapes)
            optimizer.step()
            optimizer.zero_grad()
    return Run(
        model,
        optimizer,
        losses,
        outputs,
        _full_params(model, ours),
        sum(counters["graph_break"].values()),
        counters["stats"]["unique_graphs"],
        counters["stats"]["calls_captured"],
    )


def _compare(ours: Run, theirs: Run, what: str, exact: bool = True, low_precision: bool = False) -> None:
    tolerance = {"atol": 0.0, "rtol": 0.0}
    if not exact:  # inductor fuses (and computes low-precision ops in fp32): round-off differs from eager's
        tolerance = {"atol": 1e-2, "rtol": 1e-2} if low_precision else {"atol": 1e-5, "rtol": 1e-4}
    for step, (a, b) in enumerate(zip(ours.losses, theirs.losses, strict=True)):
        assert_close(a, b, f"{what}: loss at step {step}", **tolerance)
    for index, (a, b) in enumerate(zip(ours.outputs, theirs.outputs, strict=True)):
        assert_close(a, b, f"{what}: eval output {index}", **tolerance)
    assert ours.params.keys() == theirs.params.keys()
    for name, param in theirs.params.items():
        assert_close(ours.params[name], param, f"{what}: parameter {name}", **tolerance)


def _parity_with_torch(case: Case) -> dict[str, int]:
    ours = _train(case, ours=True)
    # torch's FSDP1 cannot offload on a machine without an accelerator (it pins memory); offloading changes no value.
    theirs = _train(replace(case, offload=False), ours=False)
    # Both compile the same graphs of the same user code with the same inputs: the same bits.
    _compare(ours, theirs, "ours vs torch's FSDP1, both compiled")
    assert ours.graph_breaks <= theirs.graph_breaks, (ours.graph_breaks, theirs.graph_breaks)
    if case.use_orig_params:
        # Our graphs cover at least the code torch's do: the blocks' forward (the root's loop runs eagerly in both).
        assert ours.graphs >= 1 and ours.ops_captured >= theirs.ops_captured, (ours, theirs)
    else:  # Dynamo refuses FSDP-managed modules with use_orig_params=False: those frames run eagerly, as torch's
        assert ours.graphs == theirs.graphs == 0
    eager = _train(case, ours=True, compiled=False)
    _compare(ours, eager, "compiled vs eager", exact=False, low_precision=case.mixed_precision is not None)
    return {"graph_breaks": ours.graph_breaks, "torch_graph_breaks": theirs.graph_breaks}


CASES = [
    (Case(), 2),
    (Case(recompile=True), 2),
    (Case(mixed_precision="bfloat16"), 2),
    (Case(mixed_precision="float16", strategy="SHARD_GRAD_OP", forward_prefetch=True), 2),
    (Case(strategy="SHARD_GRAD_OP", backward_prefetch="BACKWARD_POST", no_sync=True), 2),
    (Case(strategy="NO_SHARD", recompile=True), 2),
    (Case(strategy="HYBRID_SHARD"), 2),
    (Case(strategy="HYBRID_SHARD", no_sync=True), 4),
    (Case(offload=True, no_sync=True), 2),
    (Case(use_orig_params=False), 2),
    (Case(), 1),
    (Case(strategy="SHARD_GRAD_OP", mixed_precision="bfloat16", recompile=True), 4),
]


@pytest.mark.heavy  # the compile matrix, 12 inductor builds: CI runs it after the README's tests (pytest -m heavy)
@pytest.mark.parametrize("case,world_size", CASES, ids=[f"{c.name()}_w{w}" for c, w in CASES])
def test_compiled_model_matches_torch_fsdp1(case: Case, world_size: int) -> None:
    run_on_ranks(_parity_with_torch, world_size, case, timeout=600)


# ---------------------------------------------------------------------------------------------------------------------
# What Dynamo sees


def _graphs_cover_blocks_only() -> None:
    from torch._inductor.compile_fx import compile_fx

    graphs: list[torch.fx.GraphModule] = []

    def recording(gm: torch.fx.GraphModule, example_inputs: list) -> Callable:
        graphs.append(gm)
        return compile_fx(gm, example_inputs)

    _train(Case(steps=2), ours=True, backend=recording)
    traces = [node.meta.get("stack_trace") or "" for gm in graphs for node in gm.graph.nodes]
    runtime = [trace for trace in traces if "fsdp_legacy" in trace]
    assert not runtime, f"our runtime was traced into a graph:\n{runtime[0]}"
    covered = {line for trace in traces for line in trace.splitlines() if "in forward" in line}
    for code in ("x = x + self.attn(self.ln1(x))", "F.scaled_dot_product_attention", "F.gelu(self.fc"):
        assert any(code in line or code in trace for trace in traces for line in covered), f"no graph holds {code}"


@pytest.mark.heavy  # inductor builds, about 35 s: CI runs it after the README's tests (pytest -m heavy)
def test_graphs_hold_the_blocks_code_and_nothing_of_the_runtime() -> None:
    run_on_ranks(_graphs_cover_blocks_only, 2, timeout=600)


def _fullgraph_names_the_fix() -> None:
    torch._dynamo.reset()
    model = _build(Case(), ours=True)
    with pytest.raises(Exception, match="FSDP unit's forward runs its all-gathers.*Compile without fullgraph=True"):
        torch.compile(model, fullgraph=True)(tokens(0))
    assert model(tokens(0)).isfinite()  # and the model still works (nothing half-done)


def test_fullgraph_is_refused_with_the_fix_on_every_rank() -> None:
    """A whole graph cannot hold the runtime's collectives: Dynamo's error carries our reason on every rank (torch's
    FSDP1 fails there too), before any collective, so no rank hangs."""
    run_on_ranks(_fullgraph_names_the_fix, 2, timeout=300)


# ---------------------------------------------------------------------------------------------------------------------
# FSDP features on a compiled model, against torch's FSDP1 under the same compile


def _compile_blocks(model: nn.Module) -> None:
    for block in model.blocks:
        block.compile()


def _checkpoint_blocks(model: nn.Module) -> None:
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import apply_activation_checkpointing

    apply_activation_checkpointing(model, check_fn=lambda module: isinstance(module, Block))


def _clip(model: nn.Module) -> torch.Tensor:
    return model.clip_grad_norm_(0.5)


FEATURES: dict[str, dict[str, Any]] = {
    "blocks_compiled_before_wrapping": {"before_wrap": _compile_blocks, "compiled": False},
    "activation_checkpointing_then_compile": {"after_wrap": _checkpoint_blocks},
    "clip_grad_norm": {"after_backward": _clip},
}


def _feature_like_torch(feature: str, case: Case) -> None:
    ours = _train(case, ours=True, **FEATURES[feature])
    theirs = _train(case, ours=False, **FEATURES[feature])
    # The gradient norm sums the same squares in another order than torch's: equal within round-off, not bit for bit.
    _compare(ours, theirs, f"{feature}: ours vs torch's FSDP1", exact=feature != "clip_grad_norm")
    assert ours.graph_breaks <= theirs.graph_breaks


@pytest.mark.parametrize(  # activation checkpointing recompiles every block: about 12 s, heavy
    "feature",
    [
        pytest.param(f, marks=pytest.mark.heavy) if f == "activation_checkpointing_then_compile" else f
        for f in sorted(FEATURES)
    ],
)
def test_feature_on_compiled_model_matches_torch_fsdp1(feature: str) -> None:
    run_on_ranks(_feature_like_torch, 2, feature, Case(), timeout=600)


def _state_dicts_like_torch(use_orig_params: bool) -> None:
    """After compiled training, the model (FULL, SHARDED) and optimizer state dicts hold torch's values; a new
    compiled model loaded from them (FULL, SHARDED, LOCAL), with the optimizer state, steps exactly as the original."""
    import torch.distributed.fsdp as torch_fsdp

    import fsdp_legacy

    FSDP, TorchFSDP = fsdp_legacy.FullyShardedDataParallel, torch_fsdp.FullyShardedDataParallel
    case = Case(use_orig_params=use_orig_params, steps=2)
    ours, theirs = _train(case, ours=True), _train(case, ours=False)
    for kind in ("FULL_STATE_DICT", "SHARDED_STATE_DICT"):
        with FSDP.state_dict_type(ours.model, fsdp_legacy.StateDictType[kind]):
            our_dict = ours.model.state_dict()
        with TorchFSDP.state_dict_type(theirs.model, torch_fsdp.StateDictType[kind]):
            their_dict = theirs.model.state_dict()
        assert our_dict.keys() == their_dict.keys(), kind
        for key, value in their_dict.items():
            mine = our_dict[key]
            if kind == "SHARDED_STATE_DICT":
                mine, value = mine.local_tensor(), value.local_tensor()
            assert torch.equal(mine, value), f"{kind} {key}"
    our_optim = FSDP.optim_state_dict(ours.model, ours.optimizer)
    their_optim = TorchFSDP.optim_state_dict(theirs.model, theirs.optimizer)
    assert our_optim["state"].keys() == their_optim["state"].keys()
    for key, state in their_optim["state"].items():
        assert torch.equal(our_optim["state"][key]["momentum_buffer"], state["momentum_buffer"]), key

    reloaded = []
    for kind in ("FULL_STATE_DICT", "SHARDED_STATE_DICT", "LOCAL_STATE_DICT"):
        with FSDP.state_dict_type(ours.model, fsdp_legacy.StateDictType[kind]):
            model_state = ours.model.state_dict()
            model = _build(case, ours=True)
            with FSDP.state_dict_type(model, fsdp_legacy.StateDictType[kind]):
                model.load_state_dict(model_state)
        optimizer = _sgd(model)
        optimizer.load_state_dict(FSDP.optim_state_dict_to_load(model, optimizer, our_optim))
        reloaded.append((kind, model, optimizer))
    expected = _compiled_step(ours.model, ours.optimizer)
    for kind, model, optimizer in reloaded:
        assert torch.equal(_compiled_step(model, optimizer), expected), f"after reloading through {kind}"


def _compiled_step(model: nn.Module, optimizer: torch.optim.Optimizer) -> torch.Tensor:
    """One more compiled training step; every full parameter after it, concatenated."""
    from fsdp_legacy import FullyShardedDataParallel as FSDP

    torch._dynamo.reset()
    torch.compile(model)(tokens(7)).backward()
    optimizer.step()
    with FSDP.summon_full_params(model):
        return torch.cat([p.detach().flatten() for p in model.parameters()])


@pytest.mark.parametrize("use_orig_params", [True, False], ids=["uop", "flat"])
def test_state_dicts_of_compiled_model(use_orig_params: bool) -> None:
    run_on_ranks(_state_dicts_like_torch, 2, use_orig_params, timeout=600)


def _mixed_dtype_units_compiled(use_orig_params: bool) -> None:
    """QLoRA-style units (packed uint8 weights of a Parameter subclass, scales, trainable adapters; one flat parameter
    per dtype) compiled: the same losses and adapters as the same model eager (which test_mixed_dtype holds equal to
    DDP), the packed weights untouched."""
    import fsdp_legacy
    from fsdp_legacy.wrap import ModuleWrapPolicy
    from mixed_dtype_models import QLoRABlock, QLoRANet

    kwargs = {} if use_orig_params else {"scale_dtype": torch.bfloat16}
    runs = []
    for compiled in (True, False):
        torch._dynamo.reset()
        torch.manual_seed(0)
        with _quiet():
            model = fsdp_legacy.FullyShardedDataParallel(
                QLoRANet(**kwargs), auto_wrap_policy=ModuleWrapPolicy({QLoRABlock}), use_orig_params=use_orig_params
            )
        runner = torch.compile(model) if compiled else model
        optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.05, momentum=0.9)
        losses = []
        for step in range(3):
            loss = runner(QLoRANet.batch(100 * step + dist.get_rank())).pow(2).mean()
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            losses.append(loss.detach())
        runs.append((losses, _full_params(model, ours=True)))
    (compiled_losses, compiled_params), (eager_losses, eager_params) = runs
    for step, (a, b) in enumerate(zip(compiled_losses, eager_losses, strict=True)):
        assert_close(a, b, f"loss at step {step}", atol=1e-5, rtol=1e-4)
    for name, param in eager_params.items():
        if param.dtype == torch.uint8:
            assert torch.equal(compiled_params[name], param), name
        else:
            assert_close(compiled_params[name], param, name, atol=1e-5, rtol=1e-4)


@pytest.mark.heavy  # inductor builds, about 15 s: CI runs it after the README's tests (pytest -m heavy)
@pytest.mark.parametrize("use_orig_params", [True, False], ids=["uop", "flat"])
def test_units_that_mix_dtypes_compile(use_orig_params: bool) -> None:
    run_on_ranks(_mixed_dtype_units_compiled, 2, use_orig_params, timeout=600)


def test_switch_during_dynamos_own_import() -> None:
    """torch._dynamo's import imports torch.distributed.fsdp, and so, under FSDP_LEGACY=1, fsdp_legacy: which must not
    need torch._dynamo then (the CI failure of Lightning's run: "partially initialized module 'torch._dynamo'")."""
    import os
    import subprocess
    import sys

    code = (
        "import torch._dynamo, torch.distributed.fsdp as f, fsdp_legacy; "
        "assert f.FullyShardedDataParallel is fsdp_legacy.FullyShardedDataParallel"
    )
    env = {**os.environ, "FSDP_LEGACY": "1"}
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
