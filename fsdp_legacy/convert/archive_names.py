"""Which tensors of a torch.save archive keep their bytes in one of its records, to name them when that record fails
its CRC-32 (integrity.py): torch.save writes each storage as a record `<archive>/data/<key>`, and its pickle refers to
the storage by that key (a persistent id `("storage", type, key, location, numel)`) inside the call that rebuilds
each tensor.

The pickle is read by an unpickler that imports nothing and calls nothing: every global it names becomes an inert
stand-in that only keeps its arguments and state, and every storage a marker of its key. The object tree that comes
out is walked for the keys of dicts (state dict keys) down to the markers. Only on the error path, and best effort:
a pickle that cannot be read this way names no tensor.
"""

import collections
import io
import pickle
import zipfile
from typing import Any

_LIMIT = 10_000_000  # bytes of pickle read to name tensors (a state dict's pickle is a few bytes per tensor)


class _Storage:
    def __init__(self, key: str) -> None:
        self.key = key


class _Inert:
    """Any global of the pickle: keeps what it is given, runs nothing. (Built by REDUCE, cls(*args), or NEWOBJ,
    cls.__new__(cls, *args); an instance called, as getattr's result is, makes another.)"""

    parts: list[Any]

    def __new__(cls, *args: Any, **kwargs: Any) -> "_Inert":
        self = super().__new__(cls)
        self.parts = [*args, *kwargs.values()]
        return self

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def __call__(self, *args: Any, **kwargs: Any) -> "_Inert":
        return _Inert(*args, *kwargs.values())

    def __setstate__(self, state: Any) -> None:
        self.parts.append(state)

    def __setitem__(self, key: Any, value: Any) -> None:
        self.parts.append({key: value})

    def append(self, value: Any) -> None:
        self.parts.append(value)

    def extend(self, values: Any) -> None:
        self.parts.extend(values)


class _Unpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if (module, name) == ("collections", "OrderedDict"):
            return collections.OrderedDict
        if name == "getattr" and module in ("builtins", "__builtin__"):  # a nested class: a class again
            return lambda owner, attribute: type(str(attribute), (_Inert,), {})
        return type(name, (_Inert,), {})

    def persistent_load(self, pid: Any) -> Any:
        if isinstance(pid, tuple) and len(pid) >= 3 and pid[0] == "storage":
            return _Storage(str(pid[2]))
        return _Inert(pid)


def tensors_in_record(archive: zipfile.ZipFile, record: str) -> list[str]:
    """The dotted keys of the tensors whose storage is the data record `record` (empty where none can be told)."""
    prefix, _, key = record.rpartition("/data/")
    if not prefix:
        return []
    try:
        info = archive.getinfo(f"{prefix}/data.pkl")
        if info.file_size > _LIMIT:
            return []
        tree = _Unpickler(io.BytesIO(archive.read(info))).load()
        found: list[str] = []
        _walk(tree, (), key, found, set())
        return found
    except Exception:  # (a damaged pickle: the record is named without its tensors)
        return []


def _walk(value: Any, path: tuple[str, ...], key: str, found: list[str], seen: set[int], named: bool = True) -> None:
    """Down to the storages of `key`, naming the path by the keys of the state dict's own dicts (`named`), not by the
    fields of the objects inside it (a ShardedTensor's shard is a dict of "tensor" and "metadata")."""
    if id(value) in seen or len(found) >= 8:
        return
    seen.add(id(value))
    if isinstance(value, _Storage):
        if value.key == key and path:
            found.append(".".join(path))
        return
    if isinstance(value, dict):
        for name, item in value.items():
            _walk(item, (*path, str(name)) if named else path, key, found, seen, named)
    elif isinstance(value, (list, tuple)):
        for item in value:
            _walk(item, path, key, found, seen, named)
    elif isinstance(value, _Inert):
        for item in value.parts:
            _walk(item, path, key, found, seen, False)
