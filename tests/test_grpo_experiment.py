"""experiments/grpo.py on its smallest configuration: the reward, the generator's behaviour log-probs against a
recomputation, the same GRPO loss from the naive padded batch and from Conduit's packed one, and two short runs
(synchronous on the plane's staged schedule, overlapped on overlap(1)) through the packed path, within the
staleness bound."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from experiments import grpo

CONFIG = grpo.GRPOConfig(max_items=4, group_size=4, groups_per_batch=4, iterations=4, d_model=32, heads=2,
                         layers=1, rows=4, row_length=40, token_capacity=2048, group_capacity=32)


@pytest.fixture(scope="module")
def exp():
    return grpo.Experiment(CONFIG)


def _sequence(digits, answer):
    tokens = [grpo.DIGIT0 + d for d in digits] + [grpo.EQ] + answer
    return tokens, len(digits) + 1


def test_reward_grades_answers():
    d = grpo.DIGIT0
    cases = [([3, 1, 2], [d + 1, d + 2, d + 3, grpo.EOS], 1.0),  # exact
             ([3, 1, 2], [d + 3, d + 1, d + 2, grpo.EOS], None),  # the right digits, wrong order
             ([3, 1, 2], [grpo.EOS], 0.0)]  # empty answer
    width = CONFIG.max_length
    tokens = np.zeros((len(cases), width), np.int32)
    prompts, lengths = [], []
    for i, (digits, answer, _) in enumerate(cases):
        seq, prompt = _sequence(digits, answer)
        tokens[i, :len(seq)] = seq
        prompts.append(prompt)
        lengths.append(len(seq))
    rewards = np.asarray(grpo.rewards_of(jnp.asarray(tokens), jnp.asarray(prompts), jnp.asarray(lengths)))
    assert rewards[0] == pytest.approx(1.0) and rewards[2] == pytest.approx(0.0)
    assert 0.0 < rewards[1] < 1.0


def test_list_lengths_follow_item_decay():
    """k items with probability proportional to item_decay ** k (chi-square over 20,000 prompts), digits distinct,
    then '=' and padding."""
    from scipy import stats

    for decay in (0.7, 1.0):
        tokens, lengths = jax.device_get(grpo.make_prompts(jax.random.key(0), 20_000, 8, 18, decay))
        items = lengths - 1
        counts = np.bincount(items, minlength=9)[1:]
        expected = decay ** np.arange(1, 9)
        assert stats.chisquare(counts, counts.sum() * expected / expected.sum()).pvalue > 1e-3, (decay, counts)
        row, k = tokens[0], items[0]
        assert len(set(row[:k])) == k and row[k] == grpo.EQ and not row[k + 1:].any()


def test_behaviour_logprobs_match_a_recomputation(exp):
    params = exp.init_learner(jax.random.key(0)).params
    r = exp.generate(params, jax.random.key(1), 0)
    n = CONFIG.batch_sequences
    tokens = r.tokens.reshape(n, -1)
    lengths, prompts = r.lengths.reshape(n), r.prompt_lengths.reshape(n)
    column = jnp.arange(CONFIG.max_length)[None]
    segment_ids = (column < lengths[:, None]).astype(jnp.int32)
    positions = jnp.broadcast_to(column, tokens.shape)
    again = grpo.sequence_logprobs(exp.policy, params, tokens, positions, segment_ids)
    response = (column >= prompts[:, None]) & (column < lengths[:, None])
    np.testing.assert_allclose(np.where(response, r.logprobs.reshape(n, -1), 0), np.where(response, again, 0),
                               atol=1e-4)
    assert np.all(np.asarray(r.logprobs.reshape(n, -1))[~np.asarray(response)] == 0)
    assert int(r.policy_version) == 0


def test_packed_and_naive_batches_give_the_same_loss(exp):
    params = exp.init_learner(jax.random.key(0)).params
    r = exp.generate(params, jax.random.key(2), 0)
    naive = grpo.NaivePath(CONFIG, None)
    naive.put(r)
    padded = naive.batch(naive.pop(0), 0)
    # a token budget large enough for every group of the generation: the same sequences in one packed batch
    conduit = grpo.ConduitPath(dataclasses.replace(CONFIG, rows=8), "packed", None)  # a RolloutPlane, staged
    conduit.ingest(r)
    packed = conduit.account(*conduit.deliver())
    conduit.plane.close()
    assert packed.groups == padded.groups == CONFIG.groups_per_batch
    assert packed.useful_tokens == padded.useful_tokens
    loss_padded, m_padded = grpo.grpo_loss(exp.policy, params, padded.batch, CONFIG.clip_eps)
    loss_packed, m_packed = grpo.grpo_loss(exp.policy, params, packed.batch, CONFIG.clip_eps)
    assert int(m_padded["tokens"]) == int(m_packed["tokens"]) > 0
    assert float(loss_packed) == pytest.approx(float(loss_padded), abs=1e-5)
    # ... and the same advantages as the NumPy reference, token for token
    assert float(jnp.sum(packed.batch.advantages)) == pytest.approx(float(jnp.sum(padded.batch.advantages)),
                                                                    abs=1e-3)


@pytest.mark.parametrize("mode", grpo.MODES)
def test_short_runs_through_the_packed_path(exp, mode):
    row = grpo.run_one(exp, "conduit-packed", mode, seed=0)
    assert row["learner_steps"] >= 1 and row["generations"] == CONFIG.iterations
    assert 0.0 < row["packing_efficiency"] <= 1.0
    assert all(int(k) <= CONFIG.max_staleness for k in row["staleness_histogram"])
    assert row["plane"]["schedule"] == ("staged" if mode == "sync" else "overlap")
    assert row["dropped_overwritten_groups"] == 0
    assert len(row["curve"]) == CONFIG.iterations
