"""Claim 6, the GPU figures: the JAX learners' breakdown and ablation, and the placement sweep, on one NVIDIA GPU.

Prepared for an H200 (one short call, about 5 minutes, under 8): ``python -m experiments.gpu`` (``conduit experiment
gpu``). Three parts, each in its own process so an XLA abort in one (a memory kind a kernel cannot use on this
backend) cannot take the others with it; ``--budget-s`` (default 450) bounds the whole call and each part gets what
is left:

  * probe: the backend, the device and its memory kinds (a full run refuses to start without a GPU);
  * breakdown: ``experiments/ablation.py`` on one device: DQN + PER and PPO, each with the ring in host memory
    (``pinned_host``, the kind a GPU's host-side buffer is DMA'd from) and where the planner puts it, synchronous and
    scheduled: per-step stage breakdown (ingest, wait for the batch, priority update, learner step, the rest), exposed
    and iteration latency. On a GPU the host -> device copy is real, so this is where placement can show;
  * placement: ``experiments/placement_sweep.py`` with the ring in ``device``, ``pinned_host`` and ``unpinned_host``
    memory, one shard (one GPU), batches 256 B ... 6 MiB; if the three kinds in one process fail, each kind is retried
    in a process of its own and what worked is kept.

Writes ``experiments/results/gpu_breakdown.json`` (+ ``.png``), ``gpu_placement_sweep.json`` (+ ``.png``) and
``gpu_run.json`` (what ran, how long, what failed). Every file says ``"gpu": true`` only when the backend really was a
GPU; the report marks those figures as GPU figures and ignores the rest.

``--dry-run`` (or ``--quick``) runs the same parts small on whatever backend is there (CPU here, one device) and
writes ``gpu_*_quick.*`` (never the GPU files): the test that the script runs end to end.

Environment on the GPU machine: JAX with the CUDA plugin (``pip install '.[cuda]'``), flax, optax, matplotlib, tqdm;
``JAX_PLATFORMS`` is set to ``cuda`` for the parts unless you set it yourself.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from experiments.report import RESULTS, command_line, learner_breakdown

ROOT = Path(__file__).resolve().parent.parent
KINDS = ("device", "pinned_host", "unpinned_host")
SWEEP = {  # placement_sweep arguments on the GPU (full) and in the dry run
    "full": ["--shards", "1", "--batches", "4,64,1024,16384,65536", "--capacity", str(1 << 20)],
    "quick": ["--shards", "1", "--batches", "64,1024", "--capacity", str(1 << 14), "--rounds", "2", "--reps", "5"],
}
HOST_KIND = "pinned_host"  # the baseline's host memory on a GPU


# ------------------------------------------------------------------------------------------------------------------
# Parts (each runs in a child process: python -m experiments.gpu --part NAME)
# ------------------------------------------------------------------------------------------------------------------
def probe() -> dict:
    import jax

    d = jax.devices()[0]
    info: dict[str, Any] = {"backend": jax.default_backend(), "device_kind": getattr(d, "device_kind", None),
                            "device_count": jax.device_count(), "jax": jax.__version__}
    try:
        info["memory_kinds"] = sorted({m.kind for m in d.addressable_memories()})
    except Exception as exc:  # noqa: BLE001 - informative only
        info["memory_kinds"] = f"unknown ({exc})"
    try:
        info["memory_stats"] = {k: v for k, v in (d.memory_stats() or {}).items()
                                if k in ("bytes_limit", "bytes_in_use", "peak_bytes_in_use")}
    except Exception as exc:  # noqa: BLE001
        info["memory_stats"] = f"unavailable ({exc})"
    return info


def breakdown_part(quick: bool, seed: int, stem: Path) -> dict:
    """The ablation's four variants on one device, host memory = ``HOST_KIND``; rows carry the breakdown."""
    import jax

    from benchmarks.common import environment
    from experiments import ablation

    start = time.perf_counter()
    gpu = jax.default_backend() == "gpu"
    ablation.HOST_KIND = HOST_KIND
    report = ablation.run(quick, seed, rounds=1, only=None, extra=False, progress=False)
    ablation.summarize(report)
    for row in report["rows"]:
        row["breakdown"] = learner_breakdown(row)
    info = probe()
    report.update({"claim": "GPU: breakdown and ablation of the JAX learners", "gpu": gpu, "gpu_figure": gpu,
                   "device": info, "host_kind": HOST_KIND,
                   "environment": environment({}, {"gpu_name": info.get("device_kind") if gpu else None}),
                   "command": command_line("experiments.gpu", ["--dry-run"] if quick else []),
                   "wall_s": time.perf_counter() - start})
    stem.with_suffix(".json").write_text(json.dumps(report, indent=1, default=str))
    plot_breakdown(report, stem.with_suffix(".png"))
    return {"rows": len(report["rows"]), "wall_s": report["wall_s"]}


def plot_breakdown(report: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    from experiments.report import caption_text

    rows = report["rows"]
    labels = [f"{r['workload']}\n{r['variant']}\n{r['schedule']}" for r in rows]
    parts = (("collect_other_us", "collect + loop"), ("ingest_us", "ingest"),
             ("sample_batch_exposed_us", "sample + batch (exposed)"), ("priority_update_us", "priority update"),
             ("learner_us", "learner step"))
    fig, ax = plt.subplots(figsize=(max(8, 1.3 * len(rows)), 5))
    bottom = np.zeros(len(rows))
    for key, name in parts:
        values = np.array([r["breakdown"][key] for r in rows])
        ax.bar(np.arange(len(rows)), values, bottom=bottom, label=name)
        bottom += values
    ax.set_xticks(np.arange(len(rows)), labels, fontsize=7)
    ax.set_ylabel("us per learner step")
    tag = "GPU figure: " + str(report["device"].get("device_kind")) if report.get("gpu") else \
        f"dry run on {report['device'].get('backend')} (not a GPU figure)"
    ax.set_title(f"JAX learners per step, by stage [{tag}]", fontsize=10)
    ax.legend(fontsize=7)
    fig.text(0.01, 0.01, caption_text(report), fontsize=7, family="monospace", va="bottom")
    fig.tight_layout(rect=(0, 0.05, 1, 1))
    fig.savefig(path, dpi=110)
    plt.close(fig)


# ------------------------------------------------------------------------------------------------------------------
# The orchestrating process (never starts a JAX backend itself: the GPU stays free for the parts)
# ------------------------------------------------------------------------------------------------------------------
def _child_env(dry_run: bool) -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(ROOT) + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    if dry_run:
        env.setdefault("JAX_PLATFORMS", "cpu")
        env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=1").strip() \
            if "xla_force_host_platform_device_count" not in env.get("XLA_FLAGS", "") else env["XLA_FLAGS"]
    else:
        env.setdefault("JAX_PLATFORMS", "cuda")
        env.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # each part allocates what it uses
    return env


def _run(cmd: list[str], env: dict, timeout: float) -> dict:
    start = time.perf_counter()
    try:
        proc = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True,
                              timeout=max(1.0, timeout), check=False)
        status = {"returncode": proc.returncode, "stdout_tail": proc.stdout[-3000:], "stderr_tail": proc.stderr[-3000:]}
    except subprocess.TimeoutExpired as exc:
        status = {"returncode": None, "timeout_s": timeout,
                  "stderr_tail": (exc.stderr or b"")[-3000:].decode(errors="replace")
                  if isinstance(exc.stderr, bytes) else str(exc.stderr or "")[-3000:]}
    status["cmd"] = " ".join(cmd)
    status["wall_s"] = time.perf_counter() - start
    return status


def _merge_sweeps(paths: list[Path], out: Path, failed: list[str]) -> bool:
    """One placement_sweep report from per-kind reports (records concatenated, the first planner row set)."""
    from experiments import placement_sweep

    reports = [json.loads(p.read_text()) for p in paths if p.is_file()]
    if not reports:
        return False
    merged = dict(reports[0])
    merged["records"] = [r for rep in reports for r in rep["records"]]
    merged["settings"] = dict(merged["settings"], kinds=sorted({r["memory_kind"] for r in merged["records"]}))
    merged["wall_s"] = sum(rep.get("wall_s", 0.0) for rep in reports)
    merged["failed"] = failed
    placement_sweep.summarize(merged)
    out.with_suffix(".json").write_text(json.dumps(merged, indent=1))
    placement_sweep.plot(merged, out.with_suffix(".png"))
    for p in paths:
        for suffix in (".json", ".png"):
            p.with_suffix(suffix).unlink(missing_ok=True)
    return True


def _mark(path: Path, gpu: bool, info: dict, extra: dict) -> None:
    if not path.is_file():
        return
    data = json.loads(path.read_text())
    data.update({"gpu": gpu, "gpu_figure": gpu, "device": info, **extra})
    env = data.setdefault("environment", {})
    if gpu:
        env["gpu_name"] = info.get("device_kind")
    path.write_text(json.dumps(data, indent=1, default=str))


def orchestrate(args, argv: list[str]) -> int:
    dry_run = args.dry_run or args.quick
    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    suffix = "_quick" if dry_run else ""
    env = _child_env(dry_run)
    deadline = time.perf_counter() + args.budget_s
    me = [sys.executable, "-m", "experiments.gpu"]
    run = {"command": command_line("experiments.gpu", argv), "dry_run": dry_run, "budget_s": args.budget_s,
           "parts": {}, "failed": []}
    start = time.perf_counter()

    status = _run(me + ["--part", "probe"], env, min(180.0, args.budget_s))
    run["parts"]["probe"] = status
    try:
        info = json.loads(status["stdout_tail"].strip().splitlines()[-1])
    except (ValueError, IndexError, KeyError):
        hint = "" if dry_run else (f" (JAX_PLATFORMS={env.get('JAX_PLATFORMS')}: no GPU here? --dry-run tests the "
                                   "script on this machine's backend)")
        print(f"experiments.gpu: error: the probe failed{hint}: {status.get('stderr_tail', '')[-800:]}",
              file=sys.stderr)
        return 2
    gpu = info.get("backend") == "gpu"
    run["device"] = info
    print(f"probe: backend {info['backend']}, {info.get('device_count')} x {info.get('device_kind')}, memory kinds "
          f"{info.get('memory_kinds')}", flush=True)
    if not gpu and not dry_run:
        print(f"experiments.gpu: error: no GPU here (JAX backend {info['backend']!r}); run it on a machine with an "
              "NVIDIA GPU and jax[cuda] (pip install '.[cuda]'), or pass --dry-run to test the script on this backend",
              file=sys.stderr)
        return 2
    parts = args.only.split(",") if args.only else ["breakdown", "placement"]
    if "breakdown" in parts:
        stem = out_dir / f"gpu_breakdown{suffix}"
        cmd = me + ["--part", "breakdown", "--stem", str(stem), "--seed", str(args.seed)] + (["--quick"] if dry_run
                                                                                             else [])
        status = _run(cmd, env, deadline - time.perf_counter())
        run["parts"]["breakdown"] = status
        if status["returncode"] != 0:
            run["failed"].append(f"breakdown: exit {status['returncode']}: {status.get('stderr_tail', '')[-400:]}")
        print(f"breakdown: exit {status['returncode']} ({status['wall_s']:.0f} s)", flush=True)
    if "placement" in parts:
        stem = out_dir / f"gpu_placement_sweep{suffix}"
        base = [sys.executable, "-m", "experiments.placement_sweep", "--no-progress", "--seed", str(args.seed)] + \
            SWEEP["quick" if dry_run else "full"]
        status = _run(base + ["--out", str(stem)], env, deadline - time.perf_counter())
        run["parts"]["placement"] = status
        if status["returncode"] != 0:  # one kind may abort the process: measure each kind on its own
            run["failed"].append(f"placement (all kinds in one process): exit {status['returncode']}")
            pieces, failed = [], []
            for kind in KINDS:
                piece = out_dir / f"gpu_placement_sweep{suffix}_{kind}"
                st = _run(base + ["--kinds", kind, "--out", str(piece), "--no-plot"], env,
                          deadline - time.perf_counter())
                run["parts"][f"placement_{kind}"] = st
                if st["returncode"] == 0:
                    pieces.append(piece.with_suffix(".json"))
                else:
                    failed.append(f"{kind}: exit {st['returncode']}: {st.get('stderr_tail', '')[-300:]}")
            run["failed"] += failed
            _merge_sweeps(pieces, stem, failed)
        print(f"placement: exit {status['returncode']} ({status['wall_s']:.0f} s)", flush=True)
        _mark(stem.with_suffix(".json"), gpu, info, {"command": run["command"]})
        if stem.with_suffix(".json").is_file():  # the figure again, now with the GPU mark in its title
            from experiments import placement_sweep

            placement_sweep.plot(json.loads(stem.with_suffix(".json").read_text()), stem.with_suffix(".png"))
    run["wall_s"] = time.perf_counter() - start
    run["gpu"] = gpu
    (out_dir / f"gpu_run{suffix}.json").write_text(json.dumps(run, indent=1, default=str))
    for line in run["failed"]:
        print(f"failed: {line}", file=sys.stderr)
    print(f"wrote {out_dir}/gpu_*{suffix}.json ({run['wall_s']:.0f} s; {'GPU figures' if gpu else 'not a GPU: dry run'})")
    return 1 if run["failed"] else 0


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dry-run", action="store_true", help="small, on whatever backend is here (CPU: the test)")
    parser.add_argument("--quick", action="store_true", help="the same as --dry-run")
    parser.add_argument("--budget-s", type=float, default=450.0, help="wall-clock bound for the whole call")
    parser.add_argument("--only", default=None, help="comma-separated parts: breakdown,placement")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out-dir", default=str(RESULTS))
    parser.add_argument("--part", default=None, help=argparse.SUPPRESS)  # internal: run one part in this process
    parser.add_argument("--stem", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.part == "probe":
        print(json.dumps(probe()))
        return 0
    if args.part == "breakdown":
        print(json.dumps(breakdown_part(args.quick, args.seed, Path(args.stem))))
        return 0
    return orchestrate(args, argv)


if __name__ == "__main__":
    sys.exit(main())

