"""experiments/rllib_compare.py without Ray: the breakdown summary, the convergence statistics (Welch's t-test on a
pure-Python incomplete beta), the default output paths and the figure, on synthetic runs."""

from __future__ import annotations

import math
import random

import pytest

from experiments import rllib_compare as rc


# ------------------------------------------------------------------------------------------------------------------
# Student's t and Welch's test
# ------------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("t", [0.0, 0.3, 1.0, 2.5, -4.0, 12.0])
def test_t_two_sided_p_matches_closed_forms(t):
    # dof 1 (Cauchy): p = 1 - 2/pi atan|t|; dof 2: p = 1 - |t| / sqrt(2 + t^2)
    assert rc.t_two_sided_p(t, 1.0) == pytest.approx(1 - 2 / math.pi * math.atan(abs(t)), rel=1e-10, abs=1e-13)
    assert rc.t_two_sided_p(t, 2.0) == pytest.approx(1 - abs(t) / math.sqrt(2 + t * t), rel=1e-10, abs=1e-13)
    # dof 4: F(t) = 1/2 + 3/8 u (1 - u^2 / 12) with u = t / sqrt(1 + t^2 / 4)... written via x = t^2 / (4 + t^2)
    x = t * t / (4 + t * t)
    assert rc.t_two_sided_p(t, 4.0) == pytest.approx(1 - math.sqrt(x) * (3 - x) / 2, rel=1e-10, abs=1e-13)
    assert rc.t_two_sided_p(math.inf, 3.0) == 0.0


def test_betainc_edges_and_symmetry():
    assert rc.betainc(2.0, 3.0, 0.0) == 0.0 and rc.betainc(2.0, 3.0, 1.0) == 1.0
    for a, b, x in ((0.5, 0.5, 0.3), (2.5, 0.5, 0.9), (7.0, 3.0, 0.4)):
        assert rc.betainc(a, b, x) + rc.betainc(b, a, 1 - x) == pytest.approx(1.0, abs=1e-12)
    assert rc.betainc(1.0, 1.0, 0.37) == pytest.approx(0.37)  # uniform
    assert rc.betainc(2.0, 1.0, 0.5) == pytest.approx(0.25)  # I_x(2, 1) = x^2


def test_welch_by_hand():
    # means 2 and 5, variances 1 and 1: t = -3 / sqrt(2/3), dof = (2/3)^2 / (2 (1/3)^2 / 2) = 4
    w = rc.welch_t_test([1, 2, 3], [4, 5, 6])
    assert w["t"] == pytest.approx(-3 / math.sqrt(2 / 3))
    assert w["dof"] == pytest.approx(4.0)
    x = w["t"] ** 2 / (4 + w["t"] ** 2)
    assert w["p"] == pytest.approx(1 - math.sqrt(x) * (3 - x) / 2)
    assert w["n"] == [3, 3]


def test_welch_degenerate_cases():
    assert rc.welch_t_test([1.0], [2.0, 3.0])["p"] is None
    assert rc.welch_t_test([1.0, 1.0], [1.0, 1.0]) == {"t": 0.0, "dof": None, "p": 1.0, "n": [2, 2]}
    w = rc.welch_t_test([1.0, 1.0], [2.0, 2.0])
    assert w["t"] == -math.inf and w["p"] == 0.0


def test_welch_matches_scipy():
    stats = pytest.importorskip("scipy.stats")
    rng = random.Random(0)
    for n_a, n_b, spread in ((3, 3, 1.0), (3, 5, 30.0), (4, 7, 0.1), (10, 2, 5.0)):
        a = [rng.gauss(0, 1) * spread for _ in range(n_a)]
        b = [rng.gauss(0.5, 2) * spread for _ in range(n_b)]
        w = rc.welch_t_test(a, b)
        ref = stats.ttest_ind(a, b, equal_var=False)
        assert w["t"] == pytest.approx(ref.statistic, rel=1e-9)
        assert w["p"] == pytest.approx(ref.pvalue, rel=1e-7)
        assert w["dof"] == pytest.approx(ref.df, rel=1e-9)


# ------------------------------------------------------------------------------------------------------------------
# summary on synthetic runs
# ------------------------------------------------------------------------------------------------------------------
def _synthetic_runs(seeds=(0, 1, 2), iterations=6, warmup=2):
    runs = []
    for seed in seeds:
        for path in rc.PATHS:
            scale = 1.0 if path == "native" else 0.6
            rows = []
            for i in range(iterations):
                parts = {"buffer_add": 0.1 * scale, "buffer_sample": 0.4 * scale, "priority_update": 0.1 * scale,
                         "to_batch": 0.2 * scale, "minibatching": 0.0, "learner_update": 1.0, "other": 0.5 + 0.01 * i}
                parts["iteration"] = sum(parts.values())
                parts["updates"] = 100
                rows.append(parts)
            total = warmup + iterations
            returns = [None] + [-1500.0 + 150 * i + 10 * seed + (5 if path == "conduit" else 0)
                                for i in range(1, total)]
            runs.append({"path": path, "seed": seed, "iterations": rows, "returns": returns,
                         "env_steps": [1000 * (i + 1) for i in range(total)]})
    return runs


def test_summarize_breakdown_and_convergence():
    runs = _synthetic_runs()
    summary = rc.summarize(runs, final_iterations=3)
    native, conduit = summary["native"], summary["conduit"]
    assert native["iterations_measured"] == 18
    assert native["experience_path_s"]["median"] == pytest.approx(0.8)
    assert conduit["experience_path_s"]["median"] == pytest.approx(0.48)
    change = summary["conduit_vs_native"]
    assert change["experience_path_change"] == pytest.approx(-0.4)
    assert change["iteration_latency_change"] == pytest.approx(
        conduit["median_s"]["iteration"] / native["median_s"]["iteration"] - 1)
    assert 0 < native["experience_path_share"]["median"] < 1

    conv = summary["convergence"]
    assert conv["final_iterations"] == 3
    # returns at iterations 5, 6, 7: -1500 + 150 * (5, 6, 7) -> mean -600, plus 10 * seed (+5 for conduit)
    expected = {"native": [-600.0, -590.0, -580.0], "conduit": [-595.0, -585.0, -575.0]}
    for path, values in expected.items():
        assert list(conv[path]["final_return_per_seed"].values()) == pytest.approx(values)
        assert conv[path]["mean"] == pytest.approx(sum(values) / 3)
        assert conv[path]["std"] == pytest.approx(10.0)
        assert len(conv[path]["curves"]) == 3
        curve = conv[path]["curves"][0]
        assert curve["iteration"] == list(range(8)) and curve["env_steps"][-1] == 8000 and curve["return"][0] is None
    welch = conv["welch_native_vs_conduit"]
    assert welch["t"] == pytest.approx(-5 / math.sqrt(2 * 100 / 3))
    assert welch["dof"] == pytest.approx(4.0)
    assert 0 < welch["p"] < 1
    assert "conduit vs native" in rc._table(summary) and "Welch" in rc._table(summary)


def test_final_return_skips_missing_returns():
    assert rc.final_return([None, None, 3.0, None, 5.0], 3) == 4.0
    assert rc.final_return([1.0, None, None], 2) is None
    assert rc.final_return([], 5) is None


def test_parse_args_defaults_and_output_paths():
    args = rc.parse_args(["--algo", "sac", "--quick"])
    assert args.seeds == [0] and args.final_iterations == 2 and args.fcnet_hiddens
    full = rc.parse_args(["--algo", "sac", "--iterations", "3", "--train-batch-size", "64"])
    assert full.seeds == [0, 1, 2] and full.iterations == 3 and full.train_batch_size == 64
    assert rc.parse_args(["--algo", "dqn"]).train_batch_size == 32
    assert rc.parse_args(["--algo", "dqn"]).paths == ["native", "conduit", "conduit_scheduled"]  # type_swap: opt in
    assert rc.parse_args(["--paths", "native", "type_swap"]).paths == ["native", "type_swap"]
    with pytest.raises(SystemExit):
        rc.parse_args(["--algo", "ppo", "--paths", "native", "type_swap"])
    assert rc.default_out("sac", False).name == "rllib_compare_sac.json"
    assert rc.default_out("ppo", True).name == "rllib_compare_ppo_quick.json"
    assert rc.default_out("dqn", False).parent.name == "results"


def test_plot_writes_png(tmp_path):
    pytest.importorskip("matplotlib")
    runs = _synthetic_runs(seeds=(0, 1))
    result = {"command": "python -m experiments.rllib_compare --algo sac --seeds 0 1",
              "config": vars(rc.parse_args(["--algo", "sac", "--seeds", "0", "1"])),
              "summary": rc.summarize(runs, 2), "runs": runs, "versions": {"ray": "2.60"}}
    png = rc.write(result, tmp_path / "rllib_compare_sac.json")
    assert png == tmp_path / "rllib_compare_sac.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000
    assert (tmp_path / "rllib_compare_sac.json").exists()
    # re-summarize and re-plot from the JSON (no Ray)
    again = rc.main(["--algo", "sac", "--from-json", str(tmp_path / "rllib_compare_sac.json"),
                     "--final-iterations", "3"])
    assert again["summary"]["convergence"]["final_iterations"] == 3


def test_plot_handles_one_path_and_one_seed(tmp_path):
    pytest.importorskip("matplotlib")
    runs = [r for r in _synthetic_runs(seeds=(0,)) if r["path"] == "native"]
    result = {"config": {"algo": "dqn", "seeds": [0], "quick": True, "smoothing": 10},
              "summary": rc.summarize(runs, 2), "runs": runs}
    rc.plot(result, tmp_path / "one.png")
    assert (tmp_path / "one.png").stat().st_size > 0
