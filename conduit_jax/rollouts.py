"""LLM-RL rollouts: ragged token sequences stored without padding, delivered as whole groups, packed for the learner.

In GRPO-style training (GRPO, DAPO, verl, AReaL) an item is a sequence of tokens of variable length (prompt +
response), produced in groups of ``G`` responses to one prompt; the learner needs whole groups (the advantage of a
response is its reward against its group's) and pays for every padded token it computes. This module keeps
sequences in a token ring at their own length and delivers them packed into a fixed token budget, as pure functions
over an explicit state pytree (usable inside a user's ``jax.jit``), in the shape of ``functional.make_buffer``::

    spec = cj.rollouts.RolloutSpec(group_size=8, max_length=512,
                                   token_leaves={"tokens": np.int32, "logprobs": np.float32})
    buffer = cj.rollouts.make_rollout_buffer(spec, token_capacity=1 << 20, group_capacity=1024,
                                             groups_per_batch=16, layout=cj.rollouts.packed(rows=32, row_length=2048),
                                             max_staleness=1)
    state = buffer.init()
    groups = cj.rollouts.groups_from_lists(spec, tokens=[[...G sequences...], ...], logprobs=[[...], ...],
                                           rewards=[[...G floats...], ...], prompt_lengths=[[...], ...],
                                           policy_version=3)
    state = buffer.ingest(state, groups)        # jit-able; any static number of groups
    state, batch = buffer.sample(state)         # jit-able: whole groups, oldest first, each delivered once

Storage. Each token leaf is one ring of ``token_capacity`` tokens. A group's ``G`` sequences are written one after the
other in one contiguous region (a group that does not fit before the end of the ring starts again at 0), so a sequence
is never split; the group table keeps each sequence's start, length, prompt length and reward, and the group's policy
version and generation (the slot's write count: ``(slot, generation)`` is an id no later group reuses). Writing over a
region, or over a group slot, retires the older group whole: a sequence is never delivered in part or mixed with a
newer one. ``can_ingest`` says whether a write would retire a group not yet delivered.

Delivery is a queue of groups (the on-policy contract): ``sample`` takes the oldest undelivered groups, up to
``groups_per_batch``, each exactly once. With ``max_staleness=eta`` a group produced more than ``eta`` policy versions
before the learner's (``set_policy_version``) is never delivered (AReaL's bound): it is dropped when the queue reaches
it and counted in ``state.dropped_stale``; groups retired by an overwrite before delivery are counted in
``state.dropped_overwritten``.

Layouts. ``packed(rows, row_length)``: the chosen groups' sequences are placed whole into ``[rows, row_length]`` (first
fit, longest first within a group); a group that does not fit what the earlier ones left is the next batch's first, and
a later group of the window (``groups_per_batch``) that fits fills the rows' ends meanwhile. ``padded()``: one sequence
per row, ``[groups_per_batch * G, max_length]``, for comparison. A host program that plans a batch (``HostQueue``) knows
how many rows its sequences fill (``rows_needed(plan)``: they fill the first rows) and may have ``deliver`` lay out only
those (``rows=``): token-budget batching, as verl's dynamic batch size, so a batch holding fewer tokens than the budget
costs the learner fewer rows. Either way a batch holds, per token position: every token leaf, ``segment_ids`` (0 on
padding; the sequence's index in the batch + 1, so tokens of one row attend only within their segment), ``positions``
(within the sequence), ``loss_mask`` (the response tokens: position >= prompt length) and ``advantages`` (the sequence's
group advantage on its tokens; a group whose rewards are all equal gets exactly 0):
``(reward - mean) / (std + eps)`` over the group (``std`` with ddof=1, as TRL and verl compute it), or
``reward - mean`` with ``scale_advantages=False``.
"""

from __future__ import annotations

import math
from typing import Any, Callable, Mapping, NamedTuple, Optional

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from conduit_jax._pytree import replace, state_dataclass
from conduit_jax.errors import ConfigError, SpecError

ADVANTAGE_EPS = 1e-6


class RolloutSpec(NamedTuple):
    """What one rollout holds: per-token leaves (name -> dtype), each as long as the sequence; the buffer adds the
    per-sequence reward and prompt length and the per-group policy version."""

    group_size: int
    max_length: int
    token_leaves: Mapping[str, Any]

    def check(self, where: str = "RolloutSpec") -> "RolloutSpec":
        for name, value, low, why in (("group_size", self.group_size, 2, " (advantages compare a group's responses)"),
                                      ("max_length", self.max_length, 1, "")):
            _checked_int(value, name, where, low, why)
        if not self.token_leaves:
            raise ConfigError(f"{where}: token_leaves is empty; name at least the tokens, e.g. {{'tokens': np.int32}}")
        for name, dtype in self.token_leaves.items():
            if not isinstance(name, str):
                raise ConfigError(f"{where}: token leaf names must be strings, got {name!r}")
            try:
                np.dtype(dtype)
            except TypeError as error:
                raise ConfigError(f"{where}: token leaf {name!r} has dtype {dtype!r}, not a NumPy dtype") from error
        return self


def _checked_int(value, name: str, where: str, low: int, why: str = "") -> int:
    """``value`` as an int when it is one (not a bool) and at least ``low``, else a ConfigError naming it."""
    if not isinstance(value, (int, np.integer)) or isinstance(value, bool) or value < low:
        raise ConfigError(f"{where}: {name} must be an int >= {low}{why}, got {value!r}")
    return int(value)


class Groups(NamedTuple):
    """``k`` groups of rollouts, padded for transport: ``leaves[name]`` [k, G, max_length] (anything past a sequence's
    length is ignored), ``lengths`` int32[k, G], ``rewards`` float32[k, G], ``prompt_lengths`` int32[k, G],
    ``policy_version`` int32[k]. ``groups_from_lists`` builds one from ragged host lists and checks it. Inside a
    jit a group whose lengths are all 0 is absent (it may only follow the present ones): a step compiled for k
    groups then takes fewer."""

    leaves: dict
    lengths: Any
    rewards: Any
    prompt_lengths: Any
    policy_version: Any


class Layout(NamedTuple):
    """How a batch lays its sequences out: ``packed(rows, row_length)`` or ``padded()``."""

    name: str
    rows: Optional[int] = None
    row_length: Optional[int] = None


def packed(rows: int, row_length: int) -> Layout:
    """Sequences placed whole into a ``[rows, row_length]`` token budget, several per row."""
    return Layout("packed", _checked_int(rows, "rows", "rollouts.packed()", 1),
                  _checked_int(row_length, "row_length", "rollouts.packed()", 1))


def padded() -> Layout:
    """One sequence per row, padded to the spec's ``max_length`` (the layout packing is measured against)."""
    return Layout("padded")


@state_dataclass
class RolloutState:
    leaves: dict  # name -> [token_capacity] token ring
    start: Any  # int32[group_capacity, G]: ring offset of each sequence
    length: Any  # int32[group_capacity, G]
    prompt_length: Any  # int32[group_capacity, G]
    reward: Any  # float32[group_capacity, G]
    version: Any  # int32[group_capacity]: policy version the group was produced with
    span: Any  # int32[group_capacity, 2]: [begin, end) of the group's tokens in the ring
    live: Any  # bool[group_capacity]: stored whole (not retired by a later write)
    generation: Any  # int32[group_capacity]: writes of the slot
    cursor: Any  # int32[]: ring offset of the next group's tokens
    written: Any  # int32[]: groups ever ingested; the next goes to slot written % group_capacity
    read: Any  # int32[]: groups the queue has passed (delivered or dropped)
    policy_version: Any  # int32[]: the learner's
    delivered: Any  # int32[]: groups delivered
    dropped_stale: Any  # int32[]
    dropped_overwritten: Any  # int32[]


class RolloutBatch(NamedTuple):
    """A learner batch. Per token position ([rows, row_length] packed, [groups_per_batch * G, max_length] padded):
    ``leaves`` (every token leaf), ``segment_ids`` (0 padding, else the sequence's index in the batch + 1),
    ``positions``, ``loss_mask``, ``advantages``. Per sequence of the batch ([groups_per_batch * G], in group order):
    ``ids`` int32[., 2] (group slot, generation), ``rewards``, ``lengths``, ``versions`` (policy version),
    ``sequence_mask`` (delivered in this batch). ``groups``: groups delivered; ``valid``: at least one."""

    leaves: dict
    segment_ids: Any
    positions: Any
    loss_mask: Any
    advantages: Any
    ids: Any
    rewards: Any
    lengths: Any
    versions: Any
    sequence_mask: Any
    groups: Any
    valid: Any


class RolloutBuffer(NamedTuple):
    """Pure functions over a ``RolloutState`` (see the module docstring).

    init() -> state; ingest(state, groups) -> state; sample(state) -> (state, RolloutBatch);
    can_sample(state) -> bool[]; can_ingest(state, groups) -> bool[] (no undelivered group would be retired);
    set_policy_version(state, version) -> state; size(state) -> int32[] (undelivered groups still stored).
    ``sample`` is ``deliver(state, plan(state))``: ``plan`` chooses the groups and places their sequences
    (``BatchPlan``), ``deliver`` lays the batch out; a host program may plan with ``HostQueue`` instead, and then
    pass ``deliver(state, plan, rows=n)`` to lay out only the first ``n >= rows_needed(plan)`` rows.
    ``shardings``: the state's shardings (token rings split over the mesh, tables replicated)."""

    config: "RolloutConfig"
    spec: RolloutSpec
    init: Callable
    ingest: Callable
    sample: Callable
    can_sample: Callable
    can_ingest: Callable
    set_policy_version: Callable
    size: Callable
    plan: Callable
    deliver: Callable
    shardings: Any


def make_rollout_buffer(spec: RolloutSpec, token_capacity: int, group_capacity: int, groups_per_batch: int,
                        layout: Layout = None, *, max_staleness: Optional[int] = None, scale_advantages: bool = True,
                        mesh=None) -> RolloutBuffer:
    """Build the pure functions of a rollout buffer (see the module docstring); ``mesh`` splits the token rings."""
    where = "make_rollout_buffer()"
    spec = RolloutSpec(spec.group_size, spec.max_length, dict(spec.token_leaves)).check(where)
    layout = packed(8, 4 * spec.max_length) if layout is None else layout
    for name, value, low in (("token_capacity", token_capacity, spec.group_size * spec.max_length),
                             ("group_capacity", group_capacity, 1), ("groups_per_batch", groups_per_batch, 1)):
        _checked_int(value, name, where, low,
                     " (one group of sequences at max_length must fit)" if name == "token_capacity" else "")
    if groups_per_batch > group_capacity:
        raise ConfigError(f"{where}: groups_per_batch={groups_per_batch} exceeds group_capacity={group_capacity}")
    if max_staleness is not None and (not isinstance(max_staleness, (int, np.integer)) or max_staleness < 0):
        raise ConfigError(f"{where}: max_staleness must be None or an int >= 0 (policy versions), got "
                          f"{max_staleness!r}")
    if not isinstance(layout, Layout):
        raise ConfigError(f"{where}: layout must be rollouts.packed(rows, row_length) or rollouts.padded(), got "
                          f"{layout!r}")
    if layout.name == "packed":
        if layout.row_length < spec.max_length:
            raise ConfigError(f"{where}: packed row_length={layout.row_length} is shorter than max_length="
                              f"{spec.max_length}; a sequence is never split across rows")
        if (layout.row_length // spec.max_length) * layout.rows < spec.group_size:
            raise ConfigError(f"{where}: packed({layout.rows}, {layout.row_length}) may not hold one group of "
                              f"{spec.group_size} sequences of max_length={spec.max_length}; give at least "
                              f"{math.ceil(spec.group_size / (layout.row_length // spec.max_length))} rows")
    token_capacity, group_capacity = int(token_capacity), int(group_capacity)
    static = RolloutConfig(spec, token_capacity, group_capacity, int(groups_per_batch), layout,
                     None if max_staleness is None else int(max_staleness), bool(scale_advantages))
    shardings = _shardings(static, mesh)

    def init() -> RolloutState:
        return jax.jit(lambda: _init(static), out_shardings=shardings)()

    def placed(state: RolloutState) -> RolloutState:
        # every returned state keeps the buffer's shardings (else a jitted step's outputs come back with propagated
        # ones, and the next call compiles again)
        return jax.lax.with_sharding_constraint(state, shardings)

    full_rows = batch_rows(static)

    def deliver(state: RolloutState, plan: BatchPlan, rows: Optional[int] = None):
        if rows is not None:
            _checked_int(rows, "rows", "deliver()", 1)
            if rows > full_rows:
                raise ConfigError(f"deliver(): rows={rows} exceeds the layout's {full_rows}")
            needed = None if isinstance(plan.rows, jax.core.Tracer) else rows_needed(plan)
            if needed is not None and rows < needed:
                raise ConfigError(f"deliver(): rows={rows} would cut sequences the plan places in rows up to "
                                  f"{needed - 1}; give rows >= rollouts.rows_needed(plan)")
        state, batch = _deliver(static, state, plan, full_rows if rows is None else int(rows))
        return placed(state), batch

    return RolloutBuffer(
        config=static, spec=spec, init=init, shardings=shardings, deliver=deliver,
        plan=lambda state: _plan(static, state), sample=lambda state: deliver(state, _plan(static, state)),
        ingest=lambda state, groups: placed(_ingest(static, state, _checked_groups(static, groups))),
        can_sample=lambda state: jnp.any(_plan(static, state).taken),
        can_ingest=lambda state, groups: _can_ingest(static, state, _checked_groups(static, groups)),
        set_policy_version=lambda state, version: placed(
            replace(state, policy_version=jnp.asarray(version, jnp.int32))),
        size=lambda state: jnp.sum(_undelivered(static, state).astype(jnp.int32)),
    )


class RolloutConfig(NamedTuple):
    """A rollout buffer's static configuration (``RolloutBuffer.config``)."""

    spec: RolloutSpec
    token_capacity: int
    group_capacity: int
    groups_per_batch: int
    layout: Layout
    max_staleness: Optional[int]
    scale_advantages: bool


def _shardings(static: RolloutConfig, mesh):
    abstract = jax.eval_shape(lambda: _init(static))
    if mesh is None:
        mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("data",))
    axis = mesh.axis_names[0]
    split = static.token_capacity % mesh.devices.size == 0
    ring = NamedSharding(mesh, P(axis) if split else P())
    replicated = NamedSharding(mesh, P())
    return replace(jax.tree.map(lambda _: replicated, abstract),
                   leaves={name: ring for name in abstract.leaves})


def _init(static: RolloutConfig) -> RolloutState:
    spec, groups = static.spec, static.group_capacity
    table = jnp.zeros((groups, spec.group_size), jnp.int32)
    scalar = jnp.zeros((), jnp.int32)
    return RolloutState(
        leaves={name: jnp.zeros((static.token_capacity,), dtype) for name, dtype in spec.token_leaves.items()},
        start=table, length=table, prompt_length=table, reward=jnp.zeros((groups, spec.group_size), jnp.float32),
        version=jnp.zeros((groups,), jnp.int32), span=jnp.zeros((groups, 2), jnp.int32),
        live=jnp.zeros((groups,), bool), generation=jnp.zeros((groups,), jnp.int32), cursor=scalar, written=scalar,
        read=scalar, policy_version=scalar, delivered=scalar, dropped_stale=scalar, dropped_overwritten=scalar)


# -- ingest -----------------------------------------------------------------------------------------------------------
def groups_from_lists(spec: RolloutSpec, *, rewards, prompt_lengths, policy_version, **token_leaves) -> Groups:
    """Host lists of ragged rollouts as ``Groups``, checked: ``token_leaves[name][i][j]`` is the j-th response of the
    i-th prompt (a 1-D sequence, prompt tokens first), every leaf of one rollout as long as the others;
    ``rewards[i][j]`` and ``prompt_lengths[i][j]`` per rollout; ``policy_version`` an int (all groups) or one per
    group. Raises ``SpecError`` naming the leaf, prompt and response of the first misfit."""
    spec = spec.check("groups_from_lists()")
    where = "groups_from_lists()"
    if set(token_leaves) != set(spec.token_leaves):
        raise SpecError(f"{where}: token leaves {sorted(token_leaves)} do not match the spec's "
                        f"{sorted(spec.token_leaves)}")
    first = next(iter(spec.token_leaves))
    count = len(token_leaves[first])
    if count == 0:
        raise SpecError(f"{where}: no groups given (leaf {first!r} is empty)")
    size, longest = spec.group_size, spec.max_length
    leaves = {name: np.zeros((count, size, longest), np.dtype(dtype)) for name, dtype in spec.token_leaves.items()}
    lengths = np.zeros((count, size), np.int32)
    for name in spec.token_leaves:
        if len(token_leaves[name]) != count:
            raise SpecError(f"{where}: leaf {name!r} has {len(token_leaves[name])} groups, leaf {first!r} has {count}")
        for i, group in enumerate(token_leaves[name]):
            if len(group) != size:
                raise SpecError(f"{where}: leaf {name!r}, prompt {i}: a group holds group_size={size} responses, "
                                f"got {len(group)}")
            for j, sequence in enumerate(group):
                sequence = np.asarray(sequence)
                if sequence.ndim != 1 or not 1 <= sequence.shape[0] <= longest:
                    raise SpecError(f"{where}: leaf {name!r}, prompt {i}, response {j}: expected a 1-D sequence of "
                                    f"1..{longest} tokens (max_length), got shape {sequence.shape}")
                if name == first:
                    lengths[i, j] = sequence.shape[0]
                elif sequence.shape[0] != lengths[i, j]:
                    raise SpecError(f"{where}: leaf {name!r}, prompt {i}, response {j}: {sequence.shape[0]} tokens, "
                                    f"but leaf {first!r} has {lengths[i, j]} for the same rollout")
                leaves[name][i, j, :sequence.shape[0]] = _cast(sequence, leaves[name].dtype, name, where)
    versions = np.broadcast_to(np.asarray(policy_version), (count,))
    groups = Groups(leaves, lengths, np.asarray(rewards, np.float32) if _shape(rewards) == (count, size) else rewards,
                    np.asarray(prompt_lengths) if _shape(prompt_lengths) == (count, size) else prompt_lengths,
                    versions)
    return check_groups(spec, groups, where)


def _shape(values):
    """``np.shape``, or the string "ragged" for nested lists of unequal lengths."""
    try:
        return np.shape(values)
    except ValueError:
        return "ragged"


def _cast(values: np.ndarray, dtype: np.dtype, name: str, where: str) -> np.ndarray:
    if values.dtype == dtype or np.can_cast(values.dtype, dtype, "same_kind") or values.size == 0:
        return values
    raise SpecError(f"{where}: leaf {name!r} has dtype {values.dtype}, the spec says {dtype}")


def check_groups(spec: RolloutSpec, groups: Groups, where: str = "ingest()") -> Groups:
    """``groups`` checked against ``spec`` on the host (NumPy values: every field; device arrays are checked for
    shape and dtype only, reading them would wait): raises ``SpecError`` naming the field, prompt and response."""
    if not isinstance(groups, Groups):
        raise SpecError(f"{where}: expected rollouts.Groups (see groups_from_lists), got {type(groups).__name__}")
    if set(groups.leaves) != set(spec.token_leaves):
        raise SpecError(f"{where}: token leaves {sorted(groups.leaves)} do not match the spec's "
                        f"{sorted(spec.token_leaves)}")
    shape = _shape(groups.lengths)
    if shape == "ragged" or len(shape) != 2 or shape[0] == 0:
        raise SpecError(f"{where}: lengths must be int32[k, {spec.group_size}] with k >= 1 groups, got shape "
                        f"{shape}")
    count = shape[0]
    expected = {"lengths": ((count, spec.group_size), "i"), "rewards": ((count, spec.group_size), "f"),
                "prompt_lengths": ((count, spec.group_size), "i"), "policy_version": ((count,), "i")}
    expected.update({f"leaves[{name!r}]": ((count, spec.group_size, spec.max_length), np.dtype(dtype).kind)
                     for name, dtype in spec.token_leaves.items()})
    values = {"lengths": groups.lengths, "rewards": groups.rewards, "prompt_lengths": groups.prompt_lengths,
              "policy_version": groups.policy_version}
    values.update({f"leaves[{name!r}]": leaf for name, leaf in groups.leaves.items()})
    for field, (shape, kind) in expected.items():
        value = values[field]
        if _shape(value) != shape:
            raise SpecError(f"{where}: {field} has shape {_shape(value)}, expected {shape} "
                            f"(k={count} groups of group_size={spec.group_size})")
        dtype = np.dtype(value.dtype) if hasattr(value, "dtype") else np.asarray(value).dtype
        if dtype.kind != kind and not (kind == "f" and dtype.kind in "iu") and not (kind == "i" and dtype.kind == "u"):
            raise SpecError(f"{where}: {field} has dtype {dtype}, expected {'an integer' if kind in 'iu' else kind} "
                            f"dtype")
    if any(isinstance(value, jax.Array) for value in values.values()):
        return groups  # device arrays: values checked in the kernel's terms only (nothing is read back)
    lengths, prompts, rewards = (np.asarray(groups.lengths), np.asarray(groups.prompt_lengths),
                                 np.asarray(groups.rewards, np.float64))
    for field, bad, expectation in (
            ("lengths", (lengths < 1) | (lengths > spec.max_length), f"1..{spec.max_length} (max_length)"),
            ("prompt_lengths", (prompts < 0) | (prompts > lengths), "0..the sequence's length"),
            ("rewards", ~np.isfinite(rewards), "a finite number")):
        if bad.any():
            i, j = np.argwhere(bad)[0]
            value = np.asarray(values[field])[i, j].item()
            raise SpecError(f"{where}: {field} of prompt {i}, response {j} is {value!r}, expected {expectation}")
    return groups


def _checked_groups(static: RolloutConfig, groups: Groups) -> Groups:
    groups = check_groups(static.spec, groups)
    return Groups({name: jnp.asarray(leaf, static.spec.token_leaves[name]) for name, leaf in groups.leaves.items()},
                  jnp.asarray(groups.lengths, jnp.int32), jnp.asarray(groups.rewards, jnp.float32),
                  jnp.asarray(groups.prompt_lengths, jnp.int32), jnp.asarray(groups.policy_version, jnp.int32))


def _placement(static: RolloutConfig, state: RolloutState, groups: Groups):
    """Where each new group goes: its slot, its token region [begin, begin + total), and which stored groups (and
    which earlier groups of the same call) the writes retire. A group whose lengths are all 0 is absent (padding
    after the present ones, so a kernel compiled for k groups takes fewer): it takes no slot and writes nothing."""
    present = jnp.any(groups.lengths > 0, axis=1)  # [k]
    lengths = jnp.where(present[:, None], jnp.clip(groups.lengths, 1, static.spec.max_length), 0)
    totals = jnp.sum(lengths, axis=1)  # [k]

    def place(cursor, total):  # a group that would run past the ring's end starts again at 0 (never split)
        begin = jnp.where(cursor + total > static.token_capacity, 0, cursor)
        return begin + total, begin

    cursor, begins = lax.scan(place, state.cursor, totals)
    ends = begins + totals
    count = totals.shape[0]
    slots = jnp.where(present, (state.written + jnp.arange(count, dtype=jnp.int32)) % static.group_capacity,
                      static.group_capacity)  # absent: out of range, every write to it dropped
    # a stored group is retired when a new region overlaps its tokens or a new group takes its slot
    overlaps = present[:, None] & (state.span[None, :, 0] < ends[:, None]) & (begins[:, None] < state.span[None, :, 1])
    taken = jnp.zeros_like(state.live).at[slots].set(True, mode="drop")
    retired = state.live & (jnp.any(overlaps, axis=0) | taken)
    # a new group is retired at once by a later one of the same call (more tokens than the ring in one call)
    later = (jnp.arange(count)[None, :] > jnp.arange(count)[:, None]) & present[None, :]
    clobbered = jnp.any(later & (begins[None, :] < ends[:, None]) & (begins[:, None] < ends[None, :]), axis=1)
    clobbered |= jnp.any(later & (slots[None, :] == slots[:, None]), axis=1)
    return lengths, begins, ends, slots, cursor, retired, clobbered, jnp.sum(present.astype(jnp.int32))


def _queued(static: RolloutConfig, state: RolloutState):
    """The queue in order: the slot of each position from ``read`` on, and whether that position holds a group."""
    offsets = jnp.arange(static.group_capacity, dtype=jnp.int32)
    return (state.read + offsets) % static.group_capacity, state.read + offsets < state.written


def _undelivered(static: RolloutConfig, state: RolloutState):
    slots, queued = _queued(static, state)
    return jnp.zeros_like(state.live).at[slots].set(queued) & state.live


def _can_ingest(static: RolloutConfig, state: RolloutState, groups: Groups):
    retired = _placement(static, state, groups)[5]
    return ~jnp.any(retired & _undelivered(static, state))


def _ingest(static: RolloutConfig, state: RolloutState, groups: Groups) -> RolloutState:
    spec = static.spec
    lengths, begins, ends, slots, cursor, retired, clobbered, count = _placement(static, state, groups)
    offsets = jnp.cumsum(lengths, axis=1) - lengths  # [k, G]: each sequence's offset in its group's region
    starts = begins[:, None] + offsets
    steps = jnp.arange(spec.max_length, dtype=jnp.int32)
    # token (i, j, t) goes to ring offset starts[i, j] + t; past the sequence's end: out of range, dropped
    target = jnp.where(steps < lengths[..., None], starts[..., None] + steps, static.token_capacity).reshape(-1)
    leaves = {name: ring.at[target].set(groups.leaves[name].reshape(-1).astype(ring.dtype), mode="drop")
              for name, ring in state.leaves.items()}
    undelivered = _undelivered(static, state)
    live = (state.live & ~retired).at[slots].set(~clobbered, mode="drop")

    def put(table, values):
        return table.at[slots].set(values, mode="drop")

    return replace(
        state, leaves=leaves, start=put(state.start, starts), length=put(state.length, lengths),
        prompt_length=put(state.prompt_length, jnp.clip(groups.prompt_lengths, 0, lengths)),
        reward=put(state.reward, groups.rewards), version=put(state.version, groups.policy_version),
        span=put(state.span, jnp.stack([begins, ends], axis=1)), live=live,
        generation=state.generation.at[slots].add(1, mode="drop"), cursor=cursor, written=state.written + count,
        # the queue's reader is never more than a ring of slots behind the writer
        read=jnp.maximum(state.read, state.written + count - static.group_capacity),
        dropped_overwritten=state.dropped_overwritten + jnp.sum((retired & undelivered).astype(jnp.int32)))


# -- delivery ---------------------------------------------------------------------------------------------------------
class BatchPlan(NamedTuple):
    """Which groups a batch takes and where their sequences go: ``slots`` int32[M] (group slots, queue order),
    ``taken`` bool[M], ``rows`` / ``columns`` int32[M, G] (each sequence's first token), ``advance`` int32[] (queue
    positions the reader passes: all before the first deliverable group not taken), ``dropped_stale`` int32[]
    (stale groups among those passed). ``M`` is ``groups_per_batch``."""

    slots: Any
    taken: Any
    rows: Any
    columns: Any
    advance: Any
    dropped_stale: Any


def _plan(static: RolloutConfig, state: RolloutState) -> BatchPlan:
    """The next batch: the oldest deliverable groups, up to groups_per_batch; in a packed layout each of them that
    fits whole into what the earlier ones left (first fit, longest first within a group), so a later, shorter
    group may fill the rows' ends while a longer one waits to be the next batch's first (the head of the queue always
    fits an empty batch: the constructor checks the layout holds one group). The reader passes every group up to
    the first deliverable one left behind; groups taken beyond it leave the live set, so none is delivered twice."""
    spec, batch = static.spec, static.groups_per_batch
    slots, queued = _queued(static, state)
    live = state.live[slots] & queued
    fresh = live if static.max_staleness is None else live & (
        state.version[slots] >= state.policy_version - static.max_staleness)
    rank = jnp.cumsum(fresh.astype(jnp.int32))  # 1-based rank among deliverable positions
    # the first `batch` deliverable positions, in queue order
    pick = jnp.argsort(jnp.where(fresh & (rank <= batch), rank, static.group_capacity + rank), stable=True)[:batch]
    wanted = (fresh & (rank <= batch))[pick]  # [batch]
    chosen = slots[pick]
    lengths = jnp.where(wanted[:, None], state.length[chosen], 0)  # [batch, G]
    if static.layout.name == "packed":
        order = jnp.argsort(-lengths, axis=1, stable=True)

        def place_group(fill, group):
            sizes, members = group

            def place_one(fill, size):
                fits = fill + size <= static.layout.row_length
                row = jnp.argmax(fits)
                return fill.at[row].add(jnp.where(fits[row], size, 0)), (row, fill[row], fits[row])

            trial, (row, column, fits) = lax.scan(place_one, fill, sizes[members])
            ok = jnp.all(fits) & (sizes[0] > 0)
            rows_of = jnp.zeros_like(row).at[members].set(row)
            columns_of = jnp.zeros_like(column).at[members].set(column)
            return jnp.where(ok, trial, fill), (rows_of, columns_of, ok)

        _, (row, column, taken) = lax.scan(place_group, jnp.zeros((static.layout.rows,), jnp.int32),
                                           (lengths, order))
    else:
        row = jnp.arange(batch * spec.group_size, dtype=jnp.int32).reshape(batch, spec.group_size)
        column = jnp.zeros_like(row)
        taken = wanted
    left = fresh & ~jnp.zeros_like(fresh).at[pick].set(taken)  # deliverable positions not taken now
    advance = jnp.where(jnp.any(left), jnp.argmax(left), jnp.sum(queued.astype(jnp.int32)))
    passed = (jnp.arange(static.group_capacity) < advance) & queued
    return BatchPlan(chosen, taken, row.astype(jnp.int32), column.astype(jnp.int32), advance.astype(jnp.int32),
                     jnp.sum((passed & live & ~fresh).astype(jnp.int32)))


def batch_rows(config: RolloutConfig) -> int:
    """Rows of a whole batch of a buffer with ``config`` (``buffer.config``): the packed layout's rows, or one per
    sequence of ``groups_per_batch`` groups padded."""
    if config.layout.name == "packed":
        return config.layout.rows
    return config.groups_per_batch * config.spec.group_size


def rows_needed(plan: BatchPlan) -> int:
    """Rows a batch planned on the host (``HostQueue.plan()``) puts sequences in: they fill its first rows (first fit
    opens a row only when none before it has room; padded rows go in group order), so ``deliver(state, plan,
    rows=rows_needed(plan))`` lays out all of it. At least 1."""
    taken = np.asarray(plan.taken)
    return int(np.max(np.asarray(plan.rows)[taken])) + 1 if taken.any() else 1


def _deliver(static: RolloutConfig, state: RolloutState, plan: BatchPlan, rows: int):
    """Lay out the batch ``plan`` describes in its layout's first ``rows`` rows and move the queue's reader past
    it."""
    spec = static.spec
    slots, taken, row, column = plan.slots, plan.taken, plan.rows, plan.columns
    count = jnp.sum(taken.astype(jnp.int32))
    row_length = static.layout.row_length if static.layout.name == "packed" else spec.max_length
    group_size = spec.group_size
    mask = jnp.repeat(taken, group_size)  # [n] sequences delivered
    lengths = jnp.where(mask, state.length[slots].reshape(-1), 0)
    starts = state.start[slots].reshape(-1)
    prompts = state.prompt_length[slots].reshape(-1)
    rewards = state.reward[slots]  # [batch, G]
    # a group whose responses all scored the same carries no signal: exactly 0 (a mean rounded in float32 would
    # leave a residue that the division by a zero std blows up)
    same = jnp.all(rewards == rewards[:, :1], axis=1, keepdims=True)
    advantages = jnp.where(same, 0.0, rewards - jnp.mean(rewards, axis=1, keepdims=True))
    if static.scale_advantages:
        advantages = advantages / (jnp.std(rewards, axis=1, keepdims=True, ddof=1) + ADVANTAGE_EPS)
    advantages = advantages.reshape(-1)
    # one scatter finds each position's sequence (its index + 1, 0 on padding: sequence s covers flat positions
    # row * T + column + t for t < its length); every field is then a gather through it. XLA:CPU pays per element
    # scattered, and a scatter per field cost several times this (as did a running maximum over start markers)
    size = rows * row_length
    steps = jnp.arange(spec.max_length, dtype=jnp.int32)
    first = row.reshape(-1) * row_length + column.reshape(-1)  # [n] each sequence's first flat position
    sequence = jnp.arange(lengths.shape[0], dtype=jnp.int32)
    target = jnp.where(steps[None, :] < lengths[:, None], first[:, None] + steps, size).reshape(-1)
    segment = jnp.zeros((size,), jnp.int32).at[target].set(
        jnp.broadcast_to(sequence[:, None] + 1, (lengths.shape[0], spec.max_length)).reshape(-1), mode="drop")
    inside = segment > 0
    owner = jnp.maximum(segment - 1, 0)
    step = jnp.arange(size, dtype=jnp.int32) - first[owner]
    source = jnp.clip(starts[owner] + step, 0, static.token_capacity - 1)

    def lay(values):
        return jnp.where(inside, values, jnp.zeros((), values.dtype)).reshape(rows, row_length)

    out = RolloutBatch(
        leaves={name: lay(ring[source]) for name, ring in state.leaves.items()},
        segment_ids=segment.reshape(rows, row_length),
        positions=lay(step),
        loss_mask=lay(step >= prompts[owner]),
        advantages=lay(advantages[owner]),
        ids=jnp.stack([jnp.repeat(slots, group_size), jnp.repeat(state.generation[slots], group_size)], axis=1),
        rewards=rewards.reshape(-1), lengths=lengths, versions=jnp.repeat(state.version[slots], group_size),
        sequence_mask=mask, groups=count, valid=count > 0)
    # a delivered group leaves the live set (it may sit past the reader, behind a group that did not fit)
    live = state.live.at[jnp.where(taken, slots, static.group_capacity)].set(False, mode="drop")
    state = replace(state, live=live, read=state.read + plan.advance, delivered=state.delivered + count,
                    dropped_stale=state.dropped_stale + plan.dropped_stale)
    return state, out


# -- the host's bookkeeping -------------------------------------------------------------------------------------------
class HostQueue:
    """The group table's bookkeeping in NumPy, step for step what ``ingest`` and ``deliver`` do to the state, so that
    a host program (the plane's shell) knows without reading the device what an ingest would retire, how many groups
    are deliverable, and what the next batch takes (``plan()``: the same ``BatchPlan`` as ``buffer.plan`` computes
    on the device, to hand to ``buffer.deliver``). It needs only the lengths and policy versions of what is
    ingested."""

    def __init__(self, config: RolloutConfig):
        self.config = config
        groups, size = config.group_capacity, config.spec.group_size
        self.length = np.zeros((groups, size), np.int32)
        self.version = np.zeros(groups, np.int64)
        self.span = np.zeros((groups, 2), np.int64)
        self.live = np.zeros(groups, bool)
        self.cursor = self.written = self.read = self.policy_version = 0
        self.delivered = self.dropped_stale = self.dropped_overwritten = 0
        self._next = None  # next_batch(), kept until the queue changes (a check, then the draw, plan it once)
        self._placed = None  # (written, lengths, placement, retired) of the last _place: an ingest asks twice

    @classmethod
    def from_state(cls, config: RolloutConfig, state: RolloutState) -> "HostQueue":
        """The bookkeeping of a buffer whose state is ``state`` (device or host arrays, e.g. a restored checkpoint's;
        read here): every value the queue keeps is in the state, so this equals the queue that followed the ingests
        and deliveries which made it. Nothing may be staged (written to the queue, not yet to the state)."""
        table = jax.device_get((state.length, state.version, state.span, state.live))
        scalars = jax.device_get((state.cursor, state.written, state.read, state.policy_version, state.delivered,
                                  state.dropped_stale, state.dropped_overwritten))
        queue = cls(config)
        groups, size = config.group_capacity, config.spec.group_size
        for name, value, shape in (("length", table[0], (groups, size)), ("version", table[1], (groups,)),
                                   ("span", table[2], (groups, 2)), ("live", table[3], (groups,))):
            if np.shape(value) != shape:
                raise ConfigError(f"HostQueue.from_state(): state.{name} has shape {np.shape(value)}, the config "
                                  f"needs {shape}")
            getattr(queue, name)[...] = value  # in the queue's own dtypes
        (queue.cursor, queue.written, queue.read, queue.policy_version, queue.delivered, queue.dropped_stale,
         queue.dropped_overwritten) = (int(value) for value in scalars)
        return queue

    def set_policy_version(self, version: int) -> None:
        self.policy_version, self._next = int(version), None

    def _place(self, lengths: np.ndarray):
        """``(slots, begins, ends)`` of the new groups (int64[k] each) and the stored groups the writes retire
        (bool[group_capacity]). An ingest asks twice (may it run, then run it): the second time with the same lengths
        and no ingest between, it is the first answer (where groups go moves only with ingests; which stored groups
        are live is applied afresh)."""
        kept = self._placed
        if kept is not None and kept[0] == self.written and np.array_equal(kept[1], lengths):
            return kept[2], kept[3] & self.live
        capacity = self.config.token_capacity
        totals = np.clip(lengths, 1, self.config.spec.max_length).sum(axis=1, dtype=np.int64)
        ends = self.cursor + np.cumsum(totals)
        begins = ends - totals
        # a group that would run past the ring's end starts again at 0, and the ones after it follow on from there
        # (more than once only when one call brings more tokens than the ring holds)
        start = 0
        while True:
            past = np.flatnonzero(ends[start:] > capacity)
            if not past.size:
                break
            first = start + past[0]
            ends[first:] -= begins[first]
            begins[first:] -= begins[first]
            start = first + 1  # a group never holds more tokens than the ring
        slots = (self.written + np.arange(totals.shape[0])) % self.config.group_capacity
        retired = np.any((self.span[None, :, 0] < ends[:, None]) & (begins[:, None] < self.span[None, :, 1]), axis=0)
        retired[slots] = True
        self._placed = (self.written, np.array(lengths), (slots, begins, ends), retired)
        return (slots, begins, ends), retired & self.live

    def _queued_slots(self) -> np.ndarray:
        """The slot of each queue position from the reader on, oldest first."""
        return np.arange(self.read, self.written) % self.config.group_capacity

    def _fresh(self) -> np.ndarray:
        """bool[group_capacity]: slots holding a stored group fresh enough to deliver."""
        eta = self.config.max_staleness
        return self.live if eta is None else self.live & (self.version >= self.policy_version - eta)

    def undelivered(self) -> np.ndarray:
        """bool[group_capacity]: slots holding a group the queue has not passed."""
        queued = np.zeros_like(self.live)
        queued[self._queued_slots()] = True
        return queued & self.live

    def retires_undelivered(self, lengths, fresh_only: bool = False) -> int:
        """How many undelivered groups (``fresh_only``: that are still fresh enough to deliver) an ingest of groups
        with these ``lengths`` [k, G] would retire."""
        retired = self._place(np.asarray(lengths))[1] & self.undelivered()
        return int(np.sum(retired & self._fresh() if fresh_only else retired))

    def ingest(self, lengths, versions) -> None:
        self._next = None
        lengths, versions = np.asarray(lengths), np.asarray(versions)
        (slots, begins, ends), retired = self._place(lengths)
        self.dropped_overwritten += int(np.sum(retired & self.undelivered()))
        self.live &= ~retired
        # a later group of the same call may retire an earlier one (its slot, or its tokens: more than the ring)
        order = np.arange(slots.shape[0])
        later = order[None, :] > order[:, None]
        clobbered = np.any(later & ((slots[None, :] == slots[:, None])
                                    | ((begins[None, :] < ends[:, None]) & (begins[:, None] < ends[None, :]))), axis=1)
        # a slot is taken twice only by a call of more groups than slots: its last group is the one that stays
        last = slice(max(0, slots.shape[0] - self.config.group_capacity), None)
        self.live[slots[last]] = ~clobbered[last]
        self.length[slots[last]], self.version[slots[last]] = lengths[last], versions[last]
        self.span[slots[last], 0], self.span[slots[last], 1] = begins[last], ends[last]
        if slots.shape[0]:
            self.cursor = int(ends[-1])
        self.written += slots.shape[0]
        self.read = max(self.read, self.written - self.config.group_capacity)

    def deliverable(self) -> int:
        """Groups the queue would still deliver (stored, undelivered, fresh enough)."""
        return int(np.sum(self._fresh()[self._queued_slots()]))

    def plan(self) -> BatchPlan:
        """The next batch, as ``buffer.plan(state)`` computes it (NumPy arrays)."""
        return self.next_batch()[0]

    def next_batch(self) -> tuple[BatchPlan, bool, float]:
        """``(plan, full, fill)``: the next batch's plan; whether it is full (its window of ``groups_per_batch``
        groups, or in a packed layout a group it could not fit: it cannot grow); and the share of the batch its
        sequences fill (tokens of the budget packed, rows padded)."""
        if self._next is None:
            self._next = self._next_batch()
        return self._next

    def _next_batch(self) -> tuple[BatchPlan, bool, float]:
        config, size = self.config, self.config.spec.group_size
        batch = config.groups_per_batch
        slots, taken = np.zeros(batch, np.int32), np.zeros(batch, bool)
        rows, columns = np.zeros((batch, size), np.int32), np.zeros((batch, size), np.int32)
        packed = config.layout.name == "packed"
        fill = [0] * (config.layout.rows if packed else 1)  # tokens per row (Python: a few rows, many lookups)
        row_length = config.layout.row_length
        queued, fresh = self._queued_slots(), self._fresh()
        positions = np.flatnonzero(fresh[queued])[:batch + 1]  # the window, and the first position after it
        left = None  # the first deliverable position not taken
        for wanted, position in enumerate(positions):
            if wanted == batch:
                left = position if left is None else left
                break
            slot = queued[position]
            slots[wanted] = slot
            fits = True
            if packed:
                trial, lengths = list(fill), self.length[slot].tolist()
                placed_rows, placed_columns = [0] * size, [0] * size  # a member not placed keeps 0, as on the device
                for member in sorted(range(size), key=lengths.__getitem__, reverse=True):  # stable: longest first
                    length = lengths[member]
                    most = row_length - length  # the fullest a row may be to take it
                    for row, used in enumerate(trial):  # first fit
                        if used <= most:
                            break
                    else:
                        fits = False
                        break
                    placed_rows[member], placed_columns[member] = row, used
                    trial[row] = used + length
                rows[wanted], columns[wanted] = placed_rows, placed_columns
                if fits:
                    fill = trial
            else:
                rows[wanted] = wanted * size + np.arange(size)
            taken[wanted] = fits
            if not fits and left is None:
                left = position
        advance = self.written - self.read if left is None else int(left)
        passed = queued[:advance]
        stale = int(np.sum(self.live[passed] & ~fresh[passed]))
        plan = BatchPlan(slots, taken, rows, columns, np.int32(advance), np.int32(stale))
        full = bool(taken.all()) or bool(np.any(~taken[:min(len(positions), batch)]))
        share = sum(fill) / (config.layout.rows * config.layout.row_length) if packed else \
            float(taken.sum()) / batch
        return plan, full, share

    def commit(self, plan: BatchPlan) -> int:
        """Record that a batch of ``plan`` was dispatched; returns its groups."""
        self._next = None
        count = int(np.sum(plan.taken))
        self.live[np.asarray(plan.slots)[np.asarray(plan.taken)]] = False
        self.read += int(plan.advance)
        self.delivered += count
        self.dropped_stale += int(plan.dropped_stale)
        return count
