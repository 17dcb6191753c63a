"""Pure-JAX environments written from the published dynamics: CartPole (Barto, Sutton & Anderson 1983, with the
equations as in Florian 2007 / the classic-control reference) and Pendulum (the classic-control inverted pendulum).

An environment is a NamedTuple of pure functions, as everything else here:
  reset(key) -> (obs, state)
  step(key, state, action) -> (obs, state, reward, terminated, truncated, info)
``step`` resets finished episodes itself (the returned obs is the first of the new episode) and puts the real last
observation of the finished one in ``info['final_obs']`` so off-policy learners can bootstrap through a truncation.
``vectorize(env)`` vmaps both over a batch of environments. ``info`` also carries episode statistics:
``episode_return`` of the episode that ended this step (0 elsewhere) and ``episode_done``.
"""

from __future__ import annotations

from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp


class Env(NamedTuple):
    name: str
    obs_dim: int
    num_actions: int  # 0 for a continuous action space
    action_dim: int  # 1 for a discrete action (an int32 scalar)
    action_low: float
    action_high: float
    reset: Callable[[jax.Array], tuple[jax.Array, Any]]
    step: Callable[[jax.Array, Any, jax.Array], tuple]


class EpisodeState(NamedTuple):
    physics: jax.Array  # float32[d]: the simulator's state
    t: jax.Array  # int32[]: steps taken in this episode
    episode_return: jax.Array  # float32[]: reward summed over this episode so far


def _with_auto_reset(name: str, obs_dim: int, num_actions: int, action_dim: int, low: float, high: float,
                     init_physics, dynamics, observe, max_steps: int) -> Env:
    """Wrap ``dynamics(physics, action) -> (physics', reward, terminated)`` into an auto-resetting Env."""

    def reset(key):
        physics = init_physics(key)
        return observe(physics), EpisodeState(physics, jnp.zeros((), jnp.int32), jnp.zeros((), jnp.float32))

    def step(key, state: EpisodeState, action):
        physics, reward, terminated = dynamics(state.physics, action)
        t = state.t + 1
        truncated = (t >= max_steps) & ~terminated
        done = terminated | truncated
        episode_return = state.episode_return + reward
        final_obs = observe(physics)
        fresh_obs, fresh = reset(key)

        def keep(new, old):
            return jnp.where(done, new, old)

        next_state = EpisodeState(keep(fresh.physics, physics), keep(fresh.t, t),
                                  keep(fresh.episode_return, episode_return))
        info = {"final_obs": final_obs, "episode_done": done,
                "episode_return": jnp.where(done, episode_return, 0.0), "episode_length": jnp.where(done, t, 0)}
        return keep(fresh_obs, final_obs), next_state, reward, terminated, truncated, info

    return Env(name, obs_dim, num_actions, action_dim, low, high, reset, step)


# ------------------------------------------------------------------------------------------------------------------
# CartPole: a pole hinged on a cart moved by +-10 N; reward 1 per step until the pole falls or the cart leaves.
# ------------------------------------------------------------------------------------------------------------------
def cartpole(max_steps: int = 500) -> Env:
    gravity, cart_mass, pole_mass, half_length, force_mag, tau = 9.8, 1.0, 0.1, 0.5, 10.0, 0.02
    total_mass = cart_mass + pole_mass
    pole_moment = pole_mass * half_length
    theta_limit = 12 * 2 * jnp.pi / 360  # 12 degrees
    x_limit = 2.4

    def init_physics(key):
        return jax.random.uniform(key, (4,), jnp.float32, -0.05, 0.05)  # x, x_dot, theta, theta_dot

    def dynamics(physics, action):
        x, x_dot, theta, theta_dot = physics
        force = jnp.where(action == 1, force_mag, -force_mag)
        cos, sin = jnp.cos(theta), jnp.sin(theta)
        temp = (force + pole_moment * theta_dot**2 * sin) / total_mass
        theta_acc = (gravity * sin - cos * temp) / (half_length * (4.0 / 3.0 - pole_mass * cos**2 / total_mass))
        x_acc = temp - pole_moment * theta_acc * cos / total_mass
        # explicit Euler, as in the reference implementation
        physics = jnp.stack([x + tau * x_dot, x_dot + tau * x_acc, theta + tau * theta_dot,
                             theta_dot + tau * theta_acc])
        terminated = (jnp.abs(physics[0]) > x_limit) | (jnp.abs(physics[2]) > theta_limit)
        return physics, jnp.float32(1.0), terminated

    return _with_auto_reset("CartPole", 4, 2, 1, 0.0, 1.0, init_physics, dynamics, lambda p: p, max_steps)


# ------------------------------------------------------------------------------------------------------------------
# Pendulum: swing a frictionless pendulum up and hold it; torque in [-2, 2]; 200 steps, never terminates.
# ------------------------------------------------------------------------------------------------------------------
def pendulum(max_steps: int = 200) -> Env:
    max_speed, max_torque, dt, gravity, mass, length = 8.0, 2.0, 0.05, 10.0, 1.0, 1.0

    def init_physics(key):
        return jax.random.uniform(key, (2,), jnp.float32, jnp.array([-jnp.pi, -1.0]), jnp.array([jnp.pi, 1.0]))

    def dynamics(physics, action):
        theta, theta_dot = physics
        u = jnp.clip(jnp.reshape(action, ()), -max_torque, max_torque)
        angle = ((theta + jnp.pi) % (2 * jnp.pi)) - jnp.pi  # normalised to [-pi, pi)
        cost = angle**2 + 0.1 * theta_dot**2 + 0.001 * u**2
        theta_dot = theta_dot + (3 * gravity / (2 * length) * jnp.sin(theta) + 3.0 / (mass * length**2) * u) * dt
        theta_dot = jnp.clip(theta_dot, -max_speed, max_speed)
        theta = theta + theta_dot * dt
        return jnp.stack([theta, theta_dot]), -cost, jnp.zeros((), bool)

    def observe(physics):
        return jnp.stack([jnp.cos(physics[0]), jnp.sin(physics[0]), physics[1]])

    return _with_auto_reset("Pendulum", 3, 0, 1, -max_torque, max_torque, init_physics, dynamics, observe, max_steps)


ENVS = {"CartPole": cartpole, "Pendulum": pendulum}


def make(name: str) -> Env:
    if name not in ENVS:
        raise ValueError(f"envs.make(): unknown environment {name!r}; known: {sorted(ENVS)}")
    return ENVS[name]()


def vectorize(env: Env) -> Env:
    """The same Env over a leading batch axis: ``reset(keys[n])``, ``step(keys[n], states, actions[n])``."""
    return env._replace(reset=jax.vmap(env.reset), step=jax.vmap(env.step))
