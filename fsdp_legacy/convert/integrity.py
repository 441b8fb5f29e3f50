"""CRC-32 checks of torch.save archives. torch.save writes a CRC-32 for every record of its zip archive, but
torch.load never checks them, so a flipped bit in tensor data loads silently; the converter checks every archive it
reads (a whole file, or each item of a DCP checkpoint) and fixes the CRCs of the archives it fills in place."""

import lzma
import struct
import zipfile
import zlib
from typing import BinaryIO

from .archive_names import tensors_in_record
from .errors import CheckpointError

_BLOCK = 1 << 20
_LOCAL_HEADER = struct.Struct("<4s5H3L2H")  # signature ... name length, extra length: 30 bytes
_CENTRAL_HEADER = struct.Struct("<4s6H3L5H2L")  # ... name, extra, comment lengths: 46 bytes
_LOCAL_CRC, _CENTRAL_CRC = 14, 16  # byte offsets of the CRC-32 field in each header
_DESCRIPTOR_FLAG, _DESCRIPTOR_SIGNATURE = 0x08, b"PK\x07\x08"  # torch writes a data descriptor after each record

# What zipfile raises on a damaged archive besides BadZipFile: a flipped bit in a header can name a compression method
# it lacks (NotImplementedError), set the encryption flag (RuntimeError, "password required"), or make stored bytes
# read as deflate or LZMA (zlib.error, lzma.LZMAError); bzip2 and short reads raise OSError and EOFError.
ZIP_ERRORS: tuple[type[Exception], ...] = (
    zipfile.BadZipFile,
    zipfile.LargeZipFile,
    EOFError,
    OSError,
    ValueError,
    NotImplementedError,
    RuntimeError,
    zlib.error,
    lzma.LZMAError,
)


def check_archive(file: BinaryIO, where: str) -> None:
    """Raise CheckpointError naming `where` unless `file` is a complete torch.save archive whose records all match
    their CRC-32."""
    try:
        with zipfile.ZipFile(file) as archive:
            bad = archive.testzip()
            tensors = tensors_in_record(archive, bad) if bad is not None else []
    except ZIP_ERRORS as error:
        raise CheckpointError(
            f"{where} is not a readable torch.save archive ({error}): it is truncated or corrupted, or was written "
            "by torch.save(_use_new_zipfile_serialization=False). Restore it from a copy, or save it again."
        ) from None
    if bad is not None:
        holding = f" (the data of {', '.join(tensors)})" if tensors else ""
        raise CheckpointError(
            f"{where} is corrupted: its record {bad!r}{holding} does not match the CRC-32 torch.save wrote for it (the "
            "data changed after saving). Restore the file from a copy or re-create the checkpoint."
        )


def rewrite_crcs(path: str) -> None:
    """Recompute the CRC-32 of every record of the archive at `path`, after its data was written in place."""
    with zipfile.ZipFile(path) as archive:
        infos, central = archive.infolist(), archive.start_dir
    with open(path, "r+b") as file:
        for info in infos:
            file.seek(info.header_offset)
            header = _LOCAL_HEADER.unpack(file.read(_LOCAL_HEADER.size))
            name_length, extra_length = header[-2:]
            data = info.header_offset + _LOCAL_HEADER.size + name_length + extra_length
            crc = struct.pack("<L", _crc(file, data, info.file_size))
            if info.flag_bits & _DESCRIPTOR_FLAG:  # the CRC follows the data (the local header holds zero)
                file.seek(data + info.compress_size)
                file.seek(data + info.compress_size + (4 if file.read(4) == _DESCRIPTOR_SIGNATURE else 0))
            else:
                file.seek(info.header_offset + _LOCAL_CRC)
            file.write(crc)
            file.seek(central)
            entry = _CENTRAL_HEADER.unpack(file.read(_CENTRAL_HEADER.size))
            file.seek(central + _CENTRAL_CRC)
            file.write(crc)
            central += _CENTRAL_HEADER.size + sum(entry[10:13])


def _crc(file: BinaryIO, start: int, size: int) -> int:
    crc = 0
    file.seek(start)
    while size:
        block = file.read(min(size, _BLOCK))
        if not block:
            raise CheckpointError(f"{file.name} ended before the data of one of its records: it is truncated.")
        crc = zlib.crc32(block, crc)
        size -= len(block)
    return crc
