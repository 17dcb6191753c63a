"""DLPack bridge between torch tensors and JAX arrays, and what it copies.

Which paths are zero-copy (checked by ``tests/test_rllib_adapter.py`` comparing data pointers):

* ``jax_to_torch(x)`` for an array on one device (an unsharded array, one shard of a sharded array, or a fully
  replicated array, whose first shard is used): zero-copy for every dtype a plane stores (bool, uint8, int8,
  uint16, int16, uint32, int32, float16, bfloat16, float32; on the CPU through NumPy's buffer protocol for the dtypes
  ``torch.from_numpy`` takes, fewer steps than DLPack). The tensor is *writable* and aliases JAX memory, which
  JAX assumes immutable: hand over only arrays nothing else reads afterwards (a fresh delivery, a kernel output), or
  pass ``copy=True``. Moving to another torch device (``device=``) copies.
* ``jax_to_torch(x)`` for an array split over several devices: one copy (``torch.cat`` of the zero-copy shard views);
  ``jax_shards_to_torch(x)`` returns the per-shard tensors without copying (what a learner co-located with its shard
  consumes).
* ``torch_to_jax(t, copy=False)``: zero-copy when ``t`` is contiguous, its data pointer is 64-byte aligned (fresh
  torch CPU allocations are) and its dtype is 32-bit or narrower. JAX then reads torch's memory: whoever passes
  ``copy=False`` promises nothing writes ``t`` while the JAX array lives (ownership moves to JAX), e.g. for the
  duration of a synchronous ``plane.ingest``. Otherwise JAX copies: an unaligned or non-contiguous tensor (a
  contiguous copy is made first; DLPack strides are not accepted by JAX), and with x64 off a 64-bit dtype (int64,
  uint64, float64), which is narrowed explicitly here (``narrow=True``, one cast) instead of silently by JAX.
* ``torch_to_jax(t)`` (default ``copy=True``): always an independent JAX array. ``jax.dlpack.from_dlpack(t,
  copy=True)`` still aliases on this jax version, so the copy is ``jnp.array(from_dlpack(t), copy=True)``.

NumPy arrays from RLlib (episode buffers it may reuse) never reach JAX through this module: ``plane.ingest`` packs
them on the host and keeps no reference.
"""

from __future__ import annotations

import warnings
from typing import Any, Optional

import jax
import jax.numpy as jnp
import numpy as np
import torch

ALIGNMENT = 64  # bytes: JAX's CPU client uses host memory in place only at this alignment

_WIDE = {torch.int64: torch.int32, torch.float64: torch.float32}
if hasattr(torch, "uint64"):
    _WIDE[torch.uint64] = torch.uint32

_TORCH_TO_NUMPY = {
    torch.bool: np.dtype(np.bool_), torch.uint8: np.dtype(np.uint8), torch.int8: np.dtype(np.int8),
    torch.int16: np.dtype(np.int16), torch.int32: np.dtype(np.int32), torch.int64: np.dtype(np.int64),
    torch.float16: np.dtype(np.float16), torch.bfloat16: np.dtype(jnp.bfloat16), torch.float32: np.dtype(np.float32),
    torch.float64: np.dtype(np.float64),
}
for _name, _np in (("uint16", np.uint16), ("uint32", np.uint32), ("uint64", np.uint64)):
    if hasattr(torch, _name):
        _TORCH_TO_NUMPY[getattr(torch, _name)] = np.dtype(_np)


_NUMPY_TO_TORCH = {dtype: torch_dtype for torch_dtype, dtype in _TORCH_TO_NUMPY.items()}


def torch_dtype(dtype) -> torch.dtype:
    """The torch dtype of a NumPy (or ml_dtypes bfloat16) dtype."""
    try:
        return _NUMPY_TO_TORCH[np.dtype(dtype)]
    except KeyError:
        raise TypeError(f"conduit_rllib.dlpack: dtype {dtype} has no torch counterpart") from None


def numpy_dtype(dtype: torch.dtype) -> np.dtype:
    """The NumPy (ml_dtypes for bfloat16) dtype of a torch dtype."""
    try:
        return _TORCH_TO_NUMPY[dtype]
    except KeyError:
        raise TypeError(f"conduit_rllib.dlpack: torch dtype {dtype} has no JAX counterpart") from None


def _single_device_part(x: jax.Array) -> Optional[jax.Array]:
    """``x`` itself when it lives on one device, its first shard when fully replicated, else None."""
    if len(x.sharding.device_set) == 1:
        return x
    if x.is_fully_replicated and x.is_fully_addressable:
        return x.addressable_shards[0].data
    return None


# dtypes torch.from_numpy takes: a CPU array of one of these crosses through NumPy's buffer protocol, zero-copy like
# DLPack with fewer steps on the way (~2 us against ~7 here, more inside an RLlib iteration); JAX's NumPy view is
# read-only, which torch warns about once per call site (its tensors cannot be read-only): not from this one, whose
# tensors alias JAX memory by contract (module docstring)
_NUMPY_VIEWABLE = frozenset(np.dtype(d) for d in (np.bool_, np.uint8, np.int8, np.int16, np.int32, np.int64,
                                                  np.float16, np.float32, np.float64))
warnings.filterwarnings("ignore", message="The given NumPy array is not writable", category=UserWarning,
                        module=__name__)


def _view(part: jax.Array) -> torch.Tensor:
    """A zero-copy torch tensor of a single-device array."""
    if part.dtype in _NUMPY_VIEWABLE and next(iter(part.sharding.device_set)).platform == "cpu":
        return torch.from_numpy(np.asarray(part))
    return torch.from_dlpack(part)


def jax_shards_to_torch(x: jax.Array) -> list[torch.Tensor]:
    """Zero-copy torch views of the addressable shards of ``x``, in ``addressable_shards`` order."""
    return [_view(shard.data) for shard in x.addressable_shards]


def jax_to_torch(x: jax.Array, *, device: Optional[torch.device] = None, copy: bool = False) -> torch.Tensor:
    """A torch tensor with the values of ``x`` (zero-copy where the module docstring says)."""
    if not isinstance(x, jax.Array):
        raise TypeError(f"jax_to_torch(): expected a jax.Array, got {type(x).__name__}")
    part = _single_device_part(x)
    if part is not None:
        tensor = _view(part)
    else:
        pieces = sorted(x.addressable_shards, key=lambda s: tuple(sl.start or 0 for sl in s.index))
        if not x.is_fully_addressable or any(
                any(sl.start not in (None, 0) or sl.stop not in (None, d) for sl, d in zip(s.index[1:], x.shape[1:]))
                for s in pieces):
            raise ValueError(f"jax_to_torch(): only arrays split along their first axis can be joined here; got "
                             f"sharding {x.sharding}. Use jax_shards_to_torch() or gather first.")
        seen, parts = set(), []
        for shard in pieces:  # a partially replicated axis repeats blocks: keep each block once
            key = shard.index[0].start or 0
            if key not in seen:
                seen.add(key)
                parts.append(_view(shard.data))
        tensor = torch.cat(parts, dim=0)
        copy = False  # already a fresh tensor
    if device is not None and tensor.device != torch.device(device):
        return tensor.to(device)
    return tensor.clone() if copy else tensor


def words_to_torch(words: jax.Array, layout, names, *, device: Optional[torch.device] = None) -> dict:
    """The columns ``names`` of a packed batch (``layout.pack``'s words as int32[B, layout.row_words], a core
    ``RowLayout``) as torch tensors: the words cross once (``jax_to_torch``: zero-copy on their device) and each column
    is a view of them, reinterpreted as its dtype (1- and 2-byte columns from the words' bytes): one indexing per
    column (a torch operation costs ~1 us, several more inside an RLlib iteration), planned once per layout."""
    table = jax_to_torch(words, device=device)
    plan = _word_plans.get((layout, names))
    if plan is None:
        plan = _word_plans[layout, names] = _word_plan(layout, names)
    typed, out = {}, {}
    for name, dtype, bytewise, first, stop, shape in plan:
        view = typed.get(dtype)
        if view is None:  # the words as elements of this dtype
            view = typed[dtype] = (table.view(torch.uint8) if bytewise else table).view(dtype)
        part = view[:, first] if stop is None else view[:, first:stop]
        out[name] = part if shape is None else part.reshape(part.shape[0], *shape)
    return out


_word_plans: dict = {}  # (layout, names) -> _word_plan


def _word_plan(layout, names) -> list:
    """Per column of ``names``: its name, torch dtype, whether it is read from the words' bytes, its first element,
    the element after its last (None: a scalar column, indexed) and the shape to give it (None: as indexed)."""
    plan = []
    for name in names:
        index = layout.spec.names.index(name)
        slot, shape, dtype = layout.slots[index], layout.spec.shapes[index], layout.spec.dtypes[index]
        first = slot.offset * slot.per_word
        plan.append((name, torch_dtype(dtype), slot.per_word > 1, first, None if not shape else first + slot.elems,
                     None if len(shape) <= 1 else tuple(shape)))
    return plan


def torch_to_jax(t: torch.Tensor, *, copy: bool = True, narrow: bool = True) -> jax.Array:
    """A JAX array with the values of ``t``; with ``copy=False`` zero-copy where the module docstring says."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"torch_to_jax(): expected a torch.Tensor, got {type(t).__name__}")
    t = t.detach()
    if t.dtype in _WIDE and not jax.config.jax_enable_x64:
        if not narrow:
            raise TypeError(f"torch_to_jax(): {t.dtype} would be narrowed by JAX (x64 is off); cast it or pass "
                            f"narrow=True")
        t = t.to(_WIDE[t.dtype])  # a fresh tensor nobody else holds
    if not t.is_contiguous():
        t = t.contiguous()
    if t.device.type == "cpu" and t.data_ptr() % ALIGNMENT and t.numel():
        t = t.clone()  # fresh torch CPU allocations are 64-byte aligned; JAX would copy anyway
    out = jax.dlpack.from_dlpack(t)
    if copy:
        out = jnp.array(out, copy=True)  # from_dlpack(copy=True) still aliases
    return out


def shares_memory(x: jax.Array, t: torch.Tensor) -> bool:
    """Whether a single-device JAX array and a torch tensor start at the same address (the zero-copy check)."""
    part = _single_device_part(x)
    return part is not None and part.unsafe_buffer_pointer() == t.data_ptr()


def tree_jax_to_torch(tree: Any, *, device: Optional[torch.device] = None) -> Any:
    return jax.tree_util.tree_map(lambda x: jax_to_torch(x, device=device), tree)
