"""The experiment catalogue: every experiment ``conduit experiment`` lists and runs, in one place.

Each entry names a script of this folder (``python -m experiments.<module>``), the paper claim it answers, the
result files it writes and what it needs. It types no run times: ``conduit experiment --list`` prints this table with
the wall time of each entry's last recorded run (``results/runs.json``, ``runs_quick.json`` for ``--quick``, or the
``wall_s`` its result file records); ``conduit experiment NAME [--quick] [script options]`` runs an entry.
To add an experiment: write ``experiments/<module>.py`` with a ``main(argv)``, then add an ``Experiment`` here.

This module is data only (it imports nothing but ``typing``; the experiments themselves are imported only to run).
The ``conduit`` command loads it from the checkout, as it loads the scripts: ``experiments/`` is not part of the
installed package.
"""

from __future__ import annotations

from typing import NamedTuple


class Experiment(NamedTuple):
    """One experiment: ``python -m experiments.<module>``."""

    name: str
    module: str
    claim: str  # the paper claim it answers ("all": every one; "-": none, a tool or a runtime demonstration)
    help: str
    outputs: tuple[str, ...] = ()  # result stems in experiments/results/ (quick runs add "_quick"); the first one's
    # wall_s is the whole run's
    needs: tuple[str, ...] = ()  # modules beyond the core the run imports (an extra)
    devices: int | None = None  # emulated CPU devices to ask XLA for before JAX starts
    algos: tuple[str, ...] = ()  # rllib_compare: one run per algorithm unless --algo names one
    quick_flags: tuple[str, ...] = ("--quick",)  # script options that make a short run (recorded apart)
    quick_args: tuple[str, ...] = ("--quick",)  # what `conduit experiment NAME --quick` passes to the script


_RLLIB = ("ray", "torch", "conduit_rllib", "matplotlib")

EXPERIMENTS: tuple[Experiment, ...] = (
    Experiment("breakdown", "rllib_compare", "1, 2",
               "RLlib native vs Conduit, per-stage iteration breakdown and experience-path share (DQN, PPO; "
               "--algo dqn|ppo|sac for one)",
               needs=_RLLIB, algos=("dqn", "ppo")),
    Experiment("scheduling", "scheduling", "2",
               "delivery schedules (sync/overlap/deferred/adaptive/fused) on the JAX learners: exposed and iteration "
               "latency", outputs=("scheduling",), needs=("matplotlib",)),
    Experiment("ablation", "ablation", "2",
               "baseline / + placement / + scheduling / full on the JAX learners (DQN + PER, PPO)",
               outputs=("ablation",), needs=("matplotlib",), devices=8),
    Experiment("placement", "placement_sweep", "3",
               "delivery latency vs batch bytes per memory kind and shard count; the planner's choice and its "
               "predicted cost beside the measured one", outputs=("placement_sweep",),
               needs=("matplotlib",), devices=8),
    Experiment("scaling", "scaling", "4",
               "1 -> 8 emulated devices and 1 -> 4 Ray shard actors measured here, the cost model up to 1,024 GPUs",
               outputs=("scaling",), needs=("ray", "matplotlib")),
    Experiment("convergence", "rllib_compare", "5",
               "learning curves over 3 seeds with and without Conduit, Welch's t-test of final returns (DQN, PPO, "
               "SAC; --algo for one)", needs=_RLLIB, algos=("dqn", "ppo", "sac")),
    Experiment("gpu", "gpu", "6",
               "on one NVIDIA GPU (H200): the JAX learners' breakdown and the placement sweep in device / pinned_host "
               "/ unpinned_host memory (--dry-run: small, on CPU)",
               outputs=("gpu_run", "gpu_breakdown", "gpu_placement_sweep"), needs=("matplotlib",),
               quick_flags=("--quick", "--dry-run")),
    Experiment("rllib_schedules", "rllib_schedules", "2",
               "RLlib's off-policy loop through the buffers' API: native PER vs Conduit under sync / overlap / "
               "deferred / adaptive, 1 and 4 learner updates per env round, exposed and iteration time",
               outputs=("rllib_schedules",), needs=_RLLIB[:3]),
    Experiment("jitted", "jitted", "-",
               "a fully jitted learner: env step, add, sample, priority update and learner step in one lax.scan "
               "(--algo dqn|dqn-per|ppo, --buffer conduit|flashbax); prints a JSON summary, --json FILE keeps it",
               # --quick: 10k env steps (the script has no --quick of its own)
               quick_flags=(), quick_args=("--total-env-steps", "10000")),
    Experiment("grpo", "grpo", "-",
               "GRPO end to end (a tiny transformer sorts digits): naive vs Conduit padded vs packed rollouts, "
               "synchronous and overlapped; packing efficiency, learner tokens/s, exposed path, reward curves over 3 "
               "seeds", outputs=("grpo",), needs=("matplotlib",)),
    Experiment("report", "report", "all", "regenerate experiments/REPORT.md from the JSON in experiments/results/"),
)
