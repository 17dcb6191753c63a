"""W8's contenders deliver the same batch (a check of the peers against each other and against the data, not a
timing): on a very small configuration every contender ingests one generation of ragged groups and delivers one
batch, and each sequence's tokens, logprobs, positions, loss mask and group advantage are the same in every batch."""

import importlib.util

import numpy as np

from benchmarks import bench_w8

GROUP_SIZE, GROUPS, MAX_LENGTH, ROW_LENGTH = 4, 4, 64, 128
OPTIONAL = {"flashbax": "flashbax", "torchrl": "torchrl", "cpprb": "cpprb"}  # peer -> module it needs


def test_every_contender_delivers_the_generations_sequences_and_advantages():
    rng = np.random.default_rng(0)
    gen = bench_w8.generation(rng, GROUPS, GROUP_SIZE, MAX_LENGTH)
    gen["rewards"][0] = 0.5  # one group whose rewards are all equal: advantages exactly 0
    config = bench_w8.Config(token_capacity=2 * GROUPS * GROUP_SIZE * MAX_LENGTH, group_capacity=2 * GROUPS,
                             rows=bench_w8.rows_for([gen], ROW_LENGTH, MAX_LENGTH), row_length=ROW_LENGTH,
                             group_size=GROUP_SIZE, groups=GROUPS, max_length=MAX_LENGTH)
    built, unavailable = bench_w8.build(config, [gen])
    try:
        expected_built = {label for label, _ in bench_w8.contenders(config)
                          if label not in OPTIONAL or importlib.util.find_spec(OPTIONAL[label]) is not None}
        assert expected_built <= set(built), unavailable
        want = bench_w8.expected(gen)
        assert np.all(want["advantage"][:GROUP_SIZE] == 0) and np.any(want["advantage"] != 0)
        reference = None
        for label, contender in built.items():
            batch = contender.step()
            assert set(batch) == set(bench_w8.FIELDS), label
            shape = np.shape(batch["tokens"])
            packed = label in ("conduit[packed]", "numpy-packed+device_put")
            assert shape == ((config.rows, ROW_LENGTH) if packed else (GROUPS * GROUP_SIZE, MAX_LENGTH)), label
            got = bench_w8.by_sequence(batch)
            assert bench_w8.mismatch(got, want) is None, (label, bench_w8.mismatch(got, want))
            if reference is None:
                reference = got
            else:  # the peers against each other: the same tokens per sequence and the same advantages
                assert np.array_equal(got["counts"], reference["counts"]), label
                assert np.array_equal(got["tokens"], reference["tokens"]), label
                np.testing.assert_allclose(got["advantage"], reference["advantage"], rtol=1e-5, atol=1e-6,
                                           err_msg=label)
            useful, computed = bench_w8.packing(batch)[:2]
            assert useful == int(gen["lengths"].sum()) and computed == shape[0] * shape[1], label
    finally:
        for contender in built.values():
            contender.release()
