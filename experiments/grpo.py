"""GRPO end to end in pure JAX: a tiny transformer learns to sort digits, fed through three experience paths.

The task: a prompt is a list of 1..``max_items`` distinct digits followed by ``=`` (``3 9 1 =``); the answer is the same
digits in ascending order followed by EOS (``1 3 9 <eos>``). The reward is verifiable and graded: the number of answer
positions holding the right digit divided by the longer of the answer and the target, so an exact answer scores 1, an
answer of the right digits in a wrong order or length scores in between, and the random initial policy scores 0.2-0.3 on
average (near 0.1 on long lists). Answers (and prompts) vary in length, which is what makes padding expensive and
packing worth it: short lists are common and long ones rare (``item_decay``: k items with probability proportional to
0.7 ** k), as the lengths of an LLM's responses are long-tailed, while a padded batch pays for the longest.
``TARGET_REWARD`` is the mean reward the policy is meant to reach.

The pieces, each a pure function (the experiment is also their smallest test):
  * ``Policy``: a decoder-only transformer (flax) whose forward takes ``tokens``, ``positions`` and ``segment_ids``
    ``[R, T]`` with segment-aware causal attention: a token sees the keys of its own (nonzero) segment at positions
    <= its own. One forward therefore serves padded batches (one sequence per row, segment 1, padding segment 0) and
    packed ones (several sequences per row, segments 1, 2, ...).
  * ``make_generate``: sampling inside ``jax.jit`` (temperature 1, stop at EOS, a fixed answer budget; the prompts
    go through the policy once, then each answer token alone against a key/value cache instead of recomputing the
    whole sequence at every step), ``group_size`` answers per prompt, each answer token's behaviour log-prob
    log pi_old(token_t | tokens_<t) (0 on the prompt), the rewards and the policy version that generated them.
  * ``grpo_loss``: the group advantage (reward - group mean) / (group std + 1e-6), or reward - group mean with
    ``--no-scale-advantages``, on every response token; the clipped importance ratio exp(logp_new - logp_behaviour)
    (clip 0.2), averaged over the response tokens of the batch. In a packed row the logit at position t predicts the
    token at t + 1 only when both belong to the same segment.

Three experience paths move the same rollouts from generation to the same learner, on the same seeds:
  * ``naive``: rollouts fetched to the host as Python lists, each batch padded to ``[B, max_length]`` with NumPy,
    advantages in NumPy, ``jax.device_put`` (its own lock and queue, as a user writes it);
  * ``conduit-padded`` and ``conduit-packed``: the rollouts go through ``conduit_jax.RolloutPlane``: ``ingest``
    stages a generation's groups on the host (no kernel), ``deliver`` hands over a batch of whole groups with their
    advantages, padded to ``[B, max_length]`` or packed into at most ``[rows, row_length]`` (the plane's
    ``trim_rows``: a batch has the rows its sequences fill; ``--no-trim-rows`` for the fixed shape), laid out by one
    kernel that writes the staged groups first; ``set_policy_version`` after each learner step.
Each runs synchronously (generate, then learn, alternating; Conduit on ``schedule.staged()``: the learner's deliver()
runs the kernel) and overlapped: a producer thread generates with a snapshot of the parameters and feeds the path
while the learner thread takes batches and learns (Conduit on ``schedule.overlap(1)``, ``--schedule adaptive`` for
``adaptive(2, k=0)``: the plane's worker lays the next batch out during the learner's step). The producer generates
while less than a batch's worth of groups waits (a batch laid out ahead included). No group older than
``max_staleness`` policy versions reaches the loss: the naive path drops such groups when popped; the plane drops them
when drawn and masks the sequences of a batch drawn ahead that are too old by the time it is delivered (both counted
in the JSON).

Reported per path and mode: packing efficiency (useful tokens / computed tokens in the learner's batches; masked
sequences are not useful), learner tokens per second (useful tokens per second of learner time), the exposed
experience path per iteration (the learner thread's time on the experience path until its batch is computed, wall
clock: naive: pop, pad, advantages, transfer and ``block_until_ready``; Conduit: ``ingest`` (sync mode) +
``deliver`` (which returns a computed batch) + ``set_policy_version``; steps that compiled, for a new batch shape,
are left out of the timings), the stale groups dropped and masked, the row counts of the batches, and the
mean-reward curve (initial: the mean of the first generations; final: of the last tenth); for learning, the final
mean rewards of the packed overlapped path against the naive synchronous one over the seeds (Welch's t-test).

Writes ``experiments/results/grpo.json`` and ``grpo.png`` (``--quick``: ``grpo_quick.*``); the run time is the
``wall_s`` the JSON records. ``python -m experiments.grpo --quick``; ``python -m experiments.grpo --help``.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import json
import os
import platform
import threading
import time
from pathlib import Path
from typing import Any, NamedTuple, Optional, Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax

RESULTS = Path(__file__).resolve().parent / "results"

# The vocabulary: padding, end of answer, the separator, then the digits 0..9.
PAD, EOS, EQ, DIGIT0 = 0, 1, 2, 3
VOCAB = DIGIT0 + 10
TARGET_REWARD = 0.9  # the mean reward the policy is meant to reach (1 = every answer exact)

PATHS = ("naive", "conduit-padded", "conduit-packed")
MODES = ("sync", "overlap")


@dataclasses.dataclass(frozen=True)
class GRPOConfig:
    max_items: int = 8  # a prompt lists 1..max_items distinct digits
    # P(k items) is proportional to item_decay ** k: short lists are common and long ones rare, as LLM response
    # lengths are long-tailed (1.0: every count alike, the task before; padding then wastes less)
    item_decay: float = 0.7
    group_size: int = 8  # G answers per prompt
    groups_per_batch: int = 8  # prompts per learner batch (and per generation: one learner step per generation)
    # generations per run (a learner step each on the padded paths; a packed batch may take more groups, so fewer
    # steps): the mean reward passes TARGET_REWARD after 550-850 generations, depending on the seed, and levels off
    # (a higher learning rate, or a warmup and cosine decay, did not get there sooner on every seed)
    iterations: int = 1000
    d_model: int = 64
    heads: int = 4
    layers: int = 2
    learning_rate: float = 1e-3
    clip_eps: float = 0.2
    scale_advantages: bool = True  # False: advantage = reward - group mean (no division by the group's std)
    max_staleness: int = 2  # groups older than this many policy versions never reach the loss
    overlap_schedule: str = "overlap"  # the plane's schedule in overlap mode: overlap (overlap(1)) or adaptive
    # the packed layout's token budget per learner batch, rows x row_length: about a generation's useful tokens (~700
    # here) over the packing efficiency aimed at (0.9), so a generation's groups fit one batch; a smaller budget
    # left groups of each generation waiting, a backlog that aged out as stale groups
    rows: int = 12
    row_length: int = 64
    # packed batches take only the rows their sequences fill (the plane's trim_rows: the budget is a maximum, as in
    # verl's dynamic batch size), so a batch of fewer tokens than the budget costs the learner fewer rows
    trim_rows: bool = True
    token_capacity: int = 16_384  # the conduit buffer's token ring
    group_capacity: int = 64

    @property
    def max_answer(self) -> int:  # the sorted digits and EOS
        return self.max_items + 1

    @property
    def max_length(self) -> int:  # prompt (digits and '=') + answer
        return self.max_items + 1 + self.max_answer

    @property
    def batch_sequences(self) -> int:
        return self.groups_per_batch * self.group_size


QUICK = dict(max_items=6, iterations=80)  # ~650 useful tokens a generation, within the default budget


# ------------------------------------------------------------------------------------------------------------------
# The task
# ------------------------------------------------------------------------------------------------------------------
def make_prompts(rng: jax.Array, prompts: int, max_items: int, max_length: int, item_decay: float = 1.0):
    """``prompts`` random prompts: ``tokens`` int32[prompts, max_length] (digits, '=', then PAD) and their lengths
    int32[prompts] (items + 1). Each prompt lists 1..max_items distinct digits in random order, k of them with
    probability proportional to ``item_decay ** k``."""
    count_rng, order_rng = jax.random.split(rng)
    logits = jnp.arange(max_items) * np.log(item_decay)
    items = jax.random.categorical(count_rng, logits, shape=(prompts,)) + 1
    # distinct digits: the first `items` of a random permutation of 0..9
    digits = jnp.argsort(jax.random.uniform(order_rng, (prompts, 10)), axis=1)
    digits = jnp.pad(digits, ((0, 0), (0, max(0, max_length - 10))))[:, :max_length]
    column = jnp.arange(max_length)[None, :]
    tokens = jnp.where(column < items[:, None], DIGIT0 + digits, PAD)
    tokens = jnp.where(column == items[:, None], EQ, tokens)
    return tokens.astype(jnp.int32), (items + 1).astype(jnp.int32)


def rewards_of(tokens: jax.Array, prompt_lengths: jax.Array, lengths: jax.Array) -> jax.Array:
    """The graded reward of each sequence (``tokens`` [N, T] = prompt then answer, ``lengths`` [N] including the
    answer): correct positions / max(answer length, target length); the answer stops at its first EOS (a missing
    EOS leaves the extra tokens in the answer)."""
    n, width = tokens.shape
    items = prompt_lengths - 1
    column = jnp.arange(width)[None, :]
    digit = tokens - DIGIT0
    # the target: the prompt's digits sorted (non-prompt slots sort to the end as 99)
    target = jnp.sort(jnp.where(column < items[:, None], digit, 99), axis=1)
    # the answer, shifted to start at column 0
    index = jnp.clip(column + prompt_lengths[:, None], 0, width - 1)
    answer = jnp.take_along_axis(tokens, index, axis=1)
    in_answer = column < (lengths - prompt_lengths)[:, None]
    ends = in_answer & (answer == EOS)
    answer_len = jnp.where(jnp.any(ends, axis=1), jnp.argmax(ends, axis=1), lengths - prompt_lengths)
    denominator = jnp.maximum(answer_len, items).astype(jnp.float32)
    correct = (column < jnp.minimum(answer_len, items)[:, None]) & (answer - DIGIT0 == target)
    # partial credit, a third each: answer digits that occur in the prompt at all, digits larger than the one before
    # (the order, locally), and digits in their exact place; each step is reachable from the one before it
    in_prompt = jnp.any((answer[:, :, None] == tokens[:, None, :]) & (column < items[:, None])[:, None, :], axis=2)
    present = (column < answer_len[:, None]) & in_prompt
    previous = jnp.pad(answer[:, :-1], ((0, 0), (1, 0)), constant_values=DIGIT0 - 1)
    ascending = present & (answer > previous)
    return (jnp.sum(correct, axis=1) + jnp.sum(present, axis=1) + jnp.sum(ascending, axis=1)) / (3 * denominator)


# ------------------------------------------------------------------------------------------------------------------
# The policy
# ------------------------------------------------------------------------------------------------------------------
def attention_mask(positions: jax.Array, segment_ids: jax.Array) -> jax.Array:
    """bool[R, 1, T, T]: query q sees key k when both are in the same nonzero segment and k's position <= q's."""
    same = (segment_ids[:, :, None] == segment_ids[:, None, :]) & (segment_ids[:, :, None] != 0)
    return (same & (positions[:, None, :] <= positions[:, :, None]))[:, None]


class KVCache(NamedTuple):
    """The keys and values of one sequence per row, the token at position p in slot p: per layer float32[R, S, heads,
    d_model // heads]. Slots past a row's last token hold stale values: a query never sees a slot past its own
    position, and a token's slot is written before its query reads the cache."""

    keys: tuple
    values: tuple


class Block(nn.Module):
    d_model: int
    heads: int

    @nn.compact
    def __call__(self, x, mask, cache=None, slots=None):
        """x [R, T, d] -> (x, (keys, values)). Without ``cache`` the queries attend to the keys of x itself; with a
        cache (keys and values [R, S, heads, head]) x is one token per row (T = 1), its key and value are written at
        ``slots`` [R] and it attends to the cache (``mask`` [R, 1, 1, S])."""
        r, t, d = x.shape
        head = d // self.heads
        qkv = nn.Dense(3 * d, use_bias=False)(nn.LayerNorm()(x)).reshape(r, t, 3, self.heads, head)
        q, k, v = qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]
        if cache is not None:
            # a select rather than a scatter: one slot per row, and the cache is a few KiB
            at_slot = (jnp.arange(cache[0].shape[1])[None, :] == slots[:, None])[:, :, None, None]
            k, v = jnp.where(at_slot, k, cache[0]), jnp.where(at_slot, v, cache[1])
        logits = jnp.einsum("rqhd,rkhd->rhqk", q, k) / np.sqrt(head)
        # a finite fill: a padding query sees no key at all, and -inf would make its row NaN (it is masked later)
        weights = jax.nn.softmax(jnp.where(mask, logits, -1e9), axis=-1)
        x = x + nn.Dense(d)(jnp.einsum("rhqk,rkhd->rqhd", weights, v).reshape(r, t, d))
        h = nn.Dense(4 * d)(nn.LayerNorm()(x))
        return x + nn.Dense(d)(nn.gelu(h)), (k, v)


class Policy(nn.Module):
    """A decoder-only transformer over ``tokens``, ``positions``, ``segment_ids`` [R, T] -> logits [R, T, VOCAB]
    (learned position embeddings read from ``positions``; PAD is never sampled: its logit is -1e9).

    For generation, ``prefill`` (the same forward, also returning the ``KVCache`` of rows that each hold one
    sequence from position 0) and ``decode`` (one token per row against that cache) compute the same logits as the
    full forward over the tokens so far, without recomputing the earlier tokens."""

    d_model: int = 64
    heads: int = 4
    layers: int = 2
    max_positions: int = 32

    def setup(self):
        self.token_embedding = nn.Embed(VOCAB, self.d_model)
        self.position_embedding = nn.Embed(self.max_positions, self.d_model)
        self.blocks = [Block(self.d_model, self.heads) for _ in range(self.layers)]
        self.final_norm = nn.LayerNorm()
        self.unembedding = nn.Dense(VOCAB)

    def __call__(self, tokens, positions, segment_ids):
        return self._forward(tokens, positions, attention_mask(positions, segment_ids))[0]

    def prefill(self, tokens, segment_ids, slots: int):
        """Rows of one sequence each, at positions 0..T-1 (``segment_ids`` 1 on its tokens so far, 0 after):
        (logits [R, T, VOCAB], the ``KVCache`` with ``slots`` >= T slots, those past T zero)."""
        positions = jnp.broadcast_to(jnp.arange(tokens.shape[1]), tokens.shape)
        logits, caches = self._forward(tokens, positions, attention_mask(positions, segment_ids))
        pad = ((0, 0), (0, slots - tokens.shape[1]), (0, 0), (0, 0))
        return logits, KVCache(*(tuple(jnp.pad(x, pad) for x in xs) for xs in zip(*caches)))

    def decode(self, token, position, cache: KVCache):
        """One token per row (``token``, ``position`` int32[R]) after the cached ones: (logits [R, VOCAB], the cache
        with the token's keys and values in slot ``position``)."""
        mask = (jnp.arange(cache.keys[0].shape[1])[None, :] <= position[:, None])[:, None, None, :]
        logits, caches = self._forward(token[:, None], position[:, None], mask, cache, position)
        return logits[:, 0], KVCache(*zip(*caches))

    def _forward(self, tokens, positions, mask, cache: Optional[KVCache] = None, slots=None):
        positions = jnp.clip(positions, 0, self.max_positions - 1)
        x = self.token_embedding(tokens) + self.position_embedding(positions)
        caches = []
        for i, block in enumerate(self.blocks):
            x, kv = block(x, mask, None if cache is None else (cache.keys[i], cache.values[i]), slots)
            caches.append(kv)
        logits = self.unembedding(self.final_norm(x))
        return jnp.where(jnp.arange(VOCAB) == PAD, -1e9, logits), caches


def make_policy(config: GRPOConfig) -> Policy:
    return Policy(config.d_model, config.heads, config.layers, config.max_length)


def init_params(policy: Policy, config: GRPOConfig, rng: jax.Array):
    shape = (1, config.max_length)
    return policy.init(rng, jnp.zeros(shape, jnp.int32), jnp.zeros(shape, jnp.int32), jnp.ones(shape, jnp.int32))


# ------------------------------------------------------------------------------------------------------------------
# Generation
# ------------------------------------------------------------------------------------------------------------------
class Rollouts(NamedTuple):
    """One generation: ``prompts`` groups of ``G`` sequences, left-aligned and padded to ``max_length``."""

    tokens: jax.Array  # int32[prompts, G, max_length]: prompt, answer, PAD
    logprobs: jax.Array  # float32[prompts, G, max_length]: behaviour log-prob of each answer token, 0 elsewhere
    lengths: jax.Array  # int32[prompts, G]: prompt + answer tokens
    prompt_lengths: jax.Array  # int32[prompts, G]
    rewards: jax.Array  # float32[prompts, G]
    policy_version: jax.Array  # int32[]: the version of the parameters that generated them


def make_generate(config: GRPOConfig, policy: Policy):
    """``generate(params, rng, version) -> Rollouts`` of ``groups_per_batch`` prompts x ``group_size`` answers,
    jitted. The prompts go through the policy once (``Policy.prefill``, which keeps their keys and values); then each
    step samples the next token of every unfinished row at temperature 1 and feeds it alone through
    ``Policy.decode``. A row's answer starts at its own prompt length, so each row writes at its own position."""
    prompts, group, width = config.groups_per_batch, config.group_size, config.max_length

    def generate(params, rng, version):
        prompt_rng, sample_rng = jax.random.split(rng)
        tokens, prompt_lengths = make_prompts(prompt_rng, prompts, config.max_items, width, config.item_decay)
        tokens = jnp.repeat(tokens, group, axis=0)  # [N, T], each prompt G times
        prompt_lengths = jnp.repeat(prompt_lengths, group, axis=0)
        n = tokens.shape[0]
        rows = jnp.arange(n)

        def sample(tokens, logprobs, lengths, done, last, key):
            """Sample after each row's last token from its log-probs ``last`` [N, VOCAB]; finished rows keep theirs."""
            token = jax.random.categorical(key, last).astype(jnp.int32)
            write = ~done
            slot = jnp.minimum(lengths, width - 1)
            tokens = tokens.at[rows, slot].set(jnp.where(write, token, tokens[rows, slot]))
            logprobs = logprobs.at[rows, slot].set(jnp.where(write, last[rows, token], logprobs[rows, slot]))
            lengths = lengths + write.astype(jnp.int32)
            return tokens, logprobs, lengths, done | (token == EOS) | (lengths >= width)

        def step(carry, key):
            tokens, logprobs, lengths, done, cache = carry
            # each row's newest token (a finished row's last one again: it rewrites its own slot, read by nobody)
            logits, cache = policy.apply(params, tokens[rows, lengths - 1], lengths - 1, cache,
                                         method=Policy.decode)
            return (*sample(tokens, logprobs, lengths, done, jax.nn.log_softmax(logits), key), cache), None

        # the prefill computes only the columns a prompt can fill (the digits and '='); the answers' slots start empty
        prompt_width = config.max_items + 1
        segment_ids = (jnp.arange(prompt_width)[None, :] < prompt_lengths[:, None]).astype(jnp.int32)
        logits, cache = policy.apply(params, tokens[:, :prompt_width], segment_ids, width, method=Policy.prefill)
        keys = jax.random.split(sample_rng, config.max_answer)
        # the logit at a prompt's last token predicts the answer's first
        state = sample(tokens, jnp.zeros((n, width), jnp.float32), prompt_lengths, jnp.zeros((n,), bool),
                       jax.nn.log_softmax(logits[rows, prompt_lengths - 1]), keys[0])
        (tokens, logprobs, lengths, _, _), _ = jax.lax.scan(step, (*state, cache), keys[1:])
        rewards = rewards_of(tokens, prompt_lengths, lengths)
        shape = (prompts, group)
        return Rollouts(tokens.reshape(shape + (width,)), logprobs.reshape(shape + (width,)),
                        lengths.reshape(shape), prompt_lengths.reshape(shape), rewards.reshape(shape),
                        jnp.asarray(version, jnp.int32))

    return jax.jit(generate)


def sequence_logprobs(policy: Policy, params, tokens, positions, segment_ids) -> jax.Array:
    """float32[R, T]: log pi(token_t | the tokens before t in its segment) at every t whose predecessor is in the same
    segment, 0 elsewhere (a segment's first token, padding)."""
    logits = policy.apply(params, tokens, positions, segment_ids)
    logp = jnp.take_along_axis(jax.nn.log_softmax(logits[:, :-1]), tokens[:, 1:, None], axis=-1)[..., 0]
    follows = (segment_ids[:, 1:] == segment_ids[:, :-1]) & (segment_ids[:, 1:] != 0)
    return jnp.pad(jnp.where(follows, logp, 0.0), ((0, 0), (1, 0)))


# ------------------------------------------------------------------------------------------------------------------
# GRPO
# ------------------------------------------------------------------------------------------------------------------
class Batch(NamedTuple):
    """A learner batch, padded or packed: every field [R, T]."""

    tokens: jax.Array  # int32
    logprobs: jax.Array  # float32: behaviour log-prob of each response token
    positions: jax.Array  # int32: position within its sequence
    segment_ids: jax.Array  # int32: 0 padding, 1.. the k-th sequence of the row
    loss_mask: jax.Array  # bool: response tokens
    advantages: jax.Array  # float32: the sequence's group advantage on each of its tokens


def group_advantages(rewards: np.ndarray, scale: bool) -> np.ndarray:
    """NumPy: (reward - group mean) / (group std + 1e-6), or reward - group mean; ``rewards`` [k, G]."""
    centred = rewards - rewards.mean(axis=1, keepdims=True)
    # the sample std (ddof=1), as TRL and verl compute it and conduit_jax.rollouts does
    return centred / (rewards.std(axis=1, ddof=1, keepdims=True) + 1e-6) if scale else centred


def grpo_loss(policy: Policy, params, batch: Batch, clip_eps: float):
    """The clipped-ratio GRPO objective averaged over the batch's response tokens; returns (loss, metrics)."""
    logits = policy.apply(params, batch.tokens, batch.positions, batch.segment_ids)
    logp = jnp.take_along_axis(jax.nn.log_softmax(logits[:, :-1]), batch.tokens[:, 1:, None], axis=-1)[..., 0]
    # the logit at t predicts the token at t + 1 only inside one segment; only response tokens are scored
    mask = batch.loss_mask[:, 1:] & (batch.segment_ids[:, 1:] == batch.segment_ids[:, :-1]) & \
        (batch.segment_ids[:, 1:] != 0)
    log_ratio = jnp.where(mask, logp - batch.logprobs[:, 1:], 0.0)
    ratio = jnp.exp(log_ratio)
    advantage = batch.advantages[:, 1:]
    objective = jnp.minimum(ratio * advantage, jnp.clip(ratio, 1 - clip_eps, 1 + clip_eps) * advantage)
    count = jnp.maximum(jnp.sum(mask), 1)
    loss = -jnp.sum(jnp.where(mask, objective, 0.0)) / count
    metrics = {"tokens": jnp.sum(mask), "clipped": jnp.sum(mask & (jnp.abs(ratio - 1) > clip_eps)) / count,
               "kl": jnp.sum(jnp.where(mask, ratio - 1 - log_ratio, 0.0)) / count}
    return loss, metrics


class Learner(NamedTuple):
    params: Any
    opt_state: Any


def make_learner(config: GRPOConfig, policy: Policy, compiles: Optional[collections.Counter] = None):
    """``(init(rng) -> Learner, step(learner, batch) -> (learner, loss, metrics))``, the step jitted (one program per
    batch shape: padded and packed compile apart), its compilations counted in ``compiles``."""
    optimizer = optax.adam(config.learning_rate)

    def init(rng) -> Learner:
        params = init_params(policy, config, rng)
        return Learner(params, optimizer.init(params))

    def step(learner: Learner, batch: Batch):
        (loss, metrics), grads = jax.value_and_grad(
            lambda p: grpo_loss(policy, p, batch, config.clip_eps), has_aux=True)(learner.params)
        updates, opt_state = optimizer.update(grads, learner.opt_state, learner.params)
        return Learner(optax.apply_updates(learner.params, updates), opt_state), loss, metrics

    from conduit_jax.engine import compiled

    # no donation: the overlapped producer may still be generating with the parameters of the step before
    return init, compiled(step, "grpo learner step", collections.Counter() if compiles is None else compiles)


# ------------------------------------------------------------------------------------------------------------------
# Experience paths: rollouts from the generator to a learner batch
# ------------------------------------------------------------------------------------------------------------------
class Delivered(NamedTuple):
    """What a path hands the learner: the batch and its bookkeeping (host values)."""

    batch: Batch
    useful_tokens: int  # tokens of the delivered sequences
    computed_tokens: int  # R x T of the batch
    groups: int
    versions: list  # the policy version that generated each delivered group


class NaivePath:
    """Rollouts as Python lists on the host; a batch is padded to ``[groups_per_batch * G, max_length]`` with NumPy,
    its advantages computed in NumPy, and sent with ``jax.device_put``. Stale groups are dropped when popped."""

    name = "naive"

    def __init__(self, config: GRPOConfig, max_staleness: Optional[int]):
        self.config, self.max_staleness = config, max_staleness
        self.queue: collections.deque = collections.deque()
        self.consumed = 0  # groups popped (delivered or dropped)
        self.dropped = 0

    def put(self, rollouts: Rollouts) -> None:
        """Producer side: fetch to the host and keep each group as lists of per-sequence arrays."""
        host = jax.device_get(rollouts)
        version = int(host.policy_version)
        for i in range(host.rewards.shape[0]):
            lengths = host.lengths[i].tolist()
            self.queue.append({"tokens": [host.tokens[i, j, :n] for j, n in enumerate(lengths)],
                               "logprobs": [host.logprobs[i, j, :n] for j, n in enumerate(lengths)],
                               "rewards": host.rewards[i].tolist(), "prompt_lengths": host.prompt_lengths[i].tolist(),
                               "version": version})

    def pop(self, version: int) -> list:
        """Up to groups_per_batch fresh groups, oldest first (call under the lock)."""
        groups = []
        while self.queue and len(groups) < self.config.groups_per_batch:
            group = self.queue.popleft()
            self.consumed += 1
            if self.max_staleness is not None and version - group["version"] > self.max_staleness:
                self.dropped += 1
                continue
            groups.append(group)
        return groups

    def batch(self, groups: list, version: int) -> Delivered:
        """Pad, compute advantages and transfer (outside the lock: only the learner touches these groups now)."""
        config = self.config
        rows, width = config.batch_sequences, config.max_length
        tokens = np.zeros((rows, width), np.int32)
        logprobs = np.zeros((rows, width), np.float32)
        segment_ids = np.zeros((rows, width), np.int32)
        loss_mask = np.zeros((rows, width), bool)
        advantages = np.zeros((rows, width), np.float32)
        group_adv = group_advantages(np.asarray([g["rewards"] for g in groups], np.float32),
                                     config.scale_advantages)
        row, useful = 0, 0
        for g, group in enumerate(groups):
            for j, sequence in enumerate(group["tokens"]):
                n = len(sequence)
                tokens[row, :n] = sequence
                logprobs[row, :n] = group["logprobs"][j]
                segment_ids[row, :n] = row + 1
                loss_mask[row, group["prompt_lengths"][j]:n] = True
                advantages[row, :n] = group_adv[g, j]
                row, useful = row + 1, useful + n
        positions = np.broadcast_to(np.arange(width, dtype=np.int32), (rows, width))
        batch = jax.device_put(Batch(tokens, logprobs, np.where(segment_ids > 0, positions, 0), segment_ids,
                                     loss_mask, advantages))
        return Delivered(batch, useful, rows * width, len(groups), [g["version"] for g in groups])


class ConduitPath:
    """Rollouts through ``conduit_jax.RolloutPlane``: ``ingest`` fetches a generation to the host and stages its
    groups there (no kernel); ``deliver`` hands over a batch of whole groups with their advantages, padded to
    ``[groups_per_batch * G, max_length]`` or packed into ``[rows, row_length]``, laid out by one kernel that writes
    the staged groups first. Under ``schedule.staged()`` that kernel is the learner's own ``deliver()`` call; under
    ``schedule.overlap(1)`` (or ``adaptive``) the plane's delivery worker runs it while the learner's step computes,
    and ``deliver()`` only hands the batch over. The plane keeps the staleness bound: groups older than
    ``max_staleness`` versions are dropped when drawn, and sequences of a batch drawn before the learner's last
    ``set_policy_version`` that are too old by then are masked out (no loss, no advantage)."""

    def __init__(self, config: GRPOConfig, layout: str, max_staleness: Optional[int], schedule=None):
        import conduit_jax as cj
        from conduit_jax import rollouts

        self.name = f"conduit-{layout}"
        self.config = config
        spec = rollouts.RolloutSpec(group_size=config.group_size, max_length=config.max_length,
                                    token_leaves={"tokens": np.int32, "logprobs": np.float32})
        shape = rollouts.packed(config.rows, config.row_length) if layout == "packed" else rollouts.padded()
        self.plane = cj.RolloutPlane(spec, config.token_capacity, config.group_capacity, config.groups_per_batch,
                                     shape, max_staleness=max_staleness, scale_advantages=config.scale_advantages,
                                     schedule=schedule, trim_rows=config.trim_rows and layout == "packed")

    def groups(self, r: Rollouts):
        """A generation fetched to the host as ``rollouts.Groups``."""
        from conduit_jax import rollouts

        host = jax.device_get(r)
        return rollouts.Groups(leaves={"tokens": host.tokens, "logprobs": host.logprobs}, lengths=host.lengths,
                               rewards=host.rewards, prompt_lengths=host.prompt_lengths,
                               policy_version=np.full(host.rewards.shape[:1], host.policy_version, np.int32))

    def ingest(self, r, timeout: Optional[float] = 0.0) -> None:
        """Stage groups (``Rollouts`` of a generation, or host ``rollouts.Groups``) in the plane; waits up to
        ``timeout`` for room (``CapacityError`` after)."""
        self.plane.ingest(self.groups(r) if isinstance(r, Rollouts) else r, timeout=timeout)

    def deliver(self, timeout: Optional[float] = 0.0):
        """The learner's next batch (computed) and the plane's ``RolloutBatch`` it came from (``account`` reads its
        bookkeeping). ``NotEnoughDataError`` when nothing is deliverable within ``timeout``."""
        b = self.plane.deliver(timeout=timeout)
        return Batch(b.leaves["tokens"], b.leaves["logprobs"], b.positions, b.segment_ids, b.loss_mask,
                     b.advantages), b

    def account(self, batch: Batch, b) -> Delivered:
        """What the batch delivered, read to the host: the sequences still in it (``sequence_mask``: masked stale
        ones are not), their tokens, and each delivered group's policy version."""
        lengths, mask, versions = jax.device_get((b.lengths, b.sequence_mask, b.versions))
        kept = mask.reshape(-1, self.config.group_size)[:, 0]  # a group is delivered or masked whole
        rows, width = batch.tokens.shape
        return Delivered(batch, int(np.sum(lengths[mask])), rows * width, int(np.sum(kept)),
                         versions.reshape(-1, self.config.group_size)[kept, 0].tolist())


def conduit_schedule(mode: str, name: str = "overlap"):
    """The plane's schedule for a mode: ``staged()`` in sync mode (the learner's deliver() runs the one kernel);
    in overlap mode ``overlap(1)`` (one batch laid out ahead, during the learner's step) or ``adaptive(2, k=0)``."""
    from conduit_jax import schedule

    if mode == "sync":
        return schedule.staged()
    if name == "adaptive":
        return schedule.adaptive(2, k=0)
    if name == "overlap":
        return schedule.overlap(1)
    raise ValueError(f"unknown overlap schedule {name!r}; use overlap or adaptive")


def make_path(name: str, config: GRPOConfig, max_staleness: Optional[int], schedule=None):
    if name == "naive":
        return NaivePath(config, max_staleness)
    if name in ("conduit-padded", "conduit-packed"):
        return ConduitPath(config, name.split("-")[1], max_staleness, schedule)
    raise ValueError(f"unknown experience path {name!r}; use one of {', '.join(PATHS)}")


# ------------------------------------------------------------------------------------------------------------------
# Runs: synchronous and overlapped
# ------------------------------------------------------------------------------------------------------------------
WARMUP_STEPS = 3  # learner steps left out of the timings (the first calls compile)
# the initial mean reward: of the first generations, before the policy has moved much (the first tenth of a long run,
# which the final reward's window mirrors, already holds much of the first rise)
INITIAL_GENERATIONS = 10


class Experiment:
    """The jitted pieces of one configuration, shared by every run (path, mode, seed) so each compiles once (a
    Conduit run's plane is its own: its few kernels compile in the run, in the steps left out of the timings)."""

    def __init__(self, config: GRPOConfig):
        self.config = config
        self.policy = make_policy(config)
        self.generate = make_generate(config, self.policy)
        self.compiles = collections.Counter()  # XLA compilations of the learner's step
        self.init_learner, self.step = make_learner(config, self.policy, self.compiles)

    def path(self, name: str, mode: str = "sync"):
        """A fresh experience path for one run (a Conduit path: a new plane, on the mode's schedule)."""
        config = self.config
        if name == "conduit-packed":
            # a packed batch takes as many whole groups as its token budget holds: allow more than a generation's
            # worth, so short answers fill the budget instead of leaving it half empty
            config = dataclasses.replace(config, groups_per_batch=2 * config.groups_per_batch)
        schedule = None if name == "naive" else conduit_schedule(mode, config.overlap_schedule)
        return make_path(name, config, config.max_staleness, schedule)


class _Shared:
    """What the producer and the learner threads share, under ``cond``'s lock (the naive path's queue too)."""

    def __init__(self):
        self.cond = threading.Condition()
        self.produced_groups = 0
        self.produced_tokens = 0
        self.generations: list = []  # (policy version, mean reward, seconds)
        self.done = False  # the producer has finished (or the learner has stopped)
        self.error: Optional[BaseException] = None


def run_one(exp: Experiment, path_name: str, mode: str, seed: int) -> dict:
    """One training run; returns its curve, timings and batch statistics."""
    from conduit_jax.errors import CapacityError, NotEnoughDataError

    config = exp.config
    if mode not in MODES:
        raise ValueError(f"unknown mode {mode!r}; use one of {', '.join(MODES)}")
    path = exp.path(path_name, mode)
    packed = path_name == "conduit-packed"
    conduit = path_name != "naive"
    key = jax.random.key(seed)
    learner = exp.init_learner(jax.random.fold_in(key, 0))  # the same initial policy on every path
    generation_key = jax.random.fold_in(key, 1)
    shared = _Shared()
    budget = config.rows * config.row_length

    def queued() -> int:
        """Groups ingested and not yet drawn into a batch (Conduit: the plane's count; batches it laid out ahead are
        not in it)."""
        return len(path.plane) if conduit else len(path.queue)

    def needed() -> int:
        """Groups a batch waits for: a generation's worth, or (packed) the groups that fill the token budget."""
        if not packed or not shared.produced_groups:
            return config.groups_per_batch
        per_group = shared.produced_tokens / shared.produced_groups
        # one group more than the budget holds on average: the packer then has a choice and fills the rows
        return max(1, min(2 * config.groups_per_batch, int(budget // per_group) + 1))

    def produce(params, g: int, version: int):
        """Generate one generation (the caller holds no lock); returns the rollouts, their tokens and seconds."""
        start = time.perf_counter()
        rollouts = exp.generate(params, jax.random.fold_in(generation_key, g), version)
        tokens, reward = (float(x) for x in jax.device_get((jnp.sum(rollouts.lengths), jnp.mean(rollouts.rewards))))
        seconds = time.perf_counter() - start
        shared.generations.append((version, reward, seconds))
        return rollouts, int(tokens), seconds

    steps: list = []  # per learner step: exposed_s, learner_s, useful, computed, groups, loss, staleness, rows, ...

    def compiles() -> int:
        """XLA compilations of the learner's step and (Conduit) this run's plane kernels so far."""
        return sum(exp.compiles.values()) + (sum(path.plane.engine.compiles.values()) if conduit else 0)

    compiles_seen = compiles()
    version = 0

    def take(version: int, timeout: Optional[float] = 0.0):
        """The next batch and how to account for it, or None: Conduit's deliver(), or the naive pop, pad and
        transfer. Computed when it returns, so the caller's clock holds all of it: the plane's deliver() returns a
        computed batch (it waits for the kernel itself, or hands over one its worker saw finish), the naive path's
        transfer is waited for here (block_until_ready)."""
        if conduit:
            try:
                batch, b = path.deliver(timeout=timeout)
            except NotEnoughDataError:
                return None
            return batch, lambda: path.account(batch, b)
        with shared.cond:
            groups = path.pop(version)
        if not groups:
            return None
        delivered = path.batch(groups, version)
        return jax.block_until_ready(delivered.batch), lambda: delivered

    def learn(batch: Batch, account, exposed: float) -> float:
        """One learner step; then (Conduit) the plane's policy version moves on. Returns the seconds that
        set_policy_version() took on this thread, counted in the next step's exposed path."""
        nonlocal learner, version
        start = time.perf_counter()
        learner, loss, metrics = exp.step(learner, batch)
        loss = float(loss)  # blocks on the step
        learner_s = time.perf_counter() - start
        delivered = account()
        # XLA compiled since the last step (the learner's step for a new batch shape or input type, a plane kernel)
        nonlocal compiles_seen
        now = compiles()
        compiled, compiles_seen = now > compiles_seen, now
        steps.append({"exposed_s": exposed, "learner_s": learner_s, "useful": delivered.useful_tokens,
                      "computed": delivered.computed_tokens, "groups": delivered.groups, "loss": loss,
                      "rows": batch.tokens.shape[0], "compiled": compiled,
                      "staleness": [version - v for v in delivered.versions], "kl": float(metrics["kl"]),
                      "clipped": float(metrics["clipped"])})
        version += 1
        if not conduit:
            return 0.0
        start = time.perf_counter()
        path.plane.set_policy_version(version)
        return time.perf_counter() - start

    started = time.perf_counter()
    wait_s = 0.0
    carried = 0.0  # experience-path seconds of this thread not yet counted with a batch (ingest, set version)
    try:
        if mode == "sync":
            for g in range(config.iterations):
                rollouts, tokens, _ = produce(learner.params, g, version)
                start = time.perf_counter()
                if conduit:
                    path.ingest(rollouts)  # staged: the next deliver()'s kernel writes it
                else:
                    path.put(rollouts)
                carried += time.perf_counter() - start
                shared.produced_groups += config.groups_per_batch
                shared.produced_tokens += tokens
                while queued() >= needed():
                    start = time.perf_counter()
                    taken = take(version)
                    if taken is None:
                        break
                    exposed = carried + time.perf_counter() - start
                    carried = learn(*taken, exposed)
        else:
            wait_s = _overlapped(config, path, conduit, shared, queued, needed, produce, take, learn,
                                 lambda: (learner.params, version), CapacityError)
    finally:
        if conduit:
            path.plane.close()
    wall = time.perf_counter() - started
    if conduit:
        stats = path.plane.stats()
        plane = {"dropped_stale": stats["dropped_stale"], "masked_stale": stats["masked_stale"],
                 "dropped_overwritten": stats["dropped_overwritten"], "undelivered": stats["undelivered"],
                 "groups_ingested": stats["groups_ingested"], "groups_drawn": stats["groups_drawn"],
                 "schedule": stats["schedule"], "compiles": stats["compiles"],
                 "exposed_us_median": stats["exposed_path"]["median_us"]}
    else:
        plane = {"dropped_stale": path.dropped, "masked_stale": 0, "dropped_overwritten": 0,
                 "undelivered": len(path.queue)}
    return summarize_run(config, path_name, mode, seed, steps, shared.generations, wall, wait_s, plane)


def _overlapped(config: GRPOConfig, path, conduit: bool, shared: _Shared, queued, needed, produce, take, learn,
                current, CapacityError) -> float:
    """The overlapped run: a producer thread generates with the latest parameters and feeds the path while this
    (the learner's) thread takes batches and learns. Returns the seconds the learner waited for the producer.

    Pacing (both paths): the producer generates while fewer than a batch's worth of groups wait (``needed()``; for
    Conduit also when none of them is fresh enough to deliver; a batch the schedule laid out ahead is such a batch's
    worth), so a generation does not queue long enough to go stale. Conduit: the producer calls ``plane.ingest``
    (waiting for room, which the pacing makes rare) and the learner ``plane.deliver`` whenever the plane has a batch
    for it (laid out ahead by the schedule's worker, or deliverable groups for deliver() to lay out)."""
    snapshot = {"params": current()[0], "version": 0}

    def backlogged() -> bool:  # under shared.cond
        """Whether a batch's worth of groups waits for the learner."""
        if conduit and path.plane.in_flight():
            # counting only the groups not yet drawn, the producer refilled the plane while a batch waited laid out:
            # two batches' worth queued, and once generation outpaced the learner much of the batch laid out next
            # was older than max_staleness when delivered (masked: not learned from)
            return True
        return queued() >= needed() and (not conduit or path.plane.can_sample())

    def producer():
        try:
            for g in range(config.iterations):
                with shared.cond:
                    while not shared.done and backlogged():
                        shared.cond.wait(0.005)  # a draw (the plane's worker) does not notify this condition
                    if shared.done:
                        return
                    params, v = snapshot["params"], snapshot["version"]
                rollouts, tokens, _ = produce(params, g, v)
                while conduit:
                    try:
                        path.ingest(rollouts, timeout=0.5)  # back-pressure: waits for deliveries to make room
                        break
                    except CapacityError:
                        if shared.done:
                            return
                with shared.cond:
                    if not conduit:
                        path.put(rollouts)
                    shared.produced_groups += config.groups_per_batch
                    shared.produced_tokens += tokens
                    shared.cond.notify_all()
        except BaseException as error:  # noqa: BLE001 - re-raised on the learner's thread
            shared.error = error
        finally:
            with shared.cond:
                shared.done = True
                shared.cond.notify_all()

    def deliverable() -> bool:  # under shared.cond
        if not conduit:
            return queued() >= needed()
        return path.plane.can_sample() or bool(path.plane.in_flight())

    thread = threading.Thread(target=producer, name="grpo-producer", daemon=True)
    thread.start()
    wait_s, carried = 0.0, 0.0
    try:
        while shared.error is None:
            start = time.perf_counter()
            with shared.cond:
                while not (deliverable() or shared.done or shared.error is not None):
                    shared.cond.wait(0.005)
                finished = shared.done and not deliverable()
            wait_s += time.perf_counter() - start
            if finished or shared.error is not None:
                break
            start = time.perf_counter()
            taken = take(current()[1])
            if taken is None:  # nothing fresh (the rest went stale), or a race with the worker's draw
                if shared.done:
                    break
                continue
            exposed = carried + time.perf_counter() - start
            carried = learn(*taken, exposed)
            with shared.cond:
                snapshot["params"], snapshot["version"] = current()
                shared.cond.notify_all()
    finally:
        with shared.cond:
            shared.done = True
            shared.cond.notify_all()
        thread.join()
    if shared.error is not None:
        raise shared.error
    return wait_s


def summarize_run(config: GRPOConfig, path: str, mode: str, seed: int, steps: list, generations: list, wall: float,
                  wait_s: float, plane: dict) -> dict:
    # not timed: the first steps, and any that compiled (a trimmed packed batch has a few shapes)
    timed = [s for s in steps[WARMUP_STEPS:] if not s["compiled"]] or steps
    useful = sum(s["useful"] for s in timed)
    computed = sum(s["computed"] for s in timed)
    learner_s = sum(s["learner_s"] for s in timed)
    exposed = [s["exposed_s"] for s in timed]
    staleness = [x for s in steps for x in s["staleness"]]
    curve = [r for _, r, _ in generations]
    tail = max(1, len(curve) // 10)
    return {
        "path": path, "mode": mode, "seed": seed, "learner_steps": len(steps), "generations": len(generations),
        "packing_efficiency": useful / computed if computed else None,
        "learner_tokens_per_s": useful / learner_s if learner_s else None,
        "learner_step_ms": 1e3 * float(np.median([s["learner_s"] for s in timed])) if timed else None,
        "exposed_ms_median": 1e3 * float(np.median(exposed)) if exposed else None,
        "exposed_ms_mean": 1e3 * float(np.mean(exposed)) if exposed else None,
        "generation_ms_median": 1e3 * float(np.median([s for _, _, s in generations[1:]] or [0.0])),
        "groups_per_step": float(np.mean([s["groups"] for s in steps])) if steps else None,
        "useful_tokens_per_step": float(np.mean([s["useful"] for s in steps])) if steps else None,
        "batch_rows": {str(k): int(v) for k, v in zip(*np.unique([s["rows"] for s in steps], return_counts=True))},
        "dropped_stale_groups": int(plane["dropped_stale"]),
        "masked_stale_groups": int(plane["masked_stale"]) // config.group_size,  # masked whole, counted per sequence
        "dropped_overwritten_groups": int(plane["dropped_overwritten"]),
        "undelivered_groups": int(plane["undelivered"]),
        "plane": plane if path != "naive" else None,
        "staleness_histogram": {str(k): int(v) for k, v in zip(*np.unique(staleness, return_counts=True))},
        "curve": curve, "initial_reward": float(np.mean(curve[:min(tail, INITIAL_GENERATIONS)])),
        "final_reward": float(np.mean(curve[-tail:])),
        "loss_last": float(np.mean([s["loss"] for s in steps[-10:]])) if steps else None,
        "kl_last": float(np.mean([s["kl"] for s in steps[-10:]])) if steps else None,
        "clipped_last": float(np.mean([s["clipped"] for s in steps[-10:]])) if steps else None,
        "wait_for_producer_s": wait_s, "wall_s": wall,
    }


# ------------------------------------------------------------------------------------------------------------------
# The experiment: every path and mode on every seed, the comparison, the figure
# ------------------------------------------------------------------------------------------------------------------
GOALS = {"packing_efficiency": 0.9, "learner_tokens_per_s_vs_naive": 1.5, "exposed_vs_naive": 0.10,
         "full_run_s": 600.0, "quick_run_s": 120.0}
LEARNING = (("naive", "sync"), ("conduit-packed", "overlap"))  # the learning comparison: baseline, packed + scheduled


def run(config: GRPOConfig, seeds: Sequence[int], paths: Sequence[str] = PATHS, modes: Sequence[str] = MODES,
        log=print) -> dict:
    """Every (path, mode) on every seed, seeds outermost so a busy spell of the shared host hits every path alike."""
    exp = Experiment(config)
    rows = []
    for seed in seeds:
        for mode in modes:
            for path in paths:
                row = run_one(exp, path, mode, seed)
                rows.append(row)
                log(f"  seed {seed} {mode:<7} {path:<15} reward {row['initial_reward']:.2f} -> "
                    f"{row['final_reward']:.2f}  efficiency {row['packing_efficiency']:.2f}  learner "
                    f"{row['learner_tokens_per_s']:,.0f} tok/s  exposed {row['exposed_ms_median']:.2f} ms  "
                    f"({row['wall_s']:.1f} s)")
    return summarize(config, list(seeds), rows)


def _median(rows: list, key: str) -> Optional[float]:
    values = [r[key] for r in rows if r[key] is not None]
    return float(np.median(values)) if values else None


def summarize(config: GRPOConfig, seeds: list, rows: list) -> dict:
    """Per (path, mode): medians over seeds; ratios against naive in the same mode; the learning comparison."""
    from scipy import stats

    table = []
    for mode in dict.fromkeys(r["mode"] for r in rows):
        for path in dict.fromkeys(r["path"] for r in rows):
            same = [r for r in rows if r["path"] == path and r["mode"] == mode]
            if not same:
                continue
            entry = {"path": path, "mode": mode, "seeds": [r["seed"] for r in same]}
            for key in ("packing_efficiency", "learner_tokens_per_s", "learner_step_ms", "exposed_ms_median",
                        "exposed_ms_mean", "generation_ms_median", "groups_per_step", "useful_tokens_per_step",
                        "initial_reward", "final_reward", "wall_s"):
                entry[key] = _median(same, key)
            for key in ("dropped_stale_groups", "masked_stale_groups", "dropped_overwritten_groups"):
                entry[key] = int(sum(r[key] for r in same))  # totals over seeds
            table.append(entry)
    for entry in table:
        naive = next((e for e in table if e["path"] == "naive" and e["mode"] == entry["mode"]), None)
        entry["learner_tokens_per_s_vs_naive"] = None if naive is None else \
            entry["learner_tokens_per_s"] / naive["learner_tokens_per_s"]
        entry["exposed_vs_naive"] = None if naive is None else entry["exposed_ms_median"] / naive["exposed_ms_median"]
    finals = {f"{p}/{m}": [r["final_reward"] for r in rows if (r["path"], r["mode"]) == (p, m)] for p, m in LEARNING}
    base, ours = finals.values()
    learning = {"compared": list(finals), "finals": finals, "target_reward": TARGET_REWARD,
                "initial_reward": float(np.mean([r["initial_reward"] for r in rows])),
                "t": None, "p": None}
    if len(base) >= 2 and len(ours) >= 2:
        test = stats.ttest_ind(ours, base, equal_var=False)
        learning["t"], learning["p"] = float(test.statistic), float(test.pvalue)
    report = {"claim": "issue 41: GRPO's experience path (ragged groups, packed delivery, bounded staleness)",
              "config": dataclasses.asdict(config), "seeds": seeds, "goals": GOALS, "table": table,
              "learning": learning, "runs": rows}
    report["verdict"] = verdict(report)
    return report


def verdict(report: dict) -> list[str]:
    """Plain statements of each goal, reached or not, from the numbers."""
    table, goals, out = report["table"], report["goals"], []

    def row(path, mode):
        return next((e for e in table if e["path"] == path and e["mode"] == mode), None)

    for mode in dict.fromkeys(e["mode"] for e in table):
        packed, padded, naive = row("conduit-packed", mode), row("conduit-padded", mode), row("naive", mode)
        if packed is None or naive is None:
            continue
        efficiency = packed["packing_efficiency"]
        out.append(f"{mode}: packing efficiency {efficiency:.3f} (padded {naive['packing_efficiency']:.3f}; goal >= "
                   f"{goals['packing_efficiency']}: {'reached' if efficiency >= goals['packing_efficiency'] else 'NOT reached'})"
                   f"; learner tokens/s {packed['learner_tokens_per_s_vs_naive']:.3f}x naive"
                   + ("" if padded is None else f" (conduit-padded {padded['learner_tokens_per_s_vs_naive']:.2f}x)")
                   + f" (goal >= {goals['learner_tokens_per_s_vs_naive']}: "
                   f"{'reached' if packed['learner_tokens_per_s_vs_naive'] >= goals['learner_tokens_per_s_vs_naive'] else 'NOT reached'})"
                   f"; exposed path {packed['exposed_ms_median']:.3f} ms vs naive {naive['exposed_ms_median']:.3f} ms = "
                   f"{100 * packed['exposed_vs_naive']:.0f}% (goal <= {100 * goals['exposed_vs_naive']:.0f}%: "
                   f"{'reached' if packed['exposed_vs_naive'] <= goals['exposed_vs_naive'] else 'NOT reached'})")
    for e in table:
        if e["mode"] == "overlap" and e["path"] != "naive":
            out.append(f"overlap: {e['path']} stale groups over the seeds: {e['dropped_stale_groups']} dropped when "
                       f"drawn, {e['masked_stale_groups']} masked at delivery, {e['dropped_overwritten_groups']} "
                       f"overwritten undelivered")
    learning = report["learning"]
    base, ours = (learning["finals"][k] for k in learning["compared"])
    best = max(np.mean(base), np.mean(ours))
    out.append(f"learning: mean reward {learning['initial_reward']:.2f} at the start; final {np.mean(base):.3f} +- "
               f"{np.std(base):.3f} ({learning['compared'][0]}) vs {np.mean(ours):.3f} +- {np.std(ours):.3f} "
               f"({learning['compared'][1]}), Welch t={_fmt(learning['t'])} p={_fmt(learning['p'])}; target "
               f"{learning['target_reward']}: {'reached' if best >= learning['target_reward'] else 'NOT reached'}")
    if report.get("wall_s") is not None:
        limit = goals["quick_run_s"] if report.get("quick") else goals["full_run_s"]
        out.append(f"run time {report['wall_s']:.0f} s (goal < {limit:.0f} s: "
                   f"{'reached' if report['wall_s'] < limit else 'NOT reached'})")
    return out


def _fmt(x) -> str:
    return "n/a" if x is None else f"{x:.3g}"


def _vs_naive(ratio, percent: bool = False) -> str:
    """A ratio to the naive path's figure for the table; n/a when the naive path was not run (``--paths``)."""
    if ratio is None:
        return "n/a"
    return f"{100 * ratio:.0f}%" if percent else f"{ratio:.2f}x"


def format_table(report: dict) -> str:
    lines = [f"{'mode':<8} {'path':<15} {'efficiency':>10} {'learner tok/s':>13} {'vs naive':>8} {'step ms':>8} "
             f"{'exposed ms':>10} {'vs naive':>8} {'groups/step':>11} {'reward':>13} {'stale d/m':>9}"]
    for e in report["table"]:
        lines.append(f"{e['mode']:<8} {e['path']:<15} {e['packing_efficiency']:>10.3f} "
                     f"{e['learner_tokens_per_s']:>13,.0f} {_vs_naive(e['learner_tokens_per_s_vs_naive']):>8} "
                     f"{e['learner_step_ms']:>8.2f} {e['exposed_ms_median']:>10.3f} "
                     f"{_vs_naive(e['exposed_vs_naive'], percent=True):>8} {e['groups_per_step']:>11.1f} "
                     f"{e['initial_reward']:>5.2f} -> {e['final_reward']:.2f} "
                     f"{str(e['dropped_stale_groups']) + '/' + str(e['masked_stale_groups']):>9}")
    lines.append("medians over seeds; efficiency: useful / computed tokens in learner batches; learner tok/s: useful "
                 "tokens per second of learner step time; exposed: the learner thread's time getting a batch ready, "
                 "per step (median); stale d/m: groups dropped stale when drawn / masked stale at delivery, totals "
                 "over seeds")
    return "\n".join(lines)


def plot(report: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from experiments.report import caption_text

    table = report["table"]
    fig, axes = plt.subplots(1, 4, figsize=(18, 4.4))
    labels = [f"{e['path']}\n{e['mode']}" for e in table]
    x = np.arange(len(table))
    colors = {"naive": "tab:gray", "conduit-padded": "tab:blue", "conduit-packed": "tab:green"}
    bar_colors = [colors.get(e["path"], "tab:red") for e in table]
    for ax, key, title in ((axes[0], "packing_efficiency", "packing efficiency (useful / computed tokens)"),
                           (axes[1], "learner_tokens_per_s", "learner tokens / s"),
                           (axes[2], "exposed_ms_median", "exposed experience path per step (ms)")):
        ax.bar(x, [e[key] for e in table], color=bar_colors)
        ax.set_xticks(x, labels, fontsize=7)
        ax.set_title(title, fontsize=9)
    axes[0].axhline(report["goals"]["packing_efficiency"], color="k", ls="--", lw=0.8)
    for run in report["runs"]:
        if (run["path"], run["mode"]) in LEARNING:
            style = "-" if run["path"] == "conduit-packed" else "--"
            curve = np.asarray(run["curve"])
            window = max(1, len(curve) // 20)
            smooth = np.convolve(curve, np.ones(window) / window, mode="valid")
            axes[3].plot(np.arange(len(smooth)) + window - 1, smooth, style, color=colors[run["path"]],
                         label=f"{run['path']} {run['mode']} seed {run['seed']}", lw=1)
    axes[3].axhline(report["learning"]["target_reward"], color="k", ls=":", lw=0.8, label="target")
    axes[3].set_xlabel("generation")
    axes[3].set_ylabel("mean reward")
    axes[3].set_title("mean reward per generation (moving average)", fontsize=9)
    axes[3].legend(fontsize=6)
    fig.text(0.01, 0.01, caption_text(report), fontsize=7, family="monospace", va="bottom")
    fig.tight_layout(rect=(0, 0.05, 1, 1))
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _environment() -> dict:
    try:
        from benchmarks.common import environment  # the benchmark harness's record (versions, CPU, load, commit)
        return environment({})
    except Exception:  # noqa: BLE001 - the record is informative only
        return {"python": platform.python_version(), "jax": jax.__version__, "devices": [str(d) for d in jax.devices()],
                "cpu_count": os.cpu_count(), "load_average": list(os.getloadavg())}


def main(argv: Optional[list[str]] = None) -> int:
    import sys

    argv = list(sys.argv[1:] if argv is None else argv)
    started = time.perf_counter()
    defaults = GRPOConfig()
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="a smaller task and shorter runs, 2 seeds")
    parser.add_argument("--seeds", type=int, default=None, help="seeds 0..N-1 (default 3; --quick 2)")
    parser.add_argument("--iterations", type=int, default=None, help="generations per run")
    parser.add_argument("--paths", nargs="+", default=list(PATHS), choices=PATHS)
    parser.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES)
    parser.add_argument("--max-staleness", type=int, default=defaults.max_staleness)
    parser.add_argument("--schedule", choices=("overlap", "adaptive"), default=defaults.overlap_schedule,
                        help="the Conduit plane's schedule in overlap mode (sync mode: staged)")
    parser.add_argument("--no-scale-advantages", action="store_true", help="advantage = reward - group mean")
    parser.add_argument("--rows", type=int, default=None, help=f"rows of the packed layout's token budget "
                                                                f"(default {defaults.rows})")
    parser.add_argument("--row-length", type=int, default=None,
                        help=f"tokens per packed row (default {defaults.row_length})")
    parser.add_argument("--item-decay", type=float, default=None,
                        help=f"P(k items) ~ item_decay ** k (default {defaults.item_decay}; 1: uniform)")
    parser.add_argument("--no-trim-rows", action="store_true",
                        help="packed batches always take the whole [rows, row_length] budget (the fixed shape)")
    parser.add_argument("--out", default=str(RESULTS))
    args = parser.parse_args(argv)
    if args.item_decay is not None and args.item_decay <= 0:
        parser.error(f"--item-decay must be > 0, got {args.item_decay}")
    overrides = dict(QUICK) if args.quick else {}
    for key in ("iterations", "rows", "row_length", "item_decay"):
        if getattr(args, key) is not None:
            overrides[key] = getattr(args, key)
    config = dataclasses.replace(defaults, max_staleness=args.max_staleness, overlap_schedule=args.schedule,
                                 scale_advantages=not args.no_scale_advantages, trim_rows=not args.no_trim_rows,
                                 **overrides)
    seeds = list(range(args.seeds if args.seeds is not None else 2 if args.quick else 3))
    from experiments.report import command_line

    report = run(config, seeds, args.paths, args.modes)
    report = {"command": command_line("experiments.grpo", argv), "quick": args.quick,
              "environment": _environment(), **report}
    report["wall_s"] = time.perf_counter() - started
    report["verdict"] = verdict(report)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    stem = out / ("grpo_quick" if args.quick else "grpo")
    stem.with_suffix(".json").write_text(json.dumps(report, indent=1))
    plot(report, stem.with_suffix(".png"))
    print(format_table(report))
    print()
    for line in report["verdict"]:
        print(line)
    print(f"\nwrote {stem}.json and .png ({report['wall_s']:.0f} s)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
