"""What both Checkpointer facades share: the engine and the synchronous half of every
operation (:class:`_Core`). The facades (``_checkpointer.facades``) only bridge to it: the async one
awaits the engine loop, the synchronous one blocks on it.

Here: opening, snapshot's synchronous half (walk, eager copies, the plan and its cache) and
the guard. The operations on committed steps (restore, verify, list, delete) are
``_checkpointer.steps._StepOps``; close, drain, preemption and exit handling are
``_checkpointer.lifecycle._Lifecycle``; ``_Core`` joins the three."""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
import time
import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch

from .._capture.cpu import EagerPolicy, VerifyingCapture, copy_eager, optimizer_pointers
from .._capture.cuda import CudaCapture, GuardMode, resolve_guard_mode, stream_guard_hook
from .._capture.optimizers import hook_installed, optimizer_shape, unwrap_optimizer, wrap_closure
from .._distributed.preemption import PreemptionHandler
from .._engine.flight import Flight
from .._engine.scheduler import Engine
from .._errors import CheckpointerClosedError, ConfigurationError, SnapshotSkippedWarning
from .._format.manifest import Manifest, check_metrics, plan_layout
from .._format.walk import Columns, KeyCache, TensorRef, walk_state
from .._gcpause import collector_paused
from .._options import CheckpointerOptions
from .._restore.lazy import LazyRestores
from .._restore.reshard import assign_writers
from .._tiering.interface import SupportsRankManifests, Tier
from .handle import SnapshotHandle
from .lifecycle import _Lifecycle
from .steps import _StepOps

__all__ = ["_Core", "captures_done", "make_core"]

log = logging.getLogger("lazyckpt")


@dataclass(frozen=True, slots=True)
class _Plan:
    """A snapshot's plan: the structure it was made for (keys, dtypes, shapes, aliases and
    placements of its tensors), its manifest and tensor bytes, and the eager policy's
    choice as that structure decides it (see ``_Core._eager_classes``)."""

    signature: tuple[list[Any], ...]
    manifest: Manifest
    nbytes: int
    forced: list[int]
    candidates: list[int]
    # the refs left lazy whoever owns them (larger than eager_bytes, no pattern for them,
    # not aliases), and the aliases: what _changing looks at
    large: list[int]
    aliases: list[int]


class _Core(_StepOps, _Lifecycle):
    """What both facades share: the engine and the synchronous half of every operation."""

    def __init__(self, tiers: Sequence[Tier], options: CheckpointerOptions) -> None:
        self.options = options
        self.preemption = PreemptionHandler(options.preemption_signals, self._on_preemption)
        self.preempted: int | None = None  # the signal that stopped snapshots
        self.policy = EagerPolicy(options.eager_bytes, options.eager, options.lazy)
        if isinstance(tiers, Tier) or not isinstance(tiers, Sequence):
            raise ConfigurationError("tiers must be a list of Tier objects, fastest first")
        self.engine = Engine(tiers, options)
        if options.verify_sources:
            self.engine.capture = VerifyingCapture(self.engine.capture, options.capture_threads)
        self._last_step: int | None = None
        self._closing = False
        self._open_lock = threading.Lock()
        self._guards: list[tuple[torch.optim.Optimizer, Any]] = []
        # under a guard: the lazily captured refs no guarded optimizer owns, watched from
        # snapshot() to the guard's next wait, and the keys of those seen changing in that
        # window, copied at snapshot() from then on (see _changing)
        self._watched: list[TensorRef] = []
        self._changes_seen: set[str] = set()
        # the last plan: its signature, the manifest, its tensor bytes (summed once) and the
        # eager policy's choice as far as the structure decides it
        self._plan_cache: _Plan | None = None
        self._keys = KeyCache()  # the state's key paths, kept from one snapshot to the next
        self._at_exit: Callable[[], None] | None = None
        self._owned_cache: tuple[tuple[Any, ...], set[int]] | None = None
        # lazy restores: per guarded optimizer (by id) the future of its state's restore,
        # and the engine-side tasks still loading (close and the next restore wait for them)
        self.lazy = LazyRestores()

    @property
    def cuda(self) -> CudaCapture | None:
        """The engine's CUDA capture backend, if it has one (under a VerifyingCapture too)."""
        capture = self.engine.capture
        if isinstance(capture, VerifyingCapture):
            capture = capture.inner
        return capture if isinstance(capture, CudaCapture) else None

    def check_open(self) -> None:
        if self._closing or self.engine.closed:
            raise CheckpointerClosedError("the Checkpointer is closed")
        if not self.engine.opened:
            raise ConfigurationError(
                "the Checkpointer is not open: use 'async with Checkpointer(...)' "
                "(or 'with SyncCheckpointer(...)'), or call open() first"
            )

    async def open_on_engine(self) -> None:
        await self.engine.open()
        self._register_exit()
        listing = await asyncio.gather(*(t.steps() for t in self.engine.tiers))
        committed = [s for steps in listing for s in steps]
        if self.engine.coordinator is not None:  # every rank must refuse the same steps
            everyone = await self.engine.coordinator.gather(0, committed)
            committed = [s for part in everyone for s in part]
        self._last_step = max(committed) if committed else None

    def prepare(
        self,
        state: Any,
        step: int,
        stacklevel: int = 3,
        *,
        metrics: Mapping[str, float] | None = None,
    ) -> Flight | SnapshotHandle:
        """The synchronous half of ``snapshot()``: walk, copy the eager tensors, plan. Returns
        the flight to submit, or the handle of a skipped snapshot (whose warning points
        ``stacklevel`` frames up: at the caller of the public ``snapshot()``)."""
        t0 = time.perf_counter()
        self.check_open()
        if type(step) is not int or step < 0:
            raise ConfigurationError(f"step must be a non-negative int, got {step!r}")
        kept_metrics = check_metrics(metrics) if metrics else None
        if self._last_step is not None and step <= self._last_step:
            raise ConfigurationError(
                f"step {step} is not newer than the newest snapshot ({self._last_step}); "
                "steps must increase. After a rollback, start a new directory or delete "
                "the newer snapshots first (ckpt.delete(step))."
            )
        if self.preempted is not None:
            # draining for a preemption: a new snapshot could not become durable in time
            # and would only delay the exit; the trainer may still run a few steps
            return self._skip(
                step,
                f"the job is being preempted (signal {self.preempted}); the snapshots taken "
                "before it were drained",
                stacklevel + 1,
            )
        self.report_failures()
        self.lazy.wait_blocking()  # a snapshot must not see half-loaded optimizer state
        self.lazy.raise_failed(state)  # nor state a failed lazy restore left half loaded
        with collector_paused():  # a few objects per tensor, none cyclic: see _gc.py
            columns = Columns()
            tree, refs = walk_state(
                state, allow_pickle=self.options.allow_pickle, keys=self._keys, columns=columns
            )
            dists = columns.dists
            if dists.count(None) != len(dists):
                dedup = all(isinstance(t, SupportsRankManifests) for t in self.engine.durable)
                assign_writers(refs, self.engine.rank, self.engine.world_size, dedup)
                dists = [r.dist for r in refs]
            manifest, nbytes = self._plan(step, tree, refs, dists, columns)
            # before anything can change them: copy what a forward pass may change (see
            # EagerPolicy); on a GPU this is enqueued before the snapshot's mark below.
            # Planning read only keys, dtypes and shapes, which a copy keeps.
            chosen = self._eager(columns.pointers)
            if chosen:
                copy_eager(refs, chosen)
            changing = self._changing(refs, columns.pointers)
            if changing:
                copy_eager(refs, changing)
        if self.options.when_busy == "skip" and self.engine.busy_for(manifest):
            return self._skip(
                step,
                f"the pipeline is still busy with earlier snapshots "
                f"({self.engine.skipped + 1} skipped so far)",
                stacklevel + 1,
            )
        if kept_metrics:
            manifest = replace(manifest, metrics=kept_metrics)
        flight = Flight(manifest, refs, self.engine.stage_names, nbytes)
        self.engine.plan_stages(flight)  # which tiers take it (Checkpointer(cadence=...))
        self._last_step = step
        if self.cuda is not None:
            self.cuda.mark_snapshot(step)  # the point on the stream it must see
        flight.stats.snapshot_s = time.perf_counter() - t0
        return flight

    def submit(self, flight: Flight) -> SnapshotHandle:
        self.check_open()
        self.engine.submit(flight)
        return SnapshotHandle(self.engine, flight, flight.step)

    def withdraw(self, flight: Flight, previous: int | None) -> None:
        """A prepared snapshot that will not be submitted (its ``snapshot()`` was cancelled)."""
        if self._last_step == flight.step:
            self._last_step = previous

    def snapshot(
        self, state: Any, step: int, metrics: Mapping[str, float] | None = None
    ) -> SnapshotHandle:
        prepared = self.prepare(state, step, stacklevel=4, metrics=metrics)
        if isinstance(prepared, SnapshotHandle):
            return prepared
        return self.submit(prepared)

    async def wait_for_room(self, flight: Flight) -> None:
        """Backpressure for ``await snapshot()``, on the caller's loop: wait (yielding) until
        the earlier captures are done and the arena has room for this snapshot, or nothing
        is left in flight that could make room. The engine would otherwise wait on its own
        thread, and the guard would then block the caller's thread (and loop) in the next
        optimizer step."""
        engine = self.engine
        await captures_done(engine.pending_captures())
        delay = 0.0005
        while engine.flights and engine.busy_for(flight.manifest):
            await asyncio.sleep(delay)
            delay = min(0.01, delay * 2)

    def report_failures(self) -> None:
        """Apply the failure policy to the failures nobody has seen yet: raise them
        (``on_failure="raise"``), or drop them, since each was logged as it happened and is
        counted in ``metrics()["snapshots_failed"]`` (``"warn"``)."""
        if self.options.on_failure == "raise":
            self.engine.raise_unreported()
        else:
            self.engine.take_unreported()

    def owned_pointers(self) -> set[int]:
        """Data pointers of the tensors the guarded optimizers own (see EagerPolicy).

        Listing them costs about as much per tensor as the walk itself, so the set is kept
        while the optimizers' shape stays the same: the same ``state`` and ``param_groups``
        objects (``load_state_dict`` replaces both), the same number of parameters, of
        parameters with state and of state entries (an optimizer creates its state at its
        first step). An optimizer that swaps a state tensor for a new one without any of
        these changing leaves the new one out: it is then treated as not owned, which is
        safe (copied at ``snapshot()`` if small, version-checked if large)."""
        live = [opt for opt, handle in self._guards if hook_installed(opt, handle)]
        if not live:
            return set()
        shape = tuple(optimizer_shape(opt) for opt in live)
        if self._owned_cache is None or self._owned_cache[0] != shape:
            self._owned_cache = (shape, optimizer_pointers(live))
        return self._owned_cache[1]

    def _skip(self, step: int, why: str, stacklevel: int) -> SnapshotHandle:
        """Count and warn of a skipped snapshot (the warning points ``stacklevel`` frames up
        from here) and return its handle."""
        self.engine.skipped += 1
        warnings.warn(
            f"snapshot of step {step} skipped: {why}", SnapshotSkippedWarning, stacklevel=stacklevel
        )
        return SnapshotHandle(self.engine, None, step)

    def _plan(
        self,
        step: int,
        tree: Any,
        refs: list[TensorRef],
        dists: list[Any],
        columns: Columns,
    ) -> tuple[Manifest, int]:
        """The layout for this snapshot and its tensor bytes; reused from the previous one
        when every tensor has the same key, dtype, shape, aliasing and placement (the usual
        case: the same model and optimizer every step), since planning is most of a first
        ``snapshot()``'s cost. Keeps, with the plan, the eager policy's choice as far as
        that structure decides it (see :meth:`_eager`). ``columns``: what the walk read
        of the refs' tensors, and whether it pickled a value."""
        # parallel lists rather than one tuple per tensor: fewer objects for the collector.
        # List comprehensions, not map(attrgetter): about twice as fast on Python 3.11.
        # Keys are the key cache's own strings and dtypes singletons: comparing them is
        # mostly comparing pointers.
        tensors = columns.tensors
        signature = (
            columns.keys,
            columns.dtypes,
            [t.shape for t in tensors],
            columns.aliases,
            dists,
        )
        pickled = columns.pickled  # only a walk with allow_pickle pickles anything
        cached = self._plan_cache
        if cached is not None and cached.signature == signature:
            fresh = replace(
                cached.manifest, step=step, tree=tree, pickled=pickled, created=time.time()
            )
            return fresh, cached.nbytes
        manifest = plan_layout(
            step,
            tree,
            refs,
            self.engine.layout,
            pickled=pickled,
            rank=self.engine.rank,
            world_size=self.engine.world_size,
        )
        forced, candidates = self._eager_classes(refs, tensors)
        eager = set(forced) | set(candidates)
        lazy_re = self.policy._lazy_re
        large = [
            i
            for i, ref in enumerate(refs)
            if i not in eager
            and ref.alias_of is None
            and (lazy_re is None or not lazy_re.match(ref.key))
        ]
        aliases = [i for i, ref in enumerate(refs) if ref.alias_of is not None]
        self._plan_cache = _Plan(
            signature, manifest, manifest.tensor_bytes, forced, candidates, large, aliases
        )
        return manifest, self._plan_cache.nbytes

    def _eager_classes(
        self, refs: list[TensorRef], tensors: list[torch.Tensor]
    ) -> tuple[list[int], list[int]]:
        """The eager policy's choice split by what decides it (see EagerPolicy): the refs
        copied whatever the guarded optimizers own (an ``eager`` pattern, and their
        aliases), and the *candidates*, copied unless a guarded optimizer owns their data
        (small enough, no pattern against them). Every other ref is captured lazily. Both
        follow from keys, aliasing, dtypes and shapes alone: the plan's signature."""
        # the policy itself decides, as if every pointer were owned and as if none were,
        # so that the cached choice cannot drift from EagerPolicy.choose; without eager
        # patterns, nothing is copied when everything is owned
        policy = self.policy
        forced = policy.choose(refs, {t.data_ptr() for t in tensors}) if policy.eager else []
        unowned = policy.choose(refs, set())
        if not forced:
            return forced, unowned
        kept = set(forced)
        return forced, [i for i in unowned if i not in kept]

    def _eager(self, every: list[int]) -> list[int]:
        """Indexes of the refs to copy at ``snapshot()``, in order: what
        ``self.policy.choose(refs, self.owned_pointers())`` returns, from the choice kept
        with the plan (the refs must have its structure: call after :meth:`_plan`), looking
        only at the candidates' data pointers (``every``: the refs' data pointers as the
        walk read them, ``Columns``). An alias has its tensor's data pointer, so it is
        picked with it, as the policy wants."""
        assert self._plan_cache is not None
        forced, candidates = self._plan_cache.forced, self._plan_cache.candidates
        if not candidates:
            return forced
        pointers = list(map(every.__getitem__, candidates))
        owned = self.owned_pointers()
        if owned.issuperset(pointers):  # the usual case: the optimizers own all of them
            return forced
        picked = [i for i, p in zip(candidates, pointers, strict=True) if p not in owned]
        return sorted(forced + picked) if forced else picked

    def _changing(self, refs: list[TensorRef], every: list[int]) -> list[int]:
        """Under a guard: the refs left lazy whoever owns them that no guarded optimizer
        owns and that were seen changing *before the optimizer step* after an earlier
        snapshot (:meth:`_note_changes`), with their aliases. They are copied at
        ``snapshot()`` as the eager ones are. The others of those unowned refs are watched
        until the guard's next wait. ``every``: the refs' data pointers as the walk read
        them. When the guarded optimizers own every such ref (the usual case) this is one
        set operation. Call after :meth:`_plan`.

        Why: such a tensor is written between ``snapshot()`` and the optimizer step by
        something the guard does not hold (a large buffer updated in forward, an EMA in a
        hook): left to the lazy capture it races with that writer, and on a CPU tensor the
        version check cannot always see the race, since torch moves the counter when an
        in-place operation *ends*, so a copy taken while one is still running (on an
        intra-op thread, or paused midway) passes the check torn. A change made after the
        guard's wait (the optimizer step itself, even for a tensor the owned set misses,
        such as a view of a flat buffer) cannot race with the capture and does not count.
        The first snapshot of such a tensor, before it was seen changing, is captured
        lazily and only the version check guards it (docs/guarantees.md, item 9). Without
        a guard nothing is watched: there is no point that separates the forward pass
        from the optimizer step."""
        assert self._plan_cache is not None
        large = self._plan_cache.large
        self._watched = []
        if not self._guards or not large:
            return []
        owned = self.owned_pointers()
        pointers = list(map(every.__getitem__, large))
        if owned.issuperset(pointers):
            return []
        changing = self._changes_seen
        picked: set[int] = set()
        for i, pointer in zip(large, pointers, strict=True):
            if pointer in owned:
                continue
            ref = refs[i]
            if ref.key in changing:
                picked.add(i)
            elif ref.version is not None:
                self._watched.append(ref)
        if picked:
            picked.update(j for j in self._plan_cache.aliases if refs[j].alias_of in picked)
        return sorted(picked)

    def _note_changes(self) -> None:
        """At the guard's wait, on the training thread: every operation it ran since the
        last ``snapshot()`` has ended, so a watched tensor whose version counter moved was
        written before this optimizer step; it is copied at ``snapshot()`` from now on,
        and a warning names it once (see :meth:`_changing`)."""
        watched, self._watched = self._watched, []
        for ref in watched:
            if ref.tensor._version == ref.version or ref.key in self._changes_seen:
                continue
            self._changes_seen.add(ref.key)
            log.warning(
                "tensor %r changed between snapshot() and the optimizer step although no "
                "guarded optimizer owns it (a buffer updated in forward?): it is copied at "
                "snapshot() from now on (%d bytes each time), since a lazy capture races "
                "with whatever writes it. List it in Checkpointer(eager=[...]) to copy it "
                "from the first snapshot on.",
                ref.key,
                ref.tensor.numel() * ref.tensor.element_size(),
            )

    def wait_captured_blocking(self, *, report: bool = True) -> float:
        """Block until every pending capture is done; return the seconds waited. With
        ``report``, then apply the failure policy."""
        pending = self.engine.pending_captures()
        waited = 0.0
        if pending:  # else (most steps) nothing to time or to charge
            t0 = time.perf_counter()
            concurrent.futures.wait([f.captured for f in pending])
            waited = time.perf_counter() - t0
            for f in pending:
                f.stats.guard_s += waited
        if report:
            self.report_failures()
        return waited

    def guard(
        self, optimizer: Any, mode: GuardMode = "cpu", closure: bool | None = None
    ) -> Any:
        self.check_open()
        opt = unwrap_optimizer(optimizer)
        if closure not in (None, True, False):
            raise ConfigurationError(f"closure must be None, True or False, got {closure!r}")
        resolved = resolve_guard_mode(mode, self.cuda)
        if resolved == "stream" and self.options.verify_sources:
            raise ConfigurationError(
                'verify_sources=True needs guard(mode="cpu"): with the stream guard the '
                "optimizer may legitimately change a source before its copy is seen "
                "complete, which the check would report as a violation"
            )
        fence: Callable[[Any, Any, Any], None] | None = None
        if resolved == "stream" and self.cuda is not None:
            fence = stream_guard_hook(
                self.cuda, self.engine.pending_captures, closing=lambda: self._closing
            )

        def wait() -> None:
            # a lazy restore still loading this optimizer's state holds its step; a failed
            # one raises: stepping on state that was not restored would corrupt training
            self.lazy.hold(opt)
            # never raises into the optimizer step: a failed snapshot must not cost a
            # training step; failures go to the handle, the log, metrics and the policy
            if self._closing:
                return
            try:
                if fence is not None:
                    fence(None, (), {})
                else:
                    self.wait_captured_blocking(report=False)
                if self._watched:
                    self._note_changes()
            except Exception:
                log.exception("lazyckpt's guard failed to wait for the pending captures")

        def hook(_opt: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
            # the hook runs at every step, with cold caches after a forward and backward
            # pass: a step without a closure (its only argument the optimizer) skips the
            # closure lookup
            if closure is not False and (kwargs or len(args) != 1 or args[0] is not opt):
                wrapped = wrap_closure(args, kwargs, wait)
                if wrapped is not None:
                    return wrapped
            wait()
            return None

        handle = opt.register_step_pre_hook(hook)
        self._guards.append((opt, handle))
        return handle


def _retrieve(future: asyncio.Future[None]) -> None:
    if not future.cancelled():
        future.exception()  # a failure is the handle's and the policy's to report


async def captures_done(flights: Sequence[Flight]) -> None:
    """Wait, on the caller's loop, until these captures are done, failed or not. Cancelling
    the wait leaves the captures alone (``asyncio.wait`` cancels nothing, and nothing here
    cancels the engine's futures)."""
    if not flights:
        return
    waits = [asyncio.wrap_future(f.captured) for f in flights]
    for w in waits:
        w.add_done_callback(_retrieve)
    await asyncio.wait(waits)


def make_core(tiers: Sequence[Tier], options: dict[str, Any]) -> _Core:
    return _Core(tiers, CheckpointerOptions.from_kwargs(options))
