"""W3: Atari DQN frames, uniform replay.

Item: obs u8[84,84,4], act i32, rew f32, done bool, next_obs u8[84,84,4] (56,457 raw bytes; Conduit's packed row is
56,460). Capacity 100,000 (5.6 GB per contender), filled with random data; add in chunks of 100 items; uniform sample
of a batch of 256 and of 32, batch ready (JAX results blocked on).

Memory. At full size no two peers fit beside each other and Conduit on this 24 GB machine shared with other
engineers, so the workload runs in groups: Conduit against one peer at a time, interleaved rounds inside the group,
then both are freed before the next group (see ``common.Group``). Every ratio is against the Conduit row of its own
group. Before the run the capacity is checked against MemAvailable: two contenders need ~2.3 x 5.6 GB at 100k; when
that does not fit the run drops to 30,000 and says so (``--capacity`` chooses another). A Conduit plane samples one
batch size (its sampler's), so b256 and b32 are two planes, built one after the other (``API`` note below).

    python -m benchmarks.bench_w3 [--quick] [--capacity N] [--rounds R]
"""

from __future__ import annotations


import numpy as np

from benchmarks import common, peers
from benchmarks.bench_w1 import add_op

W3_SPEC = {
    "obs": ((84, 84, 4), np.uint8),
    "act": ((), np.int32),
    "rew": ((), np.float32),
    "done": ((), np.bool_),
    "next_obs": ((84, 84, 4), np.uint8),
}
FULL_CAPACITY = 100_000
FALLBACK_CAPACITY = 30_000
CHUNK = 100
BATCHES = (256, 32)


def settings_for(quick: bool, capacity=None, rounds=None) -> common.Settings:
    if quick:
        s = common.Settings(capacity=1_000, batch_size=256, chunk=CHUNK, rounds=2, sample_reps=6, add_reps=6,
                            quick=True)
    else:
        s = common.Settings(capacity=FULL_CAPACITY, batch_size=256, chunk=CHUNK, rounds=10, sample_reps=40,
                            add_reps=40)
    if capacity is not None:
        s.capacity = capacity
    if rounds is not None:
        s.rounds = rounds
    return s


def fit_capacity(settings: common.Settings, explicit: bool) -> tuple[int, str]:
    """The capacity to run with: the requested one when two contenders (~1.15 x raw each) plus 2 GiB fit in
    MemAvailable, else ``FALLBACK_CAPACITY`` (unless the capacity was given explicitly)."""
    item = peers.item_bytes(W3_SPEC)
    free = common.mem_available_bytes()
    need = 2 * 1.15 * settings.capacity * item + (2 << 30)
    if explicit or free is None or free >= need or settings.capacity <= FALLBACK_CAPACITY:
        return settings.capacity, (f"capacity {settings.capacity:,}: {need / 2**30:.1f} GiB needed for two "
                                   f"contenders, {(free or 0) / 2**30:.1f} GiB available at start")
    return FALLBACK_CAPACITY, (f"capacity reduced from {settings.capacity:,} to {FALLBACK_CAPACITY:,}: two contenders "
                               f"need {need / 2**30:.1f} GiB, only {free / 2**30:.1f} GiB was available at start")


def _sample_op(batch_size):
    def make(contender, pools):
        return lambda: contender.sample(batch_size)

    return make


def groups(settings: common.Settings) -> list[common.Group]:
    spec, cap, chunk = W3_SPEC, settings.capacity, settings.chunk
    # the derived rows share their buffer with a row that adds already
    derived = (peers.NumpyToJax, peers.ConduitRecycling)
    add = common.Metric(f"add_chunk{chunk}", f"add, chunks of {chunk} frames", "items/s", chunk, add_op,
                        applies=lambda c: not isinstance(c, derived), reps=settings.add_reps, first_from_fill=True)
    peer_entries = [
        [common.Entry("numpy", lambda: peers.NumpyRing(spec, cap, 256)),
         common.Entry("numpy+device_put", lambda built: peers.NumpyToJax(built["numpy"]), derived=True)],
        [common.Entry("cpprb", lambda: peers.CpprbUniform(spec, cap, 256))],
        [common.Entry("flashbax", lambda: peers.FlashbaxUniform(spec, cap, 256))],
        [common.Entry("torchrl", lambda: peers.TorchRLUniform(spec, cap, 256, fixed_batch=False))],
    ]
    out = []
    for b in BATCHES:
        label = "conduit[1dev]"
        conduit = common.Entry(label, lambda b=b: peers.Conduit(spec, cap, b, devices=1, chunk=chunk))
        recycling = common.Entry(RECYCLING, lambda built, label=label: peers.ConduitRecycling(built[label]),
                                 derived=True)
        sample = common.Metric(f"sample_b{b}", f"uniform sample, batch {b} (ready)", "samples/s", b,
                               _sample_op(b), reps=settings.sample_reps, extra={"batch_size": b})
        metrics = [add, sample] if b == BATCHES[0] else [sample]
        if settings.quick:  # small buffers: every peer in one group per batch size, peers carried to the next
            everyone = [e for entries in peer_entries for e in entries]
            keep = tuple(e.label for e in everyone if b != BATCHES[-1])
            out.append(common.Group(f"b{b}", [conduit, recycling, *everyone], metrics, keep=keep))
            continue
        for i, entries in enumerate(peer_entries):
            peer = entries[0].label
            last = i == len(peer_entries) - 1
            out.append(common.Group(f"b{b} vs {peer}", [conduit, recycling, *entries], metrics,
                                    keep=() if last else (label,)))
    return out


RECYCLING = "conduit[recycle]"
GOALS = [
    common.Goal("W3 sample b256 >= 80% of memcpy", "memcpy", "sample_b256", 0.80),
    common.Goal("W3 sample b256 >= 80% of memcpy, batch buffers recycled", "memcpy", "sample_b256", 0.80,
                contender=RECYCLING),
    common.Goal("W3 sample b32 <= 1.0x NumPy", "ratio", "sample_b32", 1.0, peer="numpy"),
    common.Goal("W3 sample b32 <= 1.0x NumPy, batch buffers recycled", "ratio", "sample_b32", 1.0, peer="numpy",
                contender=RECYCLING),
    common.Goal("W3 sample b256 <= 1.0x NumPy", "ratio", "sample_b256", 1.0, peer="numpy"),
    common.Goal("W3 sample b256 <= 1.0x NumPy, batch buffers recycled", "ratio", "sample_b256", 1.0, peer="numpy",
                contender=RECYCLING),
    common.Goal("W3 add (chunks of 100) <= 1.0x NumPy time", "ratio", f"add_chunk{CHUNK}", 1.0, peer="numpy"),
    common.Goal("W3 memory <= 1.05x raw", "memory", None, 1.05),
    common.Goal("W3 zero recompiles after warm-up (sample b256)", "recompiles", "sample_b256", 0),
]


def run(settings: common.Settings, explicit_capacity: bool = False) -> list[dict]:
    common.configure_runtime("w3")
    settings.capacity, capacity_note = fit_capacity(settings, explicit_capacity)
    common.log_line(f"w3: {capacity_note}")
    rng = np.random.default_rng(3)
    pool = 4 if settings.quick else 16  # distinct random chunks (16 x 100 x 56 KB = 90 MB)
    pools = {"chunks": [peers.random_batch(W3_SPEC, settings.chunk, rng) for _ in range(pool)]}
    status = peers.torchrl_status()
    notes = {
        "capacity": capacity_note,
        "groups": "Conduit against one peer at a time (each group built, filled, timed interleaved, freed); ratios "
                  "within a group",
        "conduit_batch_sizes": "one plane per batch size: ExperienceDataPlane fixes the batch size in its sampler, "
                               "so b256 and b32 are two planes (two fills, never both held)",
        "conduit_ingest": f"a {settings.chunk}-item ingest is padded to a power-of-two bucket of rows (memory note "
                          f"ingest_bucket_rows), and the padding rows are packed, copied and written back too",
        "flashbax": "one make_item_buffer per sample_batch_size over the same state",
        "torchrl": status["torchrl"],
        "numpy+device_put": "the NumPy ring's batch moved to a JAX device array (what a JAX learner pays)",
    }
    return common.run_workload(
        "w3", f"Atari frames u8[84,84,4] x2, uniform, capacity {settings.capacity:,}, batch 256 and 32",
        W3_SPEC, settings, [], [], pools=pools, notes=notes, groups=groups(settings), goals=GOALS,
        env_extra={"group_ratios": True})


def main(argv=None):
    parser = common.workload_parser(__doc__)
    args = parser.parse_args(argv)
    run(settings_for(args.quick, args.capacity, args.rounds), explicit_capacity=args.capacity is not None)


if __name__ == "__main__":
    main()
