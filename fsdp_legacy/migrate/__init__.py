"""`fsdp-legacy migrate`: FSDP1 programs rewritten onto FSDP2 (`fully_shard`) and torch's state-dict helpers.

rewriter.py drives one file through the LibCST transformer, after survey.py has read the whole file: construction.py
maps `FSDP(...)`, manual_wrap.py `enable_wrap`/`wrap`, summon.py summon_full_params blocks, state_dict_type.py the
state-dict types (set_state_dict_type followed through the file; type_blocks.py which blocks go, configs.py their
configs, bindings.py names followed to their one assignment), optim_state.py the optimizer-state API (legacy calls
included; sharded_resume.py the DCP recipe's load_sharded_optimizer_state_dict), precision.py standalone
MixedPrecision policies, apply_call.py FSDP1's `apply`, reorder.py moves statements around a construction, names.py
knows the FSDP1 names; report.py words what could not be mapped, internals.py FSDP1's private modules. A file
that must stay FSDP1 as a whole is left as it is: a subclass of FSDP1's class (subclasses.py), a state-dict type it
cannot follow (returned_model.py follows a model a function builds and returns, and a type set there, to its
callers). program.py migrates the files of a program together (facts.py: what the other files tell one file;
policies.py: MixedPrecision policies shared between files, and who imports what), rewriter.py drives one file,
transformer.py is its LibCST transformer.

runtime.py (with optim_runtime.py) holds the helpers migrated programs import: apply_fully_shard (an FSDP1 auto-wrap
policy's units sharded with `fully_shard`, meta modules materialized as FSDP1 does), full_params (summon_full_params
for reading), apply_full (FSDP1's apply), hybrid_mesh (HYBRID_SHARD's pair of groups as a 2-D mesh),
unshared_optim_state and rekey_optim_state_dict (FSDP1's optimizer state dicts carried over),
full_/sharded_state_dict_options (FSDP1's configs built at run time). Nothing here imports LibCST at import time, so
a migrated program needs only torch and this package, not the `migrate` extra.
"""
