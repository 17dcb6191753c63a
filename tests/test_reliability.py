"""Reliability: random bad input at every public entry point changes nothing; sustained concurrent load loses nothing.

Property tests (hypothesis) generate malformed batches, priority updates and constructor arguments; each must raise a
``ConduitError`` naming the argument and leave the state bit-identical. The soak runs producer threads and a consumer
that samples and updates priorities, then checks the books: every item ingested is stored or overwritten by design,
no call raised, memory stays flat after warm-up, and nothing recompiled.
"""

from __future__ import annotations

import os
import resource
import re
import threading
import time

import jax
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import conduit_jax as cj
from conduit_jax import limits, samplers

SPEC = cj.ExperienceSpec.from_example({
    "obs": np.zeros((3,), np.float32), "act": np.int32(0), "done": np.bool_(False),
    "img": np.zeros((2, 2), np.uint8)})


def good_batch(n: int, seed: int = 0):
    rng = np.random.default_rng(seed)
    return {"obs": rng.standard_normal((n, 3)).astype(np.float32), "act": rng.integers(0, 5, n).astype(np.int32),
            "done": rng.random(n) < 0.2, "img": rng.integers(0, 255, (n, 2, 2)).astype(np.uint8)}


def snapshot(plane):
    return [np.asarray(x).copy() for x in jax.tree_util.tree_leaves(jax.device_get(plane.state))]


def assert_unchanged(plane, before):
    after = snapshot(plane)
    assert len(after) == len(before)
    for a, b in zip(after, before):
        assert a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()


@pytest.fixture(scope="module")
def per_plane():
    plane = cj.ExperienceDataPlane(SPEC, 64, samplers.prioritized(8), mesh=cj.default_mesh(8))
    plane.ingest(good_batch(40))
    plane.sample()
    return plane


# -- malformed batches ------------------------------------------------------------------------------------------------
LEAF_NAMES = ("obs", "act", "done", "img")
BAD_DTYPES = (np.float64, np.int64, np.int16, np.float16, np.uint32, np.complex64)


@st.composite
def bad_batches(draw):
    n = draw(st.integers(1, 12))
    batch = good_batch(n, draw(st.integers(0, 1000)))
    kind = draw(st.sampled_from(["dtype", "shape", "missing", "extra", "count", "scalar", "empty"]))
    name = draw(st.sampled_from(LEAF_NAMES))
    if kind == "dtype":
        dtype = draw(st.sampled_from([d for d in BAD_DTYPES if np.dtype(d) != batch[name].dtype]))
        batch[name] = batch[name].astype(dtype)
    elif kind == "shape":
        extra = draw(st.sampled_from([(2,), (1,), ()]))
        shape = (n, *extra) if batch[name].ndim > 1 else (n, 2)
        if shape == batch[name].shape:
            shape = (n, 7)
        batch[name] = np.zeros(shape, batch[name].dtype)
    elif kind == "missing":
        del batch[name]
    elif kind == "extra":
        batch["bogus"] = np.zeros((n,), np.float32)
    elif kind == "count":
        batch[name] = np.concatenate([batch[name], batch[name][:1]])
    elif kind == "scalar":
        batch[name] = 1.0
    else:
        batch = {k: v[:0] for k, v in batch.items()}
    return kind, name, batch


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(bad=bad_batches())
def test_malformed_batches_are_rejected_and_change_nothing(per_plane, bad):
    kind, name, batch = bad
    before = snapshot(per_plane)
    with pytest.raises(cj.SpecError) as info:
        per_plane.ingest(batch)
    message = str(info.value)
    assert message.startswith("ingest():")
    if kind in ("dtype", "shape", "missing"):
        assert f"'{name}'" in message
    elif kind == "extra":
        assert "bogus" in message
    assert_unchanged(per_plane, before)


# -- malformed priority updates ---------------------------------------------------------------------------------------
@st.composite
def bad_updates(draw):
    m = draw(st.integers(1, 10))
    ids = np.stack([np.arange(m) % 64, np.ones(m, np.int64)], axis=1).astype(np.int32)
    priorities = np.ones(m, np.float32)
    kind = draw(st.sampled_from(["nan", "inf", "negative", "row", "generation", "ids_shape", "prio_shape", "float_ids"]))
    i = draw(st.integers(0, m - 1))
    if kind == "nan":
        priorities[i] = np.nan
    elif kind == "inf":
        priorities[i] = draw(st.sampled_from([np.inf, -np.inf]))
    elif kind == "negative":
        priorities[i] = -draw(st.floats(1e-30, 1e30))
    elif kind == "row":
        ids[i, 0] = draw(st.sampled_from([-1, 64, 2**31 - 1]))
    elif kind == "generation":
        ids[i, 1] = draw(st.integers(-5, 0))
    elif kind == "ids_shape":
        ids = ids[:, :1]
    elif kind == "prio_shape":
        priorities = np.ones(m + 1, np.float32)
    else:
        ids = ids.astype(np.float32)
    return ids, priorities


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(update=bad_updates())
def test_malformed_priority_updates_are_rejected_and_change_nothing(per_plane, update):
    ids, priorities = update
    before = snapshot(per_plane)
    with pytest.raises(cj.PriorityError) as info:
        per_plane.update_priorities(ids, priorities)
    assert str(info.value).startswith("update_priorities():")
    assert_unchanged(per_plane, before)


def test_ids_from_a_different_plane_are_ignored_not_misapplied():
    """Ids are (row, generation); a row's generation from another plane that is ahead of this one is stale here."""
    a = cj.ExperienceDataPlane(SPEC, 16, samplers.prioritized(4), mesh=cj.default_mesh(1))
    b = cj.ExperienceDataPlane(SPEC, 16, samplers.prioritized(4), mesh=cj.default_mesh(1))
    for _ in range(3):
        a.ingest(good_batch(16))
    b.ingest(good_batch(16))
    foreign = np.asarray(a.sample().ids)  # generation 3 ids
    before = np.asarray(b.state.sampler.levels[-1]).copy()
    b.update_priorities(foreign, np.full(len(foreign), 50.0, np.float32))
    assert np.array_equal(np.asarray(b.state.sampler.levels[-1]), before)
    assert b.stats()["priority_updates_ignored"] == len(foreign)


# -- impossible configurations --------------------------------------------------------------------------------------
@settings(max_examples=40, deadline=None)
@given(capacity=st.integers(-3, 70), batch=st.integers(-2, 40), shards=st.sampled_from([1, 8]),
       kind=st.sampled_from(["uniform", "fifo", "epochs", "prioritized"]))
def test_constructor_accepts_exactly_the_workable_combinations(capacity, batch, shards, kind):
    workable = capacity >= 1 and batch >= 1 and capacity % shards == 0 and batch % shards == 0 and \
        (kind in ("uniform", "prioritized") or batch <= capacity)
    try:
        sampler = getattr(samplers, kind)(batch)
        cj.ExperienceDataPlane(SPEC, capacity, sampler, mesh=cj.default_mesh(shards))
    except cj.ConfigError as error:
        assert not workable, f"rejected a workable combination: {error}"
        assert any(word in str(error) for word in ("capacity", "batch_size", "items per batch"))
    else:
        assert workable


def test_rate_limiter_that_could_deadlock_is_refused():
    with pytest.raises(cj.ConfigError, match="deadlock"):
        cj.ExperienceDataPlane(SPEC, 64, samplers.uniform(8), mesh=cj.default_mesh(1),
                               limiter=limits.sample_to_insert_ratio(4.0, min_size=8, error_buffer=2))


# -- named cases: what an adversarial battery found -----------------------------------------------------------------
@pytest.fixture(scope="module")
def buffers():
    """A prioritized and a uniform functional buffer of capacity 64 (one device) holding 40 items, and a smaller
    one."""
    made = {}
    for name, sampler, capacity in (("per", samplers.prioritized(8), 64), ("uniform", samplers.uniform(8), 64),
                                    ("small", samplers.prioritized(8), 32)):
        buffer = cj.make_buffer(SPEC, capacity, sampler, mesh=cj.default_mesh(1))
        made[name] = (buffer, jax.jit(buffer.ingest)(buffer.init(0), good_batch(40)))
    return made


def test_functional_calls_refuse_a_state_that_is_not_their_buffers(buffers):
    buffer, state = buffers["per"]
    wrong = {"a state of another capacity": buffers["small"][1], "another sampler's state": buffers["uniform"][1],
             "not a state": "garbage", "None": None}
    calls = {"ingest": lambda s: buffer.ingest(s, good_batch(4)), "sample": buffer.sample,
             "can_sample": buffer.can_sample, "size": buffer.size, "read": lambda s: buffer.read(s, np.arange(2)),
             "update": lambda s: buffer.update(s, np.array([[0, 1]]), np.ones(1)),
             "set_policy_version": lambda s: buffer.set_policy_version(s, 1)}
    for what, bad in wrong.items():
        for name, call in calls.items():
            with pytest.raises(cj.ConfigError, match=rf"Buffer.{name}\(\): .*(state must be a ReplayState|expected a "
                                                     rf"ReplayState of this buffer|leaf .* must be)"):
                call(bad)
    assert int(buffer.size(state)) == 40  # and its own state still works


def test_functional_arguments_are_checked_by_name(buffers):
    buffer, state = buffers["per"]
    wide = np.array([[3 + 2**32, 1]], np.int64)  # narrowed to int32 it would name row 3, a live item
    for ids in (wide, np.array([[3, 1 + 2**32]], np.int64)):
        with pytest.raises(cj.PriorityError, match=r"ids must fit int32 .*got 4294967\d+"):
            buffer.update(state, ids, np.array([100.0]))
    with pytest.raises(cj.ConfigError, match="rows must fit int32"):
        buffer.read(state, np.array([2**32 + 2], np.int64))
    for priorities in (np.array(["a"]), np.array([1 + 5j])):
        with pytest.raises(cj.PriorityError, match="priorities must be real numbers"):
            buffer.update(state, np.array([[0, 1]]), priorities)
    for version in (2**40, 1.9, None, -1, "3"):
        with pytest.raises(cj.ConfigError, match=r"version must be an int in \[0, 2\*\*31\)"):
            buffer.set_policy_version(state, version)
    for items in (["a"], -1, [0, -5], 1.5):
        with pytest.raises(cj.ConfigError, match="items must be ints >= 0"):
            buffer.item_ids(items)
    uniform, uniform_state = buffers["uniform"]
    for batches in (0, -1, 1.5, True, "x"):
        with pytest.raises(cj.ConfigError, match="batches must be an int >= 1 or None"):
            uniform.can_sample(uniform_state, batches)
    for n in (0, 1.5, "x"):
        with pytest.raises(cj.ConfigError, match="n must be an int >= 1"):
            uniform.can_ingest(uniform_state, n)


def test_a_functional_queue_refuses_what_would_overwrite_undelivered_items():
    queue = cj.make_buffer(SPEC, 16, samplers.fifo(8), mesh=cj.default_mesh(1))
    ingest, sample = jax.jit(queue.ingest), jax.jit(queue.sample)  # (inside a trace nothing is refused)
    state = ingest(queue.init(0), good_batch(12))
    assert bool(queue.can_ingest(state, 4)) and not bool(queue.can_ingest(state, 5))
    with pytest.raises(cj.CapacityError, match="queue holds 12 undelivered items of 16; 8 more would overwrite 4"):
        queue.ingest(state, good_batch(8))  # outside a trace it is
    state, first = sample(state)
    state = ingest(state, good_batch(8, seed=1))  # room for 12 now
    state, second = sample(state)
    state, third = sample(state)  # 4 undelivered items left: no full batch
    assert bool(first.valid) and bool(second.valid) and not bool(third.valid)
    expected = np.concatenate([good_batch(12)["act"], good_batch(8, seed=1)["act"]])
    np.testing.assert_array_equal(np.concatenate([first.data["act"], second.data["act"]]), expected[:16])


def numbered(start: int, n: int):
    """Items start, ..., start + n - 1: ``act`` is the item's insertion index, the other leaves are derived from it."""
    g = np.arange(start, start + n, dtype=np.int32)
    return {"obs": np.stack([g, -g, g * 0.5], axis=1).astype(np.float32), "act": g, "done": g % 3 == 0,
            "img": np.broadcast_to((g % 251).astype(np.uint8)[:, None, None], (n, 2, 2)).copy()}


def queue_owes(ops, capacity: int, shards: int, batch: int):
    """What a FIFO queue must deliver for ``ops`` (an int: ingest that many items; None: one draw), as a list with
    one entry per draw: the batch's items in delivery order, or None where the draw is flagged invalid. Inside a
    trace nothing is refused: an ingest past the capacity overwrites the oldest undelivered items, and as every
    shard reads the same row the queue skips whole rows, ceil(over / S) of them: the oldest ceil(over / S) * S
    items, some of which (fewer than S) were not overwritten. Within a batch the order is shard-major."""
    pending, next_g, draws, overs = [], 0, [], []
    for op in ops:
        if op is None:
            if len(pending) < batch:
                draws.append(None)
                continue
            block = np.asarray(pending[:batch]).reshape(batch // shards, shards)
            draws.append(block.T.reshape(-1).tolist())
            del pending[:batch]
        else:
            pending += range(next_g, next_g + op)
            next_g += op
            over = max(len(pending) - capacity, 0)
            overs.append(over)
            del pending[:-(-over // shards) * shards]
    return draws, overs


def random_queue_ops(seed: int, steps: int = 40):
    """Ingests of 3, 5 or 13 items (none a multiple of 8) and draws, in a seeded order that overfills the queue by
    every amount modulo 8 (the test checks it does)."""
    rng = np.random.default_rng(seed)
    return [None if rng.random() < 0.3 else int(rng.choice([3, 5, 13])) for _ in range(steps)]


def test_inside_a_trace_a_queue_skips_what_an_overfilling_ingest_overwrote(mesh):
    """Nothing can be refused inside jit: an ingest past the capacity overwrites undelivered items, and the queue
    skips them and goes on. Overfilled by amounts that are not multiples of the shard count (where rounding the
    skipped rows down instead of up delivers items twice: 19 items into 16 slots on 8 shards, then 5 more, gave
    16-18 twice), every draw is exactly the batch the model above owes: each item delivered at most once, in
    insertion order, with its own data and the live id of its row; the items lost are the oldest, fewer than S more
    than were overwritten."""
    capacity, batch = 16, 8
    queue = cj.make_buffer(SPEC, capacity, samplers.fifo(batch), mesh=mesh)
    shards, shard_capacity = queue.config.num_shards, queue.config.shard_capacity
    ingest, sample = jax.jit(queue.ingest, donate_argnums=0), jax.jit(queue.sample, donate_argnums=0)
    # the case (19 items into 16 slots, then 5 more) and seeded ones, all of ingests of 3, 5 or 13 items
    schedules = [[13, 3, 3, None, None, 5, None, None], *(random_queue_ops(seed) for seed in range(3))]
    residues, overfills = set(), 0
    for ops in schedules:
        owed, overs = queue_owes(ops, capacity, shards, batch)
        residues |= {over % shards for over in overs if over}
        overfills += sum(over > 0 for over in overs)
        state, next_g, got = queue.init(0), 0, []
        for op in ops:
            if op is None:
                state, delivery = sample(state)
                got.append(delivery if bool(delivery.valid) else None)
            else:
                state = ingest(state, numbered(next_g, op))
                next_g += op
        delivered = []
        for delivery in filter(None, got):
            g = np.asarray(delivery.data["act"])
            for leaf in ("obs", "done", "img"):
                np.testing.assert_array_equal(np.asarray(delivery.data[leaf]), numbered(0, next_g)[leaf][g])
            lap_slot = g // shards
            np.testing.assert_array_equal(np.asarray(delivery.ids), np.stack(
                [(g % shards) * shard_capacity + lap_slot % shard_capacity, lap_slot // shard_capacity + 1], -1))
            delivered += sorted(g.tolist())
        # what any queue promises, apart from the model: at most once, in order
        assert delivered == sorted(set(delivered)), f"schedule {ops}: items delivered twice or out of order: {delivered}"
        got = [None if d is None else np.asarray(d.data["act"]).tolist() for d in got]
        assert got == owed, f"schedule {ops}: delivered {got}, owed {owed}"
    assert overfills >= 10 and residues >= set(range(1, shards)), (overfills, residues)  # every partial row


def test_an_ingest_that_would_carry_the_limiter_past_int32_is_refused():
    plane = cj.ExperienceDataPlane(SPEC, 64, samplers.uniform(8), mesh=cj.default_mesh(1),
                                   limiter=limits.sample_to_insert_ratio(1e6, min_size=1, error_buffer=1e6))
    before = snapshot(plane)
    with pytest.raises(cj.CapacityError, match=r"3000 items in one call would carry the rate limiter .* past int32; "
                                               r"ingest at most 214\d items per call"):
        plane.ingest(good_batch(3000))
    assert_unchanged(plane, before)
    plane.ingest(good_batch(2000))


def test_plane_arguments_are_checked_by_name_and_change_nothing(per_plane, tmp_path):
    empty = cj.ExperienceDataPlane(SPEC, 64, samplers.uniform(8), mesh=cj.default_mesh(1))
    before = snapshot(per_plane)
    for timeout in ("1", float("nan"), -1.0, True):
        for name, call in (("ingest", lambda t: per_plane.ingest(good_batch(4), timeout=t)),
                           ("sample", lambda t: empty.sample(timeout=t)),
                           ("deliver", lambda t: empty.deliver(timeout=t))):
            with pytest.raises(cj.ConfigError, match=rf"{name}\(\): timeout must be a number of seconds >= 0"):
                call(timeout)
    for n in ("x", -100, 1.5, 0):
        with pytest.raises(cj.ConfigError, match=r"can_ingest\(\): n must be an int >= 1"):
            per_plane.can_ingest(n)
    for bad in ("garbage", [per_plane.shardings.storage.rows],
                cj.ExperienceDataPlane(SPEC, 64, samplers.prioritized(8), mesh=cj.default_mesh(1)).shardings):
        with pytest.raises(cj.ConfigError, match=r"place\(\): shardings must be a ReplayState of NamedSharding on "
                                                 r"the plane's mesh"):
            per_plane.place(bad)
    batch = good_batch(4)
    for leaf, message in ((jax.ShapeDtypeStruct((4, 3), np.float32), "leaf 'obs' is a ShapeDtypeStruct"),
                          (jax.numpy.zeros((4, 3)), "leaf 'obs' is a deleted jax.Array")):
        if message.endswith("jax.Array"):
            leaf.delete()
        with pytest.raises(cj.SpecError, match=message):
            per_plane.ingest({**batch, "obs": leaf})
    assert_unchanged(per_plane, before)
    # an empty plane waits for ever with timeout=inf, as with None, until an ingest lets it sample
    threading.Timer(0.2, lambda: empty.ingest(good_batch(8))).start()
    assert empty.sample(timeout=float("inf")).ids.shape == (8, 2)
    with pytest.raises(cj.ConfigError, match="staleness must be limits.Staleness"):
        cj.ExperienceDataPlane({**SPEC.structs, "version": jax.ShapeDtypeStruct((), np.int32)}, 64,
                               samplers.uniform(8), mesh=cj.default_mesh(1),
                               staleness=limits.Staleness(2**40, "version"))
    from conduit_jax import schedule

    with pytest.raises(cj.ConfigError, match="schedule name must be sync, staged, overlap, deferred or adaptive, got 'x'"):
        cj.ExperienceDataPlane(SPEC, 64, samplers.uniform(8), mesh=cj.default_mesh(1),
                               schedule=schedule.Schedule("x", depth=-1, defer=-1))
    with pytest.raises(cj.ConfigError, match=r"is not what schedule.overlap\(\) makes"):
        cj.ExperienceDataPlane(SPEC, 64, samplers.uniform(8), mesh=cj.default_mesh(1),
                               schedule=schedule.Schedule("overlap", depth=2, defer=3))
    afile = tmp_path / "afile"
    afile.write_text("")
    with pytest.raises(cj.CheckpointError, match="cannot be a directory: .*afile is a file"):
        per_plane.save(afile / "ck", block=True)


def test_batches_on_other_devices_are_taken_and_a_freed_state_is_named():
    plane = cj.ExperienceDataPlane(SPEC, 64, samplers.uniform(8), mesh=cj.default_mesh(1))
    elsewhere = jax.device_put(good_batch(64), jax.devices()[5])
    plane.ingest(elsewhere)
    sharded = cj.ExperienceDataPlane(SPEC, 64, samplers.uniform(8), mesh=cj.default_mesh(8))
    sharded.ingest(jax.device_put(good_batch(64), jax.devices()[0]))
    for p in (plane, sharded):
        act = np.sort(np.asarray(p.sample().data["act"]))
        assert len(p) == 64 and np.isin(act, good_batch(64)["act"]).all()
    state = plane.state
    plane.state = None
    with pytest.raises(cj.ConfigError, match=r"the state was freed \(plane.state = None\)"):
        plane.ingest(good_batch(4))
    plane.state = state
    assert len(plane) == 64


def test_an_overlap_plane_refuses_a_recycle_that_is_no_delivery():
    from conduit_jax import schedule

    with cj.ExperienceDataPlane(SPEC, 64, samplers.uniform(8), mesh=cj.default_mesh(1),
                                schedule=schedule.overlap(2)) as plane:
        plane.ingest(good_batch(32))
        plane.deliver()
        for call in (lambda: plane.deliver(recycle="x"), lambda: plane.sample(recycle=42)):
            with pytest.raises(cj.SpecError, match="recycle must be a Delivery this plane returned"):
                call()


# -- sustained load -------------------------------------------------------------------------------------------------
def rss_bytes() -> int:
    with open(f"/proc/{os.getpid()}/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize()


WARM_BUCKETS = (64, 256, 1024, 4096)
WARM_SAMPLES = 3 + len(WARM_BUCKETS)  # the soak's sample() calls before the clock starts


def soak(seconds: float, producers: int = 3, devices: int = 1, save_to=None, save_every_s: float = 30.0):
    """Producer threads ingest while this thread samples and reports priorities for ``seconds``; with ``save_to``
    the plane is also saved (asynchronously) every ``save_every_s``. Returns the plane and what was counted."""
    plane = cj.ExperienceDataPlane(SPEC, 4096, samplers.prioritized(64), mesh=cj.default_mesh(devices))
    plane.ingest(good_batch(256))  # compile the common buckets before the clock starts
    plane.ingest(good_batch(32))
    delivery = plane.sample()
    plane.update_priorities(delivery.ids, np.ones(64, np.float32))
    plane.ingest(good_batch(32))  # staged: the next sample applies the queued update, then writes these rows
    delivery = plane.sample()
    plane.update_priorities(delivery.ids, np.ones(64, np.float32))
    plane.sample()  # applies it inside the sample kernel
    plane.update_priorities(delivery.ids, np.ones(64, np.float32))
    plane.stats()  # applies it in a kernel of its own (a read of the state), as the stats at the end do
    # how many rows wait for a draw depends on how the producers race the sampler: every bucket of staged rows a
    # draw can carry (powers of four up to the ring, engine.staged_rows), compiled before the clock, so the timed
    # loop's samples are not spent compiling
    for n in WARM_BUCKETS:
        plane.ingest(good_batch(n))
        delivery = plane.sample()
        plane.update_priorities(delivery.ids, np.ones(64, np.float32))
    compiled_before = plane.compile_counts()
    ingested = [0] * producers
    errors: list[BaseException] = []
    stop = threading.Event()

    def produce(k):
        rng = np.random.default_rng(k)
        try:
            while not stop.is_set():
                n = int(rng.choice([17, 32]))
                plane.ingest(good_batch(n, int(rng.integers(1 << 30))))
                ingested[k] += n
                # an actor's env step between its ingests (the GIL released): a thread doing nothing but staged
                # ingests, each a copy, would hold the GIL but for CPython's switch interval and starve the sampler
                time.sleep(2e-4)
        except BaseException as error:  # noqa: BLE001 - reported below
            errors.append(error)

    samples = 0
    threads = [threading.Thread(target=produce, args=(k,)) for k in range(producers)]
    for thread in threads:
        thread.start()
    rss_after_warmup = None
    start = last_save = time.monotonic()
    try:
        while time.monotonic() - start < seconds:
            delivery = plane.sample()
            plane.update_priorities(delivery.ids, np.abs(np.asarray(delivery.data["obs"])[:, 0]) + 0.1)
            samples += 1
            if rss_after_warmup is None and time.monotonic() - start > seconds / 3:
                rss_after_warmup = rss_bytes()
            if save_to is not None and time.monotonic() - last_save > save_every_s:
                plane.save(save_to, max_to_keep=2)  # written in the background while the producers go on
                last_save = time.monotonic()
    finally:
        stop.set()
        for thread in threads:
            thread.join()
    ingested_total = 320 + sum(WARM_BUCKETS) + sum(ingested)
    return plane, ingested_total, samples, errors, rss_after_warmup, rss_bytes(), compiled_before


def assert_nothing_recompiled(before: dict, after: dict) -> None:
    """No kernel compiled twice, and a kernel compiled since ``before`` differs from one compiled then only in the
    bucket of staged rows it carries (``engine.staged_rows``): how many items wait for a draw depends on how the
    producers' threads raced the sampler, and each bucket compiles once."""
    assert all(count == 1 for count in after.values()), after

    def without_bucket(name):
        return re.sub(r"\+?ingest\[\d+,packed\]\+?", "+", name).strip("+")

    assert {without_bucket(n) for n in after} <= {without_bucket(n) for n in before} | {""}, (before, after)


@pytest.mark.parametrize("seconds", [6.0])
def test_soak_counts_add_up_memory_is_flat_and_nothing_recompiles(seconds):
    plane, ingested, samples, errors, rss_mid, rss_end, compiled_before = soak(seconds)
    assert errors == []
    stats = plane.stats()
    assert stats["items_inserted"] == ingested
    assert stats["size"] + stats["items_overwritten"] == ingested
    assert stats["size"] == min(ingested, plane.capacity)
    assert stats["stages"]["sample"]["calls"] == samples + WARM_SAMPLES and samples > 10
    assert_nothing_recompiled(compiled_before, plane.compile_counts())
    assert rss_end - rss_mid < 64 * 2**20, f"RSS grew by {(rss_end - rss_mid) / 2**20:.1f} MiB after warm-up"


@pytest.mark.slow
def test_soak_ten_minutes_on_the_mesh_with_periodic_saves(tmp_path):
    """10 minutes of 4 producers, sampling and priority updates on the 8-device mesh, saved every 30 s: every item
    counted in is stored or overwritten, nothing recompiles, RSS stays flat, and the last save restores exactly."""
    plane, ingested, samples, errors, rss_mid, rss_end, compiled_before = soak(
        600.0, producers=4, devices=8, save_to=tmp_path / "ckpt")
    assert errors == []
    stats = plane.stats()
    assert stats["items_inserted"] == ingested == stats["size"] + stats["items_overwritten"]
    assert stats["stages"]["sample"]["calls"] == samples + WARM_SAMPLES
    assert_nothing_recompiled(compiled_before, plane.compile_counts())
    assert rss_end - rss_mid < 64 * 2**20, f"RSS grew by {(rss_end - rss_mid) / 2**20:.1f} MiB after warm-up"
    plane.save(tmp_path / "ckpt", block=True)
    restored = cj.ExperienceDataPlane.restore(tmp_path / "ckpt", mesh=cj.default_mesh(8))
    for name, (a, b) in zip(["storage", "sampler"], [(plane.state.storage, restored.state.storage),
                                                     (plane.state.sampler, restored.state.sampler)]):
        for x, y in zip(jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b)):
            np.testing.assert_array_equal(np.asarray(x), np.asarray(y), err_msg=name)
    assert restored.stats()["items_inserted"] == ingested
