"""Checkpoints of a whole ``ExperienceDataPlane``: every leaf of its state plus JSON metadata, written by orbax.

What a checkpoint holds. Step ``k`` of a checkpoint directory is an orbax step folder ``<directory>/<k>/`` with two
items: ``arrays`` (every leaf of ``plane.state``, by name, written by orbax/tensorstore) and ``meta`` (JSON): the format
version, the spec (leaf names, shapes, dtype names such as ``bfloat16``, and the tree as nested dicts / lists / tuples
so it can be rebuilt), capacity, shard count and per-shard write counts, sampler and limiter (name + constructor
parameters), staleness, ``cast``, and for every stored array its shape, dtype and a 32-bit digest. Nothing is
pickled: loading a checkpoint cannot run code. Restore refuses (``CheckpointError``, a ``ValueError``) a missing,
unfinished, partial or corrupted checkpoint (an array that does not read back or whose digest differs), another
format version, and anything that does not match what the caller passes explicitly (``spec``, ``capacity``,
``sampler``, ``limiter``); the message says what differs.

Saving is asynchronous. ``save`` takes the plane's lock only to dispatch one jitted copy of the state (the plane
donates its state buffers on every ingest, so a background writer must never hold the live arrays); the copy is
written by a background thread (digests, then a synchronous orbax save inside that thread) while ingest and sample
keep running. ``SaveHandle.blocked_s`` is how long the lock was held, ``total_s`` the whole save. Saves to one
directory run one after another in call order. The copy doubles the state's memory until it is written.

Atomicity. Orbax writes a step into ``<k>.orbax-checkpoint-tmp-<timestamp>/`` and renames it to ``<k>/`` once
complete; a process killed mid-save leaves only the tmp folder, which restore never reads (and the next save to that
directory removes). Retention: after each save only the newest ``max_to_keep`` steps are kept, plus the steps an
incremental step depends on.

Incremental saves (``save(..., incremental=True)``). When this plane object's previous save went to the same
directory (or it was restored from it), the step stores only the ring rows written since that step: for each shard s
the ``count[s]`` rows from slot ``start[s]`` on (cyclically), as one ``uint32[shards * D, row_words]`` array (D: the
largest count rounded up to a power of two; rows past ``count[s]`` are zero), plus every other state leaf in full
(cursors, laps, counters, limiter and sampler state, including a priority sampler's sum trees and
``times_sampled``). Restore replays the chain: the full base step, then each increment's rows in order, then the last
step's other leaves. Otherwise (first save of this plane object here, or some shard wrapped all the way round since)
an incremental save writes a full step; ``SaveHandle.kind`` says which. Retention never deletes a step a kept
increment depends on, so a chain lives until the next full save is among the newest ``max_to_keep``.

Restoring onto another mesh. With the same shard count (another device set, another mesh shape such as 2x4 instead
of 8, another memory kind) orbax reads every array directly into the new plane's shardings, bit for bit. With another
shard count (8 -> 4 -> 1 devices) the per-shard layout differs (item g lives at shard ``g % S``, slot
``(g // S) % (capacity / S)``), so restore re-lays the state out on the host: it recomputes each stored item's shard
and slot (the stored items are always the last ``min(inserted, capacity)`` ones), moves the item-attached sampler
state with its item (sum-tree leaves, ``times_sampled``) and rebuilds every sum-tree level above the leaves as float32
sums of their children, recomputes cursors, laps, the round-robin shard and a FIFO queue's read head; scalar state
(random stream counters, limiter balance, policy version, counters) carries over. The result equals a plane built on
the new mesh that ingested the same items (ring rows, cursors, laps, priorities and remaining deliveries); item ids
delivered before such a restore name other rows afterwards, so apply pending priority updates before saving.
The random streams continue, but draws map to different rows under another shard count, so deliveries after the
restore are not the ones the original would have made. Same-count restores continue the original delivery stream
exactly.

Single process only: multi-host meshes are not supported by this module yet.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import os
import threading
import time
import uuid
import weakref
from typing import Any, Optional

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import Mesh, NamedSharding, SingleDeviceSharding
from jax.sharding import PartitionSpec as P

from conduit_jax import limits, replay, samplers, storage, sumtree
from conduit_jax.errors import ConduitError, ConfigError
from conduit_jax.spec import ExperienceSpec, leaf_name

FORMAT = "conduit-jax-plane"
FORMAT_VERSION = 1
_ARRAYS, _META = "arrays", "meta"
_ROWS = "storage.rows"
_DELTA = "delta.rows"


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
    the ``save`` call until the step was final on disk (None until then); ``bytes``: array bytes written.
    """

    directory: str
    step: int
    kind: str  # "full" or "incremental"
    base_step: Optional[int]
    blocked_s: float
    snapshot_s: Optional[float] = None
    total_s: Optional[float] = None
    bytes: int = 0
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
_kernels: "weakref.WeakKeyDictionary[Any, dict]" = weakref.WeakKeyDictionary()


# ------------------------------------------------------------------------------------------------------------------
# save
# ------------------------------------------------------------------------------------------------------------------
def save(plane, directory, *, step: Optional[int] = None, max_to_keep: Optional[int] = 3, block: bool = False,
         incremental: bool = False) -> SaveHandle:
    """Save the whole plane as step ``step`` (default: one past the newest step) of ``directory``; returns at once
    with a ``SaveHandle`` (``block=True``: after the step is on disk). See the module docstring."""
    directory = _directory(directory, "save()")
    if max_to_keep is not None and (not isinstance(max_to_keep, int) or isinstance(max_to_keep, bool) or
                                    max_to_keep < 1):
        raise ConfigError(f"save(): max_to_keep must be an int >= 1 or None (keep all), got {max_to_keep!r}")
    if step is not None and (not isinstance(step, (int, np.integer)) or isinstance(step, bool) or step < 0):
        raise ConfigError(f"save(): step must be an int >= 0 or None, got {step!r}")
    start_time = time.perf_counter()
    kernels = _plane_kernels(plane)
    shard_cap = plane.config.shard_capacity
    if incremental and _lineages.get(plane, {}).get(directory) is not None:
        # compile the increment kernel outside the plane's lock for the size an increment has now (and twice it)
        with plane._changed:
            counts = _counts(plane)
        plan = _delta_plan(_lineages[plane][directory], counts, shard_cap)
        if plan is not None:
            for rows_per_shard in {plan["rows_per_shard"], min(2 * plan["rows_per_shard"], shard_cap)}:
                kernels["delta_compiled"](rows_per_shard)
    with _dir_lock:
        on_disk = _steps_on_disk(directory, include_unfinished=False)
        newest = max([*on_disk, _assigned.get(directory, -1)], default=-1)
        if step is None:
            step = newest + 1
        elif step <= newest:
            raise ConfigError(f"save(): step {step} is not after the newest step {newest} of {directory}; steps only "
                              f"increase (pass step=None for the next one)")
        step = int(step)
        _assigned[directory] = step
        previous = _last_handle.get(directory)
        base = _lineages.get(plane, {}).get(directory) if incremental else None

        with plane._changed:
            locked = time.perf_counter()
            counts = _counts(plane)
            delta = None if base is None else _delta_plan(base, counts, shard_cap)
            if delta is None:
                snapshot = kernels["copy"](plane.state)
            else:
                snapshot = kernels["delta"](delta["rows_per_shard"])(
                    plane.state, np.asarray(delta["start"], np.int32), np.asarray(delta["count"], np.int32))
            blocked = time.perf_counter() - locked
        lineage = uuid.uuid4().hex if delta is None else base.lineage
        _lineages.setdefault(plane, {})[directory] = _Lineage(step, lineage, counts)

        handle = SaveHandle(directory=directory, step=step, kind="full" if delta is None else "incremental",
                            base_step=None if delta is None else base.step, blocked_s=blocked)
        _last_handle[directory] = handle
    meta = _metadata(plane, counts, lineage, delta, None if delta is None else base.step)
    thread = threading.Thread(target=_write, name=f"conduit-checkpoint-{step}",
                              args=(handle, plane, snapshot, meta, previous, max_to_keep, start_time))
    thread.start()  # not a daemon: an interpreter exit waits for the write to finish
    if block:
        handle.wait()
    return handle


def _counts(plane) -> tuple[int, ...]:
    """Items ever written to each shard (call under the plane's lock)."""
    cursor, laps = jax.device_get((plane.state.storage.cursor, plane.state.storage.laps))
    return tuple(int(l) * plane.config.shard_capacity + int(c) for c, l in zip(cursor, laps))


def _delta_plan(base: _Lineage, counts, shard_cap: int) -> Optional[dict]:
    """Which rows an increment on ``base`` holds, or None when it cannot be one (a shard wrapped all the way)."""
    written = [now - then for now, then in zip(counts, base.counts)]
    if len(written) != len(base.counts) or not all(0 <= w < shard_cap for w in written):
        return None
    rows_per_shard = min(1 << max(0, math.ceil(math.log2(max(max(written), 1)))), shard_cap)
    return {"start": [then % shard_cap for then in base.counts], "count": written, "rows_per_shard": rows_per_shard,
            "from_counts": list(base.counts)}


def _write(handle: SaveHandle, plane, snapshot, meta, previous, max_to_keep, start_time):
    try:
        snapshot = jax.block_until_ready(snapshot)
        handle.snapshot_s = time.perf_counter() - start_time
        if previous is not None:
            previous._done.wait()
        if handle.kind == "incremental" and handle.base_step not in _steps_on_disk(handle.directory):
            raise CheckpointError(f"incremental step {handle.step} of {handle.directory}: its base step "
                                  f"{handle.base_step} was not written (its save failed or it was deleted); take a "
                                  f"full save")
        arrays = _named_leaves(snapshot)
        digests = jax.device_get(_digests(arrays))
        meta["arrays"] = {name: {"shape": list(a.shape), "dtype": np.dtype(a.dtype).name,
                                 "digest": int(digests[name])} for name, a in arrays.items()}
        handle.bytes = int(sum(a.size * a.dtype.itemsize for a in arrays.values()))
        import orbax.checkpoint as ocp
        options = ocp.CheckpointManagerOptions(max_to_keep=None, enable_async_checkpointing=False, create=True,
                                               cleanup_tmp_directories=True)
        with ocp.CheckpointManager(handle.directory, options=options) as manager:
            saved = manager.save(handle.step, force=True, args=ocp.args.Composite(
                **{_ARRAYS: ocp.args.StandardSave(arrays), _META: ocp.args.JsonSave(meta)}))
            if not saved:
                raise CheckpointError(f"orbax did not save step {handle.step} to {handle.directory}")
            manager.wait_until_finished()
            del snapshot, arrays
            if max_to_keep is not None:
                _retain(manager, handle.directory, max_to_keep)
        handle.total_s = time.perf_counter() - start_time
    except BaseException as exc:  # reported by wait()
        handle.error = exc
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
    }
    if delta is not None:
        meta["delta"] = delta
    return meta


# ------------------------------------------------------------------------------------------------------------------
# kernels: snapshot copies, increments, digests
# ------------------------------------------------------------------------------------------------------------------
def _plane_kernels(plane) -> dict:
    kernels = _kernels.get(plane)
    if kernels is not None:
        return kernels
    config, shardings = plane.config, plane._shardings
    copy = jax.jit(lambda state: jax.tree_util.tree_map(jnp.copy, state), out_shardings=shardings)
    # compile outside the plane's lock, so the first save does not hold it while XLA compiles
    abstract = jax.tree_util.tree_map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
                                      _abstract_state(plane), shardings)
    copy.lower(abstract).compile()
    spec_axes = P(config.axes)
    small_shardings = dataclasses.replace(shardings, storage=dataclasses.replace(shardings.storage, rows=None))
    deltas = {}

    def delta(rows_per_shard: int):
        kernel = deltas.get(rows_per_shard)
        if kernel is None:
            def extract(rows, start, count):
                slots = (start[0] + lax.iota(jnp.int32, rows_per_shard)) % config.shard_capacity
                block = storage.gather(rows, slots)
                return jnp.where((lax.iota(jnp.int32, rows_per_shard) < count[0])[:, None], block, jnp.uint32(0))

            extract = jax.shard_map(extract, mesh=config.mesh, in_specs=(spec_axes, spec_axes, spec_axes),
                                    out_specs=spec_axes, check_vma=False)

            def kernel(state, start, count):
                small = dataclasses.replace(state, storage=dataclasses.replace(state.storage, rows=None))
                return {"state": jax.tree_util.tree_map(jnp.copy, small),
                        "delta": extract(state.storage.rows, start, count)}

            kernel = jax.jit(kernel, out_shardings={"state": small_shardings,
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
    kernels = {"copy": copy, "delta": delta, "delta_compiled": delta_compiled}
    _kernels[plane] = kernels
    return kernels


def _abstract_state(plane):
    config = plane.config
    return jax.eval_shape(functools.partial(replay.init, config, 0))


def _named_leaves(tree) -> dict[str, jax.Array]:
    """Every leaf of a state (or of a delta snapshot) by a stable name: 'storage.rows', 'sampler.levels.2', ..."""
    if isinstance(tree, dict) and "delta" in tree:
        out = _named_leaves(tree["state"])
        out[_DELTA] = tree["delta"]
        return out
    flat, _ = jax.tree_util.tree_flatten_with_path(tree)
    return {_key(path): leaf for path, leaf in flat}


def _key(path) -> str:
    return leaf_name(path).replace("/", ".").replace("[", "").replace("]", "")


def _as_words(x):
    dtype = np.dtype(x.dtype)
    if dtype == np.bool_:
        return x.astype(jnp.uint32)
    unsigned = {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32}[dtype.itemsize]
    x = x if dtype == unsigned else lax.bitcast_convert_type(x, unsigned)
    return x.astype(jnp.uint32)


@jax.jit
def _digests(arrays: dict) -> dict:
    """A 32-bit digest of each array: the uint32 sum of ``mix32(word ^ position hash)``; independent of sharding and
    of the order XLA sums in (integer addition mod 2**32), so a restore onto another mesh checks the same value."""
    out = {}
    for name, x in arrays.items():
        words = _as_words(x.reshape(-1))
        position = lax.iota(jnp.uint32, words.shape[0]) * jnp.uint32(0x9E3779B9) + jnp.uint32(0x7F4A7C15)
        out[name] = jnp.sum(samplers.mix32(words ^ position), dtype=jnp.uint32)
    return out


# ------------------------------------------------------------------------------------------------------------------
# restore
# ------------------------------------------------------------------------------------------------------------------
def restore(directory, *, step: Optional[int] = None, mesh: Optional[Mesh] = None,
            sampler: Optional[samplers.Sampler] = None, limiter: Optional[limits.Limiter] = None,
            spec=None, capacity: Optional[int] = None):
    """Rebuild a plane from step ``step`` (default: the newest finished step) of ``directory`` on ``mesh`` (default:
    ``default_mesh()``). The sampler and limiter are rebuilt from their recorded parameters unless given (then they
    must match the recorded ones; a sampler with a beta schedule must be given). ``spec`` and ``capacity``, when
    given, must match the checkpoint's. Raises ``CheckpointError`` for a missing, unfinished, corrupted or mismatching
    checkpoint."""
    from conduit_jax.plane import ExperienceDataPlane, default_mesh

    directory = _directory(directory, "restore()")
    where = f"restore({directory})"
    if not os.path.isdir(directory):
        raise CheckpointError(f"{where}: no such directory")
    steps = _steps_on_disk(directory)
    if not steps:
        unfinished = _steps_on_disk(directory, include_unfinished=True)
        raise CheckpointError(f"{where}: no finished checkpoint in the directory" +
                              (f" (unfinished saves of steps {unfinished} were interrupted)" if unfinished else ""))
    if step is None:
        step = steps[-1]
    elif step not in steps:
        raise CheckpointError(f"{where}: there is no finished step {step}; the directory has steps {steps}")
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
    sampler = _sampler(meta, sampler, where)
    limiter = _limiter(meta, limiter, where)
    staleness = meta.get("staleness")
    if staleness is not None:
        staleness = limits.Staleness(_field(staleness, "max_versions", int, where), _field(staleness, "key", str,
                                                                                           where))
    mesh = default_mesh() if mesh is None else mesh
    try:
        plane = ExperienceDataPlane(saved_spec, saved_capacity, sampler, limiter=limiter, staleness=staleness,
                                    mesh=mesh, cast=bool(meta.get("cast", False)))
    except ConfigError as exc:
        raise ConfigError(f"{where}: the checkpoint's plane cannot be built on this mesh: {exc}") from None
    saved_shards = _field(meta, "num_shards", int, where)
    abstract = _named_leaves(_abstract_state(plane))
    targets = {name: jax.ShapeDtypeStruct(abstract[name].shape, abstract[name].dtype, sharding=sharding)
               for name, sharding in _named_leaves(plane._shardings).items()}
    if _field(meta, "row_words", int, where) != plane.config.layout.row_words:
        raise CheckpointError(f"{where}: the checkpoint's rows have {meta['row_words']} words, the spec packs into "
                              f"{plane.config.layout.row_words}: the checkpoint is inconsistent")
    plane.state = None  # free the empty state before reading the saved one
    if saved_shards == plane.num_shards:
        state = _restore_same_layout(directory, chain, plane, targets, where)
        _lineages.setdefault(plane, {})[directory] = _Lineage(step, _field(meta, "lineage", str, where),
                                                              tuple(int(c) for c in meta["counts"]))
    else:
        state = _restore_relayout(directory, chain, plane, targets, saved_shards, where)
    plane.state = state
    return plane


def _restore_same_layout(directory, chain, plane, targets, where):
    """Same shard count: orbax reads each array straight into the new plane's sharding; increments are applied on
    the device, shard by shard."""
    first_step, first_meta = chain[0]
    last_step, last_meta = chain[-1]
    base = _read_arrays(directory, first_step, first_meta, targets if len(chain) == 1 else
                        {_ROWS: targets[_ROWS]}, where)
    rows = base[_ROWS]
    spec_axes = P(plane.config.axes)
    for inc_step, inc_meta in chain[1:]:
        delta_meta = inc_meta["delta"]
        d = delta_meta["rows_per_shard"]
        delta_target = {_DELTA: jax.ShapeDtypeStruct((plane.num_shards * d, plane.config.layout.row_words),
                                                     jnp.uint32, sharding=NamedSharding(plane.mesh, spec_axes))}
        delta = _read_arrays(directory, inc_step, inc_meta, delta_target, where)[_DELTA]
        rows = _apply_delta_kernel(plane.config, d)(rows, delta, np.asarray(delta_meta["start"], np.int32),
                                                    np.asarray(delta_meta["count"], np.int32))
    if len(chain) > 1:
        small = {name: t for name, t in targets.items() if name != _ROWS}
        arrays = _read_arrays(directory, last_step, last_meta, small, where)
        arrays[_ROWS] = rows
    else:
        arrays = base
    return _unflatten_like(_abstract_state(plane), arrays, where)


def _restore_relayout(directory, chain, plane, targets, saved_shards: int, where):
    """Another shard count: read the saved arrays on one device, reassemble and re-lay them out on the host, then
    place them with the new plane's shardings."""
    device = plane.mesh.devices.flat[0]
    first_step, first_meta = chain[0]
    last_step, last_meta = chain[-1]
    single = SingleDeviceSharding(device)

    def saved_targets(meta, names=None):
        out = {}
        for name, info in meta["arrays"].items():
            if names is None or name in names:
                out[name] = jax.ShapeDtypeStruct(tuple(info["shape"]), jnp.dtype(info["dtype"]), sharding=single)
        return out

    capacity, row_words = plane.capacity, plane.config.layout.row_words
    old_cap = capacity // saved_shards
    if len(chain) == 1:
        old = {k: np.asarray(v) for k, v in _read_arrays(directory, first_step, first_meta,
                                                          saved_targets(first_meta), where).items()}
        rows = old[_ROWS]
    else:
        rows = np.array(_read_arrays(directory, first_step, first_meta,
                                     saved_targets(first_meta, {_ROWS}), where)[_ROWS])
        for inc_step, inc_meta in chain[1:]:
            delta = np.asarray(_read_arrays(directory, inc_step, inc_meta,
                                            saved_targets(inc_meta, {_DELTA}), where)[_DELTA])
            d = inc_meta["delta"]["rows_per_shard"]
            for s, (start, count) in enumerate(zip(inc_meta["delta"]["start"], inc_meta["delta"]["count"])):
                slots = (start + np.arange(count)) % old_cap
                rows[s * old_cap + slots] = delta[s * d:s * d + count]
        old = {k: np.asarray(v) for k, v in _read_arrays(
            directory, last_step, last_meta,
            saved_targets(last_meta, set(last_meta["arrays"]) - {_DELTA}), where).items()}
        old[_ROWS] = rows
    if old[_ROWS].shape != (capacity, row_words):
        raise CheckpointError(f"{where}: storage rows have shape {old[_ROWS].shape}, expected {(capacity, row_words)}")
    new = _relayout(old, plane, saved_shards, targets, where)
    return jax.device_put(_unflatten_like(_abstract_state(plane), new, where), plane._shardings)


def _relayout(old: dict, plane, saved_shards: int, targets: dict, where: str) -> dict:
    """The saved arrays of an ``saved_shards``-shard plane, laid out for ``plane``'s shard count (host NumPy)."""
    capacity, shards = plane.capacity, plane.num_shards
    old_cap, new_cap = capacity // saved_shards, capacity // shards
    cursor, laps = old["storage.cursor"].astype(np.int64), old["storage.laps"].astype(np.int64)
    counts = laps * old_cap + cursor
    total = int(counts.sum())
    expected = [max(0, -(-(total - s) // saved_shards)) for s in range(saved_shards)]
    if counts.tolist() != expected or int(old["storage.next_shard"]) != total % saved_shards:
        raise CheckpointError(f"{where}: per-shard write counts {counts.tolist()} are not a round-robin deal of "
                              f"{total} items: the checkpoint is inconsistent")
    items = np.arange(max(0, total - capacity), total, dtype=np.int64)
    old_at = (items % saved_shards) * old_cap + (items // saved_shards) % old_cap
    new_at = (items % shards) * new_cap + (items // shards) % new_cap
    new_counts = np.array([max(0, -(-(total - s) // shards)) for s in range(shards)], np.int64)
    out = {}
    rows = np.zeros_like(old[_ROWS])
    rows[new_at] = old[_ROWS][old_at]
    out[_ROWS] = rows
    out["storage.cursor"] = (new_counts % new_cap).astype(np.int32)
    out["storage.laps"] = (new_counts // new_cap).astype(np.int32)
    out["storage.next_shard"] = np.asarray(total % shards, np.int32)
    sampler_state = _abstract_state(plane).sampler
    if isinstance(sampler_state, samplers.PriorityState):
        old_levels = sorted((n for n in old if n.startswith("sampler.levels.")), key=lambda n: int(n.split(".")[-1]))
        new_levels = sorted((n for n in targets if n.startswith("sampler.levels.")),
                            key=lambda n: int(n.split(".")[-1]))
        old_leaf_count = old[old_levels[-1]].shape[0] // saved_shards
        new_leaf_count = targets[new_levels[-1]].shape[0] // shards
        leaves = np.zeros((shards * new_leaf_count,), np.float32)
        leaves[(items % shards) * new_leaf_count + (items // shards) % new_cap] = \
            old[old_levels[-1]][(items % saved_shards) * old_leaf_count + (items // saved_shards) % old_cap]
        for name, level in zip(new_levels, _rebuild_levels(leaves, len(new_levels))):
            out[name] = level
        if "sampler.times_sampled" in targets:
            times = np.zeros((capacity,), np.int32)
            times[new_at] = old["sampler.times_sampled"][old_at]
            out["sampler.times_sampled"] = times
    elif isinstance(sampler_state, samplers.QueueState):
        delivered = total - int(old["sampler.pending"])
        if delivered < 0 or delivered % shards or delivered % saved_shards or \
                int(old["sampler.head"]) != (delivered // saved_shards) % old_cap:
            raise CheckpointError(f"{where}: the FIFO queue's head {int(old['sampler.head'])} and pending count "
                                  f"{int(old['sampler.pending'])} do not fit {total} ingested items on "
                                  f"{saved_shards} shards: the checkpoint is inconsistent")
        out["sampler.head"] = np.asarray((delivered // shards) % new_cap, np.int32)
    for name, target in targets.items():
        if name in out:
            continue
        if name not in old:
            raise CheckpointError(f"{where}: the checkpoint has no state leaf '{name}'")
        if target.shape != () or old[name].shape != ():
            raise CheckpointError(f"{where}: cannot re-lay out state leaf '{name}' of the {plane.sampler.name} "
                                  f"sampler from {saved_shards} to {shards} shards")
        out[name] = old[name]
    return out


def _rebuild_levels(leaves: np.ndarray, num_levels: int) -> list[np.ndarray]:
    """Sum-tree levels (root first) over the given leaf level: each node the float32 sum of its children."""
    levels = [jnp.asarray(leaves)]
    for _ in range(num_levels - 1):
        levels.append(jnp.sum(levels[-1].reshape(-1, sumtree.ARITY), axis=-1))
    return [np.asarray(level) for level in reversed(levels)]


@functools.lru_cache(maxsize=None)
def _apply_delta_kernel(config, rows_per_shard: int):
    spec_axes = P(config.axes)

    def apply(rows, delta, start, count):
        iota = lax.iota(jnp.int32, rows_per_shard)
        slots = jnp.where(iota < count[0], (start[0] + iota) % config.shard_capacity, config.shard_capacity)
        return rows.at[slots].set(delta, mode="drop")

    apply = jax.shard_map(apply, mesh=config.mesh, in_specs=(spec_axes,) * 4, out_specs=spec_axes, check_vma=False)
    return jax.jit(apply, donate_argnums=(0,), out_shardings=NamedSharding(config.mesh, spec_axes))


def _unflatten_like(template, arrays: dict, where: str):
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
        if not isinstance(delta, dict) or delta.get("from_counts") != previous.get("counts") or \
                len(delta.get("start", ())) != head["num_shards"] or len(delta.get("count", ())) != head["num_shards"] \
                or not isinstance(delta.get("rows_per_shard"), int):
            raise CheckpointError(f"{where}: incremental step {inc_step} does not continue its base step "
                                  f"{inc_meta['base_step']} (the write counts differ): the chain is inconsistent")
    return chain


def _read_meta(directory: str, step: int, where: str) -> dict:
    meta = _read_meta_file(directory, step)
    if isinstance(meta, Exception):
        raise CheckpointError(f"{where}: the metadata of step {step} cannot be read ({type(meta).__name__}: {meta}); "
                              f"the checkpoint is partial or corrupted") from meta
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        raise CheckpointError(f"{where}: step {step} is not a Conduit-JAX plane checkpoint")
    if meta.get("format_version") != FORMAT_VERSION:
        raise CheckpointError(f"{where}: step {step} has format version {meta.get('format_version')!r}; this version "
                              f"of conduit_jax reads version {FORMAT_VERSION}")
    if meta.get("kind") not in ("full", "incremental"):
        raise CheckpointError(f"{where}: step {step} has unknown kind {meta.get('kind')!r}")
    if not isinstance(meta.get("arrays"), dict) or not isinstance(meta.get("counts"), list):
        raise CheckpointError(f"{where}: the metadata of step {step} lacks its array list: the checkpoint is corrupted")
    return meta


def _read_meta_file(directory: str, step: int):
    """The JSON metadata of a step (read as plain JSON: never unpickled), or the exception that prevented it."""
    import orbax.checkpoint as ocp
    try:
        with ocp.CheckpointManager(directory, options=ocp.CheckpointManagerOptions(read_only=True)) as manager:
            return manager.restore(step, args=ocp.args.Composite(**{_META: ocp.args.JsonRestore()}))[_META]
    except Exception as exc:  # noqa: BLE001 - reported by the caller with context
        return exc


def _read_arrays(directory: str, step: int, meta: dict, targets: dict, where: str) -> dict:
    """Read ``targets`` (name -> ShapeDtypeStruct with sharding) of one step and check shapes and digests."""
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
    try:
        with ocp.CheckpointManager(directory, options=ocp.CheckpointManagerOptions(read_only=True)) as manager:
            restored = manager.restore(step, args=ocp.args.Composite(**{_ARRAYS: ocp.args.StandardRestore(full)}))
            arrays = dict(restored[_ARRAYS])
    except Exception as exc:  # noqa: BLE001
        raise CheckpointError(f"{where}: the arrays of step {step} cannot be read ({type(exc).__name__}: "
                              f"{str(exc)[:500]}); the checkpoint is partial or corrupted") from exc
    arrays = {name: arrays[name] for name in targets}
    digests = jax.device_get(_digests(arrays))
    bad = [name for name in arrays if int(digests[name]) != recorded[name].get("digest")]
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


def _sampler(meta, given, where):
    recorded = meta.get("sampler")
    if not isinstance(recorded, dict) or not isinstance(recorded.get("name"), str) or \
            not isinstance(recorded.get("params"), dict):
        raise CheckpointError(f"{where}: the metadata records no sampler")
    if given is not None:
        if not isinstance(given, samplers.Sampler):
            raise ConfigError(f"{where}: sampler must be a samplers.Sampler, got {type(given).__name__}")
        mine = {"name": given.name, "params": _params_json(given.params)}
        if json.loads(json.dumps(mine)) != recorded:
            raise CheckpointError(f"{where}: the checkpoint was saved with sampler {recorded['name']}"
                                  f"({_describe(recorded['params'])}), not the given {given.name}"
                                  f"({_describe(mine['params'])})")
        return given
    try:
        return samplers.from_params(recorded["name"], recorded["params"])
    except ConfigError as exc:
        raise CheckpointError(f"{where}: {exc}") from None
    except TypeError as exc:
        raise CheckpointError(f"{where}: the recorded sampler parameters do not fit samplers."
                              f"{recorded['name']}(): {exc}") from None


def _limiter(meta, given, where):
    recorded = meta.get("limiter")
    if not isinstance(recorded, dict) or not isinstance(recorded.get("name"), str) or \
            not isinstance(recorded.get("params"), dict):
        raise CheckpointError(f"{where}: the metadata records no limiter")
    if given is not None:
        if not isinstance(given, limits.Limiter):
            raise ConfigError(f"{where}: limiter must be a limits.Limiter, got {type(given).__name__}")
        mine = {"name": given.name, "params": _params_json(given.params)}
        if json.loads(json.dumps(mine)) != recorded:
            raise CheckpointError(f"{where}: the checkpoint was saved with limiter {recorded['name']}, not the given "
                                  f"{given.name} (the limiter's balance is kept in its own units)")
        return given
    try:
        return limits.from_params(recorded["name"], recorded["params"])
    except ConfigError as exc:
        raise CheckpointError(f"{where}: {exc}") from None
    except TypeError as exc:
        raise CheckpointError(f"{where}: the recorded limiter parameters do not fit {recorded['name']}: {exc}") \
            from None


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
def _directory(directory, where: str) -> str:
    if not isinstance(directory, (str, os.PathLike)):
        raise ConfigError(f"{where}: directory must be a path, got {type(directory).__name__}")
    return os.path.abspath(os.fspath(directory))


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
    return _steps_on_disk(_directory(directory, "all_steps()"))


def latest_step(directory) -> Optional[int]:
    steps = all_steps(directory)
    return steps[-1] if steps else None


def metadata(directory, step: Optional[int] = None) -> dict:
    """The JSON metadata of a step (default: the newest), e.g. to inspect a checkpoint without restoring it."""
    directory = _directory(directory, "metadata()")
    steps = _steps_on_disk(directory)
    if not steps:
        raise CheckpointError(f"metadata({directory}): no finished checkpoint in the directory")
    step = steps[-1] if step is None else step
    return _read_meta(directory, step, f"metadata({directory}, step={step})")
