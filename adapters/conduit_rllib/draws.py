"""The draws RLlib asks a Conduit buffer for, as pure functions over the core's state (a ``conduit_jax.make_buffer``
``ReplayState``) and the links (int32[3, ring]: for each stored step the ring row of the next step of its episode (-1:
none stored yet), of the previous one (-1: the episode's first) and of its episode's first stored step).

Each ``make_*`` closes over static arguments and returns the pure step a store gives its core engine
(``Engine.add_step``: run after the pending priority updates and the staged rows, in one kernel) per layout and static
arguments; ``buffer_for(batch)`` is the store's functional buffer drawing ``batch`` items.

* ``make_draw``: n-step transitions, PER's redraw and importance weights; ``make_gather``: n-step windows from
  given ring rows (the multi-agent synchronized draw); both follow the links with ``follow_window`` and name the
  columns with ``window_columns``; ``make_sequences``: RLlib's ``[B, T]`` batch; ``make_slices``: the rows of
  episode slices; ``link``: an add's links; ``with_adds``: a step after the adds' links and retirements;
  ``random_keys`` / ``shuffled``: the draws' random numbers.
* On the host: ``n_range`` (a request's n-steps), ``candidate_count`` (how many steps PER's redraw draws),
  ``joined`` (one batch from several draws), ``exact_values`` (float64 columns back bit for bit), ``to_host``;
  the kernels' host arguments packed into few arrays (``adds_fill``, ``draw_arguments``, ``stream_argument``: each
  NumPy argument costs a kernel call several us of dispatch).

For PER's redraw a draw takes more steps than the batch needs, as many as the share of fitting windows in earlier
draws asks for (``candidate_count``), so one kernel suffices even when most of the priority mass sits on steps near an
episode's end (short episodes); where even its largest draw has too few, the fitting steps of several draws are
joined, as RLlib resamples one step at a time.
"""

from __future__ import annotations

import math
from typing import NamedTuple, Optional

import jax
import jax.numpy as jnp
import numpy as np
from ray.rllib.core.columns import Columns

from conduit_jax import ExperienceSpec, samplers
from conduit_jax.replay import compile_size
from conduit_jax.storage import RowLayout
from conduit_rllib.episode_index import EXACT, unbits

MOST_CANDIDATES = 1 << 14  # PER's redraw: steps one draw kernel takes by priority at most (beyond 64 x the batch)
RANDOM_STREAM = 1  # the draws' random numbers: the core's counter-based bits on a stream the core's samplers do not use


class Request(NamedTuple):
    """What a ``sample()`` call asks for; a prefetched batch is handed over only to the same request."""

    size: int
    n_range: tuple  # (low, high), inclusive
    beta: float
    gamma: float


class Drawn(NamedTuple):
    """A draw kernel's batch for ``request`` (its arrays may still be computing)."""

    request: Request
    columns: dict
    ids: jax.Array
    fitting: jax.Array  # int32[]: how many of the candidates' windows fitted (0: the draw found nothing to draw)
    candidates: int  # steps drawn by priority


def candidate_count(need: int, share: float) -> int:
    """How many steps a draw takes by priority when a ``share`` of the priority mass sits on steps whose n-step window
    fits and ``need`` of those must be among them: the binomial mean at least three standard deviations (plus 4) above
    ``need``, at most ``max(64 * need, MOST_CANDIDATES)`` (a smaller share takes several draws); rounded up to a
    power of two, so a share that drifts compiles few kernel sizes (finer sizes compiled one kernel after another
    while priorities moved the share, and the compiles took much of a warm-up)."""
    target = math.ceil(min((need + 3 * math.sqrt(need) + 4) / max(share, 1e-9), max(64 * need, MOST_CANDIDATES)))
    return compile_size(target)


def exact_values(host: dict, gamma: float, discounts: Optional[np.ndarray] = None) -> dict:
    """A drawn batch's float64 columns as they were added: bit patterns back to float64, and the n-step sums of
    float64 rewards recomputed in float64 (RLlib's recursion, from the window's last reward back; with
    ``discounts``, float64[B, longest], the k-th reward weighs ``discounts[:, k]``)."""
    for key in [k for k in host if k.startswith(EXACT)]:
        words = host.pop(key)
        if key == EXACT + "reward_window":
            rewards, used, total = unbits(words), host["n_step"], 0.0
            for k in range(rewards.shape[1] - 1, -1, -1):
                if discounts is None:
                    total = np.where(k < used, rewards[:, k] + gamma * total, total)
                else:
                    total = np.where(k < used, discounts[:, k] * rewards[:, k] + total, total)
            host[Columns.REWARDS] = np.asarray(total, np.float64)
        else:
            host[key[len(EXACT):]] = unbits(words)
    return host


def n_range(name: str, n_step) -> tuple[int, int]:
    """The n-steps to draw from, inclusive: RLlib's ``(low, high)`` draws n in ``[low, high)``; ``name`` names the
    buffer in the error."""
    if isinstance(n_step, (tuple, list)):
        if len(n_step) != 2 or not all(isinstance(x, (int, np.integer)) for x in n_step) \
                or not 1 <= n_step[0] < n_step[1]:
            raise ValueError(f"{name}.sample(): an n_step range must be (low, high) ints with 1 <= low < high, "
                             f"got {n_step!r}")
        return int(n_step[0]), int(n_step[1]) - 1
    n = 1 if n_step is None else n_step
    if not isinstance(n, (int, np.integer)) or isinstance(n, bool) or n < 1:
        raise ValueError(f"{name}.sample(): n_step must be an int >= 1 or a (low, high) range, got {n_step!r}")
    return int(n), int(n)


def joined(parts: list) -> Drawn:
    """One batch from the first ``take`` rows of each ``(draw, take)``: the rows whose window fitted, which a draw
    puts first (in random order)."""
    first = parts[0][0]
    columns = {k: jnp.concatenate([drawn.columns[k][:take] for drawn, take in parts]) for k in first.columns}
    ids = jnp.concatenate([drawn.ids[:take] for drawn, take in parts])
    return Drawn(first.request, columns, ids, np.int32(ids.shape[0]), first.candidates)


def to_host(tree):
    """A pytree of JAX arrays as NumPy arrays (read-only), once computed. On the CPU ``np.asarray`` reads each buffer
    in place, with less overhead per array than ``jax.device_get``; on an accelerator ``device_get`` starts every
    copy before it waits for the first."""
    if jax.default_backend() == "cpu":
        return jax.tree.map(np.asarray, tree)
    return jax.device_get(tree)


def random_keys(seed, counter, n: int) -> jax.Array:
    """``n`` random uint32 for draw number ``counter`` of a store seeded ``seed``: the core's counter-based bits
    (``samplers.random_bits``), one fused integer kernel. ``jax.random``'s threefry compiles to a rolled loop on
    XLA:CPU, ~40 us of a ~300 us PER draw kernel."""
    return samplers.random_bits(samplers.seed_key(seed), counter, n, stream=RANDOM_STREAM)


def shuffled(rows: jax.Array, seed, counter) -> jax.Array:
    """A drawn batch's rows in random order. The sampler's draws are stratified (draw j lands in the j-th equal
    slice of the priority mass), so a kernel that uses only some of them, or groups them, takes them in a random
    order to keep every one uniform over the buffer."""
    return rows[jnp.argsort(random_keys(seed, counter, rows.shape[0]))]


def link(links, full, patch):
    """An add's links: ``full`` int32[4, m] (each written step's row, then the rows of its episode's next, previous
    and first step) and ``patch`` int32[2, k] (the row of an episode's last stored step and the row that now follows
    it); rows past the ring are padding and dropped."""
    links = links.at[:, full[0]].set(full[1:], mode="drop")
    return links.at[0, patch[0]].set(patch[1], mode="drop")


ADDS_ROWS = (4, 2, 2)  # the rows of ``with_adds``' packed array: ``link``'s full and patch blocks, retired ids (.T)


def adds_fill(ring: int) -> np.ndarray:
    """int32[8]: the padding value of each row of ``with_adds``' packed array (a row past the ring ``ring`` where a
    link names a row, which the write drops; -1 elsewhere, which the retirement ignores)."""
    fill = np.full(sum(ADDS_ROWS), -1, np.int32)
    fill[0] = fill[ADDS_ROWS[0]] = ring
    return fill


def with_adds(buffer, step, retires: bool = True):
    """``step(state, links, *args) -> (state, *outputs)`` after the adds given since the last kernel, packed in one
    int32[8, k] array (one host argument instead of three: each costs the kernel's dispatch several us): their links
    (``link``: ``full`` rows 0-3, ``patch`` rows 4-5) and the retirement of the steps they evicted (rows 6-7: ids, -1
    columns are padding), in the order one add did them (written, linked, retired; the engine writes the staged rows
    first). The links come out too (donated in, updated). Without ``retires`` (static: no add since the last kernel
    evicted a step) the retirement is left out. The store writes staged rows in a kernel of their own before a
    retiring step: beside a run write, the retirement's scatter into the sum tree makes XLA:CPU copy every level."""
    first, second = ADDS_ROWS[0], ADDS_ROWS[0] + ADDS_ROWS[1]

    def stepped(state, links, adds, *args):
        full, patch, retire = adds[:first], adds[first:second], adds[second:].T
        links = link(links, full, patch)
        state, *outputs = step(buffer.retire(state, retire) if retires else state, links, *args)
        return (state, links, *outputs)

    return stepped


class Window(NamedTuple):
    """Each row's n-step window, followed through the links (``follow_window``)."""

    last: jax.Array  # int32[B]: the ring row of the window's last step
    used: jax.Array  # int32[B]: steps in the window (fewer than n where its episode's stored steps end)
    fits: jax.Array  # bool[B]: all n steps are stored
    ret: jax.Array  # float32[B]: the discounted reward sum
    exact: list  # per step the float64 rewards' bits (uint32[B, 2]), when the rewards are float64


def follow_window(buffer, state, links, rows, first: dict, n, longest: int, discount, exact_reward: bool) -> Window:
    """Follow ``rows`` (ring rows; ``first``: their stored columns) through the links to their episode's next
    steps, n per row (at most ``longest``, and no further than the episode's stored steps); the k-th step's reward
    weighs ``discount(k)`` (k >= 1; the first step's weighs 1)."""
    last, going, fits = rows, jnp.ones(rows.shape, jnp.bool_), jnp.ones(rows.shape, jnp.bool_)
    ret, used = first["reward"].astype(jnp.float32), jnp.ones(rows.shape, jnp.int32)
    exact = [first[EXACT + "reward"]] if exact_reward else []  # float64 rewards, bit for bit
    for k in range(1, longest):
        following = links[0, last]
        step = going & (k < n) & (following >= 0)
        fits = fits & ((k >= n) | step)
        read = buffer.read(state, jnp.where(step, following, 0))
        ret = ret + jnp.where(step, discount(k) * read["reward"], 0.0)
        if exact_reward:
            exact.append(jnp.where(step[:, None], read[EXACT + "reward"], 0))
        last, used, going = jnp.where(step, following, last), used + step.astype(jnp.int32), step
    return Window(last, used, fits, ret, exact)


def window_columns(names, first: dict, end: dict, window: Window) -> dict:
    """A transition's columns from its first step's stored columns, its window's last step's (``end``) and the
    ``window``: o_t, a_t, the reward sum, o_(t+n) with its terminated / truncated, the steps used (``n_step``), the
    float64 twins, the infos / extra_model_outputs of step t and the infos of o_(t+n)."""
    names = set(names)
    columns = {Columns.OBS: first["obs"], Columns.NEXT_OBS: end["next_obs"], Columns.ACTIONS: first["action"],
               Columns.REWARDS: window.ret, Columns.TERMINATEDS: end["terminated"],
               Columns.TRUNCATEDS: end["truncated"], "n_step": window.used}
    for source, column, data in (("obs", Columns.OBS, first), ("next_obs", Columns.NEXT_OBS, end),
                                 ("action", Columns.ACTIONS, first)):
        if EXACT + source in names:
            columns[EXACT + column] = data[EXACT + source]
    if window.exact:
        columns[EXACT + "reward_window"] = jnp.stack(window.exact, axis=1)  # [B, longest, 2]
    columns.update({k: first[k] for k in names if k.startswith(("extra__", "info__", EXACT + "extra__",
                                                                  EXACT + "info__"))})
    columns.update({k: end[k] for k in names if k.startswith(("next_info__", EXACT + "next_info__"))})
    return columns


def make_draw(buffer_for, names, prioritized: bool, candidates: int, size: int, longest: int, redraw: bool):
    """One draw: ``candidates`` steps by priority, their n-step windows (n per candidate, at most ``longest``)
    followed through the links, the first ``size`` whose window fits (``redraw``: RLlib's PER resampling) or all of
    them (windows clipped at the episode's end), and the importance weights for ``beta`` (``prioritized``; else 1)."""
    buffer = buffer_for(candidates)
    exact_reward = EXACT + "reward" in set(names)

    def draw(state, links, arguments):
        n, beta, gamma, seed, counter = draw_arguments_in(arguments, candidates)
        keys = random_keys(seed, counter, candidates)
        state, delivery = buffer.sample(state)
        rows = delivery.ids[:, 0]
        window = follow_window(buffer, state, links, rows, delivery.data, n, longest, lambda k: jnp.power(gamma, k),
                               exact_reward)
        end = buffer.read(state, window.last)
        if redraw:
            order = jnp.argsort(jnp.where(window.fits, keys >> 1, jnp.uint32(0xFFFFFFFF)))[:size]  # fitting first
            fitting = jnp.where(delivery.valid, jnp.sum(window.fits, dtype=jnp.int32), 0)
        else:  # every candidate, in random order: the host may drop the shard padding off the end
            order, fitting = jnp.argsort(keys[:size]), jnp.where(delivery.valid, size, 0)
        weights = jnp.power(delivery.weights, beta) if prioritized else jnp.ones(rows.shape, jnp.float32)
        columns = window_columns(names, delivery.data, end, window)
        columns["weights"] = weights.astype(jnp.float32)
        columns = {k: v[order] for k, v in columns.items()}
        return state, columns, delivery.ids[order], fitting

    return draw


PACKED = "packed"  # the one column of a packed draw (``packed_draw``)


def train_layout(buffer, draw, links_shape: tuple, candidates: int) -> RowLayout:
    """The layout ``packed_draw`` packs ``draw``'s columns in (a ``make_draw`` of ``candidates``): every column but the
    float64 twins (a torch learner trains on the float32 values), from the draw's output types (``jax.eval_shape``:
    traced, not run)."""
    state = jax.eval_shape(buffer.init)
    links = jax.ShapeDtypeStruct(links_shape, jnp.int32)
    arguments = draw_arguments(np.zeros(candidates, np.int32), 0.0, 0.0, 0, 0)
    _, columns, _, _ = jax.eval_shape(draw, state, links, jax.ShapeDtypeStruct(arguments.shape, jnp.int32))
    return RowLayout.of(ExperienceSpec.from_structs({k: jax.ShapeDtypeStruct(v.shape[1:], v.dtype)
                                                     for k, v in columns.items() if not k.startswith(EXACT)}))


def packed_draw(draw, layout: RowLayout):
    """``draw`` with its columns packed into one int32[B, layout.row_words] array (``RowLayout.pack``, as int32 for
    torch), the one column ``PACKED``: a torch learner takes it in one DLPack hand-over and views each column in it
    (``dlpack.words_to_torch``), and the kernel has one output where it had one per column."""

    def packed(state, links, arguments):
        state, columns, ids, fitting = draw(state, links, arguments)
        words = layout.pack({k: columns[k] for k in layout.spec.names})
        return state, {PACKED: jax.lax.bitcast_convert_type(words, jnp.int32)}, ids, fitting

    return packed


def stream_argument(seed: int, counter: int) -> np.ndarray:
    """The random stream of a draw of ``make_sequences`` / ``make_slices`` as their one host argument: uint32[2],
    the store's seed and the draw's counter."""
    return np.asarray([seed, counter], np.uint32)


def draw_arguments(n: np.ndarray, beta: float, gamma: float, seed: int, counter: int) -> np.ndarray:
    """``make_draw``'s host arguments as one int32 array (one transfer into the kernel): each candidate's n, then
    beta and gamma (float32 bits), the store's seed and the draw's counter (uint32 bits)."""
    out = np.empty(n.shape[0] + 4, np.int32)
    out[:n.shape[0]] = n
    out[n.shape[0]:n.shape[0] + 2] = np.asarray([beta, gamma], np.float32).view(np.int32)
    out[n.shape[0] + 2:] = stream_argument(seed, counter).view(np.int32)
    return out


def draw_arguments_in(arguments, candidates: int) -> tuple:
    """Inside the draw kernel: ``draw_arguments``' values (n int32[candidates], beta, gamma, seed, counter)."""
    scalars = arguments[candidates:]
    floats = jax.lax.bitcast_convert_type(scalars[:2], jnp.float32)
    words = jax.lax.bitcast_convert_type(scalars[2:], jnp.uint32)
    return arguments[:candidates], floats[0], floats[1], words[0], words[1]


def make_gather(buffer_for, names, size: int, longest: int):
    """The synchronized multi-agent draw's rows of one module: for ``size`` given ring rows (the agent steps taken at
    the drawn env steps; padding rows are dropped by the host), each row's window of ``steps`` agent steps (at most
    ``longest``) followed through the links, the k-th step's reward weighing ``discounts[:, k]`` (gamma to the env
    steps from the drawn one to the one the agent acted at), as ``window_columns``; weights and ``n_step`` (env
    steps) are the host's."""
    buffer = buffer_for(size)
    exact_reward = EXACT + "reward" in set(names)

    def gather(state, links, rows, steps, discounts):
        first = buffer.read(state, rows)
        window = follow_window(buffer, state, links, rows, first, steps, longest, lambda k: discounts[:, k],
                               exact_reward)
        return state, window_columns(names, first, buffer.read(state, window.last), window)

    return gather


def make_sequences(buffer_for, names, size: int, length: int):
    """RLlib's ``[B, T]`` batch: each row starts at a uniformly drawn step and runs to its episode's end (the
    final observation included, with the last action repeated), then continues with another drawn step's
    episode from its first step, until T entries; ``is_first`` / ``is_last`` / ``is_terminated`` /
    ``is_truncated`` as RLlib sets them. A row needs at most T // 2 + 1 draws (an entry run is >= 2 long)."""
    draws = length // 2 + 1
    buffer = buffer_for(size * draws)
    names = set(names)
    exact = {k: EXACT + k in names for k in ("obs", "action", "reward")}

    def pick(condition, a, b):
        return jnp.where(condition.reshape(condition.shape + (1,) * (a.ndim - 1)), a, b)

    def sequences(state, links, stream):
        seed, counter = stream[0], stream[1]
        state, delivery = buffer.sample(state)
        pool = shuffled(delivery.ids[:, 0], seed, counter).reshape(size, draws)
        start = pool[:, 0]
        before = links[1, start]
        first = buffer.read(state, jnp.maximum(before, 0))
        first_reward = jnp.where(before >= 0, first["reward"], 0.0)
        first_bits = jnp.where((before >= 0)[:, None], first[EXACT + "reward"], 0) if exact["reward"] else \
            jnp.zeros((size, 2), jnp.uint32)
        zeros = jnp.zeros((size,), jnp.bool_)

        def entry(carry, t):
            row, final, segment, reward, bits, first = carry
            data = buffer.read(state, row)
            out = {"obs": pick(final, data["next_obs"], data["obs"]), "actions": data["action"],
                   "rewards": reward, "is_first": first, "is_last": final | (t == length - 1),
                   "is_terminated": final & data["terminated"], "is_truncated": final & data["truncated"]}
            if exact["obs"]:  # float64 columns, bit for bit
                out[EXACT + "obs"] = pick(final, data[EXACT + "next_obs"], data[EXACT + "obs"])
            if exact["action"]:
                out[EXACT + "actions"] = data[EXACT + "action"]
            if exact["reward"]:
                out[EXACT + "rewards"] = bits
                bits = jnp.where(final[:, None], 0, data[EXACT + "reward"])
            following = links[0, row]
            segment = segment + final.astype(jnp.int32)
            fresh = links[2, jnp.take_along_axis(pool, jnp.minimum(segment, draws - 1)[:, None], 1)[:, 0]]
            row = jnp.where(final, fresh, jnp.where(following >= 0, following, row))
            reward = jnp.where(final, 0.0, data["reward"].astype(jnp.float32))
            return (row, ~final & (following < 0), segment, reward, bits, final), out

        carry = (start, zeros, jnp.zeros((size,), jnp.int32), first_reward.astype(jnp.float32), first_bits, ~zeros)
        _, out = jax.lax.scan(entry, carry, jnp.arange(length))
        return state, {k: jnp.swapaxes(v, 0, 1) for k, v in out.items()}

    return sequences


def make_slices(buffer_for, names, size: int, lookback: int, length: int):
    """RLlib's sequences of episodes: for each of ``size`` uniformly drawn steps, the ring rows of up to
    ``lookback`` steps before it and up to ``length`` steps from it, in its episode (-1 past either end, followed
    through the links), every stored column at those rows, and the window's last step's ``next_*`` columns."""
    buffer = buffer_for(size)
    at_end = [k for k in names if k.startswith(("next_", EXACT + "next_")) or k in ("terminated", "truncated")]
    per_step = [k for k in names if k not in at_end]

    def slices(state, links, stream):
        seed, counter = stream[0], stream[1]
        state, delivery = buffer.sample(state)
        start = shuffled(delivery.ids[:, 0], seed, counter)  # RLlib takes as many as its count needs

        def follow(direction: int, count: int):
            """[size, count]: the rows 1..count steps away from ``start`` (direction 0: later, 1: earlier)."""
            def step(row, _):
                row = jnp.where(row >= 0, links[direction, jnp.maximum(row, 0)], -1)
                return row, row

            if count == 0:
                return jnp.zeros((size, 0), jnp.int32)
            return jax.lax.scan(step, start, None, length=count)[1].T

        rows = jnp.concatenate([follow(1, lookback)[:, ::-1], start[:, None], follow(0, length - 1)], axis=1)
        taken = jnp.sum(rows[:, lookback:] >= 0, axis=1)
        last = jnp.take_along_axis(rows, (lookback + taken - 1)[:, None], axis=1)[:, 0]
        data = buffer.read(state, jnp.maximum(rows, 0).reshape(-1))
        data = {k: data[k].reshape(rows.shape + data[k].shape[1:]) for k in per_step}
        end = buffer.read(state, last)
        return state, rows, delivery.valid, data, {k: end[k] for k in at_end}

    return slices
