"""What the other files of a program, migrated together (program.py), tell the rewrite of one file."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field


@dataclass(frozen=True)
class ImportedPolicy:
    """A `name = MixedPrecision(...)` of another file, imported here: what FSDP2's policy would lack."""

    origin: str  # `path:line` of its assignment
    buffer_dtype: str | None  # its buffer_dtype's code, which the construction taking it must cast the buffers to
    refused: tuple[str, ...]  # its arguments FSDP2's MixedPrecisionPolicy has no counterpart for
    kept: str | None = None  # why it stays FSDP1's (then so does every construction taking it)


@dataclass(frozen=True)
class FileFacts:
    """One file's view of the program (empty: the file is migrated alone)."""

    # FSDP1 subclasses the other files define: name -> `path:line`
    subclasses: Mapping[str, str] = field(default_factory=dict)
    # local names bound to another file's MixedPrecision(...) that FSDP(...) here may take as fully_shard's policy
    policies: Mapping[str, ImportedPolicy] = field(default_factory=dict)
    # this file's module-level MixedPrecision names used by other files: whether each of those uses becomes
    # FSDP2's (False: one stays FSDP1, so the policy must stay FSDP1's too)
    policy_uses: Mapping[str, bool] = field(default_factory=dict)
    # this file's names other files import (`*`: a star import of it) -> where, as a finding words it: a function
    # returning a wrapped model to callers there is not followed (returned_model.py)
    read_elsewhere: Mapping[str, str] = field(default_factory=dict)
    # whether some file of the program calls set_state_dict_type: then a function's FSDP1 model outside its blocks
    # may have any type, not FSDP1's default (methods.py)
    state_dict_setters: bool = False
    # the FSDP1 keywords constructions of the other files (that became fully_shard) read at run time: this file's
    # MixedPrecision / CPUOffload values and policies may be what they read, FSDP1's as they are (fsdp1_options and
    # apply_fully_shard take them)
    run_time_reads: frozenset[str] = frozenset()
    # the names here bound to a wrapped model that a function of another file returns (cross_file.py)
    imported_models: frozenset[str] = frozenset()
    # this file's functions returning the model to callers in other files, which cross_file.py follows (-> where):
    # a state-dict type set on it there is not followed
    followed_elsewhere: Mapping[str, str] = field(default_factory=dict)
    # this file's module-level functions -> the parameters every call in the program gives a wrapped model
    # (handed_models.py)
    wrapped_params: Mapping[str, frozenset[str]] = field(default_factory=dict)
    # whether another file hands a wrapped model to a function here (followed or not): its FSDP1 calls are looked
    # at even where the file names no FSDP
    receives_models: bool = False
    # this file's module-level functions -> the parameters some calls, not all, give a wrapped model: their
    # state-dict calls are FSDP1's full dict for those calls and a plain module's for the others (reported)
    sometimes_wrapped_params: Mapping[str, frozenset[str]] = field(default_factory=dict)
    # of `wrapped_params`, those some call hands a name wrapped on some runs only (maybe_wrapped.py): FSDP1's
    # default-type state-dict calls on them keep their plain form for the other runs
    maybe_plain_params: Mapping[str, frozenset[str]] = field(default_factory=dict)
    # this file's module-level functions -> the parameters every call hands something other than a wrapped model:
    # a name they share with a wrapped model of the file is not it there
    plain_params: Mapping[str, frozenset[str]] = field(default_factory=dict)
    # this file's module-level classes some construction in the program hands a wrapped model: a `.module` read on
    # their methods' parameters or `self`'s attributes is FSDP1's wrapped module on some runs (methods.py)
    receiving_classes: frozenset[str] = frozenset()
    # the local names this file imports from the program's own files (names and modules): calls through them are
    # followed there, not another library's (foreign.py)
    program_names: frozenset[str] = frozenset()
