"""Importing the runtime stays framework-agnostic: no torch, no ray (ray is imported lazily in distributed/)."""

import json
import os
import subprocess
import sys

FORBIDDEN = ("torch", "ray", "ray.rllib", "tensorflow")


def test_import_does_not_pull_in_frameworks():
    code = ("import json, sys; import conduit_jax; "
            f"print(json.dumps({{m: m in sys.modules for m in {list(FORBIDDEN)!r}}}))")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                            env={**os.environ, "JAX_PLATFORMS": "cpu"})
    assert result.returncode == 0, result.stderr
    loaded = json.loads(result.stdout.strip().splitlines()[-1])
    assert loaded == {m: False for m in FORBIDDEN}, f"import conduit_jax loaded {[m for m, v in loaded.items() if v]}"


def test_public_api_resolves():
    import conduit_jax

    for name in conduit_jax.__all__:
        assert getattr(conduit_jax, name) is not None, name
    for name in ("CapacityError", "ConfigError", "NotEnoughDataError", "SpecError"):
        assert issubclass(getattr(conduit_jax, name), conduit_jax.ConduitError)
        assert issubclass(getattr(conduit_jax, name), ValueError)
