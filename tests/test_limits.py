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
