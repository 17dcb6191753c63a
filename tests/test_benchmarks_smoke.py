"""The benchmark suite's quick mode runs end to end (a smoke run, not a measurement: speed is never asserted).

Peers that are not installed (the ``bench`` extra: cpprb, Flashbax, TorchRL) are reported as unavailable; NumPy and
Conduit always run, so every Conduit kernel the suite times is exercised the way the benchmarks drive it (the fused
learner-jit path included).
"""

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_quick_suite_runs_and_writes_rows_for_conduit_and_numpy(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    # one device, as the suite's headline rows; the suite's other XLA flags (conftest.py: LLVM -O0) still apply
    flags = [flag for flag in os.environ.get("XLA_FLAGS", "").split() if "device_count" not in flag]
    if flags:
        env["XLA_FLAGS"] = " ".join(flags)
    done = subprocess.run([sys.executable, "-m", "benchmarks.run", "--quick", "--only", "w1,w2,w4,w5", "--no-plots",
                           "--results", str(tmp_path)], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    for workload in ("w1", "w2", "w4", "w5"):
        lines = [json.loads(line) for line in (tmp_path / f"{workload}.quick.jsonl").read_text().splitlines()]
        assert lines[0]["record"] == "environment" and lines[0]["memcpy"]["bytes_per_s"] > 0
        timed = {(r["contender"], r["metric"]) for r in lines if r["record"] == "timing"}
        conduit = {metric for contender, metric in timed if contender == "conduit[1dev]"}
        baseline = {metric for contender, metric in timed if contender.startswith("numpy")}
        assert conduit and conduit <= baseline | {"ppo_iteration"}, (workload, timed)
        goals = [r for r in lines if r["record"] == "goal"]
        # a goal against a peer that is not installed is not measured (value and met None); the others are decided
        measured = [g for g in goals if g["value"] is not None]
        assert measured and all(isinstance(g["met"], bool) for g in measured), workload
        assert all(g["met"] is None for g in goals if g["value"] is None), workload
        recompiles = [r["value"] for r in goals if r["kind"] == "recompiles"]
        assert recompiles and all(value == 0 for value in recompiles), workload
