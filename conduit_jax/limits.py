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
from conduit_jax.errors import ConfigError, constructor_kwargs


@state_dataclass
class LimiterState:
    balance: object  # int32[]: (inserts * samples_per_insert - samples) * D, exact


class Staleness(NamedTuple):
    """Deliver only items whose ``key`` leaf (policy version) is >= current version - ``max_versions``."""

    max_versions: int
    key: str = "policy_version"


class Limiter(NamedTuple):
    """``can_insert(state, size)`` / ``can_sample(state, size, batch)`` are plain arithmetic: they run on device
    scalars inside jit and on host integers alike. ``check(batch_size, capacity=None)`` raises a ``ConfigError`` if
    the limiter could deadlock with that batch size, or (given the capacity) could never admit a sample because its
    ``min_size`` exceeds the capacity, or could carry its int32 balance past the int32 range."""

    name: str
    min_size: int
    init: Callable[[], LimiterState]
    can_insert: Callable[[LimiterState, int], bool]
    can_sample: Callable[[LimiterState, int, int], bool]
    on_insert: Callable[[LimiterState, int], LimiterState]
    on_sample: Callable[[LimiterState, int], LimiterState]
    check: Callable[..., None]  # check(batch_size, capacity=None)
    limits_inserts: bool = False  # False: can_insert is always true (the shell skips reading state)
    limits_samples: bool = False  # False: can_sample depends on the stored count alone
    moves_balance: bool = True  # False: on_insert and on_sample return the state they are given (no host copy kept)
    params: tuple = ()  # ((argument, value), ...) of the constructor call: rebuilds the limiter from a checkpoint


INT32_MAX = 2**31 - 1  # the balance is an int32 device scalar
MAX_DENOMINATOR = 1000  # samples_per_insert and error_buffer are kept as fractions with denominators up to this
MIN_SAMPLES_PER_INSERT = Fraction(1, MAX_DENOMINATOR)  # the smallest ratio such a fraction holds (to 0.05%)


def _int(value, name: str, where: str, low: int) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < low:
        raise ConfigError(f"{where}: {name} must be an int >= {low}, got {value!r}")
    return value


def _number(value, name: str, where: str, bound: str) -> float:
    """``value`` when it is a finite real number (not a bool) satisfying ``bound`` ("> 0" or ">= 0"), else a
    ConfigError naming ``where``'s argument ``name``."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or \
            not (value > 0 if bound == "> 0" else value >= 0):
        raise ConfigError(f"{where}: {name} must be a finite number {bound}, got {type(value).__name__} {value!r}")
    return value


def _capacity(capacity):
    """The capacity when it is a usable one; ``None`` (nothing to check against) otherwise: ``configure`` reports a
    bad capacity itself."""
    if isinstance(capacity, int) and not isinstance(capacity, bool) and capacity >= 1:
        return capacity
    return None


def _check_min_size(size: int, name: str, where: str, capacity) -> None:
    capacity = _capacity(capacity)
    if capacity is not None and size > capacity:
        raise ConfigError(f"{where}: {name} ({size}) exceeds the capacity ({capacity}): the plane can never hold "
                          f"{size} items, so no sample would ever be admitted; use {name} <= {capacity}")


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
        check=lambda batch, capacity=None: _check_min_size(size, "size", "limits.min_size()", capacity),
        moves_balance=False,
        params=(("size", size),),
    )


def sample_to_insert_ratio(samples_per_insert: float, min_size: int, error_buffer: float) -> Limiter:
    """Keep sampled items per inserted item near ``samples_per_insert`` (Reverb's SampleToInsertRatio).

    ``samples_per_insert`` and ``error_buffer`` are finite numbers, kept as fractions with denominators up to
    ``MAX_DENOMINATOR`` (1000): ``samples_per_insert`` must be at least 1/1000. The balance is an int32 in units of
    1/D sample (D their common denominator); a limiter whose balance could leave the int32 range is refused (here
    for its thresholds, by ``check`` for what the plane's capacity lets one ingest add)."""
    where = "limits.sample_to_insert_ratio()"
    _number(samples_per_insert, "samples_per_insert", where, "> 0")
    min_items = _int(min_size, "min_size", where, 1)
    _number(error_buffer, "error_buffer", where, ">= 0")
    # everything in units of 1/D sample, D the common denominator of the ratio and the buffer: exact integers
    ratio = Fraction(samples_per_insert).limit_denominator(MAX_DENOMINATOR)
    if samples_per_insert < MIN_SAMPLES_PER_INSERT:
        raise ConfigError(
            f"{where}: samples_per_insert must be at least {float(MIN_SAMPLES_PER_INSERT)} (the ratio is kept as a "
            f"fraction with a denominator up to {MAX_DENOMINATOR}; {samples_per_insert!r} would become {ratio}), "
            f"got {samples_per_insert!r}")
    buffer = Fraction(error_buffer).limit_denominator(MAX_DENOMINATOR)
    scale = math.lcm(ratio.denominator, buffer.denominator)
    p, q = int(ratio * scale), scale  # one insert adds p, one sampled item takes q
    low = int((ratio * min_items - buffer) * scale)
    high = int((ratio * min_items + buffer) * scale)

    def check_range(items: int, batch: int, capacity) -> None:
        """The balance stays in int32. It never goes below min(0, low) (a batch is admitted only if it leaves at
        least ``low``), and ``can_sample`` computes balance - q * batch. An ingest of up to ``items`` items (one
        kernel call writes at most ``capacity``) is admitted at a balance <= high - p, or below min_size items at a
        balance of p * (min_size - 1) (no sample before), and ``can_insert`` then computes balance + p."""
        top = high + p * items  # >= p * (min_size + items): high = p * min_size + error_buffer * D
        bottom = min(0, low) - q * batch
        if top <= INT32_MAX and bottom >= -INT32_MAX - 1:
            return
        parts = {"samples_per_insert or min_size": ratio * min_items, "error_buffer": buffer}
        if capacity is not None:
            parts["samples_per_insert or the capacity"] = ratio * items
        advice = f"lower {max(parts, key=parts.get)} (the largest part)"
        unit = f"1/{scale} sample" if scale > 1 else "samples"
        if scale > 1:
            unit += (f", the common denominator of samples_per_insert {samples_per_insert} = {ratio} and error_buffer "
                     f"{error_buffer} = {buffer}")
            advice += ", or choose samples_per_insert and error_buffer whose fractions have small denominators"
        with_capacity = f" on a plane of capacity {capacity} (the most one ingest adds)" if capacity is not None else ""
        raise ConfigError(
            f"{where}: the limiter's balance (an int32, in units of {unit}) could reach {max(top, -bottom):,}"
            f"{with_capacity}, beyond the int32 range ({INT32_MAX:,}); {advice}")

    check_range(1, 1, None)  # the thresholds themselves must be int32

    def check(batch: int, capacity=None) -> None:
        # a deadlock needs a balance where neither one insert (+p) nor one batch (-q*batch) fits
        if high - low < p + q * batch:
            raise ConfigError(
                f"{where}: error_buffer {error_buffer} can deadlock with samples_per_insert {samples_per_insert} and "
                f"batch_size {batch}: it must be at least (samples_per_insert + batch_size) / 2 = "
                f"{(float(ratio) + batch) / 2}")
        _check_min_size(min_items, "min_size", where, capacity)
        capacity = _capacity(capacity)
        check_range(1 if capacity is None else capacity, batch, capacity)

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
    where = "limits.from_params()"
    if not isinstance(name, str):
        raise ConfigError(f"{where}: name must be a limiter's name (a str), got {type(name).__name__} {name!r}")
    kind = name.split("(")[0]
    constructors = {"min_size": min_size, "sample_to_insert_ratio": sample_to_insert_ratio}
    if kind not in constructors:
        raise ConfigError(f"{where}: unknown limiter {name!r}; known: {sorted(constructors)}")
    return constructors[kind](**constructor_kwargs(where, f"the {kind} limiter", constructors[kind], params))
