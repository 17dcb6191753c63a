"""Test setup: 8 emulated CPU devices, configured before JAX initialises its backends."""

import os

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import pytest  # noqa: E402

from conduit_jax.plane import default_mesh  # noqa: E402

assert jax.device_count() == 8, "tests need 8 emulated CPU devices; XLA_FLAGS was set too late"


def _mesh_2x4():
    from jax.sharding import AxisType
    return jax.make_mesh((2, 4), ("host", "local"), axis_types=(AxisType.Auto, AxisType.Auto))


MESHES = {"1dev": lambda: default_mesh(1), "8dev": lambda: default_mesh(8), "2x4": _mesh_2x4}


@pytest.fixture(params=["1dev", "8dev"])
def mesh(request):
    """The same test body on one device and on the 8-device mesh."""
    return MESHES[request.param]()


@pytest.fixture(params=["1dev", "8dev", "2x4"])
def any_mesh(request):
    """One device, a 1-D 8-device mesh and a 2x4 mesh (capacity sharded over both axes)."""
    return MESHES[request.param]()
