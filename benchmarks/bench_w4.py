"""W4: the PPO experience path.

A rollout of 64 envs x 256 steps = 16,384 items of obs f32[64], act i32, logp f32, value f32, reward f32, done bool
(273 raw bytes; 4.5 MB). One PPO iteration: store the rollout, then 4 epochs x 4 shuffled minibatches of 4,096, each
minibatch ready (JAX results blocked on); every item is delivered once per epoch.

Contenders:
  * ``conduit[1dev]``: a plane of capacity 16,384 with ``samplers.epochs(4096)``; ``ingest`` the rollout, 16 x
    ``sample()``;
  * ``conduit[fused-jit]``: the same plane, the 16 minibatches in one jitted call of ``plane.sample_fn(batches=16)``
    (state donated; one gather per leaf): what a learner that samples inside its own jitted update pays;
  * ``numpy``: per-leaf arrays, ``rng.permutation`` per epoch, a fancy-index gather per leaf per minibatch (CleanRL);
  * ``jax-shuffle(purejaxrl)``: ``device_put`` of the rollout, then one jitted ``lax.scan`` over epochs of
    ``jax.random.permutation`` + gather + reshape into minibatches (PureJaxRL's update);
  * ``torchrl``: ``ReplayBuffer(LazyTensorStorage, SamplerWithoutReplacement, batch_size=4096)``, ``extend`` +
    16 x ``sample()``.

Metrics: the whole iteration (the goal: <= 1.0x NumPy), and apart the rollout store and one minibatch. "% of memcpy"
of the iteration counts the rollout written once and read four times (5 x 4.5 MB).

    python -m benchmarks.bench_w4 [--quick] [--rounds R]
"""

from __future__ import annotations

import itertools

import numpy as np

from benchmarks import common, peers

ENVS, STEPS = 64, 256
ROLLOUT = ENVS * STEPS
MINIBATCH, EPOCHS = 4096, 4
W4_SPEC = {
    "obs": ((64,), np.float32),
    "act": ((), np.int32),
    "logp": ((), np.float32),
    "value": ((), np.float32),
    "reward": ((), np.float32),
    "done": ((), np.bool_),
}
POOL = 4  # distinct rollouts cycled through


def settings_for(quick: bool, capacity=None, rounds=None) -> common.Settings:
    # the rollout size is the workload: --capacity is not used (a PPO buffer holds exactly one rollout)
    if quick:
        s = common.Settings(capacity=ROLLOUT, batch_size=MINIBATCH, chunk=ROLLOUT, rounds=2, sample_reps=4,
                            add_reps=4, quick=True)
    else:
        s = common.Settings(capacity=ROLLOUT, batch_size=MINIBATCH, chunk=ROLLOUT, rounds=12, sample_reps=30,
                            add_reps=30)
    if rounds is not None:
        s.rounds = rounds
    return s


def _cycle(contender):
    prepared = contender._prepared if hasattr(contender, "_prepared") else contender.base._prepared
    counter = itertools.count()
    return prepared, counter


def _iteration_op(contender, pools):
    prepared, counter = _cycle(contender)
    n = len(prepared)
    return lambda: contender.iterate(prepared[next(counter) % n])


def _add_op(contender, pools):
    prepared, counter = _cycle(contender)
    n = len(prepared)
    return lambda: contender.add(prepared[next(counter) % n])


def _minibatch_op(contender, pools):
    return contender.minibatch


def entries() -> list[common.Entry]:
    spec, n, mb, ep = W4_SPEC, ROLLOUT, MINIBATCH, EPOCHS
    return [
        common.Entry("conduit[1dev]", lambda: peers.ConduitEpochs(spec, n, mb, ep)),
        common.Entry("conduit[fused-jit]", lambda built: peers.ConduitFusedEpochs(built["conduit[1dev]"]),
                     derived=True),
        common.Entry("numpy", lambda: peers.NumpyEpochs(spec, n, mb, ep)),
        common.Entry("jax-shuffle(purejaxrl)", lambda: peers.JaxShuffleEpochs(spec, n, mb, ep)),
        common.Entry("torchrl", lambda: peers.TorchRLEpochs(spec, n, mb, ep)),
    ]


GOALS = [
    common.Goal("W4 PPO iteration <= 1.0x NumPy", "ratio", "ppo_iteration", 1.0, peer="numpy"),
    common.Goal("W4 PPO iteration, minibatches drawn in the learner's jit (sample_fn(batches=16)) <= 1.0x NumPy",
                "ratio", "ppo_iteration", 1.0, peer="numpy", contender="conduit[fused-jit]"),
    common.Goal("W4 zero recompiles after warm-up", "recompiles", "ppo_iteration", 0),
]


def random_rollout(rng: np.random.Generator) -> dict:
    out = peers.random_batch(W4_SPEC, ROLLOUT, rng)
    out["act"] = rng.integers(0, 18, ROLLOUT, dtype=np.int32)
    out["done"] = rng.random(ROLLOUT) < 1 / 500
    return out


def run(settings: common.Settings) -> list[dict]:
    common.configure_runtime("w4")
    rng = np.random.default_rng(4)
    pools = {"chunks": [random_rollout(rng) for _ in range(POOL)]}
    item = peers.item_bytes(W4_SPEC)
    steps = EPOCHS * (ROLLOUT // MINIBATCH)
    not_fused = lambda c: not isinstance(c, peers.ConduitFusedEpochs)  # noqa: E731
    per_minibatch = lambda c: not isinstance(c, (peers.ConduitFusedEpochs, peers.JaxShuffleEpochs))  # noqa: E731
    metrics = [
        common.Metric("ppo_iteration", f"PPO iteration: store {ROLLOUT:,} items + {EPOCHS} epochs x "
                      f"{ROLLOUT // MINIBATCH} minibatches of {MINIBATCH:,}", "samples/s", steps * MINIBATCH,
                      _iteration_op, reps=settings.sample_reps // 3 or 1,
                      bytes_per_call=(EPOCHS + 1) * ROLLOUT * item,
                      extra={"bytes_note": "rollout written once + read once per epoch"}),
        common.Metric(f"store_rollout{ROLLOUT}", f"store one rollout of {ROLLOUT:,} items", "items/s", ROLLOUT,
                      _add_op, applies=not_fused, reps=settings.add_reps, first_from_fill=True),
        common.Metric(f"minibatch_b{MINIBATCH}", f"one shuffled minibatch of {MINIBATCH:,} (ready)", "samples/s",
                      MINIBATCH, _minibatch_op, applies=per_minibatch, reps=settings.sample_reps),
    ]
    status = peers.torchrl_status()
    notes = {
        "iteration": f"{EPOCHS} epochs x {ROLLOUT // MINIBATCH} minibatches, each delivered ready; % memcpy counts "
                     f"{EPOCHS + 1} x the rollout's {ROLLOUT * item / 1e6:.2f} MB",
        "jax-shuffle(purejaxrl)": "device_put of the rollout + one jitted lax.scan of jax.random.permutation + gather "
                                  "per epoch; all minibatches from one call (no per-minibatch row)",
        "conduit[fused-jit]": "plane.ingest + one jit of plane.sample_fn(batches=16) with the state donated "
                              "(no per-minibatch row)",
        "torchrl": status["torchrl"],
    }
    return common.run_workload(
        "w4", f"PPO rollout {ENVS} envs x {STEPS} steps, {EPOCHS} epochs x {ROLLOUT // MINIBATCH} minibatches of "
              f"{MINIBATCH:,}", W4_SPEC, settings, entries(), metrics, pools=pools, notes=notes, goals=GOALS)


def main(argv=None):
    parser = common.workload_parser(__doc__, capacity=False)
    args = parser.parse_args(argv)
    run(settings_for(args.quick, None, args.rounds))


if __name__ == "__main__":
    main()
