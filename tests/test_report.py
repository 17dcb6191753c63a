"""experiments/report.py: REPORT.md from small synthetic result files, including missing, quick-only, malformed and
GPU-marked ones. Every number in the report comes from the JSON; these tests pin that."""

import json

import pytest

from experiments import report


def _rllib(native_share=0.237, conduit_share=0.16, convergence=True, seeds=(0, 1, 2)):
    def path(share, it):
        med = {"buffer_add": 0.16, "buffer_sample": 0.47, "priority_update": 0.11, "to_batch": 0.27,
               "minibatching": 0.01, "learner_update": 0.86, "other": 2.5, "iteration": it}
        return {"iterations_measured": 30, "updates_per_iteration": 250, "median_s": med, "mean_s": med,
                "experience_path_s": {"median": share * it, "mean": share * it},
                "experience_path_share": {"median": share, "mean": share}}

    summary = {"native": path(native_share, 4.5), "conduit": path(conduit_share, 3.7),
               "conduit_vs_native": {"iteration_latency_change": -0.187, "experience_path_change": -0.429}}
    finals = {"native": [280.0, 250.0, 310.0], "conduit": [270.0, 300.0, 260.0]}
    if convergence:
        summary["convergence"] = {
            "final_iterations": 5,
            **{p: {"final_return_per_seed": {str(s): v for s, v in zip(seeds, finals[p])},
                   "mean": sum(finals[p]) / 3, "std": 30.0} for p in finals},
            "welch_native_vs_conduit": {"t": 0.12, "dof": 3.9, "p": 0.91, "n": [3, 3]}}
    runs = [{"path": p, "seed": s, "returns": [10.0, v], "iterations": []} for p in finals
            for s, v in zip(seeds, finals[p])]
    return {"command": "python -m experiments.rllib_compare --algo dqn", "wall_s": 330.0, "environment": "CartPole-v1",
            "config": {"seeds": list(seeds), "schedule": "sync", "steps_per_iteration": 1000}, "summary": summary,
            "runs": runs, "machine": {"cpu_count": 2, "load_average": [1.0, 1.0, 1.0]},
            "versions": {"jax": "0.10.2", "ray": "2.60.0"}}


ENV = {"record": "environment", "date": "2026-11-30T12:00:00+00:00", "cpu_model": "AMD EPYC", "cpu_count": 2,
       "jax_backend": "cpu", "device_count": 8, "versions": {"jax": "0.10.2"}, "load_average": [0.5, 0.5, 0.5]}


def _placement(regret=0.0):
    recs = [{"shards": s, "memory_kind": k, "pattern": "global", "batch": 256, "batch_bytes": 24576, "row_bytes": 96,
             "measured_median_s": 3e-5 * s, "predicted_s": 3.3e-5 * s, "rel_error": 0.1}
            for s in (1, 8) for k in ("device", "pinned_host", "unpinned_host")]
    planner = [{"batch": 256, "batch_bytes": 24576, "choice": {"label": "1 shard(s), device", "storage": "device",
                                                               "shards": 1},
                "predicted_delivery_s": 4e-4, "measured_median_s": 2e-4 * (1 + regret), "prediction_error": 1.0,
                "best_for_learners": {"label": "1 shard(s), device (planner)", "measured_median_s": 2e-4},
                "regret": regret}]
    return {"command": "python -m experiments.placement_sweep", "wall_s": 70.0, "gpu": False, "environment": ENV,
            "settings": {"learner_devices": 8}, "records": recs, "planner": planner,
            "model": {"configs": 6, "within_30pct": 6, "median_abs_error": 0.1, "max_abs_error": 0.1},
            "verdict": ["cost model: 6/6 within 30%"]}


def _ablation():
    rows = []
    for variant, exposed, it in (("baseline", 200.0, 800.0), ("+placement", 198.0, 790.0),
                                 ("+scheduling", 90.0, 650.0), ("full", 85.0, 640.0), ("default_mesh", 1100.0, 6000.0)):
        rows.append({"workload": "dqn", "variant": variant, "placement_label": "x", "schedule": "sync",
                     "exposed_us": exposed, "iteration_us": it, "learner_compute_us": 160.0,
                     "exposed_change": exposed / 200 - 1, "iteration_change": it / 800 - 1})
    return {"command": "python -m experiments.ablation", "wall_s": 360.0, "environment": ENV, "rows": rows,
            "definitions": {"baseline": {"placement": "host memory", "schedule": "sync"}},
            "verdict": ["dqn: placement makes no measurable difference here"]}


def _write(d, name, data):
    (d / name).write_text(data if isinstance(data, str) else json.dumps(data))


def test_empty_results_say_not_run_yet_with_each_command(tmp_path):
    text = report.build_report(tmp_path, tmp_path)
    assert text.count("*Not run yet:*") >= 8
    for command in ("conduit experiment breakdown --algo dqn", "conduit experiment breakdown --algo ppo",
                    "conduit experiment placement", "conduit experiment ablation", "conduit experiment scaling",
                    "conduit experiment convergence --algo sac", "conduit experiment gpu",
                    "conduit experiment scheduling"):
        assert command in text, command
    for section in range(1, 7):
        assert f"## {section}. " in text


def test_numbers_come_from_the_json_beside_the_paper(tmp_path):
    _write(tmp_path, "rllib_compare_dqn.json", _rllib())
    _write(tmp_path, "placement_sweep.json", _placement())
    _write(tmp_path, "ablation.json", _ablation())
    text = report.build_report(tmp_path, None)
    # claim 1: our share beside the paper's 50.2%, and the gap computed, not typed
    assert "23.7% vs the paper's 50.2% -> **below the paper by 26.5 points**" in text
    assert "'collect' = other) take 55.6% of the native iteration" in text  # 2.5 / 4.5
    assert "| collect | other | 2.5000 | 55.6% |" in text
    # claim 2: RLlib changes and the ablation rows; the extra run is not a baseline step
    assert "| RLlib DQN | sync | -42.9% | -18.7% | -10.5% |" in text  # (0.592 - 1.0665) / 4.5
    assert "default_mesh (reported apart)" in text
    assert ("largest exposed-latency cut measured (ablation dqn full vs baseline): -57.5% vs the paper's -97.0% -> "
            "**below the paper by 39.5 points**") in text
    assert "| 2. exposed latency, best cut | -97.0% | -57.5% (ablation dqn full vs baseline) | below |" in text
    # claim 3: the planner's choice, predicted beside measured; command and run time from the file
    assert "| 256 | 24.0 | 1 shard(s), device | 400 us | 200 us | +100.0% |" in text
    assert "`python -m experiments.placement_sweep`, run time 70 s" in text
    # claim 5: rllib_compare's own convergence section is used as it is
    assert "| RLlib DQN (CartPole-v1) | 3 | 280.0 +/- 30.0 | 276.7 +/- 30.0 | +0.12 | 3.9 | 0.910 |" in text
    assert "final return = mean of the last K = 5 iterations" in text
    # the machine table reads every layout
    assert "| `placement_sweep.json` | 2026-11-30T12:00:00+00:00 | AMD EPYC, 2 cores, cpu x8, jax 0.10.2 |" in text


def test_quick_file_is_used_and_marked_only_without_the_full_one(tmp_path):
    _write(tmp_path, "rllib_compare_ppo_quick.json", _rllib(0.30, 0.2, seeds=(0,)))
    text = report.build_report(tmp_path, None)
    assert "rllib_compare_ppo_quick.json" in text and "(quick run: the full run's file is missing)" in text
    assert "30.0% vs the paper's 26.2% -> **reached**" in text
    # a quick run's latency numbers are shown but never counted as reaching the paper
    assert "| 2. iteration latency, best cut | -38.0% | quick runs only: -18.7% | - |" in text
    assert "A quick run shows -18.7% (RLlib PPO, Conduit vs native); not counted" in text
    _write(tmp_path, "rllib_compare_ppo.json", _rllib(0.10, 0.05))
    text = report.build_report(tmp_path, None)
    assert "rllib_compare_ppo_quick.json" not in text


def test_convergence_falls_back_to_the_runs_returns(tmp_path):
    data = _rllib(convergence=False)
    conv = report.convergence_of(data)
    assert conv["computed_here"] and conv["native"]["finals"] == [280.0, 250.0, 310.0]
    assert conv["t"] == pytest.approx(0.158, abs=1e-3) and conv["dof"] > 3
    _write(tmp_path, "rllib_compare_dqn.json", data)
    assert "has no `summary.convergence` section" in report.build_report(tmp_path, None)


def test_planner_regret_is_reported_as_below(tmp_path):
    _write(tmp_path, "placement_sweep.json", _placement(regret=0.5))
    text = report.build_report(tmp_path, None)
    assert "up to +50.0% slower than the fastest measured option" in text
    assert "| 3. planner's choice vs fastest measured | (no number) | worst regret +50.0% | not always best |" in text


def test_malformed_files_do_not_hide_the_other_claims(tmp_path):
    _write(tmp_path, "scaling.json", "{not json")
    _write(tmp_path, "ablation.json", {"rows": [{"workload": "dqn"}]})  # wrong shape
    _write(tmp_path, "placement_sweep.json", _placement())
    text = report.build_report(tmp_path, None)
    assert "`scaling.json` could not be read" in text
    assert "unexpected shape" in text
    assert "| 256 | 24.0 | 1 shard(s), device |" in text  # the good file still reported


def test_gpu_figures_only_from_files_marked_gpu(tmp_path):
    dry = {"gpu": False, "device": {"backend": "cpu"}, "rows": [], "environment": ENV}
    _write(tmp_path, "gpu_breakdown_quick.json", dry)
    text = report.build_report(tmp_path, None)
    assert "[GPU figure]" not in text.split("## 6.")[1].split("## Machines")[0].replace(
        "unless a figure is marked **[GPU figure]**", "")
    assert "the CPU dry run last passed" in text
    gpu = dict(_placement(), gpu=True, environment=dict(ENV, gpu_name="NVIDIA H200", jax_backend="gpu"))
    _write(tmp_path, "gpu_placement_sweep.json", gpu)
    (tmp_path / "gpu_placement_sweep.png").write_bytes(b"png")
    text = report.build_report(tmp_path, None)
    assert "### placement sweep **[GPU figure]**" in text
    assert "![gpu_placement_sweep](results/gpu_placement_sweep.png) **[GPU figure]**" in text
    assert "Machine: NVIDIA H200" in text


def test_run_time_from_the_cli_record_when_the_file_has_none(tmp_path):
    data = {"host": {"cpus": 2, "jax": "0.10.2"}, "measured": [], "predicted": {}, "local": {}}
    _write(tmp_path, "scaling.json", data)
    text = report.build_report(tmp_path, None)
    assert "run time not recorded" in text
    _write(tmp_path, "runs.json", {"scaling": {"command": "conduit experiment scaling", "wall_s": 200.0,
                                               "outputs": [str(tmp_path / "scaling.json")]}})
    text = report.build_report(tmp_path, None)
    assert "`conduit experiment scaling`, run time 3.3 min (200 s)" in text


def test_learner_breakdown_per_step():
    row = {"iteration_us": 500.0, "learner_compute_us": 150.0, "learner_steps": 100,
           "stages": {"ingest": {"median_us": 50.0, "calls": 110}, "exposed": {"median_us": 90.0, "calls": 100},
                      "update": {"median_us": 60.0, "calls": 100}}}
    b = report.learner_breakdown(row)
    assert b["ingest_us"] == pytest.approx(55.0) and b["experience_path_us"] == pytest.approx(205.0)
    assert b["collect_other_us"] == pytest.approx(145.0) and b["experience_path_share"] == pytest.approx(0.41)


def test_caption_and_command_line():
    assert report.command_line("experiments.ablation", ["--quick", "--only", "a b"]) == \
        "python -m experiments.ablation --quick --only 'a b'"
    caption = report.caption_text({"command": "python -m x", "seed": 3, "wall_s": 12.4, "environment": ENV})
    assert caption.startswith("command: python -m x | seed 3 | run time 12 s | ")
    assert "AMD EPYC, 2 cores, cpu x8, jax 0.10.2" in caption


def test_main_writes_the_file(tmp_path, capsys):
    out = tmp_path / "sub" / "REPORT.md"
    assert report.main(["--results", str(tmp_path), "--bench-results", str(tmp_path), "--out", str(out)]) == 0
    assert out.read_text().startswith("# Conduit-JAX: results beside the paper")


def test_a_result_without_a_date_is_dated_by_its_commit_not_by_the_checkout(tmp_path):
    """A clone sets every file's time to the clone's: a result file that records no date of its own is dated by its
    last commit while unchanged since, and by its file time once changed."""
    import os
    import subprocess

    def git(*args):
        subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@t", *args], cwd=tmp_path, check=True,
                       capture_output=True, env={**os.environ, "GIT_COMMITTER_DATE": "2026-01-02T03:04:05+00:00",
                                                 "GIT_AUTHOR_DATE": "2026-01-02T03:04:05+00:00"})

    result = tmp_path / "result.json"
    result.write_text("{}")
    assert report.committed_date(result) is None  # not in a checkout
    git("init", "-q")
    git("add", "result.json")
    git("commit", "-q", "-m", "a result")
    assert report.committed_date(result) == "2026-01-02T03:04:05+00:00"
    result.write_text('{"changed": true}')
    assert report.committed_date(result) is None
