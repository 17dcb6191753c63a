"""The ``conduit`` command: ``conduit demo``, ``conduit bench`` and ``conduit plan``; ``experiment`` joins ``COMMANDS``
later.

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


# ------------------------------------------------------------------------------------------------------------------
# conduit bench
# ------------------------------------------------------------------------------------------------------------------
_BENCH_WORKLOADS = "w1,w2,w3,w4,w5,w6"


def _bench_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--quick", action="store_true",
                        help="every workload small and few rounds (CI smoke run, well under a minute)")
    parser.add_argument("--only", default=None, help=f"comma-separated workloads (default: all, {_BENCH_WORKLOADS})")
    parser.add_argument("--emulated-mesh", action="store_true",
                        help="also run Conduit on 8 emulated CPU devices in W1/W2 (a correctness configuration)")
    parser.add_argument("--capacity", type=_positive_int, default=None, help="override each workload's capacity")
    parser.add_argument("--rounds", type=_positive_int, default=None, help="override the interleaved rounds")
    parser.add_argument("--no-plots", action="store_true", help="skip the PNG charts")
    parser.add_argument("--gpu", action="store_true",
                        help="run benchmarks/gpu.py instead: W1-W3 with the state in device, pinned_host and "
                             "unpinned_host memory (for a GPU; --quick smoke-tests it on CPU)")


def _import_benchmarks(module: str):
    """``benchmarks.<module>`` of an installed suite, else of ``./benchmarks`` (a Conduit-JAX checkout). The suite is
    not part of the conduit-jax package: returns (module, note) with a note saying where it was found, or (None,
    reason)."""
    import importlib
    from pathlib import Path

    def _ours(mod) -> bool:
        return callable(getattr(mod, "main", None)) and Path(getattr(mod, "__file__", "")).parent.name == "benchmarks"

    try:
        mod = importlib.import_module(f"benchmarks.{module}")
        if _ours(mod):
            return mod, None
    except ImportError:
        pass
    here = Path.cwd()
    if (here / "benchmarks" / "run.py").is_file():
        for name in [n for n in sys.modules if n == "benchmarks" or n.startswith("benchmarks.")]:
            del sys.modules[name]  # another package named "benchmarks" may have been imported above
        sys.path.insert(0, str(here))
        try:
            mod = importlib.import_module(f"benchmarks.{module}")
        except ImportError as exc:
            return None, f"found {here / 'benchmarks'} but could not import benchmarks.{module}: {exc}"
        return mod, (f"the benchmark suite is not installed with conduit-jax; using {here / 'benchmarks'} from the "
                     f"current directory (results go to {here / 'benchmarks' / 'results'})")
    return None, ("the benchmark suite (benchmarks/) is not part of the installed conduit-jax package and there is no "
                  f"benchmarks/run.py under the current directory {here}. Run `conduit bench` from the root of a "
                  "Conduit-JAX checkout (or `python -m benchmarks.run` there), with the bench extra installed: "
                  "pip install '.[bench]'")


def _run_bench(args: argparse.Namespace) -> int:
    mod, note = _import_benchmarks("gpu" if args.gpu else "run")
    if mod is None:
        print(f"conduit bench: error: {note}", file=sys.stderr)
        return 2
    if note:
        print(f"conduit bench: {note}", file=sys.stderr)
    argv = ["--quick"] if args.quick else []
    if args.gpu:
        if args.only:
            argv += ["--only", args.only]
        if args.rounds:
            argv += ["--rounds", str(args.rounds)]
        return int(mod.main(argv) or 0)
    if args.only:
        argv += ["--only", args.only]
    if args.emulated_mesh:
        argv.append("--emulated-mesh")
    if args.capacity:
        argv += ["--capacity", str(args.capacity)]
    if args.rounds:
        argv += ["--rounds", str(args.rounds)]
    if args.no_plots:
        argv.append("--no-plots")
    return int(mod.main(argv) or 0)


def _plan_arguments(parser: argparse.ArgumentParser) -> None:
    from conduit_jax.placement import planner

    planner.build_parser(parser)


def _run_plan(args: argparse.Namespace) -> int:
    from conduit_jax.placement import planner

    return planner.run_cli(args)


COMMANDS: tuple[Command, ...] = (
    Command("demo", "run synthetic actors -> the data plane -> a jitted DQN learner, and report what the plane did",
            _demo_arguments, _run_demo),
    Command("bench", "run the benchmark suite (W1-W6 against NumPy, cpprb, Flashbax, TorchRL) from a checkout's "
                     "benchmarks/", _bench_arguments, _run_bench),
    Command("plan", "plan where the plane's state lives on a topology (a preset, a JSON file, or this machine) and "
                    "explain why", _plan_arguments, _run_plan),
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
