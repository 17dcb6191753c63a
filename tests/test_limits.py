"""Rate limiter invariants under random interleavings of ingest and sample (hypothesis).

A reference model keeps Reverb's error ``inserts * samples_per_insert - samples`` in exact fractions. Whatever the
interleaving: every call the limiter admits keeps the error inside the band its law allows, every refused call raises
``RateLimitedError`` and changes nothing, nothing ingested is dropped, and the plane never reaches a state where
neither an ingest nor a sample may run (no deadlock).
"""

from fractions import Fraction

import jax
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import conduit_jax as cj
from conduit_jax import limits, samplers

SPEC = cj.ExperienceSpec.from_example({"x": np.int32(0)})


def leaves(plane):
    return [np.asarray(x).tobytes() for x in jax.tree_util.tree_leaves(jax.device_get(plane.state))]


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(spi=st.sampled_from([0.25, 0.5, 1.0, 2.0, 3.0]), min_size=st.integers(1, 12), slack=st.integers(0, 6),
       batch=st.sampled_from([1, 2, 4]),
       ops=st.lists(st.one_of(st.integers(1, 5), st.just("sample")), min_size=5, max_size=40))
def test_sample_to_insert_ratio_holds_under_any_interleaving(spi, min_size, slack, batch, ops):
    buffer = (spi + batch) / 2 + slack  # the smallest buffer the limiter accepts, plus some
    limiter = limits.sample_to_insert_ratio(spi, min_size=min_size, error_buffer=buffer)
    plane = cj.ExperienceDataPlane(SPEC, 256, samplers.uniform(batch), limiter=limiter, mesh=cj.default_mesh(1))
    ratio, band = Fraction(spi), Fraction(buffer)
    low, high = ratio * min_size - band, ratio * min_size + band
    inserted = sampled = 0
    for op in ops:
        error = inserted * ratio - sampled
        size = min(inserted, plane.capacity)
        assert plane.can_ingest() or plane.can_sample(), f"deadlock at error {error}, size {size}"
        before = leaves(plane)
        if op == "sample":
            allowed = size >= min_size and error - batch >= low
            if allowed:
                plane.sample()
                sampled += batch
            else:
                with pytest.raises((cj.RateLimitedError, cj.NotEnoughDataError)):
                    plane.sample()
                assert leaves(plane) == before
        else:
            allowed = size < min_size or error + ratio <= high
            if allowed:
                plane.ingest({"x": np.arange(op, dtype=np.int32)})
                inserted += op
            else:
                with pytest.raises(cj.RateLimitedError):
                    plane.ingest({"x": np.arange(op, dtype=np.int32)})
                assert leaves(plane) == before
        assert plane.can_sample() == (min(inserted, plane.capacity) >= min_size and
                                      inserted * ratio - sampled - batch >= low)
    stats = plane.stats()
    assert stats["items_inserted"] == inserted  # nothing dropped to satisfy the limiter
    assert stats["stages"].get("sample", {"calls": 0})["calls"] == sampled // batch


# -- constructor checks -----------------------------------------------------------------------------------------------
MESH1 = cj.default_mesh(1)


@pytest.mark.parametrize("args, argument", [
    ((float("inf"), 1, 10), "samples_per_insert"), ((float("nan"), 1, 10), "samples_per_insert"),
    ((-1.0, 1, 10), "samples_per_insert"), ((0, 1, 10), "samples_per_insert"), (("2", 1, 10), "samples_per_insert"),
    ((2.0, 1, float("inf")), "error_buffer"), ((2.0, 1, float("nan")), "error_buffer"), ((2.0, 1, -1), "error_buffer"),
    ((2.0, 1, None), "error_buffer"), ((2.0, 0, 10), "min_size"), ((2.0, 1.5, 10), "min_size"),
], ids=str)
def test_sample_to_insert_ratio_arguments_must_be_finite_numbers(args, argument):
    with pytest.raises(cj.ConfigError, match=rf"sample_to_insert_ratio\(\): {argument} must be"):
        limits.sample_to_insert_ratio(*args)


@pytest.mark.parametrize("spi", [1e-4, 4e-4, 0.0009])
def test_sample_to_insert_ratio_refuses_a_ratio_its_fractions_cannot_hold(spi):
    """limit_denominator(1000) would round these to 0 or 1/1000: inserts would earn (nearly) no sample credit."""
    with pytest.raises(cj.ConfigError, match=r"samples_per_insert must be at least 0\.001"):
        limits.sample_to_insert_ratio(spi, min_size=1, error_buffer=8)


def test_the_smallest_supported_ratio_earns_its_credit():
    limiter = limits.sample_to_insert_ratio(0.001, min_size=1, error_buffer=8)
    state = limiter.on_insert(limiter.init(), 1000)  # 1000 inserts earn one sampled item
    assert int(state.balance) == 1000 * 1  # p = 1 in units of 1/1000 sample
    assert int(limiter.on_sample(state, 1).balance) == 0


@pytest.mark.parametrize("args, argument", [
    ((1e10, 1, 1e10), "samples_per_insert or min_size"),  # one insert alone is 1e10 samples
    ((1.0, 1, 3e9), "error_buffer"),
    ((0.999, 4000, 4986 / 997), "samples_per_insert or min_size"),  # units of 1/997000: high = 3,979,026,000
])
def test_a_balance_beyond_int32_is_refused_at_construction(args, argument):
    with pytest.raises(cj.ConfigError, match=rf"int32 range .*lower {argument}"):
        limits.sample_to_insert_ratio(*args)


def test_a_balance_beyond_int32_for_the_capacity_is_refused():
    """One ingest adds up to a capacity of items: 1000 samples each, 2**22 items is 4.2e9 > int32."""
    limiter = limits.sample_to_insert_ratio(1000, 1, 600)
    limiter.check(8)
    limiter.check(8, 2**20)
    with pytest.raises(cj.ConfigError,
                       match=r"capacity 4194304 .*int32 range.*lower samples_per_insert or the capacity"):
        limiter.check(8, 2**22)


@pytest.mark.parametrize("make, argument", [
    (lambda: limits.min_size(100), r"size \(100\) exceeds the capacity \(64\)"),
    (lambda: limits.sample_to_insert_ratio(1.0, min_size=100, error_buffer=20),
     r"min_size \(100\) exceeds the capacity \(64\)"),
], ids=["min_size", "sample_to_insert_ratio"])
def test_min_size_above_the_capacity_is_refused(make, argument):
    with pytest.raises(cj.ConfigError, match=argument):
        cj.ExperienceDataPlane(SPEC, 64, samplers.uniform(8), limiter=make(), mesh=MESH1)
    with pytest.raises(cj.ConfigError, match=argument):
        make().check(8, 64)


def test_min_size_equal_to_the_capacity_samples():
    plane = cj.ExperienceDataPlane(SPEC, 16, samplers.uniform(8), limiter=limits.min_size(16), mesh=MESH1)
    plane.ingest({"x": np.arange(15, dtype=np.int32)})
    assert not plane.can_sample()
    plane.ingest({"x": np.arange(1, dtype=np.int32)})
    assert plane.can_sample()


@pytest.mark.parametrize("name, params, words", [
    ("min_size(1)", {"x": 1}, r"unknown parameters \['x'\]"),
    ("sample_to_insert_ratio(1.0)", {"min_size": 1}, r"missing parameters \['samples_per_insert', 'error_buffer'\]"),
    ("min_size(1)", None, "params must be a mapping"),
    ("min_size(1)", 3, "params must be a mapping"),
    ("bogus(1)", {}, "unknown limiter 'bogus"),
    (None, {}, "name must be"),
], ids=str)
def test_from_params_refuses_what_no_limiter_takes(name, params, words):
    with pytest.raises(cj.ConfigError, match=rf"limits\.from_params\(\): .*{words}"):
        limits.from_params(name, params)


@pytest.mark.parametrize("limiter", [limits.min_size(3), limits.sample_to_insert_ratio(2.0, 4, 9.5)],
                         ids=lambda l: l.name)
def test_from_params_rebuilds_a_limiter(limiter):
    assert limits.from_params(limiter.name, dict(limiter.params)).name == limiter.name
    assert limits.from_params(limiter.name, limiter.params).params == limiter.params  # pairs as well
