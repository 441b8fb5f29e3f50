"""fsdp_legacy.checkpoint.save_full_model / load_full_model: full weights in Hugging Face's layout, streamed.

The oracles: torch FSDP1's FULL_STATE_DICT of the same model trained the same way (and ours), safetensors' own reader,
and transformers' save_pretrained / from_pretrained on a tiny LlamaForCausalLM (built from a config, no download).
"""

import glob
import json
import os
import struct
import warnings
import zipfile

import pytest
import torch
import torch.distributed as dist
import torch.distributed.fsdp as torch_fsdp
from safetensors.torch import load_file, save_file

import fsdp_legacy
from fsdp_legacy import FullyShardedDataParallel as FSDP
from fsdp_legacy.checkpoint import load_full_model, save_full_model
from fsdp_legacy.safetensors_format import read_safetensors_header
from fsdp_legacy.state import hf_checkpoint
from fsdp_utils import Config, build_ours, build_torch_fsdp, full_params, train
from harness import run_on_ranks

TIED = {"transformer": {"head.weight"}, "net": set(), "moe": set(), "frozen": set()}


# --------------------------------------------------------------------------------------------------------------------
# Helpers (run inside the ranks)


def full_state_dict(model, lib) -> dict:
    """`lib`'s FULL_STATE_DICT (torch's with offload_to_cpu=False: its CPU offload frees storage still in use)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        config = lib.FullStateDictConfig(offload_to_cpu=False, rank0_only=False)
        with lib.FullyShardedDataParallel.state_dict_type(model, lib.StateDictType.FULL_STATE_DICT, config):
            return model.state_dict()


def read_directory(directory: str) -> tuple[dict, dict | None]:
    """Every tensor saved in `directory` (with safetensors' or torch's reader), and the index if there is one."""
    index_path = glob.glob(os.path.join(directory, "*.index.json"))
    index = json.load(open(index_path[0])) if index_path else None
    tensors: dict = {}
    files = sorted(f for f in os.listdir(directory) if not f.endswith(".json"))
    for name in files:
        path = os.path.join(directory, name)
        part = load_file(path) if name.endswith(".safetensors") else torch.load(path, weights_only=True)
        assert not tensors.keys() & part.keys(), f"{name}: a key saved twice"
        if index is not None:
            assert {k for k, f in index["weight_map"].items() if f == name} == part.keys(), f"index of {name}"
        tensors.update(part)
    if index is None:
        assert len(files) == 1 and files[0] in ("model.safetensors", "pytorch_model.bin"), files
    else:
        assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in tensors.values())
        assert index["weight_map"].keys() == tensors.keys()
    return tensors, index


def barrier_then(fn, *args):
    dist.barrier()
    return fn(*args)


def params_and_buffers(model) -> dict:
    """Full parameters by clean FQN (all-gathered from the shards) plus the buffers, in their original dtype (as the
    FULL state dict gives them: MixedPrecision.buffer_dtype casts them at the first forward): what a load must
    reproduce."""
    result = full_params(model)
    buffers = {name.replace("_fsdp_wrapped_module.", "") for name, _ in model.named_buffers()}
    result.update((k, v) for k, v in full_state_dict(model, fsdp_legacy).items() if k in buffers)
    return result


def assert_equal(actual: dict, expected: dict, what: str) -> None:
    assert actual.keys() == expected.keys(), f"{what}: {sorted(actual.keys() ^ expected.keys())}"
    for key, value in expected.items():
        assert actual[key].dtype == value.dtype and torch.equal(actual[key], value), f"{what}: {key}"


# --------------------------------------------------------------------------------------------------------------------
# Saving: against torch FSDP1's FULL state dict


def _save_matches_torch(config: Config, directory: str, max_shard_size, safe: bool) -> None:
    _, ours = build_ours(config)
    theirs = build_torch_fsdp(config)
    train(ours, config)
    train(theirs, config)
    save_full_model(ours, directory, max_shard_size=max_shard_size, safe_serialization=safe)
    expected_ours, expected_torch = full_state_dict(ours, fsdp_legacy), full_state_dict(theirs, torch_fsdp)
    if dist.get_rank() != 0:
        assert not os.path.exists(directory) or os.listdir(directory), "only rank 0 writes"
        return
    saved, index = read_directory(directory)
    assert (index is not None) == (max_shard_size != "5GB"), "sharded exactly when asked"
    if index is not None:
        assert len(set(index["weight_map"].values())) > 1
    for expected in (expected_ours, expected_torch):
        expected = {k: v for k, v in expected.items() if k not in TIED[config.model]}
        assert list(saved) == list(expected) or saved.keys() == expected.keys()
        for key, value in expected.items():
            assert saved[key].dtype == value.dtype and torch.equal(saved[key], value), f"{key} is not bit-equal"


SAVE_CASES = [
    (Config("transformer", steps=2), 2, "5GB", True),
    (Config("transformer", use_orig_params=True, steps=2), 2, "3KB", True),
    (Config("net", strategy="SHARD_GRAD_OP", policy="size", steps=2), 4, "100B", True),
    (Config("transformer", strategy="NO_SHARD", steps=2), 2, "5GB", True),
    (Config("transformer", steps=2), 2, "5GB", False),
    (Config("transformer", use_orig_params=True, steps=2), 2, "3KB", False),
]


@pytest.mark.parametrize(
    "config,world_size,max_shard_size,safe",
    SAVE_CASES,
    ids=[f"{c.name()}_w{w}_{s}_{'st' if safe else 'bin'}" for c, w, s, safe in SAVE_CASES],
)
def test_save_matches_torch_full_state_dict(tmp_path, config, world_size, max_shard_size, safe) -> None:
    run_on_ranks(_save_matches_torch, world_size, config, str(tmp_path / "out"), max_shard_size, safe)


# --------------------------------------------------------------------------------------------------------------------
# Round trips: save, load into a freshly initialised model


def _round_trip(config: Config, directory: str, max_shard_size: str, safe: bool) -> None:
    _, ours = build_ours(config)
    train(ours, config)
    save_full_model(ours, directory, max_shard_size=max_shard_size, safe_serialization=safe)
    _, fresh = build_ours(config, seed=1)
    before = params_and_buffers(fresh)
    result = load_full_model(fresh, directory)
    assert result.missing_keys == [] and result.unexpected_keys == []
    expected, loaded = params_and_buffers(ours), params_and_buffers(fresh)
    assert any(not torch.equal(before[k], v) for k, v in expected.items()), "the fresh model started elsewhere"
    assert_equal(loaded, expected, "loaded")
    train(fresh, config)  # and it trains on
    train(ours, config)
    assert_equal(params_and_buffers(fresh), params_and_buffers(ours), "after more training")


OFFLOAD = {"cpu_offload": fsdp_legacy.CPUOffload(offload_params=True)}
ROUND_TRIPS = [
    (Config("transformer", strategy=strategy, use_orig_params=uop, steps=2), 2, "3KB", True)
    for strategy in ("FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD")
    for uop in (False, True)
] + [
    (Config("transformer", mixed_precision=("bfloat16", "bfloat16", "bfloat16"), steps=2), 2, "5GB", True),
    (Config("transformer", use_orig_params=True, mixed_precision=("float16",) * 3, steps=2), 2, "3KB", True),
    (Config("transformer", extra=OFFLOAD, steps=2), 2, "5GB", True),
    (Config("transformer", use_orig_params=True, extra=OFFLOAD, steps=2), 2, "3KB", True),
    (Config("transformer", strategy="SHARD_GRAD_OP", use_orig_params=True, steps=2), 4, "1KB", True),
    (Config("transformer", use_orig_params=True, steps=2), 2, "3KB", False),
]


@pytest.mark.parametrize(
    "config,world_size,max_shard_size,safe",
    ROUND_TRIPS,
    ids=[
        f"{c.name()}{'_offload' if c.extra else ''}_w{w}_{s}_{'st' if safe else 'bin'}" for c, w, s, safe in ROUND_TRIPS
    ],
)
def test_round_trip(tmp_path, config, world_size, max_shard_size, safe) -> None:
    run_on_ranks(_round_trip, world_size, config, str(tmp_path / "out"), max_shard_size, safe)


# --------------------------------------------------------------------------------------------------------------------
# transformers: save_pretrained -> load_full_model, save_full_model -> from_pretrained


def _llama(tie: bool):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=96,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        tie_word_embeddings=tie,
    )
    return LlamaForCausalLM(config)


def _wrapped_llama(tie: bool, seed: int):
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    torch.manual_seed(seed)
    return FSDP(_llama(tie), auto_wrap_policy=fsdp_legacy.wrap.ModuleWrapPolicy({LlamaDecoderLayer}))


def _transformers_both_ways(tie: bool, theirs: str, ours: str) -> None:
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    original = _llama(tie)
    if dist.get_rank() == 0:
        original.save_pretrained(theirs, max_shard_size="20KB")
    dist.barrier()
    model = _wrapped_llama(tie, seed=1)
    load_full_model(model, theirs)
    expected = dict(original.state_dict())
    loaded = params_and_buffers(model)
    assert_equal({k: loaded[k] for k in expected}, expected, "save_pretrained -> load_full_model")
    if tie:
        assert torch.equal(loaded["lm_head.weight"], loaded["model.embed_tokens.weight"])
    save_full_model(model, ours, max_shard_size="20KB")
    if dist.get_rank() == 0:
        original.config.save_pretrained(ours)  # from_pretrained reads config.json beside the weights
        saved, _ = read_directory(ours)
        reference, _ = read_directory(theirs)
        assert saved.keys() == reference.keys(), "the keys save_pretrained writes (tied weights once, as it does)"
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            reloaded = LlamaForCausalLM.from_pretrained(ours)
        assert_equal(dict(reloaded.state_dict()), expected, "save_full_model -> from_pretrained")
        if tie:
            assert reloaded.lm_head.weight is reloaded.model.embed_tokens.weight


@pytest.mark.parametrize("tie", [True, False], ids=["tied", "untied"])
def test_transformers_llama_both_ways(tmp_path, tie: bool) -> None:
    pytest.importorskip("transformers")
    run_on_ranks(_transformers_both_ways, 2, tie, str(tmp_path / "theirs"), str(tmp_path / "ours"), timeout=300)


# --------------------------------------------------------------------------------------------------------------------
# dtype on the way out; errors


def _dtype_cast(directory: str) -> None:
    config = Config("transformer", steps=1)
    _, ours = build_ours(config)
    train(ours, config)
    save_full_model(ours, directory, dtype=torch.bfloat16)
    expected = full_state_dict(ours, fsdp_legacy)
    if dist.get_rank() == 0:
        saved, _ = read_directory(directory)
        for key, value in saved.items():
            assert value.dtype == torch.bfloat16 and torch.equal(value, expected[key].to(torch.bfloat16)), key
    dist.barrier()
    _, fresh = build_ours(config, seed=1)
    with pytest.raises(RuntimeError, match=r"dtype mismatch for tok\.weight in model\.safetensors"):
        load_full_model(fresh, directory)


def test_dtype_cast_on_the_way_out(tmp_path) -> None:
    run_on_ranks(_dtype_cast, 2, str(tmp_path / "bf16"))


def _edited(source: str, target: str, edit) -> None:
    if dist.get_rank() == 0:
        os.makedirs(target)
        tensors = load_file(os.path.join(source, "model.safetensors"))
        edit(tensors)
        save_file(tensors, os.path.join(target, "model.safetensors"), metadata={"format": "pt"})
    dist.barrier()


def _errors(directory: str) -> list[str]:
    config = Config("transformer", steps=1)
    _, ours = build_ours(config)
    save_full_model(ours, os.path.join(directory, "good"))
    cases = {
        "missing": lambda t: t.pop("blocks.1.mlp.0.weight"),
        "unexpected": lambda t: t.update(extra=torch.zeros(3)),
        "shape": lambda t: t.update({"norm.weight": torch.zeros(7)}),
        "dtype": lambda t: t.update({"pos": t["pos"].double()}),
    }
    patterns = {
        "missing": r'Missing key\(s\) in .*missing: "blocks\.1\.mlp\.0\.weight"',
        "unexpected": r'Unexpected key\(s\) in .*: "extra" \(in model\.safetensors\)',
        "shape": r"size mismatch for norm\.weight in model\.safetensors: .*torch\.Size\(\[7\]\).*torch\.Size\(\[16\]\)",
        "dtype": r"dtype mismatch for pos in model\.safetensors: the checkpoint holds torch\.float64",
    }
    messages = []
    for name, edit in cases.items():
        _edited(os.path.join(directory, "good"), os.path.join(directory, name), edit)
        _, fresh = build_ours(config, seed=1)
        before = params_and_buffers(fresh)
        with pytest.raises(RuntimeError, match=patterns[name]) as caught:
            load_full_model(fresh, os.path.join(directory, name))
        assert_equal(params_and_buffers(fresh), before, f"{name}: the model is left untouched")
        messages.append(str(caught.value))
    # strict=False reports and loads the rest
    _, fresh = build_ours(config, seed=1)
    result = load_full_model(fresh, os.path.join(directory, "missing"), strict=False)
    assert result.missing_keys == ["blocks.1.mlp.0.weight"] and result.unexpected_keys == []
    result = load_full_model(fresh, os.path.join(directory, "unexpected"), strict=False)
    assert result.missing_keys == [] and result.unexpected_keys == ["extra"]
    assert_equal(params_and_buffers(fresh), params_and_buffers(ours), "strict=False loaded what is there")
    return messages


def test_errors_raise_on_every_rank_naming_key_and_file(tmp_path) -> None:
    messages = run_on_ranks(_errors, 2, str(tmp_path))
    assert messages[0] == messages[1], "every rank raises the same error"


def _flip_a_data_bit(directory: str, key: str, safe: bool) -> None:
    """On rank 0, one bit of `key`'s bytes in whichever file of `directory` holds it (bytes in the file only: the
    header and the archive's records stay as written)."""
    if dist.get_rank() == 0:
        if safe:
            for path in glob.glob(os.path.join(directory, "*.safetensors")):
                header = read_safetensors_header(path)
                if key in header.tensors:
                    position = header.tensors[key].start + header.tensors[key].nbytes // 2
                    break
        else:
            (path,) = glob.glob(os.path.join(directory, "*.bin"))
            with zipfile.ZipFile(path) as archive:  # the largest data record: the tensors' bytes
                info = max((i for i in archive.infolist() if "/data/" in i.filename), key=lambda i: i.file_size)
            with open(path, "rb") as file:
                file.seek(info.header_offset + 26)
                name_length, extra_length = struct.unpack("<HH", file.read(4))
            position = info.header_offset + 30 + name_length + extra_length + info.file_size // 2
        with open(path, "r+b") as file:
            file.seek(position)
            byte = file.read(1)[0]
            file.seek(position)
            file.write(bytes([byte ^ 0x10]))
    dist.barrier()


def _refuses_flipped_data(directory: str, max_shard_size: str, safe: bool) -> str:
    config = Config("transformer", steps=1)
    _, ours = build_ours(config)
    save_full_model(ours, directory, max_shard_size=max_shard_size, safe_serialization=safe)
    _flip_a_data_bit(directory, "blocks.1.mlp.0.weight", safe)
    _, fresh = build_ours(config, seed=1)
    before = params_and_buffers(fresh)
    pattern = "does not match the CRC-32" if safe else "corrupted: its record .* does not match the CRC-32"
    with pytest.raises(RuntimeError, match=pattern) as caught:
        load_full_model(fresh, directory)
    assert_equal(params_and_buffers(fresh), before, "the model is left untouched")
    if safe:
        assert "blocks.1.mlp.0.weight" in str(caught.value), "the changed tensor is named"
    # the oracle that the flip reached data that loads: unchecked, the load differs from what was saved
    load_full_model(fresh, directory, verify_data=False)
    loaded, saved = params_and_buffers(fresh), params_and_buffers(ours)
    assert any(not torch.equal(loaded[k], saved[k]) for k in saved), "the flipped bit loads when unchecked"
    return str(caught.value)


@pytest.mark.parametrize(
    "world_size,max_shard_size,safe", [(2, "5GB", True), (2, "3KB", True), (4, "5GB", True), (2, "5GB", False)]
)
def test_flipped_data_bit_refused_on_every_rank(tmp_path, world_size, max_shard_size, safe) -> None:
    """save_full_model seals a CRC-32 per tensor into each header (torch.save one per record): load_full_model checks
    them, the ranks sharing the reading, before anything is copied."""
    messages = run_on_ranks(_refuses_flipped_data, world_size, str(tmp_path / "out"), max_shard_size, safe)
    assert len(set(messages)) == 1, "every rank raises the same error"


# --------------------------------------------------------------------------------------------------------------------
# Atomicity


class _Injected(RuntimeError):
    pass


def _fail_mid_write(directory: str, fresh_directory: str) -> None:
    config = Config("transformer", steps=1)
    _, ours = build_ours(config)
    save_full_model(ours, directory, max_shard_size="3KB")
    before = read_directory(directory)[0] if dist.get_rank() == 0 else {}
    train(ours, config)
    original, calls = hf_checkpoint._write_piece, [0]

    def failing(*args):
        calls[0] += 1
        if calls[0] == 5:
            raise _Injected("disk full (injected)")
        return original(*args)

    hf_checkpoint._write_piece = failing  # type: ignore[assignment]
    try:
        for target in (directory, fresh_directory):
            calls[0] = 0
            with pytest.raises(RuntimeError, match="disk full") as caught:  # the same error on every rank
                save_full_model(ours, target, max_shard_size="3KB")
            assert type(caught.value) is RuntimeError and isinstance(caught.value.__cause__, _Injected) == (
                dist.get_rank() == 0
            )
    finally:
        hf_checkpoint._write_piece = original  # type: ignore[assignment]
    dist.barrier()
    parent = os.path.dirname(directory)
    assert not os.path.exists(fresh_directory), "no destination directory after a failed first save"
    assert sorted(os.listdir(parent)) == [os.path.basename(directory)], (
        f"no temporary left behind: {os.listdir(parent)}"
    )
    if dist.get_rank() == 0:
        assert_equal(read_directory(directory)[0], before, "the previous checkpoint is untouched")
    dist.barrier()  # every rank has looked before rank 0 starts the next save (and its temporary)
    save_full_model(ours, directory, max_shard_size="3KB")  # and a save after the failure works
    expected = full_state_dict_without_tied(ours)
    if dist.get_rank() == 0:
        assert_equal(read_directory(directory)[0], expected, "the next save")


def full_state_dict_without_tied(model) -> dict:
    return {k: v for k, v in full_state_dict(model, fsdp_legacy).items() if k not in TIED["transformer"]}


def test_failure_mid_write_leaves_previous_directory(tmp_path) -> None:
    run_on_ranks(_fail_mid_write, 2, str(tmp_path / "ckpt"), str(tmp_path / "new"))


def test_max_shard_size_parsing() -> None:
    assert hf_checkpoint.parse_size("5GB") == 5 * 10**9
    assert hf_checkpoint.parse_size("2GiB") == 2 * 2**30
    assert hf_checkpoint.parse_size(1234) == 1234
    with pytest.raises(ValueError, match="max_shard_size"):
        hf_checkpoint.parse_size("lots")


# --------------------------------------------------------------------------------------------------------------------
# A pretrained model into a model built on the meta device and hybrid-sharded: no rank ever holds it whole


def _meta_hybrid_load_and_save(source: str, target: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh

    import models

    torch.manual_seed(0)
    pretrained = models.Transformer()
    expected = {k: v for k, v in pretrained.state_dict().items() if k not in TIED["transformer"]}
    if dist.get_rank() == 0:
        os.makedirs(source)
        save_file({k: v.contiguous() for k, v in expected.items()}, os.path.join(source, "model.safetensors"))
    dist.barrier()
    with torch.device("meta"):
        skeleton = models.Transformer()

    def materialize(module: torch.nn.Module) -> None:
        module.to_empty(device=torch.device("cpu"), recurse=False)
        if module is skeleton.head:  # to_empty unties weights: tie them again, as tie_weights() does
            module.weight = skeleton.tok.weight

    model = FSDP(
        skeleton,
        sharding_strategy=fsdp_legacy.ShardingStrategy.HYBRID_SHARD,
        device_mesh=init_device_mesh("cpu", (2, 2)),  # replicated across dim 0, sharded across dim 1
        auto_wrap_policy=fsdp_legacy.wrap.ModuleWrapPolicy({models.TransformerBlock}),
        param_init_fn=materialize,
    )
    assert model.process_group.size() == 2 and model._inter_node_pg.size() == 2
    result = load_full_model(model, source)
    assert result.missing_keys == [] and result.unexpected_keys == []
    loaded = {k: v for k, v in params_and_buffers(model).items() if k not in TIED["transformer"]}
    assert_equal(loaded, expected, "loaded into the meta-built hybrid model")
    save_full_model(model, target)
    if dist.get_rank() == 0:
        saved, _ = read_directory(target)
        assert_equal(saved, expected, "saved from the hybrid model")


def test_meta_device_hybrid_shard_load_and_save(tmp_path) -> None:
    """load_full_model fills a model built on the meta device and HYBRID_SHARDed over a 2 x 2 mesh (each rank reads
    only its shard's slices), and save_full_model writes back exactly the pretrained weights."""
    run_on_ranks(_meta_hybrid_load_and_save, 4, str(tmp_path / "pretrained"), str(tmp_path / "resaved"))
