"""Run the benchmark suite: ``python -m benchmarks.run [--quick] [--only w1,w3] [--emulated-mesh]``.

  --quick          every workload small and few rounds: a CI smoke run, well under a minute on this host; writes
                   benchmarks/results/<workload>.quick.jsonl (and .quick.png) so it never replaces a full run's results
  --only w1,w3     the workloads to run (default: all, w1..w8)
  --emulated-mesh  give the process 8 emulated CPU devices (XLA_FLAGS) so Conduit also runs on the 8-device mesh in
                   W1/W2: a correctness configuration, slower on a 2-core host; the headline row stays on 1 device
  --capacity N, --rounds R   override the sizes of every selected workload (W4's rollout size is fixed; W8's
                   capacity is its token ring, in tokens)
  --no-plots       skip the PNG charts (benchmarks/plots.py; needs matplotlib)
  --results DIR    write the JSON lines (and plots) to DIR instead of benchmarks/results
  --xla-threads N|default   the XLA:CPU intra-op pool of every JAX contender; without it each workload gets its own
                   (one thread; W3, whose calls move megabytes of frames, XLA's default), a workload whose setting
                   differs from the first one's running in a subprocess (the pool is fixed when JAX starts)

Workloads: w1 SAC uniform, w2 SAC PER, w3 Atari frames (batch 256 and 32), w4 PPO epochs, w5 sequences of 32 steps,
w6 W1 on 1/2/4/8 emulated devices (run in a subprocess with XLA_FLAGS unless this process was started with 8 devices,
e.g. ``--only w6`` or ``--emulated-mesh``), w7 a fully jitted DQN loop (env step, add, sample, priority update,
learner step in one ``lax.scan``) with Conduit's functional buffer vs Flashbax's, uniform and PER, on 1 device, and
Conduit alone on 8 emulated devices (in a subprocess: Flashbax has no sharded buffer), w8 LLM-RL rollouts (ingest a
generation of 16 ragged token groups + deliver one learner batch of them, packed or padded, against NumPy, Flashbax,
TorchRL and cpprb; ``--quick``: a pool of 3 generations, 2 rounds of 8 calls). Each workload prints its
tables and goals and writes benchmarks/results/<workload>.jsonl (environment line first). Full sizes take several
minutes per workload on 2 cores: run them one at a time (``--only``) on a shared machine. The exit status is non-zero
when a workload fails (a contender that cannot run here is reported, not a failure).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
import traceback
from pathlib import Path

WORKLOADS = ("w1", "w2", "w3", "w4", "w5", "w6", "w7", "w8")
DEVICE_FLAG = "--xla_force_host_platform_device_count=8"


def w12_goals():
    """Issue 7's goals for W1 and W2, whose scripts predate the goal records: checked here after they run."""
    from benchmarks.common import Goal

    return {
        "w1": [Goal("W1 sample b256 <= 1.0x NumPy", "ratio", "sample_b256", 1.0, peer="numpy"),
               Goal("W1 add (chunks of 1,000) >= NumPy's rows/s (time <= 1.0x)", "ratio", "add_chunk1000", 1.0,
                    peer="numpy"),
               Goal("W1 memory <= 1.05x raw", "memory", None, 1.05),
               Goal("W1 zero recompiles after warm-up (sample b256)", "recompiles", "sample_b256", 0)],
        "w2": [Goal("W2 PER sample + update <= 1.0x cpprb", "ratio", "per_cycle_b256", 1.0, peer="cpprb-per"),
               Goal("W2 memory <= 1.05x raw", "memory", None, 1.05),
               Goal("W2 zero recompiles after warm-up (PER step)", "recompiles", "per_cycle_b256", 0)],
    }


def _in_subprocess(name: str, threads: str, args) -> None:
    """Run workload ``name`` with another XLA:CPU pool (fixed per process), its records where this run writes."""
    from benchmarks import common

    argv = ["--quick"] if args.quick else []
    if args.capacity is not None and name != "w4":  # W4's size is the rollout
        argv += ["--capacity", str(args.capacity)]
    if args.rounds is not None:
        argv += ["--rounds", str(args.rounds)]
    common.run_workload_module(name, argv, f"XLA:CPU pool '{threads}' differs from this process's",
                               {common.XLA_THREADS_ENV: threads})


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--only", default=",".join(WORKLOADS),
                        help=f"comma-separated workloads ({','.join(WORKLOADS)})")
    parser.add_argument("--emulated-mesh", action="store_true")
    parser.add_argument("--capacity", type=int)
    parser.add_argument("--rounds", type=int)
    parser.add_argument("--no-plots", action="store_true")
    parser.add_argument("--xla-threads", default=None, metavar="N|default",
                        help="XLA:CPU intra-op pool threads for the JAX contenders of every workload ('default': one "
                             "per usable CPU, XLA's own choice); without it each workload runs with its own setting "
                             "(common.WORKLOAD_XLA_THREADS: 1, W3 'default'), in a subprocess where it differs")
    parser.add_argument("--results", default=None,
                        help="write the JSON lines and plots here instead of benchmarks/results (the smoke test "
                             "uses a temporary directory)")
    args = parser.parse_args(argv)
    only = [w.strip().lower() for w in args.only.split(",") if w.strip()]
    unknown = [w for w in only if w not in WORKLOADS]
    if unknown:
        parser.error(f"--only: unknown workload(s) {unknown}; choose from {', '.join(WORKLOADS)}")

    from conduit_jax import runtime  # imports jax but starts no backend

    # 8 emulated devices must be requested before JAX initialises its backends. W6 alone gets them in-process; with
    # other workloads it runs in a subprocess so their 1-device rows are unaffected.
    if (args.emulated_mesh or only == ["w6"]) and DEVICE_FLAG.split("=")[0] not in os.environ.get("XLA_FLAGS", ""):
        if runtime.backend_started():
            if args.emulated_mesh:
                parser.error("--emulated-mesh must be applied before a JAX backend starts")
        else:
            os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + DEVICE_FLAG).strip()

    from benchmarks import bench_w1, bench_w2, bench_w3, bench_w4, bench_w5, bench_w6, bench_w7, bench_w8, common

    if args.xla_threads is not None:
        os.environ[common.XLA_THREADS_ENV] = args.xla_threads
    # the pool is fixed for the process: the first workload's setting here, the others' in subprocesses
    try:
        threads = {name: common.xla_threads_setting(name) for name in only}
    except ValueError as exc:
        parser.error(str(exc))
    here = threads[only[0]]
    common.configure_runtime(only[0])
    if args.results:
        common.RESULTS_DIR = Path(args.results)
        common.RESULTS_DIR.mkdir(parents=True, exist_ok=True)
    quick, cap, rounds = args.quick, args.capacity, args.rounds
    runners = {
        "w1": lambda: bench_w1.run(common.Settings.for_run(quick, cap, rounds)),
        "w2": lambda: bench_w2.run(common.Settings.for_run(quick, cap, rounds)),
        "w3": lambda: bench_w3.run(bench_w3.settings_for(quick, cap, rounds), explicit_capacity=cap is not None),
        "w4": lambda: bench_w4.run(bench_w4.settings_for(quick, None, rounds)),
        "w5": lambda: bench_w5.run(bench_w5.settings_for(quick, cap, rounds)),
        "w6": lambda: bench_w6.run(common.Settings.for_run(quick, cap, rounds)),
        "w7": lambda: bench_w7.run(bench_w7.settings_for(quick, cap, rounds)),
        "w8": lambda: bench_w8.run(bench_w8.settings_for(quick, cap, rounds)),
    }
    failed = []
    start = time.perf_counter()
    for name in only:
        try:
            if threads[name] != here:
                _in_subprocess(name, threads[name], args)
            else:
                runners[name]()
            if name in ("w1", "w2"):
                path = common.RESULTS_DIR / (f"{name}.quick.jsonl" if quick else f"{name}.jsonl")
                goals = common.attach_goals(path, w12_goals()[name], name)
                print(f"{name} goals (issue 7):\n{common.goal_lines(goals)}")
        except (Exception, SystemExit):
            traceback.print_exc()
            failed.append(name)
        print()
    if not args.no_plots:
        try:
            from benchmarks import plots

            written = plots.make_plots(only, quick=quick, results=common.RESULTS_DIR)
            print("plots: " + (", ".join(str(p) for p in written) if written else "none written"))
        except ImportError as exc:
            print(f"plots skipped: {exc} (pip install matplotlib, or the bench extra)")
        except Exception:
            traceback.print_exc()
            failed.append("plots")
    print(f"suite {'(quick) ' if quick else ''}finished in {time.perf_counter() - start:.1f} s"
          + (f"; FAILED: {', '.join(failed)}" if failed else ""))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
