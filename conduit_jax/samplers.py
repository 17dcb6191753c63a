"""Samplers: which stored items a batch reads. Each constructor returns a ``Sampler`` of pure functions.

A sampler's kernels run per shard (inside ``shard_map``) and see a ``ShardView`` of their own shard. A selection is one
of two kinds:
  * global draws (``owner`` set): every shard computes the same ``batch_size`` draws over the whole buffer, each
    naming the shard that owns it; owners gather their rows and one reduce-scatter hands each shard its block of the
    batch. The distribution over the whole buffer is exactly the declared one, however many shards.
  * shard-local (``owner`` None): each shard reads ``batch_size // shards`` of its own rows (FIFO, where round-robin
    dealing makes per-shard order the global insertion order).

Random numbers come from a counter hashed with the seed (one fused integer kernel, no ``jax.random`` key splitting,
which costs ~18 kernels per call on XLA:CPU). The counter lives in the sampler state, so a restored plane continues
the same stream.
"""

from __future__ import annotations

import functools
from typing import Any, Callable, NamedTuple, Optional

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from conduit_jax import storage, sumtree
from conduit_jax._pytree import replace, state_dataclass
from conduit_jax.errors import ConfigError, constructor_kwargs


class ShardView(NamedTuple):
    """What a per-shard sampler kernel knows about its shard and the buffer."""

    num_shards: int  # static
    shard_capacity: int  # static
    axes: tuple[str, ...]  # static: mesh axes the capacity is sharded over
    shard_index: jax.Array  # int32[]
    cursor: jax.Array  # int32[]: this shard's write cursor
    laps: jax.Array  # int32[]: this shard's completed laps
    size: jax.Array  # int32[]: valid items in the whole buffer


class InsertView(NamedTuple):
    """What ``on_insert`` learns about one ingest on this shard: ``slots[i]`` received ``items[i]`` where ``valid``."""

    num_shards: int
    shard_capacity: int
    axes: tuple[str, ...]
    slots: jax.Array  # int32[k]: ring slots of this shard's rows of the batch (padding rows included)
    valid: jax.Array  # bool[k]: rows that hold an item (the rest is padding)
    total: jax.Array  # int32[]: items the whole batch held
    cursor: jax.Array  # int32[]: this shard's cursor before the write
    laps: jax.Array  # int32[]: this shard's laps before the write
    read: Callable[[str, jax.Array], jax.Array]  # read(leaf name, slots): stored values after the write


class ItemMoves(NamedTuple):
    """Where every stored item goes when a state is laid out for another shard count (a checkpoint restored onto
    another mesh). Round-robin dealing puts item g (its insertion index) at shard ``g % S``, slot ``(g // S) %
    (capacity / S)``; the stored items are always the last ``min(total, capacity)`` ones. Host NumPy."""

    items: np.ndarray  # int64[n]: insertion index of every stored item, oldest first
    total: int  # items ever inserted
    saved_shards: int
    shards: int
    capacity: int

    def saved_at(self, per_shard: int) -> np.ndarray:
        """Each item's index in a saved per-item array laid out shard-major with ``per_shard`` entries a shard."""
        return _dealt(self.items, self.saved_shards, self.capacity, per_shard)

    def new_at(self, per_shard: int) -> np.ndarray:
        """Each item's index in the new layout's array of ``per_shard`` entries a shard."""
        return _dealt(self.items, self.shards, self.capacity, per_shard)


def _dealt(items: np.ndarray, shards: int, capacity: int, per_shard: int) -> np.ndarray:
    return (items % shards) * per_shard + (items // shards) % (capacity // shards)


class Selection(NamedTuple):
    slots: jax.Array  # int32[B] (global draws) or int32[B // shards] (shard-local): slots in the owner's ring
    owner: Optional[jax.Array]  # int32[B]: shard that owns each draw, or None for shard-local selections
    probability: Optional[jax.Array]  # float32[B]: P(draw) for weighted samplers (becomes importance weights), or None
    keep: Optional[jax.Array] = None  # bool[B]: False for draws that are not deliveries (over max_times_sampled)


class Sampler(NamedTuple):
    """A named sampling policy: static config closed over, state explicit.

    init(capacity, num_shards, seed) -> state (global; works under ``jax.eval_shape``). Placement convention: 0-d
        leaves are replicated, every other leaf is per shard, laid out shard-major on its first axis.
    on_insert(state, InsertView) -> state                          (per shard)
    sample(state, ShardView) -> (state, Selection)                 (per shard)
    update(state, ShardView, ids, priorities, valid) -> state      (per shard; None for samplers without priorities)
    update_then_insert(state, ShardView, InsertView, ids, priorities, valid) -> state   (per shard; optional)
    insert_then_update(state, InsertView, ShardView, ids, priorities, valid) -> state   (per shard; optional):
        ``update`` and ``on_insert`` in that order (the ShardView: the storage before the insert, resp. after it),
        equal to the two in turn, in one pass over the sampler's index (the prioritized samplers: two sum-tree
        passes in one kernel made XLA:CPU copy every level twice)
    weigh(state, probability, size, shard_capacity) -> importance weights (global; None when selections carry no
        weights; ``shard_capacity``, static, is each shard's ring: slots of a per-shard index past it hold no item)
    deliverable(state, size) -> int32[]: what sample() can draw from now, compared with min_items (global; None
        when it is simply the stored item count, which never decreases: the shell then counts it on the host)
    consumes: delivery removes items (queues): ingest refuses to overwrite undelivered ones
    sampling_retires: a non-consuming sampler whose draws can lower ``deliverable`` (items retired after
        ``max_times_sampled`` deliveries); otherwise only inserts and retirements change it
    relayout(saved, ItemMoves, target) -> leaves: the state laid out for another shard count, on the host. ``saved``
        and the result map leaf names ('levels.0', 'head') to NumPy arrays, ``target`` names to the new layout's
        ``jax.ShapeDtypeStruct``; leaves it leaves out carry over unchanged (0-d only). None: no per-item state.
    """

    name: str
    batch_size: int
    min_items: int  # sample() needs available >= min_items
    init: Callable[[int, int, int], Any]
    on_insert: Callable[[Any, InsertView], Any]
    sample: Callable[[Any, ShardView], tuple[Any, Selection]]
    update: Optional[Callable[..., Any]] = None
    deliverable: Optional[Callable[[Any, jax.Array], jax.Array]] = None
    consumes: bool = False
    sampling_retires: bool = False
    weigh: Optional[Callable[[Any, jax.Array, jax.Array, int], jax.Array]] = None
    retire: Optional[Callable[[Any, jax.Array], Any]] = None  # (state, stale bool[shard capacity]) -> state, per shard
    # (state, slots int32[m], valid bool[m]) -> state, per shard: ``retire`` for a few named slots, without O(capacity)
    retire_slots: Optional[Callable[[Any, jax.Array, jax.Array], Any]] = None
    params: tuple = ()  # ((argument, value), ...) of the constructor call: rebuilds the sampler from a checkpoint
    update_then_insert: Optional[Callable[..., Any]] = None
    insert_then_update: Optional[Callable[..., Any]] = None
    window: int = 1  # steps per delivered sequence
    time_axis: bool = False  # deliveries carry a time axis [B, window, ...] (sequences, even of length 1)
    streams: int = 1  # environments per ingest step; batches hold multiples of it
    needs: tuple[str, ...] = ()  # leaves the spec must have (boolean episode ends)
    mask: Optional[Callable[[Any], jax.Array]] = None  # data [B, T, ...] -> bool[B, T] valid-step mask
    relayout: Optional[Callable[[dict, ItemMoves, dict], dict]] = None


# ------------------------------------------------------------------------------------------------------------------
# Counter-based random numbers
# ------------------------------------------------------------------------------------------------------------------
def mix32(x):
    """A 32-bit integer finaliser (xorshift-multiply, 'lowbias32' constants): a bijection with good avalanche."""
    x = x.astype(jnp.uint32)
    x = x ^ (x >> 16)
    x = x * jnp.uint32(0x7FEB352D)
    x = x ^ (x >> 15)
    x = x * jnp.uint32(0x846CA68B)
    return x ^ (x >> 16)


def random_bits(key, counter, n: int, stream: int = 0):
    """``n`` pseudo-random uint32 for call number ``counter`` of the stream ``(key, stream)``."""
    base = mix32(mix32(counter.astype(jnp.uint32) ^ key) + jnp.uint32((0x9E3779B9 * (stream + 1)) & 0xFFFFFFFF))
    return mix32(base + lax.iota(jnp.uint32, n) * jnp.uint32(0x632BE5AB))


def random_below(bits, n):
    """Map uint32 bits to [0, n). Modulo bias is at most n / 2**32 relative (2e-4 at a million items)."""
    return (bits % jnp.maximum(n, 1).astype(jnp.uint32)).astype(jnp.int32)


def random_unit(bits):
    """Map uint32 bits to float32 in [0, 1) with 24 bits of resolution."""
    return (bits >> 8).astype(jnp.float32) * jnp.float32(1.0 / (1 << 24))


def seed_key(seed) -> jax.Array:
    """The key of ``random_bits``' streams for ``seed``: a Python int (taken mod 2**32) or a uint32 array (traced
    too)."""
    if isinstance(seed, int):
        seed = seed & 0xFFFFFFFF
    return mix32(jnp.asarray(seed, jnp.uint32) + jnp.uint32(0x2545F491))


def rank_to_slot(rank, num_shards: int):
    """Round-robin dealing puts the rank-r item (insertion order, before any wrap) at shard r % S, slot r // S."""
    return rank % num_shards, rank // num_shards


def _check_batch_size(batch_size: int, name: str) -> None:
    if not isinstance(batch_size, int) or isinstance(batch_size, bool) or batch_size < 1:
        raise ConfigError(f"samplers.{name}(): batch_size must be a positive int, got {batch_size!r}")


# ------------------------------------------------------------------------------------------------------------------
# Uniform with replacement
# ------------------------------------------------------------------------------------------------------------------
@state_dataclass
class RandomState:
    key: jax.Array  # uint32[]: hashed seed
    counter: jax.Array  # uint32[]: calls so far


def _random_state(seed: int) -> RandomState:
    return RandomState(key=seed_key(seed), counter=jnp.zeros((), jnp.uint32))


def uniform(batch_size: int) -> Sampler:
    """Uniform sampling with replacement over every valid item of the whole buffer."""
    _check_batch_size(batch_size, "uniform")

    def sample(state: RandomState, view: ShardView):
        rank = random_below(random_bits(state.key, state.counter, batch_size), view.size)
        owner, slot = rank_to_slot(rank, view.num_shards)
        return RandomState(state.key, state.counter + 1), Selection(slot, owner, None)

    return Sampler(
        name="uniform", batch_size=batch_size, min_items=1, params=_params(batch_size=batch_size),
        init=lambda capacity, num_shards, seed: _random_state(seed),
        on_insert=lambda state, view: state,
        sample=sample,
    )


# ------------------------------------------------------------------------------------------------------------------
# Epochs: without replacement, each item once per epoch in shuffled minibatches (PPO)
# ------------------------------------------------------------------------------------------------------------------
@state_dataclass
class EpochState:
    key: jax.Array  # uint32[]
    epoch: jax.Array  # uint32[]: epochs started so far (keys the permutation)
    step: jax.Array  # int32[]: minibatches delivered in the current epoch
    epoch_size: jax.Array  # int32[]: items the current epoch covers (0: start a new epoch at the next sample)


def feistel_permute(x, n, key, rounds: int = 4):
    """A keyed bijection of [0, n) applied to int32 ``x`` (all < n): a balanced Feistel network on the smallest
    even-bit domain >= n, cycle-walking values that land outside [0, n). O(1) state, no sort: a few integer rounds
    per element instead of an O(n log n) sort of the whole domain."""
    n = n.astype(jnp.uint32)
    bits = 32 - lax.clz(jnp.maximum(n, 2) - 1)  # bits to hold n-1
    half = (bits + 1) // 2
    mask = (jnp.uint32(1) << half) - 1

    def network(v):
        left, right = v >> half, v & mask
        for r in range(rounds):
            f = mix32(right ^ mix32(key + jnp.uint32(r * 0x3C6EF372 & 0xFFFFFFFF))) & mask
            left, right = right, left ^ f
        return (left << half) | right

    def outside(v):
        return jnp.any(v >= n)

    v = network(x.astype(jnp.uint32))
    v = lax.while_loop(outside, lambda v: jnp.where(v >= n, network(v), v), v)
    return v.astype(jnp.int32)


def epochs(batch_size: int) -> Sampler:
    """Sampling without replacement: each epoch is a fresh shuffle of the items present when it starts, delivered in
    minibatches of ``batch_size``; every item is delivered exactly once per epoch. An epoch has
    ``size // batch_size`` minibatches: keep the item count a multiple of the batch size (PPO's rollout size) or the
    remainder of each epoch's shuffle is left out of that epoch. Ingesting new items starts a new epoch."""
    _check_batch_size(batch_size, "epochs")

    def init(capacity, num_shards, seed):
        return EpochState(key=seed_key(seed), epoch=jnp.zeros((), jnp.uint32), step=jnp.zeros((), jnp.int32),
                          epoch_size=jnp.zeros((), jnp.int32))

    def on_insert(state: EpochState, view: InsertView):
        return EpochState(state.key, state.epoch, jnp.zeros((), jnp.int32), jnp.zeros((), jnp.int32))

    def sample(state: EpochState, view: ShardView):
        fresh = (state.epoch_size == 0) | (state.step >= state.epoch_size // batch_size)
        epoch = jnp.where(fresh, state.epoch + 1, state.epoch)
        step = jnp.where(fresh, 0, state.step)
        epoch_size = jnp.where(fresh, view.size, state.epoch_size)
        # a draw with fewer than a batch of items (the functional API computes it, then flags it invalid) must still
        # terminate: the cycle walk needs every position inside [0, n) and n >= 1
        domain = jnp.maximum(epoch_size, 1)
        position = (step * batch_size + lax.iota(jnp.int32, batch_size)) % domain
        rank = feistel_permute(position, domain, mix32(state.key ^ epoch))
        owner, slot = rank_to_slot(rank, view.num_shards)
        return EpochState(state.key, epoch, step + 1, epoch_size), Selection(slot, owner, None)

    return Sampler(
        name="epochs", batch_size=batch_size, min_items=batch_size, params=_params(batch_size=batch_size),
        init=init,
        on_insert=on_insert,
        sample=sample,
    )


# ------------------------------------------------------------------------------------------------------------------
# FIFO queue: every item delivered exactly once, in insertion order (IMPALA / APPO)
# ------------------------------------------------------------------------------------------------------------------
@state_dataclass
class QueueState:
    head: jax.Array  # int32[]: next slot every shard reads (shards read in lockstep)
    pending: jax.Array  # int32[]: items ingested and not yet delivered, whole buffer


def fifo(batch_size: int) -> Sampler:
    """A queue: each item is delivered exactly once, oldest first. Ingest refuses (never overwrites) items that have
    not been delivered yet. Round-robin dealing puts global item g at shard g % S, slot g // S, so when every shard
    reads its next ``batch_size // S`` rows the batch holds exactly the next ``batch_size`` items. Within the batch
    each shard's block is in insertion order (shard-major, no cross-device exchange): on one shard that is the
    global insertion order; on S shards the order inside the batch is g0, g0+S, ..., then g0+1, g0+1+S, ..."""
    _check_batch_size(batch_size, "fifo")

    def init(capacity, num_shards, seed):
        return QueueState(head=jnp.zeros((), jnp.int32), pending=jnp.zeros((), jnp.int32))

    def on_insert(state: QueueState, view: InsertView):
        # the plane (and an eager Buffer.ingest) refuses an ingest that would overwrite undelivered items; inside a
        # trace nothing can be refused, so the head skips past what was overwritten (whole rows of every shard: the
        # shards read in lockstep) and no item is ever delivered twice
        pending = state.pending + view.total
        over = jnp.maximum(pending - view.num_shards * view.shard_capacity, 0)
        rows = (over + view.num_shards - 1) // view.num_shards
        return QueueState((state.head + rows) % view.shard_capacity, pending - rows * view.num_shards)

    def sample(state: QueueState, view: ShardView):
        per_shard = batch_size // view.num_shards
        slots = (state.head + lax.iota(jnp.int32, per_shard)) % view.shard_capacity
        head = (state.head + per_shard) % view.shard_capacity
        return QueueState(head, state.pending - batch_size), Selection(slots, None, None)

    return Sampler(
        name="fifo", batch_size=batch_size, min_items=batch_size, params=_params(batch_size=batch_size),
        init=init,
        on_insert=on_insert,
        sample=sample,
        deliverable=lambda state, size: state.pending,
        consumes=True,
        relayout=_relayout_queue,
    )


def _relayout_queue(saved: dict, moves: ItemMoves, target: dict) -> dict:
    """Every shard reads its rows in lockstep: the head is the slot after the items delivered so far."""
    delivered = moves.total - int(saved["pending"])
    old_cap = moves.capacity // moves.saved_shards
    if delivered < 0 or delivered % moves.shards or delivered % moves.saved_shards or \
            int(saved["head"]) != (delivered // moves.saved_shards) % old_cap:
        raise ValueError(f"the FIFO queue's head {int(saved['head'])} and pending count {int(saved['pending'])} do not "
                         f"fit {moves.total} ingested items on {moves.saved_shards} shards")
    return {"head": np.asarray((delivered // moves.shards) % (moves.capacity // moves.shards), np.int32)}


# ------------------------------------------------------------------------------------------------------------------
# Prioritized: P(i) = p_i^alpha / sum_k p_k^alpha over the whole buffer (PER)
# ------------------------------------------------------------------------------------------------------------------
@state_dataclass
class PriorityState:
    key: jax.Array  # uint32[]
    counter: jax.Array  # uint32[]: sample calls so far (also the step of a beta schedule)
    levels: tuple  # per-shard sum trees of p^alpha, level l float32[shards * K**l] (see sumtree.py)
    max_priority: jax.Array  # float32[]: largest priority seen; new items get it
    ignored_updates: jax.Array  # int32[]: priority updates dropped because their item was overwritten
    times_sampled: Optional[jax.Array] = None  # int32[shards * shard_capacity] with max_times_sampled, else None
    # with normalise="buffer": per shard the smallest positive leaf below each node (inf: none), levels 0 .. L-1 of
    # the sum tree's shapes over the same leaves, so a draw reads the smallest mass at the roots (O(1), not O(N))
    smallest: Optional[tuple] = None


def _all_shards(x, view):
    """The per-shard scalar ``x`` of every shard, [S] in shard order: the one small collective of a global draw."""
    if view.num_shards == 1:
        return x[None]
    return lax.all_gather(x, view.axes, tiled=False).reshape(view.num_shards)


def _check_number(value, name: str, where: str, *, low: float = 0.0, above: bool = False) -> float:
    """``value`` as a float when it is a finite real number >= ``low`` (> ``low`` with ``above``), else a
    ConfigError naming ``where``'s argument ``name``, what it must be and what came."""
    bound = f"{'>' if above else '>='} {low:g}"
    if isinstance(value, bool) or not isinstance(value, (int, float, np.integer, np.floating)):
        raise ConfigError(f"{where}: {name} must be a finite number {bound}, got {type(value).__name__} {value!r}")
    if not np.isfinite(value) or not (value > low if above else value >= low):
        raise ConfigError(f"{where}: {name} must be a finite number {bound}, got {value!r}")
    return float(value)


def _as_schedule(value, name: str, where: str):
    if callable(value):
        return value
    value = _check_number(value, name, where)
    return lambda step: jnp.float32(value)


def _priority_sampler(name: str, batch_size: int, alpha: float, beta, eps: float, insert_run,
                      max_times_sampled: Optional[int], keeps_smallest: bool = False) -> Sampler:
    """The sum-tree sampler shared by item and sequence replay; ``insert_run(state, InsertView) -> (first, masses,
    valid)`` decides which slots become eligible: the run of leaves an insert writes (``sumtree.set_run``).
    With ``max_times_sampled`` k, an item's mass drops to 0 once it has been delivered k times; draws of one batch past
    an item's remaining budget are marked as not delivered (``Delivery.mask`` False) and do not count.
    ``keeps_smallest``: the state keeps the smallest-mass tree (``PriorityState.smallest``) too."""
    where = f"samplers.{name}()"
    _check_number(alpha, "alpha", where)
    _check_number(eps, "eps", where, above=True)  # eps > 0 keeps every live item sampleable
    beta_at = _as_schedule(beta, "beta", where)
    if max_times_sampled is not None and (not isinstance(max_times_sampled, int) or isinstance(max_times_sampled, bool)
                                          or max_times_sampled < 1):
        raise ConfigError(f"samplers.{name}(): max_times_sampled must be an int >= 1 or None, got "
                          f"{max_times_sampled!r}")

    def init(capacity, num_shards, seed):
        base = _random_state(seed)
        levels = sumtree.init(capacity // num_shards, num_shards)
        return PriorityState(key=base.key, counter=base.counter, levels=levels,
                             max_priority=jnp.ones((), jnp.float32), ignored_updates=jnp.zeros((), jnp.int32),
                             times_sampled=None if max_times_sampled is None else jnp.zeros((capacity,), jnp.int32),
                             smallest=tuple(jnp.full(level.shape, jnp.inf) for level in levels[:-1]) if keeps_smallest
                             else None)

    def with_leaves(state: PriorityState, leaves, ranges: list, scattered) -> PriorityState:
        """``state`` with the leaf level ``leaves``, changed at ``sumtree.refresh``'s ``ranges`` and ``scattered``,
        and every ancestor refreshed: the sum tree's, and the smallest-mass tree's where kept (both read the final
        leaves, each level written once: in place)."""
        levels = sumtree.refresh((*state.levels[:-1], leaves), ranges, scattered)
        if state.smallest is None:
            return replace(state, levels=levels)
        smallest = sumtree.refresh((*state.smallest, leaves), ranges, scattered, combine=sumtree.smallest_positive)
        return replace(state, levels=levels, smallest=smallest[:-1])

    def with_all_leaves(state: PriorityState, leaves) -> PriorityState:
        """``state`` with its trees rebuilt over ``leaves`` (most of them changed), O(leaves)."""
        levels = sumtree.from_leaves(leaves, len(state.levels))
        if state.smallest is None:
            return replace(state, levels=levels)
        smallest = sumtree.from_leaves(leaves, len(state.levels), combine=sumtree.smallest_positive)
        return replace(state, levels=levels, smallest=smallest[:-1])

    def inserted(state: PriorityState, view: InsertView):
        """The state after an insert: the new items' delivery counts start at 0."""
        if max_times_sampled is None:
            return state
        fresh = jnp.where(view.valid, view.slots, view.shard_capacity)
        return replace(state, times_sampled=state.times_sampled.at[fresh].set(0, mode="drop"))

    def insert(state: PriorityState, view: InsertView):
        first, masses, valid = insert_run(state, view)
        leaves, ranges = sumtree.write_run(state.levels[-1], first, masses, valid, view.shard_capacity)
        return inserted(with_leaves(state, leaves, ranges, None), view)

    def sample(state: PriorityState, view: ShardView):
        masses = _all_shards(sumtree.total(state.levels), view)
        mass = jnp.sum(masses)
        # stratified: draw j lands in [j, j+1) * mass / B, so a batch covers the whole mass range
        unit = random_unit(random_bits(state.key, state.counter, batch_size))
        targets = (lax.iota(jnp.float32, batch_size) + unit) * (mass / batch_size)
        owner, local, _ = sumtree.pick(jnp.broadcast_to(masses, (batch_size, view.num_shards)), targets)
        slot, leaf = sumtree.descend(state.levels, local)
        probability = leaf / mass
        new_state = replace(state, counter=state.counter + 1)
        keep = None
        if max_times_sampled is not None:
            # a batch may draw an item more often than it has deliveries left: the draws past its budget are not
            # deliveries (Delivery.mask is False there) and do not count
            mine = owner == view.shard_index
            item = owner * view.shard_capacity + slot
            earlier = jnp.sum(jnp.tril(item[:, None] == item[None, :], k=-1), axis=1).astype(jnp.int32)
            before = state.times_sampled.at[slot].get(mode="promise_in_bounds")
            keep = before + earlier < max_times_sampled
            counts = state.times_sampled.at[jnp.where(mine & keep, slot, view.shard_capacity)].add(1, mode="drop")
            spent = mine & (counts.at[slot].get(mode="promise_in_bounds") >= max_times_sampled)
            leaves = sumtree.write_leaves(state.levels[-1], slot, jnp.zeros_like(leaf), spent)
            new_state = replace(with_leaves(new_state, leaves, [], (slot, spent)), times_sampled=counts)
        return new_state, Selection(slot, owner, probability, keep)

    def weigh(state: PriorityState, probability, size, shard_capacity: int):
        """Importance weights (N * P(i))^-beta, normalised by the batch maximum (so every weight is in (0, 1])."""
        step = state.counter - 1  # sample() has already advanced the counter
        w = jnp.power(size.astype(jnp.float32) * probability, -beta_at(step))
        return w / jnp.max(w)

    def update_leaves(state: PriorityState, view: ShardView, ids, priorities, valid, current):
        """An update's leaf writes (slots, masses, live) and its effect on the other fields; ``current``: the leaves
        before it."""
        rows, generation = ids[:, 0], ids[:, 1]
        slot = rows % view.shard_capacity
        mine = valid & (rows // view.shard_capacity == view.shard_index)
        # an id whose slot was rewritten since it was sampled names another item now: ignore it, never apply it
        live = (mine & (generation == storage.slot_generation(view.cursor, view.laps, slot))
                & (current.at[slot].get(mode="promise_in_bounds") > 0))
        top = jnp.max(jnp.where(live, priorities, 0.0))
        ignored = jnp.sum(mine & ~live).astype(jnp.int32)
        if view.num_shards > 1:
            top, ignored = lax.pmax(top, view.axes), lax.psum(ignored, view.axes)
        values = _mass(priorities, alpha, eps, view.num_shards * view.shard_capacity)
        return (slot, values, live), dict(max_priority=jnp.maximum(state.max_priority, top),
                                          ignored_updates=state.ignored_updates + ignored)

    def update(state: PriorityState, view: ShardView, ids, priorities, valid):
        (slot, values, live), fields = update_leaves(state, view, ids, priorities, valid, state.levels[-1])
        leaves = sumtree.write_leaves(state.levels[-1], slot, values, live)
        return replace(with_leaves(state, leaves, [], (slot, live)), **fields)

    def update_then_insert(state: PriorityState, before: ShardView, view: InsertView, ids, priorities, valid):
        """``update`` and then ``insert`` (``before``: the view before the insert) with one refresh of the tree:
        both write the leaves, then every changed leaf's ancestors are refreshed from the final leaves."""
        (slot, values, live), fields = update_leaves(state, before, ids, priorities, valid, state.levels[-1])
        state = replace(state, **fields)  # the new items take the largest priority, this update's included
        leaves = sumtree.write_leaves(state.levels[-1], slot, values, live)
        first, masses, run_valid = insert_run(state, view)
        leaves, ranges = sumtree.write_run(leaves, first, masses, run_valid, view.shard_capacity)
        return inserted(with_leaves(state, leaves, ranges, (slot, live)), view)

    def insert_then_update(state: PriorityState, view: InsertView, after: ShardView, ids, priorities, valid):
        """``insert`` and then ``update`` (``after``: the view after the insert) with one refresh of the tree."""
        first, masses, run_valid = insert_run(state, view)
        leaves, ranges = sumtree.write_run(state.levels[-1], first, masses, run_valid, view.shard_capacity)
        (slot, values, live), fields = update_leaves(state, after, ids, priorities, valid, leaves)
        leaves = sumtree.write_leaves(leaves, slot, values, live)
        return replace(inserted(with_leaves(state, leaves, ranges, (slot, live)), view), **fields)

    def retire(state: PriorityState, stale):
        """Zero the mass of every slot where ``stale`` (bool[shard capacity]): never drawn again until rewritten. The
        tree is rebuilt from its leaves, O(capacity), which is cheaper than refreshing every leaf's ancestors."""
        leaves = state.levels[-1]
        stale = jnp.pad(stale, (0, leaves.shape[0] - stale.shape[0]))  # leaves past the ring hold 0 already
        return with_all_leaves(state, jnp.where(stale, 0.0, leaves))

    def retire_slots(state: PriorityState, slots, valid):
        """Zero the mass of ``slots`` where ``valid``: their leaves and ancestors only, O(m log capacity) (``retire``
        rebuilds the whole tree, which pays off when many slots go at once, e.g. a staleness bound)."""
        leaves = sumtree.write_leaves(state.levels[-1], slots, jnp.zeros(slots.shape, jnp.float32), valid)
        return with_leaves(state, leaves, [], (slots, valid))

    return Sampler(name=name, batch_size=batch_size, min_items=1, init=init,
                   on_insert=insert, sample=sample, update=update, weigh=weigh, retire=retire,
                   retire_slots=retire_slots, update_then_insert=update_then_insert,
                   insert_then_update=insert_then_update,
                   deliverable=None if max_times_sampled is None else _has_mass,
                   sampling_retires=max_times_sampled is not None, relayout=_relayout_priorities)


def _relayout_priorities(saved: dict, moves: ItemMoves, target: dict) -> dict:
    """Each item's sum-tree leaf (and delivery count) moves with it; the levels above (and the smallest-mass tree,
    where kept) are rebuilt from the leaves."""
    def levels(names):
        return sorted((n for n in names if n.startswith("levels.")), key=lambda n: int(n.split(".")[-1]))

    saved_levels, new_levels = levels(saved), levels(target)
    saved_leaves = saved[saved_levels[-1]]
    leaves = np.zeros(target[new_levels[-1]].shape, np.float32)
    leaves[moves.new_at(leaves.shape[0] // moves.shards)] = \
        saved_leaves[moves.saved_at(saved_leaves.shape[0] // moves.saved_shards)]
    out = {name: np.asarray(level) for name, level in zip(new_levels, sumtree.from_leaves(leaves, len(new_levels)))}
    smallest = sorted((n for n in target if n.startswith("smallest.")), key=lambda n: int(n.split(".")[-1]))
    if smallest:  # rebuilt from the leaves too (a checkpoint saved before the plane kept this tree lacks it)
        built = sumtree.from_leaves(leaves, len(new_levels), combine=sumtree.smallest_positive)
        out.update({name: np.asarray(level) for name, level in zip(smallest, built)})
    if "times_sampled" in target:
        times = np.zeros(target["times_sampled"].shape, np.int32)
        times[moves.new_at(moves.capacity // moves.shards)] = \
            saved["times_sampled"][moves.saved_at(moves.capacity // moves.saved_shards)]
        out["times_sampled"] = times
    return out


def max_mass(capacity: int) -> float:
    """The largest mass one item of a buffer of ``capacity`` items gets: float32's maximum / (2 * capacity), so the
    sum tree's total (and every partial sum a draw computes) stays finite for any finite priority."""
    return float(np.finfo(np.float32).max) / (2.0 * capacity)


def _mass(priority, alpha: float, eps: float, capacity: int):
    """A live item's mass (p + eps)^alpha, kept >= the smallest normal float32 (with a large alpha it would underflow
    to 0, and a zero mass means "never draw, never update", retired, to the sum tree) and <= ``max_mass(capacity)``
    (a priority of 3e38 would otherwise overflow the tree: every weight NaN, every draw row 0)."""
    mass = jnp.power(priority + eps, alpha)
    return jnp.clip(mass, jnp.finfo(jnp.float32).tiny, jnp.float32(max_mass(capacity)))


def _has_mass(state: PriorityState, size):
    """1 while some item or window of any shard can still be drawn (its mass is positive), else 0. Called on the
    global state, where the top level holds every shard's root (reading the first root alone missed the others)."""
    return jnp.any(state.levels[0] > 0).astype(jnp.int32)


def prioritized(batch_size: int, alpha: float = 0.6, beta=0.4, eps: float = 1e-6,
                max_times_sampled: Optional[int] = None, normalise: str = "batch") -> Sampler:
    """Prioritized experience replay over the whole buffer: P(i) = (p_i + eps)^alpha / sum_k (p_k + eps)^alpha,
    stratified draws, importance weights (N * P(i))^-beta. ``normalise="batch"`` divides them by the batch maximum;
    ``"buffer"`` by the largest weight any stored item could get, (N * P_min)^-beta with P_min the smallest
    probability of a drawable item (RLlib's and OpenAI baselines' convention: a weight does not depend on what else
    the batch drew; a tree of the smallest masses beside the sum tree keeps P_min: O(log capacity) more per write,
    O(1) per draw). ``beta`` may be a schedule (a function of the
    sample step, e.g. ``optax.linear_schedule(0.4, 1.0, 100_000)``). New items get the largest priority seen so far.
    ``max_times_sampled`` retires an item after that many deliveries (``alpha=0`` makes this uniform sampling with a
    delivery limit)."""
    _check_batch_size(batch_size, "prioritized")
    if normalise not in ("batch", "buffer"):
        raise ConfigError(f"samplers.prioritized(): normalise must be 'batch' or 'buffer', got {normalise!r}")

    def insert_run(state: PriorityState, view: InsertView):
        value = _mass(state.max_priority, alpha, eps, view.num_shards * view.shard_capacity)
        return view.slots[0], jnp.full(view.slots.shape, value), view.valid

    base = _priority_sampler("prioritized", batch_size, alpha, beta, eps, insert_run, max_times_sampled,
                             keeps_smallest=normalise == "buffer")
    extra = {} if normalise == "batch" else {"normalise": normalise}  # older checkpoints' metadata stays as it was
    params = _params(batch_size=batch_size, alpha=alpha, beta=beta, eps=eps, max_times_sampled=max_times_sampled,
                     **extra)
    if normalise == "batch":
        return base._replace(params=params)
    beta_at = _as_schedule(beta, "beta", "samplers.prioritized()")

    def weigh(state: PriorityState, probability, size, shard_capacity: int):
        """(P(i) / P_min)^-beta: the N of (N * P)^-beta cancels, and P(i) / P_min = mass_i / smallest mass, read
        at the roots of the smallest-mass trees (scanning the leaves instead, O(capacity) per draw, took ~50 us of an
        RLlib PER draw at capacity 50,000 and ~0.7 ms at 1,000,000)."""
        smallest = jnp.min(state.smallest[0])
        total = jnp.sum(state.levels[0])
        ratio = jnp.maximum(probability * total / smallest, 1.0)  # >= 1 up to rounding: every weight is in (0, 1]
        return jnp.power(ratio, -beta_at(state.counter - 1))

    return base._replace(params=params, weigh=weigh)


# ------------------------------------------------------------------------------------------------------------------
# Sequences: windows of consecutive steps of one stream (recurrent learners, n-step returns)
# ------------------------------------------------------------------------------------------------------------------
def sequences(batch_size: int, length: int, streams: int, *, burn_in: int = 0, period: int = 1, pad: bool = False,
              end_keys: tuple[str, ...] = ("terminated", "truncated"), alpha: Optional[float] = None, beta=0.4,
              eps: float = 1e-6, max_times_sampled: Optional[int] = None) -> Sampler:
    """Windows of ``burn_in + length`` consecutive steps of one stream (one environment).

    Ingest contract: every batch holds whole steps of ``streams`` environments, time-major (``steps * streams``
    items, environment e at position ``t * streams + e``), so stream e's steps sit in one shard, ``streams / S``
    slots apart; ``streams`` must be a multiple of the shard count.

    A window starts only every ``period`` steps. Episode ends are the OR of the boolean ``end_keys`` leaves (a
    tuple of leaf names, by default ``terminated`` and ``truncated``; a bare str is refused: write ``("done",)``).
    ``pad`` must be a bool. With ``pad=False`` a window never crosses an episode boundary (only
    its last step may end the episode). With ``pad=True`` windows may run past an episode's end and the delivery's
    ``mask`` marks the steps that belong to the window's first episode (what n-step returns need: see
    ``transforms.n_step``). Selection is uniform over eligible windows, or prioritized when ``alpha`` is given
    (P(window) ∝ (p + eps)^alpha, importance weights with ``beta``; priorities attach to the window's first step).

    Uniform padded windows of every step (``pad=True``, ``period=1``, no ``alpha``, no ``max_times_sampled``) keep no
    index: every stored step with ``window - 1`` stored steps after it starts one, so a draw is arithmetic on the
    ring's cursor (see ``_uniform_windows``). Under a staleness bound their stale steps are masked at delivery, as
    with ``uniform`` items; the indexed variants stop drawing stale windows instead.
    """
    _check_batch_size(batch_size, "sequences")
    window = burn_in + length
    for name, value, low in (("length", length, 1), ("streams", streams, 1), ("burn_in", burn_in, 0),
                             ("period", period, 1)):
        if not isinstance(value, int) or isinstance(value, bool) or value < low:
            raise ConfigError(f"samplers.sequences(): {name} must be an int >= {low}, got {value!r}")
    if not isinstance(pad, (bool, np.bool_)):
        raise ConfigError(f"samplers.sequences(): pad must be a bool (True: windows may run past an episode's end, "
                          f"masked), got {type(pad).__name__} {pad!r}")
    pad = bool(pad)
    if isinstance(end_keys, str):  # a bare str would be iterated into one-letter keys
        raise ConfigError(f"samplers.sequences(): end_keys must be a tuple of leaf names, not a str: write "
                          f"end_keys=({end_keys!r},) for a single episode-end leaf")
    if not isinstance(end_keys, (tuple, list)) or not end_keys or \
            not all(isinstance(k, str) and k for k in end_keys):
        raise ConfigError(f"samplers.sequences(): end_keys must be a non-empty tuple of names of the boolean "
                          f"episode-end leaves, got {end_keys!r}")
    end_keys = tuple(end_keys)
    weighted = alpha is not None
    exponent = 1.0 if alpha is None else alpha
    params = _params(batch_size=batch_size, length=length, streams=streams, burn_in=burn_in, period=period, pad=pad,
                     end_keys=list(end_keys), alpha=alpha, beta=beta, eps=eps, max_times_sampled=max_times_sampled)

    def mask(data):
        """True for the steps of the window's first episode: every step up to and including the first end."""
        ends = functools.reduce(jnp.logical_or, [_leaf(data, key) for key in end_keys])
        before = jnp.cumsum(ends.astype(jnp.int32), axis=1) - ends.astype(jnp.int32)
        return before == 0

    if pad and not weighted and max_times_sampled is None and period == 1:
        # eps and beta are unused here, but checked as on the indexed path: a checkpoint records them
        _check_number(eps, "eps", "samplers.sequences()", above=True)
        _as_schedule(beta, "beta", "samplers.sequences()")
        return _uniform_windows(batch_size, window, streams, tuple(end_keys), mask, params)

    def insert_run(state: PriorityState, view: InsertView):
        stride = streams // view.num_shards
        k = view.slots.shape[0]
        # each new row completes the window that starts window-1 steps earlier in its stream
        back_steps = (window - 1) * stride
        position = view.cursor + lax.iota(jnp.int32, k)  # rows written before this one in the current lap
        exists = (view.laps > 0) | (position >= back_steps)
        # rows of this same batch written after row i must not have reached the window's first slot again (a batch
        # as large as the ring laps over its own older steps)
        later = jnp.sum(view.valid.astype(jnp.int32)) - 1 - lax.iota(jnp.int32, k)
        intact = later < view.shard_capacity - back_steps
        eligible = view.valid & exists & intact
        if not pad and window > 1:
            back = lax.iota(jnp.int32, window - 1)[::-1] * stride + stride  # window-1, ..., 1 steps back
            earlier = (view.slots[:, None] - back[None, :]) % view.shard_capacity  # [k, window-1], oldest first
            ends = functools.reduce(jnp.logical_or, [view.read(key, earlier) for key in end_keys])
            eligible &= ~jnp.any(ends, axis=1)
        if period > 1:
            modulus = stride * period
            start_position = (view.laps % modulus) * (view.shard_capacity % modulus) + position - back_steps
            eligible &= ((start_position % modulus) // stride) % period == 0
        value = (_mass(state.max_priority, exponent, eps, view.num_shards * view.shard_capacity) if weighted
                 else jnp.float32(1.0))
        # One run of slots from the first completed window's start to the last new row: the window starts (each new
        # row's slot, window-1 steps back) get their mass, then the new rows' own slots get 0 (the windows that
        # started there are gone with their items) unless a window starting there just completed. A start that is
        # not eligible keeps mass 0: it was zeroed when its own row was written and no window completed there since.
        # (Two runs, one after the other, made XLA copy every level of the tree on each ingest.)
        # run entry j: the window start of new row j (j < k), the slot of new row j - back_steps (j >= back_steps)
        # (the first window start is computed as a scalar: slicing it out of a [k, window] array of window slots
        # made XLA materialise the whole array, integer remainders for every slot on each ingest)
        no_step = jnp.zeros((back_steps,), jnp.bool_)
        values = jnp.concatenate([jnp.where(eligible, value, 0.0), jnp.zeros((back_steps,), jnp.float32)])
        valid = jnp.concatenate([view.valid, no_step]) | jnp.concatenate([no_step, view.valid])
        return (view.slots[0] - back_steps) % view.shard_capacity, values, valid

    base = _priority_sampler("sequences", batch_size, exponent, beta, eps, insert_run, max_times_sampled)
    return base._replace(params=params, window=window, time_axis=True, streams=streams, needs=tuple(end_keys),
                         mask=mask if pad else None,
                         weigh=base.weigh if weighted else None, update=base.update if weighted else None,
                         update_then_insert=base.update_then_insert if weighted else None,
                         insert_then_update=base.insert_then_update if weighted else None,
                         deliverable=_has_mass)


def _uniform_windows(batch_size: int, window: int, streams: int, needs: tuple[str, ...], mask, params) -> Sampler:
    """Uniform over every window of ``window`` consecutive stored steps, without an index.

    Ingest takes whole steps of every stream and deals them evenly, so each shard holds ``n = size / S`` items,
    ``n / stride`` steps of each of its ``stride = streams / S`` streams, and its cursor sits on a step boundary.
    In ring order from the oldest slot (0 before the first wrap, the cursor after), the i-th item is step ``i //
    stride`` of stream ``i % stride``, and its window's steps are ``stride`` slots apart, so the starts are exactly
    the oldest ``n - (window - 1) * stride`` items: a draw is a uniform rank among them. The priority tree this
    replaces cost every ingest two tree windows per level, and every draw a descent.
    """

    def sample(state: RandomState, view: ShardView):
        starts = view.size // view.num_shards - (window - 1) * (streams // view.num_shards)
        rank = random_below(random_bits(state.key, state.counter, batch_size), starts * view.num_shards)
        owner, local = rank_to_slot(rank, view.num_shards)
        oldest = jnp.where(view.laps > 0, view.cursor, 0)
        return RandomState(state.key, state.counter + 1), Selection((oldest + local) % view.shard_capacity, owner, None)

    # a first window needs `window` steps of every stream: with equal steps per stream, that many stored items
    return Sampler(name="sequences", batch_size=batch_size, min_items=window * streams,
                   init=lambda capacity, num_shards, seed: _random_state(seed),
                   on_insert=lambda state, view: state, sample=sample, params=params,
                   window=window, time_axis=True, streams=streams, needs=needs, mask=mask)


def _leaf(tree, name: str):
    node = tree
    for part in name.split("/"):
        node = node[part]
    return node


def _params(**kwargs) -> tuple:
    """Constructor arguments as a hashable tuple; a schedule (callable) is recorded as None: not serialisable."""
    return tuple(sorted((k, None if callable(v) else (tuple(v) if isinstance(v, list) else v))
                        for k, v in kwargs.items()))


def from_params(name: str, params) -> Sampler:
    """Rebuild a sampler from ``(sampler.name, dict(sampler.params))``, as a checkpoint records it."""
    where = "samplers.from_params()"
    constructors = {"uniform": uniform, "epochs": epochs, "fifo": fifo, "prioritized": prioritized,
                    "sequences": sequences}
    if not isinstance(name, str) or name not in constructors:
        raise ConfigError(f"{where}: unknown sampler {name!r}; known: {sorted(constructors)}")
    kwargs = constructor_kwargs(where, f"the {name} sampler", constructors[name], params)
    if "beta" in kwargs and kwargs["beta"] is None:
        raise ConfigError(f"{where}: the {name} sampler used a beta schedule, which a checkpoint cannot "
                          f"record; pass the sampler explicitly")
    if isinstance(kwargs.get("end_keys"), list):
        kwargs["end_keys"] = tuple(kwargs["end_keys"])
    return constructors[name](**kwargs)
