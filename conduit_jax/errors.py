"""The error types of the data plane.

Every error is a ``ValueError`` subclass whose message names the argument or leaf, what was expected and what came.
A call that raises one leaves the plane's state exactly as it was.
"""


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
