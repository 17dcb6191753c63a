"""The demo and the `conduit` command: counts in the summary agree with each other and with each run's plane, both
schedules run the same workload, and the trace and plot hold what they say."""

import json
import math

import pytest

from conduit_jax import cli
from conduit_jax.demo import STAGES, DemoConfig, format_summary, run_demo
from conduit_jax.errors import ConfigError

TINY = DemoConfig(iterations=20, num_actors=2, envs_per_actor=16, batch_size=32, capacity=512, hidden=16, rounds=2,
                  warmup=2, progress=False)


def _tiny(**changes) -> DemoConfig:
    return DemoConfig(**{**TINY.__dict__, **changes})


def _check_counts(run, config):
    per_iteration = config.num_actors * config.envs_per_actor
    assert run["items_in"] == config.iterations * per_iteration
    assert run["ingest_calls"] == config.iterations * config.num_actors
    assert run["batches_delivered"] == config.iterations == run["learner_steps"]
    assert run["items_delivered"] == config.iterations * config.batch_size
    stats = run["plane_stats"]
    assert stats["items_inserted"] == run["items_in"]
    assert stats["size"] == run["items_stored"] == min(run["items_in"], config.capacity)
    assert run["items_overwritten"] == stats["items_overwritten"] == max(0, run["items_in"] - config.capacity)
    assert stats["stages"]["ingest"]["calls"] == run["ingest_calls"]
    # a prefetching schedule may have drawn batches it never delivered (in flight when the run ended)
    assert run["batches_delivered"] <= stats["stages"]["sample"]["calls"] <= run["batches_delivered"] + config.depth
    assert math.isfinite(run["loss_first"]) and math.isfinite(run["loss_last"])


@pytest.mark.parametrize("devices", [None, 8])
def test_both_schedules_run_the_same_workload(devices):
    config = _tiny(devices=devices)
    summary = run_demo(config)
    assert list(summary["runs"]) == ["sync", "overlap"]
    assert summary["placement"]["source"] == ("planner" if devices is None else "--devices")
    assert summary["num_devices"] == summary["placement"]["devices"] == (devices or summary["num_devices"])
    for name, run in summary["runs"].items():
        _check_counts(run, config)
        assert run["schedule"] == name
        assert run["items_overwritten"] > 0  # 640 items into a 512-item ring
        assert run["steady_iterations"] == config.iterations - 1 - config.warmup  # the first one compiles
        assert set(run["latency_us"]) == {*STAGES, "exposed", "iteration"}
        for row in run["latency_us"].values():
            assert 0 < row["median"] <= row["p99"] and row["mean"] > 0
    sync, overlap = summary["runs"].values()
    assert sync["items_in"] == overlap["items_in"] and sync["episodes_ended"] == overlap["episodes_ended"]  # same actors
    cut = summary["cut"]
    expected = 1 - overlap["latency_us"]["exposed"]["mean"] / sync["latency_us"]["exposed"]["mean"]  # ingest + deliver
    assert cut["exposed"] == pytest.approx(expected) and math.isfinite(cut["iteration"])
    assert cut["deliver"] == pytest.approx(1 - overlap["latency_us"]["deliver"]["mean"] /
                                           sync["latency_us"]["deliver"]["mean"])
    report = format_summary(summary)
    assert "schedule sync:" in report and "schedule overlap:" in report and "overlap against sync" in report
    json.dumps(summary)  # the summary is JSON-friendly


def test_sync_alone_reports_no_cut():
    summary = run_demo(_tiny(schedule="sync", iterations=6, rounds=1))
    assert list(summary["runs"]) == ["sync"] and summary["cut"] is None
    assert "against sync" not in format_summary(summary)


def test_fifo_delivers_every_item_once_under_both_schedules():
    config = _tiny(sampler="fifo")  # 32 in and 32 out per iteration
    summary = run_demo(config)
    for run in summary["runs"].values():
        _check_counts(run, config)
        assert run["items_delivered"] == run["items_in"]


def test_trace_and_plot_are_written(tmp_path):
    trace, plot = tmp_path / "demo.json", tmp_path / "demo.png"
    summary = run_demo(_tiny(iterations=8, rounds=2, trace=str(trace), plot=str(plot)))
    events = json.loads(trace.read_text())["traceEvents"]
    names = {e["args"]["name"] for e in events if e["ph"] == "M"}
    assert names == {"schedule sync", "schedule overlap"}
    for pid, run in enumerate(summary["runs"].values()):
        spans = [e for e in events if e["pid"] == pid and e["ph"] == "X"]
        assert sum(e["name"] == "exposed" for e in spans) == run["batches_delivered"]
        assert sum(e["name"] == "learner step" for e in spans) == run["learner_steps"]
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert f"trace written to {trace}" in format_summary(summary)


def test_bad_config_is_refused_with_the_fix():
    with pytest.raises(ConfigError, match="--batch-size 32"):
        run_demo(_tiny(sampler="fifo", batch_size=16))
    with pytest.raises(ConfigError, match="sampler must be one of"):
        run_demo(_tiny(sampler="lifo"))
    with pytest.raises(ConfigError, match="schedule must be one of"):
        run_demo(_tiny(schedule="eager"))
    with pytest.raises(ConfigError, match="rounds"):
        run_demo(_tiny(iterations=2, rounds=3))


def test_cli_demo_json(capsys):
    rc = cli.main(["demo", "--iterations", "3", "--rounds", "1", "--actors", "1", "--envs-per-actor", "16",
                   "--batch-size", "16", "--capacity", "256", "--hidden", "16", "--devices", "8", "--json",
                   "--no-progress"])
    assert rc == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["num_devices"] == 8
    for run in summary["runs"].values():
        assert run["items_in"] == 48 and run["batches_delivered"] == 3


def test_cli_reports_plane_errors(capsys):
    rc = cli.main(["demo", "--iterations", "1", "--rounds", "1", "--capacity", "1001", "--devices", "8",
                   "--no-progress"])
    assert rc == 2
    assert "capacity 1001 is not a multiple" in capsys.readouterr().err


def test_configure_devices_respects_the_user(monkeypatch):
    monkeypatch.setenv("XLA_FLAGS", "--xla_force_host_platform_device_count=3")
    assert cli.configure_devices(8) is None
    assert cli.os.environ["XLA_FLAGS"] == "--xla_force_host_platform_device_count=3"
    monkeypatch.setenv("XLA_FLAGS", "--xla_cpu_use_thunk_runtime=true")
    # this test process already started its backend: too late to change the count, and it says so
    assert "already running" in cli.configure_devices(8)
