"""The benchmark peers measure the workload they claim to (the ones whose semantics are not the library's default).

TorchRL's slice sampler over a never-set end key (W5's ``torchrl-slices``): windows of consecutive steps of one
stream, never across the write cursor's seam, starting anywhere in the stored steps. TorchRL comes with the ``test``
extra (and the ``bench`` one), so CI runs this; it is skipped only where TorchRL is not installed.
"""

import importlib.util

import numpy as np
import pytest
from scipy import stats

from benchmarks import peers

# looked up, not imported: importing TorchRL takes seconds, paid in every test worker's collection otherwise
pytestmark = pytest.mark.skipif(importlib.util.find_spec("torchrl") is None, reason="TorchRL is not installed")

STREAMS, LENGTH, BATCH, STEPS = 4, 8, 16, 64


def test_torchrl_slices_draw_consecutive_steps_of_one_stream_inside_the_stored_ones():
    spec = {"obs": ((2,), np.float32)}
    contender = peers.TorchRLSequences(spec, STREAMS * STEPS, BATCH, LENGTH, STREAMS)
    step = 0
    for _ in range(5):  # 5 chunks of 24 steps into a 64-step ring per stream: it wraps
        t = np.arange(step, step + 24)
        step += 24
        obs = np.stack([np.repeat(t, STREAMS).astype(np.float32), np.tile(np.arange(STREAMS), 24)], axis=1)
        contender.add(contender.prepare({"obs": obs}))  # time-major: item t * STREAMS + e
    starts = []
    for _ in range(100):
        obs = contender.sample(BATCH).data["obs"].numpy()  # [B, L, 2]
        assert obs.shape == (BATCH, LENGTH, 2)
        assert (np.diff(obs[:, :, 0], axis=1) == 1).all()  # consecutive steps: no seam, no wrap inside a window
        assert (obs[:, :, 1] == obs[:, :1, 1]).all()  # one stream per window
        starts.append(obs[:, 0, 0])
    starts = np.concatenate(starts)
    oldest, newest = step - STEPS, step - 1
    assert starts.min() >= oldest and starts.max() <= newest - (LENGTH - 1)
    # uniform over the 57 stored windows of each stream (1,600 draws, seeded): a chi-square test of the starts
    counts = np.bincount((starts - oldest).astype(int), minlength=STEPS - LENGTH + 1)
    assert len(counts) == STEPS - LENGTH + 1
    assert stats.chisquare(counts).pvalue > 1e-3, counts
