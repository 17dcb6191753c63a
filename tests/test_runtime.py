"""conduit_jax.runtime: the CPU client's thread pool and dispatch mode, set before JAX starts."""

import json
import os
import subprocess
import sys

import jax
import pytest

from conduit_jax import runtime
from conduit_jax.errors import ConfigError

# A child process: configure_cpu(THREADS) first, then report what the CPU client compiled and every thread's CPUs.
# A gather of 256 rows from a 1M-row array is split over the pool (outer_dimension_partitions) whenever the pool
# has more than one thread; with one thread XLA has nothing to split it over.
CHILD = """
import json, os, sys
before = sorted(os.sched_getaffinity(0))
from conduit_jax import runtime
threads = None if sys.argv[1] == "default" else int(sys.argv[1])
applied = runtime.configure_cpu(threads)
import jax, jax.numpy as jnp
rows = jax.ShapeDtypeStruct((1_000_000, 84), jnp.uint32)
at = jax.ShapeDtypeStruct((256,), jnp.int32)
hlo = jax.jit(lambda r, i: r[i]).lower(rows, at).compile().as_text()
print(json.dumps({"applied": applied, "before": before, "async": jax.config.read("jax_cpu_enable_async_dispatch"),
                  "partitioned": "outer_dimension_partitions" in hlo,
                  "threads": [sorted(os.sched_getaffinity(int(t))) for t in os.listdir("/proc/self/task")]}))
"""


def _child(arg: str, code: str = CHILD) -> dict:
    """Run ``code`` with ``arg`` in a fresh one-device CPU process; its last stdout line, as JSON. The process
    compiles for itself: the suite's compilation cache (conftest.py) is keyed without the CPU client's thread pool,
    so a program another process compiled on a 1-thread pool would come back unsplit to a process on XLA's own pool."""
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS" and k != "JAX_COMPILATION_CACHE_DIR"}
    env["JAX_PLATFORMS"] = "cpu"
    done = subprocess.run([sys.executable, "-c", code, arg], capture_output=True, text=True, timeout=120, env=env)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])


needs_two_cpus = pytest.mark.skipif(not hasattr(os, "sched_getaffinity") or len(os.sched_getaffinity(0)) < 2,
                                    reason="the pool size only shows on a process that may use 2 or more CPUs")


@needs_two_cpus
def test_one_thread_pool_splits_no_loop_and_pins_no_thread():
    report = _child("1")
    assert report["applied"] == {"intra_op_threads": 1, "async_dispatch": False, "narrowed": True,
                                 "malloc": runtime.RETAINED_MALLOC}
    assert report["async"] is False
    assert not report["partitioned"], "a 1-thread pool still split the gather over threads"
    assert len(report["threads"]) > 1  # the client's own threads exist ...
    assert all(cpus == report["before"] for cpus in report["threads"]), report  # ... and none stays pinned


@needs_two_cpus
def test_default_pool_is_xla_s_own_choice():
    report = _child("default")
    assert report["applied"]["narrowed"] is False
    assert report["applied"]["intra_op_threads"] == len(report["before"])
    assert report["partitioned"], "with every CPU in its pool XLA splits the large gather (what configure_cpu avoids)"


# A child process: a jitted step whose two 7 MB outputs (an Atari-sized batch of 256 frames twice) are fresh on every
# call, on XLA's own pool, and the minor page faults per call after warm-up. With freed blocks kept, calls' outputs
# land on pages earlier calls used: 0.05-220 faults per call here (the heap still grows once or twice in some runs),
# against 1,300-3,100 (most of the 3,528 pages of the outputs) with glibc's defaults. With one 7 MB output on a
# 1-thread pool both modes varied from run to run (0-260 per call), so the child reproduces the benchmark's case.
FAULTS_CHILD = """
import json, resource, sys
import numpy as np
from conduit_jax import runtime
applied = runtime.configure_cpu(None, keep_freed_memory=sys.argv[1] == "keep")
import jax, jax.numpy as jnp
rows = jnp.asarray(np.random.default_rng(0).integers(0, 255, (2000, 28224), dtype=np.uint8))
step = jax.jit(lambda r, i: (r[i], r[(i + 1) % r.shape[0]]))
at = [jnp.asarray(np.random.default_rng(k).integers(0, 2000, 256).astype(np.int32)) for k in range(8)]
for k in range(10):
    jax.block_until_ready(step(rows, at[k % 8]))
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for k in range(40):
    jax.block_until_ready(step(rows, at[k % 8]))
print(json.dumps({"malloc": applied["malloc"],
                  "faults_per_call": (resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before) / 40}))
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt")
def test_kept_freed_memory_gives_fresh_outputs_used_pages():
    reports = {mode: _child(mode, FAULTS_CHILD) for mode in ("keep", "default")}
    assert reports["keep"]["malloc"] == runtime.RETAINED_MALLOC
    assert reports["keep"]["faults_per_call"] <= 3528 / 4, reports  # most calls reuse their outputs' pages
    assert reports["default"]["malloc"] is None  # keep_freed_memory=False leaves malloc as it was


def test_refused_once_a_backend_runs_and_nothing_changes():
    jax.devices()  # conftest's backend runs already; make it explicit
    assert runtime.backend_started()
    before = jax.config.read("jax_cpu_enable_async_dispatch")
    with pytest.raises(ConfigError, match=r"configure_cpu\(\): a JAX backend already runs"):
        runtime.configure_cpu(1, async_dispatch=not before)
    assert jax.config.read("jax_cpu_enable_async_dispatch") == before


@pytest.mark.parametrize("bad", [0, -1, True, 1.5, "1"])
def test_bad_thread_count_names_the_argument(bad):
    with pytest.raises(ConfigError, match=r"intra_op_threads must be an int >= 1 or None, got"):
        runtime.configure_cpu(bad)


class _Device:
    def __init__(self, platform):
        self.platform = platform


def test_delivery_kernels_get_cpu_options_on_cpu_only():
    cpu = runtime.delivery_compiler_options(jax.devices("cpu"))
    assert cpu == runtime.CPU_DELIVERY_COMPILER_OPTIONS and cpu is not runtime.CPU_DELIVERY_COMPILER_OPTIONS
    assert runtime.delivery_compiler_options([_Device("gpu")]) == {}
    assert runtime.delivery_compiler_options([_Device("cpu"), _Device("gpu")]) == {}
    # XLA knows the option (an unknown name fails the compile) and the result is the same as without it
    gather = lambda rows, at: rows[at]  # noqa: E731
    rows, at = jax.numpy.arange(64 * 70, dtype=jax.numpy.uint32).reshape(64, 70), jax.numpy.arange(32) * 2
    with_options = jax.jit(gather, compiler_options=cpu)(rows, at)
    assert (with_options == jax.jit(gather)(rows, at)).all()
