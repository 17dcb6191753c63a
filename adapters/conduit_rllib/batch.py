"""What a Conduit buffer's ``sample()`` hands a Conduit learner with ``deliver="torch"`` (``learners.py``): a
``ConduitBatch`` of the train-batch columns as JAX arrays, which the learner hands to torch through DLPack."""

from __future__ import annotations

from conduit_rllib.episode_index import EXACT


class ConduitBatch(list):
    """What ``sample()`` returns with ``deliver="torch"``: the train-batch columns as JAX arrays, for a Conduit
    learner (``learners.py``) to hand to torch through DLPack, instead of episodes for RLlib's learner connector.

    It is a list of ``len(batch)`` placeholders so RLlib code that counts steps with ``sum(len(e) for e in
    episodes)`` sees the batch size; any other use of a placeholder as an episode raises a message saying which
    learner to configure."""

    def __init__(self, columns: dict, module_id: str, size: int):
        super().__init__(_Placeholder() for _ in range(size))
        self.columns = columns
        self.module_id = module_id

    def take(self) -> dict:
        """The columns, once: the batch gives up its references (ownership of the memory moves to the caller)."""
        columns, self.columns = self.columns, None
        if columns is None:
            raise RuntimeError("ConduitBatch.take(): the columns were already taken")
        return columns


class _Placeholder:
    def __len__(self) -> int:
        return 1

    def __getattr__(self, name):
        raise TypeError(
            "This batch came from a Conduit replay buffer with deliver='torch': it holds JAX columns, not episodes. "
            "Train with a local Conduit learner (num_learners=0 and config.training(learner_class=conduit_rllib."
            "ConduitDQNTorchLearner or ConduitSACTorchLearner)) or set replay_buffer_config['deliver'] = 'episodes'.")


def train_columns(columns: dict, infos: bool, extras: bool) -> dict:
    """The train-batch columns asked for from a drawn batch's: RLlib's, plus extra_model_outputs / infos columns on
    request (never the float64 twins, ``EXACT``)."""
    return {k: v for k, v in columns.items() if not (k.startswith(("info__", "next_info__")) and not infos)
            and not (k.startswith("extra__") and not extras) and not k.startswith(EXACT)}
