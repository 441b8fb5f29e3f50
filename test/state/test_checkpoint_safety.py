"""Checkpoint safety: every load is weights_only, saves are atomic, and each kind of bad input (truncated or
corrupted files, pickled code, missing files, missing/unexpected keys, shape and dtype mismatches, a LOCAL checkpoint
from another world size, a damaged layout record) raises an error naming the file or key and the fix.

Most cases run offline in the pytest process on small synthetic checkpoints; the in-memory LOCAL load checks of the
layout record run on ranks. (In-memory load errors without a record are covered by test_state_dict.py.)
"""

import ast
import enum
import glob
import os
import pickle
import random
import sys
import warnings

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import _MEM_FORMAT_ENCODING

import repo_paths

sys.path.insert(0, str(repo_paths.TOOLS))
from checkpoint_fuzz.hostile import REBUILD_EDITS, replace_dcp_item, with_hostile_rebuild
from fsdp_legacy import FullyShardedDataParallel as FSDP
from fsdp_legacy import StateDictType
from fsdp_legacy.convert import CheckpointError, FlatParamRecord, ParamRecord, convert_checkpoint, torch_file
from fsdp_legacy.convert.dcp_files import write_dcp
from fsdp_legacy.convert.dcp_metadata import read_metadata
from fsdp_legacy.convert.flat import Flattened
from fsdp_legacy.convert.torch_file import TorchFile
from fsdp_utils import Config, build_ours, full_params, layout_keys
from harness import run_on_ranks

REPO = str(repo_paths.REPO)


def record(world_size: int = 2, dtype: torch.dtype = torch.float32) -> FlatParamRecord:
    """The layout of a root unit holding w (3, 4) and b (3,), with use_orig_params' alignment padding."""
    params = (ParamRecord("w", (3, 4), 0), ParamRecord("b", (3,), 0))
    return FlatParamRecord("", dtype, 1, 4, params, (), (), 0).at_world_size(world_size)


def full_checkpoint(path, with_layout: bool = True, **model_overrides) -> dict:
    torch.manual_seed(0)
    model = {"w": torch.randn(3, 4), "b": torch.randn(3), "buf": torch.arange(2.0), **model_overrides}
    model = {k: v for k, v in model.items() if v is not None}
    state = {
        "model": model,
        "optim": {
            "state": {"w": {"step": torch.tensor(2.0), "exp_avg": torch.randn(3, 4)}},
            "param_groups": [{"lr": 0.1, "betas": (0.9, 0.99), "params": ["w", "b"]}],
        },
    }
    if with_layout:
        state["layout"] = {"_flat_param_meta": record().to_tensor()}
    torch.save(state, path)
    return state


def snapshot(directory) -> dict:
    files = {}
    for name in sorted(glob.glob(os.path.join(directory, "**"), recursive=True)):
        if os.path.isfile(name):
            with open(name, "rb") as handle:
                files[os.path.relpath(name, directory)] = handle.read()
    return files


class Evil:
    """Unpickling this runs a shell command."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


# --------------------------------------------------------------------------------------------------------------------
# Loads and saves


def test_every_torch_load_is_weights_only() -> None:
    """No torch.load in the package or the tools without weights_only=True, but the one that reads per-rank LOCAL
    files, with the restricted pickle module of convert/loading.py (which allows only an explicit list of globals)."""
    offenders, restricted = [], []
    for file in glob.glob(os.path.join(REPO, "fsdp_legacy", "**", "*.py"), recursive=True) + glob.glob(
        os.path.join(REPO, "tools", "*.py")
    ):
        for node in ast.walk(ast.parse(open(file).read())):
            if isinstance(node, ast.Call) and ast.unparse(node.func) == "torch.load":
                keywords = {k.arg: ast.unparse(k.value) for k in node.keywords}
                where = f"{os.path.relpath(file, REPO)}:{node.lineno}"
                if keywords.get("weights_only") == "True":
                    continue
                in_loading = os.path.relpath(file, REPO) == os.path.join("fsdp_legacy", "convert", "loading.py")
                if (
                    in_loading
                    and keywords.get("pickle_module") == "_RANK_FILE_PICKLE"
                    and keywords.get("weights_only") == "False"
                ):
                    restricted.append(where)
                else:
                    offenders.append(where)
    assert offenders == []
    assert len(restricted) == 1, restricted
    assert any("torch.load" in open(f).read() for f in glob.glob(os.path.join(REPO, "fsdp_legacy", "convert", "*.py")))


@pytest.mark.parametrize("target", ["full", "dcp", "local"])
def test_a_crash_mid_save_leaves_the_previous_checkpoint(tmp_path, monkeypatch, target: str) -> None:
    source, destination = str(tmp_path / "source.pt"), str(tmp_path / "out")
    full_checkpoint(source)
    convert_checkpoint(source, destination, to=target)
    before = snapshot(tmp_path)
    reads = []

    def crash(self, path):
        reads.append(path)
        if len(reads) == 3:
            raise RuntimeError("simulated crash")
        return self._values[path]

    monkeypatch.setattr(TorchFile, "read", crash)
    with pytest.raises(RuntimeError, match="simulated crash"):
        convert_checkpoint(source, destination, to=target)
    assert snapshot(tmp_path) == before, "the previous checkpoint is intact and no partial file remains"
    with pytest.raises(RuntimeError, match="simulated crash"):  # a first save leaves nothing behind either
        reads.clear()
        convert_checkpoint(source, str(tmp_path / "new"), to=target)
    assert sorted(os.listdir(tmp_path)) == ["out", "source.pt"]


def test_the_full_writer_fails_before_replacing(tmp_path, monkeypatch) -> None:
    """A failure in the last step of writing a file (its CRC pass) also keeps the previous file."""
    source, destination = str(tmp_path / "source.pt"), str(tmp_path / "out.pt")
    full_checkpoint(source)
    convert_checkpoint(source, destination, to="full")
    before = snapshot(tmp_path)

    def fail(path):
        raise OSError("disk full")

    monkeypatch.setattr(torch_file, "rewrite_crcs", fail)
    with pytest.raises(CheckpointError, match=r"Could not write .*out\.pt: disk full"):  # the converter's own error
        convert_checkpoint(source, destination, to="full")
    assert snapshot(tmp_path) == before


def test_destination_must_be_the_right_kind(tmp_path) -> None:
    source = str(tmp_path / "source.pt")
    full_checkpoint(source)
    os.mkdir(tmp_path / "dir")
    with pytest.raises(CheckpointError, match=r"dir exists and is a directory, but this checkpoint format is a file"):
        convert_checkpoint(source, str(tmp_path / "dir"), to="full")
    with pytest.raises(CheckpointError, match="is the source: write the conversion to another path"):
        convert_checkpoint(source, source, to="full")


# --------------------------------------------------------------------------------------------------------------------
# Damaged files


def test_truncated_files(tmp_path) -> None:
    source = str(tmp_path / "source.pt")
    full_checkpoint(source)
    convert_checkpoint(source, str(tmp_path / "dcp"), to="dcp")
    data = open(source, "rb").read()
    open(source, "wb").write(data[: len(data) // 2])
    with pytest.raises(
        CheckpointError,
        match=r"source\.pt is not a readable torch.save archive .*truncated or "
        r"corrupted.*Restore it from a copy",
    ):
        convert_checkpoint(source, str(tmp_path / "out.pt"), to="full")

    item = str(tmp_path / "dcp" / "__0_0.distcp")
    data = open(item, "rb").read()
    open(item, "wb").write(data[: len(data) - 100])
    with pytest.raises(
        CheckpointError,
        match=r"__0_0\.distcp holds \d+ bytes, but the item of model\.\S+ ends at byte \d+: it is truncated",
    ):
        convert_checkpoint(str(tmp_path / "dcp"), str(tmp_path / "out.pt"), to="full")

    metadata = str(tmp_path / "dcp" / ".metadata")
    data = open(metadata, "rb").read()
    open(metadata, "wb").write(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match=r"dcp/\.metadata cannot be read: it is truncated or corrupted"):
        convert_checkpoint(str(tmp_path / "dcp"), str(tmp_path / "out.pt"), to="full")
    assert not os.path.exists(tmp_path / "out.pt")


def test_a_flipped_bit_is_found(tmp_path) -> None:
    """torch.load does not check CRC-32s; the converter does, for files and for each DCP item."""
    source = str(tmp_path / "source.pt")
    state = full_checkpoint(source)
    convert_checkpoint(source, str(tmp_path / "dcp"), to="dcp")
    needle = state["model"]["w"].numpy().tobytes()
    for path, what in (
        (source, r"source\.pt is corrupted: its record '.*/data/\d+' \(the data of model\.w\) does not match"),
        (str(tmp_path / "dcp" / "__0_0.distcp"), r"__0_0\.distcp \(the item of model\.w at byte \d+\) is corrupted"),
    ):
        data = bytearray(open(path, "rb").read())
        data[data.index(needle) + 5] ^= 0x01
        open(path, "wb").write(data)
        assert torch.load(source, weights_only=True)["model"]["w"].shape == (3, 4)  # torch.load alone does not notice
        with pytest.raises(CheckpointError, match=what + r".*Restore the file from a copy"):
            convert_checkpoint(
                os.path.dirname(path) if path.endswith("distcp") else path, str(tmp_path / "out.pt"), to="full"
            )


def test_a_missing_file(tmp_path) -> None:
    source = str(tmp_path / "source.pt")
    full_checkpoint(source)
    convert_checkpoint(source, str(tmp_path / "dcp"), to="dcp")
    os.remove(tmp_path / "dcp" / "__0_0.distcp")
    with pytest.raises(
        CheckpointError,
        match=r"__0_0\.distcp, which holds .*, is missing: the checkpoint is "
        r"incomplete \(copy every file of the directory\)",
    ):
        convert_checkpoint(str(tmp_path / "dcp"), str(tmp_path / "out.pt"), to="full")
    os.remove(tmp_path / "dcp" / ".metadata")
    with pytest.raises(CheckpointError, match=r"dcp is a directory without a DCP \.metadata file"):
        convert_checkpoint(str(tmp_path / "dcp"), str(tmp_path / "out.pt"), to="full")


def test_pickled_code_is_refused(tmp_path) -> None:
    marker = str(tmp_path / "pwned")
    state = {"model": {"w": torch.zeros(2)}, "extra": Evil(marker)}
    torch.save(state, tmp_path / "evil.pt")
    with pytest.raises(
        CheckpointError,
        match=r"evil\.pt holds pickled Python objects other than tensors .*"
        r"(posix|os)\.system.*could run arbitrary code, so it is refused",
    ):
        convert_checkpoint(str(tmp_path / "evil.pt"), str(tmp_path / "out"), to="dcp")

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save(state, checkpoint_id=str(tmp_path / "evil_dcp"), no_dist=True)
    with pytest.raises(
        CheckpointError,
        match=r"__0_0\.distcp \(the item of extra at byte \d+\) holds pickled "
        r"Python objects.*refused",
    ):
        convert_checkpoint(str(tmp_path / "evil_dcp"), str(tmp_path / "out"), to="full")

    with open(tmp_path / "evil_dcp" / ".metadata", "wb") as handle:
        pickle.dump(Evil(marker), handle)
    with pytest.raises(
        CheckpointError,
        match=r"\.metadata refers to (posix|os)\.system, which DCP metadata never "
        r"holds: unpickling it could run arbitrary code, so it is refused",
    ):
        convert_checkpoint(str(tmp_path / "evil_dcp"), str(tmp_path / "out"), to="full")
    assert not os.path.exists(marker), "nothing was executed"


class _EnumsByName(pickle.Pickler):
    """Pickles enum members as Python 3.11.0 to 3.11.4 do, `getattr(EnumClass, "NAME")` (later releases write
    `EnumClass(value)`), so that a checkpoint saved there is read here as it would be there."""

    def reducer_override(self, obj):  # type: ignore[no-untyped-def]
        if isinstance(obj, enum.Enum):
            return getattr, (type(obj), obj.name)
        return NotImplemented


def test_dcp_metadata_of_python_3_11_early_releases_is_read(tmp_path) -> None:
    """dcp.save's .metadata holds an enum (the memory format of each tensor): the readers accept it pickled by
    name through getattr, and only that use of getattr."""
    state = {"model": {"w": torch.randn(3, 4), "b": torch.randn(3)}}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save(state, checkpoint_id=str(tmp_path / "saved"), no_dist=True)
    metadata_file = tmp_path / "saved" / ".metadata"
    with open(metadata_file, "rb") as handle:
        metadata = pickle.load(handle)
    with open(metadata_file, "wb") as handle:
        _EnumsByName(handle, protocol=pickle.HIGHEST_PROTOCOL).dump(metadata)
    assert b"getattr" in metadata_file.read_bytes(), "written as Python 3.11.2 writes it"
    assert read_metadata(str(metadata_file)) == metadata
    convert_checkpoint(str(tmp_path / "saved"), str(tmp_path / "full.pt"), to="full")
    full = torch.load(tmp_path / "full.pt", weights_only=True)
    assert all(torch.equal(full["model"][k], v) for k, v in state["model"].items())

    marker = str(tmp_path / "pwned")
    hostiles = (EvilGetattr(), _GetattrOf(torch.Size, "__new__"), _GetattrOf(_MEM_FORMAT_ENCODING, "__init_subclass__"))
    refused = r"refers to (builtins\.getattr\(|torch\.distributed).*, which DCP metadata never"
    for hostile in hostiles:
        with open(metadata_file, "wb") as handle:
            pickle.dump(hostile, handle)
        with pytest.raises(CheckpointError, match=refused):
            read_metadata(str(metadata_file))
    assert not os.path.exists(marker)


@pytest.mark.parametrize("edit", sorted(REBUILD_EDITS))
def test_tensor_rebuilds_no_save_writes_are_refused(tmp_path, edit: str) -> None:
    """A DCP item's torch.save pickle rebuilding its tensor with a storage offset, size or stride no save writes (the
    archive's CRC-32s valid, .metadata consistent): one CheckpointError naming the item, never a traceback or a view
    of the wrong elements. (tools/checkpoint_fuzz fuzzes the same edits over every format.)"""
    state = {"model": {"w": torch.randn(4, 6), "b": torch.randn(3)}}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save(state, checkpoint_id=str(tmp_path / "saved"), no_dist=True)
    metadata = dcp.FileSystemReader(str(tmp_path / "saved")).read_metadata()
    (index,) = [i for i in metadata.storage_data if i.fqn == "model.w"]
    info = metadata.storage_data[index]
    with open(tmp_path / "saved" / str(info.relative_path), "rb") as handle:
        handle.seek(int(info.offset))
        item, _ = with_hostile_rebuild(handle.read(int(info.length)), random.Random(0), edit)
    replace_dcp_item(tmp_path / "saved", index, item)
    with pytest.raises(
        CheckpointError, match=r"model\.w.* (cannot be read: it is truncated or corrupted|is a view|is not)"
    ):
        convert_checkpoint(str(tmp_path / "saved"), str(tmp_path / "full.pt"), to="full")


class _GetattrOf:
    def __init__(self, owner: object, name: str) -> None:
        self.owner, self.name = owner, name

    def __reduce__(self):
        return getattr, (self.owner, self.name)


class EvilGetattr:
    """Unpickling this fetches ShardedTensor.__setstate__ through getattr (the route protocol 2 takes to
    ShardedTensor.ProcessGroupState)."""

    def __reduce__(self):
        from torch.distributed._shard.sharded_tensor.api import ShardedTensor

        return getattr, (ShardedTensor, "__setstate__")


def test_pickled_code_in_per_rank_files_is_refused(tmp_path) -> None:
    """A per-rank LOCAL file is loaded with a restricted unpickler (ShardedTensors cannot be loaded with
    weights_only=True): any global outside its allowlist is refused before it is imported, and nothing runs."""
    marker = str(tmp_path / "pwned")
    ranks = tmp_path / "ranks"
    ranks.mkdir()
    # "ShardedTensor" in the pickle makes the directory's file look like a rank file
    torch.save({"model": {"w": torch.zeros(2)}, "ShardedTensor": Evil(marker)}, ranks / "rank0.pt")
    for source in (str(ranks), [str(ranks / "rank0.pt")]):
        with pytest.raises(
            CheckpointError,
            match=r"rank0\.pt names (posix|os)\.system, which a per-rank LOCAL state "
            r"dict file never holds: refused: this loader never runs code from "
            r"a checkpoint",
        ):
            convert_checkpoint(source, str(tmp_path / "out.pt"), to="full")
    torch.save({"model": {"w": EvilGetattr()}}, ranks / "rank0.pt")
    with pytest.raises(
        CheckpointError,
        match=r"rank0\.pt names getattr\(ShardedTensor, '__setstate__'\).*refused: "
        r"this loader never runs code",
    ):
        convert_checkpoint(str(ranks), str(tmp_path / "out.pt"), to="full")
    assert not os.path.exists(marker), "nothing was executed"
    assert not os.path.exists(tmp_path / "out.pt")


def _save_rank_files(directory: str) -> None:
    _, model = build_ours(Config("net"))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with FSDP.state_dict_type(model, StateDictType.LOCAL_STATE_DICT):
            torch.save(model.state_dict(), os.path.join(directory, f"rank{torch.distributed.get_rank()}.pt"))


def test_per_rank_files_missing_or_duplicated(tmp_path) -> None:
    """The ranks of per-rank LOCAL files come from their ShardedTensors, not their names; every rank must be there
    exactly once."""
    ranks = tmp_path / "ranks"
    ranks.mkdir()
    run_on_ranks(_save_rank_files, 2, str(ranks))
    convert_checkpoint(str(ranks), str(tmp_path / "ok.pt"), to="full")  # complete: converts
    with pytest.MonkeyPatch.context() as patch:  # torch then refuses any pickle module: say which switch to flip
        patch.setenv("TORCH_FORCE_WEIGHTS_ONLY_LOAD", "1")
        with pytest.raises(CheckpointError, match=r"TORCH_FORCE_WEIGHTS_ONLY_LOAD is set .* unset it"):
            convert_checkpoint(str(ranks), str(tmp_path / "forced.pt"), to="full")

    os.rename(ranks / "rank1.pt", ranks / "rank0_copy.pt")  # the name says nothing: rank 1's file still
    convert_checkpoint(str(ranks), str(tmp_path / "renamed.pt"), to="full")
    with open(ranks / "rank0.pt", "rb") as src, open(ranks / "rank1.pt", "wb") as dst:
        dst.write(src.read())
    with pytest.raises(
        CheckpointError,
        match=r"rank1\.pt and .*rank0\.pt are both rank 0's LOCAL state dict .*"
        r"Pass exactly one file per rank",
    ):
        convert_checkpoint(str(ranks), str(tmp_path / "out.pt"), to="full")
    os.remove(ranks / "rank1.pt")
    os.remove(ranks / "rank0_copy.pt")
    with pytest.raises(
        CheckpointError,
        match=r"ranks: the LOCAL state dict was saved by 2 ranks, but the file of "
        r"rank\(s\) \[1\] is missing \(found ranks \[0\]: rank0\.pt\)\. "
        r"Copy every rank's file",
    ):
        convert_checkpoint(str(ranks), str(tmp_path / "out.pt"), to="full")
    with pytest.raises(CheckpointError, match=r"rank\(s\) \[1\] is missing"):  # one rank's file alone
        convert_checkpoint(str(ranks / "rank0.pt"), str(tmp_path / "out.pt"), to="full")
    assert not os.path.exists(tmp_path / "out.pt")


# --------------------------------------------------------------------------------------------------------------------
# Checkpoints that do not fit their layout


def test_missing_key_shape_and_dtype_mismatch(tmp_path) -> None:
    """Laying a checkpoint out as flat parameters checks every parameter the layout holds."""
    cases = [
        ({"b": None}, r"model\.b in .*source\.pt is missing: the layout of _flat_param holds it.*--layout-from"),
        (
            {"w": torch.zeros(4, 3)},
            (
                r"size mismatch for model\.w in .*source\.pt: \(4, 3\) in the checkpoint, "
                r"\(3, 4\) in the layout of _flat_param"
            ),
        ),
        (
            {"b": torch.zeros(3, dtype=torch.float64)},
            (
                r"dtype mismatch for model\.b in .*source\.pt: torch\.float64 in the checkpoint, but the flat "
                r"parameter _flat_param holds torch\.float32\. Convert the checkpoint's tensors to torch\.float32 first"
            ),
        ),
    ]
    for overrides, message in cases:
        full_checkpoint(tmp_path / "source.pt", **overrides)
        with pytest.raises(CheckpointError, match=message):
            convert_checkpoint(str(tmp_path / "source.pt"), str(tmp_path / "local"), to="local")
    full_checkpoint(tmp_path / "source.pt", with_layout=False)
    with pytest.raises(CheckpointError, match=r"source\.pt carries no flat-parameter layout .*--layout-from"):
        convert_checkpoint(str(tmp_path / "source.pt"), str(tmp_path / "local"), to="local")
    assert not os.path.exists(tmp_path / "local")


def test_unexpected_keys(tmp_path) -> None:
    state = full_checkpoint(tmp_path / "source.pt")
    orphan = {"model": {**state["model"], "_flat_param_meta": record().to_tensor()}}
    torch.save(orphan, tmp_path / "orphan.pt")
    with pytest.raises(
        CheckpointError,
        match=r"orphan\.pt has the layout record model\._flat_param_meta but no flat "
        r"parameter model\._flat_param",
    ):
        convert_checkpoint(str(tmp_path / "orphan.pt"), str(tmp_path / "out"), to="dcp")
    stray = {**state, "optim": {**state["optim"], "state": {"head.weight": {"step": torch.tensor(1.0)}}}}
    torch.save(stray, tmp_path / "stray.pt")
    with pytest.raises(
        CheckpointError,
        match=r"optim\.state\.head\.weight\.step in .*stray\.pt: the optimizer state "
        r"names a parameter the model section does not have",
    ):
        convert_checkpoint(str(tmp_path / "stray.pt"), str(tmp_path / "out"), to="dcp")
    full_checkpoint(tmp_path / "source.pt")
    ids = {"model": {"w": torch.zeros(3, 4)}, "optim": {"state": {0: {}}, "param_groups": []}}
    torch.save(ids, tmp_path / "ids.pt")
    with pytest.raises(
        CheckpointError,
        match=r"ids\.pt: optim\.state has the key 0; only str keys are supported.*"
        r"FSDP\.optim_state_dict\(model, optim\)",
    ):
        convert_checkpoint(str(tmp_path / "ids.pt"), str(tmp_path / "out"), to="dcp")


def test_layout_from_must_fit(tmp_path) -> None:
    """A flat parameter saved without a record (as torch's FSDP1 saves it) takes the layout of --layout-from only if
    it describes that flat parameter."""
    full_checkpoint(tmp_path / "layout.pt")
    full_checkpoint(tmp_path / "nothing.pt", with_layout=False)
    flat = torch.arange(16.0)
    for numel in (12, 16):
        torch.save({"model": {"_flat_param": flat[:numel]}}, tmp_path / "torch_local.pt")
        if numel == 12:
            with pytest.raises(
                CheckpointError,
                match=r"model\._flat_param in .*torch_local\.pt holds 12 torch\.float32 "
                r"elements but its layout record describes 16",
            ):
                convert_checkpoint(
                    str(tmp_path / "torch_local.pt"),
                    str(tmp_path / "out.pt"),
                    to="full",
                    layout_from=str(tmp_path / "layout.pt"),
                )
    convert_checkpoint(
        str(tmp_path / "torch_local.pt"), str(tmp_path / "out.pt"), to="full", layout_from=str(tmp_path / "layout.pt")
    )
    model = torch.load(tmp_path / "out.pt", weights_only=True)["model"]
    assert torch.equal(model["w"], flat[:12].view(3, 4)) and torch.equal(model["b"], flat[12:15])
    with pytest.raises(CheckpointError, match=r"nothing\.pt \(the layout to use\) carries no flat-parameter layout"):
        convert_checkpoint(
            str(tmp_path / "torch_local.pt"),
            str(tmp_path / "out2.pt"),
            to="full",
            layout_from=str(tmp_path / "nothing.pt"),
        )


def test_local_checkpoint_from_another_world_size_on_disk(tmp_path) -> None:
    """A LOCAL checkpoint whose chunks (4 ranks) contradict its record (2 ranks)."""
    full_checkpoint(tmp_path / "source.pt")
    with TorchFile(str(tmp_path / "source.pt")) as source:
        flat = Flattened(source, [record(2)])
        four = [((o,), (n,)) for o, n in record(4).rank_chunks()]
        assert four != [((o,), (n,)) for o, n in record(2).rank_chunks()]
        four[-1] = ((four[-1][0][0],), (record(2).numel - four[-1][0][0],))  # the 2-rank numel, cut as 4 ranks would
        write_dcp(flat, str(tmp_path / "local"), {("model", "_flat_param"): four}, lambda *_: None)
    with pytest.raises(
        CheckpointError,
        match=r"model\._flat_param in .*local is stored in chunks .* but its layout "
        r"record says it was saved at world size 2.*different saves",
    ):
        convert_checkpoint(str(tmp_path / "local"), str(tmp_path / "out.pt"), to="full")


def test_damaged_layout_record_on_disk(tmp_path) -> None:
    state = full_checkpoint(tmp_path / "source.pt")
    convert_checkpoint(str(tmp_path / "source.pt"), str(tmp_path / "local"), to="local")
    cases = [
        (torch.tensor([1, 2, 3], dtype=torch.uint8), "the flat-parameter layout record is not readable"),
        (torch.zeros(3), "a flat-parameter layout record must be a 1-D uint8 tensor"),
    ]
    for bad, message in cases:
        torch.save({**state, "layout": {"_flat_param_meta": bad}}, tmp_path / "bad.pt")
        with pytest.raises(CheckpointError, match=r"layout\._flat_param_meta in .*bad\.pt: " + message):
            convert_checkpoint(str(tmp_path / "bad.pt"), str(tmp_path / "local"), to="local")


# --------------------------------------------------------------------------------------------------------------------
# The record in in-memory LOCAL loads (on ranks)


def _local(config: Config) -> dict:
    _, model = build_ours(config)
    with warnings.catch_warnings(), layout_keys():
        warnings.simplefilter("ignore")
        with FSDP.state_dict_type(model, StateDictType.LOCAL_STATE_DICT):
            return {k: v for k, v in model.state_dict().items() if k.endswith("_meta")}


def _load_with_records(config: Config, records: dict, message: str) -> None:
    _, model = build_ours(config)
    before = full_params(model)
    with warnings.catch_warnings(), layout_keys():
        warnings.simplefilter("ignore")
        with FSDP.state_dict_type(model, StateDictType.LOCAL_STATE_DICT):
            sd = model.state_dict()
            assert FlatParamRecord.from_tensor(sd["_flat_param_meta"], "root").world_size == dist_world_size()
            model.load_state_dict(sd)  # its own record is accepted
            with pytest.raises(RuntimeError, match=message):
                model.load_state_dict({**sd, **records})
    assert all(torch.equal(full_params(model)[k], v) for k, v in before.items()), "nothing loaded"


def dist_world_size() -> int:
    import torch.distributed as dist

    return dist.get_world_size()


def test_local_load_checks_the_record() -> None:
    """use_orig_params pads the flat parameter to a multiple of the world size: a record from 2 ranks is refused on 4
    with the conversion command; a record of another unit and a damaged record are refused too."""
    config = Config("net", use_orig_params=True)
    saved = run_on_ranks(_local, 2, config)[0]
    run_on_ranks(
        _load_with_records,
        4,
        config,
        {"_flat_param_meta": saved["_flat_param_meta"]},
        r"_flat_param is a LOCAL_STATE_DICT saved with world size 2 but this model runs with world size 4.*"
        r"tools/convert_checkpoint\.py CHECKPOINT NEW_CHECKPOINT --to local --world-size 4",
    )
    run_on_ranks(
        _load_with_records,
        2,
        config,
        {"_flat_param_meta": saved["block._flat_param_meta"]},
        r"_flat_param: the checkpoint's flat parameter holds \[fc1\.weight \[5, 5\]@0, .*this model's holds "
        r"\[l1\.weight \[5, 3\]@0, .*--layout-from",
    )
    run_on_ranks(
        _load_with_records,
        2,
        config,
        {"_flat_param_meta": torch.zeros(4, dtype=torch.uint8)},
        r"_flat_param_meta: the flat-parameter layout record is not readable",
    )
