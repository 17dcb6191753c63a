"""W1 / W2 / W3 with Conduit's state in device memory (HBM), pinned host, unpinned host memory and split (the ring in
pinned host, the index and counters in HBM: the planner's hot/cold split), for one NVIDIA GPU (prepared for an H200):
``python -m benchmarks.gpu [--quick] [--only w1,w3] [--budget-s 420]``.

One short call: the full run is sized to finish in about 6 minutes on an H200 (``--budget-s`` stops starting new
measurements once spent and says what was skipped). Never required by the tests. On a CPU-only machine
``python -m benchmarks.gpu --quick`` is the smoke test: XLA:CPU exposes the same three memory kinds (all the same
DRAM), so every code path runs.

For each workload and each memory kind a Conduit plane (1 device) is built and filled in device memory, then its
state is moved to the kind with ``plane.place(shardings)`` (the move is timed), and add / sample (W2: sample + update
priorities) are timed in interleaved rounds with the GPU peers:
``numpy+device_put`` (a host NumPy ring whose batch is copied to the GPU), ``flashbax`` / ``flashbax-per`` (state in
HBM) and ``cpprb-per`` (host, reference) where those libraries are installed. Every call ends with
``block_until_ready``. Each record says where the ring rows actually were after the timing (``actual_memory_kind``):
a kind the plane does not keep is visible, not silently measured as another.

Bytes moved. Each Conduit record carries ``bytes_to_device_per_sample``: what its sample kernel moves from host to
device memory per call, read from the kernel lowered for CUDA (``engine.memory_moves``), beside the batch's own bytes.
A ring in pinned host memory is gathered in place by a host computation, so only the batch crosses; an index in host
memory (``pinned_host`` / ``unpinned_host`` kinds, the whole state moved) is moved whole per call, which is what
``split`` avoids.

Beyond the device budget (``--only beyond``): in a subprocess whose GPU allocator is capped by
``XLA_PYTHON_CLIENT_MEM_FRACTION``, a plane planned with ``placement.Topology.detect()`` for a ring about twice the
cap: the planner spills the ring to pinned host memory and the plane fills and samples it.

Figures go to ``benchmarks/results/gpu_<workload>.jsonl`` (``gpu_<workload>.quick.jsonl`` with ``--quick``): the
environment line (GPU name, memory stats, versions) first, then timing / memory / unavailable records in the format
of the CPU suite; ratios are against ``conduit[device]`` of the same run. Environment on the H200 machine: its
``python3`` has jax with the CUDA plugin (0.11.x where this project pins <0.11: carry jax/jaxlib/plugin 0.10.x wheels
if 0.11 breaks an API); flashbax and cpprb are not installed there (carry wheels or accept "unavailable" rows).
"""

from __future__ import annotations

import argparse
import itertools
import os
import sys
import time
import traceback
from typing import Any, Optional

import numpy as np

from benchmarks import common, peers
from benchmarks.bench_w1 import W1_SPEC
from benchmarks.bench_w3 import W3_SPEC

KINDS = ("device", "pinned_host", "unpinned_host", "split")
PER = peers.PER(alpha=0.6, beta=0.4, eps=1e-6)
WORKLOADS = {
    # name: (spec, full capacity, quick capacity, chunk, batch sizes, prioritized)
    "w1": (W1_SPEC, 1_000_000, 20_000, 1000, (256,), False),
    "w2": (W1_SPEC, 1_000_000, 20_000, 1000, (256,), True),
    "w3": (W3_SPEC, 100_000, 1_000, 100, (256, 32), False),
}


# ------------------------------------------------------------------------------------------------------------------
# Conduit with its state in a memory kind
# ------------------------------------------------------------------------------------------------------------------
class ConduitIn(peers.Conduit):
    """A 1-device Conduit plane whose state lives in ``kind`` memory after ``place()``; filled before that in device
    memory (a fill through host-resident state would move the whole ring per ingest on a GPU)."""

    def __init__(self, spec, capacity: int, batch_size: int, kind: str, per: Optional[peers.PER] = None,
                 chunk: int = 1000):
        super().__init__(spec, capacity, batch_size, per=per, devices=1, chunk=chunk)
        self.spec, self.kind = spec, kind
        self.place_s: Optional[float] = None

    def place(self) -> None:
        import jax

        plane = self.plane
        from conduit_jax.placement import with_part_in

        if self.kind == "split":  # the ring in pinned host memory, the rest where it is (device)
            target = with_part_in(plane.shardings, "storage", "pinned_host")
        else:
            target = jax.tree_util.tree_map(lambda s: s.with_memory_kind(self.kind), plane.shardings)
        start = time.perf_counter()
        plane.place(target)
        plane.block_until_ready()
        self.place_s = time.perf_counter() - start

    def actual_kinds(self) -> dict[str, Any]:
        state = self.plane.state
        rows = state.storage.rows.sharding.memory_kind
        import jax

        others = sorted({leaf.sharding.memory_kind for leaf in jax.tree_util.tree_leaves(state.sampler)})
        return {"rows": rows, "sampler": others}

    def notes(self) -> dict[str, Any]:
        out = super().notes()
        out.update({"requested_memory_kind": self.kind, "place_s": self.place_s})
        try:
            from conduit_jax.engine import memory_moves

            moved = memory_moves(self.plane.engine.lowered("sample", platform="cuda").as_text())
            out["bytes_to_device_per_sample"] = sum(size for kind, size in moved if kind == "device")
            out["batch_bytes"] = self.plane.batch_size * peers.item_bytes(self.spec)
        except Exception as exc:  # pragma: no cover
            out["bytes_to_device_per_sample"] = f"unknown ({exc})"
        try:
            out["memory_kinds_after_fill"] = self.actual_kinds()
        except Exception as exc:  # pragma: no cover
            out["memory_kinds_after_fill"] = f"unknown ({exc})"
        return out


# ------------------------------------------------------------------------------------------------------------------
# Probes: which operations work with the state in a memory kind. Run in a subprocess: with some kinds XLA aborts the
# process (an absl fatal error, not a Python exception), which must not end the whole run.
# ------------------------------------------------------------------------------------------------------------------
PROBE_OPS = ("add", "sample", "per_cycle")


def _probe_here(kind: str) -> dict[str, Optional[str]]:
    """In this process: a small plane in ``kind`` memory; each operation once. None = worked, else the error."""
    import jax

    out: dict[str, Optional[str]] = {}
    rng = np.random.default_rng(0)
    chunk = peers.random_batch(W1_SPEC, 64, rng)
    for per in (False, True):
        c = ConduitIn(W1_SPEC, 1024, 64, kind, per=PER if per else None, chunk=64)
        for _ in range(4):
            c.add(chunk)
        c.place()
        ops = {"add": lambda: c.add(chunk)} if not per else {}
        if per:
            prio = jax.device_put(np.ones(64, np.float32))
            ops["per_cycle"] = lambda: c.update_priorities(c.sample(64).ids, prio)
        else:
            ops["sample"] = lambda: c.sample(64)
        for op_name, op in ops.items():
            try:
                op()
                op()
                out[op_name] = None
            except Exception as exc:
                out[op_name] = f"{type(exc).__name__}: {str(exc)[:400]}"
            print(f"PROBE {op_name} {'ok' if out[op_name] is None else 'error'}", flush=True)
        c.release()
    return out


def probe_kind(kind: str, timeout_s: float = 120.0) -> dict[str, Optional[str]]:
    """``_probe_here`` in a subprocess; an operation that aborted the process is reported with its last words."""
    import json
    import os
    import subprocess

    if kind == "device":
        return {op: None for op in PROBE_OPS}
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, PYTHONPATH=root + (os.pathsep + os.environ["PYTHONPATH"]
                                               if os.environ.get("PYTHONPATH") else ""))
    try:
        proc = subprocess.run([sys.executable, "-m", "benchmarks.gpu", "--probe", kind], capture_output=True,
                              text=True, timeout=timeout_s, env=env)
    except subprocess.TimeoutExpired:
        return {op: f"probe timed out after {timeout_s:.0f} s" for op in PROBE_OPS}
    for line in proc.stdout.splitlines():
        if line.startswith("PROBE-RESULT "):
            return json.loads(line[len("PROBE-RESULT "):])
    done = [line.split()[1] for line in proc.stdout.splitlines() if line.startswith("PROBE ")]
    last = (proc.stderr.strip().splitlines() or ["(no output)"])[-1][:400]
    out: dict[str, Optional[str]] = {}
    for op in PROBE_OPS:
        if op in done:
            out[op] = None
        elif not any(v is not None and v.startswith("process aborted") for v in out.values()):
            out[op] = f"process aborted (exit {proc.returncode}) during this operation: {last}"
        else:
            out[op] = "not reached (the probe process aborted earlier)"
    return out


# ------------------------------------------------------------------------------------------------------------------
# Beyond the device budget: a subprocess whose allocator is capped, a ring about twice the cap
# ------------------------------------------------------------------------------------------------------------------
BEYOND_FRACTION = 0.05  # of the GPU's memory: ~7 GB of an H200's 141 GB


def _beyond_here(quick: bool) -> dict[str, Any]:
    import jax

    from conduit_jax import ExperienceDataPlane, placement, samplers

    spec = {name: jax.ShapeDtypeStruct(shape, dtype) for name, (shape, dtype) in W1_SPEC.items()}
    row = peers.item_bytes(W1_SPEC)
    if jax.default_backend() == "cpu":  # smoke run: an emulated 1 MB device budget
        topology, budget = placement.emulated_cpu(1, device_memory=1 << 20), 1 << 20
    else:
        topology = placement.Topology.detect()
        budget = topology.memories[0].capacity
    capacity = int(min(2 * budget // row, (1 << 31) - 1))
    capacity = min(capacity, 20_000) if quick else capacity
    plan = placement.plan(spec, capacity, topology, placement.Workload(batch_size=256))
    out: dict[str, Any] = {"record": "beyond", "device_budget_bytes": int(budget), "capacity": capacity,
                           "ring_bytes": capacity * row, "plan_storage": plan.placement.storage,
                           "plan_index": plan.placement.index, "plan": plan.explain()}
    plane = ExperienceDataPlane(spec, capacity, samplers.uniform(256), plan=plan)
    chunk = peers.random_batch(W1_SPEC, 8192, np.random.default_rng(0))
    start = time.perf_counter()
    for _ in range(-(-capacity // 8192)):
        plane.ingest(chunk)
    plane.block_until_ready()
    out["fill_s"] = time.perf_counter() - start
    jax.block_until_ready(plane.sample())
    times = []
    for _ in range(50):
        t0 = time.perf_counter()
        jax.block_until_ready(plane.sample())
        times.append(time.perf_counter() - t0)
    out.update(sample_b256_median_s=float(np.median(times)), rows_memory_kind=plane.state.storage.rows.sharding
               .memory_kind, size=len(plane))
    return out


def beyond_device(quick: bool, timeout_s: float = 300.0) -> dict[str, Any]:
    """``_beyond_here`` in a subprocess with the GPU allocator capped at ``BEYOND_FRACTION``."""
    import json
    import subprocess

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, XLA_PYTHON_CLIENT_MEM_FRACTION=str(BEYOND_FRACTION), XLA_PYTHON_CLIENT_PREALLOCATE="false",
               PYTHONPATH=root + (os.pathsep + os.environ["PYTHONPATH"] if os.environ.get("PYTHONPATH") else ""))
    try:
        proc = subprocess.run([sys.executable, "-m", "benchmarks.gpu", "--beyond-child"] + (["--quick"] if quick
                                                                                            else []),
                              capture_output=True, text=True, timeout=timeout_s, env=env)
    except subprocess.TimeoutExpired:
        return {"record": "unavailable", "workload": "gpu_beyond", "reason": f"timed out after {timeout_s:.0f} s"}
    for line in proc.stdout.splitlines():
        if line.startswith("BEYOND-RESULT "):
            return json.loads(line[len("BEYOND-RESULT "):])
    last = (proc.stderr.strip().splitlines() or ["(no output)"])[-1][:600]
    return {"record": "unavailable", "workload": "gpu_beyond", "reason": f"exit {proc.returncode}: {last}"}


# ------------------------------------------------------------------------------------------------------------------
# Measurements
# ------------------------------------------------------------------------------------------------------------------
def device_copy_bandwidth(nbytes: int = 1 << 30, reps: int = 5) -> dict[str, Any]:
    """Bytes per second of a jitted elementwise copy (x + 1, u8) on the default device, counting bytes read and
    written (the convention of device-to-device copy figures)."""
    import jax
    import jax.numpy as jnp

    x = jax.device_put(np.zeros(nbytes, np.uint8))
    f = jax.jit(lambda a: a + jnp.uint8(1))
    jax.block_until_ready(f(x))
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        jax.block_until_ready(f(x))
        times.append(time.perf_counter() - start)
    del x
    med = float(np.median(times))
    return {"bytes": nbytes, "median_s": med, "bytes_per_s_read_plus_write": 2 * nbytes / med, "readings_s": times}


def gpu_info() -> dict[str, Any]:
    import jax

    d = jax.devices()[0]
    info: dict[str, Any] = {"device_kind": getattr(d, "device_kind", None), "platform": d.platform}
    try:
        info["memory_stats"] = {k: v for k, v in (d.memory_stats() or {}).items()
                                if k in ("bytes_limit", "bytes_in_use", "peak_bytes_in_use")}
    except Exception as exc:
        info["memory_stats"] = f"unavailable ({exc})"
    return info


def interleaved_budget(ops: dict, reps: dict, rounds: int, log: common.CompileLog, phase: str) -> dict:
    """``common.interleaved`` with a repetition count per contender (host-memory kinds can be 100x slower)."""
    import gc

    names = list(ops)
    out = {n: common.Timings() for n in names}
    for r in range(rounds):
        shift = r % len(names)
        for name in names[shift:] + names[:shift]:
            op, times = ops[name], np.empty(reps[name])
            gc.collect()
            gc.disable()
            try:
                with log.phase(name, phase):
                    for i in range(reps[name]):
                        start = time.perf_counter()
                        op()
                        times[i] = time.perf_counter() - start
            finally:
                gc.enable()
            out[name].rounds.append(times)
    return out


def run_workload(name: str, quick: bool, kinds, deadline: float, rounds: int, metric_budget_s: float,
                 max_reps: int, probes: dict) -> tuple[list[dict], common.MemcpyMeter]:
    import jax

    spec, capacity, quick_capacity, chunk, batches, per = WORKLOADS[name]
    capacity = quick_capacity if quick else capacity
    item = peers.item_bytes(spec)
    rng = np.random.default_rng(11)
    chunks = [peers.random_batch(spec, chunk, rng) for _ in range(4 if quick else 8)]
    meter = common.MemcpyMeter(64 << 20 if quick else 256 << 20)
    meter.measure(3)
    log = common.CompileLog()
    common.log_line(f"== gpu {name}: capacity {capacity:,}, item {item} B, batches {batches}, "
                    f"{'PER' if per else 'uniform'}, kinds {list(kinds)}, backend {jax.default_backend()}")

    # -- build and fill --------------------------------------------------------------------------------------------
    makers: list[tuple[str, Any]] = []
    for kind in kinds:
        makers.append((f"conduit[{kind}]", lambda kind=kind: ConduitIn(spec, capacity, batches[0], kind,
                                                                       per=PER if per else None, chunk=chunk)))
    if name == "w3":  # a plane samples one batch size: the b32 plane only in device memory (time budget)
        makers.append(("conduit[device,b32]", lambda: ConduitIn(spec, capacity, 32, "device", chunk=chunk)))
    if per:
        makers += [("flashbax-per", lambda: peers.FlashbaxPER(spec, capacity, batches[0], per=PER)),
                   ("cpprb-per(host)", lambda: peers.CpprbPER(spec, capacity, batches[0], per=PER))]
    else:
        makers += [("numpy", lambda: peers.NumpyRing(spec, capacity, batches[0])),
                   ("flashbax", lambda: peers.FlashbaxUniform(spec, capacity, batches[0]))]
    built: dict[str, Any] = {}
    records: list[dict] = []
    for label, make in makers:
        if time.perf_counter() > deadline:
            records.append({"record": "unavailable", "workload": name, "contender": label,
                            "reason": "skipped: the --budget-s time was spent"})
            continue
        try:
            start = time.perf_counter()
            with log.phase(label, "construct"):
                c = make()
            c.name = label
            prepared = [c.prepare(b) for b in chunks]
            written, i = 0, 0
            with log.phase(label, "fill"):
                while written < capacity:
                    c.add(prepared[i % len(prepared)])
                    written += chunk
                    i += 1
            fill_s = time.perf_counter() - start
            if isinstance(c, ConduitIn):
                c.place()
            c._prepared = prepared
            built[label] = c
            records.append({"record": "memory", "workload": name, "contender": label, "raw_bytes": capacity * item,
                            "state_bytes": c.state_bytes(), "fill_s": fill_s,
                            "construct_compile": vars(log.get(label, "construct")),
                            **{f"note_{k}": v for k, v in c.notes().items()}})
            common.log_line(f"   built {label}: {fill_s:.2f} s" + (f", moved to {c.kind} in {c.place_s:.3f} s"
                                                                     if isinstance(c, ConduitIn) else ""))
        except Exception as exc:
            why = f"{type(exc).__name__}: {exc}"
            records.append({"record": "unavailable", "workload": name, "contender": label, "reason": why[:600]})
            common.log_line(f"   {label}: UNAVAILABLE: {why[:300]}")
    if not built:
        return records, meter

    # -- metrics ---------------------------------------------------------------------------------------------------
    pools_prio = [np.abs(rng.standard_normal(batches[0])).astype(np.float32) for _ in range(16)]

    def add_op(c):
        counter, prepared = itertools.count(), c._prepared
        return lambda: c.add(prepared[next(counter) % len(prepared)])

    def sample_op(c, b):
        return lambda: c.sample(b)

    def cycle_op(c, b):
        prepared = [c.prepare_priorities(p) for p in pools_prio]
        counter = itertools.count()

        def step():
            out = c.sample(b)
            c.update_priorities(out.ids, prepared[next(counter) % len(prepared)])

        return step

    def samples_at(c, b):
        if isinstance(c, ConduitIn):
            return c.batch_size == b
        return True

    metrics = [(f"add_chunk{chunk}", chunk, lambda c: isinstance(c, ConduitIn) and c.batch_size == batches[0]
                or not isinstance(c, ConduitIn), add_op)]
    for b in batches:
        if per:
            metrics.append((f"per_cycle_b{b}", b, lambda c, b=b: samples_at(c, b), lambda c, b=b: cycle_op(c, b)))
        else:
            metrics.append((f"sample_b{b}", b, lambda c, b=b: samples_at(c, b), lambda c, b=b: sample_op(c, b)))
    measured = []
    for metric, items, applies, make_op in metrics:
        if time.perf_counter() > deadline:
            records.append({"record": "unavailable", "workload": name, "contender": "*", "metric": metric,
                            "reason": "skipped: the --budget-s time was spent"})
            continue
        ops, reps, first = {}, {}, {}
        probe_op = "add" if metric.startswith("add") else "per_cycle" if metric.startswith("per") else "sample"
        for label, c in built.items():
            if not applies(c):
                continue
            why = probes.get(c.kind, {}).get(probe_op) if isinstance(c, ConduitIn) else None
            if why:
                records.append({"record": "unavailable", "workload": name, "contender": label, "metric": metric,
                                "reason": f"probe: {why}"[:600]})
                continue
            try:
                op = make_op(c)
                first[label] = common.time_first_call(op, log, label, f"{metric}/first")
                second = common.time_first_call(op, None, label, "")
                reps[label] = int(np.clip(metric_budget_s / rounds / max(len(built), 1) / max(second, 1e-6), 2,
                                          max_reps))
                ops[label] = op
            except Exception as exc:
                why = f"{type(exc).__name__}: {exc}"
                records.append({"record": "unavailable", "workload": name, "contender": label, "metric": metric,
                                "reason": why[:600]})
                common.log_line(f"   {label} {metric}: FAILED: {why[:300]}")
        if not ops:
            continue
        common.log_line(f"   timing {metric}: {len(ops)} contenders x {rounds} rounds, reps {reps}")
        timings = interleaved_budget(ops, reps, rounds, log, f"{metric}/steady")
        for label, t in timings.items():
            c = built[label]
            extra = {"first_call_s": first[label], "reps_per_round": reps[label],
                     "compile_s": log.get(label, f"{metric}/first").seconds if c.is_jax else None,
                     "recompiles": log.get(label, f"{metric}/steady").compiles if c.is_jax else None}
            if isinstance(c, ConduitIn):
                extra["requested_memory_kind"] = c.kind
                extra["actual_memory_kind"] = c.actual_kinds()
            measured.append((metric, label, t, items, extra))
    meter.measure(3)
    for metric, label, t, items, extra in measured:
        records.append(common.timing_record(f"gpu_{name}", metric, label, t, items_per_call=items,
                                            bytes_per_call=items * item, memcpy_bps=meter.bytes_per_s, **extra))
    common.add_ratios(records)
    for c in built.values():
        c.release()
    return records, meter


def print_table(records: list[dict], name: str) -> None:
    rows = [r for r in records if r.get("record") == "timing"]
    print(f"\ngpu {name}: (x/conduit = contender time / conduit[device] time; memcpy = host np.copyto bandwidth)")
    print(f"{'metric':<16} {'contender':<26} {'median us':>10} {'p99 us':>10} {'calls':>6} {'x/conduit':>9} "
          f"{'host memcpy':>11} {'rows in':>14}")
    for r in rows:
        kinds = r.get("actual_memory_kind") or {}
        ratio = "" if r.get("x_over_conduit") is None else f"{r['x_over_conduit']:.2f}x"
        print(f"{r['metric']:<16} {r['contender']:<26} {r['median_s'] * 1e6:>10.1f} {r['p99_s'] * 1e6:>10.1f} "
              f"{r['n']:>6} {ratio:>9} {r['frac_memcpy'] * 100:>10.1f}% {kinds.get('rows', ''):>14}")
    for r in records:
        if r.get("record") == "unavailable":
            print(f"  {r['contender']}{' ' + r['metric'] if r.get('metric') else ''}: {r['reason']}")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="small sizes (smoke test; runs on CPU)")
    parser.add_argument("--only", default="w1,w2,w3,beyond")
    parser.add_argument("--kinds", default=",".join(KINDS))
    parser.add_argument("--budget-s", type=float, default=None,
                        help="stop starting measurements after this many seconds (default 420, quick 60)")
    parser.add_argument("--rounds", type=int, default=None)
    parser.add_argument("--probe", metavar="KIND", help=argparse.SUPPRESS)  # internal: probe_kind's subprocess
    parser.add_argument("--beyond-child", action="store_true", help=argparse.SUPPRESS)  # internal: beyond_device
    args = parser.parse_args(argv)
    # the GPU's runtime is not the CPU client's pool: leave XLA's own thread choice unless asked otherwise
    os.environ.setdefault(common.XLA_THREADS_ENV, "default")
    if args.probe:
        import json

        common.configure_runtime()
        print("PROBE-RESULT " + json.dumps(_probe_here(args.probe)), flush=True)
        return 0
    if args.beyond_child:
        import json

        common.configure_runtime()
        print("BEYOND-RESULT " + json.dumps(_beyond_here(args.quick)), flush=True)
        return 0
    start = time.perf_counter()
    budget = args.budget_s if args.budget_s is not None else (60.0 if args.quick else 420.0)
    deadline = start + budget
    rounds = args.rounds or (2 if args.quick else 5)
    metric_budget = 1.0 if args.quick else 12.0  # seconds of timed calls per metric, all contenders together
    max_reps = 20 if args.quick else 400

    common.configure_runtime()
    import jax

    kinds = [k.strip() for k in args.kinds.split(",") if k.strip()]
    available = sorted({m.kind for m in jax.devices()[0].addressable_memories()})
    offered = set(available) | ({"split"} if "pinned_host" in available else set())
    missing = [k for k in kinds if k not in offered]
    kinds = [k for k in kinds if k in offered]
    common.log_line(f"gpu.py: backend {jax.default_backend()}, devices {jax.devices()}, memory kinds {available}"
                    + (f"; not offered here: {missing}" if missing else ""))
    if jax.default_backend() != "gpu":
        common.log_line("gpu.py: no GPU backend: this is a smoke run of the code paths, not a GPU measurement")
    device_bw = device_copy_bandwidth(64 << 20 if args.quick else 1 << 30)
    probes = {}
    for kind in kinds:
        probes[kind] = probe_kind(kind)
        broken = {op: why for op, why in probes[kind].items() if why}
        common.log_line(f"probe {kind}: " + ("every operation works" if not broken else
                                              "; ".join(f"{op}: {why[:200]}" for op, why in broken.items())))
    failed = []
    for name in [w.strip() for w in args.only.split(",") if w.strip()]:
        if name == "beyond":
            record = beyond_device(args.quick)
            common.log_line(f"beyond the device budget: {record}")
            meter = common.MemcpyMeter(64 << 20)
            meter.measure(3)
            env = common.environment(meter.record(), {
                "workload": "gpu_beyond", "description": "a ring about twice the capped device memory, planned "
                                                         "with Topology.detect()", "gpu": gpu_info()})
            common.write_jsonl(common.RESULTS_DIR / f"gpu_beyond{'.quick' if args.quick else ''}.jsonl", env,
                               [record])
            continue
        if name not in WORKLOADS:
            parser.error(f"--only: {name} is not one of {sorted(WORKLOADS)}")
        try:
            out = run_workload(name, args.quick, kinds, deadline, rounds, metric_budget, max_reps, probes)
        except Exception:
            traceback.print_exc()
            failed.append(name)
            continue
        records, meter = out
        env = common.environment(meter.record(), {
            "workload": f"gpu_{name}", "description": f"{name} with Conduit's state in {kinds}",
            "gpu": gpu_info(), "device_copy": device_bw, "memory_kinds_requested": kinds,
            "memory_kinds_missing": missing, "quick": args.quick, "budget_s": budget, "probes": probes})
        path = common.RESULTS_DIR / (f"gpu_{name}.quick.jsonl" if args.quick else f"gpu_{name}.jsonl")
        common.write_jsonl(path, env, records)
        print_table(records, name)
        print(f"results: {path}")
        common.release_all([])
    print(f"\ngpu.py finished in {time.perf_counter() - start:.1f} s (budget {budget:.0f} s)"
          + (f"; FAILED: {', '.join(failed)}" if failed else ""))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
