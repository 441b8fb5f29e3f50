"""`fsdp-legacy migrate`: FSDP1 programs rewritten onto FSDP2 (`fully_shard`) and torch's state-dict helpers.

rewriter.py drives one file through the LibCST transformer (construction.py maps `FSDP(...)`, summon.py
summon_full_params blocks, reorder.py moves statements around a construction, names.py knows the FSDP1 names),
report.py words what could not be mapped, runtime.py holds the helpers migrated programs import: apply_fully_shard
(an FSDP1 auto-wrap policy's units sharded with `fully_shard`, meta modules materialized as FSDP1 does) and
full_params (summon_full_params for reading). Nothing here imports LibCST at import time, so a migrated program needs
only torch and this package, not the `migrate` extra.
"""
