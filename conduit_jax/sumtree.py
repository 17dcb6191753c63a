"""Per-shard priority index: a K-ary sum tree stored level by level, float32-safe by construction.

Levels. ``levels[0]`` is the root ``[1]``, ``levels[L]`` the leaves ``[K**L]`` (slots past the shard's ring hold 0).
A draw descends one level at a time and reads one contiguous ``[K]`` block per level, so a 1M-slot shard with K=16 is
5 block reads per draw instead of 20 dependent scalar reads of a binary tree.

Float32 safety. Nodes are never updated by adding deltas (the drift that makes long-running float32 sum trees return
empty or zero-priority slots). A changed leaf refreshes each ancestor as the float32 sum of its K children's *current*
values, so every node always equals the sum of its children as float32 computes it, whatever happened before. The
descent then only ever steps into a child with positive mass: a rounding overshoot falls back to the last positive
child, a negative remainder is clamped to 0. Zero-mass leaves (empty slots, ineligible items) are never returned.

Writes. ``write_run`` / ``write_leaves`` change the leaf level, ``refresh`` then recomputes every changed leaf's
ancestors once (``set_run`` / ``set_leaves`` do both): writes from several sources in one kernel go into the leaves
first and are refreshed together, since two refreshing passes in one kernel make XLA:CPU copy every level. The same
``refresh`` with ``combine=smallest_positive`` keeps a tree of the smallest positive leaf over the same leaves.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jax import lax

ARITY = 16


def depth(num_leaves: int, arity: int = ARITY) -> int:
    """Levels below the root needed for ``num_leaves`` leaves (at least one)."""
    return max(1, math.ceil(math.log(max(num_leaves, 2)) / math.log(arity) - 1e-9))


def init(num_leaves: int, num_shards: int = 1, arity: int = ARITY) -> tuple[jax.Array, ...]:
    """Zero trees for ``num_shards`` shards of ``num_leaves`` leaves each: level l is float32[shards * arity**l]."""
    return tuple(jnp.zeros((num_shards * arity**level,), jnp.float32) for level in range(depth(num_leaves, arity) + 1))


def total(levels) -> jax.Array:
    """The shard's total mass (the root)."""
    return levels[0][0]


def child_sums(children):
    """Row sums of ``children`` [..., K], added left to right: the same float32 value as the last running sum of
    ``pick``, so a parent always equals the total its descent sees. K explicit adds fuse into one loop; a reduce over
    a minor axis of 16 compiled to a slower kernel on XLA:CPU."""
    total = children[..., 0]
    for j in range(1, children.shape[-1]):
        total = total + children[..., j]
    return total


def smallest_positive(children):
    """Row minima of ``children`` [..., K] over their positive entries (inf where none is): the combine of a
    smallest-mass tree (``refresh`` / ``from_leaves`` with ``combine=smallest_positive``), whose nodes are inf or
    positive, so one rule serves every level. K explicit minima, as ``child_sums`` adds."""
    positive = jnp.where(children > 0, children, jnp.inf)
    smallest = positive[..., 0]
    for j in range(1, children.shape[-1]):
        smallest = jnp.minimum(smallest, positive[..., j])
    return smallest


def pick(block, target):
    """Index of the child of ``block`` [..., K] (non-negative masses) whose cumulative range holds ``target``, the
    remainder of the target inside that child, and the child's mass. Never returns a zero-mass child while the block
    has positive mass: the target is clamped into [0, total) first (float32 rounding can overshoot the total, or go
    negative), and inside that range the first child whose cumulative sum exceeds the target has positive mass.

    The running sums are K explicit adds in ``child_sums``' order, so the last one is exactly the parent's stored
    value. Everything after the block read is elementwise over the draws: each running sum that the target reaches
    moves the choice one child on (its count, its mass, the running sum up to it), a chain of selects that XLA
    fuses into a few loops; its three results are then materialised (``_materialised``). Stacking the running sums
    into a [..., K] array for one compare-and-reduce instead made XLA:CPU materialise each sum in a kernel of its
    own, dozens of kernels per level, and a descent slowed accordingly."""
    arity = block.shape[-1]
    masses = [block[..., j] for j in range(arity)]
    running = [masses[0]]
    for j in range(1, arity):
        running.append(running[-1] + masses[j])  # child_sums' order: the last one is the parent's value
    total = running[-1]
    target = jnp.clip(target, 0.0, jnp.nextafter(total, jnp.zeros_like(total)))
    # the chosen child: the number of running sums <= target (all K - 1 for an empty block, whose target is 0)
    child, upto, mass = jnp.zeros(target.shape, jnp.int32), running[0], masses[0]
    for j in range(arity - 1):
        past = running[j] <= target
        child = child + past.astype(jnp.int32)
        upto = jnp.where(past, running[j + 1], upto)
        mass = jnp.where(past, masses[j + 1], mass)
    before = upto - mass  # as cum[child] - mass was: the same float32 value, so the draws did not change
    outputs = (child, jnp.clip(target - before, 0.0, mass), mass)
    return tuple(_materialised(x) for x in outputs) if arity > 1 else outputs


def descend(levels, targets, arity: int = ARITY):
    """Leaf slot and leaf mass for each target in [0, total): one [K] block read per level per target."""
    node = jnp.zeros(targets.shape, jnp.int32)
    mass = jnp.zeros(targets.shape, jnp.float32)
    offsets = lax.iota(jnp.int32, arity)
    for level in levels[1:]:
        block = level.at[node[..., None] * arity + offsets].get(mode="promise_in_bounds")
        child, targets, mass = pick(block, targets)
        node = node * arity + child
    return node, mass


def _materialised(x):
    """``x``, computed in a kernel of its own. XLA fuses a cheap elementwise producer into every consumer, so the
    chain of selects of ``pick`` ran again for each element its consumers read: 16 per draw in the next level's block
    read, 84 per draw in a W1 row gather, and nested across levels, which made a PER step slower than the stacked
    pick; materialised, it is faster than both. ``lax.optimization_barrier`` is gone by the time
    XLA:CPU fuses; a reduction is not fused into its consumers, and the max of ``x`` and the lowest value is ``x``."""
    lowest = jnp.iinfo(x.dtype).min if jnp.issubdtype(x.dtype, jnp.integer) else -jnp.inf
    return jnp.max(jnp.stack([x, jnp.full_like(x, lowest)]), axis=0)


def set_leaves(levels, slots, values, valid, arity: int = ARITY):
    """Set leaves ``slots`` (where ``valid``) to ``values`` and refresh their ancestors from their children.

    Duplicate slots are allowed (one of the values wins); invalid entries change nothing.
    """
    levels = list(levels)
    levels[-1] = write_leaves(levels[-1], slots, values, valid)
    return refresh(levels, [], (slots, valid), arity)


def from_leaves(leaves, num_levels: int, arity: int = ARITY, combine=child_sums) -> tuple[jax.Array, ...]:
    """Levels (root first) over a leaf level: every node the float32 sum of its children in ``child_sums``' order
    (or ``combine``'s rule, e.g. ``smallest_positive``).
    One pass per level, O(leaves): for changes to most leaves at once (retiring stale items, re-laying out a
    checkpoint), where refreshing each changed leaf's ancestors would read K children per leaf per level."""
    levels = [jnp.asarray(leaves, jnp.float32)]
    for _ in range(num_levels - 1):
        levels.append(combine(levels[-1].reshape(-1, arity)))
    return tuple(reversed(levels))


def set_run(levels, first, values, valid, num_slots: int, arity: int = ARITY):
    """``set_leaves`` for a run of consecutive slots: slot ``(first + i) % num_slots`` gets ``values[i]`` where
    ``valid[i]``. An ingest writes such a run; refreshing ancestors by contiguous slices reads each affected node's
    K children once, instead of once per changed leaf as the general path does (16x less at the lowest level).

    A run that wraps touches two windows of slots (one from ``first``, one from slot 0); both apply the same
    slot-by-slot rule, so where they overlap the second rewrites what the first wrote. Each level is written for
    both windows before the level above reads it."""
    levels = list(levels)
    levels[-1], ranges = write_run(levels[-1], first, values, valid, num_slots)
    return refresh(levels, ranges, None, arity)


def write_leaves(leaves, slots, values, valid):
    """``set_leaves``' writes into the leaf level alone (its ancestors not refreshed)."""
    out_of_range = leaves.shape[0]  # dropped by the scatter
    return leaves.at[jnp.where(valid, slots, out_of_range)].set(values.astype(jnp.float32), mode="drop")


def write_run(leaves, first, values, valid, num_slots: int):
    """``set_run``'s writes into the leaf level alone (its ancestors not refreshed): the new leaf level and the
    changed slots' windows ``[(start, span)]``."""
    k = values.shape[0]
    window = min(k, leaves.shape[0])
    # the second window starts at 0, written as min(first, 0) (first >= 0): an update at an offset XLA can see is a
    # constant gets rewritten into an op over the whole level, far slower than the slice
    starts = [jnp.clip(first, 0, leaves.shape[0] - window)] + ([jnp.minimum(first, 0)] if k > 1 else [])
    for start in starts:
        slot = start + lax.iota(jnp.int32, window)
        entry = (slot - first) % num_slots  # the entry of the run that lands on this slot, if < k
        source = jnp.clip(entry, 0, k - 1)
        chosen = (entry < k) & valid[source] & (slot < num_slots)
        # read each window from the level as updated so far: holding the pre-update level for a later read made
        # XLA copy the whole level on every call
        old = lax.dynamic_slice_in_dim(leaves, start, window)
        leaves = lax.dynamic_update_slice_in_dim(leaves, jnp.where(chosen, values[source].astype(jnp.float32), old),
                                                 start, 0)
    return leaves, [(start, window) for start in starts]


def refresh(levels, ranges: list, scattered, arity: int = ARITY, combine=child_sums) -> tuple:
    """Every ancestor of changed leaves, level by level from the leaves up, as the float32 sum of its children (or
    ``combine``'s rule, e.g. ``smallest_positive``): those over the slot windows ``ranges`` ``[(start, span)]``
    (``write_run``'s) by contiguous slices, those of the ``scattered`` ``(slots, valid)`` (``write_leaves``') one by
    one. Each level is written whole, both kinds computed from the finished level below, before the level above
    reads it.

    Writes from several sources (an insert's run, then a priority update) go into the leaves first and are refreshed
    here once: two refreshing passes in one kernel (any two of ``set_run`` / ``set_leaves``) made XLA:CPU copy every
    level twice, 8 MB a call at a 100,000-slot shard."""
    levels = list(levels)
    offsets = lax.iota(jnp.int32, arity)
    node = None if scattered is None else scattered[0]
    for index in range(len(levels) - 2, -1, -1):
        width, below = levels[index].shape[0], levels[index + 1]
        updates = []
        for low, span in ranges:  # changed nodes of the level below: [low, low + span)
            count = min(width, span // arity + 2)
            first_node = jnp.clip(low // arity, 0, width - count)
            children = lax.dynamic_slice_in_dim(below, first_node * arity, count * arity)
            updates.append((first_node, count, combine(children.reshape(count, arity))))
        if scattered is not None:
            node = node // arity
            sums = combine(below.at[node[:, None] * arity + offsets].get(mode="promise_in_bounds"))
        level = levels[index]
        for first_node, _, run_sums in updates:
            level = lax.dynamic_update_slice_in_dim(level, run_sums, first_node, 0)
        if scattered is not None:
            level = level.at[jnp.where(scattered[1], node, width)].set(sums, mode="drop")
        levels[index] = level
        ranges = [(first_node, count) for first_node, count, _ in updates]
    return tuple(levels)
