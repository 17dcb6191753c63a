"""The pure data plane: one state pytree and the ingest / sample / update steps over it, mapped over shards.

``ReplayConfig`` is static (hashable) configuration; ``ReplayState`` holds every counter, so nothing lives on the
Python side that a checkpoint could miss. Each step is a pure function ``(config, state, ...) -> state'`` whose
per-shard body runs under ``jax.shard_map``; ``plane.py`` jits them, donates the state and validates input.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable, NamedTuple, Optional

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from conduit_jax import storage
from conduit_jax._pytree import replace, state_dataclass
from conduit_jax.errors import ConfigError, SpecError
from conduit_jax.limits import Limiter, LimiterState, Staleness
from conduit_jax.samplers import InsertView, Sampler, ShardView


@state_dataclass
class ReplayState:
    storage: storage.StorageState
    sampler: Any
    limiter: LimiterState
    policy_version: jax.Array  # int32[]: the learner's current policy version (see limits.Staleness)
    stale_draws: jax.Array  # int32[]: drawn rows masked out because their item was too old

    def replace(self, **changes) -> "ReplayState":
        """A copy with the given fields changed (``storage=None`` leaves a tree without the ring)."""
        return replace(self, **changes)


class Delivery(NamedTuple):
    """A sampled batch: ``data`` in the spec's structure with a leading batch axis (and a time axis for sequences),
    ``ids`` int32[B, 2] as (global row, generation) of each item or window start, importance weights float32[B] for
    prioritized samplers (else None), and for padded sequences ``mask`` bool[B, T] (else None).

    ``valid`` (bool[], from the functional API's ``sample``): False when the state could not deliver a batch (too few
    items, or the rate limiter refused); the state is then returned unchanged, ``ids`` are -1, ``weights`` 0, and
    ``data`` is not a delivery (do not learn from it). None from the plane, which refuses such a call on the host."""

    data: Any
    ids: jax.Array
    weights: Optional[jax.Array]
    mask: Optional[jax.Array] = None
    valid: Optional[jax.Array] = None


class ReplayConfig(NamedTuple):
    layout: storage.RowLayout
    sampler: Sampler
    limiter: Limiter
    staleness: Optional[Staleness]
    mesh: Mesh
    axes: tuple[str, ...]
    capacity: int

    @property
    def num_shards(self) -> int:
        size = 1
        for axis in self.axes:
            size *= self.mesh.shape[axis]
        return size

    @property
    def shard_capacity(self) -> int:
        return self.capacity // self.num_shards

    @property
    def streams_per_shard(self) -> int:
        """Streams interleaved in each shard's ring (see ``storage.ring_row``)."""
        return storage.streams_per_shard(self.sampler.streams, self.num_shards)

    def ring_row(self, slots):
        """The rows of a shard's ring that hold ``slots``."""
        return storage.ring_row(slots, self.streams_per_shard, self.shard_capacity)


DEFAULT_AXIS = "shard"


def default_mesh(num_devices: Optional[int] = None, axis: str = DEFAULT_AXIS) -> Mesh:
    """A 1-D mesh over the first ``num_devices`` local devices (all by default), axis type Auto."""
    devices = jax.local_devices()
    num = len(devices) if num_devices is None else num_devices
    if not isinstance(num, (int, np.integer)) or isinstance(num, bool) or not 1 <= num <= len(devices):
        raise ConfigError(f"default_mesh(): num_devices must be in [1, {len(devices)}], got {num_devices!r} (an int: "
                          f"how many local devices)")
    num = int(num)
    if not isinstance(axis, str):
        raise ConfigError(f"default_mesh(): axis must be a str (the mesh axis name), got {axis!r}")
    return jax.make_mesh((num,), (axis,), axis_types=(AxisType.Auto,), devices=devices[:num])


def init(config: ReplayConfig, seed: int) -> ReplayState:
    """Empty state (global arrays; works under ``jax.eval_shape``)."""
    return ReplayState(
        storage=storage.init(config.layout, config.capacity, config.num_shards),
        sampler=config.sampler.init(config.capacity, config.num_shards, seed),
        limiter=config.limiter.init(),
        policy_version=jnp.zeros((), jnp.int32),
        stale_draws=jnp.zeros((), jnp.int32),
    )


def partition_specs(config: ReplayConfig) -> ReplayState:
    """One convention for the whole state: 0-d leaves are replicated, every other leaf is per shard (shard-major on
    its first axis) and split over the shard axes."""
    abstract = jax.eval_shape(functools.partial(init, config, 0))
    return jax.tree_util.tree_map(lambda leaf: P() if leaf.ndim == 0 else P(config.axes), abstract)


def shardings(config: ReplayConfig) -> ReplayState:
    return jax.tree_util.tree_map(lambda spec: NamedSharding(config.mesh, spec), partition_specs(config),
                                  is_leaf=lambda x: isinstance(x, P))


def _shard_mapped(config: ReplayConfig, fn, in_specs, out_specs):
    return jax.shard_map(fn, mesh=config.mesh, in_specs=in_specs, out_specs=out_specs, check_vma=False)


def _shard_index(config: ReplayConfig):
    return lax.axis_index(config.axes) if config.num_shards > 1 else jnp.zeros((), jnp.int32)


def _total(config: ReplayConfig, x):
    return lax.psum(x, config.axes) if config.num_shards > 1 else x


def _shard_view(config: ReplayConfig, st: storage.StorageState) -> ShardView:
    cursor, laps = st.cursor[0], st.laps[0]
    count = storage.shard_count(cursor, laps, config.shard_capacity)
    return ShardView(config.num_shards, config.shard_capacity, config.axes, _shard_index(config), cursor, laps,
                     _total(config, count))


# ------------------------------------------------------------------------------------------------------------------
# ingest
# ------------------------------------------------------------------------------------------------------------------
def ingest(config: ReplayConfig, state: ReplayState, batch, n, *, packed: bool = False,
           update_before: Optional[tuple] = None, then_update: Optional[tuple] = None) -> ReplayState:
    """Write the first ``n`` items of ``batch`` (padded to ``shards * k`` rows, replicated) into the rings. ``batch``
    is a pytree in the spec's structure, or with ``packed`` rows already packed (uint32[shards * k, row_words], or
    those bytes as uint8[shards * k, row_bytes] for a byte ring: ``RowLayout.to_ring``). ``update_before`` /
    ``then_update`` (at most one): a priority update ``(ids, priorities, valid)`` applied before / after the write, as
    ``update`` would be (in one pass over the sampler's index where the sampler has ``update_then_insert`` /
    ``insert_then_update``: two passes over a sum tree in one kernel made XLA:CPU copy every level twice).

    Each shard takes its round-robin share of the batch, packs it and writes it at its own cursor: no item is
    written twice and no shard waits for another.
    """
    specs = partition_specs(config)
    if update_before is not None and then_update is not None:
        raise ConfigError("replay.ingest(): give update_before or then_update, not both")
    if update_before is not None and config.sampler.update_then_insert is None:
        state = dataclasses.replace(state, sampler=update(config, state, *update_before))
        return ingest(config, state, batch, n, packed=packed)
    if then_update is not None and config.sampler.insert_then_update is None:
        written = ingest(config, state, batch, n, packed=packed)
        return dataclasses.replace(written, sampler=update(config, written, *then_update))

    def per_shard(state: ReplayState, batch, n, *updating):
        st = state.storage
        mine, count = storage.deal(batch, st.next_shard, n, _shard_index(config), config.num_shards)
        block = config.layout.to_ring(mine) if packed else config.layout.pack_ring(mine)
        cursor, laps = st.cursor[0], st.laps[0]
        rows, new_cursor, new_laps = storage.write(st.rows, cursor, laps, block, count, config.streams_per_shard)
        k = block.shape[0]
        slots = (cursor + lax.iota(jnp.int32, k)) % config.shard_capacity
        view = InsertView(config.num_shards, config.shard_capacity, config.axes, slots, lax.iota(jnp.int32, k) < count,
                          n, cursor, laps,
                          lambda name, at: config.layout.read_leaf(rows, name, config.ring_row(at)))
        written = storage.StorageState(rows=rows, cursor=new_cursor[None], laps=new_laps[None],
                                       next_shard=(st.next_shard + n) % config.num_shards)
        if not updating:
            sampler = config.sampler.on_insert(state.sampler, view)
        elif update_before is not None:
            sampler = config.sampler.update_then_insert(state.sampler, _shard_view(config, st), view, *updating)
        else:
            sampler = config.sampler.insert_then_update(state.sampler, view, _shard_view(config, written), *updating)
        return ReplayState(storage=written, sampler=sampler, limiter=config.limiter.on_insert(state.limiter, n),
                           policy_version=state.policy_version, stale_draws=state.stale_draws)

    updating = tuple(update_before if update_before is not None else then_update or ())
    return _shard_mapped(config, per_shard, (specs, P(), P()) + (P(),) * len(updating), specs)(state, batch, n,
                                                                                            *updating)


# ------------------------------------------------------------------------------------------------------------------
# sample
# ------------------------------------------------------------------------------------------------------------------
CACHE_RESIDENT_BYTES = 16 << 20  # a ring this small stays in the last-level cache while it is sampled


def check_batch(config: ReplayConfig, batch, where: str, cast: bool = False) -> int:
    """The item count of ``batch`` (a pytree of the spec's leaves with a leading item axis); SpecError naming the leaf
    and what was expected unless it matches the spec and holds whole steps of the sampler's streams."""
    return checked_batch(config, batch, where, cast)[1]


def checked_batch(config: ReplayConfig, batch, where: str, cast: bool = False) -> tuple[list, int]:
    """``check_batch``, returning the batch's leaves too (``ExperienceSpec.checked_leaves``)."""
    leaves, n = config.layout.spec.checked_leaves(batch, cast=cast, where=where)
    streams, name = config.sampler.streams, config.sampler.name
    if n % streams:
        raise SpecError(f"{where}: the {name} sampler takes whole steps of {streams} streams (time-major), so a batch "
                        f"must hold a multiple of {streams} items; got {n}")
    return leaves, n


def check_batches(config: ReplayConfig, batches, where: str = "sample()") -> None:
    """ConfigError unless ``batches`` is None or a count of batches ``sample`` can draw at once for this sampler."""
    if batches is None:
        return
    if not isinstance(batches, int) or isinstance(batches, bool) or batches < 1:
        raise ConfigError(f"{where}: batches must be an int >= 1 or None, got {batches!r}")
    if config.sampler.weigh is not None:
        raise ConfigError(f"{where}: the {config.sampler.name} sampler delivers importance weights, which depend on "
                          f"each draw's step; draw its batches one at a time (batches=None)")


def sample(config: ReplayConfig, state: ReplayState, batches: Optional[int] = None) -> tuple[ReplayState, Delivery]:
    """Draw one batch; returns the new state and the delivery. The new state's storage is ``state.storage`` itself:
    jit callers must not return it (an unchanged buffer returned from a jitted step is copied whole), so the shell's
    kernel returns ``new_state.replace(storage=None)`` and reattaches the storage.

    The batch comes back sharded over the shard axes: shard s holds rows ``[s*B/S, (s+1)*B/S)``.

    ``batches=k`` draws k batches at once, exactly the draws of k successive calls, with a leading [k] axis on every
    field of the delivery. The selections run one after the other, then every batch is gathered in one pass (a PPO
    epoch of minibatches: one gather per leaf instead of k). Samplers with importance weights are not supported
    there: their weights depend on each draw's step."""
    specs = partition_specs(config)
    layout, num_shards, window = config.layout, config.num_shards, config.sampler.window
    time_axis = config.sampler.time_axis
    check_batches(config, batches)
    lead = () if batches is None else (batches,)
    # One shard: gather each leaf straight from its words of the ring (every byte copied once) when each leaf's read
    # is sequential (wide rows such as image frames, windows of consecutive rows) or the ring is cache-resident (PPO
    # rollouts); narrow single rows of a ring in DRAM are gathered whole (one random access per item instead of one
    # per leaf) and unpacked. Several shards: packed rows with ids and weights appended travel in one reduce-scatter.
    ring_bytes = config.shard_capacity * layout.row_bytes
    direct = num_shards == 1 and (layout.row_bytes >= 1024 or time_axis or ring_bytes <= CACHE_RESIDENT_BYTES)

    def per_shard(state: ReplayState):
        st = state.storage
        view = _shard_view(config, st)
        if batches is None:
            sampler_state, sel = config.sampler.sample(state.sampler, view)
        else:  # the selections of k successive draws, stacked
            sampler_state, sel = lax.scan(lambda s, _: config.sampler.sample(s, view), state.sampler, None,
                                          length=batches)
        slots = sel.slots  # lead + [B / S or B]
        if time_axis:  # a window's steps are `streams / S` slots apart in the owner's ring, oldest first
            stride = config.streams_per_shard
            steps = (slots[..., None] + lax.iota(jnp.int32, window) * stride) % config.shard_capacity
        else:
            steps = slots
        steps = config.ring_row(steps)
        extra = [view.shard_index * config.shard_capacity + slots,
                 storage.slot_generation(view.cursor, view.laps, slots)]
        if config.sampler.weigh is not None:
            extra.append(lax.bitcast_convert_type(sel.probability.astype(jnp.float32), jnp.int32))
        if sel.keep is not None:
            extra.append(sel.keep.astype(jnp.int32))
        extra = lax.bitcast_convert_type(jnp.stack(extra, axis=-1), jnp.uint32)
        if direct:
            return sampler_state, layout.gather_leaves(st.rows, steps), extra
        rows = layout.to_words(storage.gather(st.rows, steps)).reshape(*slots.shape, window * layout.row_words)
        if sel.owner is not None and num_shards > 1:
            # every shard drew the same global batch; owners keep their rows, a reduce-scatter deals the blocks
            packed = jnp.concatenate([rows, extra], axis=-1)
            packed = jnp.where((sel.owner == view.shard_index)[..., None], packed, jnp.uint32(0))
            packed = lax.psum_scatter(packed, config.axes, scatter_dimension=len(lead), tiled=True)
            rows, extra = packed[..., :rows.shape[-1]], packed[..., rows.shape[-1]:]
        data = layout.unpack(rows.reshape(*rows.shape[:-1], window, layout.row_words) if time_axis else rows)
        return sampler_state, data, extra

    batch_spec = P(*([None] * len(lead)), config.axes)
    batch_specs = jax.tree_util.tree_map(lambda _: batch_spec, layout.spec.structs)
    sampler_state, data, extra = _shard_mapped(config, per_shard, (specs,),
                                               (specs.sampler, batch_specs, batch_spec))(state)
    ids = lax.bitcast_convert_type(extra[..., :2], jnp.int32)
    weights = mask = None
    column = 2
    if config.sampler.weigh is not None:
        probability = lax.bitcast_convert_type(extra[..., column], jnp.float32)
        weights = config.sampler.weigh(sampler_state, probability, size(config, state), config.shard_capacity)
        column += 1
    if config.sampler.mask is not None:  # per window: the leading axes flattened into one batch axis
        flat = jax.tree_util.tree_map(lambda x: x.reshape(-1, *x.shape[len(lead) + 1:]), data)
        mask = config.sampler.mask(flat).reshape(*lead, -1, window)
    if extra.shape[-1] > column:  # the sampler marked draws that are not deliveries
        keep = extra[..., column] != 0
        mask = keep if mask is None else mask & keep[..., None]
    stale_draws = state.stale_draws
    if config.staleness is not None:
        fresh = is_fresh(config, data, state.policy_version)
        first_fresh = fresh[..., 0] if time_axis else fresh
        stale_draws = stale_draws + jnp.sum(~first_fresh).astype(jnp.int32)
        mask = fresh if mask is None else mask & fresh
    new_state = ReplayState(state.storage, sampler_state,
                            config.limiter.on_sample(state.limiter, config.sampler.batch_size * (batches or 1)),
                            state.policy_version, stale_draws)
    return new_state, Delivery(data, ids, weights, mask)


def is_fresh(config: ReplayConfig, data, policy_version):
    """bool per delivered item (per step of a window): its policy version is at most ``staleness.max_versions``
    behind ``policy_version``."""
    version = data
    for part in config.staleness.key.split("/"):
        version = version[part]
    return version >= policy_version - config.staleness.max_versions


# ------------------------------------------------------------------------------------------------------------------
# priority update
# ------------------------------------------------------------------------------------------------------------------
def update(config: ReplayConfig, state: ReplayState, ids, priorities, valid):
    """Apply priorities to the items named by ``ids`` (int32[m, 2]) where ``valid``; returns the new sampler state.
    Each shard applies the ids it owns; an id whose slot has been rewritten since is ignored and counted."""
    specs = partition_specs(config)

    def per_shard(state: ReplayState, ids, priorities, valid):
        view = _shard_view(config, state.storage)
        return config.sampler.update(state.sampler, view, ids, priorities, valid)

    return _shard_mapped(config, per_shard, (specs, P(), P(), P()), specs.sampler)(state, ids, priorities, valid)


def retire(config: ReplayConfig, state: ReplayState, ids, valid):
    """Never draw the items named by ``ids`` (int32[m, 2]) again where ``valid``: their mass becomes 0 until their
    slot is rewritten (an id whose slot was rewritten since names another item and is ignored). Returns the new
    sampler state. A sampler with ``retire_slots`` (the prioritized ones) touches only those items' leaves and their
    ancestors, O(m log capacity); otherwise each shard rebuilds its index from the leaves once, O(capacity)."""
    specs = partition_specs(config)

    def per_shard(state: ReplayState, ids, valid):
        view = _shard_view(config, state.storage)
        rows, generation = ids[:, 0], ids[:, 1]
        slot = rows % view.shard_capacity
        live = generation == storage.slot_generation(view.cursor, view.laps, slot)
        mine = valid & live & (rows // view.shard_capacity == view.shard_index)
        if config.sampler.retire_slots is not None:
            return config.sampler.retire_slots(state.sampler, jnp.where(mine, slot, 0), mine)
        stale = jnp.zeros((view.shard_capacity,), jnp.bool_)
        stale = stale.at[jnp.where(mine, slot, view.shard_capacity)].set(True, mode="drop")
        return config.sampler.retire(state.sampler, stale)

    return _shard_mapped(config, per_shard, (specs, P(), P()), specs.sampler)(state, ids, valid)


def read(config: ReplayConfig, state: ReplayState, rows):
    """The items stored in global ``rows`` (int32[m], the first column of their ids), replicated: each shard
    gathers the rows it owns and one sum combines them (the others contribute zeros). A row out of range reads as
    zeros."""
    specs = partition_specs(config)
    layout = config.layout

    def per_shard(state: ReplayState, rows):
        st = state.storage
        local = rows - _shard_index(config) * config.shard_capacity
        mine = (local >= 0) & (local < config.shard_capacity)
        at = config.ring_row(jnp.where(mine, local, 0))
        words = layout.to_words(storage.gather(st.rows, at))
        words = jnp.where(mine[:, None], words, jnp.uint32(0))
        return lax.psum(words, config.axes) if config.num_shards > 1 else words

    words = _shard_mapped(config, per_shard, (specs, P()), P())(state, rows)
    return layout.unpack(words)


def item_ids(config: ReplayConfig, items) -> np.ndarray:
    """Host NumPy: the id (global row, generation) of the ``items[i]``-th item ever ingested (0-based). Items are
    dealt round-robin: item g goes to shard ``g % S`` as that shard's ``g // S``-th item."""
    given = np.asarray(items)
    if not np.issubdtype(given.dtype, np.integer) or (given.size and given.min() < 0):
        raise ConfigError(f"item_ids(): items must be ints >= 0 (the g-th item ever ingested), got "
                          f"{given.dtype}{list(given.shape)}" + (f" holding {given.min()}" if given.size and
                                                                 np.issubdtype(given.dtype, np.number) else ""))
    items = given.astype(np.int64)
    return np.stack([item_rows(config, items), items // config.num_shards // config.shard_capacity + 1],
                    axis=-1).astype(np.int32)


def item_rows(config: ReplayConfig, items) -> np.ndarray:
    """Host NumPy: the global row of the ``items[i]``-th item ever ingested (``item_ids``' first column) as int32, -1
    where ``items[i]`` is negative (no item: the end of a link). Unchecked, for a host's bookkeeping per call
    (``item_ids`` checks its input)."""
    items = np.asarray(items)
    shards, per_shard = config.num_shards, config.shard_capacity
    rows = items % per_shard if shards == 1 else (items % shards) * per_shard + (items // shards) % per_shard
    return np.where(items >= 0, rows, -1).astype(np.int32)


# ------------------------------------------------------------------------------------------------------------------
# policy version
# ------------------------------------------------------------------------------------------------------------------
def set_policy_version(config: ReplayConfig, state: ReplayState, version) -> ReplayState:
    """Move the current policy version; samplers with a priority index retire the items that became too old."""
    state = dataclasses.replace(state, policy_version=version)
    if config.staleness is None or config.sampler.retire is None:
        return state
    specs = partition_specs(config)
    oldest = version - config.staleness.max_versions

    def per_shard(state: ReplayState):
        st = state.storage
        slots = lax.iota(jnp.int32, config.shard_capacity)
        versions = config.layout.read_leaf(st.rows, config.staleness.key, config.ring_row(slots))
        return config.sampler.retire(state.sampler, versions < oldest)

    sampler_state = _shard_mapped(config, per_shard, (specs,), specs.sampler)(state)
    return dataclasses.replace(state, sampler=sampler_state)


# ------------------------------------------------------------------------------------------------------------------
# host-side status: the few scalars the shell needs to refuse a call before it runs
# ------------------------------------------------------------------------------------------------------------------
def size(config: ReplayConfig, state: ReplayState):
    """Valid items in the whole buffer (global computation over the per-shard counters)."""
    counts = storage.shard_count(state.storage.cursor, state.storage.laps, config.shard_capacity)
    return jnp.sum(counts)


def deliverable(config: ReplayConfig, state: ReplayState):
    """What ``sample()`` can draw from now, compared with the sampler's ``min_items``: the stored items, or what the
    sampler's own index says (undelivered items of a queue, windows or items that still have mass)."""
    n = size(config, state)
    return n if config.sampler.deliverable is None else config.sampler.deliverable(state.sampler, n)


def status(config: ReplayConfig, state: ReplayState) -> dict[str, jax.Array]:
    out = {"size": size(config, state), "deliverable": deliverable(config, state)}
    ignored = getattr(state.sampler, "ignored_updates", None)
    if ignored is not None:
        out["priority_updates_ignored"] = ignored
    out["limiter_balance"] = state.limiter.balance
    out["policy_version"] = state.policy_version
    out["stale_draws"] = state.stale_draws
    return out


# -- pieces every caller of these steps shares: the padding rule, placement inside a kernel, state checks -----------
MAX_CAPACITY = 2**31 - 1  # items one buffer holds at most: row ids and counters are int32


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


class StateTypes(NamedTuple):
    """What a state of one configuration looks like: its type, its structure and each leaf's (shape, dtype)."""

    leaves: list
    treedef: Any
    kind: type = ReplayState

    @classmethod
    def of(cls, config: ReplayConfig) -> "StateTypes":
        return cls.of_init(functools.partial(init, config, 0))

    @classmethod
    def of_init(cls, make: Callable[[], Any]) -> "StateTypes":
        """From a function that builds a fresh state (traced, not run): e.g. a rollout buffer's ``init``."""
        abstract = jax.eval_shape(make)
        abstract_leaves, treedef = jax.tree_util.tree_flatten(abstract)
        return cls([(leaf.shape, leaf.dtype) for leaf in abstract_leaves], treedef, type(abstract))

    def check(self, tree, where: str = "state") -> list:
        """The leaves of ``tree``; ConfigError unless it is a state of this configuration (structure, shapes and
        dtypes; works on tracers too). Cheap when it is (a fused loop passes the state on every step)."""
        if not isinstance(tree, self.kind):
            raise ConfigError(f"{where}: state must be a {self.kind.__name__} (from buffer.init() or plane.state), "
                              f"got {type(tree).__name__}")
        leaves, treedef = jax.tree_util.tree_flatten(tree)
        if treedef != self.treedef:
            raise ConfigError(f"{where}: expected a {self.kind.__name__} of this buffer's configuration, "
                              f"{self.treedef}; got {treedef} (a state of another sampler or spec?)")
        for index, (leaf, (shape, dtype)) in enumerate(zip(leaves, self.leaves)):
            if getattr(leaf, "shape", None) != shape or getattr(leaf, "dtype", None) != dtype:
                path = jax.tree_util.keystr(jax.tree_util.tree_flatten_with_path(tree)[0][index][0])
                raise ConfigError(f"{where}: leaf {path} must be {dtype}{list(shape)}, got "
                                  f"{getattr(leaf, 'dtype', None)}{list(np.shape(leaf))} (a state of another "
                                  f"capacity, spec, sampler or mesh?)")
        return leaves
