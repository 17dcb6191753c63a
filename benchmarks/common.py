"""Timing harness shared by the workload benchmarks.

Conventions (STYLE.md, "Benchmarks"):
  * compile / warm-up time is measured on the first call and reported apart from the steady state;
  * steady state is measured in interleaved rounds: every contender runs ``reps`` calls per round, round robin, the
    order rotated each round, so machine noise (this 2-core host is shared) hits all contenders alike. Medians and
    p99 are over every timed call of all rounds; the per-round medians are kept to show the spread;
  * the memcpy bandwidth of this machine is measured in the same run, so each row can say which fraction of it the
    contender reached (bytes delivered / time / memcpy bandwidth);
  * memory is RSS growth over the raw bytes of the items held;
  * results go to ``benchmarks/results/<workload>.jsonl`` (one JSON object per line, the first one the environment)
    together with a printed table of ratios against Conduit measured in the same run.

``configure_runtime()`` must run before the first JAX computation of the process.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import datetime
import gc
import importlib.metadata
import json
import os
import platform
import resource
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional

import numpy as np

RESULTS_ENV = "CONDUIT_BENCH_RESULTS"  # a results directory handed to a workload run in a subprocess (W6)
RESULTS_DIR = Path(os.environ.get(RESULTS_ENV) or Path(__file__).resolve().parent / "results")
BASELINE = "conduit"  # every ratio is taken against the contender whose name starts with this

_runtime: Optional[dict] = None  # what configure_runtime applied (recorded in every environment line)
XLA_THREADS_ENV = "CONDUIT_BENCH_XLA_THREADS"  # run.py --xla-threads sets it; a workload's subprocess inherits it
# XLA:CPU intra-op pool per workload when nobody chose one: one thread (replay-sized kernels: a hand-off to a second
# pool thread costs more than it saves), except where a call moves megabytes, which two threads copy faster: W3's
# frames (b256, batch buffers recycled). W4 moved to one thread once its kernels took the state's scalars as one
# vector, when its iteration came out faster with one thread than with XLA's pool in runs one after another
# (``run.py --xla-threads`` compares the settings).
WORKLOAD_XLA_THREADS = {"w3": "default"}


def xla_threads_setting(workload: Optional[str] = None) -> str:
    """The pool setting for a run: ``$CONDUIT_BENCH_XLA_THREADS`` when set, else the workload's own (a count, or
    'default' for XLA's own pool of one thread per usable CPU)."""
    value = os.environ.get(XLA_THREADS_ENV) or WORKLOAD_XLA_THREADS.get(workload, "1")
    if value != "default" and (not value.isdigit() or int(value) < 1):
        raise ValueError(f"XLA:CPU pool threads: expected a positive integer or 'default', got {value!r} "
                         f"(--xla-threads / ${XLA_THREADS_ENV})")
    return value


def configure_runtime(workload: Optional[str] = None) -> dict:
    """Dispatch settings for latency-bound single-stream loops on this 2-core host (ARCHITECTURE.md), through
    ``conduit_jax.runtime.configure_cpu``: async dispatch off (multi-kernel samplers skip the queue), the
    XLA:CPU intra-op pool of ``xla_threads_setting(workload)`` (see ``WORKLOAD_XLA_THREADS``), for Conduit and the
    other JAX contenders alike, and glibc's malloc keeping freed blocks, for every contender in the process. torch
    (imported lazily by the TorchRL peer) is pinned to one thread in ``peers.import_torch``: with its default 2
    threads on 2 shared cores it is many times slower. Both JAX settings are fixed when the backend starts, so the
    first call decides (call it first thing in ``main``); when a backend already runs (a caller started JAX first)
    nothing changes and the record says so.
    """
    global _runtime
    if _runtime is not None:
        return _runtime
    from conduit_jax import runtime

    if runtime.backend_started():
        import jax

        _runtime = {"intra_op_threads": "unchanged: the JAX backend had started before configure_runtime()",
                    "async_dispatch": bool(jax.config.read("jax_cpu_enable_async_dispatch")), "narrowed": False}
    else:
        setting = xla_threads_setting(workload)
        _runtime = runtime.configure_cpu(None if setting == "default" else int(setting), async_dispatch=False)
    return _runtime


# ------------------------------------------------------------------------------------------------------------------
# Environment record
# ------------------------------------------------------------------------------------------------------------------
_PACKAGES = ("jax", "jaxlib", "numpy", "cpprb", "flashbax", "torch", "torchrl", "tensordict", "conduit-jax")


def _version(name: str) -> Optional[str]:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def _git_state() -> dict[str, Any]:
    root = Path(__file__).resolve().parent.parent
    used = _conduit_path()
    if used is not None and Path(used).resolve() != (root / "conduit_jax").resolve():
        # conduit_jax imported from elsewhere, e.g. `git archive <commit> conduit_jax | tar -x -C DIR` with the commit
        # written to DIR/COMMIT, so a run can measure a committed state while the work tree is being edited
        marker = Path(used).parent / "COMMIT"
        commit = marker.read_text().strip() if marker.is_file() else None
        return {"commit": commit, "conduit_jax_dirty": False if commit else None,
                "conduit_jax_note": f"imported from {used}" + (f", exported from commit {commit}" if commit else "")}
    try:
        head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True,
                              timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--", "conduit_jax"], cwd=root, capture_output=True,
                               text=True, timeout=10).stdout.strip()
        return {"commit": head or None, "conduit_jax_dirty": bool(dirty)}
    except (OSError, subprocess.SubprocessError):
        return {"commit": None, "conduit_jax_dirty": None}


def _conduit_path() -> Optional[str]:
    try:
        import conduit_jax

        return str(Path(conduit_jax.__file__).parent)
    except ImportError:
        return None


def environment(memcpy: dict[str, float], extra: Optional[dict] = None) -> dict[str, Any]:
    """What a reader needs to judge the numbers: versions, devices, memory kinds, CPU, load, settings, date."""
    import jax

    devices = jax.devices()
    try:
        memory_kinds = sorted({m.kind for m in devices[0].addressable_memories()})
        default_kind = devices[0].default_memory().kind
    except Exception as exc:  # pragma: no cover - backends without memories API
        memory_kinds, default_kind = [f"unknown ({exc})"], None
    env = {
        "record": "environment",
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "python": platform.python_version(),
        "platform": platform.platform(),
        "cpu_model": _cpu_model(),
        "cpu_count": os.cpu_count(),
        "cpu_affinity": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
        "load_average": list(os.getloadavg()),
        "versions": {name: _version(name) for name in _PACKAGES},
        "jax_backend": jax.default_backend(),
        "devices": [str(d) for d in devices],
        "device_count": len(devices),
        "default_memory_kind": default_kind,
        "memory_kinds": memory_kinds,
        "jax_cpu_enable_async_dispatch": bool(jax.config.read("jax_cpu_enable_async_dispatch")),
        "xla_cpu_intra_op_threads": configure_runtime()["intra_op_threads"],
        "malloc_retained": configure_runtime().get("malloc"),  # glibc thresholds set by configure_cpu, or None
        "XLA_FLAGS": os.environ.get("XLA_FLAGS"),
        # set on this machine for old OpenBLAS builds; the measured paths (indexing, copies, sum-tree arithmetic)
        # call no BLAS routine, so they do not change what is measured here
        "OPENBLAS_CORETYPE": os.environ.get("OPENBLAS_CORETYPE"),
        "OPENBLAS_L2_SIZE": os.environ.get("OPENBLAS_L2_SIZE"),
        "memcpy": memcpy,
        "conduit_jax_path": _conduit_path(),
        **_git_state(),
    }
    if extra:
        env.update(extra)
    return env


# ------------------------------------------------------------------------------------------------------------------
# memcpy bandwidth of this machine, measured in the same run
# ------------------------------------------------------------------------------------------------------------------
class MemcpyMeter:
    """``np.copyto`` bandwidth of an ``nbytes`` array (bytes copied per second), both sides touched first.

    Measured several times during a run (before, between and after the timed phases): the host is shared, so one
    reading can catch a busy moment. The bandwidth used for the "fraction of memcpy" column is the median of all
    readings; every reading goes into the JSON record."""

    def __init__(self, nbytes: int = 256 << 20):
        self.nbytes = nbytes
        self.samples: list[float] = []

    def measure(self, reps: int = 3) -> float:
        src = np.full(self.nbytes, 7, np.uint8)
        dst = np.empty_like(src)
        np.copyto(dst, src)  # fault in the destination pages
        for _ in range(reps):
            start = time.perf_counter()
            np.copyto(dst, src)
            self.samples.append(time.perf_counter() - start)
        del src, dst
        trim_memory()
        return self.bytes_per_s

    @property
    def bytes_per_s(self) -> float:
        return self.nbytes / float(np.median(self.samples))

    def record(self) -> dict[str, Any]:
        times = np.asarray(self.samples)
        return {"bytes": self.nbytes, "readings": len(times), "median_s": float(np.median(times)),
                "bytes_per_s": self.bytes_per_s, "min_s": float(times.min()), "max_s": float(times.max()),
                "readings_s": times.tolist()}


def memcpy_bandwidth(nbytes: int = 256 << 20, reps: int = 5) -> dict[str, Any]:
    """One-off measurement: median ``np.copyto`` bandwidth of an ``nbytes`` array."""
    meter = MemcpyMeter(nbytes)
    meter.measure(reps)
    return meter.record()


# ------------------------------------------------------------------------------------------------------------------
# Memory
# ------------------------------------------------------------------------------------------------------------------
_PAGE = os.sysconf("SC_PAGE_SIZE")


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * _PAGE


def minor_page_faults() -> int:
    """Minor page faults of this process so far (every thread): each is a fresh page mapped on first touch."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def trim_memory() -> None:
    """Collect garbage and hand free heap pages back to the OS, so RSS deltas measure live memory.

    The survivors are then frozen (``gc.freeze``): with torch and JAX loaded a full collection is slow, and later
    collections only need to scan what was allocated since."""
    gc.collect()
    gc.freeze()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except OSError:  # pragma: no cover - non-glibc
        pass


def warm_runtimes() -> None:
    """Start the JAX CPU backend and compiler (and import torch and TorchRL, when installed) before any contender is
    built: their start-up memory (~45 MB for JAX here, ~140 MB for TorchRL's imports) is the runtime's, not a
    buffer's, and would otherwise be charged to whichever JAX or torch contender happens to be built first."""
    import jax

    jax.jit(lambda x: x + 1)(np.float32(1)).block_until_ready()
    from benchmarks import peers

    try:
        peers.start_torchrl(seed=0)  # torch, tensordict and torchrl.data: what the TorchRL contenders are built from
    except peers.Unavailable:  # no TorchRL: torch alone, when installed
        try:
            peers.import_torch()
        except ImportError:
            pass


class RssMonitor:
    """RSS at entry and exit, and the peak in between (a thread polls /proc every ``interval`` s)."""

    def __init__(self, interval: float = 0.002):
        self.interval = interval
        self.start = self.end = self.peak = 0
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None

    def _poll(self):
        while not self._stop.is_set():
            self.peak = max(self.peak, rss_bytes())
            self._stop.wait(self.interval)

    def __enter__(self):
        trim_memory()
        self.start = self.peak = rss_bytes()
        self._thread = threading.Thread(target=self._poll, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()
        trim_memory()
        self.end = rss_bytes()
        self.peak = max(self.peak, self.end)
        return False

    @property
    def delta(self) -> int:
        return self.end - self.start

    @property
    def peak_delta(self) -> int:
        return self.peak - self.start


# ------------------------------------------------------------------------------------------------------------------
# Compilation accounting (JAX contenders)
# ------------------------------------------------------------------------------------------------------------------
_TRACE = "/jax/core/compile/jaxpr_trace_duration"
_LOWER = "/jax/core/compile/jaxpr_to_mlir_module_duration"
_BACKEND = "/jax/core/compile/backend_compile_duration"


@dataclass
class CompileStats:
    compiles: int = 0  # backend compilations
    seconds: float = 0.0  # trace + lowering + backend compile

    def add(self, other: "CompileStats") -> None:
        self.compiles += other.compiles
        self.seconds += other.seconds


class CompileLog:
    """Attributes JAX compilation events to the phase that is running (``with log.phase("conduit", "warmup")``).

    A compile during a ``steady`` phase is a recompilation: the steady-state numbers then include it, and the
    report says so.
    """

    def __init__(self):
        self.stats: dict[tuple[str, str], CompileStats] = {}
        self._current: Optional[tuple[str, str]] = None
        import jax

        jax.monitoring.register_event_duration_secs_listener(self._listen)

    def _listen(self, event: str, duration: float, **kwargs) -> None:
        if self._current is None or event not in (_TRACE, _LOWER, _BACKEND):
            return
        stats = self.stats.setdefault(self._current, CompileStats())
        stats.seconds += duration
        if event == _BACKEND:
            stats.compiles += 1

    def phase(self, contender: str, phase: str):
        log = self

        class _Phase:
            def __enter__(self):
                log._current = (contender, phase)

            def __exit__(self, *exc):
                log._current = None
                return False

        return _Phase()

    def get(self, contender: str, *phases: str) -> CompileStats:
        out = CompileStats()
        for (name, phase), stats in self.stats.items():
            if name == contender and (not phases or phase in phases):
                out.add(stats)
        return out


# ------------------------------------------------------------------------------------------------------------------
# Timing
# ------------------------------------------------------------------------------------------------------------------
@dataclass
class Timings:
    """Wall-clock seconds of every timed call, grouped by round, and the process's minor page faults per round."""

    rounds: list[np.ndarray] = field(default_factory=list)
    faults: list[int] = field(default_factory=list)

    @property
    def calls(self) -> np.ndarray:
        return np.concatenate(self.rounds) if self.rounds else np.zeros(0)

    def summary(self) -> dict[str, Any]:
        calls = self.calls
        return {
            "n": int(calls.size),
            "median_s": float(np.median(calls)),
            "p99_s": float(np.percentile(calls, 99)),
            "mean_s": float(np.mean(calls)),
            "min_s": float(np.min(calls)),
            "round_medians_s": [float(np.median(r)) for r in self.rounds],
            # fresh pages touched per call (output buffers the allocator took from the OS): a cost that appears in
            # the time of whoever allocates, and that varies with the allocator's state
            "page_faults_per_call": float(sum(self.faults) / calls.size),
        }


def time_first_call(fn: Callable[[], Any], log: Optional[CompileLog], name: str, phase: str) -> float:
    """Seconds of one call (the first: tracing, compilation and first-touch included)."""
    ctx = log.phase(name, phase) if log is not None else contextlib.nullcontext()
    with ctx:
        start = time.perf_counter()
        fn()
        return time.perf_counter() - start


def interleaved(ops: dict[str, Callable[[], Any]], *, rounds: int, reps: int, warmup: int = 3,
                log: Optional[CompileLog] = None, phase: str = "steady") -> dict[str, Timings]:
    """Time ``reps`` calls of every op per round, round robin, rotating the order each round.

    Each op must leave its result ready (block on JAX arrays) before it returns. The garbage collector is paused
    inside a contender's block of calls, so a collection triggered by one contender's garbage does not land on the
    next one's timings; it runs between blocks.
    """
    names = list(ops)
    out = {name: Timings() for name in names}
    trim_memory()
    for name in names:  # a few untimed calls: caches, branch predictors, lazily built state
        with (log.phase(name, phase + "-warmup") if log is not None else contextlib.nullcontext()):
            for _ in range(warmup):
                ops[name]()
    perf = time.perf_counter
    for r in range(rounds):
        shift = r % len(names)
        for name in names[shift:] + names[:shift]:
            op = ops[name]
            times = np.empty(reps)
            gc.collect()
            gc.disable()
            faults = minor_page_faults()
            try:
                with (log.phase(name, phase) if log is not None else contextlib.nullcontext()):
                    for i in range(reps):
                        start = perf()
                        op()
                        times[i] = perf() - start
            finally:
                gc.enable()
            out[name].rounds.append(times)
            out[name].faults.append(minor_page_faults() - faults)
    return out


# ------------------------------------------------------------------------------------------------------------------
# Records, ratios, tables, JSON lines
# ------------------------------------------------------------------------------------------------------------------
def is_baseline(name: str) -> bool:
    return name.split("[")[0] == BASELINE


def headline_baseline(records: list[dict], metric: str, group: Optional[str] = None) -> Optional[dict]:
    """The Conduit row a metric's ratios are taken against: the first Conduit contender (the 1-device mesh) of the
    same group (workloads too large to hold every contender at once time Conduit against one peer at a time)."""
    for rec in records:
        if (rec.get("metric") == metric and is_baseline(rec["contender"]) and "median_s" in rec
                and rec.get("group") == group):
            return rec
    return None


def timing_record(workload: str, metric: str, contender: str, timings: Timings, *, items_per_call: int,
                  bytes_per_call: int, memcpy_bps: float, **extra) -> dict[str, Any]:
    summary = timings.summary()
    median = summary["median_s"]
    return {
        "record": "timing", "workload": workload, "metric": metric, "contender": contender,
        **summary,
        "items_per_call": items_per_call,
        "bytes_per_call": bytes_per_call,
        "items_per_s": items_per_call / median,
        "bytes_per_s": bytes_per_call / median,
        "frac_memcpy": bytes_per_call / median / memcpy_bps,
        **extra,
    }


def add_ratios(records: list[dict]) -> None:
    """``x_over_conduit`` = contender median / Conduit median (>1: Conduit is faster); ``conduit_over_x`` its
    inverse. Taken per metric (and group) against the headline Conduit row of the same run."""
    for rec in records:
        if rec.get("record") != "timing":
            continue
        base = headline_baseline(records, rec["metric"], rec.get("group"))
        if base is None:
            rec["x_over_conduit"] = rec["conduit_over_x"] = None
            continue
        rec["x_over_conduit"] = rec["median_s"] / base["median_s"]
        rec["conduit_over_x"] = base["median_s"] / rec["median_s"]


def _fmt_rate(x: float) -> str:
    for unit, scale in (("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if x >= scale:
            return f"{x / scale:.2f}{unit}"
    return f"{x:.0f}"


def _fmt_bytes(x: float) -> str:
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if abs(x) >= scale:
            return f"{x / scale:.1f} {unit}"
    return f"{x:.0f} B"


def timing_table(records: list[dict], metric: str, title: str, rate_unit: str) -> str:
    rows = [r for r in records if r.get("record") == "timing" and r["metric"] == metric]
    if not rows:
        return ""
    header = (f"{'contender':<34} {'median us':>10} {'p99 us':>9} {'rounds (min-max) us':>20} {rate_unit:>11} "
              f"{'memcpy':>7} {'x/conduit':>9} {'conduit/x':>9} {'1st call s':>10} {'recomp':>6} {'faults':>7}")
    lines = [title, header, "-" * len(header)]
    group = None
    for r in rows:
        if r.get("group") and r["group"] != group:
            group = r["group"]
            lines.append(f"  [{group}]")
        rm = r["round_medians_s"]
        ratio = "" if r.get("x_over_conduit") is None else f"{r['x_over_conduit']:.2f}x"
        inverse = "" if r.get("conduit_over_x") is None else f"{r['conduit_over_x']:.2f}x"
        first = "" if r.get("first_call_s") is None else f"{r['first_call_s']:.3f}"
        recompiles = "" if r.get("recompiles") is None else str(r["recompiles"])
        lines.append(
            f"{r['contender']:<34} {r['median_s'] * 1e6:>10.1f} {r['p99_s'] * 1e6:>9.1f} "
            f"{min(rm) * 1e6:>9.1f}-{max(rm) * 1e6:<10.1f} {_fmt_rate(r['items_per_s']):>11} "
            f"{r['frac_memcpy'] * 100:>6.1f}% {ratio:>9} {inverse:>9} {first:>10} {recompiles:>6} "
            f"{r.get('page_faults_per_call', 0.0):>7.1f}")
    return "\n".join(lines)


def memory_table(records: list[dict], title: str) -> str:
    rows = [r for r in records if r.get("record") == "memory"]
    if not rows:
        return ""
    header = (f"{'contender':<34} {'raw':>10} {'state':>10} {'RSS delta':>10} {'RSS/raw':>8} {'peak delta':>10} "
              f"{'peak/raw':>8} {'fill s':>7} {'jit cache':>9}")
    lines = [title, header, "-" * len(header)]
    for r in rows:
        state = "" if r.get("state_bytes") is None else _fmt_bytes(r["state_bytes"])
        cache = "" if r.get("jit_cache_entries") is None else str(r["jit_cache_entries"])
        name = r["contender"] + (f" ({r['group']})" if r.get("group") and is_baseline(r["contender"]) else "")
        lines.append(
            f"{name:<34} {_fmt_bytes(r['raw_bytes']):>10} {state:>10} {_fmt_bytes(r['rss_delta_bytes']):>10} "
            f"{r['rss_over_raw']:>8.2f} {_fmt_bytes(r['rss_peak_delta_bytes']):>10} {r['peak_over_raw']:>8.2f} "
            f"{r['fill_s']:>7.2f} {cache:>9}")
    return "\n".join(lines)


def write_jsonl(path: Path, env: dict, records: list[dict]) -> Path:
    """One run per file: the environment line, then one line per record (the latest run replaces the previous)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    with open(tmp, "w") as f:
        f.write(json.dumps(env, default=_json_default) + "\n")
        for rec in records:
            f.write(json.dumps(rec, default=_json_default) + "\n")
    tmp.replace(path)
    return path


def read_jsonl(path: Path) -> tuple[dict, list[dict]]:
    """(environment, records) of one results file."""
    lines = [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]
    return (lines[0] if lines else {}), lines[1:]


def _json_default(x):
    if isinstance(x, (np.integer,)):
        return int(x)
    if isinstance(x, (np.floating,)):
        return float(x)
    if isinstance(x, np.ndarray):
        return x.tolist()
    return str(x)


# ------------------------------------------------------------------------------------------------------------------
# Goals (issue 7): each workload states its goals; the run says which are met and by how much the others are missed
# ------------------------------------------------------------------------------------------------------------------
@dataclass
class Goal:
    """One goal, checked against the records of the run that measured it.

    kinds: ``ratio`` Conduit time / ``peer`` time in the same group (and run) <= ``target``; ``memcpy`` Conduit's
    fraction of memcpy >= ``target``; ``memory`` Conduit's RSS growth / raw bytes <= ``target``; ``recompiles``
    Conduit's steady-state compilations == 0. ``contender`` names the Conduit row (default: the headline one)."""

    text: str
    kind: str
    metric: Optional[str] = None
    target: float = 1.0
    peer: Optional[str] = None
    contender: Optional[str] = None


def _conduit_rows(records, goal: Goal, record: str = "timing") -> list[dict]:
    """The Conduit rows a goal reads: ``goal.contender`` when named, else the headline Conduit row of each group
    (timings) or every 1-device Conduit build (memory)."""
    out = []
    for r in records:
        if r.get("record") != record or (record == "timing" and r.get("metric") != goal.metric):
            continue
        if goal.contender is not None:
            if r["contender"] == goal.contender:
                out.append(r)
        elif record == "timing":
            if r is headline_baseline(records, r["metric"], r.get("group")):
                out.append(r)
        elif r["contender"].startswith(BASELINE + "[1dev"):
            out.append(r)
    return out


def evaluate_goals(records: list[dict], goals: list[Goal], workload: str) -> list[dict]:
    """One ``goal`` record per goal: the measured value, the target, whether it is met and the margin (``by``: the
    factor by which the value is on the wrong side of the target, 1.0 when met exactly)."""
    out = []
    for goal in goals:
        value, detail = None, ""
        if goal.kind == "ratio":
            peer = [r for r in records if r.get("record") == "timing" and r.get("metric") == goal.metric
                    and r["contender"] == goal.peer and r.get("conduit_over_x") is not None]
            group = peer[0].get("group") if peer else None
            base = next((r for r in _conduit_rows(records, goal) if r.get("group") == group), None)
            if peer and base is not None:
                value = base["median_s"] / peer[0]["median_s"]
                detail = (f"{base['contender']} {base['median_s'] * 1e6:.1f} us vs {goal.peer} "
                          f"{peer[0]['median_s'] * 1e6:.1f} us")
        elif goal.kind == "memcpy":
            rows = _conduit_rows(records, goal)
            if rows:
                value = float(np.median([r["frac_memcpy"] for r in rows]))
                detail = f"median of {len(rows)} Conduit measurement(s); " + ", ".join(
                    f"{r['frac_memcpy'] * 100:.1f}%" for r in rows)
        elif goal.kind == "memory":
            rows = _conduit_rows(records, goal, "memory")
            if rows:
                value = max(r["rss_over_raw"] for r in rows)
                detail = "largest of " + ", ".join(f"{r['rss_over_raw']:.3f}" for r in rows)
        elif goal.kind == "recompiles":
            rows = _conduit_rows(records, goal)
            if rows:
                value = float(sum(r.get("recompiles") or 0 for r in rows))
                detail = f"over {len(rows)} timed Conduit metric(s)"
        if value is None:
            out.append({"record": "goal", "workload": workload, "goal": goal.text, "kind": goal.kind, "value": None,
                        "target": goal.target, "met": None, "detail": "not measured in this run"})
            continue
        lower_is_better = goal.kind in ("ratio", "memory", "recompiles")
        met = value <= goal.target if lower_is_better else value >= goal.target
        if goal.kind == "recompiles":
            by = None
        elif lower_is_better:
            by = value / goal.target
        else:
            by = goal.target / value if value > 0 else float("inf")
        out.append({"record": "goal", "workload": workload, "goal": goal.text, "kind": goal.kind, "metric": goal.metric,
                    "peer": goal.peer, "value": value, "target": goal.target, "met": met, "by": by,
                    "detail": detail})
    return out


def attach_goals(path: Path, goals: list[Goal], workload: str) -> list[dict]:
    """Evaluate ``goals`` on a results file written without them (W1/W2's scripts) and append the goal records to it
    (replacing earlier ones). Returns the goal records."""
    env, records = read_jsonl(path)
    records = [r for r in records if r.get("record") != "goal"]
    goal_records = evaluate_goals(records, goals, workload)
    write_jsonl(path, env, records + goal_records)
    return goal_records


def goal_lines(goal_records: list[dict]) -> str:
    lines = []
    for g in goal_records:
        if g["met"] is None:
            lines.append(f"  [ -- ] {g['goal']}: not measured in this run")
            continue
        kind, value = g["kind"], g["value"]
        shown = (f"{value:.2f}x" if kind == "ratio" else f"{value * 100:.1f}% of memcpy" if kind == "memcpy"
                 else f"{value:.3f}x raw" if kind == "memory" else f"{value:.0f}")
        verdict = "MET " if g["met"] else "MISS"
        margin = ""
        if not g["met"] and g.get("by") is not None:
            margin = (f" (missed by {(g['by'] - 1) * 100:.0f}%: {g['by']:.2f}x the target)" if kind != "memcpy" else
                      f" (missed by {(g['target'] - value) * 100:.1f} points)")
        lines.append(f"  [{verdict}] {g['goal']}: {shown}{margin}" + (f"; {g['detail']}" if g.get("detail") else ""))
    return "\n".join(lines)


@dataclass
class Settings:
    """Sizes of one workload run; ``quick`` is the CI smoke configuration."""

    capacity: int
    batch_size: int = 256
    chunk: int = 1000
    rounds: int = 12
    sample_reps: int = 200
    add_reps: int = 50
    quick: bool = False

    @classmethod
    def for_run(cls, quick: bool, capacity: Optional[int] = None, rounds: Optional[int] = None) -> "Settings":
        if quick:
            s = cls(capacity=20_000, rounds=2, sample_reps=15, add_reps=6, quick=True)
        else:
            s = cls(capacity=1_000_000, rounds=20, sample_reps=250, add_reps=50)
        if capacity is not None:
            s.capacity = capacity
        if rounds is not None:
            s.rounds = rounds
        return s


# ------------------------------------------------------------------------------------------------------------------
# The workload driver: build + fill every contender, then time each metric in interleaved rounds
# ------------------------------------------------------------------------------------------------------------------
@dataclass
class Metric:
    """One timed operation. ``make_op(contender, pools)`` returns a zero-argument callable doing one call.

    ``bytes_per_call`` overrides ``items_per_call x item bytes`` (what "% of memcpy" divides by), for operations that
    move more than the items they deliver (W4's iteration writes the rollout once and reads it four times)."""

    name: str
    title: str
    rate_unit: str
    items_per_call: int
    make_op: Callable[[Any, dict], Callable[[], Any]]
    applies: Callable[[Any], bool] = lambda c: True
    reps: int = 100
    first_from_fill: bool = False  # its first call (and compile) happened while filling: report that one
    first_calls: int = 1  # calls timed together as the first call: the steady state starts after them
    bytes_per_call: Optional[int] = None
    extra: dict = field(default_factory=dict)  # copied into each timing record


@dataclass
class Entry:
    """A contender to build: ``make()`` returns it (or raises ``peers.Unavailable``). A derived entry wraps a
    contender built before it (``make(built)``) and is neither filled nor measured for memory."""

    label: str
    make: Callable[..., Any]
    derived: bool = False


@dataclass
class Group:
    """Contenders that exist and are timed together. Workloads whose buffers are too large to hold every contender
    at once (W3: 5.6 GB per contender at 100k Atari frames) run Conduit against one peer at a time: each group is
    built, filled, timed in interleaved rounds and released before the next, and its ratios are taken against the
    Conduit row of the same group. ``keep`` names contenders carried into the next group instead of being released
    (the next group lists them again and reuses them: no second fill). ``metrics`` None: the workload's metrics."""

    label: str
    entries: list[Entry]
    metrics: Optional[list[Metric]] = None
    keep: tuple[str, ...] = ()


_T0 = time.perf_counter()


def workload_parser(doc: str, *, capacity: bool = True) -> argparse.ArgumentParser:
    """The command line every bench_w*.py shares: --quick, --rounds and (unless the workload's size is fixed)
    --capacity; a script adds its own options to the parser returned."""
    parser = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true",
                        help="small capacity, few rounds (CI smoke run)" if capacity else "few rounds (CI smoke run)")
    if capacity:
        parser.add_argument("--capacity", type=int)
    parser.add_argument("--rounds", type=int)
    return parser


def run_workload_module(workload: str, args: list[str], why: str, env: Optional[dict] = None) -> None:
    """Run ``python -m benchmarks.bench_<workload> ARGS`` in a subprocess (a setting fixed per process differs:
    device count, XLA:CPU pool), importing this checkout's ``benchmarks`` and writing its records into
    ``RESULTS_DIR``, where the caller reads them back. ``env``: variables to set on top of this process's."""
    root = str(Path(__file__).resolve().parent.parent)
    child_env = {**os.environ, **(env or {}), RESULTS_ENV: str(RESULTS_DIR),
                 "PYTHONPATH": root + (os.pathsep + os.environ["PYTHONPATH"] if os.environ.get("PYTHONPATH") else "")}
    cmd = [sys.executable, "-m", f"benchmarks.bench_{workload}", *args]
    log_line(f"{workload}: {why}; running `{' '.join(cmd[1:])}` in a subprocess")
    subprocess.run(cmd, env=child_env, check=True)


def log_line(msg: str) -> None:
    print(f"[{time.perf_counter() - _T0:6.1f}s] {msg}", flush=True)


def mem_available_bytes() -> Optional[int]:
    """MemAvailable of /proc/meminfo (memory the kernel can hand out without swapping), or None."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def release_all(contenders) -> None:
    """Free contenders' buffers now: each drops (JAX: deletes) its arrays, then a full collection, frozen objects
    included (``trim_memory`` freezes survivors, which would otherwise keep reference cycles alive)."""
    for c in contenders:
        try:
            c.release()
        except Exception as exc:  # pragma: no cover - releasing must never fail a run
            log_line(f"   release of {getattr(c, 'name', c)} failed: {exc}")
    gc.unfreeze()
    trim_memory()


def run_workload(workload: str, description: str, spec: dict, settings: Settings, entries: list[Entry],
                 metrics: list[Metric], *, pools: dict, notes: Optional[dict] = None,
                 out_path: Optional[Path] = None, groups: Optional[list[Group]] = None,
                 goals: Optional[list[Goal]] = None, env_extra: Optional[dict] = None,
                 memory_headroom: float = 1.25) -> list[dict]:
    """Build, fill, time and report one workload. Returns the records (also written as JSON lines).

    Without ``groups`` every entry is built and all are timed together (one group). Before each build the free
    memory is checked: a contender whose buffer (``memory_headroom`` x raw bytes + 512 MiB) does not fit in
    MemAvailable is reported unavailable instead of pushing a shared machine into the OOM killer."""
    from benchmarks import peers

    configure_runtime(workload)
    warm_runtimes()
    load_start = list(os.getloadavg())
    notes = dict(notes or {})
    item = peers.item_bytes(spec)
    raw = settings.capacity * item
    # a smoke run copies 64 MiB (still 4x the 32 MiB L3 of this host, source and destination together 8x)
    meter = MemcpyMeter(64 << 20 if settings.quick else 256 << 20)
    meter.measure(3 if settings.quick else 5)
    log = CompileLog()
    log_line(f"== {workload}: {description}")
    log_line(f"   capacity {settings.capacity:,}, item {item} B, raw {raw / 2**20:.1f} MiB; memcpy "
             f"{meter.bytes_per_s / 1e9:.2f} GB/s (np.copyto of {meter.nbytes >> 20} MiB); rounds {settings.rounds}")
    grouped = groups is not None
    if groups is None:
        groups = [Group("", entries, metrics)]

    unavailable: dict[str, str] = {}
    memory_records: list[dict] = []
    measured = []  # (metric, name, timings, extra) until the last memcpy reading is in
    first_calls: dict[tuple[str, str], float] = {}  # (contender, metric) -> first call s (carried contenders)
    first_compiles: dict[tuple[str, str], CompileStats] = {}
    chunks = pools["chunks"]
    carried: dict[str, Any] = {}
    fill_first: dict[str, float] = {}
    for group in groups:
        gname = group.label or None
        if grouped:
            log_line(f"   -- group {group.label}")
        built: dict[str, Any] = {}
        for entry in group.entries:
            if entry.label in carried:
                built[entry.label] = carried.pop(entry.label)
                continue
            if entry.derived:
                try:
                    c = entry.make(built)
                except peers.Unavailable as exc:
                    unavailable[entry.label] = str(exc)
                    log_line(f"   {entry.label}: UNAVAILABLE: {exc}")
                    continue
                c.name = entry.label
                built[entry.label] = c
                continue
            free = mem_available_bytes()
            need = memory_headroom * raw + (512 << 20)
            if free is not None and free < need:
                why = (f"not built: {free / 2**30:.1f} GiB available, its buffer needs ~{need / 2**30:.1f} GiB "
                       f"({memory_headroom} x raw + 512 MiB); rerun with a smaller --capacity")
                unavailable[entry.label] = why
                log_line(f"   {entry.label}: SKIPPED: {why}")
                continue
            start = time.perf_counter()
            try:
                with RssMonitor() as mon:
                    with log.phase(entry.label, "construct"):
                        c = entry.make()
                    c.name = entry.label
                    prepared = [c.prepare(b) for b in chunks]
                    first_add = time_first_call(lambda: c.add(prepared[0]), log, entry.label, "fill/first")
                    written = settings.chunk
                    fill_start = time.perf_counter()
                    with log.phase(entry.label, "fill"):
                        i = 1
                        while written < settings.capacity:
                            c.add(prepared[i % len(prepared)])
                            written += settings.chunk
                            i += 1
                    fill_s = time.perf_counter() - fill_start
            except peers.Unavailable as exc:
                unavailable[entry.label] = str(exc)
                log_line(f"   {entry.label}: UNAVAILABLE: {exc}")
                continue
            built[entry.label] = c
            c._prepared = prepared
            fill_first[entry.label] = first_add
            memory_records.append({
                "record": "memory", "workload": workload, "contender": entry.label,
                **({"group": gname} if grouped else {}),
                "raw_bytes": raw, "state_bytes": c.state_bytes(),
                "rss_delta_bytes": mon.delta, "rss_peak_delta_bytes": mon.peak_delta,
                "rss_over_raw": mon.delta / raw, "peak_over_raw": mon.peak_delta / raw,
                "fill_s": fill_s, "fill_items_per_s": (written - settings.chunk) / max(fill_s, 1e-9),
                "first_add_s": first_add, "setup_s": time.perf_counter() - start,
                "construct_compile": vars(log.get(entry.label, "construct")),
                **{f"note_{k}": v for k, v in c.notes().items()},
            })
            log_line(f"   built {entry.label}: filled {written:,} items in {fill_s:.2f} s, first add {first_add:.3f} s"
                     f", RSS +{mon.delta / 2**20:.0f} MiB (peak +{mon.peak_delta / 2**20:.0f} MiB)")

        suffix = f"@{group.label}" if grouped else ""
        for metric in (group.metrics if group.metrics is not None else metrics):
            ops = {name: metric.make_op(c, pools) for name, c in built.items() if metric.applies(c)}
            if not ops:
                continue
            first_phase = "fill/first" if metric.first_from_fill else f"{metric.name}/first"
            for name, op in ops.items():  # first call apart: tracing, compilation, first touch
                key = (name, metric.name)
                if key in first_calls:
                    continue  # a carried contender: its first call was in an earlier group
                if metric.first_from_fill and name in fill_first:
                    first_calls[key] = fill_first[name]
                else:
                    first = op if metric.first_calls == 1 else (
                        lambda op=op, calls=metric.first_calls: [op() for _ in range(calls)])
                    first_calls[key] = time_first_call(first, log, name, first_phase)
                first_compiles[key] = log.get(name, first_phase)
            log_line(f"   timing {metric.name}: {len(ops)} contenders x {settings.rounds} rounds x {metric.reps} "
                     f"calls")
            steady_phase = f"{metric.name}/steady{suffix}"
            timings = interleaved(ops, rounds=settings.rounds, reps=metric.reps, log=log, phase=steady_phase)
            if not settings.quick:  # a smoke run reads memcpy at the start and the end only
                meter.measure(3)
            for name, t in timings.items():
                c = built[name]
                compiled = first_compiles[(name, metric.name)]
                steady = log.get(name, steady_phase, steady_phase + "-warmup")
                measured.append((metric, name, t, dict(
                    **({"group": gname} if grouped else {}),
                    first_call_s=first_calls[(name, metric.name)],
                    compile_s=compiled.seconds if c.is_jax else None,
                    compiles=compiled.compiles if c.is_jax else None,
                    recompiles=steady.compiles if c.is_jax else None,
                    jit_cache_entries=c.jit_cache_entries(),
                    rate_unit=metric.rate_unit,
                    **metric.extra,
                )))
        for rec in memory_records:
            if rec["contender"] in built and "jit_cache_entries" not in rec:
                rec["jit_cache_entries"] = built[rec["contender"]].jit_cache_entries()
        carried = {label: built.pop(label) for label in group.keep if label in built}
        if grouped or group is groups[-1]:
            release_all(list(built.values()))
        built.clear()
    if carried:
        release_all(list(carried.values()))
    if settings.quick:
        meter.measure(3)

    bps = meter.bytes_per_s
    records: list[dict] = [
        timing_record(workload, metric.name, name, t, items_per_call=metric.items_per_call,
                      bytes_per_call=metric.bytes_per_call or metric.items_per_call * item, memcpy_bps=bps, **extra)
        for metric, name, t, extra in measured]
    records.extend(memory_records)
    for label, why in unavailable.items():
        records.append({"record": "unavailable", "workload": workload, "contender": label, "reason": why})
    add_ratios(records)
    goal_records = evaluate_goals(records, goals or [], workload)
    records.extend(goal_records)

    memcpy = meter.record()
    log_line(f"   memcpy readings: median {bps / 1e9:.2f} GB/s, range {meter.nbytes / memcpy['max_s'] / 1e9:.2f}-"
             f"{meter.nbytes / memcpy['min_s'] / 1e9:.2f} GB/s over {memcpy['readings']} copies")
    env = environment(memcpy, {"workload": workload, "description": description, "settings": vars(settings),
                               "notes": notes, **(env_extra or {})})
    env["load_average_end"] = env["load_average"]
    env["load_average"] = load_start
    path = out_path or RESULTS_DIR / (f"{workload}.quick.jsonl" if settings.quick else f"{workload}.jsonl")
    write_jsonl(path, env, records)

    print()
    seen = []
    for group in groups:
        for metric in (group.metrics if group.metrics is not None else metrics):
            if metric.name in seen:
                continue
            seen.append(metric.name)
            table = timing_table(records, metric.name, f"{workload} {metric.title}  (memcpy {bps / 1e9:.2f} GB/s; "
                                 f"x/conduit = contender time / conduit time"
                                 f"{' of the same group' if grouped else ''})", metric.rate_unit)
            if table:
                print(table + "\n")
    print(memory_table(records, f"{workload} memory (raw = capacity x {item} B item; RSS measured around "
                                f"construct + fill, compile memory included)") + "\n")
    for label, why in unavailable.items():
        print(f"{label}: {why}")
    for key, value in notes.items():
        print(f"note {key}: {value}")
    if goal_records:
        print(f"{workload} goals (issue 7):\n{goal_lines(goal_records)}")
    print(f"load average start {env['load_average']} end {env['load_average_end']}; results: {path}")
    return records
