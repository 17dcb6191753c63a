"""experiments/scaling.py without Ray: the emulated-device half (the worker the full run starts in a subprocess, run
here in-process on the tests' 8 emulated devices), the cost model's price of the same device counts, the series the
figure plots, the caption and the figure itself, on synthetic results."""

from __future__ import annotations

import json

import pytest

from experiments import scaling


def _devices_half() -> dict:
    def row(n, ingest, batches, median_ms):
        return {"devices": n, "sampler": "uniform", "ingest_items_per_s": ingest, "sample_batches_per_s": batches,
                "sample_latency": {"median_ms": median_ms, "p90_ms": median_ms, "p99_ms": median_ms, "count": 10}}

    return {"sampler": "uniform", "counts": [1, 2, 4, 8], "xla_flags": scaling.FLAG, "phase_s": 0.1,
            # out of order on purpose: the series sort by device count
            "measured": [row(8, 2e6, 1500.0, 0.65), row(1, 1e7, 9000.0, 0.10), row(4, 3e6, 2600.0, 0.37),
                         row(2, 5e6, 4400.0, 0.21)],
            "predicted": scaling.predicted_devices([1, 2, 4, 8])}


def test_predicted_devices_prices_each_count_and_grows_with_shards():
    rows = scaling.predicted_devices([1, 2, 4, 8])
    assert [r["devices"] for r in rows] == [1, 2, 4, 8]
    assert [r["topology"] for r in rows] == [f"emulated_cpu:{n}" for n in (1, 2, 4, 8)]
    for r in rows:
        c = r["costs"]
        delivery = c["sample_s"] + c["gather_s"] + c["delivery_s"]
        assert r["sample_latency_ms"] == pytest.approx(delivery * 1e3)
        assert r["sample_batches_per_s"] == pytest.approx(1.0 / delivery)
        assert r["ingest_items_per_s"] == pytest.approx(scaling.INGEST_BATCH / c["ingest_s"])
        assert c["update_s"] == 0.0  # uniform: no priority updates
    # on one 2-core host every extra emulated device adds dispatch work: the model prices overhead, not speed-up
    latency = [r["sample_latency_ms"] for r in rows]
    ingest = [r["ingest_items_per_s"] for r in rows]
    assert latency == sorted(latency) and ingest == sorted(ingest, reverse=True)
    assert rows[0]["costs"]["delivery_s"] == 0.0 and rows[-1]["costs"]["delivery_s"] > 0.0  # reduce-scatter from 2


def test_device_series_sorts_and_scales():
    s = scaling.device_series(_devices_half())
    assert s["x"] == [1, 2, 4, 8] and s["predicted_x"] == [1, 2, 4, 8]
    assert s["ingest_k_items_per_s"] == pytest.approx([1e4, 5e3, 3e3, 2e3])
    assert s["sample_batches_per_s"] == [9000.0, 4400.0, 2600.0, 1500.0]
    assert s["sample_latency_ms"] == [0.10, 0.21, 0.37, 0.65]
    assert len(s["predicted_sample_latency_ms"]) == len(s["predicted_ingest_k_items_per_s"]) == 4


@pytest.mark.parametrize("half", [None, {}, {"measured": [], "predicted": []}])
def test_device_series_empty_without_the_device_half(half):
    assert all(v == [] for v in scaling.device_series(half).values())


def test_caption_has_the_command_and_says_what_the_devices_show():
    results = {"command": "python -m experiments.scaling --quick", "wall_s": 95.0,
               "host": {"cpus": 2, "jax": "0.10.2", "date": "2026-01-01T00:00:00+00:00"},
               "emulated_devices": _devices_half()}
    text = scaling.caption(results)
    assert text.startswith("command: python -m experiments.scaling --quick | run time 95 s")
    assert "share this host's 2 CPU cores" in text and "sharding overhead, not speed-up" in text
    results["emulated_devices"] = None
    assert "emulated" not in scaling.caption(results)


def test_devices_worker_writes_the_rows_device_series_reads(tmp_path):
    out = tmp_path / "devices.json"
    assert scaling.main(["--devices-worker", str(out), "--phase-s", "0.05", "--devices", "1", "2"]) == 0
    rows = json.loads(out.read_text())
    assert [r["devices"] for r in rows] == [1, 2]
    for r in rows:
        assert r["sampler"] == "uniform" and r["ingest_items_per_s"] > 0 and r["sample_batches_per_s"] > 0
        assert r["sample_latency"]["count"] >= 1
    s = scaling.device_series({"measured": rows, "predicted": scaling.predicted_devices([1, 2])})
    assert s["x"] == [1, 2] and len(s["sample_latency_ms"]) == 2


def test_plot_writes_a_png_with_only_the_device_half(tmp_path):
    pytest.importorskip("matplotlib")
    results = {"command": "python -m experiments.scaling --actors", "wall_s": 20.0, "host": {"cpus": 2},
               "measured": [], "predicted": {"uniform": scaling.predicted("uniform")[:2]},
               "emulated_devices": _devices_half()}
    path = tmp_path / "scaling.png"
    scaling.plot(results, path)
    assert path.stat().st_size > 10_000
