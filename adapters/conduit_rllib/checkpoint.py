"""``store_buffer_in_checkpoints`` for RLlib's new API stack: the replay buffer survives ``algo.save()`` /
``algo.restore()`` and ``Algorithm.from_checkpoint()``.

RLlib 2.60 honours ``store_buffer_in_checkpoints`` only on the old API stack (``Algorithm.__getstate__``); on the new
stack ``get_state()`` leaves the buffer out and a restored algorithm starts with an empty one. The algorithm classes
here add it without touching RLlib's algorithm code: after RLlib's own ``save_to_path`` they write
``<checkpoint>/conduit_replay_buffer/`` (``buffer.json``: format, config, spec, counters and the name, dtype, shape
and CRC-32 of every array; ``arrays.npz``: the arrays, read back with ``allow_pickle=False``), and after RLlib's
``restore_from_path`` they read it back into ``algo.local_replay_buffer`` with ``set_state``. Nothing is pickled,
so loading a buffer cannot run code; a missing, partial or corrupted buffer is refused with a message.

The algorithm classes are in ``algorithms.py`` (``ConduitDQN``, ``ConduitSAC``, ``with_buffer_checkpoints``). Buffers
that are not Conduit buffers are written the same way when their ``get_state``/``set_state`` use arrays and JSON-able
values only.
"""

from __future__ import annotations

import importlib
import io
import json
import pathlib
import zlib
from typing import Any, Optional

import numpy as np
import pyarrow.fs

BUFFER_DIR = "conduit_replay_buffer"
META_FILE, ARRAYS_FILE = "buffer.json", "arrays.npz"
FORMAT = "conduit_rllib.buffer_checkpoint"
VERSION = 1


class BufferCheckpointError(ValueError):
    """A buffer checkpoint that cannot be read back (missing, partial, corrupted, another format)."""


def _split(state: Any, arrays: dict, prefix: str = "") -> Any:
    """JSON-able skeleton of ``state`` with every ndarray replaced by {"__array__": key}."""
    if isinstance(state, np.ndarray):
        key = f"a{len(arrays)}"
        arrays[key] = state
        return {"__array__": key}
    if isinstance(state, dict):
        if not all(isinstance(k, str) for k in state):
            raise TypeError(f"buffer state: dict keys must be strings, got {list(state)[:5]} at '{prefix}'")
        return {k: _split(v, arrays, f"{prefix}/{k}") for k, v in state.items()}
    if isinstance(state, (list, tuple)):
        return [_split(v, arrays, f"{prefix}[{i}]") for i, v in enumerate(state)]
    if isinstance(state, (np.integer, np.floating, np.bool_)):
        return state.item()
    if state is None or isinstance(state, (bool, int, float, str)):
        return state
    raise TypeError(f"buffer state: {type(state).__name__} at '{prefix}' is neither an array nor JSON data; a "
                    f"checkpointed buffer's state holds arrays, numbers, strings, lists and dicts only")


def _join(skeleton: Any, arrays: dict) -> Any:
    if isinstance(skeleton, dict):
        if set(skeleton) == {"__array__"}:
            return arrays[skeleton["__array__"]]
        return {k: _join(v, arrays) for k, v in skeleton.items()}
    if isinstance(skeleton, list):
        return [_join(v, arrays) for v in skeleton]
    return skeleton


def _crc(array: np.ndarray) -> int:
    return zlib.crc32(np.ascontiguousarray(array).view(np.uint8).reshape(-1))


def _storable(array: np.ndarray) -> np.ndarray:
    """Arrays of non-builtin dtypes (bfloat16 from ml_dtypes) are stored as unsigned ints of the same width."""
    if array.dtype.isbuiltin:
        return array
    return array.view(np.dtype(f"u{array.dtype.itemsize}"))


def _filesystem(path, filesystem):
    path = str(path)
    if filesystem is None:
        filesystem, path = pyarrow.fs.FileSystem.from_uri(path)
    return filesystem, pathlib.PurePosixPath(path)


def save_buffer(buffer, path, *, filesystem: Optional["pyarrow.fs.FileSystem"] = None) -> str:
    """Write ``buffer.get_state()`` to the directory ``path`` (created); returns the path."""
    filesystem, path = _filesystem(path, filesystem)
    arrays: dict[str, np.ndarray] = {}
    skeleton = _split(buffer.get_state(), arrays)
    index = {key: {"dtype": str(a.dtype), "shape": list(a.shape), "crc32": _crc(a)} for key, a in arrays.items()}
    payload = io.BytesIO()
    np.savez(payload, **{key: _storable(a) for key, a in arrays.items()})
    meta = {"format": FORMAT, "version": VERSION, "buffer_class": f"{type(buffer).__module__}."
            f"{type(buffer).__qualname__}", "state": skeleton, "arrays": index}
    filesystem.create_dir(str(path), recursive=True)
    # arrays first, metadata last: a buffer.json on disk means the arrays were written completely
    with filesystem.open_output_stream(str(path / ARRAYS_FILE)) as f:
        f.write(payload.getvalue())
    with filesystem.open_output_stream(str(path / META_FILE)) as f:
        f.write(json.dumps(meta).encode("utf-8"))
    return str(path)


def load_buffer(buffer, path, *, filesystem: Optional["pyarrow.fs.FileSystem"] = None) -> None:
    """Read a directory written by ``save_buffer`` into ``buffer`` (``buffer.set_state``)."""
    importlib.import_module("ml_dtypes")  # registers bfloat16 & co. with NumPy (a JAX dependency)

    filesystem, path = _filesystem(path, filesystem)
    where = f"load_buffer({path})"
    try:
        with filesystem.open_input_stream(str(path / META_FILE)) as f:
            meta = json.loads(f.read().decode("utf-8"))
        with filesystem.open_input_stream(str(path / ARRAYS_FILE)) as f:
            payload = f.read()
    except (FileNotFoundError, OSError) as exc:
        raise BufferCheckpointError(f"{where}: no complete buffer checkpoint there ({exc})") from None
    except ValueError as exc:
        raise BufferCheckpointError(f"{where}: {META_FILE} is not JSON ({exc})") from None
    if meta.get("format") != FORMAT or meta.get("version") != VERSION:
        raise BufferCheckpointError(f"{where}: format {meta.get('format')!r} version {meta.get('version')!r}; this "
                                    f"code reads {FORMAT!r} version {VERSION}")
    arrays = {}
    try:
        with np.load(io.BytesIO(payload), allow_pickle=False) as stored:
            for key, info in meta["arrays"].items():
                array = stored[key].view(np.dtype(info["dtype"]))
                if list(array.shape) != info["shape"] or _crc(array) != info["crc32"]:
                    raise BufferCheckpointError(f"{where}: array {key} does not match its record (shape "
                                                f"{list(array.shape)} vs {info['shape']}, or its CRC-32 differs)")
                arrays[key] = array
    except BufferCheckpointError:
        raise
    except Exception as exc:  # a truncated or corrupted npz
        raise BufferCheckpointError(f"{where}: {ARRAYS_FILE} does not read back ({type(exc).__name__}: {exc})") \
            from None
    buffer.set_state(_join(meta["state"], arrays))


class BufferCheckpointMixin:
    """Algorithm mixin: with ``store_buffer_in_checkpoints`` the local replay buffer is saved and restored with the
    algorithm (see the module docstring)."""

    def _stores_buffer(self) -> bool:
        return bool(getattr(self.config, "store_buffer_in_checkpoints", False)) and \
            getattr(self, "local_replay_buffer", None) is not None

    def save_to_path(self, path=None, *, state=None, filesystem=None, use_msgpack: bool = False) -> str:
        out = super().save_to_path(path, state=state, filesystem=filesystem, use_msgpack=use_msgpack)
        if self._stores_buffer():
            save_buffer(self.local_replay_buffer, pathlib.PurePosixPath(out) / BUFFER_DIR, filesystem=filesystem)
        return out

    def restore_from_path(self, path, *args, **kwargs):
        super().restore_from_path(path, *args, **kwargs)
        if not self._stores_buffer() or kwargs.get("component"):
            return
        filesystem = kwargs.get("filesystem")
        fs, root = _filesystem(path, filesystem)
        target = root / BUFFER_DIR
        if fs.get_file_info(str(target / META_FILE)).type == pyarrow.fs.FileType.NotFound:
            raise BufferCheckpointError(f"restore: store_buffer_in_checkpoints is set but {path} holds no replay "
                                        f"buffer ({BUFFER_DIR}/{META_FILE} is missing)")
        load_buffer(self.local_replay_buffer, target, filesystem=fs)
