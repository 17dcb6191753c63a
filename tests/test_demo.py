"""The demo and the `conduit` command: counts in the summary agree with each other and with the plane."""

import json
import math

import pytest

from conduit_jax import cli
from conduit_jax.demo import STAGES, DemoConfig, run_demo
from conduit_jax.errors import ConfigError

TINY = DemoConfig(iterations=20, num_actors=2, envs_per_actor=16, batch_size=32, capacity=512, hidden=16,
                  progress=False)


def _check_counts(summary, config):
    per_iteration = config.num_actors * config.envs_per_actor
    assert summary["items_per_iteration"] == per_iteration
    assert summary["items_in"] == config.iterations * per_iteration
    assert summary["ingest_calls"] == config.iterations * config.num_actors
    assert summary["batches_delivered"] == config.iterations == summary["learner_steps"]
    assert summary["items_delivered"] == config.iterations * config.batch_size
    stats = summary["plane_stats"]
    assert stats["items_inserted"] == summary["items_in"]
    assert stats["size"] == summary["items_stored"] == min(summary["items_in"], config.capacity)
    assert summary["items_overwritten"] == stats["items_overwritten"] == max(0, summary["items_in"] - config.capacity)
    assert stats["stages"]["ingest"]["calls"] == summary["ingest_calls"]
    assert stats["stages"]["sample"]["calls"] == summary["batches_delivered"]
    assert math.isfinite(summary["loss_first"]) and math.isfinite(summary["loss_last"])


@pytest.mark.parametrize("devices", [None, 1])
def test_uniform_counts_and_latency(devices):
    config = DemoConfig(**{**TINY.__dict__, "devices": devices})
    summary = run_demo(config)
    _check_counts(summary, config)
    assert summary["num_devices"] == (8 if devices is None else 1)
    assert summary["items_overwritten"] > 0  # 640 items into a 512-item ring
    assert summary["steady_iterations"] == config.iterations - 1  # the first iteration compiles
    assert set(summary["latency_us"]) == {*STAGES, "iteration"}
    for row in summary["latency_us"].values():
        assert 0 < row["median"] <= row["p99"]
    assert 0 < summary["experience_path_share"] < 1
    json.dumps(summary)  # the summary is JSON-friendly


def test_fifo_delivers_every_item_once():
    config = DemoConfig(**{**TINY.__dict__, "sampler": "fifo"})  # 32 in and 32 out per iteration
    summary = run_demo(config)
    _check_counts(summary, config)
    assert summary["items_delivered"] == summary["items_in"]


def test_bad_config_is_refused_with_the_fix():
    with pytest.raises(ConfigError, match="--batch-size 32"):
        run_demo(DemoConfig(**{**TINY.__dict__, "sampler": "fifo", "batch_size": 16}))
    with pytest.raises(ConfigError, match="sampler must be one of"):
        run_demo(DemoConfig(**{**TINY.__dict__, "sampler": "lifo"}))


def test_cli_demo_json(capsys):
    rc = cli.main(["demo", "--iterations", "3", "--actors", "1", "--envs-per-actor", "16", "--batch-size", "16",
                   "--capacity", "256", "--json", "--no-progress"])
    assert rc == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["items_in"] == 48 and summary["batches_delivered"] == 3
    assert summary["num_devices"] == 8


def test_cli_reports_plane_errors(capsys):
    rc = cli.main(["demo", "--iterations", "1", "--capacity", "1001", "--no-progress"])
    assert rc == 2
    assert "capacity 1001 is not a multiple" in capsys.readouterr().err


def test_configure_devices_respects_the_user(monkeypatch):
    monkeypatch.setenv("XLA_FLAGS", "--xla_force_host_platform_device_count=3")
    assert cli.configure_devices(8) is None
    assert cli.os.environ["XLA_FLAGS"] == "--xla_force_host_platform_device_count=3"
    monkeypatch.setenv("XLA_FLAGS", "--xla_cpu_use_thunk_runtime=true")
    # this test process already started its backend: too late to change the count, and it says so
    assert "already running" in cli.configure_devices(8)
