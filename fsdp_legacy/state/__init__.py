"""State dicts and checkpoints: what a model and its optimizer save and load, and the files they go to.

    state_dict.py             model state dict types and settings (FULL, SHARDED, LOCAL), and saving them
    state_dict_loading.py     loading a model state dict of any type (load_state_dict's hooks)
    state_dict_dtensor.py     SHARDED values as DTensors (a device mesh, or a torch without ShardedTensor)
    sharded_tensor_compat.py  torch's ShardedTensor while torch has it
    optim_entries.py          what each parameter an optimizer holds stands for (FQNs, layout), for both below
    optim_state.py            saving optimizer state dicts (FSDP.optim_state_dict)
    optim_state_loading.py    loading them (FSDP.optim_state_dict_to_load)
    optim_state_named.py      optimizer state dicts keyed by parameter name (_NamedOptimizer), re-keyed by id
    optim_state_legacy.py     torch's older optimizer-state API (full_optim_state_dict, scatter_..., rekey_...)
    checkpoint.py             torch's DSD helpers (get_/set_state_dict, ...) for our models: fsdp_legacy.checkpoint
    dcp_checkpoint.py         dcp.save / dcp.load plus layout records, save id, CRC-32s: fsdp_legacy.dcp_checkpoint
    save_identity.py          the identity that tells per-rank files of two saves apart
    hf_checkpoint.py          streamed full-model save/load as Hugging Face safetensors shards
    peers.py                  ranks that agree on a streamed save's or load's outcome through rank 0
    async_save.py             saves in the background (DCP, SHARDED from copies, full weights): AsyncSave
    background_state.py       SHARDED model and optimizer state dicts built from copies, away from training
    latest.py                 the newest complete checkpoint under a folder, agreed by every rank
    partial_load.py           a DCP load that would leave a section of the checkpoint behind is an error
    fresh_optim.py            a fresh optimizer's state dict as a load target: filled from the checkpoint
    dcp_load_hook.py          torch's dcp.load, which fills such targets first
    rank_file.py              one rank's torch.save LOCAL/SHARDED file read back without running pickled code

Every module here works on units (unit.py) and their handles (handle.py); fully_sharded_data_parallel.py assembles
the public methods from them. The offline converter (convert/) reads the same files without any model code; the
file formats both use live below both (convert/, and safetensors_format.py for safetensors), never here.
"""
