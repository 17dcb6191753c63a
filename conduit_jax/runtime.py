"""Process-wide JAX settings for latency-bound replay loops on the CPU backend.

A replay kernel on XLA:CPU is a handful of small fusions (a few hundred KB touched per call), so its time is mostly
fixed cost. Two settings of the CPU client decide much of that cost, and both are fixed when the client starts:

* **The intra-op thread pool.** XLA:CPU sizes it to the CPUs the process may run on and then splits loops over it and
  runs independent thunks on it; on a small host each hand-off to a pool thread and the wait for it at the end cost
  more than the small kernel's work they spread, so one thread is faster for replay-sized calls (the benchmarks
  compare both: ``python -m benchmarks.run --xla-threads default`` against the per-workload settings). This is the
  XLA counterpart of ``torch.set_num_threads(1)``. Calls that move megabytes are the exception: several threads copy
  them faster (W3's Atari batches, ``benchmarks.common.WORKLOAD_XLA_THREADS``), so keep XLA's pool there
  (``intra_op_threads=None``). No XLA flag sets the pool size, so ``configure_cpu`` starts the client while the
  calling thread may run on ``intra_op_threads`` CPUs only, then gives every thread of the process its CPUs back: the
  pool keeps its size, nothing stays pinned.
* **Async dispatch** (``jax_cpu_enable_async_dispatch``): off, each call runs in the calling thread instead of being
  queued, which saves the queueing of every kernel of a multi-kernel sampler in a loop that waits for each batch.
  Keep it on
  (``async_dispatch=True``) for the prefetching schedules (``schedule.overlap``/``deferred``/``adaptive``): with it
  off the delivery worker computes each prefetched batch while holding the plane's lock, so the learner's next
  call waits for it (the plane warns, ``prefetch_is_synchronous``).

A third setting belongs to the C library, not to JAX, and can change at any time:

* **Freed memory kept for reuse** (glibc's ``mallopt``, ``retain_freed_memory``): by default glibc returns a freed
  block of a few MB to the OS (``mmap`` above its adaptive threshold, trimming the heap top above 128 KB), so the next
  batch of that size lands on fresh pages and pays a fault per 4 KB page, which for a batch of megabytes can cost
  more than the copy itself. With blocks up to ``RETAINED_MALLOC["mmap_threshold"]`` served from the heap and up to
  ``RETAINED_MALLOC["trim_threshold"]`` of free heap kept, such a batch reuses pages that are mapped already (the
  benchmarks record the faults per call: ``page_faults_per_call`` in ``benchmarks/results/w3.jsonl``).
  ``sample(recycle=)`` avoids the faults too, by reusing a finished batch's buffers. The setting is process-wide:
  NumPy, torch and any other library in the process reuse their freed blocks as well.

A fourth setting is per kernel and needs no call: the plane compiles its delivery kernels on CPU at XLA's backend
optimisation level 1 (``delivery_compiler_options``), where LLVM keeps the copy loop of a narrow leaf vectorised.

Call ``configure_cpu()`` first thing in a program, before anything touches a JAX backend. It is for processes whose
JAX work is replay-sized; a process that also runs large matrix products on the CPU may prefer more threads.
"""

from __future__ import annotations

import ctypes
import functools
import os
import sys
import warnings
from typing import Optional

from conduit_jax.errors import ConduitWarning, ConfigError


def backend_started() -> bool:
    """Whether a JAX backend already runs in this process (importing jax starts none). Settings that the CPU client
    reads when it starts (device count, thread pool, async dispatch) can only change before then."""
    if "jax" not in sys.modules:
        return False
    try:
        from jax._src import xla_bridge

        return bool(xla_bridge.backends_are_initialized())
    except (ImportError, AttributeError):  # pragma: no cover - private API moved: assume the worst
        return True


# bytes; 32 MiB is glibc's largest mmap threshold. A trim threshold of 64 MiB kept nearly all of the gain of 256 MiB
# (page faults per fresh W3 batch of 256, far fewer than with glibc's defaults) with less free heap kept
RETAINED_MALLOC = {"mmap_threshold": 32 << 20, "trim_threshold": 64 << 20}
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # mallopt parameters (malloc.h)


def retain_freed_memory() -> Optional[dict]:
    """Have glibc's malloc keep freed blocks for reuse (``RETAINED_MALLOC``; see the module docstring). Returns the
    thresholds set, or None where the C library is not glibc (nothing changed)."""
    try:
        mallopt = ctypes.CDLL("libc.so.6").mallopt
    except (OSError, AttributeError):
        return None
    if not (mallopt(_M_MMAP_THRESHOLD, RETAINED_MALLOC["mmap_threshold"])
            and mallopt(_M_TRIM_THRESHOLD, RETAINED_MALLOC["trim_threshold"])):
        return None
    return dict(RETAINED_MALLOC)


def configure_cpu(intra_op_threads: Optional[int] = 1, *, async_dispatch: bool = False,
                  keep_freed_memory: bool = True) -> dict:
    """Start JAX's CPU client with ``intra_op_threads`` pool threads (None: XLA's default, one per usable CPU) and
    async dispatch on or off; with ``keep_freed_memory``, ``retain_freed_memory()`` first. Returns the settings
    applied, for a benchmark's environment record.

    Raises ``ConfigError`` (and changes nothing) when a backend already runs, since neither setting could take
    effect, or when ``intra_op_threads`` is not a positive int.
    """
    if intra_op_threads is not None and (not isinstance(intra_op_threads, int) or isinstance(intra_op_threads, bool)
                                         or intra_op_threads < 1):
        raise ConfigError(f"configure_cpu(): intra_op_threads must be an int >= 1 or None, got {intra_op_threads!r}")
    if backend_started():
        raise ConfigError("configure_cpu(): a JAX backend already runs in this process, so its thread pool and "
                          "dispatch mode are fixed; move the configure_cpu() call to the top of the program, right "
                          "after the imports (importing jax or conduit_jax starts nothing) and before the first "
                          "thing that computes: a jnp array, jax.devices(), make_buffer, ExperienceDataPlane")
    import jax

    malloc = retain_freed_memory() if keep_freed_memory else None
    jax.config.update("jax_cpu_enable_async_dispatch", bool(async_dispatch))
    usable = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_setaffinity") else None
    if usable is None and intra_op_threads is not None:
        warnings.warn("configure_cpu(): this platform has no sched_setaffinity, so XLA:CPU keeps its own thread "
                      "pool (one thread per CPU); only the dispatch mode was set", ConduitWarning, stacklevel=2)
    if intra_op_threads is None or usable is None or intra_op_threads >= len(usable):
        jax.devices()
        pool = len(usable) if usable else os.cpu_count()
        return {"intra_op_threads": pool, "async_dispatch": bool(async_dispatch), "narrowed": False, "malloc": malloc}
    saved = set(usable)
    os.sched_setaffinity(0, set(usable[:intra_op_threads]))  # the calling thread: the client reads this mask
    try:
        jax.devices()
    finally:
        _restore_affinity(saved)
    return {"intra_op_threads": intra_op_threads, "async_dispatch": bool(async_dispatch), "narrowed": True,
            "malloc": malloc}


def _restore_affinity(cpus: set[int]) -> None:
    """Every thread of the process (the pool threads inherited the narrowed mask) may run on ``cpus`` again."""
    for tid in os.listdir("/proc/self/task"):
        try:
            os.sched_setaffinity(int(tid), cpus)
        except (OSError, ValueError):  # a thread that ended meanwhile
            pass


def prefetch_is_synchronous(devices) -> bool:
    """Whether a batch dispatched ahead on ``devices`` is computed in the dispatching call: CPU devices with async
    dispatch off (``configure_cpu``'s default)."""
    import jax

    return ({d.platform for d in devices} == {"cpu"}
            and not jax.config.read("jax_cpu_enable_async_dispatch"))


# XLA:CPU compiles with LLVM at its default level (2), which fully unrolls the copy loop of a narrow leaf (up to ~64
# 4-byte elements per item) into scalar loads and stores, where the loop of a wider row is vectorised. At level
# 1 the loop stays a loop and is vectorised, so the gathers of the delivery kernels run faster; an ingest's scatter
# loses more than it gains at level 1. So only the delivery kernels get it.
CPU_DELIVERY_COMPILER_OPTIONS = {"xla_backend_optimization_level": 1}


def delivery_compiler_options(devices) -> dict:
    """The XLA compiler options of the plane's delivery kernels (sample, with or without pending priority updates,
    into fresh or recycled buffers) on ``devices``: ``CPU_DELIVERY_COMPILER_OPTIONS`` where every device is a CPU,
    else none. A learner's own jit around ``sample_fn`` compiles with the learner's options, and should: level 1
    speeds up the minibatch gathers drawn in that jit but slows the learner's update step (a W4 PPO iteration lost
    more in its updates than it gained in its gathers)."""
    return dict(CPU_DELIVERY_COMPILER_OPTIONS) if {d.platform for d in devices} == {"cpu"} else {}


@functools.cache
def _trace_state_clean():
    """JAX's check that no trace is under way (no public equivalent in JAX 0.10; a cheap call), imported once: the
    plane's per-call entry points run it, and an import statement there cost more than the check."""
    from jax._src.core import trace_state_clean

    return trace_state_clean


def refuse_under_trace(where: str, instead: str) -> None:
    """ConfigError when called while JAX traces a function (``jax.jit``, ``lax.scan``, ``vmap``).

    The plane's methods run on the host and change the plane: under a trace they would leave a tracer in it (the
    next ``len(plane)`` raises ``UnexpectedTracerError``). Code inside a trace uses the functional API instead."""
    if not _trace_state_clean()():
        raise ConfigError(f"{where}: called under a JAX trace (jax.jit, lax.scan, vmap); the plane's methods run on "
                          f"the host and cannot be traced. Inside jitted code use the functional API: buffer = "
                          f"plane.buffer() (or conduit_jax.make_buffer(...)), state = plane.state, then {instead}; "
                          f"assign the final state back with plane.state = state")
