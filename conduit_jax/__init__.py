"""Conduit-JAX: the experience path of RL as an explicit data plane (ingest -> place -> deliver).

The public API; every name here is re-exported from the module that defines it.
"""

from conduit_jax import limits, metrics, runtime, samplers, schedule, transforms
from conduit_jax.errors import (CapacityError, ConduitError, ConduitWarning, ConfigError, NotEnoughDataError,
                                PriorityError, RateLimitedError, SpecError)
from conduit_jax.checkpoint import CheckpointError
from conduit_jax.plane import ExperienceDataPlane, default_mesh
from conduit_jax.replay import Delivery
from conduit_jax.spec import ExperienceSpec

__version__ = "0.1.0"

__all__ = [
    "CapacityError", "CheckpointError", "ConduitError", "ConduitWarning", "ConfigError", "Delivery",
    "ExperienceDataPlane", "ExperienceSpec", "NotEnoughDataError", "PriorityError", "RateLimitedError", "SpecError",
    "default_mesh", "limits", "samplers", "metrics", "runtime", "schedule", "transforms",
]
