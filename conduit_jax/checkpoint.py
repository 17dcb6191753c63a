"""Checkpoints of a whole ``ExperienceDataPlane``: every leaf of its state plus JSON metadata, written by orbax.

What a checkpoint holds. Step ``k`` of a checkpoint directory is an orbax step folder ``<directory>/<k>/`` with two
items: ``arrays`` (every leaf of ``plane.state``, by name, written by orbax/tensorstore) and ``meta`` (JSON): the format
version, the spec (leaf names, shapes, dtype names such as ``bfloat16``, and the tree as nested dicts / lists / tuples
so it can be rebuilt), capacity, shard count and per-shard write counts, sampler and limiter (name + constructor
parameters), staleness, ``cast``, the delivery schedule, for every stored array its shape, dtype and CRC-32, and
the CRC-32 of the metadata itself (``metadata_checksum``). Nothing is pickled: loading a checkpoint cannot run code.
Restore refuses (``CheckpointError``, a ``ValueError``) a missing, unfinished, partial or corrupted checkpoint (an
array that does not read back or whose CRC differs; metadata edited after the save, e.g. a leaf's dtype or name), a
format version it cannot read, and anything that does not match what the caller passes explicitly (``spec``,
``capacity``, ``sampler``, ``limiter``); the message says what differs.

Saving is asynchronous. The plane donates its state buffers on every ingest, so a background writer must never hold
the live arrays: ``save`` takes the plane's lock only to copy the state, and a background thread writes the copy
(CRC-32 of each array, then a synchronous orbax save inside that thread) while ingest and sample keep running. On CPU
devices the copy is a memcpy of every shard into host buffers allocated and page-faulted before the lock is taken
(``benchmarks/results/checkpoint.jsonl`` records how long the lock is held); on accelerators it is one jitted on-device copy, dispatched asynchronously. ``SaveHandle``
reports ``blocked_s`` (how long the lock was held) and ``total_s``. Saves to one directory run one after another in
call order. The copy doubles the state's memory until it is written. Arrays are written uncompressed in chunks of at
most 32 MiB (``compress=True``: zstd, which costs much more write time than it saves bytes on float rows);
tensorstore fsyncs every file.

Atomicity. Orbax writes a step into ``<k>.orbax-checkpoint-tmp-<timestamp>/`` and renames it to ``<k>/`` once
complete; a process killed mid-save leaves only the tmp folder, which restore never reads (and the next save to that
directory removes). Retention: after each save only the newest ``max_to_keep`` steps are kept, plus the steps an
incremental step depends on.

Incremental saves (``save(..., incremental=True)``). When this plane object's previous save went to the same
directory (or it was restored from it), the step stores only the ring rows written since that step: for each shard s
the ``count[s]`` rows from slot ``start[s]`` on (cyclically), as one array of ring rows (``[shards * D, ...]``, D:
the largest count rounded up to 4-7 times a power of two; rows past ``count[s]`` are zero), plus every other state
leaf in full (cursors, laps, counters, limiter and sampler state, including a priority sampler's sum trees and
``times_sampled``). Restore replays the chain: the full base step, then each increment's rows in order, then the last
step's other leaves. Otherwise (first save of this plane object here, or some shard wrapped all the way round since)
an incremental save writes a full step; ``SaveHandle.kind`` says which. Retention never deletes a step a kept
increment depends on, so a chain lives until the next full save is among the newest ``max_to_keep``.

Restoring onto another mesh or plan. With the same shard count (another device set, another mesh shape such as 2x4
instead of 8, other memory kinds from a ``placement.Plan``) orbax reads every array directly into the new plane's
shardings, bit for bit. With another shard count (8 -> 4 -> 1 devices) the per-shard layout differs (item g lives at
shard ``g % S``, slot ``(g // S) % (capacity / S)``), so restore re-lays the state out on the host: it recomputes each
stored item's shard and slot (the stored items are always the last ``min(inserted, capacity)`` ones), moves the
item-attached sampler state with its item (sum-tree leaves, ``times_sampled``) and rebuilds every sum-tree level above
the leaves as float32 sums of their children, recomputes cursors, laps, the round-robin shard and a FIFO queue's read
head; scalar state (random stream counters, limiter balance, policy version, counters) carries over. The result equals a
plane built on the new mesh that ingested the same items (ring rows, cursors, laps, priorities and remaining
deliveries); item ids delivered before such a restore name other rows afterwards, so apply pending priority updates
before saving. The random streams continue, but draws map to different rows under another shard count, so deliveries
after the restore are not the ones the original would have made. Same-count restores continue the original delivery
stream exactly.

Other checkpoints. ``rollout_checkpoint`` saves a ``RolloutPlane`` with the public pieces of this module:
``write_step`` (numbering, CRC-32s, signed metadata, atomic write, retention), ``choose_step``,
``read_step_metadata``, ``read_arrays``, ``named_leaves`` / ``unflatten_like``, ``schedule_json`` /
``schedule_from_json`` and ``checked_directory``.

Not in a checkpoint: what the shell keeps on the host outside ``plane.state``, i.e. batches a prefetching schedule
has already drawn (``deliver()`` with overlap / deferred / adaptive) and deferred priority updates; ``save`` warns
(``ConduitWarning``) when there are any. Single process only (multi-host meshes are not supported yet), and one
writing process per directory.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import json
import os
import threading
import time
import uuid
import warnings
import weakref
import zlib
from typing import Any, Optional

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import Mesh, NamedSharding, SingleDeviceSharding
from jax.sharding import PartitionSpec as P

from conduit_jax import engine, functional, limits, replay, samplers, storage
from conduit_jax.errors import ConduitError, ConduitWarning, ConfigError
from conduit_jax.spec import ExperienceSpec, leaf_name

FORMAT = "conduit-jax-plane"
FORMAT_VERSION = 4
# Version 1 stored the ring of a sampler with several streams per shard time-major (a slot was its row); version 2
# stores it stream-major (storage.ring_row). Versions 1 and 2 stored every ring as uint32 words; version 3 stores the
# ring of a layout made mostly of 1-byte leaves as uint8 (storage.RowLayout.ring_dtype): the same bytes. Version 4
# adds the metadata's own checksum (metadata_checksum). Nothing else differs, so older steps are read and converted.
READABLE_VERSIONS = (1, 2, 3, 4)
_ARRAYS, _META = "arrays", "meta"
_ROWS = "storage.rows"
_DELTA = "delta.rows"
_REBUILT = "sampler.smallest."  # state leaves a restore rebuilds from the others when a checkpoint lacks them
_CHUNK_BYTES = 32 << 20
# How a full save copies the state under the plane's lock: None picks by platform (CPU devices: memcpy into host
# buffers; accelerators: one jitted on-device copy, dispatched asynchronously, written back in the
# background). Tests set it to exercise the accelerator path on CPU.
_SNAPSHOT_ON_HOST: Optional[bool] = None


class CheckpointError(ConduitError):
    """A checkpoint is missing, unfinished, corrupted, or does not match what the caller asked for."""


# ------------------------------------------------------------------------------------------------------------------
# Save handle
# ------------------------------------------------------------------------------------------------------------------
@dataclasses.dataclass
class SaveHandle:
    """A save in progress. ``wait()`` blocks until it is on disk (and re-raises a failure as ``CheckpointError``).

    ``blocked_s``: seconds the plane's lock was held (ingest and sample were excluded); ``snapshot_s``: seconds until
    the copy of the state was complete (later kernels of the plane queue behind it on the device); ``total_s``: from
    the ``save`` call until the step was final on disk (None until then); ``bytes``: array bytes written (before
    compression); ``phases``: seconds of the background thread's digest (to host + CRC-32), write and retention.
    """

    directory: str
    step: int
    kind: str  # "full" or "incremental"
    base_step: Optional[int]
    blocked_s: float
    snapshot_s: Optional[float] = None
    total_s: Optional[float] = None
    bytes: int = 0
    phases: dict = dataclasses.field(default_factory=dict)  # seconds per phase of the background write
    error: Optional[BaseException] = None
    _done: threading.Event = dataclasses.field(default_factory=threading.Event, repr=False)

    def done(self) -> bool:
        return self._done.is_set()

    def wait(self, timeout: Optional[float] = None) -> "SaveHandle":
        if not self._done.wait(timeout):
            raise TimeoutError(f"checkpoint step {self.step} in {self.directory} not written after {timeout} s")
        if self.error is not None:
            if isinstance(self.error, CheckpointError):
                raise self.error
            raise CheckpointError(f"saving step {self.step} to {self.directory} failed: "
                                  f"{type(self.error).__name__}: {self.error}") from self.error
        return self


# per directory: the handle of the last save started (saves to one directory run in call order) and the steps
# assigned but maybe not yet on disk
_dir_lock = threading.Lock()
_last_handle: dict[str, SaveHandle] = {}
_assigned: dict[str, int] = {}


@dataclasses.dataclass(frozen=True)
class _Lineage:
    """What a plane object last saved to (or restored from) a directory: the base of its next incremental save."""

    step: int
    lineage: str
    counts: tuple[int, ...]  # items ever written per shard at that step


_lineages: "weakref.WeakKeyDictionary[Any, dict[str, _Lineage]]" = weakref.WeakKeyDictionary()


# ------------------------------------------------------------------------------------------------------------------
# save
# ------------------------------------------------------------------------------------------------------------------
def save(plane, directory, *, step: Optional[int] = None, max_to_keep: Optional[int] = 3, block: bool = False,
         incremental: bool = False, compress: bool = False) -> SaveHandle:
    """Save the whole plane as step ``step`` (default: one past the newest step) of ``directory``; returns at once
    with a ``SaveHandle`` (``block=True``: after the step is on disk). See the module docstring."""
    directory = checked_directory(directory, "save()")
    _check_save_options(step, max_to_keep, "save()")
    start_time = time.perf_counter()
    kernels = _plane_kernels(plane)
    shard_cap = plane.config.shard_capacity
    on_host = all(d.platform == "cpu" for d in plane.mesh.devices.flat) if _SNAPSHOT_ON_HOST is None \
        else _SNAPSHOT_ON_HOST
    plan = None
    if incremental and _lineages.get(plane, {}).get(directory) is not None:
        # compile the increment kernel outside the plane's lock for the size an increment has now (and twice it)
        with plane.held():
            counts = _counts(plane)
        plan = _delta_plan(_lineages[plane][directory], counts, shard_cap)
        if plan is not None:
            for rows_per_shard in {plan["rows_per_shard"], _increment_rows(2 * plan["rows_per_shard"], shard_cap)}:
                kernels["delta_compiled"](rows_per_shard)
    # a full copy on CPU devices is a memcpy into host buffers allocated and touched here, outside the lock
    buffers = _host_buffers(plane) if on_host and plan is None else None
    if not on_host and plan is None:
        kernels["copy_compiled"]()
    with _dir_lock:
        step = _assign_step(directory, step, "save()")
        previous = _last_handle.get(directory)
        base = _lineages.get(plane, {}).get(directory) if incremental else None

        with plane.held():
            locked = time.perf_counter()
            outside = plane.host_side()
            # prefetched batches of a sampler that does not consume items are only draws: nothing is lost with them
            host_side = (outside["in_flight"] if plane.sampler.consumes else 0, outside["deferred_updates"])
            counts = _counts(plane)
            delta = None if base is None else _delta_plan(base, counts, shard_cap)
            if delta is not None:  # a kernel compiled above for a size at least this one, if there is one
                delta["rows_per_shard"] = min([d for d in kernels["compiled"] if d >= delta["rows_per_shard"]],
                                              default=delta["rows_per_shard"])
            if delta is None and buffers is not None:
                snapshot = _copy_to_host(plane.state, buffers)
            elif delta is None:  # an accelerator, or an increment that turned into a full save under the lock
                snapshot = kernels["copy"](plane.state)
            else:
                snapshot = kernels["delta"](delta["rows_per_shard"])(
                    plane.state, np.asarray(delta["start"], np.int32), np.asarray(delta["count"], np.int32))
            blocked = time.perf_counter() - locked
        del buffers
        if any(host_side):
            warnings.warn(
                f"save(): {host_side[0]} prefetched batches (already drawn from the sampler) and {host_side[1]} "
                f"deferred priority updates live on the host, outside plane.state: the checkpoint does not hold "
                f"them, so a restored plane will not deliver / apply them (for a FIFO the prefetched items are "
                f"lost). Save between deliver() calls of a sync schedule to avoid this", ConduitWarning, stacklevel=2)
        lineage = uuid.uuid4().hex if delta is None else base.lineage
        _lineages.setdefault(plane, {})[directory] = _Lineage(step, lineage, counts)

        handle = SaveHandle(directory=directory, step=step, kind="full" if delta is None else "incremental",
                            base_step=None if delta is None else base.step, blocked_s=blocked)
        _last_handle[directory] = handle
    meta = _metadata(plane, counts, lineage, delta, None if delta is None else base.step)
    thread = threading.Thread(target=_write, name=f"conduit-checkpoint-{step}",
                              args=(handle, plane, snapshot, meta, previous, max_to_keep, compress, start_time))
    thread.start()  # not a daemon: an interpreter exit waits for the write to finish
    if block:
        handle.wait()
    return handle


def write_step(directory, take, *, step: Optional[int] = None, max_to_keep: Optional[int] = 3, block: bool = False,
               where: str = "save()") -> SaveHandle:
    """Write a full step of ``directory`` for a state other than an ``ExperienceDataPlane``'s (``rollout_checkpoint``
    saves a ``RolloutPlane`` with it), by the same rules as ``save``: the step number (default: one past the newest;
    steps only increase, saves to one directory are written in call order), atomicity (orbax's tmp folder, renamed
    once complete), CRC-32s and retention (the newest ``max_to_keep`` steps; None keeps all).

    ``take()`` is called once the step is numbered and returns ``(arrays, meta)``: a pytree of arrays (a copy the
    caller took under its own lock: the writer may read it after ``take`` returns; device copies may still be in
    flight) and a JSON-able metadata dict, whose ``format`` and ``format_version`` ``read_step_metadata`` checks
    later. A background thread then records every array's shape, dtype and CRC-32 under ``meta["arrays"]`` (keyed
    by ``named_leaves``), signs the metadata (``meta_crc32``, see ``metadata_checksum``) and writes the ``arrays``
    and ``meta`` items. Returns the ``SaveHandle`` at once (``block=True``: once the step is on disk); its
    ``blocked_s`` is how long ``take`` ran."""
    directory = checked_directory(directory, where)
    _check_save_options(step, max_to_keep, where)
    start_time = time.perf_counter()
    with _dir_lock:
        step = _assign_step(directory, step, where)
        previous = _last_handle.get(directory)
        began = time.perf_counter()
        snapshot, meta = take()
        handle = SaveHandle(directory=directory, step=step, kind="full", base_step=None,
                            blocked_s=time.perf_counter() - began)
        _last_handle[directory] = handle
    thread = threading.Thread(target=_write, name=f"conduit-checkpoint-{step}",
                              args=(handle, None, snapshot, dict(meta), previous, max_to_keep, False, start_time))
    thread.start()  # not a daemon: an interpreter exit waits for the write to finish
    if block:
        handle.wait()
    return handle


def _check_save_options(step, max_to_keep, where: str) -> None:
    if max_to_keep is not None and (not isinstance(max_to_keep, int) or isinstance(max_to_keep, bool) or
                                    max_to_keep < 1):
        raise ConfigError(f"{where}: max_to_keep must be an int >= 1 or None (keep all), got {max_to_keep!r}")
    if step is not None and (not isinstance(step, (int, np.integer)) or isinstance(step, bool) or step < 0):
        raise ConfigError(f"{where}: step must be an int >= 0 or None, got {step!r}")


def _assign_step(directory: str, step, where: str) -> int:
    """The number of the next save to ``directory`` (call under ``_dir_lock``): ``step``, or one past the newest step
    on disk or assigned to a save still running."""
    on_disk = _steps_on_disk(directory, include_unfinished=False)
    newest = max([*on_disk, _assigned.get(directory, -1)], default=-1)
    if step is None:
        step = newest + 1
    elif step <= newest:
        raise ConfigError(f"{where}: step {step} is not after the newest step {newest} of {directory}; steps only "
                          f"increase (pass step=None for the next one)")
    step = int(step)
    _assigned[directory] = step
    return step


def _counts(plane) -> tuple[int, ...]:
    """Items ever written to each shard (call under the plane's lock)."""
    cursor, laps = jax.device_get((plane.state.storage.cursor, plane.state.storage.laps))
    return tuple(int(lap) * plane.config.shard_capacity + int(c) for c, lap in zip(cursor, laps))


def _delta_plan(base: _Lineage, counts, shard_cap: int) -> Optional[dict]:
    """Which rows an increment on ``base`` holds, or None when it cannot be one (a shard wrapped all the way)."""
    written = [now - then for now, then in zip(counts, base.counts)]
    if len(written) != len(base.counts) or not all(0 <= w < shard_cap for w in written):
        return None
    rows_per_shard = _increment_rows(max(written), shard_cap)
    return {"start": [then % shard_cap for then in base.counts], "count": written, "rows_per_shard": rows_per_shard,
            "from_counts": list(base.counts)}


def _increment_rows(n: int, shard_cap: int) -> int:
    """Rows per shard of the kernel that copies an increment of ``n`` rows: at most 1/4 padding (rows cost a copy)."""
    return replay.compile_size(n, steps_per_octave=4, limit=shard_cap)


def _write(handle: SaveHandle, plane, snapshot, meta, previous, max_to_keep, compress, start_time):
    written = False
    try:
        snapshot = jax.block_until_ready(snapshot)
        handle.snapshot_s = time.perf_counter() - start_time
        if previous is not None:
            previous._done.wait()
        if handle.kind == "incremental" and handle.base_step not in _steps_on_disk(handle.directory):
            raise CheckpointError(f"incremental step {handle.step} of {handle.directory}: its base step "
                                  f"{handle.base_step} was not written (its save failed or it was deleted); take a "
                                  f"full save")
        phase = time.perf_counter()
        arrays = {name: np.asarray(a) for name, a in named_leaves(snapshot).items()}  # device -> host (or as is)
        del snapshot
        meta["arrays"] = {name: {"shape": list(a.shape), "dtype": np.dtype(a.dtype).name, "crc32": _crc32(a)}
                          for name, a in arrays.items()}
        meta = json.loads(json.dumps(meta))  # as it will read back (tuples become lists), then signed
        meta["meta_crc32"] = metadata_checksum(meta)
        handle.bytes = int(sum(a.nbytes for a in arrays.values()))
        import orbax.checkpoint as ocp
        options = ocp.CheckpointManagerOptions(max_to_keep=None, enable_async_checkpointing=False, create=True,
                                               cleanup_tmp_directories=True)
        # chunks of <= 32 MiB let tensorstore write (and compress) in parallel; zstd costs several times the write
        # time for float rows and saves little of their bytes, so it is off unless asked for
        save_args = {name: ocp.SaveArgs(chunk_byte_size=_CHUNK_BYTES) for name in arrays}
        handlers = {_ARRAYS: ocp.PyTreeCheckpointHandler(use_compression=compress),
                    _META: ocp.JsonCheckpointHandler()}
        handle.phases["digest"] = time.perf_counter() - phase
        phase = time.perf_counter()
        with ocp.CheckpointManager(handle.directory, options=options, item_handlers=handlers) as manager:
            saved = manager.save(handle.step, force=True, args=ocp.args.Composite(
                **{_ARRAYS: ocp.args.PyTreeSave(arrays, save_args=save_args), _META: ocp.args.JsonSave(meta)}))
            if not saved:
                raise CheckpointError(f"orbax did not save step {handle.step} to {handle.directory}")
            manager.wait_until_finished()
            del arrays
            handle.phases["write"] = time.perf_counter() - phase
            phase = time.perf_counter()
            written = True
            if max_to_keep is not None:
                try:
                    _retain(manager, handle.directory, max_to_keep)
                except Exception as exc:  # the step itself is safe on disk
                    raise CheckpointError(f"step {handle.step} was written to {handle.directory}, but deleting "
                                          f"older steps failed ({type(exc).__name__}: {exc})") from exc
            handle.phases["retain"] = time.perf_counter() - phase
        handle.total_s = time.perf_counter() - start_time
    except BaseException as exc:  # reported by wait()
        handle.error = exc
        if not written and plane is not None:
            with _dir_lock:  # the next incremental save must not build on a step that is not there
                record = _lineages.get(plane, {})
                if handle.directory in record and record[handle.directory].step == handle.step:
                    del record[handle.directory]
    finally:
        handle._done.set()


def _retain(manager, directory: str, max_to_keep: int) -> None:
    """Delete all but the newest ``max_to_keep`` steps and the steps they depend on (incremental bases)."""
    steps = sorted(manager.all_steps())
    keep = set(steps[-max_to_keep:])
    frontier = list(keep)
    while frontier:
        meta = _read_meta_file(directory, frontier.pop())
        base = meta.get("base_step") if isinstance(meta, dict) else None
        if isinstance(base, int) and base not in keep:
            keep.add(base)
            frontier.append(base)
    for old in steps:
        if old not in keep:
            manager.delete(old)


def _metadata(plane, counts, lineage: str, delta, base_step) -> dict:
    from conduit_jax import __version__
    spec, config = plane.spec, plane.config
    meta = {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "conduit_jax_version": __version__,
        "kind": "full" if delta is None else "incremental",
        "base_step": base_step,
        "lineage": lineage,
        "saved_unix_s": time.time(),
        "spec": _spec_json(spec),
        "capacity": plane.capacity,
        "num_shards": plane.num_shards,
        "row_words": config.layout.row_words,
        "mesh": {"axis_names": [str(a) for a in plane.mesh.axis_names],
                 "shape": [int(plane.mesh.shape[a]) for a in plane.mesh.axis_names]},
        "counts": list(counts),
        "sampler": {"name": plane.sampler.name, "params": _params_json(plane.sampler.params)},
        "limiter": {"name": plane.limiter.name, "params": _params_json(plane.limiter.params)},
        "staleness": None if config.staleness is None else {"max_versions": config.staleness.max_versions,
                                                          "key": config.staleness.key},
        "cast": bool(getattr(plane, "cast", False)),
        "schedule": schedule_json(getattr(plane, "schedule", None)),
        "plan": _plan_json(getattr(plane, "plan", None)),  # informational: placement.Plan.from_dict() rebuilds it
    }
    if delta is not None:
        meta["delta"] = delta
    return meta


# ------------------------------------------------------------------------------------------------------------------
# kernels: snapshot copies, increments, digests
# ------------------------------------------------------------------------------------------------------------------
def _plane_kernels(plane) -> dict:
    """The plane's snapshot kernels, kept by its engine (a ``replan`` builds a new engine, and new kernels with it)."""
    return plane.engine.beside.get("checkpoint", lambda: _snapshot_kernels(plane.engine))


def _snapshot_kernels(plane_engine) -> dict:
    config, shardings = plane_engine.config, plane_engine.shardings
    copy = engine.compiled(lambda state: jax.tree_util.tree_map(jnp.copy, state), "checkpoint_copy",
                           out_shardings=shardings)
    abstract = jax.tree_util.tree_map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
                                      plane_engine.abstract, shardings)
    copy_ready = []

    def copy_compiled():
        """The whole-state copy, compiled outside the plane's lock (the lock is not held while XLA compiles)."""
        if not copy_ready:
            copy.lower(abstract).compile()
            copy_ready.append(True)
        return copy

    spec_axes = P(config.axes)
    small_shardings = dataclasses.replace(shardings, storage=dataclasses.replace(shardings.storage, rows=None))
    deltas = {}

    def delta(rows_per_shard: int):
        kernel = deltas.get(rows_per_shard)
        if kernel is None:
            def extract(rows, start, count):
                slots = (start[0] + lax.iota(jnp.int32, rows_per_shard)) % config.shard_capacity
                block = storage.gather(rows, config.ring_row(slots))
                return jnp.where((lax.iota(jnp.int32, rows_per_shard) < count[0])[:, None], block,
                                 jnp.zeros((), block.dtype))

            extract = jax.shard_map(extract, mesh=config.mesh, in_specs=(spec_axes, spec_axes, spec_axes),
                                    out_specs=spec_axes, check_vma=False)

            def kernel(state, start, count):
                small = dataclasses.replace(state, storage=dataclasses.replace(state.storage, rows=None))
                return {"state": jax.tree_util.tree_map(jnp.copy, small),
                        "delta": extract(state.storage.rows, start, count)}

            kernel = engine.compiled(kernel, "checkpoint_delta",
                                     out_shardings={"state": small_shardings,
                                                    "delta": NamedSharding(config.mesh, spec_axes)})
            deltas[rows_per_shard] = kernel
        return kernel

    def delta_compiled(rows_per_shard: int):
        kernel = delta(rows_per_shard)
        if rows_per_shard not in compiled:
            index = jax.ShapeDtypeStruct((config.num_shards,), jnp.int32)
            kernel.lower(abstract, index, index).compile()
            compiled.add(rows_per_shard)
        return kernel

    compiled = set()
    return {"copy": copy, "copy_compiled": copy_compiled, "delta": delta, "delta_compiled": delta_compiled,
            "compiled": compiled}


def _abstract_state(config):
    return jax.eval_shape(functools.partial(replay.init, config, 0))


def named_leaves(tree) -> dict[str, jax.Array]:
    """Every leaf of a state pytree (or of a delta snapshot) by the stable name a checkpoint stores it under:
    'storage.rows', 'sampler.levels.2', 'leaves.tokens', ... (``unflatten_like`` is the inverse)."""
    if isinstance(tree, dict) and "delta" in tree:
        out = named_leaves(tree["state"])
        out[_DELTA] = tree["delta"]
        return out
    flat, _ = jax.tree_util.tree_flatten_with_path(tree)
    return {_key(path): leaf for path, leaf in flat}




def _key(path) -> str:
    return leaf_name(path).replace("/", ".").replace("[", "").replace("]", "")


def _host_buffers(plane) -> dict[str, np.ndarray]:
    """One host array per state leaf (global shape), every page touched, so the copy under the lock is a memcpy."""
    buffers = {}
    for name, leaf in named_leaves(_abstract_state(plane.config)).items():
        buffer = np.empty(leaf.shape, leaf.dtype)
        buffer.reshape(-1).view(np.uint8)[::4096] = 0  # fault the pages in now, not under the lock
        buffers[name] = buffer
    return buffers


def _copy_to_host(state, buffers: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Copy every leaf of a state on CPU devices into ``buffers`` (call under the plane's lock): each distinct
    shard is a zero-copy NumPy view of its device buffer, copied into its slice of the global array."""
    leaves = named_leaves(state)
    if set(leaves) != set(buffers):
        raise CheckpointError(f"save(): the plane's state has leaves {sorted(leaves)}, expected {sorted(buffers)}")
    for name, leaf in leaves.items():
        buffer = buffers[name]
        if tuple(leaf.shape) != buffer.shape or np.dtype(leaf.dtype) != buffer.dtype:
            raise CheckpointError(f"save(): state leaf '{name}' is {leaf.dtype}{list(leaf.shape)}, expected "
                                  f"{buffer.dtype}{list(buffer.shape)}")
        done = set()
        for shard in leaf.addressable_shards:
            key = tuple((i.start, i.stop) if isinstance(i, slice) else i for i in shard.index)
            if key in done:
                continue
            done.add(key)
            np.copyto(buffer[(*shard.index, Ellipsis)], np.asarray(shard.data))
    return buffers


def _crc32(array) -> int:
    """CRC-32 of an array's bytes in C order (a ``jax.Array`` sharded on its first axis is read shard by shard, so
    the value does not depend on the sharding). zlib releases the GIL while it runs."""
    if isinstance(array, np.ndarray):
        return zlib.crc32(np.ascontiguousarray(array).reshape(-1).view(np.uint8))
    if array.ndim > 0:
        pieces = {}
        for shard in array.addressable_shards:
            index = shard.index
            whole_rest = all(i == slice(None) or (i.start in (None, 0) and i.stop in (None, n))
                             for i, n in zip(index[1:], array.shape[1:]))
            if not whole_rest:
                break
            pieces.setdefault(index[0].indices(array.shape[0])[:2], shard)
        else:
            spans = sorted(pieces)
            if spans and spans[0][0] == 0 and spans[-1][1] == array.shape[0] and \
                    all(a[1] == b[0] for a, b in zip(spans, spans[1:])):
                crc = 0
                for span in spans:
                    crc = zlib.crc32(np.ascontiguousarray(np.asarray(pieces[span].data)).reshape(-1).view(np.uint8),
                                     crc)
                return crc
    return _crc32(np.asarray(array))


# ------------------------------------------------------------------------------------------------------------------
# restore
# ------------------------------------------------------------------------------------------------------------------
def restore(directory, build, *, step: Optional[int] = None, mesh: Optional[Mesh] = None,
            sampler: Optional[samplers.Sampler] = None, limiter: Optional[limits.Limiter] = None,
            spec=None, capacity: Optional[int] = None, schedule=None, plan=None, timings: Optional[dict] = None):
    """Rebuild a plane from step ``step`` (default: the newest finished step) of ``directory`` on ``mesh`` (default:
    ``default_mesh()``), or placed by a ``placement.Plan`` given as ``plan`` (its mesh and memory kinds; the plan the
    plane was saved with is in ``metadata(directory)["plan"]``). The sampler and limiter are rebuilt from their recorded
    parameters unless given (then they must match the recorded ones; a sampler with a beta schedule must be given); so
    is the delivery schedule unless ``schedule`` is given. ``spec`` and ``capacity``, when given, must match the
    checkpoint's. Raises ``CheckpointError`` for a missing, unfinished, corrupted or mismatching checkpoint. A dict
    passed as ``timings`` receives the seconds of each phase (metadata, build, read, verify, relayout, place, total).

    ``build(spec, capacity, sampler, *, limiter, staleness, cast, mesh | plan, [schedule,] state)`` makes the plane
    around the state read back: ``ExperienceDataPlane.restore(directory, ...)`` passes its class, the usual way in."""

    directory = checked_directory(directory, "restore()")
    where = f"restore({directory})"
    if timings is not None and not isinstance(timings, dict):
        raise ConfigError(f"restore(): timings must be a dict (it receives each phase's seconds), got "
                          f"{type(timings).__name__}")
    timings = {} if timings is None else timings
    start = phase = time.perf_counter()
    step = choose_step(directory, step, where)
    where = f"restore({directory}, step={step})"
    chain = _chain(directory, step, where)
    meta = chain[-1][1]
    # -- what the checkpoint says the plane is; each check names what does not match --
    saved_spec = _spec_from_json(meta["spec"], spec, where)
    if spec is not None:
        given = spec if isinstance(spec, ExperienceSpec) else ExperienceSpec.from_structs(spec)
        if given != saved_spec:
            raise CheckpointError(f"{where}: the checkpoint holds spec {saved_spec}, not the given {given}")
    saved_capacity = _field(meta, "capacity", int, where)
    if capacity is not None and capacity != saved_capacity:
        raise CheckpointError(f"{where}: the checkpoint holds capacity {saved_capacity}, not the given {capacity}")
    sampler = _policy(meta, sampler, where, "sampler")
    limiter = _policy(meta, limiter, where, "limiter")
    staleness = meta.get("staleness")
    if staleness is not None:
        staleness = limits.Staleness(_field(staleness, "max_versions", int, where), _field(staleness, "key", str,
                                                                                           where))
    if plan is not None and mesh is not None:
        raise ConfigError(f"{where}: pass mesh or plan, not both (a plan brings its mesh)")
    mesh = replay.default_mesh() if mesh is None and plan is None else mesh
    timings["metadata"] = time.perf_counter() - phase
    phase = time.perf_counter()
    try:
        config, shardings = functional.configure(saved_spec, saved_capacity, sampler, limiter=limiter,
                                                 staleness=staleness, mesh=None if plan is not None else mesh,
                                                 plan=plan)
    except ConfigError as exc:
        raise ConfigError(f"{where}: the checkpoint's plane cannot be built on this mesh / plan: {exc}") from None
    extra = {"plan": plan} if plan is not None else {"mesh": mesh}
    schedule = schedule_from_json(meta, schedule, where)
    if schedule is not None and "schedule" in inspect.signature(build).parameters:
        extra["schedule"] = schedule
    saved_shards = _field(meta, "num_shards", int, where)
    abstract = named_leaves(_abstract_state(config))
    targets = {name: jax.ShapeDtypeStruct(abstract[name].shape, abstract[name].dtype, sharding=sharding)
               for name, sharding in named_leaves(shardings).items()}
    if _field(meta, "row_words", int, where) != config.layout.row_words:
        raise CheckpointError(f"{where}: the checkpoint's rows have {meta['row_words']} words, the spec packs into "
                              f"{config.layout.row_words}: the checkpoint is inconsistent")
    timings["build"] = time.perf_counter() - phase
    phase = time.perf_counter()
    # the streams interleaved per shard in the saved rings' row order (version 1: slot order, i.e. one stream)
    saved_streams = storage.streams_per_shard(config.sampler.streams, saved_shards) \
        if chain[0][1]["format_version"] >= 2 else 1
    # a leaf the sampler rebuilds from its others that the checkpoint lacks (saved before the sampler kept it, e.g.
    # the smallest-mass tree of a buffer-normalised prioritized sampler): rebuilt by the relayout path
    rebuilt = {name for name in targets if name.startswith(_REBUILT)} - set.intersection(
        *(set(meta["arrays"]) for _, meta in chain))
    same_layout = saved_shards == config.num_shards and not rebuilt
    if same_layout:
        state = _restore_same_layout(directory, chain, config, targets, saved_streams, where, timings)
    else:
        state = _restore_relayout(directory, chain, config, shardings, targets, saved_shards, saved_streams, where,
                                  timings)
    plane = build(saved_spec, saved_capacity, config.sampler, limiter=config.limiter, staleness=config.staleness,
                  cast=bool(meta.get("cast", False)), state=jax.block_until_ready(state), **extra)
    if same_layout:  # the next incremental save here continues this chain
        _lineages.setdefault(plane, {})[directory] = _Lineage(step, _field(meta, "lineage", str, where),
                                                              tuple(int(c) for c in meta["counts"]))
    timings["total"] = time.perf_counter() - start
    return plane


def _restore_same_layout(directory, chain, config, targets, saved_streams: int, where, timings):
    """Same shard count: orbax reads each array straight into the new plane's sharding; increments are applied on
    the device, shard by shard. Rings saved in slot order (version 1) are put in ring-row order first."""
    first_step, first_meta = chain[0]
    last_step, last_meta = chain[-1]
    for step, meta in chain:
        held = set(meta["arrays"]) - {_DELTA} | ({_ROWS} if meta["kind"] == "incremental" else set())
        if held != set(targets):
            raise CheckpointError(
                f"{where}: step {step} holds state leaves the plane built from its metadata does not have "
                f"{sorted(held - set(targets))} and lacks {sorted(set(targets) - held)}: it was written by a version "
                f"whose {config.sampler.name} sampler kept other state (e.g. a priority tree for uniform padded "
                f"sequences, which keep none now; restore it with that version), or its metadata is damaged")
    layout = config.layout
    base_targets = dict(targets if len(chain) == 1 else {_ROWS: targets[_ROWS]})
    base_targets[_ROWS] = _saved_rows_target(first_meta, _ROWS, targets[_ROWS])
    base = read_arrays(directory, first_step, first_meta, base_targets, where, timings)
    rows = base[_ROWS] = _in_ring_units(base[_ROWS], layout)
    if saved_streams != config.streams_per_shard:
        rows = base[_ROWS] = _slot_order_to_ring_rows_kernel(config)(rows)
    spec_axes = P(config.axes)
    for inc_step, inc_meta in chain[1:]:
        delta_meta = inc_meta["delta"]
        d = delta_meta["rows_per_shard"]
        wanted = jax.ShapeDtypeStruct((config.num_shards * d, layout.ring_width), layout.ring_dtype,
                                      sharding=NamedSharding(config.mesh, spec_axes))
        delta_target = {_DELTA: _saved_rows_target(inc_meta, _DELTA, wanted)}
        delta = _in_ring_units(read_arrays(directory, inc_step, inc_meta, delta_target, where, timings)[_DELTA],
                               layout)
        rows = _apply_delta_kernel(config, d)(rows, delta, np.asarray(delta_meta["start"], np.int32),
                                                    np.asarray(delta_meta["count"], np.int32))
    if len(chain) > 1:
        small = {name: t for name, t in targets.items() if name != _ROWS}
        arrays = read_arrays(directory, last_step, last_meta, small, where, timings)
        arrays[_ROWS] = rows
    else:
        arrays = base
    return unflatten_like(_abstract_state(config), arrays, where)


def _restore_relayout(directory, chain, config, shardings, targets, saved_shards: int, saved_streams: int, where,
                      timings):
    """Another shard count: read the saved arrays on one device, reassemble and re-lay them out on the host, then
    place them with the new buffer's shardings."""
    device = config.mesh.devices.flat[0]
    first_step, first_meta = chain[0]
    last_step, last_meta = chain[-1]
    single = SingleDeviceSharding(device)

    def saved_targets(meta, names=None):
        out = {}
        for name, info in meta["arrays"].items():
            if names is None or name in names:
                out[name] = jax.ShapeDtypeStruct(tuple(info["shape"]), jnp.dtype(info["dtype"]), sharding=single)
        return out

    layout = config.layout
    capacity, ring_width = config.capacity, layout.ring_width
    old_cap = capacity // saved_shards
    if len(chain) == 1:
        old = {k: np.asarray(v) for k, v in read_arrays(directory, first_step, first_meta,
                                                          saved_targets(first_meta), where, timings).items()}
        rows = old[_ROWS] = _in_ring_units(old[_ROWS], layout)
    else:
        rows = _in_ring_units(np.asarray(read_arrays(directory, first_step, first_meta,
                                                      saved_targets(first_meta, {_ROWS}), where, timings)[_ROWS]),
                              layout)
        for inc_step, inc_meta in chain[1:]:
            delta = _in_ring_units(np.asarray(read_arrays(directory, inc_step, inc_meta,
                                                           saved_targets(inc_meta, {_DELTA}), where, timings)[_DELTA]),
                                   layout)
            phase = time.perf_counter()
            d = inc_meta["delta"]["rows_per_shard"]
            at = np.full((saved_shards * d,), capacity, np.int32)  # padding rows go out of range: dropped
            for shard, (start, count) in enumerate(zip(inc_meta["delta"]["start"], inc_meta["delta"]["count"])):
                slots = (start + np.arange(count)) % old_cap
                at[shard * d:shard * d + count] = shard * old_cap + storage.ring_row(slots, saved_streams, old_cap)
            rows = _scatter_rows(rows, at, delta)  # in place (donated), on the one device
            timings["reassemble"] = timings.get("reassemble", 0.0) + time.perf_counter() - phase
        rows = np.asarray(rows)
        old = {k: np.asarray(v) for k, v in read_arrays(
            directory, last_step, last_meta,
            saved_targets(last_meta, set(last_meta["arrays"]) - {_DELTA}), where, timings).items()}
        old[_ROWS] = rows
    if old[_ROWS].shape != (capacity, ring_width):
        raise CheckpointError(f"{where}: storage rows have shape {old[_ROWS].shape}, expected {(capacity, ring_width)}")
    phase = time.perf_counter()
    try:
        new = _relayout(old, config, saved_shards, saved_streams, targets, where)
    except (KeyError, IndexError, ValueError) as exc:
        if isinstance(exc, CheckpointError):
            raise
        raise CheckpointError(f"{where}: the saved state cannot be laid out for {config.num_shards} shards "
                              f"({type(exc).__name__}: {exc}): the checkpoint is inconsistent") from None
    timings["relayout"] = time.perf_counter() - phase
    phase = time.perf_counter()
    state = jax.block_until_ready(jax.device_put(unflatten_like(_abstract_state(config), new, where),
                                                 shardings))
    timings["place"] = time.perf_counter() - phase
    return state


def _saved_rows_target(meta: dict, name: str, target):
    """How rows array ``name`` of a step was saved: a byte ring (uint8[n, row_bytes]) was saved as uint32[n, row_words]
    before format version 3. ``target`` otherwise (``read_arrays`` checks the recorded dtype and shape)."""
    info = meta["arrays"].get(name)
    if isinstance(info, dict) and info.get("dtype") == "uint32" and np.dtype(target.dtype) == np.uint8:
        return jax.ShapeDtypeStruct((target.shape[0], target.shape[1] // 4), jnp.uint32, sharding=target.sharding)
    return target


def _in_ring_units(rows, layout):
    """Saved rows in the ring's element type (NumPy: a view; on the device: one conversion, for older steps only)."""
    if rows.dtype == layout.ring_dtype or isinstance(rows, np.ndarray):
        return layout.to_ring(rows)
    return engine.compiled(layout.to_ring, "checkpoint_to_ring", out_shardings=rows.sharding)(rows)


def _scatter(rows, at, block):
    return rows.at[at].set(block, mode="drop")


_scatter_rows = engine.compiled(_scatter, "checkpoint_scatter", donate_argnums=(0,))


def _relayout(old: dict, config, saved_shards: int, saved_streams: int, targets: dict, where: str) -> dict:
    """The saved arrays of an ``saved_shards``-shard plane (``saved_streams`` streams per ring, see
    ``storage.ring_row``), laid out for ``config``'s shard count (host NumPy)."""
    capacity, shards = config.capacity, config.num_shards
    old_cap, new_cap = capacity // saved_shards, capacity // shards
    cursor, laps = old["storage.cursor"].astype(np.int64), old["storage.laps"].astype(np.int64)
    counts = laps * old_cap + cursor
    total = int(counts.sum())
    expected = [max(0, -(-(total - s) // saved_shards)) for s in range(saved_shards)]
    if counts.tolist() != expected or int(old["storage.next_shard"]) != total % saved_shards:
        raise CheckpointError(f"{where}: per-shard write counts {counts.tolist()} are not a round-robin deal of "
                              f"{total} items: the checkpoint is inconsistent")
    items = np.arange(max(0, total - capacity), total, dtype=np.int64)
    old_slot, new_slot = (items // saved_shards) % old_cap, (items // shards) % new_cap
    old_row_at = (items % saved_shards) * old_cap + storage.ring_row(old_slot, saved_streams, old_cap)
    new_row_at = (items % shards) * new_cap + config.ring_row(new_slot)
    new_counts = np.array([max(0, -(-(total - s) // shards)) for s in range(shards)], np.int64)
    out = {}
    rows = np.zeros_like(old[_ROWS])
    for start in range(0, items.shape[0], 1 << 18):  # in pieces: no second full-size temporary
        part = slice(start, start + (1 << 18))
        rows[new_row_at[part]] = old[_ROWS][old_row_at[part]]
    out[_ROWS] = rows
    out["storage.cursor"] = (new_counts % new_cap).astype(np.int32)
    out["storage.laps"] = (new_counts // new_cap).astype(np.int32)
    out["storage.next_shard"] = np.asarray(total % shards, np.int32)
    sampler = config.sampler
    if sampler.relayout is not None:  # per-item sampler state moves with its items: the sampler's own rule
        moves = samplers.ItemMoves(items, total, saved_shards, shards, capacity)
        prefix = "sampler."
        saved = {name[len(prefix):]: value for name, value in old.items() if name.startswith(prefix)}
        wanted = {name[len(prefix):]: value for name, value in targets.items() if name.startswith(prefix)}
        out.update({prefix + name: value for name, value in sampler.relayout(saved, moves, wanted).items()})
    for name, target in targets.items():
        if name in out:
            continue
        if name not in old:
            raise CheckpointError(f"{where}: the checkpoint has no state leaf '{name}'")
        if target.shape != () or old[name].shape != ():
            raise CheckpointError(f"{where}: cannot re-lay out state leaf '{name}' of the {config.sampler.name} "
                                  f"sampler from {saved_shards} to {shards} shards")
        out[name] = old[name]
    return out


@functools.lru_cache(maxsize=8)
def _slot_order_to_ring_rows_kernel(config):
    """Rings whose rows are in slot order, moved to ring-row order (each shard: slot j to row ``ring_row(j)``)."""
    spec_axes = P(config.axes)

    def move(rows):
        return rows.at[config.ring_row(lax.iota(jnp.int32, config.shard_capacity))].set(rows, unique_indices=True)

    move = jax.shard_map(move, mesh=config.mesh, in_specs=spec_axes, out_specs=spec_axes, check_vma=False)
    return engine.compiled(move, "checkpoint_relayout", donate_argnums=(0,),
                           out_shardings=NamedSharding(config.mesh, spec_axes))


@functools.lru_cache(maxsize=32)
def _apply_delta_kernel(config, rows_per_shard: int):
    spec_axes = P(config.axes)

    def apply(rows, delta, start, count):
        iota = lax.iota(jnp.int32, rows_per_shard)
        at = jnp.where(iota < count[0], config.ring_row((start[0] + iota) % config.shard_capacity),
                       config.shard_capacity)
        return rows.at[at].set(delta, mode="drop")

    apply = jax.shard_map(apply, mesh=config.mesh, in_specs=(spec_axes,) * 4, out_specs=spec_axes, check_vma=False)
    return engine.compiled(apply, "checkpoint_apply_delta", donate_argnums=(0,),
                           out_shardings=NamedSharding(config.mesh, spec_axes))


def unflatten_like(template, arrays: dict, where: str):
    """The pytree ``template`` (arrays or ``jax.ShapeDtypeStruct``) with each leaf replaced by ``arrays[name]``
    (names as ``named_leaves`` gives them); ``CheckpointError`` for a leaf that is missing or of another shape or
    dtype."""
    flat, treedef = jax.tree_util.tree_flatten_with_path(template)
    names = [_key(path) for path, _ in flat]
    missing = [n for n in names if n not in arrays]
    if missing:
        raise CheckpointError(f"{where}: the checkpoint lacks state leaves {missing}")
    leaves = []
    for name, (_, leaf) in zip(names, flat):
        value = arrays[name]
        if tuple(value.shape) != tuple(leaf.shape) or np.dtype(value.dtype) != np.dtype(leaf.dtype):
            raise CheckpointError(f"{where}: state leaf '{name}' is {np.dtype(value.dtype)}{list(value.shape)}, the "
                                  f"plane needs {np.dtype(leaf.dtype)}{list(leaf.shape)}")
        leaves.append(value)
    return jax.tree_util.tree_unflatten(treedef, leaves)


def choose_step(directory: str, step: Optional[int], where: str) -> int:
    """The step of ``directory`` (a ``checked_directory`` path) to restore: ``step``, or the newest finished one by
    default. ``CheckpointError`` when the directory does not exist, holds no finished step (naming the steps whose
    saves were interrupted, if any) or has no finished step ``step``."""
    if not os.path.isdir(directory):
        raise CheckpointError(f"{where}: no such directory")
    steps = _steps_on_disk(directory)
    if not steps:
        unfinished = _steps_on_disk(directory, include_unfinished=True)
        raise CheckpointError(f"{where}: no finished checkpoint in the directory" +
                              (f" (unfinished saves of steps {unfinished} were interrupted)" if unfinished else ""))
    if step is None:
        return steps[-1]
    if step not in steps:
        raise CheckpointError(f"{where}: there is no finished step {step}; the directory has steps {steps}")
    return step


def _chain(directory: str, step: int, where: str) -> list[tuple[int, dict]]:
    """[(step, metadata)] from the full base up to ``step``."""
    chain = []
    seen = set()
    current = step
    while True:
        meta = _read_meta(directory, current, where)
        chain.append((current, meta))
        seen.add(current)
        if meta["kind"] == "full":
            break
        base = meta.get("base_step")
        if not isinstance(base, int) or base in seen:
            raise CheckpointError(f"{where}: incremental step {current} names no valid base step ({base!r})")
        if base not in _steps_on_disk(directory):
            raise CheckpointError(f"{where}: incremental step {current} needs base step {base}, which is missing "
                                  f"from {directory}")
        current = base
    chain.reverse()
    head = chain[0][1]
    for inc_step, inc_meta in chain[1:]:
        previous = dict(chain)[inc_meta["base_step"]]
        for key in ("lineage", "capacity", "num_shards", "row_words", "spec"):
            if inc_meta.get(key) != head.get(key):
                raise CheckpointError(f"{where}: incremental step {inc_step} and its base step {inc_meta['base_step']} "
                                      f"disagree on '{key}'")
        delta = inc_meta.get("delta")
        if not isinstance(delta, dict) or delta.get("from_counts") != previous.get("counts"):
            raise CheckpointError(f"{where}: incremental step {inc_step} does not continue its base step "
                                  f"{inc_meta['base_step']} (the write counts differ): the chain is inconsistent")
        shards, shard_cap = head["num_shards"], head["capacity"] // max(head["num_shards"], 1)
        d, starts, counts = delta.get("rows_per_shard"), delta.get("start"), delta.get("count")
        if not (isinstance(d, int) and 1 <= d <= shard_cap and isinstance(starts, list) and isinstance(counts, list)
                and len(starts) == len(counts) == shards
                and all(isinstance(x, int) and 0 <= x < shard_cap for x in starts)
                and all(isinstance(x, int) and 0 <= x <= d for x in counts)
                and [a + b for a, b in zip(previous["counts"], counts)] == inc_meta["counts"]):
            raise CheckpointError(f"{where}: the row ranges of incremental step {inc_step} are malformed: the "
                                  f"checkpoint is corrupted")
    return chain


def metadata_checksum(meta: dict) -> int:
    """CRC-32 of a step's metadata as canonical JSON (sorted keys, no spaces), its own ``meta_crc32`` field left out.
    Recorded from format version 4 on and checked by restore, so metadata edited after the save is refused."""
    body = {key: value for key, value in meta.items() if key != "meta_crc32"}
    return zlib.crc32(json.dumps(body, sort_keys=True, separators=(",", ":")).encode())


def read_step_metadata(directory: str, step: int, where: str, *, format: str = FORMAT,
                       versions: tuple = READABLE_VERSIONS, signed_from: int = 4,
                       what: str = "Conduit-JAX plane") -> dict:
    """The JSON metadata of step ``step`` of ``directory`` (read as plain JSON: never unpickled), checked: it reads
    back, its ``format`` is ``format`` (else: "not a ``what`` checkpoint"), its ``format_version`` is one of
    ``versions``, and from version ``signed_from`` on it matches its recorded ``meta_crc32`` (``metadata_checksum``:
    metadata edited after the save is refused). Raises ``CheckpointError`` naming what is wrong."""
    meta = _read_meta_file(directory, step)
    if isinstance(meta, Exception):
        raise CheckpointError(f"{where}: the metadata of step {step} cannot be read ({type(meta).__name__}: {meta}); "
                              f"the checkpoint is partial or corrupted") from meta
    if not isinstance(meta, dict) or meta.get("format") != format:
        raise CheckpointError(f"{where}: step {step} is not a {what} checkpoint")
    if meta.get("format_version") not in versions:
        raise CheckpointError(f"{where}: step {step} has format version {meta.get('format_version')!r}; this version "
                              f"of conduit_jax reads versions {', '.join(map(str, versions))}")
    if meta["format_version"] >= signed_from and meta.get("meta_crc32") != metadata_checksum(meta):
        raise CheckpointError(f"{where}: the metadata of step {step} does not match its recorded checksum: it was "
                              f"edited or damaged after the save (a dtype, a leaf name, a count); restore another "
                              f"step or save again")
    return meta


def _read_meta(directory: str, step: int, where: str) -> dict:
    meta = read_step_metadata(directory, step, where)
    if meta.get("kind") not in ("full", "incremental"):
        raise CheckpointError(f"{where}: step {step} has unknown kind {meta.get('kind')!r}")
    if not isinstance(meta.get("arrays"), dict) or not isinstance(meta.get("counts"), list):
        raise CheckpointError(f"{where}: the metadata of step {step} lacks its array list: the checkpoint is corrupted")
    capacity, shards = meta.get("capacity"), meta.get("num_shards")
    if not (isinstance(capacity, int) and isinstance(shards, int) and 1 <= shards <= capacity and
            capacity % shards == 0 and len(meta["counts"]) == shards and
            all(isinstance(c, int) and c >= 0 for c in meta["counts"])):
        raise CheckpointError(f"{where}: step {step} records capacity {capacity!r} over {shards!r} shards with write "
                              f"counts {meta['counts']!r}: the checkpoint is corrupted")
    return meta


def _read_meta_file(directory: str, step: int):
    """The JSON metadata of a step (read as plain JSON: never unpickled), or the exception that prevented it."""
    import orbax.checkpoint as ocp
    try:
        with ocp.Checkpointer(ocp.CompositeCheckpointHandler()) as reader:
            return reader.restore(os.path.join(directory, str(step)),
                                  args=ocp.args.Composite(**{_META: ocp.args.JsonRestore()}))[_META]
    except Exception as exc:  # reported by the caller with context
        return exc


def read_arrays(directory: str, step: int, meta: dict, targets: dict, where: str,
                timings: Optional[dict] = None) -> dict:
    """Read arrays of step ``step`` (``meta``: its metadata, from ``read_step_metadata``) straight into their
    places: ``targets`` maps a name (as ``named_leaves`` gives it) to a ``jax.ShapeDtypeStruct`` with a sharding.
    Each must be recorded with that shape and dtype, and must read back with its recorded CRC-32; else
    ``CheckpointError`` naming the arrays. Returns name -> ``jax.Array``; ``timings`` (a dict) accumulates the
    seconds of the read and of the verification."""
    timings = {} if timings is None else timings
    import orbax.checkpoint as ocp
    recorded = meta["arrays"]
    for name, target in targets.items():
        info = recorded.get(name)
        if not isinstance(info, dict):
            raise CheckpointError(f"{where}: step {step} has no array '{name}' (it holds {sorted(recorded)})")
        if tuple(info.get("shape", ())) != tuple(target.shape) or info.get("dtype") != np.dtype(target.dtype).name:
            raise CheckpointError(f"{where}: array '{name}' of step {step} is {info.get('dtype')}{info.get('shape')}, "
                                  f"the plane needs {np.dtype(target.dtype).name}{list(target.shape)}")
    # orbax's StandardRestore wants the whole saved tree: arrays not asked for are read onto one device and dropped
    device = min(next(iter(targets.values())).sharding.device_set, key=lambda d: d.id)
    full = {}
    for name, info in recorded.items():
        full[name] = targets[name] if name in targets else jax.ShapeDtypeStruct(
            tuple(info["shape"]), jnp.dtype(info["dtype"]), sharding=SingleDeviceSharding(device))
    phase = time.perf_counter()
    try:
        with ocp.Checkpointer(ocp.CompositeCheckpointHandler()) as reader:
            restored = reader.restore(os.path.join(directory, str(step)),
                                      args=ocp.args.Composite(**{_ARRAYS: ocp.args.StandardRestore(full)}))
            arrays = jax.block_until_ready(dict(restored[_ARRAYS]))
    except Exception as exc:  # any failure of orbax / tensorstore here means the step cannot be read
        raise CheckpointError(f"{where}: the arrays of step {step} cannot be read ({type(exc).__name__}: "
                              f"{str(exc)[:500]}); the checkpoint is partial or corrupted") from exc
    arrays = {name: arrays[name] for name in targets}
    timings["read"] = timings.get("read", 0.0) + time.perf_counter() - phase
    phase = time.perf_counter()
    bad = [name for name in arrays if _crc32(arrays[name]) != recorded[name].get("crc32")]
    timings["verify"] = timings.get("verify", 0.0) + time.perf_counter() - phase
    if bad:
        raise CheckpointError(f"{where}: arrays {bad} of step {step} do not match their recorded digests: the "
                              f"checkpoint is corrupted")
    return arrays


# ------------------------------------------------------------------------------------------------------------------
# metadata helpers
# ------------------------------------------------------------------------------------------------------------------
def _field(meta, key: str, kind, where: str):
    value = meta.get(key) if isinstance(meta, dict) else None
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        raise CheckpointError(f"{where}: metadata field '{key}' is {value!r}, expected a {kind.__name__}")
    return value


def _params_json(params) -> dict:
    return {str(k): (list(v) if isinstance(v, tuple) else v) for k, v in params}


def _policy(meta, given, where: str, kind: str):
    """The sampler or limiter (``kind``) to restore with: the given one if it matches what the checkpoint recorded
    (else a ``CheckpointError`` saying what differs), or one rebuilt from the recorded constructor arguments."""
    module, cls = {"sampler": (samplers, samplers.Sampler), "limiter": (limits, limits.Limiter)}[kind]
    recorded = meta.get(kind)
    if not isinstance(recorded, dict) or not isinstance(recorded.get("name"), str) or \
            not isinstance(recorded.get("params"), dict):
        raise CheckpointError(f"{where}: the metadata records no {kind}")
    if given is not None:
        if not isinstance(given, cls):
            raise ConfigError(f"{where}: {kind} must be a {module.__name__.split('.')[-1]}.{cls.__name__}, got "
                              f"{type(given).__name__}")
        mine = {"name": given.name, "params": _params_json(given.params)}
        if json.loads(json.dumps(mine)) != recorded:
            raise CheckpointError(f"{where}: the checkpoint was saved with {kind} {recorded['name']}"
                                  f"({_describe(recorded['params'])}), not the given {given.name}"
                                  f"({_describe(mine['params'])})")
        return given
    try:
        return module.from_params(recorded["name"], recorded["params"])
    except ConfigError as exc:
        raise CheckpointError(f"{where}: {exc}") from None
    except TypeError as exc:
        raise CheckpointError(f"{where}: the recorded {kind} parameters do not fit {recorded['name']}: {exc}") \
            from None


def _plan_json(plan):
    try:
        return None if plan is None else json.loads(json.dumps(plan.to_dict()))
    except (AttributeError, TypeError, ValueError):
        return None


def schedule_json(schedule):
    """A delivery schedule as JSON for a checkpoint's metadata: it is plain data (a NamedTuple of name, depth,
    defer, adaptive), so its fields; None for no schedule (or one that is not plain data)."""
    if schedule is None or not hasattr(schedule, "_asdict"):
        return None
    fields = schedule._asdict()
    return fields if all(isinstance(v, (str, int, bool)) for v in fields.values()) else None


def schedule_from_json(meta, given, where):
    """The schedule a restored plane runs: ``given`` if not None, else the one ``meta["schedule"]`` records
    (``schedule_json``) rebuilt, else None; ``CheckpointError`` when the record cannot be rebuilt."""
    if given is not None:
        return given
    recorded = meta.get("schedule")
    if recorded is None:
        return None
    try:
        from conduit_jax import schedule as schedule_lib
        fields = {name: recorded[name] for name in schedule_lib.Schedule._fields if name in recorded}
        return schedule_lib.rebuilt(schedule_lib.Schedule(**fields), where)
    except (ImportError, TypeError, KeyError, ConfigError) as exc:
        raise CheckpointError(f"{where}: the recorded schedule {recorded!r} cannot be rebuilt ({exc}); pass "
                              f"schedule=") from None


def _describe(params: dict) -> str:
    return ", ".join(f"{k}={v!r}" for k, v in sorted(params.items()))


def _spec_json(spec: ExperienceSpec) -> dict:
    return {
        "leaves": [{"name": n, "shape": list(s), "dtype": np.dtype(d).name}
                   for n, s, d in zip(spec.names, spec.shapes, spec.dtypes)],
        "tree": _encode_tree(spec.structs, iter(range(len(spec.names)))),
        "treedef": str(spec.treedef),
    }


def _encode_tree(node, counter):
    """The spec's structure as JSON: {"dict": [[key, sub], ...]}, {"list": [...]}, {"tuple": [...]}, {"none": 0},
    {"leaf": i}; None for a structure JSON cannot describe (custom pytree nodes: restore then needs ``spec=``)."""
    if isinstance(node, jax.ShapeDtypeStruct):
        return {"leaf": next(counter)}
    if node is None:
        return {"none": 0}
    if type(node) is dict:
        if not all(isinstance(k, str) for k in node):
            return None
        parts = [[k, _encode_tree(node[k], counter)] for k in sorted(node)]
        return None if any(p[1] is None for p in parts) else {"dict": parts}
    if type(node) in (list, tuple):
        parts = [_encode_tree(x, counter) for x in node]
        return None if any(p is None for p in parts) else {type(node).__name__: parts}
    return None


def _decode_tree(node, leaves, where):
    if not isinstance(node, dict) or len(node) != 1:
        raise CheckpointError(f"{where}: the recorded spec tree is malformed at {node!r}")
    (kind, value), = node.items()
    if kind == "leaf":
        if not isinstance(value, int) or not 0 <= value < len(leaves):
            raise CheckpointError(f"{where}: the recorded spec tree names leaf {value!r} of {len(leaves)}")
        return leaves[value]
    if kind == "none":
        return None
    if kind == "dict" and isinstance(value, list):
        return {str(k): _decode_tree(v, leaves, where) for k, v in value}
    if kind in ("list", "tuple") and isinstance(value, list):
        parts = [_decode_tree(v, leaves, where) for v in value]
        return parts if kind == "list" else tuple(parts)
    raise CheckpointError(f"{where}: the recorded spec tree has unknown node kind {kind!r}")


def _spec_from_json(recorded, given, where) -> ExperienceSpec:
    if not isinstance(recorded, dict) or not isinstance(recorded.get("leaves"), list):
        raise CheckpointError(f"{where}: the metadata records no spec")
    try:
        leaves = [jax.ShapeDtypeStruct(tuple(int(d) for d in leaf["shape"]), jnp.dtype(leaf["dtype"]))
                  for leaf in recorded["leaves"]]
    except (KeyError, TypeError, ValueError) as exc:
        raise CheckpointError(f"{where}: the recorded spec leaves are malformed ({exc})") from None
    if recorded.get("tree") is None:
        if given is None:
            raise CheckpointError(f"{where}: the checkpoint's spec has custom pytree nodes that JSON cannot rebuild "
                                  f"({recorded.get('treedef')}); pass spec= to restore()")
        given = given if isinstance(given, ExperienceSpec) else ExperienceSpec.from_structs(given)
        mine = _spec_json(given)
        if [mine["leaves"], mine["treedef"]] != [recorded["leaves"], recorded.get("treedef")]:
            raise CheckpointError(f"{where}: the checkpoint holds spec {recorded['leaves']} "
                                  f"({recorded.get('treedef')}), not the given {given}")
        return given
    try:
        spec = ExperienceSpec.from_structs(_decode_tree(recorded["tree"], leaves, where))
    except ConduitError as exc:
        raise CheckpointError(f"{where}: the recorded spec is invalid: {exc}") from None
    if [list(spec.names), str(spec.treedef)] != [[leaf["name"] for leaf in recorded["leaves"]],
                                                   recorded.get("treedef")]:
        raise CheckpointError(f"{where}: the recorded spec tree does not rebuild its leaf names / structure")
    return spec


# ------------------------------------------------------------------------------------------------------------------
# directories
# ------------------------------------------------------------------------------------------------------------------
def checked_directory(directory, where: str) -> str:
    """``directory`` as an absolute path, checked to be (or to be able to become) a directory of checkpoint steps:
    ``ConfigError`` for what is not a path, ``CheckpointError`` for a file (or a path under one)."""
    if not isinstance(directory, (str, os.PathLike)):
        raise ConfigError(f"{where}: directory must be a path, got {type(directory).__name__}")
    path = os.path.abspath(os.fspath(directory))
    if os.path.exists(path) and not os.path.isdir(path):
        raise CheckpointError(f"{where}: {path} is a file, not a directory; checkpoints go in a directory of "
                              f"their own (one numbered step per folder)")
    parent = os.path.dirname(path)
    while not os.path.exists(parent):  # the nearest existing ancestor must be a directory too
        parent = os.path.dirname(parent)
    if not os.path.isdir(parent):
        raise CheckpointError(f"{where}: {path} cannot be a directory: {parent} is a file")
    return path


def _steps_on_disk(directory: str, include_unfinished: bool = False) -> list[int]:
    """Finished steps (folders named by a number), or with ``include_unfinished`` the steps of interrupted saves."""
    try:
        names = os.listdir(directory)
    except FileNotFoundError:
        return []
    if include_unfinished:
        return sorted({int(n.split(".")[0]) for n in names if ".orbax-checkpoint-tmp" in n and
                       n.split(".")[0].isdigit()})
    return sorted(int(n) for n in names if n.isdigit() and os.path.isdir(os.path.join(directory, n)))


def all_steps(directory) -> list[int]:
    """The finished steps of a checkpoint directory, oldest first."""
    return _steps_on_disk(checked_directory(directory, "all_steps()"))


def latest_step(directory) -> Optional[int]:
    steps = all_steps(directory)
    return steps[-1] if steps else None


def metadata(directory, step: Optional[int] = None) -> dict:
    """The JSON metadata of a step (default: the newest), e.g. to inspect a checkpoint without restoring it."""
    directory = checked_directory(directory, "metadata()")
    steps = _steps_on_disk(directory)
    if not steps:
        raise CheckpointError(f"metadata({directory}): no finished checkpoint in the directory")
    step = steps[-1] if step is None else step
    return _read_meta(directory, step, f"metadata({directory}, step={step})")
