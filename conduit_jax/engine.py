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
* **one padding rule**: ``compile_size`` rounds a row count up to the few sizes kernels are compiled for, for every
  caller (ingest chunks of the plane and the functional API via ``ingest_chunks``, checkpoint increments, Ray shard
  draws, the RLlib adapter's GAE kernel).

The engine decides nothing: it has no waits, limits, schedule or input checks beyond what a kernel needs. Those are
the plane's (``plane.py``).
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import re
import threading
from typing import Any, NamedTuple, Optional

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from conduit_jax import limits, replay, runtime, storage
from conduit_jax._pytree import LeafBundle
from conduit_jax._pytree import replace as _replace
from conduit_jax.errors import ConfigError, SpecError
from conduit_jax.replay import Delivery, ReplayConfig, ReplayState


# ------------------------------------------------------------------------------------------------------------------
# placement inside a kernel, and the padding rule
# ------------------------------------------------------------------------------------------------------------------
def computable(state, shardings):
    """Inside a kernel: leaves placed in ``pinned_host`` memory moved to ``device`` memory (XLA computes on host memory
    only inside a host computation), except the ring: ``storage`` reads and writes ``state.storage.rows`` where it
    lives (``storage.where_rows_live``), so a ring in host memory never crosses, only batches do. What moves is the
    rest: counters, and the sampler's index where a plan puts it on the host (the planner prices that move and keeps
    the index in device memory where it fits). Leaves in ``device`` or ``unpinned_host`` memory are used where they
    are."""
    def move(leaf, sharding):
        if getattr(sharding, "memory_kind", None) != "pinned_host":
            return leaf
        return jax.device_put(leaf, sharding.with_memory_kind("device"))

    return _except_rows(move, state, shardings)


def placed(state, shardings):
    """Inside a kernel: the leaves that ``computable`` moved put back in their memory kind, so a state returned from
    a jitted step (or carried by ``lax.scan``) keeps its placement. (Inside a jit, JAX 0.10 does not place a result
    in ``unpinned_host`` memory: only a jit's ``out_shardings`` does, as the engine's kernels and the functional
    API's documentation have it.)"""
    def back(leaf, sharding):
        if getattr(sharding, "memory_kind", None) != "pinned_host":
            return leaf
        return jax.device_put(leaf, sharding)

    return _except_rows(back, state, shardings)


def _except_rows(fn, state, shardings):
    """``fn(leaf, sharding)`` over every leaf of ``state`` but the ring's rows, which stay as they are. Called outside
    a jit (a functional-API call run eagerly) the rows go through ``fn`` too: an eager ``shard_map`` cannot move
    arrays between memory kinds, so there a host ring is read through a device copy (jit the call to avoid it)."""
    if not isinstance(state.storage.rows, jax.core.Tracer):
        return jax.tree_util.tree_map(fn, state, shardings)

    def without_rows(tree):
        return dataclasses.replace(tree, storage=dataclasses.replace(tree.storage, rows=None))

    moved = jax.tree_util.tree_map(fn, without_rows(state), without_rows(shardings))
    return dataclasses.replace(moved, storage=dataclasses.replace(moved.storage, rows=state.storage.rows))


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


def compile_size(n: int, *, steps_per_octave: int = 1, multiple: int = 1, limit: Optional[int] = None) -> int:
    """The size a kernel is compiled for to take ``n`` rows: the one padding rule of every caller.

    ``n`` rounded up to one of ``steps_per_octave`` evenly spaced sizes in its octave (1: the next power of two; 8:
    at most 1/8 padding), then to a multiple of ``multiple``, at most ``limit``. Few distinct sizes keep a varying
    ``n`` from compiling a kernel per call. Writes pad with rows that are dropped and cost nothing (coarse steps);
    work that costs per row (draws, checkpoint increments) takes finer ones."""
    n = max(int(n), 1)
    quantum = max(1, (1 << (n - 1).bit_length()) // (2 * steps_per_octave))
    size = max(-(-n // quantum) * quantum, multiple)
    size += (-size) % multiple
    return size if limit is None else min(size, limit)


def padded_rows(n: int, num_shards: int, shard_capacity: int) -> int:
    """Rows of the kernel that writes an ``n``-item chunk: ``num_shards`` times a power of two, at most a ring."""
    return num_shards * compile_size(-(-n // num_shards), limit=shard_capacity)


def ingest_chunks(n: int, config: ReplayConfig) -> list[tuple[int, int, int]]:
    """``(start, count, rows)`` for each kernel call that writes an ``n``-item batch: one call writes at most a full
    ring per shard, and its batch is padded to ``rows = padded_rows(count)``."""
    return [(start, min(config.capacity, n - start),
             padded_rows(min(config.capacity, n - start), config.num_shards, config.shard_capacity))
            for start in range(0, n, config.capacity)]


# ------------------------------------------------------------------------------------------------------------------
# compile counting
# ------------------------------------------------------------------------------------------------------------------
_compile_scope = threading.local()  # the kernel whose call is running on this thread, if any


def _count_compile(event: str, duration: float, **kwargs) -> None:
    counter = getattr(_compile_scope, "counter", None)
    if event == "/jax/core/compile/backend_compile_duration" and counter is not None:
        counter[_compile_scope.kernel] += 1


jax.monitoring.register_event_duration_secs_listener(_count_compile)


class CompileScope:
    """While a kernel is called, attribute the XLA compilations JAX reports on this thread to ``kernel`` in
    ``counter`` (a ``collections.Counter``)."""

    def __init__(self, counter: collections.Counter, kernel: str):
        self.counter, self.kernel = counter, kernel

    def __enter__(self):
        self.saved = getattr(_compile_scope, "counter", None), getattr(_compile_scope, "kernel", None)
        _compile_scope.counter, _compile_scope.kernel = self.counter, self.kernel
        self.counter.setdefault(self.kernel, 0)

    def __exit__(self, *exc):
        _compile_scope.counter, _compile_scope.kernel = self.saved
        return False


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
class StateTypes(NamedTuple):
    """What a state of one configuration looks like: its structure and each leaf's (shape, dtype)."""

    leaves: list
    treedef: Any

    @classmethod
    def of(cls, config: ReplayConfig) -> "StateTypes":
        abstract_leaves, treedef = jax.tree_util.tree_flatten(jax.eval_shape(functools.partial(replay.init, config, 0)))
        return cls([(leaf.shape, leaf.dtype) for leaf in abstract_leaves], treedef)

    def check(self, tree, where: str = "state") -> list:
        """The leaves of ``tree``; ConfigError unless it is a state of this configuration (structure, shapes and
        dtypes; works on tracers too). Cheap when it is (a fused loop passes the state on every step)."""
        if not isinstance(tree, ReplayState):
            raise ConfigError(f"{where}: state must be a ReplayState (from buffer.init() or plane.state), got "
                              f"{type(tree).__name__}")
        leaves, treedef = jax.tree_util.tree_flatten(tree)
        if treedef != self.treedef:
            raise ConfigError(f"{where}: expected a ReplayState of this buffer's configuration, {self.treedef}; got "
                              f"{treedef} (a state of another sampler or spec?)")
        for index, (leaf, (shape, dtype)) in enumerate(zip(leaves, self.leaves)):
            if getattr(leaf, "shape", None) != shape or getattr(leaf, "dtype", None) != dtype:
                path = jax.tree_util.keystr(jax.tree_util.tree_flatten_with_path(tree)[0][index][0])
                raise ConfigError(f"{where}: leaf {path} must be {dtype}{list(shape)}, got "
                                  f"{getattr(leaf, 'dtype', None)}{list(np.shape(leaf))} (a state of another "
                                  f"capacity, spec, sampler or mesh?)")
        return leaves


# ------------------------------------------------------------------------------------------------------------------
# the engine
# ------------------------------------------------------------------------------------------------------------------
class Engine:
    """Compiled kernels over one buffer's state, and that state in the kernels' form.

    Not thread-safe: the caller serialises calls (the plane holds its lock around each). ``state`` may be None
    (freed, e.g. before a restore reads the saved one); ``seed`` builds a fresh empty state.
    """

    def __init__(self, config: ReplayConfig, shardings, seed: Optional[int] = 0):
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
        # then long computed (a status kernel of its own cost ~100 us on every sample)
        self.reports_deliverable = sampler.deliverable is not None and not sampler.consumes
        # XLA:CPU runs the collectives of an emulated multi-device mesh in-process; with many multi-device programs
        # queued on few cores one device's part can miss the rendezvous and XLA aborts the process (seen here after
        # ~300 back-to-back priority updates on 8 emulated devices). There, each kernel completes before the next.
        self._one_at_a_time = config.num_shards > 1 and config.mesh.devices.flat[0].platform == "cpu"
        self.compiles: collections.Counter = collections.Counter()  # kernel name -> XLA compilations
        self._build_kernels()
        # the state, in one or both of two forms that agree: the pytree (``_tree``) and the kernels' form (``_form``:
        # storage's large leaves, the rest's large leaves, the small leaves' vector). Kernels produce the form;
        # reading ``state`` joins it once.
        self._tree: Optional[ReplayState] = None
        self._form = None
        if seed is not None:
            self._keep(*jax.jit(lambda: bundle.split(replay.init(config, seed)),
                                out_shardings=(bundle.large_shardings, bundle.small_sharding))())
        # (host array, an output of the ingest that read it): reused for the next batch once that ingest is done
        self._last_staging: Optional[tuple[np.ndarray, jax.Array]] = None
        self._delivery_layout = None  # (treedef, [(shape, dtype, sharding)]) of the batches sample kernels deliver
        # the host's copy of the status scalars a host policy decides on (size, deliverable, limiter balance), kept
        # by arithmetic on each kernel call: read from the device only when unknown (see ``known``)
        self._mirror: Optional[dict[str, Any]] = None

    def _build_kernels(self) -> None:
        config = self.config
        self._ingest_kernels: dict[tuple[int, bool], Any] = {}  # (rows, host-packed) -> kernel
        # + the deliverable count, for samplers that keep it in an index; a draw changes it only where it retires
        # items, so the sample kernels report it only then
        reports = self.reports_deliverable
        sample_reports = reports and config.sampler.sampling_retires

        def update_sample(state, updates):
            return replay.sample(config, _replace(state, sampler=replay.update(config, state,
                                                                              *unpack_updates(updates))))

        sample_step = self._reporting(functools.partial(replay.sample, config), sample_reports)
        update_sample_step = self._reporting(update_sample, sample_reports)
        deliver = functools.partial(self.reading_kernel, delivery=True)
        # with a finished Delivery donated (recycles): XLA writes the new batch into its buffers (sample(recycle=))
        self._sample_kernels = {(pending, recycles): deliver(step, num_outputs=1 + sample_reports, recycles=recycles)
                                for pending, step in ((False, sample_step), (True, update_sample_step))
                                for recycles in (False, True)}
        self._version_kernel = self.reading_kernel(self._reporting(lambda state, version: (
            replay.set_policy_version(config, state, version),), reports), num_outputs=int(reports))
        self._update_kernel = self.reading_kernel(lambda state, updates: (
            _replace(state, sampler=replay.update(config, state, *unpack_updates(updates))),), num_outputs=0)
        self._status_kernel = jax.jit(lambda *form: replay.status(config, self._joined(*form)))

    def _reporting(self, step, reports: bool):
        """``step(state, *args) -> (state', *outputs)``, with the deliverable count after it as one more output when
        ``reports``."""
        if not reports:
            return step
        config = self.config

        def reporting_step(state, *args):
            new_state, *outputs = step(state, *args)
            return (new_state, *outputs, replay.deliverable(config, new_state))

        return reporting_step

    def _joined(self, storage_leaves, rest_leaves, small):
        """Inside a kernel: the state from its bundled form, every leaf computable (see ``computable``)."""
        return computable(self.bundle.join(tuple(storage_leaves) + tuple(rest_leaves), small), self.shardings)

    def reading_kernel(self, step, num_outputs: int, recycles: bool = False, delivery: bool = False):
        """Jit ``step(state, *args) -> (state', *outputs)`` for a step that only reads storage, over the state's
        bundled form: storage's large leaves (the ring) go in undonated and do not come out, the rest is donated and
        keeps its placement. Call it with ``run``.

        ``recycles``: the kernel takes one more donated argument after the state, a finished output of the same
        shapes, which it never reads: XLA writes the outputs into its buffers (``keep_unused``, or jit would drop it).
        ``delivery``: compiled with the delivery kernels' XLA options (``runtime.delivery_compiler_options``)."""
        storage_large = self._storage_large
        joined, split = self._joined, self.bundle.split

        def kernel(storage_leaves, rest_leaves, small, *args):
            new_state, *outputs = step(joined(storage_leaves, rest_leaves, small), *args[1:] if recycles else args)
            large, small = split(new_state)
            return (large[storage_large:], small, *outputs)

        options = runtime.delivery_compiler_options(self.config.mesh.devices.flat) if delivery else None
        return jax.jit(kernel, donate_argnums=(1, 2, 3) if recycles else (1, 2), keep_unused=recycles,
                       out_shardings=(self.bundle.large_shardings[storage_large:], self.bundle.small_sharding)
                       + (None,) * num_outputs, compiler_options=options)

    # -- the state --------------------------------------------------------------------------------------------------
    @property
    def state(self) -> Optional[ReplayState]:
        """The whole state as one pytree, assembled from the kernels' form once after each kernel call."""
        if self._tree is None and self._form is not None:
            storage_large, rest_large, small = self._form
            self._tree = self.bundle.to_tree(storage_large + rest_large, small)
        return self._tree

    @state.setter
    def state(self, tree: Optional[ReplayState]) -> None:
        """A state from outside, split into the kernels' form now (its large leaves are shared, so the pytree stays
        valid too); a leaf placed elsewhere than ``shardings`` says is moved there first. None frees the state."""
        leaves = None if tree is None else self.check_state(tree)  # a refused state leaves this one as it was
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
        """Wait until every kernel dispatched on the state so far has finished."""
        jax.block_until_ready(self._form)

    def _keep(self, large, small) -> None:
        self._form = (tuple(large[:self._storage_large]), tuple(large[self._storage_large:]), small)
        self._tree = None

    def _settled(self, outputs):
        """``outputs`` of a kernel call, waited for on an emulated CPU mesh (see ``_one_at_a_time``)."""
        return jax.block_until_ready(outputs) if self._one_at_a_time else outputs

    def counting(self, kernel: str) -> CompileScope:
        return CompileScope(self.compiles, kernel)

    def compile_counts(self) -> dict[str, int]:
        """XLA compilations per kernel so far (counted from JAX's compile events); steady state adds none."""
        return dict(sorted(self.compiles.items()))

    def kernel_cache_sizes(self) -> dict[str, int]:
        """Compiled variants held by each kernel's jit cache (a steady loop keeps them at 1)."""
        out = {f"ingest[{rows}{',packed' if packed else ''}]": kernel._cache_size()
               for (rows, packed), kernel in self._ingest_kernels.items()}
        out.update({f"sample[{'update,' if p else ''}{'recycle' if r else ''}]": k._cache_size()
                    for (p, r), k in self._sample_kernels.items()})
        out.update(update=self._update_kernel._cache_size(), version=self._version_kernel._cache_size())
        return out

    def lowered(self, kernel: str, *args, platform: Optional[str] = None):
        """``jax.stages.Lowered`` of a kernel over the current state (``sample``, ``update``, ``update+sample``,
        ``version``, ``ingest`` with ``(rows, packed_rows_or_batch, n)``), to read its HLO. ``platform`` (e.g.
        ``"cuda"``): lowered for that backend instead of this one, to read what a GPU would be asked to move."""
        if kernel == "ingest":
            rows, block, n = args
            jitted, args = self._ingest_kernel(rows, True), (block, n)
        else:
            jitted = {"sample": self._sample_kernels[False, False], "update": self._update_kernel,
                      "update+sample": self._sample_kernels[True, False], "version": self._version_kernel}[kernel]
        return jitted.trace(*self._live_form, *args).lower(lowering_platforms=None if platform is None else (platform,))

    def run(self, name: str, kernel, *args) -> list:
        """Call a kernel built by ``reading_kernel`` on the state (its compilations counted under ``name``), keep
        the state it returns, return its outputs. The host's status copy is read from the device again next time
        (the engine cannot tell what the kernel changed)."""
        self._mirror = None
        return self._call(name, kernel, *args)

    def _call(self, name: str, kernel, *args) -> list:
        storage_large, rest_large, small = self._live_form
        with self.counting(name):
            rest_large, small, *outputs = self._settled(kernel(storage_large, rest_large, small, *args))
        self._keep(storage_large + tuple(rest_large), small)
        return outputs

    # -- kernels ----------------------------------------------------------------------------------------------------
    def ingest(self, batch, n: int) -> None:
        """Write the ``n`` items of ``batch`` (a checked pytree with a leading item axis): device arrays of exactly a
        bucket's size go in as they are and are packed on the device; everything else is packed on the host into one
        array (one transfer instead of one per leaf, the caller's buffers never aliased, and no op on the unpadded
        shape, which would compile once per batch size)."""
        leaves = jax.tree_util.tree_leaves(batch)
        layout = self.config.layout
        reported: list = []
        on_mesh = all(isinstance(leaf, jax.Array) and leaf.sharding.device_set == self._devices for leaf in leaves)
        for start, count, rows in ingest_chunks(n, self.config):
            if start == 0 and count == rows and on_mesh:  # (arrays on other devices are packed on the host)
                block, packed = batch, False
            else:
                block, packed = layout.pack_host(leaves, start, count, rows, self._staging(rows)), True
            with self.counting(f"ingest[{rows}{',packed' if packed else ''}]"):
                large, small, finished, *reported = self._settled(self._ingest_kernel(rows, packed)(
                    *self._live_form, layout.to_ring(block) if packed else block, np.int32(count)))
            self._keep(large, small)
            if packed:
                self._last_staging = (block, finished)
        mirror = self._mirror
        if mirror is not None:
            sampler = self.config.sampler
            mirror["size"] = min(mirror["size"] + n, self.config.capacity)
            mirror["limiter_balance"] = int(self.config.limiter.on_insert(
                limits.LimiterState(mirror["limiter_balance"]), n).balance)
            if sampler.deliverable is None:
                mirror["deliverable"] = mirror["size"]
            elif sampler.consumes:
                mirror["deliverable"] += n
            else:
                mirror["deliverable"] = reported[0]  # a device scalar, read only if a check needs it

    @property
    def staging(self) -> Optional[np.ndarray]:
        """The host array the last host-packed batch went into (reused for the next once its ingest finished)."""
        return None if self._last_staging is None else self._last_staging[0]

    def _staging(self, rows: int) -> np.ndarray:
        """The host array a batch is packed into: the last one again when its shape fits and the ingest that read it
        has finished (JAX reads it in place), else a fresh one. Fresh pages fault on first write, which made packing
        a 4.5 MB PPO rollout take 2x as long."""
        if self._last_staging is not None:
            block, finished = self._last_staging
            if block.shape[0] == rows and finished.is_ready():
                return block
        return storage.aligned_empty((rows, self.config.layout.row_words))

    def _ingest_kernel(self, rows: int, packed: bool):
        """The compiled ingest for one bucket of batch rows, for host-packed rows or a pytree of device arrays."""
        kernel = self._ingest_kernels.get((rows, packed))
        if kernel is None:
            config, bundle = self.config, self.bundle

            def ingest_step(state, batch, n):
                new_state = replay.ingest(config, state, batch, n, packed=packed)
                # a scalar of its own that is ready once this ingest has finished, even after the state has been
                # donated to another jit: the staging array this ingest read is packed again only then
                return new_state, jnp.sum(new_state.storage.cursor)

            step = self._reporting(ingest_step, self.reports_deliverable)

            def ingest_kernel(storage_large, rest_large, small, batch, n):
                new_state, *outputs = step(self._joined(storage_large, rest_large, small), batch, n)
                return (*bundle.split(new_state), *outputs)

            kernel = jax.jit(ingest_kernel, donate_argnums=(0, 1, 2),
                             out_shardings=(bundle.large_shardings, bundle.small_sharding, None)
                             + (None,) * int(self.reports_deliverable))
            self._ingest_kernels[(rows, packed)] = kernel
        return kernel

    def sample(self, updates: Optional[np.ndarray] = None, recycle: Optional[Delivery] = None) -> Delivery:
        """One batch, after applying ``updates`` (``pack_updates``' array) in the same kernel; ``recycle``: a checked
        finished Delivery whose buffers receive the batch."""
        kernel = self._sample_kernels[updates is not None, recycle is not None]
        if updates is None:
            name = "sample" if recycle is None else "sample[recycle]"
        else:
            name = f"update+sample[{updates.shape[0]}{'' if recycle is None else ',recycle'}]"
        args = (() if recycle is None else (recycle,)) + (() if updates is None else (updates,))
        delivery, *reported = self._call(name, kernel, *args)
        if self._delivery_layout is None:
            leaves, treedef = jax.tree_util.tree_flatten(delivery)
            self._delivery_layout = treedef, [(leaf.shape, leaf.dtype, leaf.sharding) for leaf in leaves]
        mirror, batch_size = self._mirror, self.config.sampler.batch_size
        if mirror is not None:
            mirror["limiter_balance"] = int(self.config.limiter.on_sample(
                limits.LimiterState(mirror["limiter_balance"]), batch_size).balance)
            if self.config.sampler.consumes:
                mirror["deliverable"] -= batch_size
            elif reported:
                mirror["deliverable"] = reported[0]
        return delivery

    def update(self, updates: np.ndarray) -> None:
        """Apply ``pack_updates``' array in a kernel of its own."""
        self._call("update", self._update_kernel, updates)

    def set_policy_version(self, version: int) -> None:
        reported = self._call("version", self._version_kernel, np.int32(version))
        if self._mirror is not None and reported:
            self._mirror["deliverable"] = reported[0]  # retired items can empty an eligibility index

    def knows(self, need_deliverable: bool = False) -> bool:
        """Whether ``known`` answers from the host's copy (else it reads the status from the device)."""
        return self._mirror is not None and not (need_deliverable and self._mirror["deliverable"] is None)

    def known(self, need_deliverable: bool = False) -> dict[str, Any]:
        """The status scalars a host policy decides on (``size``, ``deliverable``, ``limiter_balance``) from the
        host's copy, read from the device only when unknown. A sampler whose deliverable count is an index has it
        reported by the last kernel that changed it, as a device scalar read here only when ``need_deliverable``."""
        if not self.knows(need_deliverable):
            status = self.status()
            self._mirror = {key: status[key] for key in ("size", "deliverable", "limiter_balance")}
        if need_deliverable and isinstance(self._mirror["deliverable"], jax.Array):
            self._mirror["deliverable"] = int(self._mirror["deliverable"])
        return self._mirror

    def status(self) -> dict[str, int]:
        """The status scalars (``replay.status``) read from the device: waits for every kernel in flight."""
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
               "sampler": sampler.name, "limiter": config.limiter.name, "compiled": self.compile_counts()}
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


def _placed_elsewhere(leaf, target) -> bool:
    sharding = getattr(leaf, "sharding", None)
    return sharding is None or (sharding != target and not sharding.is_equivalent_to(target, leaf.ndim))
