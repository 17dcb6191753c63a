"""The ``conduit`` command: ``conduit demo`` now; ``plan``, ``bench`` and ``experiment`` join ``COMMANDS`` later.

Each subcommand is a ``Command(name, help, add_arguments, run)``: ``add_arguments`` fills its argparse sub-parser and
``run(args) -> exit status`` does the work. Nothing here touches a JAX backend before ``configure_devices`` has run, so
the emulated host device count still takes effect: by default the CPU backend gets 8 devices, the mesh the tests use.
Modules that compute (``conduit_jax.demo``, ...) are imported inside ``run``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Callable, NamedTuple, Optional, Sequence

DEFAULT_HOST_DEVICES = 8
_DEVICE_COUNT_FLAG = "--xla_force_host_platform_device_count"


def configure_devices(count: int = DEFAULT_HOST_DEVICES) -> Optional[str]:
    """Ask XLA for ``count`` emulated CPU devices unless the user already set a count (``XLA_FLAGS`` naming
    ``xla_force_host_platform_device_count``, or ``JAX_NUM_CPU_DEVICES``). Returns a warning when it is too late:
    a JAX backend already started in this process. Accelerator platforms are unaffected."""
    flags = os.environ.get("XLA_FLAGS", "")
    if _DEVICE_COUNT_FLAG.lstrip("-") in flags or "JAX_NUM_CPU_DEVICES" in os.environ:
        return None
    if "jax" in sys.modules:
        try:
            from jax._src import xla_bridge
            started = xla_bridge.backends_are_initialized()
        except (ImportError, AttributeError):  # pragma: no cover - private API moved; assume not started
            started = False
        if started:
            return (f"a JAX backend is already running, so {_DEVICE_COUNT_FLAG}={count} cannot take effect; set "
                    f"XLA_FLAGS='{_DEVICE_COUNT_FLAG}={count}' before starting Python")
    os.environ["XLA_FLAGS"] = f"{flags} {_DEVICE_COUNT_FLAG}={count}".strip()
    return None


class Command(NamedTuple):
    name: str
    help: str
    add_arguments: Callable[[argparse.ArgumentParser], None]
    run: Callable[[argparse.Namespace], int]


# ------------------------------------------------------------------------------------------------------------------
# conduit demo
# ------------------------------------------------------------------------------------------------------------------
def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value}")
    return value


def _demo_arguments(parser: argparse.ArgumentParser) -> None:
    from conduit_jax.demo import SAMPLERS, DemoConfig  # imports jax, but starts no backend

    d = DemoConfig()
    parser.add_argument("--iterations", type=_positive_int, default=d.iterations,
                        help=f"actor -> ingest -> sample -> learner iterations (default {d.iterations})")
    parser.add_argument("--devices", type=_positive_int, default=None,
                        help=f"devices the plane shards over (default: all; on CPU {DEFAULT_HOST_DEVICES} emulated "
                             f"unless XLA_FLAGS or JAX_NUM_CPU_DEVICES sets a count)")
    parser.add_argument("--batch-size", type=_positive_int, default=d.batch_size,
                        help=f"items per delivered batch, a multiple of the devices (default {d.batch_size})")
    parser.add_argument("--capacity", type=_positive_int, default=d.capacity,
                        help=f"items the plane holds, a multiple of the devices (default {d.capacity})")
    parser.add_argument("--actors", type=_positive_int, default=d.num_actors,
                        help=f"actors, one ingest call each per iteration (default {d.num_actors})")
    parser.add_argument("--envs-per-actor", type=_positive_int, default=d.envs_per_actor,
                        help=f"vectorized envs per actor: items per ingest call (default {d.envs_per_actor})")
    parser.add_argument("--sampler", choices=SAMPLERS, default=d.sampler, help=f"default {d.sampler}")
    parser.add_argument("--seed", type=int, default=d.seed, help=f"default {d.seed}")
    parser.add_argument("--json", action="store_true", help="print the summary as JSON instead of the report")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")


def _run_demo(args: argparse.Namespace) -> int:
    warning = configure_devices(max(DEFAULT_HOST_DEVICES, args.devices or 0))
    if warning:
        print(f"conduit demo: warning: {warning}", file=sys.stderr)
    from conduit_jax.demo import DemoConfig, format_summary, run_demo
    from conduit_jax.errors import ConduitError

    config = DemoConfig(iterations=args.iterations, devices=args.devices, batch_size=args.batch_size,
                        capacity=args.capacity, num_actors=args.actors, envs_per_actor=args.envs_per_actor,
                        sampler=args.sampler, seed=args.seed, progress=not args.no_progress)
    try:
        summary = run_demo(config)
    except ConduitError as exc:
        print(f"conduit demo: error: {exc}", file=sys.stderr)
        return 2
    print(json.dumps(summary, indent=2) if args.json else format_summary(summary))
    return 0


COMMANDS: tuple[Command, ...] = (
    Command("demo", "run synthetic actors -> the data plane -> a jitted DQN learner, and report what the plane did",
            _demo_arguments, _run_demo),
)


# ------------------------------------------------------------------------------------------------------------------
# entry point
# ------------------------------------------------------------------------------------------------------------------
def build_parser() -> argparse.ArgumentParser:
    from conduit_jax import __version__

    parser = argparse.ArgumentParser(
        prog="conduit", description="Conduit-JAX: the RL experience path as an explicit data plane on JAX.")
    parser.add_argument("--version", action="version", version=f"conduit-jax {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for command in COMMANDS:
        command_parser = sub.add_parser(command.name, help=command.help, description=command.help)
        command.add_arguments(command_parser)
        command_parser.set_defaults(run=command.run)
    return parser


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.run(args)
    except BrokenPipeError:  # stdout closed early (`conduit demo | head`): stop quietly, as other CLI tools do
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1


if __name__ == "__main__":
    sys.exit(main())
