"""The engine: the pure core compiled into the kernels a host program calls, over one state it keeps.

``replay.py`` holds the pure steps and ``functional.py`` offers them to code that runs inside ``jax.jit``. A host
program (the plane, a Ray shard) calls compiled kernels instead, and this module builds them:

* **the bundled state form**: kernels take and return the state as a ``LeafBundle`` (its large leaves plus every
  small counter in one uint32 vector), since each array through a jit boundary costs dispatch time. ``Engine.state``
  is the pytree, assembled from that form when it is read.
* **reading and donating kernels**: kernels that only read storage take the ring undonated and do not return it (an
  unchanged buffer returned from a jit is copied whole); the rest of the state is donated.
* **compile counting**: every XLA compilation is attributed to the kernel whose call triggered it
  (``Engine.compile_counts``), so a test or benchmark can assert that steady state compiles nothing.
* **one padding rule**: ``replay.compile_size`` (pure arithmetic, so the functional API uses it without an engine)
  rounds a row count up to the few sizes kernels are compiled for, for every caller (ingest chunks of the plane and
  the functional API via ``replay.ingest_chunks``, checkpoint increments, Ray shard draws, the RLlib adapter's GAE
  kernel).
* **rollout kernels**: ``RolloutEngine`` does the same for a rollout buffer (``rollouts.py``).

The engine decides nothing: it has no waits, limits, schedule or input checks beyond what a kernel needs. Those are
the plane's (``plane.py``).
"""

from __future__ import annotations

import collections
import functools
import re
import threading
from typing import Any, Callable, Optional

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from conduit_jax import limits, replay, rollouts, runtime, staging
from conduit_jax._pytree import LeafBundle
from conduit_jax._pytree import replace as _replace
from conduit_jax.errors import ConfigError, SpecError
from conduit_jax.replay import Delivery, ReplayConfig, ReplayState, StateTypes, compile_size, computable, padded_rows


# ------------------------------------------------------------------------------------------------------------------
# placement inside a kernel, and the padding rule
# ------------------------------------------------------------------------------------------------------------------
_STABLEHLO_BYTES = {"f32": 4, "i32": 4, "ui32": 4, "i1": 1, "ui8": 1, "i8": 1, "f16": 2, "bf16": 2, "ui16": 2,
                    "i16": 2, "f64": 8, "i64": 8, "ui64": 8}


def memory_moves(stablehlo: str) -> list[tuple[str, int]]:
    """(destination memory kind, bytes) of every move between memory kinds in a kernel's StableHLO lowered for a GPU
    (``Engine.lowered(..., platform="cuda")``; XLA:CPU lowers these moves to nothing, so its HLO shows none).

    A move is a placement annotation whose operand lives elsewhere: for a device destination, a value computed by a
    host computation or a pinned_host argument; for a host destination, anything else. An annotation of where a value
    already is (a ring written in place on the host and returned) is not a move. Tests and ``benchmarks/gpu.py``
    read the bytes a kernel moves per call from it."""
    lines = stablehlo.splitlines()
    on_host = set(re.findall(r'(%arg\d+): tensor<[^>]*> \{mhlo.memory_kind = "pinned_host"', stablehlo))
    for i, line in enumerate(lines):  # values an op computes on the host (its text, regions included, says so)
        match = re.match(r"(\s*)(%[\w.]+)(?::\d+)? = ", line)
        if match:
            end = i + 1
            while end < len(lines) and not re.match(match.group(1) + r"(%|return|})", lines[end]):
                end += 1
            text = "\n".join(lines[i:end + 1])
            constraint = re.match(r"\s*%[\w.]+ = sdy.sharding_constraint (%[\w.]+)", line)  # where it was
            if '_xla_compute_type = "host"' in text or (constraint and constraint.group(1) in on_host):
                on_host.add(match.group(2))
    found = []
    for match in re.finditer(r'annotate_device_placement\((%[\w.]+)(?:#\d+)?\).*?_xla_buffer_placement = '
                             r'"(\w+)".*?-> tensor<([^>]*)>', stablehlo):
        operand, kind, shape = match.groups()
        if (operand in on_host) == (kind == "pinned_host"):
            continue
        *dims, dtype = shape.split("x")
        found.append((kind, int(np.prod([int(d) for d in dims])) * _STABLEHLO_BYTES[dtype]))
    return found


MAX_KEPT_COUNTS = 4096  # distinct staged-block item counts an engine keeps as device scalars
UPDATE_HEADROOM = 4  # a timing-dependent engine pads its first batch of updates to this multiple of its size


@functools.lru_cache(maxsize=4096)  # called on every kernel that carries staged rows
def staged_rows(n: int, num_shards: int, shard_capacity: int) -> int:
    """Rows of the block that carries ``n`` staged items into a kernel: ``num_shards`` times a power of four, at most
    a ring. How many items wait for a draw can depend on thread timing (producers racing a sampler), so the buckets
    are coarse: at most one compiled variant per factor of four, with rows past ``n`` dropped by the write."""
    per_shard = compile_size(-(-n // num_shards))
    per_shard <<= (per_shard.bit_length() - 1) % 2
    return num_shards * min(per_shard, shard_capacity)


# ------------------------------------------------------------------------------------------------------------------
# compile counting
# ------------------------------------------------------------------------------------------------------------------
class _Running(threading.local):
    def __init__(self):
        self.kernels: list[tuple[collections.Counter, str]] = []  # (counter, kernel) per running call, innermost last


_running = _Running()  # the kernels whose calls are running on this thread


def _count_compile(event: str, duration: float, **kwargs) -> None:
    if event == "/jax/core/compile/backend_compile_duration":
        kernels = _running.kernels
        if kernels:
            counter, kernel = kernels[-1]
            counter[kernel] += 1


jax.monitoring.register_event_duration_secs_listener(_count_compile)


class CompileScope:
    """While a kernel is called, attribute the XLA compilations JAX reports on this thread to ``kernel`` in
    ``counter`` (a ``collections.Counter``, where ``kernel`` counts from 0 once the scope exists). It keeps no state of
    its own between ``__enter__`` and ``__exit__`` (the thread's stack does), so an engine makes one per kernel and
    enters it on every call, from any thread: an append and a pop, for the kernel calls a loop makes."""

    def __init__(self, counter: collections.Counter, kernel: str):
        counter.setdefault(kernel, 0)
        self._entry = (counter, kernel)

    def __enter__(self):
        _running.kernels.append(self._entry)

    def __exit__(self, *exc):
        _running.kernels.pop()
        return False


def compiled(fn, name: str, counter: Optional[collections.Counter] = None, **jit_options):
    """``jax.jit(fn, **jit_options)`` for a kernel that runs outside an engine's state (a transform a framework
    adapter applies to its own batches, e.g. ``transforms.gae``), with its XLA compilations counted under ``name`` in
    ``counter`` (default: ``COMPILES``), so a steady-state check covers it as it covers the engines' kernels."""
    jitted = jax.jit(fn, **jit_options)
    counter = COMPILES if counter is None else counter

    @functools.wraps(fn)
    def call(*args, **kwargs):
        with CompileScope(counter, name):
            return jitted(*args, **kwargs)

    call.jitted, call.lower = jitted, jitted.lower  # lower(...).compile(): compiled ahead, e.g. outside a lock
    return call


COMPILES: collections.Counter = collections.Counter()  # compilations of the kernels ``compiled`` built, by name


class KernelCache:
    """Kernels a module beside an engine builds over that engine's config and placement (a checkpoint's snapshot
    copy): each built on its first use and kept as long as the engine. A plane that moves its state (``replan``)
    builds a new engine, so kernels compiled for the old placement go with the old engine."""

    def __init__(self):
        self._kernels: dict[Any, Any] = {}

    def get(self, key, build: Callable[[], Any]):
        """The kernel kept under ``key``; ``build()`` makes it on the first call."""
        kernel = self._kernels.get(key)
        if kernel is None:
            kernel = self._kernels[key] = build()
        return kernel


# ------------------------------------------------------------------------------------------------------------------
# priority updates travel as one array
# ------------------------------------------------------------------------------------------------------------------
def pack_updates(updates: list[tuple[np.ndarray, np.ndarray]]) -> np.ndarray:
    """Checked updates ``[(ids int32[m, 2], priorities float32[m]), ...]`` as one int32[bucket, 4] array, a row (id row,
    id generation, priority bits, valid) per update, padded to a power of two (one kernel per bucket, one transfer
    instead of three). ``unpack_updates`` reads it in the kernel."""
    m = sum(ids.shape[0] for ids, _ in updates)
    packed = np.zeros((1 << max(0, (m - 1).bit_length()), 4), np.int32)
    at = 0
    for ids, priorities in updates:
        packed[at:at + ids.shape[0], :2] = ids
        packed[at:at + ids.shape[0], 2] = priorities.view(np.int32)
        at += ids.shape[0]
    packed[:m, 3] = 1
    return packed


def unpack_updates(updates):
    """(ids int32[m, 2], priorities float32[m], valid bool[m]) from ``pack_updates``' array, inside a kernel."""
    return updates[:, :2], lax.bitcast_convert_type(updates[:, 2], jnp.float32), updates[:, 3] != 0


# ------------------------------------------------------------------------------------------------------------------
# state checks
# ------------------------------------------------------------------------------------------------------------------
# ------------------------------------------------------------------------------------------------------------------
# the engine
# ------------------------------------------------------------------------------------------------------------------
class Engine:
    """Compiled kernels over one buffer's state, and that state in the kernels' form.

    Besides the state, the engine holds the host work that is not in it yet, in the order it was given: checked
    priority updates (``pend``) and then staged ingests (``ingest(..., staged=True)``: packed into a host
    ``StagingArea``, see ``staging.py``, or a device batch's rows packed on the device). Every kernel the engine
    dispatches applies the updates, then writes the staged rows, then does its own work, all in one dispatch (the
    updates and the rows in one pass over the sampler's index; see ``_dispatch``), except that a step given with
    ``rows_apart`` runs after a kernel that writes the rows; ``flush`` runs a kernel for just those. So whatever
    reads the state (a draw, ``state``, ``status``, ``run``) sees everything given before it. An update given while
    rows are staged applies before them, unless given with ``pend(after_staged=True)`` (program order, as the plane
    gives its updates).

    Not thread-safe: the caller serialises calls (the plane holds its lock around each), except ``pend``, a deque
    append that any thread may make. ``state`` may be None (freed, e.g. before a restore reads the saved one);
    ``seed`` builds a fresh empty state. ``staging_rows``: items the staging area holds (default
    ``staging.staging_rows``; the caller checks a given one with ``staging.checked_rows``).
    ``timing_dependent``: how many updates and staged rows a kernel carries depends on thread timing (a delivery
    worker draws while producers ingest): the first batch of pending updates is padded to ``UPDATE_HEADROOM`` times
    its size (``_take_updates``), and each kernel carrying a staged block is compiled for the next bucket up too
    (``_compile_ahead``), so a run whose timing moves into a larger size compiles nothing mid-run. ``pending``: the
    deque ``pend`` appends to (an engine that replaces another on the same buffer takes over its deque, so an update
    given while they are swapped is not lost). ``kernels``: the compiled
    kernels' cache (default: the engine's own); engines of one configuration whose steps of one name are one function
    (``add_step``) may share one, so the second compiles nothing. ``mirror_status``: keep the host's copy of the status
    scalars a host policy decides on (``known``); without it a staged ingest reads nothing from the device first (a
    caller that asks no ``known`` question, e.g. a framework adapter that keeps its own counts).
    """

    def __init__(self, config: ReplayConfig, shardings, seed: Optional[int] = 0, *,
                 staging_rows: Optional[int] = None, timing_dependent: bool = False,
                 pending: Optional[collections.deque] = None, kernels: Optional[dict] = None,
                 mirror_status: bool = True):
        self.config, self.shardings = config, shardings
        self.abstract = abstract = jax.eval_shape(functools.partial(replay.init, config, 0))
        self.bundle = bundle = LeafBundle(abstract, shardings)
        self.state_types = StateTypes.of(config)
        self._devices = set(config.mesh.devices.flat)  # a device batch elsewhere is packed on the host
        self._leaf_shardings = jax.tree_util.tree_leaves(shardings)
        self._storage_large = bundle.count_large(len(jax.tree_util.tree_leaves(abstract.storage)))
        sampler = config.sampler
        # a sampler whose deliverable count is an index (windows or items with mass), not arithmetic on calls: each
        # kernel that can change it also returns it, and the host reads that scalar only when a check needs it, by
        # then long computed (a status kernel of its own would add a dispatch and a wait to every sample)
        self.reports_deliverable = sampler.deliverable is not None and not sampler.consumes
        # XLA:CPU runs the collectives of an emulated multi-device mesh in-process; with many multi-device programs
        # queued on few cores one device's part can miss the rendezvous and XLA aborts the process (seen here after
        # ~300 back-to-back priority updates on 8 emulated devices). There, each kernel completes before the next.
        self._one_at_a_time = config.num_shards > 1 and config.mesh.devices.flat[0].platform == "cpu"
        self.compiles: collections.Counter = collections.Counter()  # kernel name -> XLA compilations
        self.dispatches: collections.Counter = collections.Counter()  # kernel name -> calls (status reads apart)
        self._scopes: dict[str, CompileScope] = {}  # kernel name -> its compile scope (``counting``)
        # item counts of staged blocks as device scalars, made once each: a NumPy scalar argument costs each kernel
        # call a transfer of its own (~4 us on XLA:CPU), and a loop ingests the same few counts over and over
        self._counts: dict[int, jax.Array] = {}
        self._count_sharding = NamedSharding(config.mesh, P())
        # (step, update rows, (staged rows, host-packed) or None, recycles) -> (compiled kernel, its name)
        self._kernels: dict[tuple, Any] = {} if kernels is None else kernels
        self.beside = KernelCache()  # kernels other modules build over this engine's state (checkpoint.py)
        self._mirrors = bool(mirror_status)
        self._steps = {"": (lambda state: (state,), 0),
                       "sample": (functools.partial(replay.sample, config), 1),
                       "version": (lambda state, version: (replay.set_policy_version(config, state, version),), 0)}
        self._step_options: dict[str, tuple] = {}  # a caller's step (add_step) -> (writes, donates, keeps_status)
        joined = _joiner(bundle, shardings)
        self._status_kernel = jax.jit(lambda *form: replay.status(config, joined(*form)))
        rows = staging.staging_rows(config.layout, config.capacity, config.num_shards) if staging_rows is None \
            else staging_rows
        self.staging = staging.StagingArea(config.layout, rows,
                                           staged_rows(rows, config.num_shards, config.shard_capacity))
        # a device batch ingested under a staging schedule: its rows packed on the device by a small kernel of their
        # own (the copy is the plane's, so the caller may donate its arrays), and its item count; written by the next
        # kernel like the staging area's rows. At most one of the two waits at a time (``ingest`` keeps them in order)
        self._device_rows: Optional[tuple[jax.Array, int]] = None
        # checked priority updates not yet in the state, oldest first: the next kernel applies them
        self.pending: collections.deque[tuple[np.ndarray, np.ndarray]] = collections.deque() if pending is None \
            else pending
        self._update_rows, self.timing_dependent = 0, bool(timing_dependent)
        # checked updates given after the rows staged now (``pend(after_staged=True)``): the kernel that writes the
        # rows applies them right after
        self._after_rows: collections.deque[tuple[np.ndarray, np.ndarray]] = collections.deque()
        # the state, in one or both of two forms that agree: the pytree (``_tree``) and the kernels' form (``_form``:
        # storage's large leaves, the rest's large leaves, the small leaves' vector). Kernels produce the form;
        # reading ``state`` joins it once.
        self._tree: Optional[ReplayState] = None
        self._form = None
        if seed is not None:
            self._keep(*jax.jit(lambda: bundle.split(replay.init(config, seed)),
                                out_shardings=(bundle.large_shardings, bundle.small_sharding))())
        self._delivery_layout = None  # (treedef, [(shape, dtype, sharding)]) of the batches sample kernels deliver
        # the host's copy of the status scalars a host policy decides on (size, deliverable, limiter balance), kept
        # by arithmetic on each call: read from the device only when unknown (see ``known``)
        self._mirror: Optional[dict[str, Any]] = None

    # -- kernels ----------------------------------------------------------------------------------------------------
    def reading_kernel(self, step, num_outputs: int, recycles: bool = False, delivery: bool = False,
                       writes: bool = False, donates: tuple = ()):
        """Jit ``step(state, *args) -> (state', *outputs)`` over the state's bundled form. For a step that only reads
        storage: storage's large leaves (the ring) go in undonated and do not come out, the rest is donated and keeps
        its placement. Call it with ``run`` (which writes staged rows and pending updates first, in a kernel of
        their own). ``writes``: the step writes storage too; the whole state is donated and returned (the engine's
        own kernels that carry staged rows).

        ``recycles``: the kernel takes one more donated argument after the state, a finished output of the same
        shapes, which it never reads: XLA writes the outputs into its buffers (``keep_unused``, or jit would drop it).
        ``delivery``: compiled with the delivery kernels' XLA options (``runtime.delivery_compiler_options``).
        ``donates``: positions in ``args`` (after the recycled output, if any) of arguments donated too."""
        storage_large = 0 if writes else self._storage_large
        # not self: a kernel cache shared by engines keeps no engine alive
        joined, split = _joiner(self.bundle, self.shardings), self.bundle.split

        def kernel(storage_leaves, rest_leaves, small, *args):
            new_state, *outputs = step(joined(storage_leaves, rest_leaves, small), *args[1:] if recycles else args)
            large, small = split(new_state)
            return (large[storage_large:], small, *outputs)

        donated = ((0, 1, 2) if writes else (1, 2)) + tuple(3 + int(recycles) + i for i in donates)
        options = runtime.delivery_compiler_options(self.config.mesh.devices.flat) if delivery else None
        return jax.jit(kernel, donate_argnums=donated + ((3,) if recycles else ()), keep_unused=recycles,
                       out_shardings=(self.bundle.large_shardings[storage_large:], self.bundle.small_sharding)
                       + (None,) * num_outputs, compiler_options=options)

    def _kernel(self, step_name: str, updates: int, staged: Optional[tuple[int, bool, int]],
                recycles: bool = False):
        """The compiled kernel that applies ``updates`` rows of ``pack_updates``' array (0: none), then writes a
        staged block (``staged``: its (rows, host-packed, rows of an update applied right after it: 0 for none), or
        None), then runs step ``step_name`` ("" for none,
        "sample", "version"). Its outputs: the finished marker of the staged block (if any), the step's own, and the
        deliverable count (if it may have changed and the sampler keeps it in an index)."""
        key = (step_name, updates, staged, recycles)
        kernel = self._kernels.get(key)
        if kernel is not None:
            return kernel[0]
        config = self.config
        step, own_outputs = self._steps[step_name]
        _, step_donates, _, _ = self._step_options.get(step_name, _BUILT_IN_STEP)
        writes = self._writes(step_name, staged)
        reports = self.reports_deliverable and (staged is not None or step_name == "version" or (
            step_name == "sample" and config.sampler.sampling_retires))

        def full_step(state, *args):
            args = list(args)
            before = unpack_updates(args.pop(0)) if updates else None
            outputs = []
            if staged is None and before is not None:
                state = _replace(state, sampler=replay.update(config, state, *before))
            if staged is not None:
                block, n = args.pop(0), args.pop(0)
                then = unpack_updates(args.pop(0)) if staged[2] else None
                # the updates, the rows and the updates given after them, in one pass over the sampler's index
                state = replay.ingest(config, state, block, n, packed=staged[1], update_before=before, then_update=then)
                # a scalar of its own that is ready once this kernel has run, even after the state has been donated to
                # another jit: the staging area it read is packed again only then
                outputs.append(jnp.sum(state.storage.cursor))
            state, *own = step(state, *args)
            outputs += own
            if reports:
                outputs.append(replay.deliverable(config, state))
            return (state, *outputs)

        # the kernel's arguments before the step's own
        before = int(bool(updates)) + (0 if staged is None else 2 + int(bool(staged[2])))
        kernel = self.reading_kernel(full_step, int(staged is not None) + own_outputs + int(reports), recycles,
                                     delivery=step_name == "sample", writes=writes,
                                     donates=tuple(before + i for i in step_donates))
        self._kernels[key] = kernel, self._kernel_name(*key)
        return kernel

    def _writes(self, step_name: str, staged) -> bool:
        """Whether the kernel of step ``step_name`` (carrying a ``staged`` block or None) writes storage: its whole
        state goes in donated and comes out, the ring included."""
        return staged is not None or self._step_options.get(step_name, _BUILT_IN_STEP)[0]

    @staticmethod
    def _kernel_name(step_name: str, updates: int, staged: Optional[tuple[int, bool, int]], recycles: bool) -> str:
        parts = [f"update[{updates}]"] if updates else []
        if staged is not None:
            parts.append(f"ingest[{staged[0]}{',packed' if staged[1] else ''}]")
            if staged[2]:
                parts.append(f"update[{staged[2]}]")
        if step_name:
            parts.append(step_name + ("[recycle]" if recycles else ""))
        return "+".join(parts)

    def _dispatch(self, step_name: str, *step_args, recycle=None, block=None, write: bool = True) -> list:
        """Run step ``step_name`` in one kernel that first applies the pending updates and writes the staged rows
        (or ``block``: a (device batch, n) written instead, after the updates), then the updates given after those
        rows; return the step's outputs. ``write=False``: the staged rows stay staged. Updates and rows go in one
        pass over the sampler's index (``replay.ingest``'s ``update_before`` / ``then_update``): two passes over a
        sum tree in one kernel make XLA:CPU copy every level twice (8 MB for a 100,000-slot tree); where that is not
        possible (a sampler without the one-pass ops, updates on both sides of the rows) the pending updates get a
        kernel of their own first."""
        waiting = self.staged_items
        if write and self.pending and (block is not None or waiting) and (
                self.config.sampler.update_then_insert is None or self._after_rows):
            self._dispatch("", write=False)
        if write and waiting and self._step_options.get(step_name, _BUILT_IN_STEP)[3]:
            self._dispatch("")  # a step that scatters into the index: the rows in a kernel of their own first
        storage_large, rest_large, small = self._live_form
        updates = self._take_updates() if self.pending else None
        args: list = [] if recycle is None else [recycle]
        if updates is not None:
            args.append(updates)
        staged = None
        device_rows = self._device_rows if write and block is None else None
        if write and block is not None:
            batch, n = block
            staged = (jax.tree_util.tree_leaves(batch)[0].shape[0], False, 0)
            args += [batch, self._count(n)]
        elif device_rows is not None or (write and self.staging.count):
            if device_rows is not None:
                packed_rows, n = device_rows
            else:
                packed_rows, n = self.staging.block(staged_rows(self.staging.count, self.config.num_shards,
                                                                self.config.shard_capacity))
            # updates given after these rows were staged (``pend(after_staged=True)``) ride their write
            after = pack_updates([self._after_rows.popleft() for _ in range(len(self._after_rows))]) \
                if self._after_rows else None
            staged = (packed_rows.shape[0], True, 0 if after is None else after.shape[0])
            args += [packed_rows, self._count(n)] + ([] if after is None else [after])
        key = (step_name, 0 if updates is None else updates.shape[0], staged, recycle is not None)
        built = self._kernels.get(key)
        kernel, name = built if built is not None else (self._kernel(*key), self._kernel_name(*key))
        call_args = (storage_large, rest_large, small, *args, *step_args)
        if built is None and self.timing_dependent and staged is not None and staged[1] and device_rows is None:
            # (a device batch's rows wait one batch at a time: their bucket is the caller's batch size, not timing)
            self._compile_ahead(key, call_args, block_at=3 + int(recycle is not None) + int(updates is not None))
        self.dispatches[name] += 1
        with self.counting(name):
            out = self._settled(kernel(*call_args))
        if not self._writes(step_name, staged):
            rest_large, small, *outputs = out
            self._keep(storage_large + tuple(rest_large), small)
        else:
            large, small, *outputs = out
            self._keep(large, small)
            if staged is not None:
                finished = outputs.pop(0)
                if device_rows is not None:
                    self._device_rows = None
                elif block is None:
                    self.staging.given(finished)
        mirror = self._mirror
        if len(outputs) > self._steps[step_name][1]:  # the deliverable count after this kernel, a device scalar
            reported = outputs.pop()
            if mirror is not None:
                mirror["deliverable"] = reported
        return outputs

    def _compile_ahead(self, key: tuple, call_args: tuple, block_at: int) -> None:
        """Compile the kernel ``key`` names (carrying a block of the staging area's rows, the NumPy array at
        ``block_at`` in ``call_args``) for the next bucket of staged rows up (``staged_rows``' next factor of four,
        within the staging area), without running it: under a delivery worker how many rows wait for a draw depends
        on thread timing (an adaptive depth that drops skips a refill), and a larger bucket met mid-run would stall
        that draw for a compilation. It is lowered with this call's other arguments as they are (lowering reads their
        types and placements only), so JAX's compile cache serves the later call."""
        step_name, updates, (rows, packed, after), recycles = key
        config = self.config
        bigger = staged_rows(4 * rows, config.num_shards, config.shard_capacity)
        ahead = (step_name, updates, (bigger, packed, after), recycles)
        if bigger == rows or bigger > self.staging.area_rows or ahead in self._kernels:
            return
        block = call_args[block_at]
        arguments = (*call_args[:block_at], jax.ShapeDtypeStruct((bigger, *block.shape[1:]), block.dtype),
                     *call_args[block_at + 1:])
        kernel = self._kernel(*ahead)
        with self.counting(self._kernel_name(*ahead)):
            kernel.lower(*arguments).compile()

    def _count(self, n: int) -> jax.Array:
        """``n`` as the int32 device scalar a staged block's kernel takes (kept for the first ``MAX_KEPT_COUNTS``
        counts seen; later ones are placed per call, so every call passes the same kind of argument)."""
        count = self._counts.get(n)
        if count is None:
            count = jax.device_put(np.int32(n), self._count_sharding)
            if len(self._counts) < MAX_KEPT_COUNTS:
                self._counts[n] = count
        return count

    def flush(self) -> None:
        """Apply the pending updates and write the staged rows (nothing when there are none; see ``_dispatch``)."""
        if self.pending or self.staged_items:
            self._dispatch("")

    @property
    def staged_items(self) -> int:
        """Items ingested and not written yet: the staging area's rows, or a device batch's rows packed on the
        device."""
        return self.staging.count + (0 if self._device_rows is None else self._device_rows[1])

    # -- the state --------------------------------------------------------------------------------------------------
    @property
    def state(self) -> Optional[ReplayState]:
        """The whole state as one pytree (staged rows and pending updates written first), assembled from the kernels'
        form once after each kernel call."""
        if self._form is not None:
            self.flush()
        if self._tree is None and self._form is not None:
            storage_large, rest_large, small = self._form
            self._tree = self.bundle.to_tree(storage_large + rest_large, small)
        return self._tree

    @state.setter
    def state(self, tree: Optional[ReplayState]) -> None:
        """A state from outside, split into the kernels' form now (its large leaves are shared, so the pytree stays
        valid too); a leaf placed elsewhere than ``shardings`` says is moved there first. None frees the state. What
        was given before (pending updates, staged rows) goes into the state being replaced, as the calls' order has it."""
        leaves = None if tree is None else self.check_state(tree)  # a refused state leaves this one as it was
        if self._form is not None:
            self.flush()
        self._form, self._mirror = None, None
        if tree is not None:
            if any(_placed_elsewhere(leaf, target) for leaf, target in zip(leaves, self._leaf_shardings)):
                tree = jax.device_put(tree, self.shardings)
            self._keep(*self.bundle.from_tree(tree))
        self._tree = tree

    def check_state(self, tree, where: str = "state") -> list:
        """The leaves of ``tree``; ConfigError unless it is a state of this configuration (``StateTypes.check``)."""
        return self.state_types.check(tree, where)

    @property
    def _live_form(self) -> tuple:
        """The kernels' form of the state; ConfigError if the state was freed (``state = None``)."""
        if self._form is None:
            raise ConfigError("the state was freed (plane.state = None): assign one (plane.state = state) or restore "
                              "a checkpoint before using the plane")
        return self._form

    def block_until_ready(self) -> None:
        """Wait until everything given so far is in the state and every kernel dispatched on it has finished."""
        self.flush()
        jax.block_until_ready(self._form)

    def _keep(self, large, small) -> None:
        self._form = (tuple(large[:self._storage_large]), tuple(large[self._storage_large:]), small)
        self._tree = None

    def _settled(self, outputs):
        """``outputs`` of a kernel call, waited for on an emulated CPU mesh (see ``_one_at_a_time``)."""
        return jax.block_until_ready(outputs) if self._one_at_a_time else outputs

    def counting(self, kernel: str) -> CompileScope:
        """The scope that counts ``kernel``'s compilations (one per kernel, made on its first call)."""
        scope = self._scopes.get(kernel)
        if scope is None:
            scope = self._scopes[kernel] = CompileScope(self.compiles, kernel)
        return scope

    def compile_counts(self) -> dict[str, int]:
        """XLA compilations per kernel so far (counted from JAX's compile events); steady state adds none."""
        return dict(sorted(self.compiles.items()))

    def kernel_cache_sizes(self) -> dict[str, int]:
        """Compiled variants held by each kernel's jit cache (a steady loop keeps them at 1)."""
        return {name: kernel._cache_size() for kernel, name in self._kernels.values()}

    def lowered(self, kernel: str, *args, platform: Optional[str] = None):
        """``jax.stages.Lowered`` of a kernel over the current state, to read its HLO: ``sample``, ``version`` (with
        the version), ``update`` and ``update+sample`` (with ``pack_updates``' array), ``ingest`` and
        ``ingest+sample`` (with ``(rows, block, n)``: a packed host block of ``rows`` rows holding ``n`` items),
        ``update+ingest`` / ``ingest+update`` (with the update array before / after ``(rows, block, n)``: an update
        given before / after the rows were staged). ``platform`` (e.g. ``"cuda"``): lowered for that backend instead
        of this one, to read what a GPU would be asked to move."""
        step_name = {"sample": "sample", "update+sample": "sample", "ingest+sample": "sample", "version": "version",
                     "update": "", "ingest": "", "update+ingest": "", "ingest+update": ""}[kernel]
        args = list(args)
        updates = args[0].shape[0] if kernel.startswith("update") else 0
        staged = None
        if "ingest" in kernel:
            at = int(kernel.startswith("update"))  # where (rows, block, n) start
            rows, block, n = args[at:at + 3]
            then = args[at + 3] if kernel.endswith("+update") else None
            staged = (rows, True, 0 if then is None else then.shape[0])
            args = args[:at] + [block, np.int32(n)] + ([] if then is None else [then])
        elif kernel == "version":
            args = [np.int32(args[0])]
        jitted = self._kernel(step_name, updates, staged)
        return jitted.trace(*self._live_form, *args).lower(lowering_platforms=None if platform is None else (platform,))

    def run(self, name: str, kernel, *args) -> list:
        """Call a kernel built by ``reading_kernel`` on the state (its compilations counted under ``name``), keep
        the state it returns, return its outputs. Pending updates and staged rows are written first, by a kernel of
        their own. The host's status copy is read from the device again next time (the engine cannot tell what the
        kernel changed)."""
        self.flush()
        self._mirror = None
        storage_large, rest_large, small = self._live_form
        self.dispatches[name] += 1
        with self.counting(name):
            rest_large, small, *outputs = self._settled(kernel(storage_large, rest_large, small, *args))
        self._keep(storage_large + tuple(rest_large), small)
        return outputs

    # -- a caller's own steps ------------------------------------------------------------------------------------------
    def add_step(self, name: str, step, num_outputs: int, *, writes: bool = False, donates: tuple = (),
                 keeps_status: bool = False, rows_apart: bool = False) -> None:
        """Give the engine a pure ``step(state, *args) -> (state', *outputs)`` (``num_outputs`` outputs) that
        ``call(name, *args)`` runs in the engine's own kernel path: the pending updates, then the staged rows, then
        the step, in one dispatch (counted in ``dispatches`` and its compilations in ``compiles`` under the kernel's
        name, e.g. ``"update[8]+ingest[64,packed]+draw"``; one compiled variant per combination of update bucket,
        staged block and argument shapes, so a steady loop compiles nothing new).

        ``writes``: the step writes storage (its ring is donated and returned; else the step only reads it and it
        stays in place). ``donates``: positions in ``args`` of arguments the step consumes (donated to the kernel,
        e.g. an array it returns updated). ``keeps_status``: the step leaves the size, the deliverable count and the
        limiter's balance as they were, so the host's copy of them stays valid (else it is read from the device again
        when a host policy or a staged ingest needs it). ``rows_apart``: the step scatters into the sampler's index (a
        retirement, a priority update), so staged rows are written by a kernel of their own before it (see
        ``_dispatch``: beside a run write such a scatter makes XLA:CPU copy every sum-tree level). ConfigError if
        ``name`` is taken."""
        if name in self._steps:
            raise ConfigError(f"add_step(): a step named {name!r} exists already ({sorted(self._steps)} are taken); "
                              f"give this one another name")
        if not isinstance(num_outputs, int) or num_outputs < 0:
            raise ConfigError(f"add_step(): num_outputs must be an int >= 0, got {num_outputs!r}")
        self._steps[name] = (step, num_outputs)
        self._step_options[name] = (bool(writes), tuple(int(i) for i in donates), bool(keeps_status),
                                    bool(rows_apart))

    def call(self, name: str, *args) -> list:
        """Run the step ``add_step`` gave as ``name`` on the state with ``args``, after the pending updates and the
        staged rows, in the same kernel (see ``_dispatch``); keep the state it returns and return its outputs (a list,
        computed asynchronously)."""
        options = self._step_options.get(name)
        if options is None:
            raise ConfigError(f"call(): no step named {name!r}; add_step() gives one (given: "
                              f"{sorted(self._step_options)})")
        outputs = self._dispatch(name, *args)
        if not options[2]:
            self._mirror = None  # the engine cannot tell what the step changed
        return outputs

    # -- what the host gives: ingests and priority updates ------------------------------------------------------------
    def ingest(self, batch, n: int, *, staged: bool = False, leaves: Optional[list] = None) -> None:
        """Take the ``n`` items of ``batch`` (a checked pytree with a leading item axis).

        Host batches (and device arrays elsewhere than this mesh) are packed into the staging area (one copy; the
        caller's buffers are never aliased): with ``staged`` they wait there for the next kernel, else a kernel
        writes them now. Either way a batch that does not fit the area's room fills it and is written one full area
        per kernel. Device arrays on this mesh of exactly a write bucket's size are written as they are by a kernel
        now, after the staged rows; with ``staged`` their rows are packed on the device instead, by a small kernel
        that does not take the state (no wait for the kernels that hold it), and wait for the next kernel.
        ``leaves``: the batch's leaves, where the caller has them (``replay.checked_batch``)."""
        if leaves is None:
            leaves = jax.tree_util.tree_leaves(batch)
        config = self.config
        if self._after_rows:
            self.flush()  # an update given after the staged rows applies before these: they are written with it now
        if staged and self._mirror is None and self._mirrors:
            self.known()  # the status before these items, read now: a read later would write them first
        on_mesh = all(isinstance(leaf, jax.Array) and leaf.sharding.device_set == self._devices for leaf in leaves)
        if on_mesh and n == padded_rows(n, config.num_shards, config.shard_capacity) and n <= config.capacity:
            self.flush()  # what waits is written first: one block waits at a time, in ingest order
            if staged:
                self._device_rows = (self._packed_on_device(batch, n), n)
            else:
                self._dispatch("", block=(batch, n))
        else:
            if self._device_rows is not None:
                self.flush()  # the device batch before these rows
            start = 0
            while start < n:
                if not self.staging.room:
                    self.flush()
                count = min(n - start, self.staging.room)
                self.staging.stage(leaves, start, count)
                start += count
            if not staged:
                self.flush()
        self._count_inserted(n, written=not staged)

    def _packed_on_device(self, batch, n: int) -> jax.Array:
        """A device batch's rows in the ring's element type, padded to the staged block's rows for ``n`` items
        (``staged_rows``: the host staging path's kernel variants), replicated over the mesh as ``replay.ingest``
        takes a block."""
        config = self.config
        rows = staged_rows(n, config.num_shards, config.shard_capacity)
        key = ("pack", n, rows)
        built = self._kernels.get(key)
        if built is None:
            layout = config.layout
            pack = jax.jit(lambda batch: jnp.pad(layout.pack_ring(batch), ((0, rows - n), (0, 0))),
                           out_shardings=NamedSharding(config.mesh, P()))
            built = self._kernels[key] = (pack, f"pack[{n}]")
        pack, name = built
        self.dispatches[name] += 1
        with self.counting(name):
            return self._settled(pack(batch))

    def _count_inserted(self, n: int, written: bool) -> None:
        """Keep the host's status copy in step with an ingest of ``n`` items."""
        mirror = self._mirror
        if mirror is None:
            return
        sampler = self.config.sampler
        mirror["size"] = min(mirror["size"] + n, self.config.capacity)
        self._move_balance(mirror, self.config.limiter.on_insert, n)
        if sampler.deliverable is None:
            mirror["deliverable"] = mirror["size"]
        elif sampler.consumes:
            mirror["deliverable"] += n
        elif not written:
            mirror["deliverable"] = None  # an index's count: known once a kernel has written the rows (it reports it)

    def _move_balance(self, mirror: dict, move, n: int) -> None:
        """The host copy's limiter balance after ``move`` (the limiter's ``on_insert`` / ``on_sample``) of ``n``
        items; nothing to compute for a limiter whose balance never moves (``Limiter.moves_balance``)."""
        if self.config.limiter.moves_balance:
            mirror["limiter_balance"] = int(move(limits.LimiterState(mirror["limiter_balance"]), n).balance)

    def pend(self, checked: tuple[np.ndarray, np.ndarray], *, after_staged: bool = False) -> None:
        """Queue a checked priority update (``spec.checked_priority_update``) for the next kernel. Any thread.

        The next kernel applies it before it writes the rows staged by then; with ``after_staged`` (the caller's
        thread only) it applies after the rows staged now, in the kernel that writes them (as a sync ingest and
        then an update would: new items take the largest priority seen before it, an update of an item those rows
        overwrite is ignored). A sampler with ``insert_then_update`` does both in one pass over its index."""
        if after_staged and self.staged_items:
            self._after_rows.append(checked)
        else:
            self.pending.append(checked)

    def _take_updates(self) -> Optional[np.ndarray]:
        """The pending updates packed for one kernel (``pack_updates``), or None."""
        pending = self.pending
        taken = [pending.popleft() for _ in range(len(pending))]  # an append meanwhile waits for the next kernel
        if not taken:
            return None
        packed = pack_updates(taken)
        # padded (rows marked invalid) to the largest bucket so far, the first one to UPDATE_HEADROOM times its size
        # where how many steps' updates one kernel coalesces depends on thread timing: each new bucket compiles a
        # kernel in the middle of a run
        rows = max(packed.shape[0], self._update_rows or packed.shape[0] * (
            UPDATE_HEADROOM if self.timing_dependent else 1))
        self._update_rows = rows
        return packed if rows == packed.shape[0] else np.concatenate(
            [packed, np.zeros((rows - packed.shape[0], packed.shape[1]), packed.dtype)])

    # -- the engine's kernels -----------------------------------------------------------------------------------------
    def sample(self, recycle: Optional[Delivery] = None) -> Delivery:
        """One batch, drawn after the pending updates and staged rows are in, in the same kernel (see ``_dispatch``);
        ``recycle``: a checked finished Delivery whose buffers receive the batch."""
        delivery, = self._dispatch("sample", recycle=recycle)
        if self._delivery_layout is None:
            leaves, treedef = jax.tree_util.tree_flatten(delivery)
            self._delivery_layout = treedef, [(leaf.shape, leaf.dtype, leaf.sharding) for leaf in leaves]
        mirror, batch_size = self._mirror, self.config.sampler.batch_size
        if mirror is not None:
            self._move_balance(mirror, self.config.limiter.on_sample, batch_size)
            if self.config.sampler.consumes:
                mirror["deliverable"] -= batch_size
        return delivery

    def set_policy_version(self, version: int) -> None:
        self._dispatch("version", np.int32(version))  # retired items can empty an eligibility index: reported

    def knows(self, need_deliverable: bool = False) -> bool:
        """Whether ``known`` answers from the host's copy (else it writes what is staged and reads the status)."""
        return self._mirror is not None and not (need_deliverable and self._mirror["deliverable"] is None)

    def known(self, need_deliverable: bool = False) -> dict[str, Any]:
        """The status scalars a host policy decides on (``size``, ``deliverable``, ``limiter_balance``) from the
        host's copy, read from the device only when unknown. A sampler whose deliverable count is an index has it
        reported by the last kernel that changed it, as a device scalar read here only when ``need_deliverable``
        (staged rows are written first when they made it unknown)."""
        mirror = self._mirror
        if mirror is not None and type(mirror["deliverable"]) is int:  # every count known on the host: the usual case
            return mirror
        if need_deliverable and mirror is not None and mirror["deliverable"] is None:
            self.flush()  # its kernel reports the count
        if not self.knows(need_deliverable):
            status = self.status()
            known = {key: status[key] for key in ("size", "deliverable", "limiter_balance")}
            if not self._mirrors:
                return known
            self._mirror = known
        if need_deliverable and not isinstance(self._mirror["deliverable"], int):  # a reported device scalar
            self._mirror["deliverable"] = int(self._mirror["deliverable"])
        return self._mirror

    def status(self) -> dict[str, int]:
        """The status scalars (``replay.status``) read from the device, after what is staged: waits for every kernel
        in flight."""
        self.flush()
        with self.counting("status"):
            status = self._status_kernel(*self._live_form)
        return {k: int(v) for k, v in jax.device_get(status).items()}

    def stats(self) -> dict[str, Any]:
        """The buffer's counters, read from the state: size, capacity, items inserted and overwritten, the
        sampler's and limiter's, the policy version, compilations per kernel."""
        status = self.status()
        config, sampler = self.config, self.config.sampler
        cursor, laps = jax.device_get((self.state.storage.cursor, self.state.storage.laps))
        inserted = sum(int(lap) * config.shard_capacity + int(c) for c, lap in zip(cursor, laps))
        out = {"size": status["size"], "capacity": config.capacity, "num_shards": config.num_shards,
               "items_inserted": inserted, "items_overwritten": inserted - status["size"],
               "sampler": sampler.name, "limiter": config.limiter.name, "compiled": self.compile_counts(),
               "dispatches": dict(sorted(self.dispatches.items()))}
        if sampler.deliverable is not None:
            out["deliverable"] = status["deliverable"]
        if "priority_updates_ignored" in status:
            out["priority_updates_ignored"] = status["priority_updates_ignored"]
        out["policy_version"] = status["policy_version"]
        if config.staleness is not None:
            out["stale_draws"] = status["stale_draws"]
        return out

    def check_recycle(self, recycle: Delivery, where: str) -> None:
        """SpecError unless ``recycle``'s buffers can hold this engine's next batch (nothing changed)."""
        if not isinstance(recycle, Delivery):
            raise SpecError(f"{where}: recycle must be a Delivery this plane returned, got {type(recycle).__name__}")
        if self._delivery_layout is None:
            raise SpecError(f"{where}: recycle takes a Delivery this plane returned, and it has delivered none yet")
        treedef, expected = self._delivery_layout
        leaves, got_treedef = jax.tree_util.tree_flatten(recycle)
        if got_treedef != treedef:
            raise SpecError(f"{where}: recycle must have the structure of this plane's batches, {treedef}; got "
                            f"{got_treedef}")
        for index, (leaf, (shape, dtype, sharding)) in enumerate(zip(leaves, expected)):
            if isinstance(leaf, jax.Array) and not leaf.is_deleted() and leaf.shape == shape \
                    and leaf.dtype == dtype and leaf.sharding == sharding:
                continue
            path = jax.tree_util.tree_flatten_with_path(recycle)[0][index][0]
            name = "recycle" + jax.tree_util.keystr(path)
            if not isinstance(leaf, jax.Array):
                raise SpecError(f"{where}: {name} must be a jax.Array, got {type(leaf).__name__}")
            if leaf.is_deleted():
                raise SpecError(f"{where}: {name} was deleted (already recycled or donated to a jit)")
            if leaf.shape != shape or leaf.dtype != dtype:
                raise SpecError(f"{where}: {name} must be {dtype}{list(shape)} as in this plane's batches; got "
                                f"{leaf.dtype}{list(leaf.shape)}")
            raise SpecError(f"{where}: {name} must be placed as this plane's batches, {sharding}; got {leaf.sharding}")


ROLLOUT_SMALL_ELEMENTS = 4096  # a rollout state's group tables and counters up to this size cross a kernel bundled


class RolloutEngine:
    """Compiled kernels over a rollout buffer's state (``conduit_jax.rollouts``), and the groups staged on the host
    that the next kernel writes first.

    A host program plans each batch on the host (``rollouts.HostQueue``, which also counts staged groups) and calls
    ``deliver(plan, version)``: one kernel writes the staged groups, sets the policy version and lays the batch out,
    in one dispatch. ``flush`` writes staged groups alone. There is one kernel per number of groups staged at once
    (the staged groups padded to a power of two: a few variants however a producer's ingests fall between draws).

    Each array a kernel takes or returns costs its XLA:CPU dispatch a few microseconds (a 30-in, 30-out kernel that
    computes nothing took 82 us here), so the state crosses as its token rings and live flags plus one vector of its
    group tables and counters (``LeafBundle``: 4 arrays, not 17), and the host's arguments as one array of the staged
    groups' per-sequence values and one of the plan and policy version beside the token leaves.
    Not thread-safe: the caller serialises calls."""

    def __init__(self, buffer: "rollouts.RolloutBuffer", state=None):
        self.buffer = buffer
        self.state_types = StateTypes.of_init(buffer.init)  # what a state of this buffer looks like
        self.bundle = LeafBundle(jax.eval_shape(buffer.init), buffer.shardings, ROLLOUT_SMALL_ELEMENTS)
        self.state = buffer.init() if state is None else state
        self.staged: list = []  # rollouts.Groups of host arrays, in call order
        self.compiles: collections.Counter = collections.Counter()  # kernel name -> XLA compilations
        self.dispatches: collections.Counter = collections.Counter()  # kernel name -> calls
        self._kernels: dict[tuple[str, int, Optional[int]], Any] = {}  # (name, staged groups, rows) -> kernel
        self.beside = KernelCache()  # kernels other modules build over this engine's state (rollout_checkpoint.py)

    @property
    def state(self) -> "rollouts.RolloutState":
        """The state as one pytree, joined from the kernels' form once after each kernel."""
        if self._tree is None:
            self._tree = self.bundle.to_tree(*self._form)
        return self._tree

    @state.setter
    def state(self, state: "rollouts.RolloutState") -> None:
        self._form, self._tree = self.bundle.from_tree(state), state  # the large leaves are shared
        self.version = int(state.policy_version)  # the policy version the state holds (flush writes a newer one)

    def staged_groups(self) -> int:
        return sum(groups.lengths.shape[0] for groups in self.staged)

    def _kernel(self, name: str, staged: int, rows: Optional[int]):
        key = (name, staged, rows)
        if key not in self._kernels:
            buffer, bundle = self.buffer, self.bundle
            config = buffer.config

            def step(large, small, tokens, table, scalars):
                state = bundle.join(large, small)
                if staged:
                    state = buffer.ingest(state, _groups_from_table(config.spec, tokens, table))
                version, plan = _plan_from_scalars(config, scalars) if name == "deliver" else (scalars[0], None)
                state = buffer.set_policy_version(state, version)
                state, out = buffer.deliver(state, plan, rows=rows) if name == "deliver" else (state, None)
                return (*bundle.split(state), out)

            self._kernels[key] = jax.jit(step, donate_argnums=(0, 1))
        return self._kernels[key]

    def _dispatch(self, name: str, version: int, plan=None, rows: Optional[int] = None):
        staged, self.staged = self.staged, []
        count = sum(g.lengths.shape[0] for g in staged)
        tokens, table = (), None
        if staged:
            # padded to the next power of two with absent groups (all lengths 0: written nowhere), so however many
            # groups a producer thread staged before a draw, few kernels are compiled
            count = compile_size(count)

            def padded(values):
                out = np.zeros((count, *values[0].shape[1:]), values[0].dtype)
                np.concatenate(values, out=out[:sum(v.shape[0] for v in values)])
                return out

            tokens = tuple(padded([g.leaves[leaf] for g in staged]) for leaf in self.buffer.spec.token_leaves)
            table = padded([_group_table(g) for g in staged])
        scalars = np.int32([version]) if plan is None else _plan_scalars(plan, version)
        kernel_name = f"{'staged+' if count else ''}{name}"
        self.dispatches[kernel_name] += 1
        with CompileScope(self.compiles, kernel_name):
            large, small, out = self._kernel(name, count, rows)(*self._form, tokens, table, scalars)
        self._form, self._tree = (large, small), None
        self.version = version
        return out

    def deliver(self, plan: "rollouts.BatchPlan", version: int,
                rows: Optional[int] = None) -> "rollouts.RolloutBatch":
        """Write the staged groups, then the batch ``plan`` describes (planned after them), in one dispatch; ``rows``:
        lay out only the layout's first ``rows`` rows (at least ``rollouts.rows_needed(plan)``; a kernel per value)."""
        return self._dispatch("deliver", version, plan, rows=rows)

    def flush(self, version: int) -> None:
        """Write the staged groups and the policy version now (nothing when none is staged and the state holds
        ``version`` already)."""
        if self.staged or version != self.version:
            self._dispatch("flush", version)


def _group_table(groups: "rollouts.Groups") -> np.ndarray:
    """int32[k, 3G + 1]: each group's lengths, prompt lengths, rewards (float32 bits) and policy version, the way
    ``rollouts.ingest`` casts them, as one kernel argument (``_groups_from_table`` reads it back)."""
    return np.concatenate([np.asarray(groups.lengths, np.int32), np.asarray(groups.prompt_lengths, np.int32),
                           np.asarray(groups.rewards, np.float32).view(np.int32),
                           np.asarray(groups.policy_version, np.int32)[:, None]], axis=1)


def _groups_from_table(spec: "rollouts.RolloutSpec", tokens: tuple, table) -> "rollouts.Groups":
    size = spec.group_size
    return rollouts.Groups(dict(zip(spec.token_leaves, tokens)), table[:, :size],
                           lax.bitcast_convert_type(table[:, 2 * size:3 * size], jnp.float32),
                           table[:, size:2 * size], table[:, 3 * size])


def _plan_scalars(plan: "rollouts.BatchPlan", version: int) -> np.ndarray:
    """int32[]: the policy version, then every field of ``plan`` flattened in order, as one kernel argument."""
    return np.concatenate([np.int32([version])] + [np.asarray(field, np.int32).reshape(-1) for field in plan])


def _plan_from_scalars(config: "rollouts.RolloutConfig", scalars):
    """``(version, plan)`` from ``_plan_scalars``' vector, in the plan's shapes and dtypes."""
    batch, size = config.groups_per_batch, config.spec.group_size
    shapes = ((batch,), (batch,), (batch, size), (batch, size), (), ())
    fields, at = [], 1
    for shape in shapes:
        count = int(np.prod(shape, dtype=np.int64))
        fields.append(scalars[at:at + count].reshape(shape))
        at += count
    fields[1] = fields[1].astype(bool)  # taken
    return scalars[0], rollouts.BatchPlan(*fields)


# (writes, donates, keeps_status, rows_apart) of the engine's own steps ("", sample, version)
_BUILT_IN_STEP = (False, (), False, False)


def _joiner(bundle: LeafBundle, shardings):
    """Inside a kernel: ``joined(storage_leaves, rest_leaves, small)``, the state from its bundled form with every
    leaf computable (see ``computable``)."""
    def joined(storage_leaves, rest_leaves, small):
        return computable(bundle.join(tuple(storage_leaves) + tuple(rest_leaves), small), shardings)

    return joined


def _placed_elsewhere(leaf, target) -> bool:
    sharding = getattr(leaf, "sharding", None)
    return sharding is None or (sharding != target and not sharding.is_equivalent_to(target, leaf.ndim))
