"""The file formats ``export`` writes and ``import`` reads: safetensors dtype names, and telling
a file's format from its name or its first bytes."""

from __future__ import annotations

from pathlib import Path

from ._status import (
    EXIT_USAGE,
    CommandError,
)

# safetensors dtype names, by lazyckpt dtype name (the safetensors format's own list).
SAFETENSORS_DTYPES = {
    "float64": "F64",
    "float32": "F32",
    "float16": "F16",
    "bfloat16": "BF16",
    "int64": "I64",
    "int32": "I32",
    "int16": "I16",
    "int8": "I8",
    "uint64": "U64",
    "uint32": "U32",
    "uint16": "U16",
    "uint8": "U8",
    "bool": "BOOL",
    "complex64": "C64",
    "float8_e4m3fn": "F8_E4M3",
    "float8_e4m3fnuz": "F8_E4M3FNUZ",
    "float8_e5m2": "F8_E5M2",
    "float8_e5m2fnuz": "F8_E5M2FNUZ",
}


FROM_SAFETENSORS = {v: k for k, v in SAFETENSORS_DTYPES.items()}


def format_of(path: str, given: str | None) -> str:
    """The format ``export`` writes: ``given``, else from the file name's suffix."""
    if given is not None:
        return given
    suffix = Path(path).suffix.lower()
    if suffix == ".safetensors":
        return "safetensors"
    if suffix in (".pt", ".pth", ".bin", ".ckpt"):
        return "torch"
    raise CommandError(
        f"cannot tell the format from {path!r}; pass --format safetensors or --format torch",
        EXIT_USAGE,
    )


def sniff_format(path: Path) -> str:
    """The format of a file to import, from its first bytes (zip or pickle: torch)."""
    with path.open("rb") as f:
        head = f.read(9)
    if head[:4] == b"PK\x03\x04" or head[:2] == b"\x80\x02":
        return "torch"
    if len(head) == 9 and head[8:9] == b"{":
        return "safetensors"
    raise CommandError(
        f"cannot tell the format of {path}; pass --format safetensors or --format torch",
        EXIT_USAGE,
    )
