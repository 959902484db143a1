"""Zarr v3 data types for torch dtypes, and what a Zarr array of each needs (fill value,
byte codec). dtypes Zarr lacks are stored as unsigned integers of the same width; the
attributes say what they really are."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from lazyckpt.tier import ConfigurationError, TensorMeta

_STORAGE_DTYPE: Mapping[str, str] = {
    "float64": "float64",
    "float32": "float32",
    "float16": "float16",
    "complex128": "complex128",
    "complex64": "complex64",
    "complex32": "uint32",
    "bool": "bool",
    "uint8": "uint8",
    "int8": "int8",
    "int16": "int16",
    "int32": "int32",
    "int64": "int64",
    "uint16": "uint16",
    "uint32": "uint32",
    "uint64": "uint64",
    "bfloat16": "uint16",
    "float8_e4m3fn": "uint8",
    "float8_e5m2": "uint8",
    "float8_e4m3fnuz": "uint8",
    "float8_e5m2fnuz": "uint8",
    "float8_e8m0fnu": "uint8",
}
_UNSIGNED_OF_WIDTH = {1: "uint8", 2: "uint16", 4: "uint32", 8: "uint64"}


def storage_dtype(meta: TensorMeta) -> str:
    """The Zarr data type a tensor is stored as (``bfloat16`` -> ``uint16``)."""
    found = _STORAGE_DTYPE.get(meta.dtype) or _UNSIGNED_OF_WIDTH.get(meta.itemsize)
    if found is None:  # pragma: no cover - every torch dtype lazyckpt accepts has a width above
        raise ConfigurationError(f"tensor {meta.key!r}: no Zarr data type for {meta.dtype}")
    return found


def _fill_value(data_type: str) -> Any:
    if data_type == "bool":
        return False
    if data_type.startswith("complex"):
        return [0.0, 0.0]
    if data_type.startswith("float"):
        return 0.0
    return 0


def _bytes_codec(data_type: str) -> dict[str, Any]:
    if np.dtype(data_type).itemsize == 1:
        return {"name": "bytes"}
    return {"name": "bytes", "configuration": {"endian": "little"}}
