"""ExperienceDataPlane, the shell: compiled-kernel reuse, rejection of bad input with the state left bit-identical,
constructor checks, counters, and values through the whole ingest -> sample path."""

import logging

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conduit_jax import replay
from conduit_jax import (CapacityError, ConduitError, ConfigError, ExperienceDataPlane, ExperienceSpec,
                         NotEnoughDataError, SpecError, default_mesh, make_buffer, samplers, schedule, storage)

ITEM = {
    "obs": {"pixels": np.zeros((4, 3), np.uint8), "mask": np.zeros((5,), np.bool_)},
    "action": np.int32(0),
    "reward": np.float32(0),
    "logits": np.zeros((3,), jnp.bfloat16),
    "g": np.int32(0),
}
SPEC = ExperienceSpec.from_example(ITEM)


def batch(start, n):
    g = np.arange(start, start + n, dtype=np.int32)
    return {
        "obs": {"pixels": ((g[:, None, None] + np.arange(12).reshape(4, 3)) % 251).astype(np.uint8),
                "mask": (g[:, None] + np.arange(5)) % 3 == 0},
        "action": (g % 7).astype(np.int32),
        "reward": (g * 0.25 - 1).astype(np.float32),
        "logits": (g[:, None] * np.array([1.0, -0.5, 2.0])).astype(jnp.bfloat16),
        "g": g,
    }


def as_jax(tree):
    return jax.tree_util.tree_map(jnp.asarray, tree)


def host(x):
    return np.asarray(jax.device_get(x))


# -- compiled kernels are reused -------------------------------------------------------------------------------------
class _CompileLog(logging.Handler):
    def __init__(self):
        super().__init__(logging.DEBUG)
        self.compiled = []

    def emit(self, record):
        message = record.getMessage()
        if message.startswith("Compiling ") or "XLA compilation" in message:
            self.compiled.append(message[:160])


def compiles_during(fn):
    """Run ``fn`` with jax's compile logging on; return the compile messages it produced."""
    handler, logger = _CompileLog(), logging.getLogger("jax")
    logger.addHandler(handler)
    try:
        with jax.log_compiles(True):
            fn()
    finally:
        logger.removeHandler(handler)
    return handler.compiled


def kernel_cache_sizes(plane):
    """The plane's public compile counts, without kernels this test never calls."""
    return {name: count for name, count in plane.compile_counts().items() if name not in ("update", "version")}


# batch sizes that share one ingest bucket (1 device: 32 rows; 8 shards: 8 rows each) and that no other test uses,
# so no op compiled for another test hides a per-size compile here (jit caches are process-wide)
SAME_BUCKET = {1: (17, 23, 29), 8: (41, 47, 53)}


@pytest.mark.parametrize("to_device", [False, True], ids=["numpy", "jax"])
def test_no_recompilation_on_later_calls(mesh, to_device):
    plane = ExperienceDataPlane(SPEC, 64, samplers.uniform(16), mesh=mesh)
    sizes = SAME_BUCKET[plane.num_shards]
    buckets = {replay.padded_rows(n, plane.num_shards, plane.config.shard_capacity) for n in sizes}
    assert len(buckets) == 1
    batches = [batch(0, n) for n in sizes]
    if to_device:
        batches = [as_jax(b) for b in batches]
    jax.block_until_ready(batches)

    plane.ingest(batches[0])  # first calls compile
    jax.block_until_ready(plane.sample())
    len(plane), plane.stats()
    before = kernel_cache_sizes(plane)
    assert all(size == 1 for size in before.values()) and any(name.endswith("sample") for name in before), before

    def later_calls():
        for b in batches[1:] + batches[:1]:
            plane.ingest(b)
            jax.block_until_ready(plane.sample())
        len(plane), plane.stats(), plane.can_sample()

    compiled = compiles_during(later_calls)
    assert kernel_cache_sizes(plane) == before
    assert plane.stats()["compiled"] == plane.compile_counts()
    assert compiled == [], f"later calls compiled: {compiled}"


# -- bad input is rejected and changes nothing -------------------------------------------------------------------------
@pytest.fixture(scope="module")
def loaded_plane(module_mesh):
    """A plane holding 12 items, shared by the rejection tests (a rejected call must not change it)."""
    plane = ExperienceDataPlane(SPEC, 32, samplers.uniform(8), mesh=module_mesh)
    plane.ingest(batch(0, 12))
    return plane


def _with(n=3, **changes):
    def make():
        b = batch(100, n)
        for path, value in changes.items():
            node, *rest = path.split("__")
            if rest:
                b[node][rest[0]] = value
            elif value is _DROP:
                del b[node]
            else:
                b[node] = value
        return b
    return make


_DROP = object()

BAD_BATCHES = {
    "trailing-shape": (_with(obs__pixels=np.zeros((3, 4, 4), np.uint8)),
                       ["'obs/pixels'", "(3, 4, 4)", "(4, 3)"]),
    "wrong-dtype": (_with(reward=np.zeros((3,), np.int32)), ["'reward'", "int32", "float32"]),
    "bf16-as-f32": (_with(logits=np.zeros((3, 3), np.float32)), ["'logits'", "float32", "bfloat16"]),
    "float64": (_with(reward=np.zeros((3,), np.float64)), ["'reward'", "float64", "cast=True"]),
    "int64": (_with(action=np.zeros((3,), np.int64)), ["'action'", "int64", "cast=True"]),
    "no-item-axis": (_with(action=np.int32(1)), ["'action'", "leading item axis"]),
    "too-many-axes": (_with(reward=np.zeros((3, 1), np.float32)), ["'reward'", "(3, 1)"]),
    "missing-key": (_with(action=_DROP), ["missing", "'action'"]),
    "missing-nested-key": (lambda: {**batch(0, 3), "obs": {"pixels": batch(0, 3)["obs"]["pixels"]}},
                           ["missing", "'obs/mask'"]),
    "extra-key": (_with(extra=np.zeros((3,), np.float32)), ["unexpected", "'extra'"]),
    "python-float-leaf": (_with(reward=0.5), ["'reward'", "float"]),
    "string-leaf": (_with(reward="0.5"), ["'reward'", "str"]),
    "list-leaf": (_with(action=[1, 2, 3]), ["'action'"]),
    "none-leaf": (_with(action=None), ["missing", "'action'"]),
    "empty": (_with(n=0), ["empty", "0 items"]),
    "counts-disagree": (_with(g=np.arange(4, dtype=np.int32)), ["disagree", "'g': 4", "'action': 3"]),
    "not-a-dict": (lambda: np.zeros((3, 4), np.float32), ["missing"]),
    "none": (lambda: None, ["missing"]),
    "several-bad-leaves": (_with(reward=np.zeros((3,), np.int32), obs__mask=np.zeros((3, 4), np.bool_),
                                 logits=np.zeros((3, 3), np.float16)),
                           ["'reward'", "'obs/mask'", "'logits'", "float16", "(3, 4)"]),
}


@pytest.mark.parametrize("name", list(BAD_BATCHES))
def test_bad_batch_rejected_state_unchanged(loaded_plane, state_snapshot, name):
    make, words = BAD_BATCHES[name]
    check = state_snapshot(loaded_plane)
    stats_before = {k: v for k, v in loaded_plane.stats().items() if not k.endswith("_s")}
    with pytest.raises(SpecError) as info:
        loaded_plane.ingest(make())
    assert isinstance(info.value, (ConduitError, ValueError))
    msg = str(info.value)
    assert msg.startswith("ingest(): ")
    for word in words:
        assert word in msg, f"{word!r} not in {msg!r}"
    check()
    assert len(loaded_plane) == 12
    assert {k: v for k, v in loaded_plane.stats().items() if not k.endswith("_s")} == stats_before


@pytest.mark.parametrize("name", list(BAD_BATCHES))
def test_bad_batch_rejected_by_the_functional_ingest(name):
    """The same bad batches through the functional API: refused when ``Buffer.ingest`` is traced, with the same
    message body, so a user's jitted step fails to compile instead of storing garbage. Called eagerly here: under
    jax.jit, JAX itself narrows int64 / float64 inputs (x64 off) and refuses strings before the function sees them."""
    make, words = BAD_BATCHES[name]
    buffer = make_buffer(SPEC, 32, samplers.uniform(8), mesh=default_mesh(1))
    with pytest.raises(SpecError) as info:
        buffer.ingest(buffer.init(), make())
    msg = str(info.value)
    assert msg.startswith("Buffer.ingest(): ")
    for word in words:
        assert word in msg, f"{word!r} not in {msg!r}"


def test_sample_from_empty_plane(mesh, state_snapshot):
    plane = ExperienceDataPlane(SPEC, 16, samplers.uniform(8), mesh=mesh)
    check = state_snapshot(plane)
    assert not plane.can_sample() and len(plane) == 0
    with pytest.raises(NotEnoughDataError, match=r"sample\(\): the uniform sampler needs at least 1 .*has 0"):
        plane.sample()
    check()
    plane.ingest(batch(0, 1))
    assert plane.can_sample()
    assert (host(plane.sample().data["g"]) == 0).all()  # one item: every draw is it


def test_fifo_with_nothing_left(mesh, state_snapshot):
    plane = ExperienceDataPlane(SPEC, 16, samplers.fifo(8), mesh=mesh)
    plane.ingest(batch(0, 8))
    plane.sample()
    check = state_snapshot(plane)
    for _ in range(2):
        with pytest.raises(NotEnoughDataError, match="fifo.*undelivered.*has 0"):
            plane.sample()
    check()
    assert plane.stats()["deliverable"] == 0 and len(plane) == 8  # delivered items stay stored, only not pending


# -- constructor arguments ---------------------------------------------------------------------------------------------
BAD_CONFIGS = {
    "capacity-not-multiple-of-shards": (dict(capacity=12), 8, ["capacity 12", "multiple of the 8 shards", "16", "8"]),
    "batch-not-multiple-of-shards": (dict(sampler=samplers.uniform(12)), 8,
                                     ["batch_size 12", "multiple of the 8 shards", "use 16"]),
    "capacity-zero": (dict(capacity=0), 1, ["capacity must be a positive int", "0"]),
    "capacity-negative": (dict(capacity=-8), 8, ["capacity must be a positive int", "-8"]),
    "capacity-float": (dict(capacity=16.0), 8, ["capacity must be a positive int", "16.0"]),
    "capacity-bool": (dict(capacity=True), 1, ["capacity must be a positive int", "True"]),
    "capacity-str": (dict(capacity="16"), 1, ["capacity must be a positive int", "'16'"]),
    "capacity-none": (dict(capacity=None), 1, ["capacity must be a positive int", "None"]),
    "capacity-too-large": (dict(capacity=2**31), 1, ["capacity", "2**31"]),
    "sampler-not-a-sampler": (dict(sampler="uniform"), 1, ["sampler must be a samplers.Sampler", "str"]),
    "sampler-a-function": (dict(sampler=samplers.uniform), 1, ["sampler must be a samplers.Sampler", "function"]),
    "batch-larger-than-capacity": (dict(capacity=8, sampler=samplers.fifo(16)), 8,
                                   ["fifo", "needs 16 items", "capacity is 8"]),
}


@pytest.mark.parametrize("make", [ExperienceDataPlane, make_buffer], ids=["plane", "functional"])
@pytest.mark.parametrize("name", list(BAD_CONFIGS))
def test_bad_constructor_arguments(name, make):
    kwargs, devices, words = BAD_CONFIGS[name]
    kwargs = {"capacity": 16, "sampler": samplers.uniform(8), **kwargs}
    with pytest.raises(ConfigError) as info:
        make(SPEC, kwargs.pop("capacity"), kwargs.pop("sampler"), mesh=default_mesh(devices), **kwargs)
    msg = str(info.value)
    assert msg.startswith(f"{make.__name__}(): ")
    for word in words:
        assert word in msg, f"{word!r} not in {msg!r}"


def test_bad_spec_and_mesh_arguments():
    with pytest.raises(SpecError, match="no leaves"):
        ExperienceDataPlane({}, 16, samplers.uniform(8), mesh=default_mesh(1))
    with pytest.raises(SpecError, match=r"'x'.*float64"):
        ExperienceDataPlane({"x": jax.ShapeDtypeStruct((2,), np.float64)}, 16, samplers.uniform(8),
                            mesh=default_mesh(1))
    for devices in (0, 9, -1):
        with pytest.raises(ConfigError, match=rf"num_devices must be in \[1, 8\], got {devices}"):
            default_mesh(devices)


# -- counters ----------------------------------------------------------------------------------------------------------
def test_len_and_stats_counters(mesh):
    plane = ExperienceDataPlane(SPEC, 16, samplers.uniform(8), mesh=mesh)
    stats = plane.stats()
    assert (len(plane), stats["size"], stats["items_inserted"], stats["items_overwritten"]) == (0, 0, 0, 0)
    assert stats["capacity"] == 16 and stats["num_shards"] == mesh.size and stats["sampler"] == "uniform"
    for n, (size, inserted, overwritten) in [(5, (5, 5, 0)), (11, (16, 16, 0)), (20, (16, 36, 20)),
                                             (1, (16, 37, 21))]:
        plane.ingest(batch(0, n))
        stats = plane.stats()
        assert (len(plane), stats["size"], stats["items_inserted"], stats["items_overwritten"]) == \
            (size, size, inserted, overwritten), n
    plane.sample()
    plane.sample()
    stats = plane.stats()
    stages = stats["stages"]
    assert stages["ingest"]["calls"] == 4 and stages["sample"]["calls"] == 2 and stats["items_inserted"] == 37
    assert stages["ingest"]["median_us"] > 0 and stages["sample"]["median_us"] > 0


# -- values through ingest -> sample -----------------------------------------------------------------------------------
def _expect_items(delivery, sent):
    """Every delivered item equals the sent item its 'g' leaf names, bit for bit, in every leaf."""
    out = jax.device_get(delivery.data)
    g = np.asarray(out["g"])
    for path, got in jax.tree_util.tree_leaves_with_path(out):
        want = sent
        for key in path:
            want = want[key.key]
        got, want = np.asarray(got), np.asarray(want)[g]
        assert got.dtype == want.dtype and got.shape == want.shape, jax.tree_util.keystr(path)
        np.testing.assert_array_equal(got.view(np.uint8), want.view(np.uint8), err_msg=jax.tree_util.keystr(path))
    return g


@pytest.mark.parametrize("to_device", [False, True], ids=["numpy", "jax"])
def test_values_survive_ingest_and_sample(any_mesh, to_device):
    """Numpy batches are packed on the host, device arrays in the kernel: both paths store the same bits."""
    plane = ExperienceDataPlane(SPEC, 16, samplers.fifo(16), mesh=any_mesh)
    sent = batch(0, 16)
    sent["reward"][[1, 4]] = [np.inf, -0.0]
    plane.ingest(as_jax(sent) if to_device else sent)
    g = _expect_items(plane.sample(), sent)
    assert sorted(g.tolist()) == list(range(16))


@pytest.mark.parametrize("to_device", [False, True], ids=["numpy", "jax"])
def test_ingest_keeps_nan_payloads(mesh, to_device):
    """Storage is bytes: NaN payloads of bfloat16 / float32 leaves come back unchanged (odd and even counts)."""
    spec = ExperienceSpec.from_example({"b3": np.zeros((3,), jnp.bfloat16), "b2": np.zeros((2,), jnp.bfloat16),
                                        "f": np.float32(0), "g": np.int32(0)})
    plane = ExperienceDataPlane(spec, 8, samplers.fifo(8), mesh=mesh)
    sent = {
        "b3": np.tile(np.array([0x7F81, 0xFFA3, 0x7FF2], np.uint16), (5, 1)).view(jnp.bfloat16),
        "b2": np.tile(np.array([0x7F85, 0xFF81], np.uint16), (5, 1)).view(jnp.bfloat16),
        "f": np.full(5, 0x7F800001, np.uint32).view(np.float32),
        "g": np.arange(5, dtype=np.int32),
    }
    plane.ingest(as_jax(sent) if to_device else sent)
    plane.ingest({k: v[:3] for k, v in sent.items()})
    _expect_items(plane.sample(), {k: np.concatenate([v, v[:3]]) for k, v in sent.items()} | {
        "g": np.concatenate([sent["g"], sent["g"][:3]])})


def test_numpy_input_is_not_aliased(mesh):
    """The caller may reuse its numpy buffers as soon as ingest returns."""
    plane = ExperienceDataPlane(SPEC, 8, samplers.fifo(8), mesh=mesh)
    sent = batch(0, 8)
    keep = jax.tree_util.tree_map(np.copy, sent)
    plane.ingest(sent)
    for leaf in jax.tree_util.tree_leaves(sent):
        leaf[...] = 0
    _expect_items(plane.sample(), keep)


def test_back_to_back_ingests_through_the_reused_staging_array(mesh):
    """Batches packed into the staging array an earlier ingest's kernel read (reused only once that kernel has
    finished) all arrive intact, whether or not anything waited in between (sync: a kernel per ingest)."""
    plane = ExperienceDataPlane(SPEC, 64, samplers.fifo(56), mesh=mesh, schedule=schedule.sync())
    for start in range(0, 40, 8):  # dispatched back to back, never waited on
        plane.ingest(batch(start, 8))
    jax.block_until_ready(plane.state)
    plane.ingest(batch(40, 8))  # the previous ingest has finished: its staging array is packed again
    reused = plane.engine.staging.last
    jax.block_until_ready(plane.state)
    plane.ingest(batch(48, 8))
    assert plane.engine.staging.last is reused
    g = _expect_items(plane.sample(), batch(0, 56))
    assert sorted(g.tolist()) == list(range(56))


def test_ingest_after_the_state_went_through_a_users_jit(mesh):
    """A state donated to the learner's own jit (the fused path) and stored back: the finished marker of the kernel
    that wrote the staged rows still says when its staging array is free, so the next batches are packed into it
    again and arrive intact."""
    plane = ExperienceDataPlane(SPEC, 64, samplers.fifo(16), mesh=mesh)
    plane.ingest(batch(0, 8))
    step = jax.jit(plane.sample_fn(), donate_argnums=0)
    plane.ingest(batch(8, 8))
    state, first = step(plane.state)  # reading the state writes the 16 staged items first
    reused = plane.engine.staging.last
    plane.state = state
    jax.block_until_ready(first)
    plane.ingest(batch(16, 8))
    plane.ingest(batch(24, 8))
    plane.block_until_ready()  # written from the array the first kernel read
    assert plane.engine.staging.last is reused
    assert sorted(_expect_items(first, batch(0, 16)).tolist()) == list(range(16))
    assert sorted(_expect_items(plane.sample(), batch(0, 32)).tolist()) == list(range(16, 32))


def test_capacity_error_is_a_conduit_error(mesh, state_snapshot):
    plane = ExperienceDataPlane(SPEC, 8, samplers.fifo(8), mesh=mesh)
    plane.ingest(batch(0, 8))
    check = state_snapshot(plane)
    with pytest.raises(CapacityError) as info:
        plane.ingest(batch(8, 1))
    assert isinstance(info.value, ConduitError) and "ingest(): the fifo queue holds 8 undelivered" in str(info.value)
    check()


@pytest.mark.parametrize("to_device", [False, True], ids=["numpy", "jax"])
@pytest.mark.parametrize("sampler", ["uniform", "sequences"])
def test_wide_rows_are_delivered_bit_exactly(sampler, to_device):
    """On one shard every leaf is gathered straight from its elements of the ring (here a byte ring: frames make most
    of the row); wide rows stay bit-exact, packed on the host or, from device arrays, on the device."""
    spec = ExperienceSpec.from_example({"frame": np.zeros((32, 40), np.uint8), "t": np.int32(0), "env": np.int32(0),
                                           "r": np.float32(0), "terminated": np.bool_(False),
                                           "truncated": np.bool_(False)})
    assert storage.RowLayout.of(spec).row_bytes >= 1024
    streams = 4
    chosen = samplers.uniform(8) if sampler == "uniform" else samplers.sequences(8, 3, streams, pad=True)
    plane = ExperienceDataPlane(spec, 64, chosen, mesh=default_mesh(1))
    rng = np.random.default_rng(0)
    frames = rng.integers(0, 256, (40, streams, 32, 40)).astype(np.uint8)
    assert plane.config.layout.ring_dtype == np.uint8
    for t in range(10):
        step = {"frame": frames[t], "t": np.full(streams, t, np.int32), "env": np.arange(streams, dtype=np.int32),
                "r": rng.random(streams).astype(np.float32), "terminated": np.zeros(streams, bool),
                "truncated": np.zeros(streams, bool)}
        plane.ingest(as_jax(step) if to_device else step)
    for _ in range(5):
        data = jax.device_get(plane.sample().data)
        t, env = np.asarray(data["t"]), np.asarray(data["env"])
        np.testing.assert_array_equal(np.asarray(data["frame"]), frames[t, env])
    # device steps are packed on the device, host steps on the host (staged: the first draw writes all ten)
    assert "pack[4]" in plane.compile_counts() if to_device else "ingest[64,packed]+sample" in plane.compile_counts()


# -- recycled batches --------------------------------------------------------------------------------------------------
def _twin_planes(mesh, sampler):
    """Two planes with the same seed and contents: their draws agree call for call."""
    planes = [ExperienceDataPlane(SPEC, 64, sampler, mesh=mesh, seed=3) for _ in range(2)]
    for plane in planes:
        plane.ingest(batch(0, 40))
    return planes


def _assert_same_delivery(a, b):
    for x, y in zip(jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b)):
        np.testing.assert_array_equal(host(x), host(y))


@pytest.mark.parametrize("sampler", ["uniform", "prioritized"])
def test_recycled_batch_buffers_hold_the_same_draws(mesh, sampler, recwarn):
    """sample(recycle=d) delivers what sample() would, into d's buffers (on one device: the very same memory), with
    d's arrays deleted, no donation warning and no compile after the first recycling call."""
    make = {"uniform": lambda: samplers.uniform(8), "prioritized": lambda: samplers.prioritized(8, 0.6, 0.4)}[sampler]
    plain, recycling = _twin_planes(mesh, make())
    previous = recycling.sample()
    _assert_same_delivery(plain.sample(), previous)
    for step in range(4):
        if sampler == "prioritized":  # the update rides in the next sample's kernel: the recycling variant of it
            priorities = np.linspace(0.5, 2.0, 8, dtype=np.float32) * (step + 1)
            plain.update_priorities(previous.ids, priorities)
            recycling.update_priorities(previous.ids, priorities)
        pointer = previous.data["g"].unsafe_buffer_pointer() if mesh.size == 1 else None
        delivery = recycling.sample(recycle=previous)
        assert previous.data["g"].is_deleted() and previous.ids.is_deleted()
        if pointer is not None:
            assert delivery.data["g"].unsafe_buffer_pointer() == pointer
        _assert_same_delivery(plain.sample(), delivery)
        previous = delivery
    counts = recycling.compile_counts()
    assert sum(v for k, v in counts.items() if k.endswith("sample[recycle]")) >= 1, counts
    assert all(count == 1 for count in counts.values()), counts
    assert not [w for w in recwarn if "donated" in str(w.message)], [str(w.message) for w in recwarn]


def _unreturned_delivery(plane):
    """A Delivery of the right shapes that this plane did not return (it has returned none)."""
    from conduit_jax.replay import Delivery

    return Delivery(as_jax(batch(0, plane.batch_size)), jnp.zeros((plane.batch_size, 2), jnp.int32), None)


def test_bad_recycle_rejected_state_unchanged(mesh, state_snapshot):
    plane = ExperienceDataPlane(SPEC, 32, samplers.uniform(8), mesh=mesh)
    plane.ingest(batch(0, 12))
    check = state_snapshot(plane)
    with pytest.raises(SpecError, match=r"sample\(\): recycle takes a Delivery this plane returned, and it has "
                                         r"delivered none yet"):
        plane.sample(recycle=_unreturned_delivery(plane))
    check()
    kept = plane.sample()
    other = ExperienceDataPlane(SPEC, 32, samplers.uniform(16), mesh=mesh)
    elsewhere = ExperienceDataPlane(SPEC, 32, samplers.uniform(8), mesh=default_mesh(1 if mesh.size > 1 else 8))
    for plane_ in (other, elsewhere):
        plane_.ingest(batch(0, 16))
    check = state_snapshot(plane)
    cases = [
        ("a dict", {"data": kept.data}, ["recycle must be a Delivery", "dict"]),
        ("another batch size", other.sample(), ["recycle.data['action']", "int32[8]", "got int32[16]"]),
        ("another mesh", elsewhere.sample(), ["recycle.data['action']", "placed as this plane's batches"]),
        ("a numpy leaf", kept._replace(ids=np.zeros((8, 2), np.int32)), ["recycle.ids", "jax.Array", "ndarray"]),
        ("another structure", kept._replace(weights=jnp.ones(8)), ["structure"]),
    ]
    for label, bad, words in cases:
        with pytest.raises(SpecError) as info:
            plane.sample(recycle=bad)
        message = str(info.value)
        assert message.startswith("sample(): ") and all(w in message for w in words), (label, message)
        check()
        assert not kept.data["g"].is_deleted(), label
    plane.sample(recycle=kept)
    check = state_snapshot(plane)
    with pytest.raises(SpecError, match=r"recycle.data\['action'\] was deleted \(already recycled"):
        plane.sample(recycle=kept)
    check()


def test_deliver_recycles_into_the_next_dispatch_and_refuses_a_queued_batch(state_snapshot):
    from conduit_jax import schedule as schedule_lib

    planes = [ExperienceDataPlane(SPEC, 64, samplers.uniform(8), schedule=schedule_lib.overlap(2),
                                  mesh=default_mesh(1), seed=5) for _ in range(2)]
    for plane in planes:
        plane.ingest(batch(0, 40))
    plain, recycling = planes
    previous = recycling.deliver()
    _assert_same_delivery(plain.deliver(), previous)
    for _ in range(3):
        delivery = recycling.deliver(recycle=previous)
        recycling.in_flight()  # waits for the delivery worker's refill, which takes the recycled buffers
        assert previous.ids.is_deleted()  # the batch dispatched behind this one went into its buffers
        _assert_same_delivery(plain.deliver(), delivery)
        previous = delivery
    queued = recycling.in_flight()[0]
    check = state_snapshot(recycling)
    with pytest.raises(SpecError, match=r"deliver\(\): recycle is a batch still queued for deliver\(\)"):
        recycling.deliver(recycle=queued)
    check()
