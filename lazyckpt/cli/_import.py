"""``lazyckpt import``: store a safetensors or ``torch.save`` file as a committed snapshot,
reading the file shard by shard."""

from __future__ import annotations

import argparse
import asyncio
import collections.abc
import json
import math
import os
import pickle
import struct
from dataclasses import replace
from pathlib import Path
from typing import Any, Protocol

import torch

from .._errors import (
    CorruptionError,
    LazyCkptError,
)
from .._format.entries import ShardMeta
from .._format.manifest import LayoutOptions, Manifest, plan_layout
from .._format.values import dtype_from_name, has_tag
from .._format.walk import JSON, TensorRef, walk_state
from .._progress import format_bytes
from ._console import Console
from ._formats import FROM_SAFETENSORS, sniff_format
from ._location import opened
from ._status import (
    EXIT_NOT_FOUND,
    EXIT_OK,
    EXIT_USAGE,
    CommandError,
)
from ._write import put_all, writing


class _Source(Protocol):
    """A file being imported: its state as a tree and tensor references, and its bytes."""

    tree: JSON
    refs: list[TensorRef]
    pickled: bool

    def fill(self, manifest: Manifest, shard: ShardMeta, out: memoryview) -> None:
        """Copy the shard's bytes from the file into ``out`` (gaps zeroed). Blocking."""


def _zero_gaps(manifest: Manifest, shard: ShardMeta, out: memoryview) -> None:
    # Alignment gaps in a pack are part of the stored bytes; zero them so they are defined.
    for lo, hi in manifest.segment_gaps(shard):
        out[lo:hi] = bytes(hi - lo)


class _TorchSource:
    """A ``torch.save`` file, memory-mapped so its tensors are paged in as shards need them."""

    def __init__(self, path: Path, allow_pickle: bool, under: str | None) -> None:
        try:
            try:
                obj = torch.load(path, map_location="cpu", mmap=True, weights_only=not allow_pickle)
            except RuntimeError as exc:
                if "mmap" not in str(exc):
                    raise
                # The legacy (pre-zip) format cannot be mapped; it is loaded whole.
                obj = torch.load(path, map_location="cpu", weights_only=not allow_pickle)
        except pickle.UnpicklingError:
            raise CommandError(
                f"{path} does not load with weights_only=True: it holds objects other than "
                "tensors and plain data (loading those runs code from the file; pass "
                "--allow-pickle if you trust it), or it is not a torch file",
                EXIT_USAGE,
            ) from None
        except (RuntimeError, EOFError, ValueError) as exc:
            raise CommandError(f"{path} cannot be read by torch.load: {exc}") from None
        if under is not None:
            obj = {under: obj}
        if not isinstance(obj, collections.abc.Mapping):
            raise CommandError(
                f"{path} holds a {type(obj).__qualname__}, not a mapping; pass --under KEY "
                "to store it under a key",
                EXIT_USAGE,
            )
        self.tree, self.refs = walk_state(obj, allow_pickle=allow_pickle)
        self.pickled = has_tag(self.tree, "$pickle")

    def fill(self, manifest: Manifest, shard: ShardMeta, out: memoryview) -> None:
        """Copy the shard's pieces of the mapped tensors into ``out`` (gaps zeroed)."""
        _zero_gaps(manifest, shard, out)
        dest = torch.frombuffer(out, dtype=torch.uint8)
        for seg in shard.segments:
            src = manifest.tensor_part(seg, self.refs[seg.tensor].tensor.detach())
            manifest.shard_part(seg, dest).copy_(src)


class _SafetensorsSource:
    """A safetensors file, read with ``pread`` shard by shard (its tensors are raw bytes)."""

    def __init__(self, path: Path, under: str | None) -> None:
        self.path = path
        with path.open("rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise CommandError(f"{path} is not a safetensors file (too short)")
            (size,) = struct.unpack("<Q", head)
            if size > 100 << 20:
                raise CommandError(f"{path} is not a safetensors file (header of {size} bytes)")
            try:
                header = json.loads(f.read(size))
            except ValueError as exc:
                raise CommandError(f"{path} is not a safetensors file: {exc}") from None
        self.data_start = 8 + size
        if not isinstance(header, dict):
            raise CommandError(f"{path} is not a safetensors file (header is not an object)")
        metadata = header.pop("__metadata__", None) or {}
        self.spans: dict[str, tuple[int, int]] = {}
        tensors: dict[str, torch.Tensor] = {}
        for name, entry in header.items():
            try:
                dtype = dtype_from_name(FROM_SAFETENSORS[entry["dtype"]])
                shape = [int(d) for d in entry["shape"]]
                begin, end = (int(x) for x in entry["data_offsets"])
            except (KeyError, TypeError, ValueError, LazyCkptError):
                raise CommandError(
                    f"{path}: tensor {name!r} has a dtype or layout lazyckpt cannot read: "
                    f"{entry!r:.120}"
                ) from None
            if end - begin != math.prod(shape) * dtype.itemsize:
                raise CommandError(f"{path}: tensor {name!r} has the wrong number of bytes")
            self.spans[name] = (begin, end)
            # A zero-stride view has the right shape and dtype for the layout planner while
            # holding one element: the bytes stay in the file until a shard needs them.
            tensors[name] = torch.empty((), dtype=dtype).expand(shape)
        self.pickled = False
        rebuilt = self._lazyckpt_state(metadata, tensors)
        if rebuilt is not None and under is None:
            self.tree, self.refs, order = rebuilt
        else:
            ordered = sorted(tensors, key=lambda n: self.spans[n][0])
            state: dict[str, Any] = {name: tensors[name] for name in ordered}
            self.tree, self.refs = walk_state(
                state if under is None else {under: state}, allow_pickle=False
            )
            order = ordered
        self.names = order

    def _lazyckpt_state(
        self, metadata: dict[str, Any], tensors: dict[str, torch.Tensor]
    ) -> tuple[JSON, list[TensorRef], list[str]] | None:
        """The exact state of a file ``lazyckpt export`` wrote (plain values and tied
        weights kept), or None when the file carries no such record or it does not match."""
        try:
            tree = json.loads(metadata["lazyckpt.tree"])
            listing = json.loads(metadata["lazyckpt.tensors"])
            refs = []
            for i, (key, alias_of) in enumerate(listing):
                if alias_of is not None and not (type(alias_of) is int and 0 <= alias_of < i):
                    return None
                refs.append(TensorRef(key, tensors[key], None, alias_of))
        except (KeyError, TypeError, ValueError):
            return None
        if len(refs) != len(tensors):
            return None
        return tree, refs, [r.key for r in refs]

    def fill(self, manifest: Manifest, shard: ShardMeta, out: memoryview) -> None:
        """Read the shard's pieces from the file into ``out`` with ``preadv`` (gaps zeroed)."""
        _zero_gaps(manifest, shard, out)
        fd = os.open(self.path, os.O_RDONLY)
        try:
            for seg in shard.segments:
                begin, _ = self.spans[self.names[seg.tensor]]
                start, nbytes = manifest.segment_span(seg)
                done = 0
                while done < nbytes:
                    view = out[seg.offset + done : seg.offset + nbytes]
                    n = os.preadv(fd, [view], self.data_start + begin + start + done)
                    if n == 0:
                        raise CorruptionError(f"{self.path} is truncated")
                    done += n
        finally:
            os.close(fd)


async def import_command(args: argparse.Namespace, ui: Console) -> int:
    """``lazyckpt import``: plan the file's state as a snapshot, write and commit it."""
    path = Path(args.file)
    if not await asyncio.to_thread(path.is_file):
        raise CommandError(f"{path}: no such file", EXIT_NOT_FOUND)
    fmt = args.format or await asyncio.to_thread(sniff_format, path)
    source: _Source
    if fmt == "torch":
        source = await asyncio.to_thread(_TorchSource, path, args.allow_pickle, args.under)
    else:
        source = await asyncio.to_thread(_SafetensorsSource, path, args.under)
    layout = LayoutOptions(shard_size=args.shard_size, pack_bytes=min(1 << 20, args.shard_size))
    plan = plan_layout(args.step, source.tree, source.refs, layout, pickled=source.pickled)
    async with opened(args.to, create=True) as loc:
        if args.step in await loc.tier.steps():
            raise CommandError(
                f"{loc}: step {args.step} is already committed; choose another step or remove "
                "it first",
                EXIT_USAGE,
            )
        async with writing(loc.tier, plan) as write:
            crcs = await put_all(
                write, source.fill, None, ui, f"import step {args.step}", args.jobs
            )
            manifest = plan.with_checksums(crcs)
            extra = {"tier": loc.tier.describe(), "imported": {"format": fmt, "name": path.name}}
            await write.commit(replace(manifest, extra=extra))
    ui.note(
        f"imported {path.name} as step {args.step} into {loc} "
        f"({len(plan.tensors)} tensors, {format_bytes(plan.tensor_bytes)})"
    )
    return EXIT_OK
