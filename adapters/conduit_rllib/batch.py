"""What a Conduit buffer's ``sample()`` hands a Conduit learner with ``deliver="torch"`` (``learners.py``): a
``ConduitBatch`` of the train-batch columns as JAX arrays, which the learner hands to torch through DLPack."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from conduit_rllib.episode_index import EXACT


class ConduitBatch(list):
    """What ``sample()`` returns with ``deliver="torch"``: the train-batch columns for a Conduit learner
    (``learners.py``) to hand to torch through DLPack, instead of episodes for RLlib's learner connector. The draw
    kernel packs them into one int32[B, words] array (``draws.packed_draw``): ``layout`` (a core ``RowLayout``) says
    where each column is, ``names`` which columns the sample asked for.

    It is a list of ``len(batch)`` placeholders so RLlib code that counts steps with ``sum(len(e) for e in
    episodes)`` sees the batch size; any other use of a placeholder as an episode raises a message saying which
    learner to configure."""

    def __init__(self, words, layout, names, module_id: str, size: int):
        super().__init__([_PLACEHOLDER] * size)
        self._words, self.layout, self.names = words, layout, tuple(names)
        self.module_id = module_id

    def take_words(self):
        """The packed columns, once (the batch gives up its reference: ownership of the memory moves to the caller);
        ``dlpack.words_to_torch(words, batch.layout, batch.names)`` views them as torch tensors."""
        words, self._words = self._words, None
        if words is None:
            raise RuntimeError("ConduitBatch: the columns were already taken")
        return words

    def take(self) -> dict:
        """The columns asked for as JAX arrays, once, unpacked from the words (a few small JAX operations per column;
        a learner takes ``take_words()`` instead)."""
        columns = self.layout.unpack(jax.lax.bitcast_convert_type(self.take_words(), jnp.uint32))
        return {name: columns[name] for name in self.names}


class _Placeholder:
    def __len__(self) -> int:
        return 1

    def __getattr__(self, name):
        raise TypeError(
            "This batch came from a Conduit replay buffer with deliver='torch': it holds JAX columns, not episodes. "
            "Train with a local Conduit learner (num_learners=0 and config.training(learner_class=conduit_rllib."
            "ConduitDQNTorchLearner or ConduitSACTorchLearner)) or set replay_buffer_config['deliver'] = 'episodes'.")


_PLACEHOLDER = _Placeholder()  # holds nothing: one serves every batch


def train_columns(columns: dict, infos: bool, extras: bool) -> dict:
    """The train-batch columns asked for from a drawn batch's: RLlib's, plus extra_model_outputs / infos columns on
    request (never the float64 twins, ``EXACT``)."""
    return {k: v for k, v in columns.items() if not (k.startswith(("info__", "next_info__")) and not infos)
            and not (k.startswith("extra__") and not extras) and not k.startswith(EXACT)}
