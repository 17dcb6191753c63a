"""Conduit-JAX: the experience path of RL as an explicit data plane (ingest -> place -> deliver).

The public API; every name here is re-exported from the module that defines it. Two ways in: the functional API
(``make_buffer``: pure init / ingest / sample / update for code inside ``jax.jit``) and the plane
(``ExperienceDataPlane``: the same buffer behind host calls that wait, rate-limit and prefetch).

Names load on first use (PEP 562), so ``import conduit_jax`` does not import JAX: a command's ``--help``, or
``conduit_jax.runtime.configure_cpu()`` called first thing in a program, runs before JAX does.
"""

import importlib

__version__ = "0.1.0"

_SUBMODULES = ("functional", "limits", "metrics", "rollouts", "runtime", "samplers", "schedule", "transforms")
_NAMES = {  # public name -> the module that defines it
    **dict.fromkeys(("CapacityError", "ConduitError", "ConduitWarning", "ConfigError", "NotEnoughDataError",
                     "PriorityError", "RateLimitedError", "SpecError"), "errors"),
    "CheckpointError": "checkpoint",
    "Buffer": "functional",
    "make_buffer": "functional",
    "ExperienceDataPlane": "plane",
    "RolloutPlane": "rollout_plane",
    "Delivery": "replay",
    "default_mesh": "replay",
    "ExperienceSpec": "spec",
}

__all__ = sorted([*_NAMES, *_SUBMODULES])


def __getattr__(name: str):
    if name in _SUBMODULES:
        return importlib.import_module(f"conduit_jax.{name}")
    if name in _NAMES:
        value = getattr(importlib.import_module(f"conduit_jax.{_NAMES[name]}"), name)
        globals()[name] = value  # later lookups skip this function
        return value
    raise AttributeError(f"module 'conduit_jax' has no attribute {name!r}")


def __dir__():
    return sorted([*globals(), *__all__])
