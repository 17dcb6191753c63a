"""The functional API: a replay buffer as pure functions over its state pytree, for code that runs inside ``jax.jit``.

A JAX learner that writes its whole loop as one compiled program (env step, add, sample, update inside ``lax.scan``)
builds a ``Buffer`` once and calls its functions inside the program::

    buffer = cj.make_buffer(spec, capacity=65_536, sampler=cj.samplers.uniform(256), mesh=cj.default_mesh(1))
    state = buffer.init(seed=0)

    @functools.partial(jax.jit, donate_argnums=0)
    def step(state, batch):
        state = buffer.ingest(state, batch)          # any static batch size
        state, delivery = buffer.sample(state)       # delivery.valid is False until the buffer can deliver
        ...
        return state

Every function is pure: it returns a new state and changes nothing else. They work under ``jax.jit`` (donate the
state, or XLA copies the ring it returns), inside ``lax.scan`` and ``lax.cond``, on one device and on a mesh: the
state keeps the shardings in ``buffer.shardings`` (the capacity axis split over the mesh) and sampling is exactly as
globally correct as the plane's. The state is the same pytree as ``ExperienceDataPlane.state``: hand it to a plane
(``ExperienceDataPlane(..., state=state)`` or ``plane.state = state``) to save a checkpoint, or start from a restored
plane's ``plane.state``.

Placement: a ``placement.Plan`` may put state in ``pinned_host`` or ``unpinned_host`` memory. Both work inside your
jit. A ring in ``pinned_host`` memory is read and written in place by a host computation, so inside your step only
the batch crosses to device memory (see ``storage``); call these functions under ``jax.jit`` for that (an eager call
reads a host ring through a device copy). For ``unpinned_host`` pass ``out_shardings`` for the state
(``jax.jit(step, donate_argnums=0, out_shardings=(buffer.shardings, ...))``): JAX places a jit's results in unpinned
host memory only there, and a donated unpinned-host state without it aborts XLA:CPU (JAX 0.10).

What the plane does on the host and these functions cannot do inside a trace: wait. A sample the state cannot serve
(too few items, the rate limiter refuses) returns the state unchanged and a ``Delivery`` whose ``valid`` is False;
``can_sample`` says so beforehand. Trace-time errors (a batch that does not match the spec, a priority update on a
sampler without priorities) are raised when the function is traced, naming the leaf or argument.
"""

from __future__ import annotations

import functools
from typing import Any, Callable, NamedTuple, Optional

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from conduit_jax import limits, memory, replay, samplers, storage
from conduit_jax.errors import CapacityError, ConfigError, PriorityError
from conduit_jax.limits import Limiter, Staleness
from conduit_jax.placement import Plan
from conduit_jax.replay import Delivery, ReplayConfig, ReplayState
from conduit_jax.samplers import Sampler
from conduit_jax.spec import ExperienceSpec


class Buffer(NamedTuple):
    """A replay buffer as pure functions over its state (see the module docstring).

    init(seed=0) -> state: an empty state, placed with ``shardings``.
    ingest(state, batch) -> state: write every item of ``batch`` (a leading item axis of any static size). A queue
      (``fifo``) refuses, outside a trace, a batch that would overwrite undelivered items
      (``CapacityError``, nothing written); inside a trace nothing can be refused, so check ``can_ingest`` first.
    sample(state, batches=None) -> (state, Delivery): one batch; ``Delivery.valid`` is False when the state cannot
      deliver. ``batches=k`` (static): k successive draws at once, with a leading [k] axis (not with importance
      weights).
    update(state, ids, priorities) -> state: new priorities for delivered ids (prioritized samplers).
    can_sample(state, batches=None) -> bool[]: whether ``sample`` would deliver a valid batch now.
    size(state) -> int32[]: items stored now (at most the capacity).
    set_policy_version(state, version) -> state: the learner's policy version (with ``staleness``).
    retire(state, ids) -> state: never draw these items again (prioritized and sequence samplers; an id whose slot
      was rewritten since is ignored). What an episode buffer that evicts whole episodes needs.
    read(state, rows) -> data: the items stored in global rows (``ids[:, 0]``), e.g. to follow links between items.
    item_ids(items) -> int32[n, 2] (host NumPy): the id of the ``items[i]``-th item ever ingested (0-based).
    can_ingest(state, n=1) -> bool[]: whether ``n`` more items fit without overwriting undelivered ones (always True
      unless the sampler is a queue).

    Every function checks that ``state`` is a state of this buffer (structure, shapes and dtypes: at trace time
    under jit), and raises ``ConfigError`` naming the leaf that differs.

    With a prioritized sampler, call ``ingest`` in a different jitted function from ``update`` and ``retire``: in one
    XLA:CPU program, a scatter into the sum tree beside an ingest's run write makes XLA copy every level of the tree
    (megabytes at 100,000 items). The results are the same either way; the plane's engine keeps them in separate
    kernels for you.
    """

    config: ReplayConfig
    shardings: Any  # a ReplayState of NamedSharding: where each leaf of the state lives
    init: Callable[..., ReplayState]
    ingest: Callable[[ReplayState, Any], ReplayState]
    sample: Callable[..., tuple[ReplayState, Delivery]]
    update: Callable[[ReplayState, Any, Any], ReplayState]
    can_sample: Callable[..., jax.Array]
    size: Callable[[ReplayState], jax.Array]
    set_policy_version: Callable[[ReplayState, Any], ReplayState]
    retire: Callable[[ReplayState, Any], ReplayState]
    read: Callable[[ReplayState, Any], Any]
    item_ids: Callable[[Any], np.ndarray]
    can_ingest: Callable[..., jax.Array]


def configure(spec, capacity: int, sampler: Optional[Sampler] = None, *, limiter: Optional[Limiter] = None,
              staleness: Optional[Staleness] = None, mesh: Optional[Mesh] = None, plan=None,
              where: str = "ExperienceDataPlane()") -> tuple[ReplayConfig, Any]:
    """The checked static configuration and the state's shardings (one ``NamedSharding`` per state leaf) for a
    buffer; the one constructor the plane and the functional API share. ``spec``: an ``ExperienceSpec`` or a pytree of
    ``jax.ShapeDtypeStruct``; ``sampler`` defaults to ``samplers.uniform(256)``, ``limiter`` to ``limits.min_size(1)``;
    ``mesh`` to ``default_mesh()``; a ``plan`` brings its mesh and memory kinds. ConfigError names what cannot work;
    ``CapacityError`` a state that does not fit the free memory it would be placed in (``memory.check_fits``), before
    anything is allocated."""
    spec = spec if isinstance(spec, ExperienceSpec) else ExperienceSpec.from_structs(spec)
    sampler = samplers.uniform(256) if sampler is None else sampler
    if not isinstance(sampler, Sampler):
        raise ConfigError(f"{where}: sampler must be a samplers.Sampler (e.g. samplers.uniform(256)), got "
                          f"{type(sampler).__name__}")
    limiter = limits.min_size(1) if limiter is None else limiter
    if not isinstance(limiter, Limiter):
        raise ConfigError(f"{where}: limiter must be a limits.Limiter (e.g. limits.sample_to_insert_ratio(...)), "
                          f"got {type(limiter).__name__}")
    limiter.check(sampler.batch_size, capacity)
    if plan is not None and mesh is not None:
        raise ConfigError(f"{where}: pass mesh or plan, not both (a plan brings its mesh: plan.mesh())")
    if mesh is not None and not isinstance(mesh, Mesh):
        raise ConfigError(f"{where}: mesh must be a jax.sharding.Mesh (e.g. conduit_jax.default_mesh(1)), got "
                          f"{type(mesh).__name__}")
    if plan is not None:
        check_plan(plan, None, where)
    mesh = plan.mesh() if plan is not None else replay.default_mesh() if mesh is None else mesh
    config = ReplayConfig(storage.RowLayout.of(spec), sampler, limiter, staleness, mesh, tuple(mesh.axis_names),
                          capacity if isinstance(capacity, int) else -1)
    check_config(config, capacity, where)
    if plan is not None:
        check_plan(plan, config, where)
    placed = replay.shardings(config) if plan is None else plan.shardings(config)
    if mesh.size == 1 and all(t == AxisType.Auto for t in mesh.axis_types):
        # written as XLA writes a one-device program's outputs: a state that went through a user's jit then has
        # the shardings it came in with, and the jit's next call finds its compiled program instead of compiling
        # (an Explicit axis keeps its spec in the type, and shard_map checks it)
        placed = jax.tree_util.tree_map(
            lambda s: NamedSharding(s.mesh, P(), memory_kind=s.memory_kind), placed)
    memory.check_fits(jax.eval_shape(functools.partial(replay.init, config, 0)), placed, config.capacity,
                      config.num_shards, where)
    return config, placed


def make_buffer(spec, capacity: int, sampler: Optional[Sampler] = None, *, limiter: Optional[Limiter] = None,
                staleness: Optional[Staleness] = None, mesh: Optional[Mesh] = None, plan=None) -> Buffer:
    """A ``Buffer`` for items of ``spec`` (an ``ExperienceSpec`` or a pytree of ``jax.ShapeDtypeStruct``).

    The arguments are the plane's (``ExperienceDataPlane``) and are checked the same way, on the host, before anything
    is traced: ``capacity`` and the sampler's batch size must be multiples of the shard count; ``mesh`` defaults to
    every local device on one axis, and a ``placement.Plan`` brings its mesh and memory kinds.
    """
    config, shardings = configure(spec, capacity, sampler, limiter=limiter, staleness=staleness, mesh=mesh,
                                  plan=plan, where="make_buffer()")
    return bind(config, shardings)


def bind(config: ReplayConfig, shardings) -> Buffer:
    """The ``Buffer`` of an already checked config and its state's shardings (``ExperienceDataPlane.buffer()``)."""
    sampler = config.sampler
    state_types = replay.StateTypes.of(config)  # every function checks the state it is given against this

    def init(seed: int = 0) -> ReplayState:
        if not isinstance(seed, (int, np.integer)) or isinstance(seed, bool):
            raise ConfigError(f"Buffer.init(): seed must be an int, got {seed!r}")
        return jax.jit(lambda: replay.init(config, int(seed)), out_shardings=shardings)()

    def ingest(state: ReplayState, batch) -> ReplayState:
        state_types.check(state, "Buffer.ingest()")
        n = replay.check_batch(config, batch, "Buffer.ingest()")
        if sampler.consumes and not isinstance(state.storage.cursor, jax.core.Tracer):
            # outside a trace a queue refuses what would overwrite undelivered items, as the plane does (inside one
            # nothing can be refused: check can_ingest first)
            _refuse_overflow(int(replay.deliverable(config, replay.computable(state, shardings))), n)
        batch = jax.tree_util.tree_map(jnp.asarray, batch)
        state = replay.computable(state, shardings)
        # one kernel writes at most a full ring per shard; a larger batch goes in chunks, in order
        for start, count, rows in replay.ingest_chunks(n, config):
            chunk = jax.tree_util.tree_map(lambda leaf: _padded(leaf[start:start + count], rows), batch)
            state = replay.ingest(config, state, chunk, jnp.int32(count))
        return replay.placed(state, shardings)

    def can_sample(state: ReplayState, batches: Optional[int] = None) -> jax.Array:
        state_types.check(state, "Buffer.can_sample()")
        replay.check_batches(config, batches, "Buffer.can_sample()")
        return _can_sample(replay.computable(state, shardings), batches)

    def can_ingest(state: ReplayState, n: int = 1) -> jax.Array:
        state_types.check(state, "Buffer.can_ingest()")
        if not isinstance(n, (int, np.integer)) or isinstance(n, bool) or n < 1:
            raise ConfigError(f"Buffer.can_ingest(): n must be an int >= 1, got {n!r}")
        if not sampler.consumes:
            return jnp.asarray(True)
        return replay.deliverable(config, replay.computable(state, shardings)) + n <= config.capacity

    def _refuse_overflow(pending: int, n: int) -> None:
        if pending + n > config.capacity:
            raise CapacityError(
                f"Buffer.ingest(): the {sampler.name} queue holds {pending} undelivered items of {config.capacity}; "
                f"{n} more would overwrite {pending + n - config.capacity} of them. Sample first, or ingest at most "
                f"{config.capacity - pending} items")

    def _can_sample(state: ReplayState, batches: Optional[int]) -> jax.Array:  # over a computable state
        draws = 1 if batches is None else batches
        # a queue hands each item out once: k batches need k batches' worth of undelivered items
        needed = sampler.min_items + (draws - 1) * sampler.batch_size * int(sampler.consumes)
        enough = replay.deliverable(config, state) >= needed
        admitted = config.limiter.can_sample(state.limiter, replay.size(config, state), sampler.batch_size * draws)
        return enough & jnp.asarray(admitted)

    def sample(state: ReplayState, batches: Optional[int] = None) -> tuple[ReplayState, Delivery]:
        state_types.check(state, "Buffer.sample()")
        replay.check_batches(config, batches, "Buffer.sample()")
        state = replay.computable(state, shardings)
        valid = _can_sample(state, batches)
        new_state, delivery = replay.sample(config, state, batches)
        # a refused draw changes nothing: every counter of the state stays as it was (storage is never written here)
        rest = jax.tree_util.tree_map(lambda new, old: jnp.where(valid, new, old), new_state.replace(storage=None),
                                      state.replace(storage=None))
        new_state = rest.replace(storage=state.storage)
        ids = jnp.where(valid, delivery.ids, -1)
        weights = None if delivery.weights is None else jnp.where(valid, delivery.weights, 0.0)
        return replay.placed(new_state, shardings), delivery._replace(ids=ids, weights=weights, valid=valid)

    def update(state: ReplayState, ids, priorities) -> ReplayState:
        if sampler.update is None:
            raise ConfigError(f"Buffer.update(): the {sampler.name} sampler has no priorities; build the buffer "
                              f"with samplers.prioritized(...) to use them")
        state_types.check(state, "Buffer.update()")
        ids = _checked_ids(ids, "Buffer.update()")
        priorities = priorities if isinstance(priorities, jax.Array) else np.asarray(priorities)
        if priorities.shape != (ids.shape[0],) or not (jnp.issubdtype(priorities.dtype, jnp.integer) or
                                                       jnp.issubdtype(priorities.dtype, jnp.floating)):
            raise PriorityError(f"Buffer.update(): priorities must be real numbers of shape ({ids.shape[0]},), one "
                                f"per id, got {priorities.dtype}{list(priorities.shape)}")
        priorities = jnp.asarray(priorities, jnp.float32)
        # inside a trace nothing can be refused: ids of no stored item (the -1 of an invalid delivery, rows out of
        # range) and priorities that are NaN, infinite or negative are skipped, and the rest applies
        valid = ((ids[:, 0] >= 0) & (ids[:, 0] < config.capacity) & (ids[:, 1] >= 1) & jnp.isfinite(priorities)
                 & (priorities >= 0))
        computable = replay.computable(state, shardings)
        new_sampler = replay.update(config, computable, ids, priorities, valid)
        return replay.placed(state.replace(sampler=new_sampler), shardings)

    def set_policy_version(state: ReplayState, version) -> ReplayState:
        state_types.check(state, "Buffer.set_policy_version()")
        version = _checked_version(version)
        new_state = replay.set_policy_version(config, replay.computable(state, shardings),
                                              jnp.maximum(version, state.policy_version))  # versions never go back
        return replay.placed(new_state, shardings)

    def retire(state: ReplayState, ids) -> ReplayState:
        if sampler.retire is None:
            raise ConfigError(f"Buffer.retire(): the {sampler.name} sampler keeps no index to remove items from; "
                              f"build the buffer with samplers.prioritized(...) (alpha=0 draws uniformly)")
        state_types.check(state, "Buffer.retire()")
        ids = _checked_ids(ids, "Buffer.retire()")
        valid = (ids[:, 0] >= 0) & (ids[:, 0] < config.capacity) & (ids[:, 1] >= 1)
        new_sampler = replay.retire(config, replay.computable(state, shardings), ids, valid)
        return replay.placed(state.replace(sampler=new_sampler), shardings)

    def read(state: ReplayState, rows):
        state_types.check(state, "Buffer.read()")
        rows = rows if isinstance(rows, jax.Array) else np.asarray(rows)
        if rows.ndim != 1 or not jnp.issubdtype(rows.dtype, jnp.integer):
            raise ConfigError(f"Buffer.read(): rows must be a 1-d integer array (ids[:, 0]), got "
                              f"{rows.dtype}{list(rows.shape)}")
        _refuse_wider_than_int32(rows, "rows", "Buffer.read()", ConfigError)
        return replay.read(config, replay.computable(state, shardings), jnp.asarray(rows, jnp.int32))

    def size(state: ReplayState) -> jax.Array:
        state_types.check(state, "Buffer.size()")
        return replay.size(config, replay.computable(state, shardings))

    return Buffer(config, shardings, init, ingest, sample, update, can_sample, size, set_policy_version,
                  retire, read, functools.partial(replay.item_ids, config), can_ingest)


def _checked_ids(ids, where: str) -> jax.Array:
    ids = ids if isinstance(ids, jax.Array) else np.asarray(ids)
    if ids.ndim != 2 or ids.shape[1] != 2 or not jnp.issubdtype(ids.dtype, jnp.integer):
        raise PriorityError(f"{where}: ids must be an integer array of shape (m, 2) as in Delivery.ids, got "
                            f"{ids.dtype}{list(ids.shape)}")
    _refuse_wider_than_int32(ids, "ids", where, PriorityError)
    return jnp.asarray(ids, jnp.int32)


def _refuse_wider_than_int32(values, name: str, where: str, error) -> None:
    """``error`` unless the concrete integer array ``values`` fits int32: narrowed, an id of 2**32 + 3 would name
    row 3 (a traced array is already int32)."""
    if isinstance(values, jax.core.Tracer) or values.dtype.itemsize < 4 or values.dtype == np.int32:
        return
    values = np.asarray(values)
    wide = np.flatnonzero((values < np.iinfo(np.int32).min) | (values > np.iinfo(np.int32).max))
    if wide.size:
        raise error(f"{where}: {name} must fit int32 (ids are int32 as in Delivery.ids), got "
                    f"{values.reshape(-1)[wide[0]]} at flat index {wide[0]}")


def _checked_version(version) -> jax.Array:
    """The policy version as an int32 scalar; ConfigError naming it unless it is an integer that fits."""
    where = "Buffer.set_policy_version()"
    if isinstance(version, jax.Array):
        if version.shape != () or not jnp.issubdtype(version.dtype, jnp.integer):
            raise ConfigError(f"{where}: version must be an integer scalar, got {version.dtype}{list(version.shape)}")
        _refuse_wider_than_int32(version, "version", where, ConfigError)
        return version.astype(jnp.int32)
    if not isinstance(version, (int, np.integer)) or isinstance(version, bool) or not 0 <= version < 2**31:
        raise ConfigError(f"{where}: version must be an int in [0, 2**31), got {version!r}")
    return jnp.asarray(version, jnp.int32)


def _padded(leaf: jax.Array, rows: int) -> jax.Array:
    """``leaf`` with zero rows appended up to ``rows`` (the padding rows are never written: see storage.write)."""
    if leaf.shape[0] == rows:
        return leaf
    return jnp.pad(leaf, [(0, rows - leaf.shape[0])] + [(0, 0)] * (leaf.ndim - 1))


# ------------------------------------------------------------------------------------------------------------------
# configuration checks (host side, before anything is allocated)
# ------------------------------------------------------------------------------------------------------------------
def check_plan(plan, config: Optional[ReplayConfig], where: str = "ExperienceDataPlane()") -> None:
    """ConfigError unless ``plan`` is a ``placement.Plan`` (made for this config's capacity and row size, when
    ``config`` is given)."""
    if not isinstance(plan, Plan):
        raise ConfigError(f"{where}: plan must be a placement.Plan, got {type(plan).__name__}")
    if config is not None and (plan.capacity != config.capacity or plan.row_bytes != config.layout.row_bytes):
        raise ConfigError(f"{where}: the plan was made for capacity {plan.capacity} with "
                          f"{plan.row_bytes}-byte rows, this plane has capacity {config.capacity} with "
                          f"{config.layout.row_bytes}-byte rows; plan for this spec and capacity")




def check_config(config: ReplayConfig, capacity, where: str = "ExperienceDataPlane()") -> None:
    """ConfigError naming the argument unless the sampler, capacity, mesh and staleness bound can work together."""
    shards = config.num_shards
    if not isinstance(capacity, int) or isinstance(capacity, bool) or capacity < 1:
        raise ConfigError(f"{where}: capacity must be a positive int, got {capacity!r}")
    if capacity % shards:
        lower, upper = capacity - capacity % shards, capacity + shards - capacity % shards
        raise ConfigError(f"{where}: capacity {capacity} is not a multiple of the {shards} shards of "
                          f"mesh axes {config.axes}; use {upper}" + (f" or {lower}" if lower else ""))
    batch = config.sampler.batch_size
    if batch % shards:
        raise ConfigError(f"{where}: batch_size {batch} of the {config.sampler.name} sampler is not a "
                          f"multiple of the {shards} shards (the batch is delivered sharded); use "
                          f"{batch + shards - batch % shards}")
    if config.sampler.min_items > capacity:
        raise ConfigError(f"{where}: the {config.sampler.name} sampler needs {config.sampler.min_items} "
                          f"items per batch but capacity is {capacity}")
    sampler = config.sampler
    if sampler.streams > 1 or sampler.window > 1:
        stride = sampler.streams // shards
        if sampler.streams % shards:
            raise ConfigError(f"{where}: the {sampler.name} sampler's streams ({sampler.streams}) must be "
                              f"a multiple of the {shards} shards so each stream lives in one shard")
        if config.shard_capacity % stride or config.shard_capacity // stride < sampler.window:
            raise ConfigError(f"{where}: each shard holds {config.shard_capacity} slots for {stride} "
                              f"streams; it must be a multiple of {stride} and hold at least {sampler.window} steps "
                              f"per stream (capacity >= {sampler.window * sampler.streams}, a multiple of "
                              f"{sampler.streams})")
    spec = config.layout.spec
    for key in sampler.needs:
        if key not in spec.names or spec.dtypes[spec.names.index(key)] != np.bool_ or \
                spec.shapes[spec.names.index(key)] != ():
            raise ConfigError(f"{where}: the {sampler.name} sampler needs a per-item bool leaf '{key}' "
                              f"(episode ends); the spec is {spec}")
    staleness = config.staleness
    if staleness is not None:
        if not isinstance(staleness, Staleness) or not isinstance(staleness.max_versions, int) or \
                isinstance(staleness.max_versions, bool) or not 0 <= staleness.max_versions < 2**31:
            raise ConfigError(f"{where}: staleness must be limits.Staleness(max_versions in [0, 2**31), key) "
                              f"(versions are int32), got {staleness!r}")
        if staleness.key not in spec.names or spec.dtypes[spec.names.index(staleness.key)] != np.int32 or \
                spec.shapes[spec.names.index(staleness.key)] != ():
            raise ConfigError(f"{where}: staleness needs a per-item int32 leaf '{staleness.key}' (the "
                              f"policy version each item was produced with); the spec is {spec}")
    if capacity > replay.MAX_CAPACITY:
        raise ConfigError(f"{where}: capacity must be below 2**31 (int32 row ids: at most {replay.MAX_CAPACITY:,}), got "
                          f"{capacity:,}")
