"""Storage: the packed row layout (bit-exact round trips) and the sharded round-robin rings (positions computed
by hand)."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conduit_jax import ExperienceDataPlane, ExperienceSpec, replay, samplers, storage
from conduit_jax.replay import default_mesh
from conduit_jax.spec import SUPPORTED_DTYPES

SHAPES = [(), (1,), (2,), (3,), (5,), (7,), (2, 3)]


def random_leaf(rng, n, shape, dtype, nan_payloads=False):
    """``n`` items of random *bits* of ``dtype`` (infinities, subnormals, -0 included for floats). NaNs keep their
    random payloads only with ``nan_payloads``; otherwise they become the canonical quiet NaN of their sign (the NaN
    payload contract has its own test)."""
    dtype = np.dtype(dtype)
    if dtype == np.bool_:
        return rng.integers(0, 2, (n, *shape)).astype(np.bool_)
    raw = rng.integers(0, 256, n * int(np.prod(shape, dtype=np.int64)) * dtype.itemsize, dtype=np.uint8)
    x = raw.view(dtype).reshape(n, *shape)
    if dtype.name in ("float16", "bfloat16", "float32") and not nan_payloads:
        word = {2: np.uint16, 4: np.uint32}[dtype.itemsize]
        sign = word(1 << (8 * dtype.itemsize - 1))
        quiet = word({"float16": 0x7E00, "bfloat16": 0x7FC0, "float32": 0x7FC00000}[dtype.name])
        bits = x.view(word)
        x = np.where(np.isnan(x.astype(np.float32)), (bits & sign) | quiet, bits).astype(word).view(dtype)
    return x


def assert_bits_equal(got, want):
    got, want = np.atleast_1d(np.asarray(got)), np.atleast_1d(np.asarray(want))
    assert got.dtype == want.dtype and got.shape == want.shape
    np.testing.assert_array_equal(got.view(np.uint8), want.view(np.uint8))


# -- RowLayout ------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", SUPPORTED_DTYPES, ids=lambda d: np.dtype(d).name)
def test_pack_unpack_round_trip_bit_exact(dtype):
    """Every supported dtype, as 0-d leaves and odd and even element counts (1- and 2-byte types pad to a word)."""
    spec = ExperienceSpec.from_structs({f"s{i}": jax.ShapeDtypeStruct(shape, dtype) for i, shape in enumerate(SHAPES)})
    layout = storage.RowLayout.of(spec)
    per_word = 4 // np.dtype(dtype).itemsize
    words = [-(-int(np.prod(shape, dtype=np.int64)) // per_word) for shape in SHAPES]  # padded up to whole words
    assert [slot.words for slot in layout.slots] == words and layout.row_words == sum(words)
    rng = np.random.default_rng(per_word)
    batch = {f"s{i}": random_leaf(rng, 5, shape, dtype) for i, shape in enumerate(SHAPES)}
    rows = jax.jit(layout.pack)(batch)  # separate kernels, as in the plane (ingest packs, sample unpacks)
    out = jax.jit(layout.unpack)(rows)
    assert rows.dtype == jnp.uint32 and rows.shape == (5, layout.row_words)
    for name, leaf in batch.items():
        assert_bits_equal(out[name], leaf)


@pytest.mark.parametrize("elems", [2, 3, 5])
@pytest.mark.parametrize("dtype", [np.float16, jnp.bfloat16, np.float32], ids=lambda d: np.dtype(d).name)
def test_pack_unpack_keeps_nan_payloads(dtype, elems):
    """Storage is bytes: a NaN's sign and payload (signalling NaNs included) come back as they went in."""
    bits = np.array({2: [0x7C01, 0xFE5A, 0x7D00, 0xFC03, 0x7F81], 4: [0x7F800001, 0xFFC12345, 0x7FA00000,
                                                                     0xFF800F00, 0x7FC00001]}[np.dtype(dtype).itemsize],
                    {2: np.uint16, 4: np.uint32}[np.dtype(dtype).itemsize])
    if np.dtype(dtype) == jnp.bfloat16:
        bits = np.array([0x7F81, 0xFFA3, 0x7FF2, 0xFF81, 0x7FC1], np.uint16)
    x = bits[:elems].view(dtype)[None]
    assert np.isnan(x.astype(np.float32)).all()
    layout = storage.RowLayout.of(ExperienceSpec.from_structs({"x": jax.ShapeDtypeStruct((elems,), dtype)}))
    rows = jax.jit(layout.pack)({"x": x})  # the plane packs in its ingest kernel and unpacks in its sample kernel
    assert_bits_equal(jax.jit(layout.unpack)(rows)["x"], x)
    assert_bits_equal(layout.unpack(layout.pack({"x": x}))["x"], x)  # and op by op


MIXED = {  # keys sorted = flatten order; (shape, dtype, words the leaf takes)
    "a": ((3,), np.bool_, 1),
    "b": ((5,), np.uint8, 2),
    "c": ((), np.int8, 1),
    "d": ((3,), np.uint16, 2),
    "e": ((), np.int16, 1),
    "f": ((2,), np.uint32, 2),
    "g": ((), np.int32, 1),
    "h": ((5,), np.float16, 3),
    "i": ((3,), jnp.bfloat16, 2),
    "j": ((2, 2), np.float32, 4),
}


def test_mixed_layout_offsets_and_round_trip():
    spec = ExperienceSpec.from_structs({k: jax.ShapeDtypeStruct(s, d) for k, (s, d, _) in MIXED.items()})
    layout = storage.RowLayout.of(spec)
    words = [w for _, _, w in MIXED.values()]
    assert [slot.words for slot in layout.slots] == words
    assert [slot.offset for slot in layout.slots] == list(np.cumsum([0] + words[:-1]))
    assert layout.row_words == sum(words) == 19 and layout.row_bytes == 76
    assert layout.row_bytes * 10 == 760

    rng = np.random.default_rng(0)
    batch = {k: random_leaf(rng, 7, s, d) for k, (s, d, _) in MIXED.items()}
    rows = np.asarray(jax.jit(layout.pack)(batch))
    out = jax.jit(layout.unpack)(rows)
    for k in MIXED:
        assert_bits_equal(out[k], batch[k])
    # leading axes of any rank: rows [2, 6, words] unpack to leaves [2, 6, ...]
    nested = jax.jit(layout.unpack)(np.concatenate([rows, rows[:5]]).reshape(2, 6, layout.row_words))
    for k, (s, _, _) in MIXED.items():
        assert nested[k].shape == (2, 6, *s)
        assert_bits_equal(nested[k][0, 3], batch[k][3])
        assert_bits_equal(nested[k][1, 5], batch[k][4])


@pytest.mark.parametrize("ring", ["uint32", "uint8"])
def test_gathering_leaves_equals_gathering_rows_then_unpacking(ring):
    """gather_leaves (each leaf read from its own elements of the ring: words, or bytes and halves for sub-word
    types) and read_leaf deliver the same bits as gathering whole rows and unpacking, NaN payloads included, for any
    shape of row indices, from a ring of words and from a ring of the same bytes (a layout made mostly of bytes)."""
    spec = ExperienceSpec.from_structs({k: jax.ShapeDtypeStruct(s, d) for k, (s, d, _) in MIXED.items()})
    layout = storage.RowLayout.of(spec)
    rng = np.random.default_rng(3)
    packed = jax.jit(layout.pack)({k: random_leaf(rng, 11, s, d, nan_payloads=True) for k, (s, d, _) in MIXED.items()})
    rows = packed if ring == "uint32" else jax.jit(
        lambda r: jax.lax.bitcast_convert_type(r, jnp.uint8).reshape(r.shape[0], layout.row_bytes))(packed)
    np.testing.assert_array_equal(np.asarray(rows).view(np.uint32), np.asarray(packed))
    whole_rows = packed
    at = jnp.asarray(rng.integers(0, 11, (4, 3)), jnp.int32)
    direct = jax.jit(layout.gather_leaves)(rows, at)
    whole = jax.jit(lambda r, a: layout.unpack(r[a]))(whole_rows, at)
    for k in MIXED:
        assert direct[k].shape == (4, 3, *MIXED[k][0])
        assert_bits_equal(direct[k], whole[k])
        assert_bits_equal(jax.jit(functools.partial(layout.read_leaf, name=k))(rows, at=at), whole[k])


@pytest.mark.parametrize("block_rows", [None, 1, 2, 4], ids=["one-block", "blocks-of-1", "blocks-of-2", "blocks-of-4"])
def test_host_packing_matches_device_packing_bit_for_bit(block_rows, monkeypatch):
    """The shell packs NumPy batches on the host (pack_host, HostRows) and device arrays in the kernel (pack): the
    same rows, padding and NaN payloads included, for every dtype and word alignment, narrow and wide (image-like)
    leaves, also into a reused, dirty output array, for a slice of the batch with padding rows past it, for leaves
    that are strided views of larger arrays, and through the views of rows packed again and again (the staging
    area's); in one block of rows or in several (the last one short)."""
    shapes = {k: (s, d) for k, (s, d, _) in MIXED.items()} | {"wide_u8": ((67,), np.uint8),
                                                                 "wide_bf16": ((33,), jnp.bfloat16)}
    spec = ExperienceSpec.from_structs({k: jax.ShapeDtypeStruct(s, d) for k, (s, d) in shapes.items()})
    layout = storage.RowLayout.of(spec)
    if block_rows is not None:
        monkeypatch.setattr(storage, "PACK_BLOCK_BYTES", block_rows * layout.row_bytes)
    rng = np.random.default_rng(1)
    batch = {k: random_leaf(rng, 9, s, d, nan_payloads=True) for k, (s, d) in shapes.items()}
    leaves = jax.tree_util.tree_leaves(batch)
    device = np.asarray(jax.jit(layout.pack)(batch))
    np.testing.assert_array_equal(layout.pack_host(leaves, 0, 9, 9), device)
    dirty = storage.aligned_empty((16, layout.row_words))
    dirty[...] = 0xDEADBEEF
    packed = layout.pack_host(leaves, 2, 5, 16, out=dirty)
    assert packed is dirty
    np.testing.assert_array_equal(packed[:5], device[2:7])
    # every other item of a twice-as-long batch: no leaf is contiguous
    doubled = [np.repeat(leaf, 2, axis=0)[::2] for leaf in leaves]
    assert not any(leaf.flags.c_contiguous for leaf in doubled)
    np.testing.assert_array_equal(layout.pack_host(doubled, 0, 9, 9), device)
    # rows written through their views at an offset, then over with other items: padding bytes stay zero
    rows = storage.HostRows.zeroed(layout, 16)
    rows.write(leaves, 0, 9, 3)
    rows.write(doubled, 4, 5, 3)
    np.testing.assert_array_equal(rows.array[3:8], device[4:9])
    np.testing.assert_array_equal(rows.array[8:12], device[5:9])
    assert not rows.array[:3].any() and not rows.array[12:].any()


def test_packing_into_a_byte_ring_gives_the_bytes_of_the_word_rows():
    """Device arrays ingested into a byte ring are packed straight to bytes (pack_ring): the very bytes of pack's
    words, padding and NaN payloads included, for every dtype."""
    shapes = {k: (s, d) for k, (s, d, _) in MIXED.items()} | {"frame": ((300,), np.uint8)}
    spec = ExperienceSpec.from_structs({k: jax.ShapeDtypeStruct(s, d) for k, (s, d) in shapes.items()})
    layout = storage.RowLayout.of(spec)
    assert layout.ring_dtype == np.uint8
    batch = {k: random_leaf(np.random.default_rng(2), 9, s, d, nan_payloads=True) for k, (s, d) in shapes.items()}
    words = np.asarray(jax.jit(layout.pack)(batch))
    ring = np.asarray(jax.jit(layout.pack_ring)(batch))
    assert ring.dtype == np.uint8 and ring.shape == (9, layout.row_bytes)
    np.testing.assert_array_equal(ring.view(np.uint32), words)


def test_pack_puts_each_leaf_in_its_own_words():
    """Padding of a sub-word leaf is zeros and never spills into the next leaf's words."""
    spec = ExperienceSpec.from_example({"a": np.zeros((3,), np.uint8), "b": np.uint8(0)})
    layout = storage.RowLayout.of(spec)
    rows = np.asarray(layout.pack({"a": np.array([[1, 2, 3]], np.uint8), "b": np.array([9], np.uint8)}))
    np.testing.assert_array_equal(rows.view(np.uint8).reshape(1, 8), [[1, 2, 3, 0, 9, 0, 0, 0]])


def test_zero_size_leaf():
    spec = ExperienceSpec.from_example({"e": np.zeros((0,), np.float32), "g": np.int32(0)})
    layout = storage.RowLayout.of(spec)
    assert layout.row_words == 1
    out = layout.unpack(layout.pack({"e": np.zeros((3, 0), np.float32), "g": np.arange(3, dtype=np.int32)}))
    assert out["e"].shape == (3, 0) and out["e"].dtype == np.float32
    np.testing.assert_array_equal(out["g"], [0, 1, 2])


def test_init_works_under_eval_shape():
    spec = ExperienceSpec.from_example({"obs": np.zeros((84, 84, 4), np.uint8), "r": 0.0})
    layout = storage.RowLayout.of(spec)
    abstract = jax.eval_shape(lambda: storage.init(layout, 1 << 20, 8))
    # frames make the row mostly bytes: the ring holds the row's 4 * (84 * 84 + 1) bytes as uint8
    assert layout.ring_dtype == np.uint8 and layout.ring_width == 4 * (84 * 84 + 1) == layout.row_bytes
    assert abstract.rows.shape == (1 << 20, layout.ring_width) and abstract.rows.dtype == np.uint8
    assert abstract.cursor.shape == (8,) and abstract.laps.shape == (8,) and abstract.next_shard.shape == ()
    assert all(isinstance(leaf, jax.ShapeDtypeStruct) for leaf in jax.tree_util.tree_leaves(abstract))
    # the whole plane state too, for every sampler, at a capacity nobody allocates (the config comes from a small plane)
    small = ExperienceDataPlane({"x": jax.ShapeDtypeStruct((3,), jnp.uint8)}, 8, samplers.uniform(8),
                                mesh=jax.make_mesh((1,), ("shard",)))
    for sampler in (samplers.uniform(8), samplers.fifo(8), samplers.epochs(8)):
        config = small.config._replace(layout=layout, sampler=sampler, capacity=1 << 20)
        state = jax.eval_shape(lambda c=config: replay.init(c, 0))
        assert state.storage.rows.shape == (1 << 20, layout.ring_width)
        assert all(isinstance(leaf, jax.ShapeDtypeStruct) for leaf in jax.tree_util.tree_leaves(state))


# -- pure per-shard kernels -----------------------------------------------------------------------------------------
def _rows(capacity):
    return jnp.arange(capacity, dtype=jnp.uint32)[:, None] * jnp.uint32(10)


@pytest.mark.parametrize("cursor, count, k, expect_rows, expect_cursor, expect_laps", [
    # no wrap, block fits at the cursor
    (1, 3, 4, [0, 100, 101, 102, 40, 50, 60, 70], 4, 0),
    # no wrap, but the k-row slice would not fit: it is shifted left, the rows before the cursor are kept
    (5, 3, 4, [0, 10, 20, 30, 40, 100, 101, 102], 0, 1),
    # wrap: 2 rows at the end, 1 at the start; padding row 3 of the block must not land on row 1
    (6, 3, 4, [102, 10, 20, 30, 40, 50, 100, 101], 1, 1),
    # a full ring from a non-zero cursor
    (3, 8, 8, [105, 106, 107, 100, 101, 102, 103, 104], 3, 1),
    # count 0 (a shard that got no item): nothing changes
    (2, 0, 4, [0, 10, 20, 30, 40, 50, 60, 70], 2, 0),
])
def test_write_hand_computed(cursor, count, k, expect_rows, expect_cursor, expect_laps):
    block = (jnp.arange(k, dtype=jnp.uint32) + 100)[:, None]
    rows, new_cursor, new_laps = jax.jit(storage.write)(_rows(8), jnp.int32(cursor), jnp.int32(0), block,
                                                        jnp.int32(count))
    np.testing.assert_array_equal(np.asarray(rows)[:, 0], expect_rows)
    assert int(new_cursor) == expect_cursor and int(new_laps) == expect_laps


@pytest.mark.parametrize("streams", [1, 2])
def test_wide_byte_rows_are_written_as_the_word_scatter_writes_them(streams):
    """A byte ring with wide rows is written by a loop of row copies, the others by one scatter: the same rows,
    cursor and laps, for fitting, shifted, wrapping, full and empty writes, padding rows never landing."""
    words = storage.ROW_COPY_MIN_BYTES // 4
    rng = np.random.default_rng(0)
    ring = rng.integers(0, 2**32, (8, words), dtype=np.uint32)
    write = jax.jit(storage.write, static_argnums=5)
    for cursor, count, k in [(1, 3, 4), (5, 3, 4), (6, 3, 4), (3, 8, 8), (2, 0, 4), (7, 5, 8)]:
        block = rng.integers(0, 2**32, (k, words), dtype=np.uint32)
        args = (jnp.int32(cursor), jnp.int32(1), block, jnp.int32(count), streams)
        want = write(ring, *args)
        got = write(ring.view(np.uint8), args[0], args[1], block.view(np.uint8), *args[3:])
        assert got[0].dtype == np.uint8
        np.testing.assert_array_equal(np.asarray(got[0]).view(np.uint32), np.asarray(want[0]))
        assert (int(got[1]), int(got[2])) == (int(want[1]), int(want[2]))


def test_deal_round_robin():
    # 6 items padded to 8 rows, 4 shards, the next item goes to shard 2: item g -> shard (2 + g) % 4
    batch = {"g": jnp.arange(8, dtype=jnp.int32)}
    want = {2: ([0, 4], 2), 3: ([1, 5], 2), 0: ([2, 6], 1), 1: ([3, 7], 1)}  # (rows taken, valid count)
    for shard, (rows, count) in want.items():
        mine, got_count = storage.deal(batch, jnp.int32(2), jnp.int32(6), jnp.int32(shard), 4)
        np.testing.assert_array_equal(mine["g"], rows)
        assert int(got_count) == count


def test_generation_and_count():
    cursor, laps = jnp.int32(3), jnp.int32(2)
    np.testing.assert_array_equal(storage.slot_generation(cursor, laps, jnp.arange(6)), [3, 3, 3, 2, 2, 2])
    assert int(storage.shard_count(jnp.int32(3), jnp.int32(0), 6)) == 3
    assert int(storage.shard_count(jnp.int32(3), jnp.int32(1), 6)) == 6


@pytest.mark.parametrize("n, shards, shard_capacity, k", [
    (1, 1, 8, 1), (5, 1, 8, 8), (6, 1, 8, 8), (9, 1, 16, 16), (9, 8, 2, 2), (8, 8, 4, 1), (17, 8, 8, 4),
    (1000, 8, 16, 16), (3, 1, 6, 4), (5, 1, 6, 6),
])
def test_ingest_rows_per_shard(n, shards, shard_capacity, k):
    assert replay.padded_rows(n, shards, shard_capacity) == shards * k


def test_compile_sizes_one_rule_for_every_caller():
    """replay.compile_size: powers of two for writes, finer steps for per-row work, a multiple of the shard count."""
    assert [replay.compile_size(n) for n in (1, 2, 3, 5, 8, 9, 1000)] == [1, 2, 4, 8, 8, 16, 1024]
    for steps, padding in ((4, 1 / 4), (8, 1 / 8)):
        sizes = {replay.compile_size(n, steps_per_octave=steps) for n in range(1, 1025)}
        assert len(sizes) <= 2 * steps + steps * 10
        for n in range(2 * steps, 4000):
            assert n <= replay.compile_size(n, steps_per_octave=steps) < n + n * padding
    assert [replay.compile_size(n, steps_per_octave=8) for n in (17, 63, 65, 66, 100)] == [18, 64, 72, 72, 104]
    assert [replay.compile_size(n, steps_per_octave=8, multiple=4) for n in (1, 5, 9, 65)] == [4, 8, 12, 72]
    assert replay.compile_size(5, steps_per_octave=8, multiple=3) == 6
    assert replay.compile_size(100, limit=64) == 64


# -- rings through the plane: hand-computed positions ----------------------------------------------------------------
SPEC = ExperienceSpec.from_example({"g": np.int32(0), "x": np.zeros((3,), np.uint8), "flag": np.zeros((), np.bool_)})


def items(start, n):
    g = np.arange(start, start + n, dtype=np.int32)
    return {"g": g, "x": ((g[:, None] + np.arange(3)) % 256).astype(np.uint8), "flag": g % 3 == 0}


def stored(plane):
    """Every row of the buffer unpacked on the host: {'g': int32[capacity], ...}."""
    rows = jax.device_get(plane.state.storage.rows)
    return jax.tree_util.tree_map(np.asarray, plane.config.layout.unpack(jnp.asarray(rows)))


def host(x):
    return np.asarray(jax.device_get(x))


def check_rows(plane, table):
    """``table[row]`` is the item index stored there, or -1 for a never-written (all-zero) row."""
    out = stored(plane)
    table = np.asarray(table)
    full = table >= 0
    np.testing.assert_array_equal(out["g"][full], table[full])
    want = items(0, int(table.max()) + 1)
    for name in ("x", "flag"):
        np.testing.assert_array_equal(out[name][full], want[name][table[full]])
    raw = host(plane.state.storage.rows)
    assert not raw[~full].any(), "a row that no item was dealt to was written (padding leaked)"


def check_ids(plane, table, generations, draws=64):
    """Uniform draws: each delivered id is (row, live generation) and its data is the item stored at that row."""
    for _ in range(2):
        delivery = plane.sample()
        ids, g = host(delivery.ids), host(delivery.data["g"])
        assert ids.shape == (plane.batch_size, 2)
        np.testing.assert_array_equal(g, np.asarray(table)[ids[:, 0]])
        np.testing.assert_array_equal(ids[:, 1], np.asarray(generations)[ids[:, 0]])


def test_ring_wraparound_one_device():
    plane = ExperienceDataPlane(SPEC, 8, samplers.uniform(64), mesh=jax.make_mesh((1,), ("shard",)))
    plane.ingest(items(0, 5))
    check_rows(plane, [0, 1, 2, 3, 4, -1, -1, -1])
    assert host(plane.state.storage.cursor).tolist() == [5] and host(plane.state.storage.laps).tolist() == [0]
    plane.ingest(items(5, 6))  # items 5, 6, 7 fill the ring; 8, 9, 10 overwrite slots 0, 1, 2
    table = [8, 9, 10, 3, 4, 5, 6, 7]
    check_rows(plane, table)
    assert host(plane.state.storage.cursor).tolist() == [3] and host(plane.state.storage.laps).tolist() == [1]
    assert int(host(plane.state.storage.next_shard)) == 0
    check_ids(plane, table, [2, 2, 2, 1, 1, 1, 1, 1])
    assert len(plane) == 8


def test_ring_wraparound_eight_shards():
    # capacity 16 over 8 shards: 2 slots each. Item g -> shard g % 8, slot (g // 8) % 2, row 2 * shard + slot.
    plane = ExperienceDataPlane(SPEC, 16, samplers.uniform(64), mesh=jax.make_mesh((8,), ("shard",)))
    plane.ingest(items(0, 5))  # shards 0..4 slot 0
    check_rows(plane, [0, -1, 1, -1, 2, -1, 3, -1, 4, -1, -1, -1, -1, -1, -1, -1])
    assert host(plane.state.storage.cursor).tolist() == [1, 1, 1, 1, 1, 0, 0, 0]
    assert int(host(plane.state.storage.next_shard)) == 5
    plane.ingest(items(5, 6))  # 5, 6, 7 -> slot 0 of shards 5..7; 8, 9, 10 -> slot 1 of shards 0..2
    check_rows(plane, [0, 8, 1, 9, 2, 10, 3, -1, 4, -1, 5, -1, 6, -1, 7, -1])
    assert host(plane.state.storage.cursor).tolist() == [0, 0, 0, 1, 1, 1, 1, 1]
    assert host(plane.state.storage.laps).tolist() == [1, 1, 1, 0, 0, 0, 0, 0]
    assert int(host(plane.state.storage.next_shard)) == 3
    plane.ingest(items(11, 9))  # 11..15 -> slot 1 of shards 3..7; 16..19 overwrite slot 0 of shards 0..3
    table = [16, 8, 17, 9, 18, 10, 19, 11, 4, 12, 5, 13, 6, 14, 7, 15]
    check_rows(plane, table)
    assert host(plane.state.storage.cursor).tolist() == [1, 1, 1, 1, 0, 0, 0, 0]
    assert host(plane.state.storage.laps).tolist() == [1, 1, 1, 1, 1, 1, 1, 1]
    assert int(host(plane.state.storage.next_shard)) == 4
    check_ids(plane, table, [2, 1, 2, 1, 2, 1, 2, 1, 1, 1, 1, 1, 1, 1, 1, 1])
    assert len(plane) == 16


def test_streams_are_stored_stream_major():
    # 4 streams (envs) over 2 shards, capacity 16: item g = 4 t + e goes to shard e % 2, slot 2 t + e // 2; each
    # shard's ring keeps its 2 streams in blocks of 4 rows, step t of a stream at row t % 4 of its block.
    sampler = samplers.sequences(4, 2, streams=4, pad=True, end_keys=("flag",))
    plane = ExperienceDataPlane(SPEC, 16, sampler, mesh=default_mesh(2))
    plane.ingest(items(0, 12))  # steps 0, 1, 2
    check_rows(plane, [0, 4, 8, -1, 2, 6, 10, -1, 1, 5, 9, -1, 3, 7, 11, -1])
    plane.ingest(items(12, 8))  # step 3 fills each block, step 4 overwrites step 0
    check_rows(plane, [16, 4, 8, 12, 18, 6, 10, 14, 17, 5, 9, 13, 19, 7, 11, 15])
    assert host(plane.state.storage.cursor).tolist() == [2, 2] and host(plane.state.storage.laps).tolist() == [1, 1]
    for _ in range(4):  # every window is two consecutive steps of one env: g then g + 4
        g = host(plane.sample().data["g"])
        np.testing.assert_array_equal(g[:, 1], g[:, 0] + 4)


def reference(total, shards, capacity):
    """Round robin: the g-th item goes to shard g % S, slot (g // S) % (capacity / S); the latest item wins."""
    shard_capacity = capacity // shards
    table = np.full(capacity, -1)
    generation = np.zeros(capacity, np.int64)
    for g in range(total):
        shard, lap_slot = g % shards, g // shards
        row = shard * shard_capacity + lap_slot % shard_capacity
        table[row], generation[row] = g, lap_slot // shard_capacity + 1
    counts = np.array([len(range(s, total, shards)) for s in range(shards)])
    return table, generation, counts % shard_capacity, counts // shard_capacity


@pytest.mark.parametrize("sizes", [
    [1, 2, 3, 4, 5, 6],  # 21 items into 16: sizes crossing buckets, one wrap
    [7, 37, 1],  # larger than the capacity: only the newest survive, dealt as if ingested one by one
    [3, 50, 9, 17],
], ids=lambda s: "-".join(map(str, s)))
def test_round_robin_matches_reference(any_mesh, sizes):
    capacity = 16
    plane = ExperienceDataPlane(SPEC, capacity, samplers.uniform(64), mesh=any_mesh)
    shards = plane.num_shards
    total = 0
    for n in sizes:
        plane.ingest(items(total, n))
        total += n
        table, generation, cursor, laps = reference(total, shards, capacity)
        check_rows(plane, table)
        assert host(plane.state.storage.cursor).tolist() == cursor.tolist()
        assert host(plane.state.storage.laps).tolist() == laps.tolist()
        assert int(host(plane.state.storage.next_shard)) == total % shards
        generations = storage.slot_generation(host(plane.state.storage.cursor)[:, None],
                                              host(plane.state.storage.laps)[:, None],
                                              np.arange(capacity // shards)[None, :])
        written = table >= 0
        np.testing.assert_array_equal(np.asarray(generations).reshape(-1)[written], generation[written])
    # every stored item sits in exactly one shard: the newest min(total, capacity) items, each once
    g = stored(plane)["g"]
    assert sorted(g[table >= 0].tolist()) == list(range(max(0, total - capacity), total))
    check_ids(plane, table, generation)


def test_every_item_lands_in_exactly_one_shard(mesh):
    """Odd-sized batches that exactly fill the buffer: each shard holds exactly its items g with g % S == shard."""
    capacity = 64
    plane = ExperienceDataPlane(SPEC, capacity, samplers.uniform(64), mesh=mesh)
    total = 0
    for n in (1, 5, 11, 3, 13, 31):
        plane.ingest(items(total, n))
        total += n
    assert total == capacity
    g = stored(plane)["g"].reshape(plane.num_shards, -1)
    assert sorted(g.reshape(-1).tolist()) == list(range(capacity))
    for shard, mine in enumerate(g):
        assert (mine % plane.num_shards == shard).all()
        np.testing.assert_array_equal(mine, np.arange(shard, capacity, plane.num_shards))
