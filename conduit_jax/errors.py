"""The error types of the data plane.

Every error is a ``ValueError`` subclass whose message names the argument or leaf, what was expected and what came.
A call that raises one leaves the plane's state exactly as it was.
"""

import inspect


class ConduitError(ValueError):
    """Base class of every error the data plane raises on bad input."""


class SpecError(ConduitError):
    """A batch (or an example item) does not match the ``ExperienceSpec``."""


class ConfigError(ConduitError):
    """A constructor argument cannot work (capacity, batch size, mesh, sampler parameters)."""


class NotEnoughDataError(ConduitError):
    """``sample()`` was called when the sampler has nothing (or not enough) to deliver."""


class CapacityError(ConduitError):
    """``ingest()`` would overwrite items that a queue has not delivered yet, or a limiter forbids it."""


class RateLimitedError(ConduitError):
    """The rate limiter refused an ingest or a sample, and the call's timeout ran out; nothing was changed."""


class PriorityError(ConduitError):
    """``update_priorities()`` got NaN, infinite or negative priorities, or ids of the wrong shape or range."""


class ConduitWarning(UserWarning):
    """Something works but probably not as the user meant (e.g. an epoch whose size is not a multiple of the batch)."""


def constructor_kwargs(where: str, what: str, constructor, params) -> dict:
    """``params`` (a mapping or ``(name, value)`` pairs) as keyword arguments of ``constructor``, or a ConfigError
    naming the parameters that are unknown or missing and the ones ``what`` takes (a recorded sampler's or limiter's
    parameters, rebuilt by its ``from_params``)."""
    try:
        kwargs = dict(params.items() if hasattr(params, "items") else params)
    except (TypeError, ValueError):
        raise ConfigError(f"{where}: params must be a mapping (or (name, value) pairs) of {what}'s arguments, got "
                          f"{type(params).__name__} {params!r}") from None
    signature = inspect.signature(constructor).parameters
    unknown = sorted(str(k) for k in kwargs if k not in signature)
    missing = [name for name, arg in signature.items() if arg.default is inspect.Parameter.empty and name not in kwargs]
    if unknown or missing:
        problems = "; ".join(([f"unknown parameters {unknown}"] if unknown else []) +
                             ([f"missing parameters {missing}"] if missing else []))
        raise ConfigError(f"{where}: {what} takes the parameters {list(signature)}: {problems} "
                          f"(got {sorted(map(str, kwargs))})")
    return kwargs
