"""The file formats ``export`` writes and ``import`` reads: safetensors dtype names, telling a
file's format from its name or its first bytes, and the sharded layout of a Hugging Face
checkpoint directory (shard files and their index)."""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
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


# -- the sharded safetensors layout of Hugging Face checkpoints -----------------------------------

HF_INDEX = "model.safetensors.index.json"
"""The index of a sharded checkpoint: which file holds each tensor."""

HF_SHARD = re.compile(r"^model(-\d{5}-of-\d{5})?\.safetensors$")
"""The names of the weight files a Hugging Face checkpoint directory holds."""

DEFAULT_MAX_SHARD_BYTES = 5 << 30


def plan_shards(sizes: Sequence[int], max_bytes: int) -> list[list[int]]:
    """Tensors (by position in ``sizes``, in that order) grouped into shard files as
    ``transformers`` groups them: each file takes tensors in order until the next would take it
    past ``max_bytes``; a tensor larger than that gets a file of its own."""
    if max_bytes < 1:
        raise ValueError(f"the largest shard must be at least 1 byte, not {max_bytes}")
    shards: list[list[int]] = []
    current: list[int] = []
    filled = 0
    for i, size in enumerate(sizes):
        if size > max_bytes:
            shards.append([i])
            continue
        if current and filled + size > max_bytes:
            shards.append(current)
            current, filled = [], 0
        current.append(i)
        filled += size
    if current or not shards:
        shards.append(current)
    return shards


def shard_file_names(count: int) -> list[str]:
    """``model-00001-of-0000N.safetensors`` for each of ``count`` shard files."""
    return [f"model-{k:05d}-of-{count:05d}.safetensors" for k in range(1, count + 1)]


def index_document(weight_map: dict[str, str], total_size: int) -> bytes:
    """``model.safetensors.index.json``: the tensors' total size in bytes and each tensor's
    file, as ``transformers`` writes it."""
    doc = {
        "metadata": {"total_size": total_size},
        "weight_map": dict(sorted(weight_map.items())),
    }
    return (json.dumps(doc, indent=2) + "\n").encode()
