"""Host-fed loops: the experience path of a learner fed from host code, under every schedule, against a NumPy ring.

Two loops, each through the plane's public API only, in interleaved rounds in one process:

* **dqn loop** (``--loop dqn``): per iteration 4 ingests of 32 DQN transitions (obs f32[8], action i32, reward f32,
  done bool, next_obs f32[8]), ``deliver()`` of a uniform batch of 128, and a jitted learner step of about 1 ms on
  it (an MLP, blocked on). Per schedule (``sync``, ``staged``, ``overlap``, ``deferred``, ``adaptive``): the exposed
  path (the learner thread's time in ``ingest`` + ``deliver``) and the iteration, and against ``sync`` the exposed
  cut and the iteration time saved in units of sync's exposed path.
* **tight loop** (``--loop tight``): "ingest 32, sample 256, batch ready" on a full 262,144-item ring: Conduit under
  ``staged`` (the write rides the draw's kernel) and ``sync`` (a kernel per ingest), and a NumPy ring (per-leaf
  arrays, fancy-index sampling) doing the same; ratios against NumPy.

    python -m benchmarks.bench_hostfed [--loop dqn|tight|both] [--rounds R] [--iterations N] [--quick]

JAX's CPU runtime is configured as the README says for each kind of loop (``runtime.configure_cpu``, once per
process, so ``both`` runs each loop in a process of its own): async dispatch on for the dqn loop (the prefetching
schedules need it), off for the tight loop (a loop that waits for each batch). Results:
``benchmarks/results/hostfed_<loop>.jsonl`` (the environment line, then one record per contender).
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from benchmarks import common

SPEC = {"obs": ((8,), np.float32), "action": ((), np.int32), "reward": ((), np.float32), "done": ((), np.bool_),
        "next_obs": ((8,), np.float32)}
SCHEDULES = ("sync", "staged", "overlap", "deferred", "adaptive")
RESULTS = Path(__file__).parent / "results"


def random_batches(n: int, size: int, seed: int) -> list[dict]:
    rng = np.random.default_rng(seed)
    return [{"obs": rng.standard_normal((size, 8), np.float32), "action": rng.integers(0, 4, size).astype(np.int32),
             "reward": rng.standard_normal(size).astype(np.float32), "done": rng.random(size) < 0.01,
             "next_obs": rng.standard_normal((size, 8), np.float32)} for _ in range(n)]


def _jax_spec():
    import jax

    return {name: jax.ShapeDtypeStruct(shape, dtype) for name, (shape, dtype) in SPEC.items()}


def make_learner(hidden: int, layers: int):
    """A jitted MLP step on the delivered batch, blocked on by reading its loss (what a learner step costs)."""
    import jax
    import jax.numpy as jnp

    key = jax.random.key(0)
    weights = [jax.random.normal(k, (8 if i == 0 else hidden, hidden)) / np.sqrt(hidden)
               for i, k in enumerate(jax.random.split(key, layers))]

    @jax.jit
    def step(weights, obs, reward):
        h = obs
        for w in weights:
            h = jnp.tanh(h @ w)
        return jnp.mean((h.sum(axis=1) - reward) ** 2)

    return lambda data: float(step(weights, data["obs"], data["reward"]))


def dqn_loop(args) -> list[dict]:
    import conduit_jax as cj
    from conduit_jax import schedule

    learner = make_learner(args.hidden, args.layers)
    makers = {"sync": schedule.sync, "staged": schedule.staged, "overlap": lambda: schedule.overlap(2),
              "deferred": lambda: schedule.deferred(2, 2), "adaptive": lambda: schedule.adaptive(4)}
    planes = {name: cj.ExperienceDataPlane(_jax_spec(), 65_536, cj.samplers.uniform(128), schedule=makers[name](),
                                           mesh=cj.default_mesh(1)) for name in SCHEDULES}
    batches = random_batches(64, 32, seed=1)
    rows = {name: [] for name in SCHEDULES}
    counter = {name: 0 for name in SCHEDULES}
    perf = time.perf_counter

    def iterate(name: str, record: bool) -> None:
        plane, i = planes[name], counter[name]
        t0 = perf()
        for k in range(4):
            plane.ingest(batches[(4 * i + k) % len(batches)])
        t1 = perf()
        delivery = plane.deliver(timeout=10.0)
        t2 = perf()
        learner(delivery.data)
        t3 = perf()
        counter[name] += 1
        if record:
            rows[name].append((t1 - t0, t2 - t1, t3 - t2, t3 - t0))

    for name in SCHEDULES:  # fill past the batch size, compile, settle
        for _ in range(args.warmup):
            iterate(name, False)
    for r in range(args.rounds):
        shift = r % len(SCHEDULES)
        for name in SCHEDULES[shift:] + SCHEDULES[:shift]:
            for _ in range(args.iterations):
                iterate(name, True)
    for plane in planes.values():
        plane.close()
    records = []
    sync = np.asarray(rows["sync"]) * 1e6
    sync_exposed = (sync[:, 0] + sync[:, 1]).mean()
    for name in SCHEDULES:
        us = np.asarray(rows[name]) * 1e6
        exposed = us[:, 0] + us[:, 1]
        records.append({
            "record": "loop", "loop": "dqn", "contender": f"conduit[{name}]", "iterations": len(us),
            "ingest_us": {"mean": us[:, 0].mean(), "median": float(np.median(us[:, 0]))},
            "deliver_us": {"mean": us[:, 1].mean(), "median": float(np.median(us[:, 1]))},
            "learner_us": {"mean": us[:, 2].mean(), "median": float(np.median(us[:, 2]))},
            "exposed_us": {"mean": exposed.mean(), "median": float(np.median(exposed))},
            "iteration_us": {"mean": us[:, 3].mean(), "median": float(np.median(us[:, 3]))},
            "exposed_vs_sync": exposed.mean() / sync_exposed,
            "iteration_saved_in_sync_exposed": (sync[:, 3].mean() - us[:, 3].mean()) / sync_exposed,
            "compile_counts": planes[name].compile_counts(),
        })
    return records


def tight_loop(args) -> list[dict]:
    import jax

    import conduit_jax as cj
    from benchmarks import peers
    from conduit_jax import schedule

    capacity, fill = 262_144, random_batches(1, 262_144, seed=2)[0]
    numpy_ring = peers.NumpyRing(SPEC, capacity, 256)
    numpy_ring.add(fill)
    planes = {}
    for name, chosen in (("staged", schedule.staged()), ("sync", schedule.sync())):
        plane = cj.ExperienceDataPlane(_jax_spec(), capacity, cj.samplers.uniform(256), schedule=chosen,
                                       mesh=cj.default_mesh(1))
        plane.ingest(fill)
        plane.block_until_ready()
        planes[name] = plane
    chunks = random_batches(32, 32, seed=3)
    counters = {"numpy": 0, "staged": 0, "sync": 0}

    def numpy_op():
        numpy_ring.add(chunks[counters["numpy"] % len(chunks)])
        counters["numpy"] += 1
        return numpy_ring.sample(256)

    def conduit_op(name):
        plane = planes[name]

        def op():
            plane.ingest(chunks[counters[name] % len(chunks)])
            counters[name] += 1
            return jax.block_until_ready(plane.sample())

        return op

    ops = {"numpy": numpy_op, "conduit[staged]": conduit_op("staged"), "conduit[sync]": conduit_op("sync")}
    timings = common.interleaved(ops, rounds=args.rounds, reps=args.reps, warmup=20)
    summaries = {name: t.summary() for name, t in timings.items()}
    base = summaries["numpy"]["median_s"]
    return [{"record": "loop", "loop": "tight", "contender": name, "median_us": s["median_s"] * 1e6,
             "round_medians_us": [m * 1e6 for m in s["round_medians_s"]], "ratio_vs_numpy": s["median_s"] / base}
            for name, s in summaries.items()]


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--loop", choices=("dqn", "tight", "both"), default="both")
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--iterations", type=int, default=100, help="dqn loop: iterations per schedule per round")
    parser.add_argument("--reps", type=int, default=200, help="tight loop: calls per contender per round")
    parser.add_argument("--warmup", type=int, default=20)
    parser.add_argument("--hidden", type=int, default=512, help="dqn loop: the learner MLP's width")
    parser.add_argument("--layers", type=int, default=2, help="dqn loop: the learner MLP's depth")
    parser.add_argument("--quick", action="store_true", help="2 rounds of few iterations (a smoke run)")
    parser.add_argument("--out", type=Path, default=RESULTS, help="folder of the results files")
    args = parser.parse_args(argv)
    if args.loop == "both":
        settings = [f"--{name}={getattr(args, name)}" for name in ("rounds", "iterations", "reps", "warmup", "hidden",
                                                                  "layers", "out")]
        for loop in ("dqn", "tight"):
            subprocess.run([sys.executable, "-m", "benchmarks.bench_hostfed", f"--loop={loop}", *settings,
                            *(["--quick"] if args.quick else [])], check=True)
        return
    if args.quick:
        args.rounds, args.iterations, args.reps, args.warmup = 2, 10, 20, 5
    from conduit_jax import runtime

    runtime.configure_cpu(async_dispatch=args.loop == "dqn")
    records = dqn_loop(args) if args.loop == "dqn" else tight_loop(args)
    for rec in records:
        if rec["loop"] == "dqn":
            print(f"dqn   {rec['contender']:<19} exposed {rec['exposed_us']['mean']:7.0f} us "
                  f"(ingest {rec['ingest_us']['mean']:5.0f}, deliver {rec['deliver_us']['mean']:5.0f}) "
                  f"iteration {rec['iteration_us']['mean']:7.0f} us  exposed/sync {rec['exposed_vs_sync']:.3f}  "
                  f"iteration saved {rec['iteration_saved_in_sync_exposed']:+.2f}x sync's exposed")
        else:
            print(f"tight {rec['contender']:<19} {rec['median_us']:7.1f} us  {rec['ratio_vs_numpy']:.2f}x numpy")
    env = common.environment(common.memcpy_bandwidth(64 << 20, reps=3),
                             {"workload": f"hostfed_{args.loop}", "args": {k: str(v) for k, v in vars(args).items()},
                              "async_dispatch": args.loop == "dqn"})
    if not args.quick:
        print("written", common.write_jsonl(args.out / f"hostfed_{args.loop}.jsonl", env, records))


if __name__ == "__main__":
    main()
