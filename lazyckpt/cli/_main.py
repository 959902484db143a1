"""The ``lazyckpt`` argument parser and the one place that turns errors into exit statuses."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import re
import sys
from collections.abc import Callable, Coroutine, Sequence
from typing import Any, NoReturn

from .. import __version__
from .._errors import (
    ConfigurationError,
    CorruptionError,
    LazyCkptError,
    SnapshotNotFoundError,
    TierError,
)
from .._tiering.interface import KeepBest
from ._console import Console
from ._copy import copy_command
from ._export import export_command
from ._gc import gc_command
from ._import import import_command
from ._inspect import inspect_command, ls_command
from ._status import (
    EXIT_BROKEN_PIPE,
    EXIT_DAMAGE,
    EXIT_INTERRUPTED,
    EXIT_NOT_FOUND,
    EXIT_STORAGE,
    EXIT_USAGE,
    CommandError,
)
from ._timeline import timeline_command
from ._verify import verify_command


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


_DURATION_UNITS = {"": 1, "s": 1, "m": 60, "h": 3600, "d": 86400, "w": 604800}


def _duration(text: str) -> float:
    """Seconds, from ``90``, ``90s``, ``30m``, ``6h``, ``2d``, ``1w`` or ``1.5h``."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d*)?|\.\d+)\s*([smhdw]?)\s*", text, re.IGNORECASE)
    if match is None:
        raise argparse.ArgumentTypeError(f"not a duration: {text!r} (try 30m, 6h, 2d or seconds)")
    seconds = float(match.group(1)) * _DURATION_UNITS[match.group(2).lower()]
    if not 0 < seconds < float("inf"):
        raise argparse.ArgumentTypeError(f"must be longer than 0 seconds: {text!r}")
    return seconds


def _keep_best(text: str) -> KeepBest:
    """``METRIC:N`` or ``METRIC:N:min|max`` as a :class:`KeepBest` (the metric's name may
    itself hold colons)."""
    parts = text.split(":")
    mode = parts.pop().lower() if len(parts) >= 3 and parts[-1].lower() in ("min", "max") else "min"
    if len(parts) < 2 or not parts[-1].strip().isdigit():
        raise argparse.ArgumentTypeError(f"not METRIC:N[:min|max]: {text!r} (try val_loss:3)")
    n = int(parts.pop())
    try:
        return KeepBest(":".join(parts), n, "max" if mode == "max" else "min")
    except ConfigurationError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


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
        ls_command,
        "list committed snapshots",
        "List the committed snapshots: step, size, tensor count, creation time, and the "
        "tiers that hold each. Several locations are merged by step.",
    )
    p.add_argument("locations", nargs="+", metavar="LOCATION")
    p.add_argument("--json", action="store_true", help="print a JSON list instead of a table")

    p = command(
        "inspect",
        inspect_command,
        "show the keys of a snapshot",
        "Show the tree of keys of a snapshot, with each tensor's dtype, shape and size, and "
        "the plain values (step counters, hyperparameters) stored beside them.",
    )
    p.add_argument("location", metavar="LOCATION")
    p.add_argument("--step", type=_step, help="the step (default: the latest)")
    p.add_argument("--json", action="store_true", help="print JSON instead of a tree")

    p = command(
        "verify",
        verify_command,
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
        export_command,
        "write a snapshot as a safetensors or torch.save file, or sharded safetensors",
        "Write a snapshot to a safetensors file or a torch.save file, streaming: shards go "
        "from the tier to the file one at a time, checked on the way, and the whole state is "
        "never in memory at once. A safetensors file gets the tensors (keys as stored, e.g. "
        "model/layer.weight) and, for a whole snapshot, what import needs to rebuild it "
        "exactly. A torch file holds the full state (tensors and plain values) and loads with "
        "torch.load. A directory gets the tensors as sharded safetensors files "
        "(model-00001-of-0000N.safetensors) and model.safetensors.index.json, the layout "
        "transformers' save_pretrained writes and from_pretrained loads.",
    )
    p.add_argument("location", metavar="LOCATION")
    p.add_argument("--step", type=_step, help="the step (default: the latest)")
    p.add_argument(
        "--to",
        required=True,
        metavar="PATH",
        help="the file to write; or a directory (one that exists, a path ending in /, or "
        "any path with --max-shard-size) for sharded safetensors files and their index",
    )
    p.add_argument(
        "--format",
        choices=("safetensors", "torch"),
        help="default: from the file name (.safetensors; .pt, .pth, .bin, .ckpt)",
    )
    p.add_argument(
        "--max-shard-size",
        type=_size,
        metavar="SIZE",
        help="write a directory of safetensors files, each holding up to SIZE of tensor "
        "data (e.g. 2GiB; default 5GiB), a tensor larger than SIZE in a file of its own",
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
        import_command,
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
        copy_command,
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
        gc_command,
        "delete old snapshots",
        "Delete the committed snapshots no retention policy keeps: a step is kept when one "
        "of the policies given keeps it, and the newest snapshot is always kept. At least "
        "one policy is needed.",
    )
    p.add_argument("location", metavar="LOCATION")
    p.add_argument("--keep-last", type=_positive, metavar="K", help="keep the newest K steps")
    p.add_argument(
        "--keep-every", type=_positive, metavar="N", help="keep every step divisible by N"
    )
    p.add_argument(
        "--keep-best",
        type=_keep_best,
        metavar="METRIC:N[:min|max]",
        help="keep the N steps with the lowest (min, the default) or highest (max) METRIC "
        "recorded with the snapshot; while no step has METRIC, keep every step",
    )
    p.add_argument(
        "--keep-within",
        type=_duration,
        metavar="DURATION",
        help="keep the steps created within DURATION of now (30m, 6h, 2d, or seconds)",
    )
    p.add_argument("--dry-run", action="store_true", help="only say what would be deleted")

    p = command(
        "timeline",
        timeline_command,
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
