"""The cases of the runtime fuzzer (runtime_fuzz.py): everything one case is, drawn from its seed, as plain data.

A case is a small model (a tree of Linear / LayerNorm / Conv1d / custom leaves with odd numels, optionally an
Embedding whose weight a head shares, frozen leaves, buffers, parameters without elements), an FSDP configuration
and a short program. Drawing is pure Python (random.Random), so a seed names its case on any machine, and the case
pickles to the rank processes as tuples. The draw leaves out what torch's FSDP1 gets wrong on CPU
(FSDP1_FACTS.md): offload_to_cpu state dicts and summons, HYBRID without a mesh (shard groups of one rank), and
CPUOffload(offload_params=True), which only ours runs (torch's runs the case without it, the oracle)."""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Any

LEAF_KINDS = ("linear", "norm", "conv", "scale", "empty")
# The classes a ModuleWrapPolicy may name (runtime_fuzz.py maps the names to classes).
WRAP_CLASSES = ("Block", "Pair", "Linear", "LayerNorm", "ConvLeaf", "Conv1d", "ScaleLeaf", "EmptyLeaf")
STRATEGIES = ("FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD", "HYBRID_SHARD", "_HYBRID_SHARD_ZERO2")
NORM_TYPES = (2.0, 1.0, 3.0, float("inf"))


@dataclass(frozen=True)
class Case:
    seed: int
    hidden: int
    vocab: int | None  # an Embedding in front (integer inputs) when set
    tied: bool  # a head whose weight is the embedding's
    tree: tuple  # ("block", residual, children) | ("pair", a, b) | (leaf kind, frozen, option)
    strategy: str
    use_orig_params: bool
    mixed_precision: tuple | None  # (param, reduce, buffer dtype names or None, keep_low_precision_grads, cast_fwd)
    offload: bool  # CPUOffload(offload_params=True) on ours only
    backward_prefetch: str | None
    forward_prefetch: bool
    limit_all_gathers: bool
    ignored: tuple[str, ...]  # module paths under the model
    policy: tuple  # ("none",) | ("classes", names) | ("size", min_num_params)
    optimizer: str  # "sgd" | "adam"
    program: tuple = field(default=())  # ops, see _draw_program
    world_size: int = 2
    mesh_shape: tuple[int, int] = (1, 2)  # HYBRID's (replicate, shard) mesh

    def describe(self) -> str:
        mp = "fp32" if self.mixed_precision is None else "mp" + str(self.mixed_precision)
        return (
            f"seed {self.seed}: {self.strategy} uop={self.use_orig_params} {mp} offload={self.offload} "
            f"bwd={self.backward_prefetch} fwd_pf={self.forward_prefetch} limit={self.limit_all_gathers} "
            f"policy={self.policy} ignored={self.ignored} vocab={self.vocab} tied={self.tied} opt={self.optimizer} "
            f"tree={self.tree} program={self.program} world_size={self.world_size} mesh={self.mesh_shape}"
        )


def _draw_tree(rng: random.Random, depth: int) -> tuple:
    if depth < 2 and rng.random() < 0.45:
        if rng.random() < 0.3:
            return ("pair", _draw_tree(rng, depth + 1), _draw_tree(rng, depth + 1))
        children = tuple(_draw_tree(rng, depth + 1) for _ in range(rng.randint(1, 3)))
        return ("block", rng.random() < 0.5, children)
    kind = rng.choice(LEAF_KINDS)
    frozen = rng.random() < 0.15
    option: Any = {
        "linear": rng.random() < 0.7,  # bias
        "norm": rng.random() < 0.7,  # elementwise_affine
        "conv": rng.choice((1, 3, 5)),  # kernel size (odd: the length is kept)
        "scale": rng.random() < 0.5,  # a float64 buffer too
        "empty": rng.random() < 0.5,  # a 2-D empty parameter too
    }[kind]
    return (kind, frozen, option)


def leaf_paths(tree: tuple, prefix: str = "body") -> list[tuple[str, tuple]]:
    """(module path, leaf) for every leaf of `tree`, as runtime_fuzz.build names them."""
    if tree[0] == "block":
        return [p for i, child in enumerate(tree[2]) for p in leaf_paths(child, f"{prefix}.layers.{i}")]
    if tree[0] == "pair":
        return leaf_paths(tree[1], f"{prefix}.a") + leaf_paths(tree[2], f"{prefix}.b")
    return [(prefix, tree)]


def _draw_mixed_precision(rng: random.Random) -> tuple | None:
    if rng.random() < 0.45:
        return None
    low = rng.choice(("bfloat16", "float16"))
    param = rng.choice((low, low, None))
    reduce = rng.choice((None, "float32", low))
    buffer = rng.choice((None, low))
    return (param, reduce, buffer, rng.random() < 0.3, rng.random() < 0.3)


def _draw_program(rng: random.Random, more: random.Random, hybrid: bool, uop: bool) -> tuple:
    ops: list[tuple] = []
    for _ in range(rng.randint(2, 6)):
        roll = rng.random()
        clip = (round(rng.uniform(0.05, 2.0), 3), rng.choice(NORM_TYPES)) if rng.random() < 0.35 else None
        if roll < 0.4:
            ops.append(("step", clip))
        elif roll < 0.55:
            ops.append(("no_sync", rng.randint(1, 2), clip))
        elif roll < 0.65:
            ops.append(("eval",))
        elif roll < 0.8:
            # writeback, with_grads (torch's refuses with_grads with use_orig_params=False; ours runs it, on purpose)
            ops.append(("summon", rng.random() < 0.5, uop and rng.random() < 0.2))
        else:
            # torch's HYBRID on a (1, 2) mesh hangs in the first all-gather after a SHARDED load (seed 0)
            kind = "FULL" if hybrid else rng.choice(("FULL", "SHARDED"))
            ops.append(("save_load", "LOCAL" if not hybrid and more.random() < 0.3 else kind))
    return (*ops, ("step", None))


def draw(seed: int, world_size: int = 2) -> Case:
    """The case of `seed` on `world_size` ranks. What later rounds added (LOCAL state dicts, meshes of four ranks)
    is drawn from a second generator, so that `rng`'s draws stay as they were (a save of an older seed may now be a
    LOCAL one)."""
    rng, more = random.Random(seed), random.Random(f"{seed}/{world_size}")
    hidden = rng.choice((3, 5, 7))
    vocab = rng.choice((None, 5, 7, 11))
    tied = vocab is not None and rng.random() < 0.5
    tree = ("block", False, tuple(_draw_tree(rng, 1) for _ in range(rng.randint(1, 3))))
    leaves = leaf_paths(tree)
    ignored = tuple(path for path, _ in leaves if rng.random() < 0.08)
    strategy = rng.choice(STRATEGIES)
    mixed_precision, optimizer = _draw_mixed_precision(rng), rng.choice(("sgd", "adam"))
    use_orig_params = rng.random() < 0.5
    if mixed_precision and mixed_precision[2]:
        ignored = ()  # torch's casts the buffers of modules ignored inside nested units (docs/compatibility.md)
    roll = rng.random()
    if roll < 0.2:
        policy: tuple = ("none",)
    elif roll < 0.7:
        policy = ("classes", tuple(sorted(rng.sample(WRAP_CLASSES, rng.randint(1, 4)))))
    else:
        policy = ("size", rng.randint(3, 60))
    return Case(
        seed=seed,
        hidden=hidden,
        vocab=vocab,
        tied=tied,
        tree=tree,
        strategy=strategy,
        use_orig_params=use_orig_params,
        mixed_precision=mixed_precision,
        # (offloaded NO_SHARD keeps low-precision gradients in the compute dtype, torch's without offload, the oracle,
        # in the reduce dtype: that pair is left out)
        offload=rng.random() < 0.15 and not (strategy == "NO_SHARD" and mixed_precision and mixed_precision[3]),
        backward_prefetch=rng.choice(("BACKWARD_PRE", "BACKWARD_POST", None)),
        forward_prefetch=rng.random() < 0.3,
        limit_all_gathers=rng.random() < 0.7,
        ignored=ignored,
        policy=policy,
        # Adam cannot step fp32 parameters with the low-precision gradients keep_low_precision_grads leaves
        optimizer="sgd" if mixed_precision and mixed_precision[3] else optimizer,
        program=_draw_program(rng, more, "HYBRID" in strategy, use_orig_params),
        world_size=world_size,
        mesh_shape=more.choice(((1, 4), (2, 2))) if world_size == 4 else (1, world_size),
    )
