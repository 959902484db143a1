"""``lazyckpt export``: stream a snapshot into a safetensors file, a directory of sharded
safetensors files with their index (the layout ``transformers`` saves and loads), or a
``torch.save`` file, shard by shard, without holding the whole state in memory.

A step written by several ranks is exported as one process restores it: each distributed
tensor whole, at its global shape, assembled in memory from every rank's part."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import json
import os
import re
import struct
import zipfile
import zlib
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from .._errors import CorruptionError
from .._format.entries import TensorMeta
from .._format.manifest import Manifest
from .._format.values import StatefulValue, decode_tree
from .._format.walk import walk_state
from .._restore.reshard import restore_resharded
from ._console import Console
from ._formats import (
    DEFAULT_MAX_SHARD_BYTES,
    HF_INDEX,
    HF_SHARD,
    SAFETENSORS_DTYPES,
    format_of,
    index_document,
    plan_shards,
    shard_file_names,
)
from ._location import (
    Location,
    opened,
    pick_steps,
)
from ._read import ShardReader, damage_keys, global_shape, step_parts
from ._status import (
    EXIT_NOT_FOUND,
    EXIT_OK,
    EXIT_USAGE,
    CommandError,
)


@dataclass
class _Placement:
    """Where one stored tensor's bytes go: (output file, offset) for every copy of them."""

    targets: list[tuple[int, int]]
    crc: int = 0


class _Outputs:
    """The files an export writes into, by number, opened as writes need them: a few stay
    open at a time, however many shard files there are."""

    KEEP_OPEN = 32

    def __init__(self, paths: Sequence[Path]) -> None:
        self.paths = list(paths)
        self._fds: OrderedDict[int, int] = OrderedDict()

    def _fd(self, file: int) -> int:
        fd = self._fds.get(file)
        if fd is not None:
            self._fds.move_to_end(file)
            return fd
        if len(self._fds) >= self.KEEP_OPEN:
            os.close(self._fds.popitem(last=False)[1])
        fd = os.open(self.paths[file], os.O_WRONLY)
        self._fds[file] = fd
        return fd

    def write(self, pieces: list[tuple[int, int, memoryview]]) -> None:
        """Write each ``(file, offset, data)`` piece."""
        for file, offset, data in pieces:
            fd = self._fd(file)
            while data:
                written = os.pwrite(fd, data, offset)
                data, offset = data[written:], offset + written

    def close(self) -> None:
        while self._fds:
            os.close(self._fds.popitem()[1])


def _selected(manifest: Manifest, select: str | None) -> dict[int, str]:
    """Output names of the tensors to export, by manifest index."""
    names: dict[int, str] = {}
    for i, meta in enumerate(manifest.tensors):
        if select is None:
            names[i] = meta.key
        elif meta.key == select:
            names[i] = meta.key.rsplit("/", 1)[-1]
        elif meta.key.startswith(select + "/"):
            names[i] = meta.key[len(select) + 1 :]
    return names


def _strip_part(part: str, prefixes: Sequence[str]) -> str:
    for prefix in prefixes:
        if part.startswith(prefix):
            return part[len(prefix) :]
    return part


def _stripped_names(names: dict[int, str], prefixes: Sequence[str]) -> dict[int, str]:
    """``names`` with each prefix taken off every path component that starts with it."""
    if not prefixes:
        return names
    out: dict[int, str] = {}
    seen: dict[str, str] = {}
    for i, name in names.items():
        new = "/".join(_strip_part(part, prefixes) for part in name.split("/"))
        if new in seen:
            raise CommandError(
                f"--strip-prefix makes {seen[new]!r} and {name!r} the same name {new!r}",
                EXIT_USAGE,
            )
        seen[new] = name
        out[i] = new
    return out


def _stripped_state(state: Any, prefixes: Sequence[str], path: str = "") -> Any:
    """The decoded state with each prefix taken off every string key that starts with it."""
    if isinstance(state, dict) and prefixes:
        out: dict[Any, Any] = {}
        for k, v in state.items():
            new = _strip_part(k, prefixes) if isinstance(k, str) else k
            child = f"{path}/{k}" if path else str(k)
            if new in out:
                raise CommandError(
                    f"--strip-prefix makes two keys under {path or '<root>'!r} the same "
                    f"key {new!r}",
                    EXIT_USAGE,
                )
            out[new] = _stripped_state(v, prefixes, child)
        return out
    if isinstance(state, list | tuple) and prefixes:
        return type(state)(_stripped_state(v, prefixes, f"{path}/{i}") for i, v in enumerate(state))
    return state


def _stored(meta: TensorMeta, index: int) -> int:
    return meta.alias_of if meta.alias_of is not None else index


def _stream_position(manifest: Manifest, index: int) -> tuple[int, int]:
    meta = manifest.tensors[_stored(manifest.tensors[index], index)]
    return (meta.shards[0] if meta.shards else -1, meta.offset)


def _update_crcs(placements: dict[int, _Placement], pieces: list[tuple[int, memoryview]]) -> None:
    for index, data in pieces:
        placement = placements[index]
        placement.crc = zlib.crc32(data, placement.crc)


async def _stream_into(
    out: _Outputs,
    loc: Location,
    manifest: Manifest,
    placements: dict[int, _Placement],
    ui: Console,
    label: str,
    jobs: int,
    *,
    track_crc: bool = False,
) -> None:
    """Read the shards the placements need and write their bytes where they go."""
    needed = [s for s in manifest.shards if any(seg.tensor in placements for seg in s.segments)]
    with ui.progress(sum(s.length for s in needed), label) as bar:
        async with ShardReader(loc.tier, manifest, needed, jobs=jobs) as reader:
            async for read in reader:
                if read.error is not None or read.data is None:
                    keys = ", ".join(damage_keys(manifest, read.shard))
                    raise CorruptionError(
                        f"{loc}: step {manifest.step}, shard {read.shard.index} ({keys}): "
                        f"{read.error}"
                    )
                writes: list[tuple[int, int, memoryview]] = []
                crc_pieces: list[tuple[int, memoryview]] = []
                for seg in read.shard.segments:
                    placement = placements.get(seg.tensor)
                    if placement is None:
                        continue
                    start, nbytes = manifest.segment_span(seg)
                    piece = read.data[seg.offset : seg.offset + nbytes]
                    writes.extend(
                        (file, offset + start, piece) for file, offset in placement.targets
                    )
                    crc_pieces.append((seg.tensor, piece))
                await asyncio.to_thread(out.write, writes)
                if track_crc:
                    # Shards come in manifest order, so a tensor's pieces arrive in order.
                    await asyncio.to_thread(_update_crcs, placements, crc_pieces)
                bar.advance(read.shard.length)


def _file_order(manifest: Manifest, names: dict[int, str]) -> list[int]:
    """The tensors to export (manifest indexes) in the order their bytes are stored, so that
    the output files fill front to back as the shards are read."""
    return sorted(names, key=lambda i: _stream_position(manifest, i))


def _whole(manifest: Manifest, names: dict[int, str]) -> bool:
    """Whether ``names`` is the whole snapshot under the keys it was stored with."""
    return len(names) == len(manifest.tensors) and all(
        names[i] == t.key for i, t in enumerate(manifest.tensors)
    )


def _safetensors_layout(
    manifest: Manifest, names: dict[int, str], order: Sequence[int], whole: bool
) -> tuple[bytes, dict[int, list[int]], int]:
    """The header of a safetensors file holding the tensors ``order`` (manifest indexes, in
    file order) under their ``names``, where in the file each stored tensor's bytes go (every
    copy of them), and the file's size. ``whole``: keep what ``import`` needs to rebuild the
    snapshot exactly."""
    entries: dict[str, Any] = {}
    relative: dict[int, list[int]] = {}
    cursor = 0
    for i in order:
        meta = manifest.tensors[i]
        dtype = SAFETENSORS_DTYPES.get(meta.dtype)
        if dtype is None:
            raise CommandError(
                f"tensor {meta.key!r} is {meta.dtype}, which safetensors cannot hold; "
                "export with --format torch",
                EXIT_USAGE,
            )
        # safetensors files cannot share bytes between names: a tied weight is written
        # once per name.
        entries[names[i]] = {
            "dtype": dtype,
            "shape": list(meta.shape),
            "data_offsets": [cursor, cursor + meta.nbytes],
        }
        relative.setdefault(_stored(meta, i), []).append(cursor)
        cursor += meta.nbytes
    metadata = {
        "format": "pt",
        "lazyckpt.step": str(manifest.step),
    }
    if whole:
        # The whole snapshot: keep what `import` needs to rebuild it exactly, plain values
        # and tied weights included.
        metadata["lazyckpt.tree"] = json.dumps(manifest.tree, separators=(",", ":"))
        metadata["lazyckpt.tensors"] = json.dumps(
            [[t.key, t.alias_of] for t in manifest.tensors], separators=(",", ":")
        )
    header = json.dumps({"__metadata__": metadata, **entries}, separators=(",", ":")).encode()
    header += b" " * (-len(header) % 8)  # the format aligns the data section to 8 bytes
    start = 8 + len(header)
    offsets = {i: [start + offset for offset in at] for i, at in relative.items()}
    return struct.pack("<Q", len(header)) + header, offsets, start + cursor


@dataclass
class _File:
    """One safetensors file to write: its (partial) path, header, tensor offsets and size."""

    path: Path
    head: bytes
    offsets: dict[int, list[int]]
    size: int


def _create(files: Sequence[_File]) -> None:
    """Create each file at its full size, its header written."""
    for file in files:
        fd = os.open(file.path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            os.ftruncate(fd, file.size)
            data, offset = memoryview(file.head), 0
            while data:
                written = os.pwrite(fd, data, offset)
                data, offset = data[written:], offset + written
        finally:
            os.close(fd)


async def _export_safetensors(
    loc: Location,
    m: Manifest,
    files: Sequence[_File],
    ui: Console,
    jobs: int,
    full: dict[int, torch.Tensor] | None = None,
) -> None:
    """Write the safetensors ``files``, their tensors streamed from the tier (or taken from
    ``full``, assembled in memory)."""
    await asyncio.to_thread(_create, files)
    placements: dict[int, _Placement] = {}
    for number, file in enumerate(files):
        for index, offsets in file.offsets.items():
            targets = placements.setdefault(index, _Placement([])).targets
            targets.extend((number, offset) for offset in offsets)
    out = _Outputs([file.path for file in files])
    try:
        if full is not None:
            await asyncio.to_thread(_write_from_memory, out, full, placements)
        else:
            await _stream_into(out, loc, m, placements, ui, f"export step {m.step}", jobs)
    finally:
        out.close()


def _tensor_bytes(tensor: torch.Tensor) -> memoryview:
    flat = tensor.detach().contiguous().reshape(-1)
    return flat.view(torch.uint8).numpy().data if flat.numel() else memoryview(b"")


def _write_from_memory(
    out: _Outputs, full: dict[int, torch.Tensor], placements: dict[int, _Placement]
) -> None:
    """Write assembled tensors where their bytes go, each placement's crc32 kept."""
    for index, placement in placements.items():
        data = _tensor_bytes(full[index])
        out.write([(file, offset, data) for file, offset in placement.targets])
        placement.crc = zlib.crc32(data)


async def _assembled(
    loc: Location, m: Manifest, allow_pickle: bool
) -> tuple[Manifest, dict[int, torch.Tensor]]:
    """A step written by several ranks as one process restores it (docs/distributed.md):
    every distributed tensor whole, at its global shape, read from the ranks holding its
    parts; a tensor each rank saved as its own is rank 0's. Returns ``m`` with the global
    shapes, and each stored tensor by manifest index. Held in memory: the parts of a
    global tensor lie in several ranks' streams, so they cannot go to the file in order."""
    state = await restore_resharded(
        m,
        [loc.tier],
        [loc.tier],
        rank=0,
        world_size=1,
        into=None,
        map_location="cpu",
        allow_pickle=allow_pickle,
    )
    _, refs = walk_state(state, allow_pickle=False, lenient=True)
    by_key = {ref.key: ref.tensor for ref in refs}
    metas = []
    full: dict[int, torch.Tensor] = {}
    for i, meta in enumerate(m.tensors):
        shape = global_shape(meta)
        metas.append(dataclasses.replace(meta, shape=shape))
        if meta.alias_of is not None:
            continue
        tensor = by_key.get(meta.key)
        if tensor is None or tuple(tensor.shape) != shape:
            raise CommandError(
                f"step {m.step} was written by {m.world_size} ranks and {meta.key!r} could not "
                "be assembled from their parts; restore it with a Checkpointer instead",
                EXIT_USAGE,
            )
        full[i] = tensor
    return dataclasses.replace(m, tensors=tuple(metas)), full


def _plain(value: Any) -> Any:
    """The decoded state with lazyckpt's own marker types turned into builtins, so the file
    loads without lazyckpt installed."""
    if isinstance(value, StatefulValue):
        return {k: _plain(v) for k, v in value.items()}
    if type(value) is dict:
        return {k: _plain(v) for k, v in value.items()}
    if type(value) is list:
        return [_plain(v) for v in value]
    if type(value) is tuple:
        return tuple(_plain(v) for v in value)
    return value


def _subtree(state: Any, select: str) -> Any:
    node = state
    for part in select.split("/"):
        name = part.replace("%2F", "/").replace("%25", "%")
        if isinstance(node, dict):
            matches = [k for k in node if str(k) == name]
            if not matches:
                raise CommandError(f"no key {select!r} in the snapshot", EXIT_NOT_FOUND)
            node = node[matches[0]]
        elif isinstance(node, list | tuple) and name.isdigit() and int(name) < len(node):
            node = node[int(name)]
        else:
            raise CommandError(f"no key {select!r} in the snapshot", EXIT_NOT_FOUND)
    return node


def _pickle_order(state: Any) -> list[torch.Tensor]:
    """Tensors in the order pickle first meets them: the order ``torch.save`` numbers their
    storages in (dict items key then value, sequences in order, depth first)."""
    seen: set[int] = set()
    order: list[torch.Tensor] = []
    stack: list[Any] = [state]
    while stack:
        node = stack.pop()
        if isinstance(node, torch.Tensor):
            if id(node) not in seen:
                seen.add(id(node))
                order.append(node)
        elif isinstance(node, dict):
            items = [x for pair in node.items() for x in pair]
            stack.extend(reversed(items))
        elif isinstance(node, list | tuple):
            stack.extend(reversed(node))
    return order


def _zip_records(path: Path) -> tuple[dict[str, tuple[int, int]], int, int]:
    """Each storage record's data offset and size, and where the central directory is."""
    records: dict[str, tuple[int, int]] = {}
    with zipfile.ZipFile(path) as zf, path.open("rb") as f:
        for info in zf.infolist():
            match = re.fullmatch(r"[^/]+/data/(\d+)", info.filename)
            if match is None:
                continue
            f.seek(info.header_offset)
            local = f.read(30)
            name_len, extra_len = struct.unpack("<HH", local[26:30])
            records[info.filename] = (
                info.header_offset + 30 + name_len + extra_len,
                info.file_size,
            )
        return records, zf.start_dir, len(zf.infolist())


def _patch_zip_crcs(path: Path, crcs: dict[str, tuple[int, int, int]]) -> None:
    """Write each record's CRC-32 into its data descriptor and central-directory entry, which
    ``torch.save`` under ``skip_data`` leaves at zero, so the file is a valid zip again."""
    with path.open("r+b") as f:
        for name, (data_offset, size, crc) in crcs.items():
            if not size:
                continue  # an empty record has no data descriptor, and its CRC-32 is 0
            f.seek(data_offset + size)
            if f.read(4) != b"PK\x07\x08":
                raise CommandError(f"{path}: no data descriptor after {name} from torch.save")
            f.write(struct.pack("<I", crc))
        _, start_dir, count = _zip_records(path)
        position = start_dir
        for _ in range(count):
            f.seek(position)
            entry = f.read(46)
            if entry[:4] != b"PK\x01\x02":
                raise CommandError(f"{path}: unexpected zip layout from torch.save")
            name_len, extra_len, comment_len = struct.unpack("<HHH", entry[28:34])
            name = f.read(name_len).decode()
            if name in crcs:
                f.seek(position + 16)
                f.write(struct.pack("<I", crcs[name][2]))
            position += 46 + name_len + extra_len + comment_len


async def _export_torch(
    loc: Location,
    m: Manifest,
    select: str | None,
    allow_pickle: bool,
    tmp: Path,
    ui: Console,
    jobs: int,
    strip: Sequence[str] = (),
    full: dict[int, torch.Tensor] | None = None,
) -> None:
    if not hasattr(torch.serialization, "skip_data"):
        raise CommandError(
            f"--format torch needs torch 2.5 or newer (this is {torch.__version__}); "
            "export to safetensors instead",
            EXIT_USAGE,
        )
    # torch.save pickles one object, so it cannot take tensors one at a time. Instead it saves
    # a skeleton whose tensors are never-touched allocations (address space, no memory) under
    # torch.serialization.skip_data, which lays out every storage record but leaves its bytes
    # unwritten; the bytes then stream from the tier straight to their records.
    tensors: list[torch.Tensor] = []
    for meta in m.tensors:
        if meta.alias_of is not None:
            tensors.append(tensors[meta.alias_of])  # one storage: torch.load keeps them tied
        else:
            tensors.append(torch.empty(meta.shape, dtype=meta.torch_dtype))
    # plain: a generator's state or an array stored in the shards stays a tensor, so that its
    # bytes stream into a storage record like any other tensor's
    state = _plain(decode_tree(m.tree, tensors, allow_pickle=allow_pickle, plain=True))
    if select is not None:
        state = _subtree(state, select)
    state = _stripped_state(state, strip)
    order = _pickle_order(state)
    index_of = {id(t): i for i, t in enumerate(tensors) if m.tensors[i].alias_of is None}

    def save() -> dict[str, tuple[int, int]]:
        with tmp.open("wb") as f, torch.serialization.skip_data():
            torch.save(state, f)
        return _zip_records(tmp)[0]

    records = await asyncio.to_thread(save)
    if len(records) != len(order):
        raise CommandError(f"torch.save wrote {len(records)} storages, expected {len(order)}")
    by_key = {name.rsplit("/", 1)[-1]: name for name in records}
    placements: dict[int, _Placement] = {}
    names: dict[int, str] = {}
    for k, tensor in enumerate(order):
        index = index_of[id(tensor)]
        name = by_key[str(k)]
        offset, size = records[name]
        if size != m.tensors[index].nbytes:
            raise CommandError(
                f"torch.save laid out storage {k} with {size} bytes, but "
                f"{m.tensors[index].key!r} has {m.tensors[index].nbytes}"
            )
        placements[index] = _Placement([(0, offset)])
        names[index] = name
    out = _Outputs([tmp])
    try:
        if full is not None:
            await asyncio.to_thread(_write_from_memory, out, full, placements)
        else:
            await _stream_into(
                out, loc, m, placements, ui, f"export step {m.step}", jobs, track_crc=True
            )
    finally:
        out.close()
    crcs = {names[i]: (*records[names[i]], p.crc) for i, p in placements.items()}
    await asyncio.to_thread(_patch_zip_crcs, tmp, crcs)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_replace(tmp: Path, final: Path, *, sync_dir: bool = True) -> None:
    with tmp.open("rb+") as f:
        os.fsync(f.fileno())
    os.replace(tmp, final)
    if sync_dir:
        _fsync_dir(final.parent)


_FILE_SUFFIXES = (".safetensors", ".pt", ".pth", ".bin", ".ckpt")


def _export_directory_wanted(args: argparse.Namespace, final: Path) -> bool:
    """Whether ``--to`` names a directory of sharded safetensors files: with
    ``--max-shard-size``, a path ending in a slash, or an existing directory."""
    if args.max_shard_size is None and not args.to.endswith(("/", os.sep)) and not final.is_dir():
        return False
    if args.format == "torch":
        raise CommandError(
            "a directory export writes sharded safetensors files; --format torch writes "
            "one file: give --to a file name",
            EXIT_USAGE,
        )
    if args.max_shard_size is not None and args.max_shard_size < 1:
        raise CommandError("--max-shard-size must be at least 1 byte", EXIT_USAGE)
    if final.is_file() or (final.suffix.lower() in _FILE_SUFFIXES and not final.exists()):
        raise CommandError(
            f"a sharded export writes a directory of shard files, and {final} names a "
            "file; give --to a directory",
            EXIT_USAGE,
        )
    if final.is_dir() and not args.force:
        held = sorted(
            (p.name for p in final.iterdir() if HF_SHARD.match(p.name) or p.name == HF_INDEX),
            key=lambda name: (name != HF_INDEX, name),
        )
        if held:
            raise CommandError(
                f"{final} already holds {', '.join(held[:3])}"
                f"{' and more' if len(held) > 3 else ''}; pass --force to replace them",
                EXIT_USAGE,
            )
    return True


def _finish_directory(
    files: Sequence[_File], names: Sequence[str], index: bytes, final: Path
) -> None:
    """Put the written shard files in place under their names, then the index, then take
    away the shard files of an earlier export that the new index does not name."""
    for file, name in zip(files, names, strict=True):
        _fsync_replace(file.path, final / name, sync_dir=False)
    tmp = final / f".{HF_INDEX}.partial"
    try:
        tmp.write_bytes(index)
        _fsync_replace(tmp, final / HF_INDEX, sync_dir=False)
    finally:
        tmp.unlink(missing_ok=True)
    for stale in final.iterdir():
        if HF_SHARD.match(stale.name) and stale.name not in names:
            stale.unlink()
    _fsync_dir(final)


def _clean_up(files: Sequence[_File], created: Path | None) -> None:
    """Remove the partial files left (all of them when the export failed), and the
    directory ``created`` for the export if nothing else is in it."""
    for file in files:
        file.path.unlink(missing_ok=True)
    if created is not None:
        with contextlib.suppress(OSError):  # not empty: the export got through
            created.rmdir()


async def _export_directory(
    loc: Location,
    m: Manifest,
    names: dict[int, str],
    final: Path,
    max_bytes: int,
    ui: Console,
    jobs: int,
    full: dict[int, torch.Tensor] | None,
) -> int:
    """Write ``names`` as sharded safetensors files with ``model.safetensors.index.json``
    (transformers' layout), each file up to ``max_bytes`` of tensor data unless one tensor
    is larger. Every file is written under a partial name and put in place at the end, the
    index last; a failed export leaves the directory as it was. Returns the file count."""
    order = _file_order(m, names)
    groups = plan_shards([m.tensors[i].nbytes for i in order], max_bytes)
    file_names = shard_file_names(len(groups))
    created = not await asyncio.to_thread(final.exists)
    await asyncio.to_thread(final.mkdir, parents=True, exist_ok=True)
    files: list[_File] = []
    weight_map: dict[str, str] = {}
    for group, name in zip(groups, file_names, strict=True):
        members = [order[j] for j in group]
        head, offsets, size = _safetensors_layout(m, names, members, whole=False)
        files.append(_File(final / f".{name}.partial", head, offsets, size))
        weight_map.update((names[i], name) for i in members)
    total = sum(m.tensors[i].nbytes for i in order)
    index = index_document(weight_map, total)
    try:
        await _export_safetensors(loc, m, files, ui, jobs, full)
        await asyncio.to_thread(_finish_directory, files, file_names, index, final)
    finally:
        await asyncio.to_thread(_clean_up, files, final if created else None)
    return len(files)


async def export_command(args: argparse.Namespace, ui: Console) -> int:
    """``lazyckpt export``: write one step to a file, through a partial file replaced at the
    end, so a failed export leaves no file behind; or to a directory of sharded safetensors
    files, each through a partial file, the index written last."""
    final = Path(args.to)
    to_directory = await asyncio.to_thread(_export_directory_wanted, args, final)
    fmt = "safetensors" if to_directory else format_of(args.to, args.format)
    if not to_directory and not args.force and await asyncio.to_thread(final.exists):
        raise CommandError(f"{final} exists; pass --force to replace it", EXIT_USAGE)
    async with opened(args.location) as loc:
        (step,) = await pick_steps(loc, args.step)
        m = await loc.tier.read_manifest(step)
        full = None
        if m.world_size > 1:
            # every rank's part, checked, before anything is assembled from them
            await step_parts(loc.tier, step, m)
            m, full = await _assembled(loc, m, args.allow_pickle)
        names = _selected(m, args.select)
        if args.select is not None and not names:
            raise CommandError(f"no tensor under {args.select!r} in step {step}", EXIT_NOT_FOUND)
        names = _stripped_names(names, args.strip_prefix)
        if to_directory:
            max_bytes = args.max_shard_size or DEFAULT_MAX_SHARD_BYTES
            count = await _export_directory(loc, m, names, final, max_bytes, ui, args.jobs, full)
            ui.note(
                f"wrote step {step} ({len(names)} tensors) to {final} as {count} safetensors "
                f"file{'s' if count > 1 else ''} and {HF_INDEX}"
            )
            return EXIT_OK
        tmp = final.with_name(f".{final.name}.partial")
        try:
            if fmt == "safetensors":
                order = _file_order(m, names)
                head, offsets, size = _safetensors_layout(m, names, order, _whole(m, names))
                await _export_safetensors(
                    loc, m, [_File(tmp, head, offsets, size)], ui, args.jobs, full
                )
            else:
                await _export_torch(
                    loc,
                    m,
                    args.select,
                    args.allow_pickle,
                    tmp,
                    ui,
                    args.jobs,
                    args.strip_prefix,
                    full,
                )
            await asyncio.to_thread(_fsync_replace, tmp, final)
        finally:
            tmp.unlink(missing_ok=True)
    ui.note(f"wrote step {step} ({len(names)} tensors) to {final} as {fmt}")
    return EXIT_OK
