"""The tests of the seams between torch releases: what the releases other than 2.13.0 run in CI (`pytest -m seams`).

The whole suite runs on torch 2.13.0 (the README's test command). The other supported releases (2.11 to 2.15) share
our code and differ from 2.13.0 only where torch itself differs between releases; those places are listed below, each
with the tests that cross it. A test is chosen because it crosses a seam, not because of the file it is in; the
matrices (strategies x options x world sizes) that only multiply the same code paths run once, on 2.13.0.

conftest.py marks every collected test whose node id matches a pattern here with `seams`, and fails the session when a
pattern matches nothing (a renamed test must not silently leave the seams' coverage).
"""

from __future__ import annotations

from fnmatch import fnmatchcase

# seam -> node-id patterns (fnmatch, matched against "file::test[params]")
SEAMS: dict[str, tuple[str, ...]] = {
    # torch 2.13 renamed the single-tensor collectives; FSDP1's numerics (pre/post divide, padding) are torch's own:
    # training equal to torch's FSDP1 and to DDP, one case per strategy and option family.
    "collectives and numerics": (
        "test_parity.py::test_matches_torch_fsdp1[[]transformer_*",
        "test_parity.py::test_matches_torch_fsdp1[[]moe_*",
        "test_parity.py::test_matches_torch_fsdp1[[]*_w1]",
        "test_parity.py::test_matches_ddp[[]frozen_*",
        "test_mixed_precision.py::test_matches_torch_fsdp1*",
        "test_runtime.py::test_layout_matches_torch_*",
        "test_overlap.py::test_values_equal_torch_fsdp1",
        "test_grad_scaler.py::*",
        "test_pair_exchange.py::test_exchange_of_halves_is_c10d_bit_for_bit[[]float32]",
        "test_pair_exchange.py::test_exchange_within_pairs_of_a_larger_world",
    ),
    # torch's messages and warnings (wording changed between releases), signatures and public surface.
    "messages and API surface": (
        "test_api.py::*",
        "test_wrap.py::test_public_surface_matches_torch",
        "test_wrap.py::test_matches_torch_transformer_*_mp",
        "test_wrap.py::test_mixed_precision_*",
        "test_optim_state.py::test_signatures_match_torch",
        "test_optim_state.py::test_deprecated_api*",
        "test_state_dict_mesh.py::test_local_state_dict_with_a*mesh_is_refused_as_torch*",
        "test_torch_internal_checks_state.py::test_validate_frozen_params_messages_*",
        "test_same_model.py::test_torch_order_check_reports_ranks_that_run_different_units_0*",
        "test_same_model.py::test_a_later_change_of_order_warns_as_torch_0*",
    ),
    # DCP: the metadata dcp.save returns and writes (2.11 returns it without the files), planners, loading.
    "torch.distributed.checkpoint": (
        "test_layout_records.py::*",
        "test_state_dict.py::test_dcp_checkpoint_loads_at_another_world_size*",
        "test_state_dict.py::test_sharded_checkpoint_loads_into_fsdp2*",
        "test_convert.py::*",
        "test_checkpoint_helpers.py::test_round_trip_through_dcp_continues_identically*",
        "test_checkpoint_helpers.py::test_same_keys_and_values_as_torch_helpers_on_torch_fsdp1*",
        "test_checkpoint_helpers.py::test_invalid_options_are_refused_as_torch_refuses_them",
        "test_checkpoint_helpers.py::test_submodules_deprecated_as_in_torch",
        "test_partial_resume.py::*",
        "test_latest_checkpoint.py::*",
        "test_faults.py::test_dcp_*",
        "test_async_save.py::test_dcp_saved_in_the_background_*",  # dcp.async_save, its staging and future
        "test_rank_file.py::*",  # ShardedTensor's pickled form, rebuilt by load_rank_state
    ),
    # A pickled DeviceMesh (its _layout changed in 2.13), 1-D and 2-D meshes in state dicts.
    "device meshes": (
        "test_state_dict_mesh.py::test_hsdp_dcp_checkpoint_loads_into_torch_and_other_meshes*",
        "test_state_dict_mesh.py::test_1d_mesh_round_trip_matches_torch[[]*-2]",
        "test_state_dict_mesh.py::test_hsdp_2d_mesh_round_trip_matches_torch[[]*-uop-uneven]",
        "test_optim_state.py::test_device_mesh_dtensor_matches_torch*",
        "test_tensor_parallel_migration.py::*",
    ),
    # ShardedTensor (deprecated for DTensor) and DTensor in SHARDED state dicts; FSDP2 as a checkpoint target.
    "ShardedTensor and DTensor": (
        "test_state_dict.py::test_matches_torch_fsdp1*",
        "test_state_dict.py::test_torch_fsdp1_state_dict_loads_into_ours*",
        "test_state_dict.py::test_our_state_dict_loads_into_torch_fsdp1*",
        "test_optim_state.py::test_optim_state_dict_matches_torch[[]*",
        "test_optim_state.py::test_exchange_with_torch*",
        "test_optim_state.py::test_training_continues_identically_in_fsdp2*",
        "test_optim_state.py::test_fsdp2_checkpoint_continues_identically_in_ours*",
        "test_without_sharded_tensor.py::*-2]",
        "test_tensor_parallel.py::test_state_dicts_match_torch_and_resume_exactly*",
        "test_tensor_parallel.py::test_training_matches_torch_fsdp1_and_reference*",
    ),
    # The legacy optimizer-state API, the first piece of FSDP1 torch removes.
    "legacy optimizer-state API": ("test_legacy_optim_api.py::*",),
    # Dynamo and inductor: what Dynamo inlines and guards changes with every release.
    "torch.compile": (
        # (each inductor build costs seconds: the runtime's paths once each, the dtype and world-size cases on 2.13.0)
        "test_compile.py::test_compiled_model_matches_torch_fsdp1[[]FULL_SHARD_uop_BACKWARD_PRE_*inductor_w2]",
        "test_compile.py::test_compiled_model_matches_torch_fsdp1[[]FULL_SHARD_uop_offload_*]",
        "test_compile.py::test_compiled_model_matches_torch_fsdp1[[]FULL_SHARD_flat_*]",
        "test_compile.py::test_fullgraph_is_refused_with_the_fix_on_every_rank",
        "test_compile.py::test_graphs_hold_the_blocks_code_and_nothing_of_the_runtime",
        "test_compile.py::test_switch_during_dynamos_own_import",
        "test_compile.py::test_state_dicts_of_compiled_model*",
    ),
    # torch FSDP1's internals (attributes, private helpers, module contents) and the switch into torch's namespace,
    # with a torch that has no FSDP1 at all.
    "FSDP1 internals and the switch": (
        "test_compat.py::*",
        "test_without_fsdp1.py::*",
        "test_public_paths.py::*",
        "test_torch_internals_flat_param.py::*",
        "test_torch_internals_handles.py::*",
        "test_torch_internals_checkpointer.py::*",
        "test_torch_internal_checks.py::*",
        "test_torch_internal_checks_state.py::*",
        # (one case each of the newer mirrors: torch's private names and their signatures are what moves)
        "test_torch_internal_setattr.py::*[[]True]",
        "test_torch_internal_lazy_init.py::test_units_that_ran_wrapped_into_a_larger_model_after_a_reset",
        "test_torch_internal_manual_reduce.py::test_gradients_reduced_by_hand_after_no_sync_as_in_torch[[]FULL_SHARD]",
        "test_torch_internal_streams.py::*",
        "test_torch_internal_handle_by_hand.py::test_handle_built_by_hand_then_sharded_[02]_FULL_SHARD",
        "test_torch_internal_handle_by_hand.py::test_shard_metadata_of_any_interval_*",
        "test_torch_internal_optim_impl.py::*",
        "test_torch_internal_prefetch_limits.py::*[[]2]",
        "test_torch_internal_divide_factors.py::*[[]FULL_SHARD]",
        "test_torch_internal_composable_state.py::*",
        "test_torch_internal_patches.py::*",
        "test_torch_internal_unshard_grad.py::*[[]FULL_SHARD-*]",
        "test_torch_internal_memory_order.py::test_parameters_in_memory_order_as_torch[[]FULL_SHARD-flat]",
        "test_torch_internal_manual_reduce.py::test_the_codes_own_post_backward_hook_reduces_as_torch[[]bf16_reduce-FULL_SHARD]",
        "test_torch_parity_harness.py::*[[]NestedWrappedModule]",
    ),
}


def seam_of(nodeid: str) -> str | None:
    """The seam a test crosses (the first that lists it), or None."""
    name = nodeid.rsplit("/", 1)[-1]
    for seam, patterns in SEAMS.items():
        if any(fnmatchcase(name, pattern) for pattern in patterns):
            return seam
    return None


def unmatched(nodeids: list[str]) -> list[str]:
    """The patterns that match none of `nodeids`."""
    names = [nodeid.rsplit("/", 1)[-1] for nodeid in nodeids]
    return [
        pattern
        for patterns in SEAMS.values()
        for pattern in patterns
        if not any(fnmatchcase(name, pattern) for name in names)
    ]
