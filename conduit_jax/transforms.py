"""Pure transforms of delivered batches, run inside the consumer's jit.

``n_step`` turns padded windows (``samplers.sequences(..., pad=True, length=n)``) into n-step transitions with
correct bootstrapping: accumulation stops at the first episode end; after a termination there is no bootstrap
(discount 0), after a truncation the learner bootstraps from that step's ``next_obs``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def n_step(data, mask, gamma: float, *, reward: str = "reward", terminated: str = "terminated",
           truncated: str = "truncated", next_obs: str = "next_obs"):
    """n-step transitions from windows ``data`` (leaves [B, n, ...]) and ``mask`` bool[B, n] (the window's first
    episode, as ``Delivery.mask``).

    Returns a dict of [B, ...] leaves: every leaf of the window's first step, with ``reward`` replaced by
    ``G = sum_k gamma^k r_k`` over the masked steps, ``next_obs``, ``terminated`` and ``truncated`` (when present)
    taken from the last masked step, ``n_steps`` = m, the number of masked steps, and
    ``discount = gamma^m * (1 - terminated_last)``: the factor a TD target puts on ``Q(next_obs)``.
    """
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
