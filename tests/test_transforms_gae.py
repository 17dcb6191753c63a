"""transforms.gae: generalized advantage estimation over one time-ordered column, against a step-by-step loop."""

import jax
import numpy as np
import pytest

from conduit_jax import transforms
from conduit_jax.errors import ConfigError


def reference(values, rewards, terminateds, truncateds, gamma, lambda_):
    """The recursion, one step at a time from the end: nothing crosses an episode end; a truncated step keeps its
    bootstrap from the next row's value."""
    n = len(values)
    advantages, running = np.zeros(n), 0.0
    for t in reversed(range(n)):
        following = values[t + 1] if t + 1 < n else 0.0
        delta = rewards[t] + gamma * (1 - terminateds[t]) * following - values[t]
        running = delta + gamma * lambda_ * (1 - terminateds[t]) * (1 - truncateds[t]) * (running if t + 1 < n else 0)
        advantages[t] = running
    return advantages, advantages + values


@pytest.mark.parametrize("standardize", [False, True])
def test_gae_matches_the_recursion_on_the_valid_rows_and_zeroes_the_padding(standardize):
    rng = np.random.default_rng(4)
    n, size = 300, 512
    values, rewards = rng.normal(size=n), rng.normal(size=n)
    terminateds = rng.random(n) < 0.05
    truncateds = (rng.random(n) < 0.05) & ~terminateds
    expected, targets = reference(values, rewards, terminateds, truncateds, 0.97, 0.9)
    if standardize:
        expected = (expected - expected.mean()) / max(1e-4, expected.std())

    def pad(x):
        out = np.zeros(size, x.dtype)
        out[:n] = x
        return out

    gae = jax.jit(transforms.gae, static_argnames=("gamma", "lambda_", "standardize"))
    advantages, got = gae(*(pad(x.astype(np.float32) if x.dtype == float else x) for x in
                            (values, rewards, terminateds, truncateds)), np.int32(n), gamma=0.97, lambda_=0.9,
                          standardize=standardize)
    np.testing.assert_allclose(np.asarray(advantages)[:n], expected, rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(np.asarray(got)[:n], targets, rtol=1e-4, atol=1e-4)
    assert not np.any(np.asarray(advantages)[n:])


def test_gae_names_a_bad_discount():
    with pytest.raises(ConfigError, match=r"transforms.gae\(\): lambda_ must be a finite number in \[0, 1\], got 1.5"):
        transforms.gae(np.zeros(4), np.zeros(4), np.zeros(4, bool), np.zeros(4, bool), gamma=0.9, lambda_=1.5)


def test_a_compiled_transform_counts_its_compilations():
    """engine.compiled: the first call of a shape compiles once (counted under its name), the next compiles nothing."""
    from collections import Counter

    from conduit_jax import engine

    counter = Counter()
    gae = engine.compiled(transforms.gae, "gae", counter, static_argnames=("gamma", "lambda_", "standardize"))
    columns = (np.ones(8, np.float32), np.ones(8, np.float32), np.zeros(8, bool), np.zeros(8, bool))
    gae(*columns, gamma=0.5, lambda_=0.5)
    assert counter["gae"] >= 1
    first = counter["gae"]
    gae(*columns, gamma=0.5, lambda_=0.5)
    assert counter["gae"] == first
