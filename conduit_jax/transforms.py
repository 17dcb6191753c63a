"""Pure transforms of delivered batches, run inside the consumer's jit.

``n_step`` turns padded windows (``samplers.sequences(..., pad=True, length=n)``) into n-step transitions with
correct bootstrapping: accumulation stops at the first episode end; after a termination there is no bootstrap
(discount 0), after a truncation the learner bootstraps from that step's ``next_obs``.

``gae`` computes generalized advantage estimates and value targets over a rollout laid out as one time-ordered
column (episodes one after another, as RLlib's PPO batches them), with an associative scan (depth log n).
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import jax
import jax.numpy as jnp
import numpy as np

from conduit_jax.errors import ConfigError, SpecError

_WHERE = "transforms.n_step()"


def _checked_gamma(gamma, where: str = _WHERE, name: str = "gamma"):
    """``gamma`` when it is a finite number in [0, 1] (a Python or NumPy real, or a real JAX scalar: a traced one
    is checked for its shape and dtype only), else a ConfigError naming it."""
    if isinstance(gamma, jax.Array) or (isinstance(gamma, np.ndarray) and gamma.shape == ()):
        if gamma.shape != () or not (jnp.issubdtype(gamma.dtype, jnp.floating) or
                                     jnp.issubdtype(gamma.dtype, jnp.integer)):
            raise ConfigError(f"{where}: {name} must be a real scalar in [0, 1], got {gamma.dtype}{list(gamma.shape)}")
        if isinstance(gamma, jax.core.Tracer):
            return gamma
        value = float(gamma)
    elif isinstance(gamma, (int, float, np.integer, np.floating)) and not isinstance(gamma, (bool, np.bool_)):
        value = float(gamma)
    else:
        raise ConfigError(f"{where}: {name} must be a finite number in [0, 1], got {type(gamma).__name__} {gamma!r}")
    if not math.isfinite(value) or not 0.0 <= value <= 1.0:
        raise ConfigError(f"{where}: {name} must be a finite number in [0, 1], got {gamma!r}")
    return gamma


def _checked_window(data, mask, keys: dict):
    """The (batch, steps) of ``mask``, after checking that ``mask`` is bool[B, n], that ``data`` is a dict of
    [B, n, ...] leaves holding the ``keys`` leaves (the truncated one is optional) and that the reward and
    episode-end leaves are [B, n]; else a SpecError (ConfigError for a key argument that is not a str) naming what
    differs."""
    for argument, key in keys.items():
        if not isinstance(key, str):
            raise ConfigError(f"{_WHERE}: {argument} must be the name of a leaf of data (a str), got "
                              f"{type(key).__name__} {key!r}")
    if not isinstance(mask, (jax.Array, np.ndarray)):
        raise SpecError(f"{_WHERE}: mask must be a bool[B, n] array (Delivery.mask of a padded sequences sampler), "
                        f"got {type(mask).__name__}")
    if mask.dtype != np.bool_ or mask.ndim != 2 or mask.shape[1] < 1:
        raise SpecError(f"{_WHERE}: mask must be a bool[B, n] array with n >= 1 (Delivery.mask of a padded "
                        f"sequences sampler), got {mask.dtype}{list(mask.shape)}")
    if not isinstance(data, Mapping):
        raise SpecError(f"{_WHERE}: data must be a dict of [B, n, ...] leaves (Delivery.data of a sequences "
                        f"sampler), got {type(data).__name__}")
    batch, steps = mask.shape
    for argument, key in keys.items():
        if argument != "truncated" and key not in data:  # truncated is optional
            raise SpecError(f"{_WHERE}: data has no leaf {key!r} (the {argument} leaf); its leaves are "
                            f"{sorted(map(str, data))}")
    paths, _ = jax.tree_util.tree_flatten_with_path(data)
    for path, leaf in paths:
        name = jax.tree_util.keystr(path)
        shape = getattr(leaf, "shape", None)
        if shape is None or not hasattr(leaf, "dtype"):
            raise SpecError(f"{_WHERE}: data leaf {name} must be an array of shape [B, n, ...] = [{batch}, {steps}, "
                            f"...] like mask, got {type(leaf).__name__}")
        if tuple(shape[:2]) != (batch, steps):
            raise SpecError(f"{_WHERE}: data leaf {name} must have shape [B, n, ...] = [{batch}, {steps}, ...] like "
                            f"mask {list(mask.shape)}, got {list(shape)}")
    for argument in ("reward", "terminated", "truncated"):
        key = keys.get(argument)
        if key is None or key not in data:
            continue
        leaf = data[key]
        if tuple(leaf.shape) != (batch, steps):
            raise SpecError(f"{_WHERE}: the {argument} leaf {key!r} must be [B, n] = [{batch}, {steps}] (one per "
                            f"step), got {list(leaf.shape)}")
        if argument == "reward" and not (jnp.issubdtype(leaf.dtype, jnp.floating) or
                                         jnp.issubdtype(leaf.dtype, jnp.integer)):
            raise SpecError(f"{_WHERE}: the reward leaf {key!r} must be real numbers, got {leaf.dtype}")
    return batch, steps


def n_step(data, mask, gamma: float, *, reward: str = "reward", terminated: str = "terminated",
           truncated: str = "truncated", next_obs: str = "next_obs"):
    """n-step transitions from windows ``data`` (leaves [B, n, ...]) and ``mask`` bool[B, n] (the window's first
    episode, as ``Delivery.mask``).

    Returns a dict of [B, ...] leaves: every leaf of the window's first step, with ``reward`` replaced by
    ``G = sum_k gamma^k r_k`` over the masked steps, ``next_obs``, ``terminated`` and ``truncated`` (when present)
    taken from the last masked step, ``n_steps`` = m, the number of masked steps, and
    ``discount = gamma^m * (1 - terminated_last)``: the factor a TD target puts on ``Q(next_obs)``.

    ``gamma`` must be a finite number in [0, 1] (``ConfigError``); ``data`` must be a dict holding the ``reward``,
    ``terminated`` and ``next_obs`` leaves, every leaf [B, n, ...] with the reward and episode-end leaves [B, n],
    and ``mask`` bool[B, n] (``SpecError`` naming what differs). These are checks of shapes, dtypes and static
    values: they run at trace time under ``jax.jit``.
    """
    gamma = _checked_gamma(gamma)
    _checked_window(data, mask, {"reward": reward, "terminated": terminated, "next_obs": next_obs,
                                 "truncated": truncated})
    steps = mask.shape[1]
    live = mask.astype(jnp.float32)
    powers = jnp.power(jnp.float32(gamma), jnp.arange(steps, dtype=jnp.float32))
    rewards = data[reward].astype(jnp.float32)
    ret = jnp.sum(rewards * live * powers, axis=1)
    count = jnp.sum(mask.astype(jnp.int32), axis=1)
    last = jnp.maximum(count - 1, 0)

    def at_last(x):
        index = last.reshape((-1,) + (1,) * (x.ndim - 1))
        return jnp.take_along_axis(x, index, axis=1)[:, 0]

    out = jax.tree_util.tree_map(lambda x: x[:, 0], data)
    out[reward] = ret
    out[next_obs] = at_last(data[next_obs])
    out[terminated] = at_last(data[terminated])
    if truncated in data:
        out[truncated] = at_last(data[truncated])
    out["n_steps"] = count
    ended = out[terminated].astype(jnp.float32)
    out["discount"] = jnp.power(jnp.float32(gamma), count.astype(jnp.float32)) * (1.0 - ended)
    return out


def gae(values, rewards, terminateds, truncateds, n=None, *, gamma: float, lambda_: float, standardize: bool = True):
    """Advantages and value targets of a rollout in one time-ordered column: ``values``, ``rewards``,
    ``terminateds``, ``truncateds`` [T] (row t: the step taken at time t, its value estimate and whether the episode
    ended there), the first ``n`` rows valid (None: all; the rest padding, returned as 0).

    ``delta_t = r_t + gamma * (1 - terminated_t) * V_{t+1} - V_t`` and ``A_t = delta_t + gamma * lambda * (1 -
    terminated_t) * (1 - truncated_t) * A_{t+1}``: nothing flows back across an episode's end, and a truncated step
    keeps its bootstrap from the next row's value, which is how RLlib's ``compute_value_targets`` treats the
    batches its connector lays out. Returns ``(advantages, targets)`` with ``targets = A + V``; ``standardize``
    rescales the advantages over the valid rows to mean 0 and standard deviation 1 (the deviation at least 1e-4),
    as RLlib's PPO does."""
    where = "transforms.gae()"
    _checked_gamma(gamma, where)
    _checked_gamma(lambda_, where, "lambda_")
    size = values.shape[0]
    n = size if n is None else n
    steps = jax.lax.iota(jnp.int32, size)
    valid = steps < n
    values = jnp.where(valid, values.astype(jnp.float32), 0.0)
    non_terminal = 1.0 - terminateds.astype(jnp.float32)
    propagate = non_terminal * (1.0 - truncateds.astype(jnp.float32))
    next_values = jnp.where(steps < n - 1, jnp.roll(values, -1), 0.0)
    delta = jnp.where(valid, rewards.astype(jnp.float32) + gamma * non_terminal * next_values - values, 0.0)
    factor = jnp.where(valid, gamma * lambda_ * propagate, 0.0)

    # A_t = delta_t + factor_t * A_{t+1}: compose the affine maps x -> d + c x from the end of the column
    def compose(first, then):
        (c1, d1), (c2, d2) = first, then
        return c1 * c2, d2 + c2 * d1

    _, advantages = jax.lax.associative_scan(compose, (factor[::-1], delta[::-1]))
    advantages = advantages[::-1]
    targets = advantages + values
    if standardize:
        count = jnp.maximum(n, 1).astype(jnp.float32)
        mean = jnp.sum(jnp.where(valid, advantages, 0.0)) / count
        std = jnp.sqrt(jnp.sum(jnp.where(valid, (advantages - mean) ** 2, 0.0)) / count)
        advantages = jnp.where(valid, (advantages - mean) / jnp.maximum(1e-4, std), 0.0)
    return advantages, targets
