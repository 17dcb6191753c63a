"""Staged ingest (``staging.py``, ``Engine.ingest(staged=True)``): an ingest is a host copy, and the next kernel writes it.

The contract: a plane that stages behaves exactly as the eager baseline (``schedule.sync()``) call for call (every
delivery, refusal and the final state bit-identical, for every sampler, on 1 and 8 devices), while an ingest
dispatches no kernel; staged items count for ``len()``, the rate limiter and a queue's capacity at once; a batch
larger than the staging area is written one full area per kernel; checkpoints and ``block_until_ready`` include what
is staged; a prefetching schedule's refill carries the write, so the learner's thread runs no kernel.
"""

import threading

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from conduit_jax import ExperienceDataPlane, default_mesh, engine, limits, replay, samplers, schedule
from conduit_jax.errors import CapacityError, ConduitError, ConfigError, RateLimitedError

SPEC = {"obs": jax.ShapeDtypeStruct((3,), jnp.float32), "g": jax.ShapeDtypeStruct((), jnp.int32),
        "version": jax.ShapeDtypeStruct((), jnp.int32), "terminated": jax.ShapeDtypeStruct((), jnp.bool_),
        "truncated": jax.ShapeDtypeStruct((), jnp.bool_)}


def batch(start: int, n: int, version: int = 0) -> dict:
    g = np.arange(start, start + n, dtype=np.int32)
    return {"obs": np.stack([g * 0.5, -g, g + 0.25], axis=1).astype(np.float32), "g": g,
            "version": np.full(n, version, np.int32), "terminated": g % 11 == 10, "truncated": g % 13 == 12}


def on_mesh(tree, mesh):
    """``tree`` as device arrays replicated over ``mesh`` (a device batch: written as it is, not staged)."""
    return jax.device_put(tree, NamedSharding(mesh, P()))


CASES = {
    "uniform": lambda: samplers.uniform(8),
    "fifo": lambda: samplers.fifo(8),
    "prioritized": lambda: samplers.prioritized(8, 0.6, 0.4),
    "prioritized-max-times": lambda: samplers.prioritized(8, 0.6, 0.4, max_times_sampled=2),
    "epochs": lambda: samplers.epochs(8),
    "sequences": lambda: samplers.sequences(8, 2, streams=8),
    "sequences-padded": lambda: samplers.sequences(8, 2, streams=8, pad=True),
}


def _outcome(call):
    """What a call returned (host copies of a delivery), or the type of what it raised."""
    try:
        result = call()
    except ConduitError as error:
        return type(error).__name__
    return None if result is None else [np.asarray(leaf) for leaf in jax.tree_util.tree_leaves(result)]


def _script(plane, mesh, has_priorities: bool):
    """One call sequence with every order of host work the engine keeps: updates before staged rows, an update after
    staged rows, a device batch between staged ones, a refused ingest, a version switch, reads of the state."""
    outcomes = []
    run = lambda call: outcomes.append(_outcome(call))  # noqa: E731
    run(lambda: plane.ingest(batch(0, 24)))
    run(lambda: plane.ingest(batch(24, 8)))
    outcomes.append(len(plane))
    first = plane.sample()
    outcomes.append(_outcome(lambda: first))
    if has_priorities:  # reported before the next ingest: the next kernel applies it, then writes the rows
        run(lambda: plane.update_priorities(first.ids, np.linspace(0.5, 3.0, 8, dtype=np.float32)))
    run(lambda: plane.ingest(batch(32, 16)))
    if has_priorities:  # reported after a staged ingest: those rows are written first
        run(lambda: plane.update_priorities(first.ids, np.linspace(4.0, 1.0, 8, dtype=np.float32)))
    run(plane.sample)
    run(lambda: plane.ingest(on_mesh(batch(48, 8), mesh)))
    run(lambda: plane.ingest(batch(56, 8)))
    run(lambda: plane.ingest(batch(64, 40)))  # a queue refuses to overwrite undelivered items; others wrap
    outcomes.append(len(plane))
    for _ in range(3):
        run(plane.sample)
    run(lambda: plane.ingest(batch(104, 8, version=1)))
    plane.set_policy_version(1)
    run(plane.sample)
    run(lambda: plane.ingest(batch(112, 16, version=1)))
    outcomes.append(plane.stats()["size"])
    run(plane.sample)
    run(lambda: plane.ingest(batch(128, 8, version=1)))
    outcomes.append([np.asarray(leaf) for leaf in jax.tree_util.tree_leaves(jax.device_get(plane.state))])
    return outcomes


# every sampler on one device; on the 8-device mesh the default run covers the samplers whose state is per shard
# and order-sensitive (queue, priority tree), the rest run with -m slow
SHARDED_IN_DEFAULT_RUN = ("fifo",)


@pytest.mark.parametrize("case", [pytest.param(case, marks=() if case in SHARDED_IN_DEFAULT_RUN else pytest.mark.slow)
                                  for case in sorted(CASES)])
def test_a_staging_plane_is_call_for_call_the_eager_baseline_on_8_devices(case):
    _check_call_for_call(default_mesh(8), case)


@pytest.mark.parametrize("case", [pytest.param(case, marks=pytest.mark.slow) if case == "prioritized-max-times"
                                  else case for case in sorted(CASES)])
def test_a_staging_plane_is_call_for_call_the_eager_baseline(case):
    """Deliveries, refusals, sizes and the final state are bit-identical under sync and staged, for every sampler."""
    _check_call_for_call(default_mesh(1), case)


def _check_call_for_call(mesh, case):
    outcomes = {}
    dispatches = {}
    for chosen in (schedule.sync(), schedule.staged()):
        plane = ExperienceDataPlane(SPEC, 64, CASES[case](), mesh=mesh, seed=5, schedule=chosen,
                                    staleness=limits.Staleness(1, "version"))
        outcomes[chosen.name] = _script(plane, mesh, plane.sampler.update is not None)
        dispatches[chosen.name] = sum(plane.engine.dispatches.values())
    for index, (eager, staged) in enumerate(zip(outcomes["sync"], outcomes["staged"], strict=True)):
        if isinstance(eager, list):
            assert len(eager) == len(staged), index
            for a, b in zip(eager, staged):
                np.testing.assert_array_equal(a, b, err_msg=f"outcome {index} of {case}")
        else:
            assert eager == staged, (index, eager, staged)
    assert dispatches["staged"] < dispatches["sync"], dispatches


def test_an_ingest_is_a_copy_and_the_next_draw_writes_it(mesh):
    """Staged ingests dispatch nothing, count at once, and the next sample is one kernel that sees every item."""
    plane = ExperienceDataPlane(SPEC, 64, samplers.fifo(32), mesh=mesh)
    plane.ingest(batch(0, 8))
    before = sum(plane.engine.dispatches.values())
    for start in range(8, 32, 8):
        plane.ingest(batch(start, 8))
    assert len(plane) == 32 and plane.can_sample()
    assert sum(plane.engine.dispatches.values()) == before  # no kernel: the status is kept on the host
    delivery = plane.sample()
    assert sum(plane.engine.dispatches.values()) == before + 1
    assert sorted(np.asarray(delivery.data["g"]).tolist()) == list(range(32))


def test_item_counts_past_the_kept_ones_are_written_alike_and_compile_nothing_new(mesh, monkeypatch):
    """A staged block's item count goes to its kernel as a device scalar, kept for the first counts seen; a count
    past them is placed per call as the same kind of argument, so it writes the same items and compiles nothing."""
    monkeypatch.setattr(engine, "MAX_KEPT_COUNTS", 1)
    plane = ExperienceDataPlane(SPEC, 64, samplers.fifo(8), mesh=mesh)
    queue, start, compiled = [], 0, None
    for cycle in range(2):
        for count in (9, 10, 8):  # one block per draw: 9 is kept, 10 (a block of as many rows) and 8 placed per call
            plane.ingest(batch(start, count))
            queue += range(start, start + count)
            start += count
            assert sorted(np.asarray(plane.sample().data["g"]).tolist()) == queue[:8]
            del queue[:8]
        if cycle == 0:
            compiled = plane.compile_counts()
            assert set(compiled.values()) == {1}, compiled  # a kept count and a placed one share a kernel
    assert plane.compile_counts() == compiled


def test_a_device_batch_is_packed_by_a_kernel_of_its_own_and_written_by_the_next_draw(mesh):
    """A device batch on the plane's mesh, staged: one small kernel packs its rows (without the state) and the next
    draw writes them, in ingest order between host batches; the plane's copy is its own, so the caller may donate
    its arrays at once. Under sync it is written at its call."""
    plane = ExperienceDataPlane(SPEC, 64, samplers.fifo(24), mesh=mesh, schedule=schedule.staged())
    plane.ingest(batch(0, 8))
    device = on_mesh(batch(8, 8), mesh)
    plane.ingest(device)  # the host rows are written first (one block waits at a time)
    jax.jit(lambda tree: jax.tree.map(lambda x: x + 1, tree), donate_argnums=0)(device)  # the caller donates it
    plane.ingest(batch(16, 8))  # the device rows first
    dispatched = dict(plane.engine.dispatches)
    assert dispatched.pop("pack[8]") == 1 and sum(dispatched.values()) == 2, plane.engine.dispatches
    assert len(plane) == 24
    delivery = plane.sample()
    g = np.asarray(delivery.data["g"])
    assert sorted(g.tolist()) == list(range(24))
    np.testing.assert_array_equal(np.asarray(delivery.data["obs"]), batch(0, 24)["obs"][g])
    eager = ExperienceDataPlane(SPEC, 64, samplers.fifo(8), mesh=mesh, schedule=schedule.sync())
    eager.ingest(on_mesh(batch(0, 8), mesh))
    assert "pack[8]" not in eager.engine.dispatches and sum(eager.engine.dispatches.values()) == 1


def test_staged_items_count_for_a_queue_and_the_rate_limiter(mesh):
    queue = ExperienceDataPlane(SPEC, 16, samplers.fifo(8), mesh=mesh)
    queue.ingest(batch(0, 16))
    with pytest.raises(CapacityError, match="holds 16 undelivered items of 16"):
        queue.ingest(batch(16, 8))
    assert queue.engine.staging.count == 16 and len(queue) == 16  # the refused batch left nothing behind
    assert sorted(np.asarray(queue.sample().data["g"]).tolist()) == list(range(8))

    limited = ExperienceDataPlane(SPEC, 64, samplers.uniform(8), mesh=mesh,
                                  limiter=limits.sample_to_insert_ratio(1.0, 8, 8.0))
    limited.ingest(batch(0, 8))
    limited.ingest(batch(8, 8))
    with pytest.raises(RateLimitedError):  # 16 staged inserts, nothing sampled: past the error buffer
        limited.ingest(batch(16, 8))
    assert limited.engine.staging.count == 16
    limited.sample()
    limited.ingest(batch(16, 8))


def test_a_batch_larger_than_the_staging_area_is_written_one_full_area_per_kernel(mesh):
    plane = ExperienceDataPlane(SPEC, 128, samplers.fifo(8), mesh=mesh, staging=16)
    plane.ingest(batch(0, 4))  # the status is read here, before anything is staged
    start = dict(plane.engine.dispatches)
    plane.ingest(batch(4, 40))  # fills the area (12 more), written; 16 more, written; 12 stay staged
    new = {name: count - start.get(name, 0) for name, count in plane.engine.dispatches.items()}
    rows = engine.staged_rows(16, plane.num_shards, plane.config.shard_capacity)
    assert {name: count for name, count in new.items() if count} == {f"ingest[{rows},packed]": 2}
    assert plane.engine.staging.count == 12 and len(plane) == 44
    got = [sorted(np.asarray(plane.sample().data["g"]).tolist()) for _ in range(5)]
    assert got == [list(range(8 * i, 8 * i + 8)) for i in range(5)]
    with pytest.raises(ConduitError, match="staging must be an int in"):
        ExperienceDataPlane(SPEC, 128, samplers.fifo(8), mesh=mesh, staging=129)


def test_save_and_block_until_ready_include_staged_items(mesh, tmp_path):
    plane = ExperienceDataPlane(SPEC, 64, samplers.uniform(8), mesh=mesh)
    eager = ExperienceDataPlane(SPEC, 64, samplers.uniform(8), mesh=mesh, schedule=schedule.sync())
    for target in (plane, eager):
        target.ingest(batch(0, 20))
    assert plane.engine.staging.count == 20
    plane.block_until_ready()
    assert plane.engine.staging.count == 0
    plane.ingest(batch(20, 12))
    eager.ingest(batch(20, 12))
    plane.save(tmp_path, block=True)
    restored = ExperienceDataPlane.restore(tmp_path, mesh=mesh)
    for a, b in zip(jax.tree_util.tree_leaves(jax.device_get(restored.state)),
                    jax.tree_util.tree_leaves(jax.device_get(eager.state))):
        np.testing.assert_array_equal(a, b)


def test_under_a_prefetching_schedule_the_learners_thread_runs_no_kernel(mesh):
    """A host-fed loop (ingest, deliver) under overlap: after warm-up every kernel runs on the delivery worker, whose
    refills write the staged items; nothing compiles any more; every ingested item is delivered once, in order (FIFO).
    ``in_flight()`` lets the worker finish its refill first (a learner step would), so no deliver() finds the queue
    empty and draws on its own thread."""
    learner = threading.get_ident()
    on_learner: list = []

    class ThreadCounts(dict):
        def __setitem__(self, name, count):
            super().__setitem__(name, count)
            if threading.get_ident() == learner:
                on_learner.append(name)

    plane = ExperienceDataPlane(SPEC, 256, samplers.fifo(8), mesh=mesh, schedule=schedule.overlap(2))
    try:
        delivered = []
        for step in range(24):
            if step == 4:  # warmed up: compiled, and the worker keeps batches in flight
                plane.block_until_ready()
                compiled = plane.compile_counts()
                plane.engine.dispatches = ThreadCounts(plane.engine.dispatches)
            plane.ingest(batch(8 * step, 8))
            plane.in_flight()
            delivered += sorted(np.asarray(plane.deliver(timeout=5.0).data["g"]).tolist())
        assert on_learner == []
        assert plane.compile_counts() == compiled
        assert delivered == list(range(8 * 24))
    finally:
        plane.close()


# ----------------------------------------------------------------------------------------------------------------------
# a caller's own step (Engine.add_step / Engine.call) rides the same kernel as the updates and staged rows
# ----------------------------------------------------------------------------------------------------------------------
def _peek(config):
    """A step that reads every stored item's ``g`` and returns the sampler's state (its priorities)."""
    def peek(state, rows):
        return state, replay.read(config, state, rows)["g"], state.sampler
    return peek


def _cycle(plane, start: int):
    """A draw, its priority update (pending: nothing is staged), then a staged ingest of 8 items."""
    drawn = plane.sample()
    plane.update_priorities(drawn.ids, np.linspace(0.5, 6.0, 8, dtype=np.float32) + start)
    plane.ingest(batch(start, 8))


def test_a_callers_step_sees_every_staged_row_and_pending_update(mesh):
    """A step given to the engine runs after the pending updates and the staged rows, all in its kernel (the updates
    and the rows in one pass over the sum tree), and sees exactly what an eager plane holds."""
    eager, staged = (ExperienceDataPlane(SPEC, 64, samplers.prioritized(8, 0.6, 0.4), mesh=mesh, seed=3)
                     for _ in range(2))
    rows = np.arange(64, dtype=np.int32)
    staged.engine.add_step("peek", _peek(staged.config), 2)
    for plane in (eager, staged):
        plane.ingest(batch(0, 16))
    for start in (16, 24, 32):
        _cycle(eager, start)
        eager.engine.flush()
        _cycle(staged, start)
        assert staged.engine.pending and staged.engine.staging.count == 8
        before = dict(staged.engine.dispatches)
        compiles = dict(staged.engine.compiles)
        g, sampler = staged.engine.call("peek", rows)
        new = {k: v - before.get(k, 0) for k, v in staged.engine.dispatches.items() if v != before.get(k, 0)}
        name, = new  # one dispatch: the updates, the rows and the step
        assert new[name] == 1 and name.startswith("update[8]+ingest[") and name.endswith("+peek"), new
        if start == 32:  # steady state: the same kernel again, nothing compiled
            assert staged.engine.compiles == compiles
        assert not staged.engine.pending and staged.engine.staging.count == 0
        assert set(np.asarray(g).tolist()) == set(range(start + 8))  # rows not written yet read as zeros
        expected = jax.tree_util.tree_leaves(eager.engine.state.sampler)
        for got, want in zip(jax.tree_util.tree_leaves(sampler), expected):
            np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    assert staged.engine.kernel_cache_sizes()[name] == 1
    # the state the steps leave is the eager plane's, and its draws too
    for a, b in zip(jax.tree_util.tree_leaves(eager.engine.state), jax.tree_util.tree_leaves(staged.engine.state)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    np.testing.assert_array_equal(np.asarray(eager.sample().ids), np.asarray(staged.sample().ids))


def test_a_step_with_rows_apart_runs_after_a_kernel_that_writes_the_staged_rows(mesh):
    """``add_step(..., rows_apart=True)`` (a step that scatters into the sum tree): the pending update, then the staged
    rows, in one kernel (one pass over the sum tree), then the step in a kernel of its own; the step still sees every
    row."""
    plane = ExperienceDataPlane(SPEC, 64, samplers.prioritized(8, 0.6, 0.4), mesh=mesh, seed=3)
    plane.engine.add_step("peek", _peek(plane.config), 2, rows_apart=True)
    plane.ingest(batch(0, 16))
    _cycle(plane, 16)
    before = dict(plane.engine.dispatches)
    g, _ = plane.engine.call("peek", np.arange(64, dtype=np.int32))
    new = {k: v - before.get(k, 0) for k, v in plane.engine.dispatches.items() if v != before.get(k, 0)}
    rows_kernel, = [kernel for kernel in new if "ingest[" in kernel]
    assert new == {rows_kernel: 1, "peek": 1} and rows_kernel.startswith("update[8]+ingest["), new
    assert set(np.asarray(g).tolist()) == set(range(24))


def test_a_callers_step_may_consume_its_arguments_and_write_storage(mesh):
    plane = ExperienceDataPlane(SPEC, 64, samplers.uniform(8), mesh=mesh)
    config = plane.config

    def count_and_write(state, counter, rows):
        state = replay.ingest(config, state, rows, 8, packed=False)
        return state, counter + 1

    plane.engine.add_step("count", count_and_write, 1, writes=True, donates=(0,))
    counter = jax.device_put(jnp.zeros((4,), jnp.int32), NamedSharding(mesh, P()))
    plane.ingest(batch(0, 8))
    rows = on_mesh({k: jnp.asarray(v) for k, v in batch(8, 8).items()}, mesh)
    counter, = plane.engine.call("count", counter, rows)
    assert counter.tolist() == [1] * 4
    assert plane.engine.stats()["items_inserted"] == 16  # the staged rows, then the step's own
    with pytest.raises(ConfigError, match="exists already"):
        plane.engine.add_step("sample", count_and_write, 1)
    with pytest.raises(ConfigError, match="no step named 'nothing'"):
        plane.engine.call("nothing")


@pytest.mark.parametrize("timing_dependent", [False, True])
def test_a_timing_dependent_engine_compiles_the_next_staged_bucket_ahead(mesh, timing_dependent):
    """Under a delivery worker how many rows wait for a draw depends on thread timing (an adaptive depth that drops
    skips a refill): such an engine compiles each staged kernel it builds for the next bucket of rows up as well, so
    a draw that meets that bucket later compiles nothing (without it, that draw compiles), and writes the same."""
    plane = ExperienceDataPlane(SPEC, 256, samplers.fifo(8), mesh=mesh)
    one = engine.Engine(plane.config, plane.engine.shardings, 0, timing_dependent=timing_dependent)
    shards, per_shard = plane.config.num_shards, plane.config.shard_capacity
    first = engine.staged_rows(8, shards, per_shard)
    following = engine.staged_rows(4 * first, shards, per_shard)  # the next bucket up
    count = following * 3 // 4
    assert first < following and engine.staged_rows(count, shards, per_shard) == following
    one.ingest(batch(0, 8), 8, staged=True)
    assert sorted(np.asarray(one.sample().data["g"]).tolist()) == list(range(8))
    compiled = one.compile_counts()
    one.ingest(batch(8, count), count, staged=True)
    assert sorted(np.asarray(one.sample().data["g"]).tolist()) == list(range(8, 16))
    new = set(one.compile_counts()) - set(compiled)
    assert new == (set() if timing_dependent else {f"ingest[{following},packed]+sample"}), one.compile_counts()
    assert set(one.compile_counts().values()) == {1}
    assert one.stats()["items_inserted"] == 8 + count


def test_engines_of_one_configuration_may_share_their_kernels_and_keep_no_status_copy(mesh):
    """``kernels=``: a second engine with the same steps compiles nothing; ``mirror_status=False``: a staged ingest
    reads no status from the device first (no kernel at all until the call)."""
    plane = ExperienceDataPlane(SPEC, 64, samplers.prioritized(8, 0.6, 0.4), mesh=mesh)
    cache: dict = {}
    engines = [engine.Engine(plane.config, plane.engine.shardings, seed, kernels=cache, mirror_status=False)
               for seed in (0, 1)]
    rows = np.arange(64, dtype=np.int32)
    for one in engines:
        one.add_step("peek", _peek(plane.config), 2)
        one.ingest(batch(0, 8), 8, staged=True)
        assert not one.dispatches
        g, _ = one.call("peek", rows)
        assert set(np.asarray(g).tolist()) == set(range(8)) and sum(one.dispatches.values()) == 1
    assert sum(engines[0].compiles.values()) > 0 and sum(engines[1].compiles.values()) == 0


def test_an_update_given_after_staged_rows_applies_between_them_and_later_rows(mesh):
    """``Engine.pend(after_staged=True)``: the update applies after the rows staged when it was given and before
    rows staged later, as eager writes in program order would (new items take the largest priority seen by then;
    an update of an item those rows overwrite is ignored), and rides the kernel that writes the first rows."""
    eager, staged = (ExperienceDataPlane(SPEC, 64, samplers.prioritized(8, 0.6, 0.4), mesh=mesh, seed=3,
                                         schedule=schedule.sync()) for _ in range(2))
    for plane in (eager, staged):
        plane.ingest(batch(0, 56))
    ids = np.asarray(eager.sample().ids)
    staged.sample()
    update = (ids, np.linspace(20.0, 90.0, ids.shape[0]).astype(np.float32))
    # eager: the rows, the update, then more rows, each written at once
    eager.engine.ingest(batch(56, 8), 8)
    eager.engine.pend(update)
    eager.engine.flush()
    eager.engine.ingest(batch(64, 8), 8)
    # staged: the same three, the rows staged
    staged.engine.ingest(batch(56, 8), 8, staged=True)
    staged.engine.pend(update, after_staged=True)
    assert not staged.engine.pending  # held for the rows' kernel
    staged.engine.ingest(batch(64, 8), 8, staged=True)
    staged.engine.flush()
    assert [name for name in staged.engine.dispatches if "+update[" in name], dict(staged.engine.dispatches)
    for a, b in zip(jax.tree_util.tree_leaves(eager.engine.state), jax.tree_util.tree_leaves(staged.engine.state)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
