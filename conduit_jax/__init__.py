"""Conduit-JAX: the experience path of RL as an explicit data plane (ingest -> place -> deliver).

The public API; every name here is re-exported from the module that defines it. Two ways in: the functional API
(``make_buffer``: pure init / ingest / sample / update for code inside ``jax.jit``) and the plane
(``ExperienceDataPlane``: the same buffer behind host calls that wait, rate-limit and prefetch).
"""

from conduit_jax import functional, limits, metrics, runtime, samplers, schedule, transforms
from conduit_jax.errors import (CapacityError, ConduitError, ConduitWarning, ConfigError, NotEnoughDataError,
                                PriorityError, RateLimitedError, SpecError)
from conduit_jax.checkpoint import CheckpointError
from conduit_jax.functional import Buffer, make_buffer
from conduit_jax.plane import ExperienceDataPlane
from conduit_jax.replay import Delivery, default_mesh
from conduit_jax.spec import ExperienceSpec

__version__ = "0.1.0"

__all__ = [
    "Buffer", "CapacityError", "CheckpointError", "ConduitError", "ConduitWarning", "ConfigError", "Delivery",
    "ExperienceDataPlane", "ExperienceSpec", "NotEnoughDataError", "PriorityError", "RateLimitedError", "SpecError",
    "default_mesh", "functional", "limits", "make_buffer", "samplers", "metrics", "runtime", "schedule", "transforms",
]
