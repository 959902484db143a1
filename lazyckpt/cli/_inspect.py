"""``lazyckpt ls`` and ``lazyckpt inspect``: what snapshots exist, and what one holds."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
from dataclasses import dataclass, field
from typing import Any

from .._errors import (
    ConfigurationError,
    CorruptionError,
    LazyCkptError,
    SnapshotNotFoundError,
    first_error,
)
from .._format.entries import TensorMeta
from .._format.manifest import Manifest
from .._format.values import decode_tree, has_tag
from .._format.walk import JSON
from .._progress import Progress, format_bytes
from .._tiering.interface import Retention, StepInfo
from ._console import Console, iso_time, local_time, table
from ._location import Location, opened, pick_steps
from ._read import global_shape, layout_of, step_parts, tensor_bytes
from ._status import EXIT_DAMAGE, EXIT_OK

# manifests ``ls`` reads at once
_MANIFEST_READS = 8


async def ls_command(args: argparse.Namespace, ui: Console) -> int:
    """``lazyckpt ls``: the committed steps of every location, merged by step."""
    async with contextlib.AsyncExitStack() as stack:
        locations = [await stack.enter_async_context(opened(spec)) for spec in args.locations]
        kinds = [loc.kind for loc in locations]
        labels = [loc.kind if kinds.count(loc.kind) == 1 else loc.spec for loc in locations]
        listings = await asyncio.gather(*(loc.tier.steps() for loc in locations))
        found: dict[int, list[int]] = {}
        for i, steps in enumerate(listings):
            for step in steps:
                found.setdefault(step, []).append(i)
        entries: dict[int, dict[str, Any]] = {}
        # the location and manifest each step's figures were read from
        read_from: dict[int, tuple[int, Manifest]] = {}
        # one manifest read per step: on an object store with many snapshots that is the
        # long part, so a few run at once and the progress display counts them
        sem = asyncio.Semaphore(_MANIFEST_READS)

        async def describe(step: int, bar: Progress) -> None:
            entry: dict[str, Any] = {
                "step": step,
                "tiers": [labels[i] for i in found[step]],
                "locations": [locations[i].spec for i in found[step]],
            }
            problems = []
            async with sem:
                for i in found[step]:
                    try:
                        # every rank's part of a step several ranks wrote: its size is theirs
                        parts = await step_parts(locations[i].tier, step)
                    except CorruptionError as exc:
                        problems.append(f"{labels[i]}: {exc}")
                        continue
                    m = parts[0]
                    read_from[step] = (i, m)
                    entry.update(
                        bytes=tensor_bytes(parts),
                        stored_bytes=sum(p.stream_bytes for p in parts),
                        tensors=len(m.tensors),
                        shards=sum(len(p.shards) for p in parts),
                        world_size=m.world_size,
                        created=iso_time(m.created),
                        created_unix=m.created,
                        metrics=dict(m.metrics),
                    )
                    break
            if problems:
                entry["problems"] = problems
            entries[step] = entry
            bar.advance(1)

        with ui.progress(len(found), "ls", unit="snapshots") as bar:
            try:
                async with asyncio.TaskGroup() as tg:
                    for step in found:
                        tg.create_task(describe(step, bar))
            except ExceptionGroup as group:
                raise first_error(group) from None
        info = {step: StepInfo.from_manifest(m) for step, (_, m) in read_from.items()}
        for i, steps in enumerate(listings):
            why = await _kept_because(i, locations[i], steps, read_from, info, ui)
            for step, reasons in why.items():
                entries[step].setdefault("kept_because", {})[labels[i]] = reasons
        # what an object store holds besides the steps: parts of unfinished multipart
        # uploads (other tools, earlier versions), invisible to listings yet billed
        for loc in locations:
            uploads = getattr(loc.tier, "unfinished_uploads", None)
            if uploads is not None:
                found_uploads = await uploads()
                if found_uploads:
                    ui.note(
                        f"{loc.spec}: {len(found_uploads)} unfinished multipart uploads holding "
                        f"{format_bytes(sum(u.bytes for u in found_uploads))} (lazyckpt gc, or "
                        "the next writer's open, aborts them)"
                    )
    listing = [entries[step] for step in sorted(entries)]
    damaged = any("problems" in e for e in listing)
    if args.json:
        ui.out(json.dumps(listing, indent=2))
    elif not listing:
        ui.note(f"no committed snapshot in {', '.join(args.locations)}")
    else:
        # the metrics and the retention columns only where some step has something there
        metrics = any(e.get("metrics") for e in listing)
        kept = any("kept_because" in e for e in listing)
        rows = [
            ["STEP", "SIZE", "TENSORS", "RANKS", "CREATED"]
            + ["METRICS"] * metrics
            + ["TIERS"]
            + ["KEPT BECAUSE"] * kept
        ]
        for e in listing:
            if "bytes" in e:
                row = [
                    str(e["step"]),
                    format_bytes(e["bytes"]),
                    str(e["tensors"]),
                    str(e["world_size"]),
                    local_time(e["created_unix"]),
                ] + [_metrics_text(e["metrics"])] * metrics
            else:
                row = [str(e["step"]), "?", "?", "?", "manifest damaged"] + ["?"] * metrics
            row.append(", ".join(e["tiers"]))
            if kept:
                row.append(_kept_text(e.get("kept_because", {})))
            rows.append(row)
        for line in table(rows, right=(0, 1, 2, 3)):
            ui.out(line)
        for e in listing:
            for problem in e.get("problems", []):
                ui.note(f"step {e['step']}: {problem}")
    return EXIT_DAMAGE if damaged else EXIT_OK


async def _kept_because(
    index: int,
    location: Location,
    steps: list[int],
    read_from: dict[int, tuple[int, Manifest]],
    info: dict[int, StepInfo],
    ui: Console,
) -> dict[int, list[str]]:
    """Why the retention of ``location`` (the ``index``-th) keeps each of its ``steps``: the
    policy its newest step's manifest recorded (``extra["retention"]``, what
    :meth:`Retention.describe` gives), judged now over those steps; ``{}`` when there is
    none, or it keeps everything."""
    if not steps:
        return {}
    newest = max(steps)
    where, manifest = read_from.get(newest, (None, None))
    if where != index or manifest is None:
        try:
            manifest = await location.tier.read_manifest(newest)
        except (CorruptionError, SnapshotNotFoundError):
            return {}  # a damaged step is listed with its problem already
    described = manifest.extra.get("retention")
    if described is None or described == {}:
        return {}  # none recorded, or a tier that keeps everything: nothing to explain
    try:
        retention = Retention.from_description(described)
    except ConfigurationError as exc:
        ui.note(
            f"{location.spec}: step {newest} records a retention this lazyckpt does not "
            f"read: {exc}"
        )
        return {}
    return retention.reasons(steps, {s: info[s] for s in steps if s in info})


def _metrics_text(metrics: dict[str, float]) -> str:
    """A step's metrics for the table: ``val_loss=2.1, acc=0.93``, or ``-``."""
    return ", ".join(f"{name}={value:g}" for name, value in metrics.items()) or "-"


def _kept_text(kept: dict[str, list[str]]) -> str:
    """Why a step is kept, for the table: the reasons (``last 3, every 100th``), per
    location when several record a retention; ``-`` where none keeps it any more (the
    next retention pass deletes it)."""
    if len(kept) == 1:
        (reasons,) = kept.values()
        return ", ".join(reasons) or "-"
    return "; ".join(f"{label}: {', '.join(why) or '-'}" for label, why in kept.items()) or "-"


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
    if isinstance(node, list | dict) and not has_tag(node, "$tensor"):
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
            shape = global_shape(meta)
            if meta.alias_of is not None:
                size = f"= {manifest.tensors[meta.alias_of].key}"
            else:
                size = format_bytes(math.prod(shape) * meta.itemsize)
            layout = layout_of(meta)
            shown = f"{list(shape)} {layout}" if layout else str(list(shape))
            rows.append([indent + node.name, meta.dtype, shown, size])
        elif node.value is not None:
            rows.append([indent + node.name, f"= {node.value}"])
        else:
            rows.append([indent + node.name + "/", ""])
            for child in node.children:
                visit(child, depth + 1)

    for child in root.children:
        visit(child, 0)
    return rows


def _tensor_doc(m: Manifest, t: TensorMeta) -> dict[str, Any]:
    shape = global_shape(t)
    doc: dict[str, Any] = {
        "key": t.key,
        "dtype": t.dtype,
        "shape": list(shape),
        "bytes": math.prod(shape) * t.itemsize,
        "same_as": None if t.alias_of is None else m.tensors[t.alias_of].key,
    }
    if t.placements is not None:
        # a distributed tensor: the whole tensor above; how the ranks split it here
        doc.update(placements=list(t.placements), rank0_shape=list(t.shape))
    return doc


async def inspect_command(args: argparse.Namespace, ui: Console) -> int:
    """``lazyckpt inspect``: the tree of keys of one step, with tensor sizes and values.

    For a step written by several ranks the keys are rank 0's, a distributed tensor is shown
    with its global shape and size, and the totals count every rank's part."""
    async with opened(args.location) as loc:
        (step,) = await pick_steps(loc, args.step)
        parts = await step_parts(loc.tier, step)
    m = parts[0]
    total = tensor_bytes(parts)
    shards = sum(len(p.shards) for p in parts)
    if args.json:
        doc = {
            "step": m.step,
            "created": iso_time(m.created),
            "world_size": m.world_size,
            "bytes": total,
            "shards": shards,
            "tensors": [_tensor_doc(m, t) for t in m.tensors],
            "tree": m.tree,
        }
        ui.out(json.dumps(doc, indent=2))
        return EXIT_OK
    stored = sum(1 for t in m.tensors if t.alias_of is None)
    ranks = f", written by {m.world_size} ranks" if m.world_size > 1 else ""
    ui.out(
        f"step {m.step} in {loc}: {len(m.tensors)} tensors ({stored} stored), "
        f"{format_bytes(total)} in {shards} shards{ranks}, created {local_time(m.created)}"
    )
    rows = _render_nodes(_build_nodes(m.tree, ""), m)
    if rows:
        for line in table([["KEY", "DTYPE", "SHAPE", "BYTES"], *rows], right=(3,)):
            ui.out(line)
    return EXIT_OK
