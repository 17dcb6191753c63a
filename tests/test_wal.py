"""The shard write-ahead log (conduit_jax/distributed/wal.py), without Ray: records replay in order from any
checkpointed count, a torn or damaged tail is ignored, a gap ends the replay, and covered segments are dropped."""

import os

import jax
import jax.numpy as jnp
import numpy as np

from conduit_jax.distributed.wal import IngestLog
from conduit_jax.spec import ExperienceSpec

SPEC = ExperienceSpec.from_structs({"obs": {"x": jax.ShapeDtypeStruct((3,), jnp.float32)},
                                    "g": jax.ShapeDtypeStruct((), jnp.int32)})


def batch(start, n):
    g = np.arange(start, start + n, dtype=np.int32)
    return {"obs": {"x": np.stack([g, -g, g * 0.5], 1).astype(np.float32)}, "g": g}


def replayed(log, start):
    return [(before, n, out["g"].tolist(), out["obs"]["x"][:, 1].tolist()) for before, out, n in log.replay(start)]


def test_replay_returns_the_logged_batches_from_a_checkpointed_count(tmp_path):
    log = IngestLog(str(tmp_path), SPEC)
    for start, n in ((0, 5), (5, 3), (8, 4)):
        log.append(start, batch(start, n), n)
    assert [(b, n) for b, n, _, _ in replayed(log, 0)] == [(0, 5), (5, 3), (8, 4)]
    assert replayed(log, 5) == [(5, 3, [5, 6, 7], [-5.0, -6.0, -7.0]), (8, 4, [8, 9, 10, 11], [-8.0, -9.0, -10.0,
                                                                                              -11.0])]
    assert replayed(log, 12) == []
    # a restarted shard (a new log object on the same folder) reads the same records
    assert [(b, n) for b, n, _, _ in replayed(IngestLog(str(tmp_path), SPEC), 8)] == [(8, 4)]


def test_a_torn_or_damaged_tail_and_a_gap_end_the_replay(tmp_path):
    log = IngestLog(str(tmp_path), SPEC)
    log.append(0, batch(0, 4), 4)
    log.append(4, batch(4, 4), 4)
    log.close()
    (segment,) = os.listdir(tmp_path)
    path = tmp_path / segment
    whole = path.read_bytes()
    path.write_bytes(whole[:-5])  # the process died inside the second write: that batch was never acknowledged
    assert [(b, n) for b, n, _, _ in replayed(IngestLog(str(tmp_path), SPEC), 0)] == [(0, 4)]
    damaged = bytearray(whole)
    damaged[-1] ^= 0xFF  # a flipped byte in the last payload: its CRC no longer matches
    path.write_bytes(bytes(damaged))
    assert [(b, n) for b, n, _, _ in replayed(IngestLog(str(tmp_path), SPEC), 0)] == [(0, 4)]
    path.write_bytes(whole)
    assert replayed(IngestLog(str(tmp_path), SPEC), 2) == []  # the first batch straddles 2: nothing starts there


def test_rotation_and_drop_keep_what_a_checkpoint_does_not_cover(tmp_path):
    log = IngestLog(str(tmp_path), SPEC)
    log.append(0, batch(0, 10), 10)
    log.rotate(10)  # a snapshot of the first 10 items starts
    log.append(10, batch(10, 6), 6)
    log.rotate(16)  # another one, of 16
    log.append(16, batch(16, 2), 2)
    assert log.segments() == [0, 10, 16]
    log.drop_before(10)  # the first snapshot is on disk
    assert log.segments() == [10, 16]
    assert [(b, n) for b, n, _, _ in replayed(log, 10)] == [(10, 6), (16, 2)]
    log.drop_before(16)
    assert log.segments() == [16]
    assert [(b, n) for b, n, _, _ in replayed(log, 16)] == [(16, 2)]


def test_an_fsync_log_flushes_every_append_and_each_new_segment(tmp_path, monkeypatch):
    """fsync=True: each acknowledged append, and the directory entry of each new segment, is flushed to the disk
    before the call returns; what it replays is the same as without."""
    flushed = []
    real_fsync = os.fsync
    monkeypatch.setattr(os, "fsync", lambda fd: (flushed.append(os.readlink(f"/proc/self/fd/{fd}")), real_fsync(fd)))
    log = IngestLog(str(tmp_path / "wal"), SPEC, fsync=True)
    for start, n in ((0, 5), (5, 3)):
        log.append(start, batch(start, n), n)
    log.rotate(8)
    log.append(8, batch(8, 4), 4)
    segment = [os.path.join(log.directory, f"{start:015d}.log") for start in (0, 8)]
    directory = log.directory
    # segment 0: its directory entry, two appends; segment 8: its directory entry, one append
    assert flushed == [directory, segment[0], segment[0], directory, segment[1]]
    assert [(b, n) for b, n, _, _ in replayed(IngestLog(str(tmp_path / "wal"), SPEC), 0)] == [(0, 5), (5, 3), (8, 4)]
    assert not IngestLog(str(tmp_path / "other"), SPEC).fsync


class PageCache:
    """A host crash simulated for the files of one directory: a file's bytes past its last ``fsync`` are lost, and a
    file whose directory was not fsynced after the file was created is lost whole (what a power cut does to data the
    kernel had not written back). Installed as ``os.fsync``; ``crash()`` applies the loss to the real files."""

    def __init__(self, directory):
        self.directory, self.synced, self.listed = str(directory), {}, set()
        self._fsync = os.fsync

    def fsync(self, fd):
        path = os.readlink(f"/proc/self/fd/{fd}")
        if os.path.isdir(path):
            self.listed |= {os.path.join(path, name) for name in os.listdir(path)}
        else:
            self.synced[path] = os.fstat(fd).st_size
        self._fsync(fd)

    def crash(self):
        for name in os.listdir(self.directory):
            path = os.path.join(self.directory, name)
            if path not in self.listed:
                os.remove(path)
            else:
                os.truncate(path, self.synced.get(path, 0))


def test_only_an_fsync_log_keeps_every_acknowledged_batch_through_a_host_crash(tmp_path, monkeypatch):
    """Every batch an fsync log acknowledged (append returned) replays after a simulated host crash, across a new
    segment too; a log without fsync loses them (the crash model is not vacuous)."""
    kept = {}
    for fsync in (True, False):
        cache = PageCache(tmp_path / str(fsync))
        monkeypatch.setattr(os, "fsync", cache.fsync)
        log = IngestLog(str(tmp_path / str(fsync)), SPEC, fsync=fsync)
        acknowledged = []
        for start, n in ((0, 5), (5, 3), (8, 2)):
            if start == 8:
                log.rotate(8)  # a checkpoint started a new segment
            log.append(start, batch(start, n), n)
            acknowledged.append((start, n))
        log.close()
        monkeypatch.setattr(os, "fsync", cache._fsync)
        cache.crash()
        kept[fsync] = [(b, n) for b, n, _, _ in replayed(IngestLog(str(tmp_path / str(fsync)), SPEC), 0)]
    assert kept[True] == acknowledged
    assert kept[False] == []
