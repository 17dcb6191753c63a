"""Beyond one machine: the data plane on Ray actors and on multi-host JAX meshes.

    from conduit_jax.distributed import DistributedPlane           # shards as Ray actors (imports ray when built)
    from conduit_jax.distributed import multihost                  # jax.distributed meshes spanning processes

Nothing here imports ray at module import time: ``ray_plane`` imports it inside the functions and constructors that
need it, and ``import conduit_jax`` does not import this package at all.
"""

from conduit_jax.distributed import multihost
from conduit_jax.distributed.ray_plane import (DistributedPlane, ShardServer, ShardUnavailableError, route,
                                               split_counts)

__all__ = ["DistributedPlane", "ShardServer", "ShardUnavailableError", "multihost", "route", "split_counts"]
