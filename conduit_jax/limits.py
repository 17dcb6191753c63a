"""Rate limiters: when ingest and sample may proceed, as pure functions over integer counters in the state.

A limiter never drops data: it only answers "may this call run now?". The shell turns a "no" into waiting (with a
timeout) or a ``RateLimitedError``; the data stays with the caller.

``sample_to_insert_ratio`` follows Reverb's law: with ``error = inserts * samples_per_insert - samples`` (samples
counted in items), inserting is allowed while ``error + samples_per_insert <= spi * min_size + error_buffer`` and
sampling a batch of B while ``error - B >= spi * min_size - error_buffer`` (and the plane holds ``min_size`` items).
The ratio and the buffer are kept as exact fractions, so the balance is an integer (in units of 1/D sample) that
never drifts. Below ``min_size``
inserts are never limited. A batch ingest is admitted whole when the limiter has room for its first item.

Eligibility of single items (``max_times_sampled``) lives with the samplers that track it (``samplers.prioritized``
and ``samplers.sequences``), since it decides which items a draw may return.

``Staleness`` bounds how old on-policy data may be: every item carries the policy version it was produced with (an
int32 leaf of the spec); the plane holds the learner's current version (``plane.set_policy_version``). An item older
than ``max_versions`` versions is never delivered: its row of a batch is masked out (``Delivery.mask`` False) and
counted, and samplers with a priority index stop drawing it as soon as the version moves on.
"""

from __future__ import annotations

import math
from fractions import Fraction
from typing import Callable, NamedTuple

import jax.numpy as jnp

from conduit_jax._pytree import state_dataclass
from conduit_jax.errors import ConfigError


@state_dataclass
class LimiterState:
    balance: object  # int32[]: (inserts * samples_per_insert - samples) * D, exact


class Staleness(NamedTuple):
    """Deliver only items whose ``key`` leaf (policy version) is >= current version - ``max_versions``."""

    max_versions: int
    key: str = "policy_version"


class Limiter(NamedTuple):
    """``can_insert(state, size)`` / ``can_sample(state, size, batch)`` are plain arithmetic: they run on device
    scalars inside jit and on host integers alike. ``check(batch_size)`` raises if the limiter could deadlock."""

    name: str
    min_size: int
    init: Callable[[], LimiterState]
    can_insert: Callable[[LimiterState, int], bool]
    can_sample: Callable[[LimiterState, int, int], bool]
    on_insert: Callable[[LimiterState, int], LimiterState]
    on_sample: Callable[[LimiterState, int], LimiterState]
    check: Callable[[int], None]
    limits_inserts: bool = False  # False: can_insert is always true (the shell skips reading state)
    limits_samples: bool = False  # False: can_sample depends on the stored count alone
    params: tuple = ()  # ((argument, value), ...) of the constructor call: rebuilds the limiter from a checkpoint


def _int(value, name: str, where: str, low: int) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < low:
        raise ConfigError(f"{where}: {name} must be an int >= {low}, got {value!r}")
    return value


def min_size(size: int = 1) -> Limiter:
    """Sampling waits until the plane holds ``size`` items; inserts are never limited."""
    size = _int(size, "size", "limits.min_size()", 1)
    return Limiter(
        name=f"min_size({size})", min_size=size,
        init=lambda: LimiterState(balance=jnp.zeros((), jnp.int32)),
        can_insert=lambda state, stored: True,
        can_sample=lambda state, stored, batch: stored >= size,
        on_insert=lambda state, n: state,
        on_sample=lambda state, batch: state,
        check=lambda batch: None,
        params=(("size", size),),
    )


def sample_to_insert_ratio(samples_per_insert: float, min_size: int, error_buffer: float) -> Limiter:
    """Keep sampled items per inserted item near ``samples_per_insert`` (Reverb's SampleToInsertRatio)."""
    where = "limits.sample_to_insert_ratio()"
    if not isinstance(samples_per_insert, (int, float)) or isinstance(samples_per_insert, bool) or \
            not samples_per_insert > 0:
        raise ConfigError(f"{where}: samples_per_insert must be > 0, got {samples_per_insert!r}")
    min_items = _int(min_size, "min_size", where, 1)
    if not isinstance(error_buffer, (int, float)) or isinstance(error_buffer, bool) or not error_buffer >= 0:
        raise ConfigError(f"{where}: error_buffer must be >= 0, got {error_buffer!r}")
    # everything in units of 1/D sample, D the common denominator of the ratio and the buffer: exact integers
    ratio = Fraction(samples_per_insert).limit_denominator(1000)
    buffer = Fraction(error_buffer).limit_denominator(1000)
    scale = math.lcm(ratio.denominator, buffer.denominator)
    p, q = int(ratio * scale), scale  # one insert adds p, one sampled item takes q
    low = int((ratio * min_items - buffer) * scale)
    high = int((ratio * min_items + buffer) * scale)

    def check(batch: int) -> None:
        # a deadlock needs a balance where neither one insert (+p) nor one batch (-q*batch) fits
        if high - low < p + q * batch:
            raise ConfigError(
                f"{where}: error_buffer {error_buffer} can deadlock with samples_per_insert {samples_per_insert} and "
                f"batch_size {batch}: it must be at least (samples_per_insert + batch_size) / 2 = "
                f"{(float(ratio) + batch) / 2}")

    return Limiter(
        name=f"sample_to_insert_ratio({samples_per_insert}, min_size={min_items}, error_buffer={error_buffer})",
        min_size=min_items,
        init=lambda: LimiterState(balance=jnp.zeros((), jnp.int32)),
        can_insert=lambda state, stored: (stored < min_items) | (state.balance + p <= high),
        can_sample=lambda state, stored, batch: (stored >= min_items) & (state.balance - q * batch >= low),
        on_insert=lambda state, n: LimiterState(balance=state.balance + p * n),
        on_sample=lambda state, batch: LimiterState(balance=state.balance - q * batch),
        check=check,
        limits_inserts=True,
        limits_samples=True,
        params=(("error_buffer", error_buffer), ("min_size", min_items), ("samples_per_insert", samples_per_insert)),
    )


def from_params(name: str, params) -> Limiter:
    """Rebuild a limiter from ``(limiter.name, dict(limiter.params))``, as a checkpoint records it."""
    kind = name.split("(")[0]
    constructors = {"min_size": min_size, "sample_to_insert_ratio": sample_to_insert_ratio}
    if kind not in constructors:
        raise ConfigError(f"limits.from_params(): unknown limiter {name!r}; known: {sorted(constructors)}")
    return constructors[kind](**dict(params))
