"""The ``lazyckpt`` command line: see what checkpoints exist, check them, move them.

Every subcommand takes a *location*: a directory (a :class:`~tiers.FileTier` root), or a URL.
``s3://bucket/prefix`` and ``zarr+file:///path`` (any ``zarr+...`` URL) open a Zarr tier;
``file:///path`` is a directory; ``KIND+...://`` opens the tier registered as ``KIND`` under
the ``lazyckpt.tiers`` entry-point group, with the URL after ``KIND+`` as its argument. A local
directory that holds a ``zarr.json`` is opened as a Zarr tier.

Commands that only read (``ls``, ``inspect``, ``verify``, ``export``, the source of ``copy``)
build the tier read-only (``readonly=True``, for a tier whose constructor takes it, which is
then opened so; otherwise ``readonly`` is set and ``open()`` is never called): they create,
delete and lock nothing, so they work beside a training job writing to the same location.
Commands that write (``gc``, ``import``, the destination of ``copy``) open the tier for
writing, which takes the location's writer lock: beside a running writer they are refused
with :class:`~lazyckpt.LocationInUseError` instead of deleting what it writes.

Exit status (``docs/cli.md`` has the full table):

===  ====================================================================================
0    success
1    damage found (a checksum mismatch, missing or truncated data, an unreadable manifest),
     or the operation failed
2    usage error: bad arguments or options, or an unsupported request
3    not found: no such location, snapshot, step, key or input file
4    storage error: a tier could not be read or written (unreachable, permissions, full)
130  interrupted
141  stdout was closed before the output was written (``| head``)
===  ====================================================================================
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import inspect
import json
import math
import os
import pickle
import re
import struct
import sys
import zipfile
import zlib
from collections.abc import AsyncIterator, Callable, Coroutine, Sequence
from dataclasses import dataclass, field, replace
from datetime import datetime
from pathlib import Path
from types import TracebackType
from typing import Any, NoReturn, Protocol

import crc32c
import torch

from . import __version__
from ._errors import (
    ConfigurationError,
    CorruptionError,
    LazyCkptError,
    SnapshotNotFoundError,
    TierError,
)
from ._manifest import LayoutOptions, Manifest, Segment, ShardMeta, TensorMeta, plan_layout
from ._progress import Progress, format_bytes
from ._tier import Retention, Tier, available_tiers, load_tier
from ._tree import JSON, StatefulValue, TensorRef, decode_tree, dtype_from_name, walk_state

__all__ = [
    "EXIT_BROKEN_PIPE",
    "EXIT_DAMAGE",
    "EXIT_INTERRUPTED",
    "EXIT_NOT_FOUND",
    "EXIT_OK",
    "EXIT_STORAGE",
    "EXIT_USAGE",
    "CommandError",
    "main",
]

EXIT_OK = 0
EXIT_DAMAGE = 1
EXIT_USAGE = 2
EXIT_NOT_FOUND = 3
EXIT_STORAGE = 4
EXIT_INTERRUPTED = 130
EXIT_BROKEN_PIPE = 141

# URL schemes that mean an object store, which lazyckpt reaches through its Zarr tier.
_OBJECT_STORE_SCHEMES = frozenset({"s3"})


class CommandError(Exception):
    """A failure the command reports as one line on stderr, with its exit status."""

    def __init__(self, message: str, code: int = EXIT_DAMAGE) -> None:
        super().__init__(message)
        self.code = code


# -- locations ---------------------------------------------------------------------------------


@dataclass
class Location:
    """A tier opened from a command-line location."""

    spec: str
    kind: str
    tier: Tier

    def __str__(self) -> str:
        return self.spec


def resolve_location(spec: str) -> tuple[str, str]:
    """The tier kind (entry-point name) and constructor argument for a location.

    Raises:
        CommandError: a URL scheme no registered tier serves (exit 2).
    """
    scheme, sep, rest = spec.partition("://")
    if not sep or not re.fullmatch(r"[A-Za-z][A-Za-z0-9+.-]*", scheme):
        if (Path(spec) / "zarr.json").is_file() and "zarr" in available_tiers():
            return "zarr", spec
        return "file", spec
    scheme = scheme.lower()
    if scheme == "file":
        return "file", rest
    if "+" in scheme:
        kind, inner = scheme.split("+", 1)
        return kind, f"{inner}://{rest}"
    if scheme in _OBJECT_STORE_SCHEMES:
        return "zarr", spec
    if scheme in available_tiers():
        return scheme, spec
    raise CommandError(
        f"{spec}: no tier serves URLs starting with {scheme}://; use a directory, s3://..., "
        "zarr+file://..., or KIND+...:// for a tier registered as KIND",
        EXIT_USAGE,
    )


async def open_location(spec: str, *, create: bool = False, write: bool = False) -> Location:
    """Build the tier for ``spec``: read-only, or with ``write`` or ``create`` opened for
    writing (``create`` also makes a missing directory). A read-only tier is opened only
    when its constructor takes ``readonly=`` (the built-in tiers do): one that does not may
    not honour it, and reads need no ``open()``.

    Raises:
        CommandError: no such directory (exit 3), or no tier for it (exit 2).
        LocationInUseError: another writer holds the location (``write``/``create``).
    """
    # Resolving looks at the file system (a Zarr root?) and loads the tier plugins.
    kind, arg = await asyncio.to_thread(resolve_location, spec)
    if kind == "zarr" and "zarr" not in available_tiers():
        raise CommandError(
            f"{spec}: this installation has no Zarr tier (entry point 'zarr' in "
            f"'lazyckpt.tiers'); registered tiers: {sorted(available_tiers())}",
            EXIT_USAGE,
        )
    if kind == "file" and not create and not await asyncio.to_thread(Path(arg).is_dir):
        raise CommandError(f"{spec}: no such directory", EXIT_NOT_FOUND)
    readonly = not (create or write)
    factory = available_tiers().get(kind)
    # a tier whose constructor takes readonly= honours it: opened so, it checks the location
    # (a missing one is SnapshotNotFoundError) and creates, deletes and locks nothing
    honours = readonly and factory is not None and _takes_readonly(factory)
    tier = load_tier(kind, arg, readonly=True) if honours else load_tier(kind, arg)
    if readonly and not honours:
        tier.readonly = True  # asked, but maybe not honoured: so never opened for a read
    else:
        try:
            await tier.open()
        except BaseException:
            await tier.aclose()
            raise
    return Location(spec, kind, tier)


def _takes_readonly(factory: Callable[..., Tier]) -> bool:
    """Whether a tier's constructor takes ``readonly=`` (and so honours it in ``open()``)."""
    try:
        return "readonly" in inspect.signature(factory).parameters
    except (TypeError, ValueError):
        return False


@contextlib.asynccontextmanager
async def _opened(
    spec: str, *, create: bool = False, write: bool = False
) -> AsyncIterator[Location]:
    location = await open_location(spec, create=create, write=write)
    try:
        yield location
    finally:
        await location.tier.aclose()


async def _pick_steps(location: Location, step: int | None, *, every: bool = False) -> list[int]:
    """The committed steps a command works on: all, the one asked for, or the latest."""
    steps = await location.tier.steps()
    if not steps:
        raise CommandError(f"{location}: no committed snapshot", EXIT_NOT_FOUND)
    if every:
        return steps
    if step is None:
        return [steps[-1]]
    if step not in steps:
        near = ", ".join(map(str, steps[-5:]))
        raise CommandError(
            f"{location}: step {step} is not committed (latest: {near})", EXIT_NOT_FOUND
        )
    return [step]


# -- reading shards ----------------------------------------------------------------------------


@dataclass
class ShardRead:
    """One shard read back from a tier: its bytes, or why they are not good."""

    shard: ShardMeta
    data: memoryview | None
    error: str | None = None


class ShardReader:
    """Reads shards of one snapshot in order, up to ``jobs`` ahead, checking each crc32c.

    Use as ``async with ShardReader(...) as reader: async for read in reader:``. A shard's
    buffer is reused once the loop moves on, so memory stays at ``jobs + 1`` shards however
    large the snapshot is. Missing, short or mismatching data comes back as a
    :class:`ShardRead` with ``error`` set (so ``verify`` can name every bad shard); a tier
    that cannot be reached raises its :class:`~lazyckpt.TierError`.
    """

    def __init__(
        self,
        tier: Tier,
        manifest: Manifest,
        shards: Sequence[ShardMeta] | None = None,
        *,
        jobs: int = 4,
    ) -> None:
        self.tier = tier
        self.manifest = manifest
        self._todo = collections.deque(manifest.shards if shards is None else shards)
        self._jobs = max(1, jobs)
        self._pending: collections.deque[tuple[asyncio.Task[ShardRead], bytearray]] = (
            collections.deque()
        )
        self._free: list[bytearray] = []
        self._held: bytearray | None = None

    async def __aenter__(self) -> ShardReader:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        tasks = [task for task, _ in self._pending]
        for task in tasks:
            task.cancel()
        # The reads write into our buffers: wait until they have really stopped.
        await asyncio.gather(*tasks, return_exceptions=True)
        self._pending.clear()

    def __aiter__(self) -> ShardReader:
        return self

    async def __anext__(self) -> ShardRead:
        if self._held is not None:
            self._free.append(self._held)
            self._held = None
        while self._todo and len(self._pending) < self._jobs:
            shard = self._todo.popleft()
            buffer = self._buffer(shard.length)
            task = asyncio.create_task(self._read(shard, buffer), name=f"read-{shard.index}")
            self._pending.append((task, buffer))
        if not self._pending:
            raise StopAsyncIteration
        task, buffer = self._pending.popleft()
        try:
            result = await task
        except BaseException:
            self._free.append(buffer)
            raise
        self._held = buffer
        return result

    def _buffer(self, length: int) -> bytearray:
        for i, candidate in enumerate(self._free):
            if len(candidate) >= length:
                return self._free.pop(i)
        return bytearray(length)

    async def _read(self, shard: ShardMeta, buffer: bytearray) -> ShardRead:
        view = memoryview(buffer)[: shard.length]
        try:
            await self.tier.read_shard(self.manifest, shard, view)
        except CorruptionError as exc:
            return ShardRead(shard, None, str(exc))
        crc = await asyncio.to_thread(crc32c.crc32c, view)
        if shard.crc32c is None:
            return ShardRead(shard, view, "the manifest records no checksum for it")
        if crc != shard.crc32c:
            return ShardRead(
                shard,
                view,
                f"checksum mismatch (manifest {shard.crc32c:08x}, data {crc:08x})",
            )
        return ShardRead(shard, view)


def segment_span(manifest: Manifest, seg: Segment) -> tuple[int, int]:
    """Where a segment's bytes sit inside its whole tensor: ``(byte offset, length)``."""
    meta = manifest.tensors[seg.tensor]
    nbytes = manifest.segment_nbytes(seg)
    if meta.mode == "rows":
        return seg.start * meta.itemsize * math.prod(meta.shape[1:]), nbytes
    if meta.mode == "flat":
        return seg.start * meta.itemsize, nbytes
    return 0, nbytes


def shard_contents(manifest: Manifest, shard: ShardMeta) -> list[str]:
    """What a shard holds, for a person: keys, the rows or elements of each, and aliases."""
    parts: list[str] = []
    for seg in shard.segments:
        meta = manifest.tensors[seg.tensor]
        if meta.mode == "rows":
            parts.append(f"{meta.key} rows {seg.start}:{seg.stop} of {meta.shape[0]}")
        elif meta.mode == "flat":
            parts.append(f"{meta.key} elements {seg.start}:{seg.stop} of {meta.numel}")
        else:
            parts.append(meta.key)
        parts.extend(
            f"{other.key} (the same tensor as {meta.key})"
            for other in manifest.tensors
            if other.alias_of == seg.tensor
        )
    return parts


def _damage_keys(manifest: Manifest, shard: ShardMeta) -> list[str]:
    keys = {manifest.tensors[seg.tensor].key for seg in shard.segments}
    keys.update(
        t.key for t in manifest.tensors for seg in shard.segments if t.alias_of == seg.tensor
    )
    return sorted(keys)


# -- output ------------------------------------------------------------------------------------


@dataclass
class Console:
    """Where a command writes: results to stdout, progress and problems to stderr."""

    quiet: bool = False

    def out(self, text: str = "") -> None:
        print(text, file=sys.stdout)

    def note(self, text: str) -> None:
        print(text, file=sys.stderr)

    def progress(self, total: int, label: str) -> Progress:
        return Progress(total, label, stream=sys.stderr, enabled=not self.quiet)


def _when(created: float) -> str:
    return datetime.fromtimestamp(created).astimezone().strftime("%Y-%m-%d %H:%M:%S")


def _iso(created: float) -> str:
    return datetime.fromtimestamp(created).astimezone().isoformat(timespec="seconds")


def _table(rows: Sequence[Sequence[str]], right: Sequence[int] = ()) -> list[str]:
    """Rows as aligned columns; a row of two cells is a name and a free-form note."""
    full = [row for row in rows if len(row) == len(rows[0])]
    widths = [max(len(row[c]) for row in full) for c in range(len(rows[0]))]
    widths[0] = max(len(row[0]) for row in rows)
    lines = []
    for row in rows:
        if len(row) != len(rows[0]):
            lines.append(f"{row[0].ljust(widths[0])}  {row[1]}".rstrip())
            continue
        cells = [
            cell.rjust(widths[c]) if c in right else cell.ljust(widths[c])
            for c, cell in enumerate(row)
        ]
        lines.append("  ".join(cells).rstrip())
    return lines


# -- ls ----------------------------------------------------------------------------------------


async def _ls(args: argparse.Namespace, ui: Console) -> int:
    async with contextlib.AsyncExitStack() as stack:
        locations = [await stack.enter_async_context(_opened(spec)) for spec in args.locations]
        kinds = [loc.kind for loc in locations]
        labels = [loc.kind if kinds.count(loc.kind) == 1 else loc.spec for loc in locations]
        listings = await asyncio.gather(*(loc.tier.steps() for loc in locations))
        found: dict[int, list[int]] = {}
        for i, steps in enumerate(listings):
            for step in steps:
                found.setdefault(step, []).append(i)
        entries: list[dict[str, Any]] = []
        damaged = False
        for step in sorted(found):
            entry: dict[str, Any] = {
                "step": step,
                "tiers": [labels[i] for i in found[step]],
                "locations": [locations[i].spec for i in found[step]],
            }
            problems = []
            for i in found[step]:
                try:
                    m = await locations[i].tier.read_manifest(step)
                except CorruptionError as exc:
                    problems.append(f"{labels[i]}: {exc}")
                    continue
                entry.update(
                    bytes=m.tensor_bytes,
                    stored_bytes=m.stream_bytes,
                    tensors=len(m.tensors),
                    shards=len(m.shards),
                    created=_iso(m.created),
                    created_unix=m.created,
                )
                break
            if problems:
                entry["problems"] = problems
                damaged = True
            entries.append(entry)
    if args.json:
        ui.out(json.dumps(entries, indent=2))
    elif not entries:
        ui.note(f"no committed snapshot in {', '.join(args.locations)}")
    else:
        rows = [["STEP", "SIZE", "TENSORS", "CREATED", "TIERS"]]
        for e in entries:
            if "bytes" in e:
                rows.append(
                    [
                        str(e["step"]),
                        format_bytes(e["bytes"]),
                        str(e["tensors"]),
                        _when(e["created_unix"]),
                        ", ".join(e["tiers"]),
                    ]
                )
            else:
                rows.append([str(e["step"]), "?", "?", "manifest damaged", ", ".join(e["tiers"])])
        for line in _table(rows, right=(0, 1, 2)):
            ui.out(line)
        for e in entries:
            for problem in e.get("problems", []):
                ui.note(f"step {e['step']}: {problem}")
    return EXIT_DAMAGE if damaged else EXIT_OK


# -- inspect -----------------------------------------------------------------------------------


@dataclass
class _Node:
    name: str
    children: list[_Node] = field(default_factory=list)
    tensor: int | None = None
    value: str | None = None


def _value_text(node: JSON, limit: int | None = 60) -> str:
    try:
        value = decode_tree(node, [], allow_pickle=False)
    except LazyCkptError:
        return "<pickled value>" if isinstance(node, dict) and "$pickle" in node else "<?>"
    text = repr(value)
    return text if limit is None or len(text) <= limit else text[: limit - 3] + "..."


def _build_nodes(node: JSON, name: str) -> _Node:
    """The tagged-JSON tree as named nodes, in the order the state was written. A container
    of plain values short enough to read on one line (``betas = (0.9, 0.999)``) is a leaf."""
    if isinstance(node, list | dict) and not _has_tag(node, "$tensor"):
        text = _value_text(node, limit=None)
        if len(text) <= 60:
            return _Node(name, value=text)
    if isinstance(node, list):
        return _Node(name, [_build_nodes(v, str(i)) for i, v in enumerate(node)])
    if isinstance(node, dict) and len(node) == 1:
        ((tag, inner),) = node.items()
        if tag == "$tensor" and type(inner) is int:
            return _Node(name, tensor=inner)
        if tag == "$stateful":
            return _build_nodes(inner, name)
        # trainer state whose bytes are a tensor of the snapshot: shown as that tensor
        if tag in ("$ndarray", "$generator") and isinstance(inner, list) and inner:
            payload = inner[-1]
            if isinstance(payload, dict) and type(payload.get("$tensor")) is int:
                return _Node(name, tensor=payload["$tensor"])
        if tag == "$dataclass" and isinstance(inner, list) and len(inner) == 2:
            return _build_nodes(inner[1], name)
        if tag == "$tuple" and isinstance(inner, list):
            return _Node(name, [_build_nodes(v, str(i)) for i, v in enumerate(inner)])
        if tag == "$dict" and isinstance(inner, list):
            children = []
            for item in inner:
                key, value = item
                label = key if isinstance(key, str) else _value_text(key)
                children.append(_build_nodes(value, label))
            return _Node(name, children)
    return _Node(name, value=_value_text(node))


def _render_nodes(root: _Node, manifest: Manifest) -> list[list[str]]:
    rows: list[list[str]] = []

    def visit(node: _Node, depth: int) -> None:
        indent = "  " * depth
        if node.tensor is not None:
            meta = manifest.tensors[node.tensor]
            if meta.alias_of is not None:
                size = f"= {manifest.tensors[meta.alias_of].key}"
            else:
                size = format_bytes(meta.nbytes)
            rows.append([indent + node.name, meta.dtype, str(list(meta.shape)), size])
        elif node.value is not None:
            rows.append([indent + node.name, f"= {node.value}"])
        else:
            rows.append([indent + node.name + "/", ""])
            for child in node.children:
                visit(child, depth + 1)

    for child in root.children:
        visit(child, 0)
    return rows


async def _inspect(args: argparse.Namespace, ui: Console) -> int:
    async with _opened(args.location) as loc:
        (step,) = await _pick_steps(loc, args.step)
        m = await loc.tier.read_manifest(step)
    if args.json:
        doc = {
            "step": m.step,
            "created": _iso(m.created),
            "bytes": m.tensor_bytes,
            "shards": len(m.shards),
            "tensors": [
                {
                    "key": t.key,
                    "dtype": t.dtype,
                    "shape": list(t.shape),
                    "bytes": t.nbytes,
                    "same_as": None if t.alias_of is None else m.tensors[t.alias_of].key,
                }
                for t in m.tensors
            ],
            "tree": m.tree,
        }
        ui.out(json.dumps(doc, indent=2))
        return EXIT_OK
    stored = sum(1 for t in m.tensors if t.alias_of is None)
    ui.out(
        f"step {m.step} in {loc}: {len(m.tensors)} tensors ({stored} stored), "
        f"{format_bytes(m.tensor_bytes)} in {len(m.shards)} shards, created {_when(m.created)}"
    )
    rows = _render_nodes(_build_nodes(m.tree, ""), m)
    if rows:
        for line in _table([["KEY", "DTYPE", "SHAPE", "BYTES"], *rows], right=(3,)):
            ui.out(line)
    return EXIT_OK


# -- verify ------------------------------------------------------------------------------------


async def _verify_step(loc: Location, step: int, ui: Console, jobs: int) -> dict[str, Any]:
    report: dict[str, Any] = {"step": step, "ok": True, "damaged": []}
    try:
        m = await loc.tier.read_manifest(step)
    except CorruptionError as exc:
        report.update(ok=False, manifest_error=str(exc))
        return report
    report.update(shards=len(m.shards), bytes=m.stream_bytes)
    with ui.progress(sum(s.length for s in m.shards), f"verify step {step}") as bar:
        async with ShardReader(loc.tier, m, jobs=jobs) as reader:
            async for read in reader:
                bar.advance(read.shard.length)
                if read.error is None:
                    continue
                report["ok"] = False
                report["damaged"].append(
                    {
                        "shard": read.shard.index,
                        "offset": read.shard.offset,
                        "length": read.shard.length,
                        "error": read.error,
                        "holds": shard_contents(m, read.shard),
                        "keys": _damage_keys(m, read.shard),
                    }
                )
    return report


def _print_report(r: dict[str, Any], ui: Console) -> None:
    if "manifest_error" in r:
        ui.out(f"step {r['step']}: DAMAGED: the manifest cannot be read: {r['manifest_error']}")
    elif r["ok"]:
        ui.out(f"step {r['step']}: ok ({r['shards']} shards, {format_bytes(r['bytes'])})")
    else:
        ui.out(f"step {r['step']}: DAMAGED: {len(r['damaged'])} of {r['shards']} shards")
        for d in r["damaged"]:
            end = d["offset"] + d["length"]
            ui.out(f"  shard {d['shard']} (stream bytes {d['offset']}-{end}): {d['error']}")
            for part in d["holds"]:
                ui.out(f"    {part}")
    sys.stdout.flush()  # one step at a time: a long --all run shows results as they come


async def _verify(args: argparse.Namespace, ui: Console) -> int:
    reports = []
    async with _opened(args.location) as loc:
        for step in await _pick_steps(loc, args.step, every=args.all):
            reports.append(await _verify_step(loc, step, ui, args.jobs))
            if not args.json:
                _print_report(reports[-1], ui)
    bad = [r for r in reports if not r["ok"]]
    if args.json:
        ui.out(json.dumps({"location": args.location, "steps": reports}, indent=2))
    elif len(reports) > 1:
        ui.out(f"{len(reports) - len(bad)} of {len(reports)} snapshots intact")
    return EXIT_DAMAGE if bad else EXIT_OK


# -- export ------------------------------------------------------------------------------------

# safetensors dtype names, by lazyckpt dtype name (the safetensors format's own list).
_SAFETENSORS_DTYPES = {
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
_FROM_SAFETENSORS = {v: k for k, v in _SAFETENSORS_DTYPES.items()}


@dataclass
class _Placement:
    """Where one stored tensor's bytes go in the output file (every copy of them)."""

    offsets: list[int]
    crc: int = 0


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


def _write_pieces(fd: int, pieces: list[tuple[int, memoryview]]) -> None:
    for offset, data in pieces:
        while data:
            written = os.pwrite(fd, data, offset)
            data, offset = data[written:], offset + written


def _update_crcs(placements: dict[int, _Placement], pieces: list[tuple[int, memoryview]]) -> None:
    for index, data in pieces:
        placement = placements[index]
        placement.crc = zlib.crc32(data, placement.crc)


async def _stream_into(
    fd: int,
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
                    keys = ", ".join(_damage_keys(manifest, read.shard))
                    raise CorruptionError(
                        f"{loc}: step {manifest.step}, shard {read.shard.index} ({keys}): "
                        f"{read.error}"
                    )
                writes: list[tuple[int, memoryview]] = []
                crc_pieces: list[tuple[int, memoryview]] = []
                for seg in read.shard.segments:
                    placement = placements.get(seg.tensor)
                    if placement is None:
                        continue
                    start, nbytes = segment_span(manifest, seg)
                    piece = read.data[seg.offset : seg.offset + nbytes]
                    writes.extend((offset + start, piece) for offset in placement.offsets)
                    crc_pieces.append((seg.tensor, piece))
                await asyncio.to_thread(_write_pieces, fd, writes)
                if track_crc:
                    # Shards come in manifest order, so a tensor's pieces arrive in order.
                    await asyncio.to_thread(_update_crcs, placements, crc_pieces)
                bar.advance(read.shard.length)


def _safetensors_layout(
    manifest: Manifest, names: dict[int, str]
) -> tuple[bytes, dict[int, _Placement], int]:
    """The header, where each stored tensor's bytes go, and the file's size."""
    entries: dict[str, Any] = {}
    relative: dict[int, list[int]] = {}
    cursor = 0
    for i in sorted(names, key=lambda i: _stream_position(manifest, i)):
        meta = manifest.tensors[i]
        dtype = _SAFETENSORS_DTYPES.get(meta.dtype)
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
    if len(names) == len(manifest.tensors) and all(
        names[i] == t.key for i, t in enumerate(manifest.tensors)
    ):
        # The whole snapshot: keep what `import` needs to rebuild it exactly, plain values
        # and tied weights included.
        metadata["lazyckpt.tree"] = json.dumps(manifest.tree, separators=(",", ":"))
        metadata["lazyckpt.tensors"] = json.dumps(
            [[t.key, t.alias_of] for t in manifest.tensors], separators=(",", ":")
        )
    header = json.dumps({"__metadata__": metadata, **entries}, separators=(",", ":")).encode()
    header += b" " * (-len(header) % 8)  # the format aligns the data section to 8 bytes
    start = 8 + len(header)
    placements = {
        i: _Placement([start + offset for offset in offsets]) for i, offsets in relative.items()
    }
    return struct.pack("<Q", len(header)) + header, placements, start + cursor


async def _export_safetensors(
    loc: Location, m: Manifest, names: dict[int, str], fd: int, ui: Console, jobs: int
) -> None:
    head, placements, size = _safetensors_layout(m, names)
    await asyncio.to_thread(os.ftruncate, fd, size)
    await asyncio.to_thread(_write_pieces, fd, [(0, memoryview(head))])
    await _stream_into(fd, loc, m, placements, ui, f"export step {m.step}", jobs)


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
        placements[index] = _Placement([offset])
        names[index] = name
    fd = os.open(tmp, os.O_WRONLY)
    try:
        await _stream_into(
            fd, loc, m, placements, ui, f"export step {m.step}", jobs, track_crc=True
        )
    finally:
        os.close(fd)
    crcs = {names[i]: (*records[names[i]], p.crc) for i, p in placements.items()}
    await asyncio.to_thread(_patch_zip_crcs, tmp, crcs)


def _format_of(path: str, given: str | None) -> str:
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


def _fsync_replace(tmp: Path, final: Path) -> None:
    with tmp.open("rb+") as f:
        os.fsync(f.fileno())
    os.replace(tmp, final)
    fd = os.open(final.parent, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


async def _export(args: argparse.Namespace, ui: Console) -> int:
    fmt = _format_of(args.to, args.format)
    final = Path(args.to)
    if not args.force and await asyncio.to_thread(final.exists):
        raise CommandError(f"{final} exists; pass --force to replace it", EXIT_USAGE)
    async with _opened(args.location) as loc:
        (step,) = await _pick_steps(loc, args.step)
        m = await loc.tier.read_manifest(step)
        names = _selected(m, args.select)
        if args.select is not None and not names:
            raise CommandError(f"no tensor under {args.select!r} in step {step}", EXIT_NOT_FOUND)
        names = _stripped_names(names, args.strip_prefix)
        tmp = final.with_name(f".{final.name}.partial")
        try:
            if fmt == "safetensors":
                fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
                try:
                    await _export_safetensors(loc, m, names, fd, ui, args.jobs)
                finally:
                    os.close(fd)
            else:
                await _export_torch(
                    loc, m, args.select, args.allow_pickle, tmp, ui, args.jobs, args.strip_prefix
                )
            await asyncio.to_thread(_fsync_replace, tmp, final)
        finally:
            tmp.unlink(missing_ok=True)
    ui.note(f"wrote step {step} ({len(names)} tensors) to {final} as {fmt}")
    return EXIT_OK


# -- import ------------------------------------------------------------------------------------


class _Source(Protocol):
    """A file being imported: its state as a tree and tensor references, and its bytes."""

    tree: JSON
    refs: list[TensorRef]
    pickled: bool

    def fill(self, manifest: Manifest, shard: ShardMeta, out: memoryview) -> None:
        """Copy the shard's bytes from the file into ``out`` (gaps zeroed). Blocking."""


def _has_tag(tree: JSON, tag: str) -> bool:
    stack = [tree]
    while stack:
        node = stack.pop()
        if isinstance(node, list):
            stack.extend(node)
        elif isinstance(node, dict):
            if tag in node:
                return True
            stack.extend(node.values())
    return False


def _zero_gaps(manifest: Manifest, shard: ShardMeta, out: memoryview) -> None:
    # Alignment gaps in a pack are part of the stored bytes; zero them so they are defined.
    cursor = 0
    for seg in sorted(shard.segments, key=lambda s: s.offset):
        if seg.offset > cursor:
            out[cursor : seg.offset] = bytes(seg.offset - cursor)
        cursor = seg.offset + manifest.segment_nbytes(seg)
    if cursor < shard.length:
        out[cursor : shard.length] = bytes(shard.length - cursor)


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
        self.pickled = _has_tag(self.tree, "$pickle")

    def fill(self, manifest: Manifest, shard: ShardMeta, out: memoryview) -> None:
        _zero_gaps(manifest, shard, out)
        dest = torch.frombuffer(out, dtype=torch.uint8)
        for seg in shard.segments:
            meta = manifest.tensors[seg.tensor]
            src = self.refs[seg.tensor].tensor.detach()
            if meta.mode == "rows":
                src = src[seg.start : seg.stop]
            elif meta.mode == "flat":
                src = src.reshape(-1)[seg.start : seg.stop]
            nbytes = manifest.segment_nbytes(seg)
            piece = dest[seg.offset : seg.offset + nbytes].view(meta.torch_dtype)
            piece.view(manifest.segment_shape(seg)).copy_(src)


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
                dtype = dtype_from_name(_FROM_SAFETENSORS[entry["dtype"]])
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
        _zero_gaps(manifest, shard, out)
        fd = os.open(self.path, os.O_RDONLY)
        try:
            for seg in shard.segments:
                begin, _ = self.spans[self.names[seg.tensor]]
                start, nbytes = segment_span(manifest, seg)
                done = 0
                while done < nbytes:
                    view = out[seg.offset + done : seg.offset + nbytes]
                    n = os.preadv(fd, [view], self.data_start + begin + start + done)
                    if n == 0:
                        raise CorruptionError(f"{self.path} is truncated")
                    done += n
        finally:
            os.close(fd)


def _sniff_format(path: Path) -> str:
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


async def _put_all(
    tier: Tier,
    manifest: Manifest,
    fill: Callable[[Manifest, ShardMeta, memoryview], None] | None,
    reader: ShardReader | None,
    ui: Console,
    label: str,
    jobs: int,
) -> list[int]:
    """Write every shard to ``tier`` (from ``fill`` or from ``reader``); their crc32c."""
    crcs = [0] * len(manifest.shards)
    with ui.progress(sum(s.length for s in manifest.shards), label) as bar:
        if reader is not None:
            async for read in reader:
                if read.error is not None or read.data is None:
                    keys = ", ".join(_damage_keys(manifest, read.shard))
                    raise CorruptionError(
                        f"{reader.tier.name}: step {manifest.step}, shard {read.shard.index} "
                        f"({keys}): {read.error}; nothing was copied"
                    )
                await tier.put_shard(manifest, read.shard, read.data)
                crcs[read.shard.index] = read.shard.crc32c or 0
                bar.advance(read.shard.length)
            return crcs
        assert fill is not None
        sem = asyncio.Semaphore(max(1, jobs))

        async def one(shard: ShardMeta) -> None:
            async with sem:
                buffer = bytearray(shard.length)
                view = memoryview(buffer)
                await asyncio.to_thread(fill, manifest, shard, view)
                crcs[shard.index] = await asyncio.to_thread(crc32c.crc32c, view)
                await tier.put_shard(manifest, shard, view)
                bar.advance(shard.length)

        try:
            async with asyncio.TaskGroup() as tg:
                for shard in manifest.shards:
                    tg.create_task(one(shard))
        except ExceptionGroup as group:
            raise _first_error(group) from None
    return crcs


def _first_error(group: BaseExceptionGroup[Any]) -> BaseException:
    """The first failure of a task group, so it is reported like any other error."""
    first: BaseException = group
    while isinstance(first, BaseExceptionGroup):
        first = first.exceptions[0]
    return first


@contextlib.asynccontextmanager
async def _writing(tier: Tier, manifest: Manifest) -> AsyncIterator[None]:
    """``begin`` … ``commit`` on a tier; anything that stops it early aborts the step."""
    await tier.begin(manifest)
    try:
        yield
    except BaseException:
        with contextlib.suppress(Exception):
            await asyncio.shield(tier.abort(manifest.step))
        raise


async def _import(args: argparse.Namespace, ui: Console) -> int:
    path = Path(args.file)
    if not await asyncio.to_thread(path.is_file):
        raise CommandError(f"{path}: no such file", EXIT_NOT_FOUND)
    fmt = args.format or await asyncio.to_thread(_sniff_format, path)
    source: _Source
    if fmt == "torch":
        source = await asyncio.to_thread(_TorchSource, path, args.allow_pickle, args.under)
    else:
        source = await asyncio.to_thread(_SafetensorsSource, path, args.under)
    layout = LayoutOptions(shard_size=args.shard_size, pack_bytes=min(1 << 20, args.shard_size))
    plan = plan_layout(args.step, source.tree, source.refs, layout, pickled=source.pickled)
    async with _opened(args.to, create=True) as loc:
        if args.step in await loc.tier.steps():
            raise CommandError(
                f"{loc}: step {args.step} is already committed; choose another step or remove "
                "it first",
                EXIT_USAGE,
            )
        async with _writing(loc.tier, plan):
            crcs = await _put_all(
                loc.tier, plan, source.fill, None, ui, f"import step {args.step}", args.jobs
            )
            manifest = plan.with_checksums(crcs)
            extra = {"tier": loc.tier.describe(), "imported": {"format": fmt, "name": path.name}}
            await loc.tier.commit(replace(manifest, extra=extra))
    ui.note(
        f"imported {path.name} as step {args.step} into {loc} "
        f"({len(plan.tensors)} tensors, {format_bytes(plan.tensor_bytes)})"
    )
    return EXIT_OK


# -- copy --------------------------------------------------------------------------------------


async def _readback(loc: Location, m: Manifest, ui: Console, jobs: int) -> list[str]:
    problems = []
    with ui.progress(sum(s.length for s in m.shards), f"check step {m.step} on {loc}") as bar:
        async with ShardReader(loc.tier, m, jobs=jobs) as reader:
            async for read in reader:
                bar.advance(read.shard.length)
                if read.error is not None:
                    problems.append(f"shard {read.shard.index}: {read.error}")
    return problems


async def _copy(args: argparse.Namespace, ui: Console) -> int:
    async with _opened(args.src) as src, _opened(args.dst, create=True) as dst:
        if args.step:
            steps = [s for step in args.step for s in await _pick_steps(src, step)]
        else:
            steps = await _pick_steps(src, None, every=True)
        present = set(await dst.tier.steps())
        for step in steps:
            if step in present:
                ui.note(f"step {step}: already on {dst}, left as it is")
                continue
            m = await src.tier.read_manifest(step)
            m = replace(m, extra={**m.extra, "tier": dst.tier.describe()})
            async with (
                _writing(dst.tier, m),
                ShardReader(src.tier, m, jobs=args.jobs) as reader,
            ):
                await _put_all(dst.tier, m, None, reader, ui, f"copy step {step}", args.jobs)
                await dst.tier.commit(m)
            if not args.no_readback:
                problems = await _readback(dst, m, ui, args.jobs)
                if problems:
                    await dst.tier.delete(step)
                    raise CorruptionError(
                        f"{dst}: step {step} read back wrong, so it was removed again: "
                        + "; ".join(problems[:3])
                    )
            ui.out(f"step {step}: copied to {dst} ({format_bytes(m.stream_bytes)})")
    return EXIT_OK


# -- gc ----------------------------------------------------------------------------------------


async def _gc(args: argparse.Namespace, ui: Console) -> int:
    retention = Retention(keep_last=args.keep_last, keep_every=args.keep_every)
    # a writer: never beside a training job's own retention (the writer lock refuses it)
    async with _opened(args.location, write=not args.dry_run) as loc:
        steps = await loc.tier.steps()
        doomed = retention.to_delete(steps)
        for step in doomed:
            if args.dry_run:
                ui.out(f"would delete step {step}")
            else:
                await loc.tier.delete(step)
                ui.out(f"deleted step {step}")
    kept = len(steps) - len(doomed)
    verb = "would keep" if args.dry_run else "kept"
    ui.note(f"{verb} {kept} of {len(steps)} snapshots in {args.location}")
    return EXIT_OK


# -- timeline ----------------------------------------------------------------------------------


async def _timeline(args: argparse.Namespace, ui: Console) -> int:
    from . import timeline

    path = Path(args.events)
    if not await asyncio.to_thread(path.is_file):
        raise CommandError(f"{path}: no such file", EXIT_NOT_FOUND)
    events = await asyncio.to_thread(timeline.load_events, path)
    await asyncio.to_thread(timeline.draw, events, args.out, title=args.title)
    ui.note(f"wrote {args.out}")
    return EXIT_OK


# -- the parser --------------------------------------------------------------------------------


def _step(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a step number: {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"steps are not negative: {value}")
    return value


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a whole number: {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1: {value}")
    return value


def _size(text: str) -> int:
    match = re.fullmatch(r"\s*(\d+)\s*([KMG]i?B?|B)?\s*", text, re.IGNORECASE)
    if match is None:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (try 16MiB)")
    scale = {"": 1, "B": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    unit = (match.group(2) or "")[:1].upper()
    return int(match.group(1)) * scale[unit]


Handler = Callable[[argparse.Namespace, Console], Coroutine[Any, Any, int]]

_EPILOG = """\
exit status: 0 ok; 1 damage found or the operation failed; 2 usage error; 3 not found;
4 storage error (a tier could not be read or written); 130 interrupted; 141 output closed.

A LOCATION is a directory (file tier), s3://bucket/prefix or zarr+file:///path (Zarr tier),
or KIND+...:// for a tier registered as KIND."""


class _Parser(argparse.ArgumentParser):
    """An ``ArgumentParser`` whose usage errors exit with status 2 and name the command."""

    def error(self, message: str) -> NoReturn:
        self.print_usage(sys.stderr)
        self.exit(EXIT_USAGE, f"{self.prog}: error: {message}\n")


def build_parser() -> argparse.ArgumentParser:
    """The ``lazyckpt`` argument parser (every subcommand, with its help)."""
    parser = _Parser(
        prog="lazyckpt",
        description="Look at, check and move lazyckpt checkpoints.",
        epilog=_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"lazyckpt {__version__}")
    quiet_help = "no progress display on stderr"
    parser.add_argument("-q", "--quiet", action="store_true", help=quiet_help)
    # The same flag after the command name; SUPPRESS keeps a top-level -q from being reset.
    common = _Parser(add_help=False)
    common.add_argument(
        "-q", "--quiet", action="store_true", default=argparse.SUPPRESS, help=quiet_help
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)

    def command(name: str, handler: Handler, summary: str, description: str) -> Any:
        p = sub.add_parser(
            name,
            parents=[common],
            help=summary,
            description=description,
            epilog=_EPILOG,
            formatter_class=argparse.RawDescriptionHelpFormatter,
        )
        p.set_defaults(handler=handler)
        return p

    def jobs(p: argparse.ArgumentParser) -> None:
        p.add_argument(
            "-j",
            "--jobs",
            type=_positive,
            default=4,
            help="shards in flight at once; memory used is about this many shards (default 4)",
        )

    p = command(
        "ls",
        _ls,
        "list committed snapshots",
        "List the committed snapshots: step, size, tensor count, creation time, and the "
        "tiers that hold each. Several locations are merged by step.",
    )
    p.add_argument("locations", nargs="+", metavar="LOCATION")
    p.add_argument("--json", action="store_true", help="print a JSON list instead of a table")

    p = command(
        "inspect",
        _inspect,
        "show the keys of a snapshot",
        "Show the tree of keys of a snapshot, with each tensor's dtype, shape and size, and "
        "the plain values (step counters, hyperparameters) stored beside them.",
    )
    p.add_argument("location", metavar="LOCATION")
    p.add_argument("--step", type=_step, help="the step (default: the latest)")
    p.add_argument("--json", action="store_true", help="print JSON instead of a tree")

    p = command(
        "verify",
        _verify,
        "check every shard's checksum",
        "Read every shard of a snapshot and check its crc32c against the manifest. Exits "
        "with 1 when anything is damaged, naming the shard and the tensor keys it holds.",
    )
    p.add_argument("location", metavar="LOCATION")
    which = p.add_mutually_exclusive_group()
    which.add_argument("--step", type=_step, help="the step (default: the latest)")
    which.add_argument("--all", action="store_true", help="every committed snapshot")
    p.add_argument("--json", action="store_true", help="print a JSON report")
    jobs(p)

    p = command(
        "export",
        _export,
        "write a snapshot as a safetensors or torch.save file",
        "Write a snapshot to a safetensors file or a torch.save file, streaming: shards go "
        "from the tier to the file one at a time, checked on the way, and the whole state is "
        "never in memory at once. A safetensors file gets the tensors (keys as stored, e.g. "
        "model/layer.weight) and, for a whole snapshot, what import needs to rebuild it "
        "exactly. A torch file holds the full state (tensors and plain values) and loads with "
        "torch.load.",
    )
    p.add_argument("location", metavar="LOCATION")
    p.add_argument("--step", type=_step, help="the step (default: the latest)")
    p.add_argument("--to", required=True, metavar="FILE", help="the file to write")
    p.add_argument(
        "--format",
        choices=("safetensors", "torch"),
        help="default: from the file name (.safetensors; .pt, .pth, .bin, .ckpt)",
    )
    p.add_argument(
        "--select",
        metavar="KEY",
        help="export only what is under KEY, with KEY/ taken off the names (e.g. --select "
        "model gives keys model.load_state_dict accepts)",
    )
    p.add_argument(
        "--strip-prefix",
        action="append",
        default=[],
        metavar="PREFIX",
        help="take PREFIX off every key (every part of a key path) that starts with it; "
        "repeatable. --strip-prefix _orig_mod. turns a torch.compile'd model's "
        "model/_orig_mod.fc.weight into model/fc.weight (module. for DDP)",
    )
    p.add_argument(
        "--allow-pickle",
        action="store_true",
        help="torch format: rebuild pickled values (this runs code from the checkpoint)",
    )
    p.add_argument("--force", action="store_true", help="replace FILE if it exists")
    jobs(p)

    p = command(
        "import",
        _import,
        "store a safetensors or torch.save file as a snapshot",
        "Store the state in a safetensors file or a torch.save file as a committed snapshot "
        "of step STEP. A torch file is memory-mapped and a safetensors file read shard by "
        "shard, so the file is never loaded whole (except the pre-1.6 torch format). torch "
        "files load with weights_only=True unless --allow-pickle is given.",
    )
    p.add_argument("file", metavar="FILE")
    p.add_argument("--to", required=True, metavar="LOCATION", help="where to store it")
    p.add_argument("--step", type=_step, required=True, help="the step to store it as")
    p.add_argument(
        "--format", choices=("safetensors", "torch"), help="default: from the file's content"
    )
    p.add_argument("--under", metavar="KEY", help="store the file's state under KEY (e.g. model)")
    p.add_argument(
        "--allow-pickle",
        action="store_true",
        help="load any object from a torch file (this runs code from the file) and store "
        "values that are not plain data with pickle",
    )
    p.add_argument(
        "--shard-size",
        type=_size,
        default=16 << 20,
        help="the largest shard, e.g. 16MiB (default), a multiple of 4KiB",
    )
    jobs(p)

    p = command(
        "copy",
        _copy,
        "copy snapshots from one location to another, verified",
        "Copy committed snapshots from SRC to DST (e.g. promote a local snapshot to S3). "
        "Every shard's checksum is checked as it is read, so damage never spreads; then the "
        "copy is read back from DST and checked again (skip with --no-readback). A step DST "
        "already has is left alone.",
    )
    p.add_argument("src", metavar="SRC")
    p.add_argument("dst", metavar="DST")
    p.add_argument(
        "--step",
        type=_step,
        action="append",
        help="a step to copy (repeatable; default: every step SRC has)",
    )
    p.add_argument(
        "--no-readback", action="store_true", help="do not read the copy back to check it"
    )
    jobs(p)

    p = command(
        "gc",
        _gc,
        "delete old snapshots",
        "Delete committed snapshots, keeping the newest K and, with --keep-every N, every "
        "step divisible by N. The newest snapshot is always kept.",
    )
    p.add_argument("location", metavar="LOCATION")
    p.add_argument("--keep-last", type=_positive, required=True, metavar="K")
    p.add_argument("--keep-every", type=_positive, metavar="N")
    p.add_argument("--dry-run", action="store_true", help="only say what would be deleted")

    p = command(
        "timeline",
        _timeline,
        "draw a run's recorded events as a PNG",
        "Draw the events a lazyckpt.timeline.TimelineRecorder wrote: training iterations and "
        "each snapshot's stages per tier on one time axis. Needs matplotlib.",
    )
    p.add_argument("events", metavar="EVENTS.json")
    p.add_argument("--out", required=True, metavar="PNG", help="the image to write")
    p.add_argument("--title", help="a title for the picture")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; return the exit status (see the module docstring)."""
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # --help, --version and usage errors
        return exc.code if isinstance(exc.code, int) else EXIT_USAGE
    ui = Console(quiet=args.quiet)
    prog = f"lazyckpt {args.command}"
    handler: Handler = args.handler
    try:
        return asyncio.run(handler(args, ui))
    except KeyboardInterrupt:
        ui.note(f"{prog}: interrupted")
        return EXIT_INTERRUPTED
    except BrokenPipeError:
        # The reader went away (``| head``). Point stdout at /dev/null so that the flush at
        # exit does not fail a second time, and stop as a killed-by-SIGPIPE program would.
        with contextlib.suppress(OSError, ValueError):
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, sys.stdout.fileno())
        return EXIT_BROKEN_PIPE
    except CommandError as exc:
        ui.note(f"{prog}: {exc}")
        return exc.code
    except SnapshotNotFoundError as exc:
        ui.note(f"{prog}: {exc}")
        return EXIT_NOT_FOUND
    except CorruptionError as exc:
        ui.note(f"{prog}: damaged: {exc}")
        return EXIT_DAMAGE
    except TierError as exc:
        ui.note(f"{prog}: storage error: {exc}")
        return EXIT_STORAGE
    except ConfigurationError as exc:
        ui.note(f"{prog}: {exc}")
        return EXIT_USAGE
    except LazyCkptError as exc:
        ui.note(f"{prog}: {exc}")
        return EXIT_DAMAGE
    except FileNotFoundError as exc:
        ui.note(f"{prog}: {exc.filename or exc}: no such file or directory")
        return EXIT_NOT_FOUND
    except OSError as exc:
        ui.note(f"{prog}: {exc}")
        return EXIT_DAMAGE


if __name__ == "__main__":
    sys.exit(main())
