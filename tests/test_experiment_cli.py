"""``conduit experiment``: the catalogue (``experiments/catalogue.py``) and how the command loads it from a checkout,
parsing, --list, dispatch to an experiment's main (mocked), run records, missing extras, and short smoke runs of the
quick scripts in subprocesses (the long ones are marked slow)."""

import json
import os
import subprocess
import sys
import types
from pathlib import Path

import pytest

from conduit_jax import cli
from experiments import catalogue

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture
def fake(monkeypatch, tmp_path):
    """``_import_experiment`` returns a stand-in module whose main records its argv; results go to tmp_path. The
    catalogue itself is the real one."""
    calls = []
    real = cli._import_experiment

    def import_experiment(module, expects="main"):
        if module == "catalogue":
            return real(module, expects)

        def main(argv):
            calls.append((module, list(argv)))
            if "--out" in argv:  # what rllib_compare does with --out
                Path(argv[argv.index("--out") + 1]).write_text("{}")
            return 0

        mod = types.SimpleNamespace(main=main, RESULTS=tmp_path, __file__=str(tmp_path / f"{module}.py"))
        return mod, None

    monkeypatch.setattr(cli, "_import_experiment", import_experiment)
    monkeypatch.setattr(cli, "_missing", lambda modules: [])
    return calls


def test_the_catalogue_lives_in_experiments_and_names_real_scripts():
    names = [e.name for e in catalogue.EXPERIMENTS]
    assert len(set(names)) == len(names)
    assert {"breakdown", "scheduling", "ablation", "placement", "scaling", "convergence", "gpu", "jitted",
            "report"} <= set(names)
    for e in catalogue.EXPERIMENTS:
        assert isinstance(e, catalogue.Experiment)
        assert (ROOT / "experiments" / f"{e.module}.py").is_file(), e.module
        assert e.claim and e.help, e.name
    assert not {"full_time", "quick_time"} & set(catalogue.Experiment._fields)  # run times come from recorded runs
    assert not hasattr(cli, "EXPERIMENTS") and not hasattr(cli, "Experiment")  # one place for the catalogue
    mod, _ = cli._load_catalogue()
    assert mod.EXPERIMENTS == catalogue.EXPERIMENTS


def test_list_shows_every_experiment(capsys):
    assert cli.main(["experiment", "--list"]) == 0
    out = capsys.readouterr().out
    for e in catalogue.EXPERIMENTS:
        line = next(x for x in out.splitlines() if x.startswith(e.name + " "))
        assert e.help in line
    assert cli.main(["experiment", "list"]) == 0
    assert "placement" in capsys.readouterr().out


def _listed(tmp_path, capsys, name: str) -> str:
    print(cli._format_experiments(catalogue.EXPERIMENTS, tmp_path))
    return next(x for x in capsys.readouterr().out.splitlines() if x.startswith(name + " "))


def test_list_shows_only_run_times_on_record(tmp_path, capsys):
    """A run time comes from runs.json / runs_quick.json, else from the wall_s of the result file the run wrote;
    with neither the entry says so instead of showing a figure."""
    assert _listed(tmp_path, capsys, "placement").split()[2:6] == ["not", "recorded", "not", "recorded"]
    (tmp_path / "runs.json").write_text(json.dumps(
        {"placement": {"wall_s": 61.4, "date": "2026-11-30T14:00:00+00:00", "outputs": []}}))
    (tmp_path / "placement_sweep.json").write_text(json.dumps({"wall_s": 50.0}))  # the recorded run comes first
    (tmp_path / "placement_sweep_quick.json").write_text(json.dumps({"wall_s": 9.6}))
    (tmp_path / "scaling.json").write_text(json.dumps({"wall_s": 213.8}))
    (tmp_path / "rllib_compare_dqn.json").write_text(json.dumps({"wall_s": 1367.4}))
    (tmp_path / "rllib_compare_sac.json").write_text(json.dumps({"wall_s": 3326.0}))
    line = _listed(tmp_path, capsys, "placement")
    assert "61 s (run 2026-11-30)" in line and "10 s (placement_sweep_quick.json)" in line and "50 s" not in line
    assert "214 s (scaling.json)" in _listed(tmp_path, capsys, "scaling")
    assert "dqn 1367 s, sac 3326 s" in _listed(tmp_path, capsys, "convergence")  # ppo: none on record
    assert "dqn 1367 s not recorded" in " ".join(_listed(tmp_path, capsys, "breakdown").split())


def test_no_name_and_unknown_name_exit_2(capsys):
    assert cli.main(["experiment"]) == 2
    assert "name an experiment" in capsys.readouterr().err
    assert cli.main(["experiment", "nope"]) == 2
    err = capsys.readouterr().err
    assert "unknown experiment 'nope'" in err and "breakdown" in err


def test_dispatch_passes_quick_and_extra_args_through_and_records_the_run(fake, tmp_path):
    assert cli.main(["experiment", "placement", "--quick", "--batches", "64,256", "--seed", "3"]) == 0
    assert fake == [("placement_sweep", ["--quick", "--batches", "64,256", "--seed", "3"])]
    record = json.loads((tmp_path / "runs_quick.json").read_text())["placement"]
    assert record["command"] == "conduit experiment placement --quick --batches 64,256 --seed 3"
    assert record["script"].startswith("python -m experiments.placement_sweep --quick")
    assert record["quick"] is True and record["wall_s"] >= 0
    assert not (tmp_path / "runs.json").exists()  # quick runs never touch the full runs' record


def test_quick_before_the_name_works_too(fake):
    assert cli.main(["experiment", "--quick", "ablation"]) == 0
    assert fake == [("ablation", ["--quick"])]


def test_gpu_dry_run_is_recorded_as_a_short_run(fake, tmp_path):
    assert cli.main(["experiment", "gpu", "--dry-run"]) == 0
    assert fake == [("gpu", ["--dry-run"])]
    assert "gpu" in json.loads((tmp_path / "runs_quick.json").read_text())
    assert not (tmp_path / "runs.json").exists()


def test_jitted_quick_is_a_short_run_of_its_own_flags(fake, tmp_path):
    """experiments/jitted.py has no --quick: the catalogue says what a short run passes instead."""
    assert cli.main(["experiment", "jitted", "--quick", "--algo", "ppo"]) == 0
    assert fake == [("jitted", ["--total-env-steps", "10000", "--algo", "ppo"])]
    record = json.loads((tmp_path / "runs_quick.json").read_text())["jitted"]
    assert record["command"] == "conduit experiment jitted --quick --algo ppo" and record["quick"] is True
    fake.clear()
    assert cli.main(["experiment", "jitted", "--algo", "dqn-per"]) == 0
    assert fake == [("jitted", ["--algo", "dqn-per"])]
    assert "jitted" in json.loads((tmp_path / "runs.json").read_text())


def test_jitted_quick_args_are_flags_of_the_script():
    from experiments import jitted

    e = next(e for e in catalogue.EXPERIMENTS if e.name == "jitted")
    with pytest.raises(SystemExit) as exc:  # parses, then --help exits before any JAX work
        jitted.main([*e.quick_args, "--help"])
    assert exc.value.code == 0


def test_breakdown_runs_each_algorithm_into_its_own_file(fake, tmp_path):
    assert cli.main(["experiment", "breakdown", "--quick"]) == 0
    assert [c[1][:2] for c in fake] == [["--algo", "dqn"], ["--algo", "ppo"]]
    for (_, argv), algo in zip(fake, ("dqn", "ppo")):
        assert argv[argv.index("--out") + 1] == str(tmp_path / f"rllib_compare_{algo}_quick.json")
    runs = json.loads((tmp_path / "runs_quick.json").read_text())
    assert [Path(p).name for p in runs["breakdown --algo dqn"]["outputs"]] == ["rllib_compare_dqn_quick.json"]


def test_convergence_covers_sac_and_algo_narrows(fake, tmp_path):
    assert cli.main(["experiment", "convergence"]) == 0
    assert [c[1][1] for c in fake] == ["dqn", "ppo", "sac"]
    assert all("--quick" not in c[1] for c in fake)
    fake.clear()
    assert cli.main(["experiment", "breakdown", "--algo=sac", "--seeds", "0", "1"]) == 0
    assert fake == [("rllib_compare", ["--algo", "sac", "--seeds", "0", "1", "--out",
                                       str(tmp_path / "rllib_compare_sac.json")])]
    assert cli.main(["experiment", "breakdown", "--out", "x.json"]) == 2  # one file, two algorithms


def test_missing_rllib_extra_names_the_install_command(monkeypatch, capsys):
    monkeypatch.setattr(cli, "_missing", lambda modules: [m for m in modules if m in ("ray", "torch")])
    assert cli.main(["experiment", "breakdown", "--quick"]) == 2
    err = capsys.readouterr().err
    assert "ray, torch" in err and "pip install '.[rllib]'" in err


def test_outside_a_checkout_says_so(monkeypatch, capsys):
    monkeypatch.setattr(cli, "_import_experiment", lambda module, expects="main": (None, "run from a source checkout"))
    monkeypatch.setattr(cli, "_missing", lambda modules: [])
    assert cli.main(["experiment", "report"]) == 2
    assert "source checkout" in capsys.readouterr().err
    assert cli.main(["experiment", "--list"]) == 2  # the catalogue is in the checkout too
    assert "source checkout" in capsys.readouterr().err


def _cli(args, cwd):
    code = f"import sys; from conduit_jax import cli; sys.exit(cli.main({list(args)!r}))"
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=cwd,
                          check=False, env={**os.environ, "JAX_PLATFORMS": "cpu"})


def test_list_loads_the_catalogue_from_the_checkout_or_says_there_is_none(tmp_path):
    """From a subdirectory of the checkout (experiments/ not importable as such) the catalogue is found above; from
    outside any checkout the command fails with the reason and what to do."""
    inside = _cli(["experiment", "--list"], ROOT / "tests")
    assert inside.returncode == 0, inside.stderr
    assert [x.split()[0] for x in inside.stdout.splitlines()[1:len(catalogue.EXPERIMENTS) + 1]] == [
        e.name for e in catalogue.EXPERIMENTS]
    outside = _cli(["experiment", "--list"], tmp_path)
    assert outside.returncode == 2 and outside.stdout == ""
    assert "not part of the installed conduit-jax package" in outside.stderr and "checkout" in outside.stderr


def test_checkout_root_is_found_from_a_subdirectory(monkeypatch, tmp_path):
    (tmp_path / "experiments").mkdir()
    (tmp_path / "experiments" / "report.py").write_text("")
    deep = tmp_path / "a" / "b"
    deep.mkdir(parents=True)
    monkeypatch.chdir(deep)
    assert cli._checkout_root("experiments/report.py") == tmp_path
    monkeypatch.chdir(tmp_path / "a")
    assert cli._checkout_root("no/such/file.py") is None


def test_take_option():
    assert cli._take_option(["--algo", "sac", "--x"], "--algo") == ("sac", ["--x"])
    assert cli._take_option(["--algo=ppo"], "--algo") == ("ppo", [])
    assert cli._take_option(["--x"], "--algo") == (None, ["--x"])


def test_report_dispatches_to_the_real_module(tmp_path, monkeypatch):
    monkeypatch.chdir(ROOT)
    out = tmp_path / "REPORT.md"
    assert cli.main(["experiment", "report", "--results", str(tmp_path), "--bench-results", str(tmp_path),
                     "--out", str(out)]) == 0
    assert "Not run yet" in out.read_text()
    assert not (tmp_path / "runs.json").exists()  # regenerating the report is not an experiment run


def test_cli_import_leaves_experiments_and_frameworks_alone():
    code = ("import sys; from conduit_jax import cli; cli.build_parser(); "
            "print([m for m in ('experiments', 'torch', 'ray') if m in sys.modules])")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT, check=False,
                            env={**os.environ, "JAX_PLATFORMS": "cpu"})
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip().splitlines()[-1] == "[]"


def _run(args, timeout=120, **env):
    return subprocess.run([sys.executable, "-m", *args], capture_output=True, text=True, timeout=timeout, cwd=ROOT, check=False,
                          env={**os.environ, "JAX_PLATFORMS": "cpu", **env})


@pytest.mark.slow
def test_placement_sweep_smoke(tmp_path):
    pytest.importorskip("matplotlib")
    stem = tmp_path / "ps"
    result = _run(["experiments.placement_sweep", "--quick", "--batches", "64", "--capacity", "4096", "--no-progress",
                   "--out", str(stem)])
    assert result.returncode == 0, result.stderr[-2000:]
    report = json.loads(stem.with_suffix(".json").read_text())
    assert {r["memory_kind"] for r in report["records"]} == {"device", "pinned_host", "unpinned_host"}
    assert {r["shards"] for r in report["records"]} == {1, 8}
    row = report["planner"][0]
    assert row["predicted_delivery_s"] > 0 and row["measured_median_s"] > 0 and "regret" in row
    assert report["command"].startswith("python -m experiments.placement_sweep --quick")
    assert stem.with_suffix(".png").is_file()


def test_gpu_dry_run_placement_smoke(tmp_path):
    pytest.importorskip("matplotlib")
    result = _run(["experiments.gpu", "--dry-run", "--only", "placement", "--out-dir", str(tmp_path)])
    assert result.returncode == 0, result.stderr[-2000:]
    sweep = json.loads((tmp_path / "gpu_placement_sweep_quick.json").read_text())
    assert sweep["gpu"] is False and sweep["device"]["backend"] == "cpu"  # never marked as a GPU figure on CPU
    assert not (tmp_path / "gpu_placement_sweep.json").exists()
    run = json.loads((tmp_path / "gpu_run_quick.json").read_text())
    assert run["dry_run"] and not run["failed"]


def test_gpu_full_run_refuses_without_a_gpu(tmp_path):
    result = _run(["experiments.gpu", "--out-dir", str(tmp_path)])
    assert result.returncode == 2 and "no GPU here" in result.stderr


@pytest.mark.slow
def test_gpu_dry_run_breakdown_smoke(tmp_path):
    pytest.importorskip("matplotlib")
    result = _run(["experiments.gpu", "--dry-run", "--only", "breakdown", "--out-dir", str(tmp_path)], timeout=600)
    assert result.returncode == 0, result.stderr[-2000:]
    data = json.loads((tmp_path / "gpu_breakdown_quick.json").read_text())
    assert data["gpu"] is False and {r["variant"] for r in data["rows"]} == {"baseline", "+placement",
                                                                            "+scheduling", "full"}


@pytest.mark.slow
def test_ablation_quick_smoke(tmp_path):
    pytest.importorskip("matplotlib")
    stem = tmp_path / "ab"
    result = _run(["experiments.ablation", "--quick", "--only", "ppo", "--no-progress", "--out", str(stem)],
                  timeout=600)
    assert result.returncode == 0, result.stderr[-2000:]
    data = json.loads(stem.with_suffix(".json").read_text())
    variants = {r["variant"] for r in data["rows"]}
    assert variants == {"baseline", "+placement", "+scheduling", "full", "default_mesh"}
    assert data["verdict"] and data["noise"]["threshold"] >= 0.05


def test_bench_forwards_its_options_to_the_suite(monkeypatch):
    """``conduit bench`` hands its options to ``benchmarks.run.main`` as that script's own flags."""
    calls = []
    suite = types.SimpleNamespace(main=lambda argv: calls.append(list(argv)) or 0)
    monkeypatch.setattr(cli, "_import_benchmarks", lambda module: (suite, None))
    assert cli.main(["bench", "--quick", "--only", "w1,w2", "--no-plots", "--xla-threads", "default"]) == 0
    assert cli.main(["bench", "--rounds", "3"]) == 0
    assert calls == [["--quick", "--only", "w1,w2", "--no-plots", "--xla-threads", "default"], ["--rounds", "3"]]
