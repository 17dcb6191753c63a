"""W5: sequences of 32 consecutive steps for recurrent learners.

Item (one step of one environment): obs f32[39], act f32[4], rew f32, terminated bool, truncated bool (178 raw bytes).
16 environments (streams); capacity 1,000,000 steps in all (62,500 per stream), filled with random data (episode
ends rare: 1/500 steps); add in chunks of 64 steps x 16 envs = 1,024 items, time-major; sample a batch of 64
windows of 32 steps (2,048 steps, 364 KB), batch ready.

Contenders:
  * ``conduit[1dev]``: ``samplers.sequences(64, 32, streams=16, pad=True)``: uniform over every stored window,
    windows may cross an episode end (``Delivery.mask`` marks the steps of the first episode), as Flashbax's and the
    NumPy windows do;
  * ``flashbax-trajectory``: ``make_trajectory_buffer(add_batch_size=16, sample_sequence_length=32, period=1)``;
    chunks transposed to [envs, steps] outside the timing;
  * ``numpy-windows``: per-leaf rings laid out [envs, steps, ...], one fancy-index gather of [64, 32] (env, step)
    pairs per leaf;
  * ``torchrl-slices``: ``TensorDictReplayBuffer(LazyTensorStorage(capacity, ndim=2), SliceSampler(slice_len=32,
    end_key="episode_end"))``, chunks as [envs, steps] TensorDicts (outside the timing); ``episode_end`` is a never-set
    bool stored with the data (1 B per step), so windows may cross an episode end as the others' do.
cpprb has no window sampler; it is not part of this workload.

    python -m benchmarks.bench_w5 [--quick] [--capacity N] [--rounds R]
"""

from __future__ import annotations


import numpy as np

from benchmarks import common, peers
from benchmarks.bench_w1 import add_op

W5_SPEC = {
    "obs": ((39,), np.float32),
    "act": ((4,), np.float32),
    "rew": ((), np.float32),
    "terminated": ((), np.bool_),
    "truncated": ((), np.bool_),
}
STREAMS, LENGTH, BATCH = 16, 32, 64
CHUNK_STEPS = 64
POOL_CHUNKS = 16


def settings_for(quick: bool, capacity=None, rounds=None) -> common.Settings:
    chunk = CHUNK_STEPS * STREAMS
    if quick:
        s = common.Settings(capacity=20_480, batch_size=BATCH, chunk=chunk, rounds=2, sample_reps=10, add_reps=5,
                            quick=True)
    else:
        s = common.Settings(capacity=1_000_000, batch_size=BATCH, chunk=chunk, rounds=16, sample_reps=150,
                            add_reps=50)
    if capacity is not None:
        s.capacity = capacity
    if rounds is not None:
        s.rounds = rounds
    if s.capacity % STREAMS:
        raise SystemExit(f"w5: --capacity must be a multiple of the {STREAMS} streams")
    return s


def random_chunk(rng: np.random.Generator, n: int) -> dict:
    out = peers.random_batch(W5_SPEC, n, rng)
    out["terminated"] = rng.random(n) < 1 / 500
    out["truncated"] = rng.random(n) < 1 / 2000
    return out


def _sample_op(contender, pools):
    return lambda: contender.sample(BATCH)


def entries(settings: common.Settings) -> list[common.Entry]:
    spec, cap = W5_SPEC, settings.capacity
    return [
        common.Entry("conduit[1dev]", lambda: peers.ConduitSequences(spec, cap, BATCH, LENGTH, STREAMS, pad=True,
                                                                     chunk=settings.chunk)),
        common.Entry("numpy-windows", lambda: peers.NumpySequences(spec, cap, BATCH, LENGTH, STREAMS)),
        common.Entry("flashbax-trajectory", lambda: peers.FlashbaxTrajectory(spec, cap, BATCH, LENGTH, STREAMS)),
        common.Entry("torchrl-slices", lambda: peers.TorchRLSequences(spec, cap, BATCH, LENGTH, STREAMS)),
    ]


GOALS = [
    common.Goal("W5 sample 64 x 32 steps <= 1.0x NumPy windows", "ratio", f"sample_b{BATCH}x{LENGTH}", 1.0,
                peer="numpy-windows"),
    common.Goal("W5 sample 64 x 32 steps <= 1.0x Flashbax trajectory buffer", "ratio", f"sample_b{BATCH}x{LENGTH}",
                1.0, peer="flashbax-trajectory"),
    common.Goal("W5 sample 64 x 32 steps <= 1.0x TorchRL slice sampler", "ratio", f"sample_b{BATCH}x{LENGTH}", 1.0,
                peer="torchrl-slices"),
    common.Goal("W5 add <= 1.0x NumPy time", "ratio", f"add_chunk{CHUNK_STEPS * STREAMS}", 1.0,
                peer="numpy-windows"),
    common.Goal("W5 memory <= 1.05x raw", "memory", None, 1.05),
    common.Goal("W5 zero recompiles after warm-up", "recompiles", f"sample_b{BATCH}x{LENGTH}", 0),
]


def run(settings: common.Settings) -> list[dict]:
    common.configure_runtime("w5")
    rng = np.random.default_rng(5)
    pools = {"chunks": [random_chunk(rng, settings.chunk) for _ in range(POOL_CHUNKS)]}
    metrics = [
        common.Metric(f"add_chunk{settings.chunk}", f"add, {CHUNK_STEPS} steps x {STREAMS} envs = {settings.chunk:,} "
                      f"items", "items/s", settings.chunk, add_op, reps=settings.add_reps, first_from_fill=True),
        common.Metric(f"sample_b{BATCH}x{LENGTH}", f"sample {BATCH} windows of {LENGTH} steps (ready)", "steps/s",
                      BATCH * LENGTH, _sample_op, reps=settings.sample_reps,
                      extra={"batch_size": BATCH, "length": LENGTH, "streams": STREAMS}),
    ]
    notes = {
        "windows": "uniform over stored windows; all four may cross an episode end (Conduit pad=True also delivers "
                   "the first-episode mask; TorchRL's slice sampler is given a never-set end key, stored with the "
                   "data)",
        "layout": f"time-major chunks (item t*{STREAMS}+e); Flashbax, NumPy and TorchRL store per env and get the "
                  f"chunk transposed to [envs, steps] outside the timing",
        "cpprb": "not run: cpprb has no window (sequence) sampler",
    }
    return common.run_workload(
        "w5", f"sequences of {LENGTH} steps, {STREAMS} envs, capacity {settings.capacity:,} steps, batch {BATCH}",
        W5_SPEC, settings, entries(settings), metrics, pools=pools, notes=notes, goals=GOALS)


def main(argv=None):
    parser = common.workload_parser(__doc__)
    args = parser.parse_args(argv)
    run(settings_for(args.quick, args.capacity, args.rounds))


if __name__ == "__main__":
    main()
