"""The ``conduit`` command: ``conduit demo``, ``conduit bench``, ``conduit plan`` and ``conduit experiment``.

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
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import NamedTuple

from conduit_jax.placement.planner import positive_int  # no JAX: --help stays fast

DEFAULT_HOST_DEVICES = 8
_DEVICE_COUNT_FLAG = "--xla_force_host_platform_device_count"


def configure_devices(count: int = DEFAULT_HOST_DEVICES) -> str | None:
    """Ask XLA for ``count`` emulated CPU devices unless the user already set a count (``XLA_FLAGS`` naming
    ``xla_force_host_platform_device_count``, or ``JAX_NUM_CPU_DEVICES``). Returns a warning when it is too late:
    a JAX backend already started in this process. Accelerator platforms are unaffected."""
    flags = os.environ.get("XLA_FLAGS", "")
    if _DEVICE_COUNT_FLAG.lstrip("-") in flags or "JAX_NUM_CPU_DEVICES" in os.environ:
        return None
    from conduit_jax import runtime

    if runtime.backend_started():
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
def _demo_arguments(parser: argparse.ArgumentParser) -> None:
    from conduit_jax.demo import SAMPLERS, SCHEDULES, DemoConfig  # no JAX: --help stays fast

    d = DemoConfig()
    parser.add_argument("--iterations", type=positive_int, default=d.iterations,
                        help=f"actor -> ingest -> deliver -> learner iterations per schedule (default {d.iterations})")
    parser.add_argument("--schedule", choices=SCHEDULES, default=d.schedule,
                        help=f"the prefetching schedule run beside sync on the same workload; 'sync' runs sync only "
                             f"(default {d.schedule})")
    parser.add_argument("--depth", type=positive_int, default=d.depth,
                        help=f"batches the schedule keeps in flight (default {d.depth})")
    parser.add_argument("--rounds", type=positive_int, default=d.rounds,
                        help=f"interleaved rounds of the two runs (default {d.rounds})")
    parser.add_argument("--devices", type=positive_int, default=None,
                        help=f"shard the plane over the first N devices instead of the planner's placement for this "
                             f"host (on CPU there are {DEFAULT_HOST_DEVICES} emulated devices unless XLA_FLAGS or "
                             f"JAX_NUM_CPU_DEVICES sets a count)")
    parser.add_argument("--batch-size", type=positive_int, default=d.batch_size,
                        help=f"items per delivered batch, a multiple of the shards (default {d.batch_size})")
    parser.add_argument("--capacity", type=positive_int, default=d.capacity,
                        help=f"items the plane holds, a multiple of the shards (default {d.capacity})")
    parser.add_argument("--actors", type=positive_int, default=d.num_actors,
                        help=f"actors, one ingest call each per iteration (default {d.num_actors})")
    parser.add_argument("--envs-per-actor", type=positive_int, default=d.envs_per_actor,
                        help=f"vectorized envs per actor: items per ingest call (default {d.envs_per_actor})")
    parser.add_argument("--hidden", type=positive_int, default=d.hidden,
                        help=f"width of the Q-network's two hidden layers (default {d.hidden})")
    parser.add_argument("--sampler", choices=SAMPLERS, default=d.sampler, help=f"default {d.sampler}")
    parser.add_argument("--seed", type=int, default=d.seed, help=f"default {d.seed}")
    parser.add_argument("--trace", metavar="FILE", default=None,
                        help="write a Chrome/Perfetto trace of both runs (open in ui.perfetto.dev)")
    parser.add_argument("--plot", metavar="FILE", default=None,
                        help="write a PNG of where each run's iteration time goes (needs matplotlib)")
    parser.add_argument("--json", action="store_true", help="print the summary as JSON instead of the report")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")


def _run_demo(args: argparse.Namespace) -> int:
    warning = configure_devices(max(DEFAULT_HOST_DEVICES, args.devices or 0))
    if warning:
        print(f"conduit demo: warning: {warning}", file=sys.stderr)
    from conduit_jax import runtime
    from conduit_jax.demo import DemoConfig, format_summary, run_demo
    from conduit_jax.errors import ConduitError

    if not runtime.backend_started():
        # one XLA:CPU pool thread (replay-sized kernels), async dispatch on (prefetched batches compute off the
        # learner's thread); both are fixed once the backend starts, so this comes before anything touches JAX
        runtime.configure_cpu(intra_op_threads=1, async_dispatch=True)
    config = DemoConfig(iterations=args.iterations, schedule=args.schedule, depth=args.depth, rounds=args.rounds,
                        devices=args.devices, batch_size=args.batch_size, capacity=args.capacity,
                        num_actors=args.actors, envs_per_actor=args.envs_per_actor, hidden=args.hidden,
                        sampler=args.sampler, seed=args.seed, trace=args.trace, plot=args.plot,
                        progress=not args.no_progress)
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
_BENCH_WORKLOADS = "w1,w2,w3,w4,w5,w6,w7"


def _bench_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--quick", action="store_true",
                        help="every workload small and few rounds (CI smoke run, well under a minute)")
    parser.add_argument("--only", default=None, help=f"comma-separated workloads (default: all, {_BENCH_WORKLOADS})")
    parser.add_argument("--emulated-mesh", action="store_true",
                        help="also run Conduit on 8 emulated CPU devices in W1/W2 (a correctness configuration)")
    parser.add_argument("--capacity", type=positive_int, default=None, help="override each workload's capacity")
    parser.add_argument("--rounds", type=positive_int, default=None, help="override the interleaved rounds")
    parser.add_argument("--no-plots", action="store_true", help="skip the PNG charts")
    parser.add_argument("--xla-threads", default=None, metavar="N|default",
                        help="XLA:CPU intra-op pool threads for the JAX contenders (default: each workload's own; "
                             "'default': XLA's own pool)")
    parser.add_argument("--gpu", action="store_true",
                        help="run benchmarks/gpu.py instead: W1-W3 with the state in device, pinned_host and "
                             "unpinned_host memory (for a GPU; --quick smoke-tests it on CPU)")


def _checkout_root(marker: str) -> Path | None:
    """The current directory or the nearest directory above it that holds ``marker`` (a Conduit-JAX checkout)."""
    here = Path.cwd()
    for folder in (here, *here.parents):
        if (folder / marker).is_file():
            return folder
    return None


def _import_from_checkout(package: str, module: str, marker: str, expects: str = "main"):
    """``<package>.<module>`` of an installed copy, else of a checkout's ``./<package>`` (the current directory or one
    above it). Neither ``benchmarks`` nor ``experiments`` ships in the conduit-jax wheel. ``expects`` is the attribute
    that tells our module from another package's of the same name (a script's ``main``; the experiment catalogue's
    ``EXPERIMENTS``). Returns (module, note) with a note saying where it was found, or (None, reason)."""
    import importlib

    def ours(mod) -> bool:  # not some other installed package of the same name
        found = getattr(mod, expects, None)
        return ((callable(found) if expects == "main" else found is not None)
                and Path(getattr(mod, "__file__", "")).parent.name == package)

    try:
        mod = importlib.import_module(f"{package}.{module}")
        if ours(mod):
            return mod, None
    except ImportError:
        pass
    root = _checkout_root(marker)
    if root is None:
        return None, None
    for name in [n for n in sys.modules if n == package or n.startswith(package + ".")]:
        del sys.modules[name]  # another package of that name may have been imported above
    if str(root) not in sys.path:
        sys.path.insert(0, str(root))
    try:
        mod = importlib.import_module(f"{package}.{module}")
    except ImportError as exc:
        return None, f"found {root / package} but could not import {package}.{module}: {exc}"
    return mod, (f"the {package} suite is not installed with conduit-jax; using {root / package} from the checkout "
                 f"(results go to {root / package / 'results'})")


def _import_benchmarks(module: str):
    """``benchmarks.<module>`` of an installed suite, else of ``./benchmarks`` (a Conduit-JAX checkout). The suite is
    not part of the conduit-jax package: returns (module, note) with a note saying where it was found, or (None,
    reason)."""
    mod, note = _import_from_checkout("benchmarks", module, "benchmarks/run.py")
    if mod is None and note is None:
        note = ("the benchmark suite (benchmarks/) is not part of the installed conduit-jax package and there is no "
                f"benchmarks/run.py under the current directory {Path.cwd()} or above it. Run `conduit bench` from a "
                "Conduit-JAX checkout (or `python -m benchmarks.run` there), with the bench extra installed: "
                "pip install '.[bench]'")
    return mod, note


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
    if args.xla_threads:
        argv += ["--xla-threads", args.xla_threads]
    return int(mod.main(argv) or 0)


def _plan_arguments(parser: argparse.ArgumentParser) -> None:
    from conduit_jax.placement import planner

    planner.build_parser(parser)


def _run_plan(args: argparse.Namespace) -> int:
    from conduit_jax.placement import planner

    return planner.run_cli(args)


# ------------------------------------------------------------------------------------------------------------------
# conduit experiment
# ------------------------------------------------------------------------------------------------------------------
def _import_experiment(module: str, expects: str = "main"):
    """``experiments.<module>`` from a Conduit-JAX checkout: (module, note) or (None, reason)."""
    mod, note = _import_from_checkout("experiments", module, "experiments/report.py", expects)
    if mod is None and note is None:
        note = ("the experiments (experiments/) are not part of the installed conduit-jax package and there is no "
                f"experiments/report.py under the current directory {Path.cwd()} or above it. Run `conduit "
                "experiment` from the root of a Conduit-JAX source checkout (git clone ...; pip install -e '.[bench]')")
    return mod, note


def _load_catalogue():
    """The experiment catalogue, ``experiments/catalogue.py`` of the checkout (its ``EXPERIMENTS``): (module, note)
    or (None, reason). Loaded like the experiments themselves, so ``conduit experiment`` lists what the checkout has."""
    return _import_experiment("catalogue", expects="EXPERIMENTS")


def _experiment_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("name", nargs="?", metavar="NAME",
                        help="an experiment of the checkout's catalogue (experiments/catalogue.py); 'list' lists them")
    parser.add_argument("--list", action="store_true", help="list the experiments with their run times")
    parser.add_argument("--quick", action="store_true", help="the short version (each in under a few minutes)")
    parser.add_argument("args", nargs=argparse.REMAINDER,
                        help="passed to the experiment's script (`conduit experiment NAME -h` shows its options)")
    parser.epilog = ("Run from a Conduit-JAX checkout (experiments/ is not part of the installed package). Results go "
                     "to experiments/results/; `conduit experiment report` writes experiments/REPORT.md from them.")


def _recorded_runs(results: Path, quick: bool = False) -> dict:
    try:
        data = json.loads((results / ("runs_quick.json" if quick else "runs.json")).read_text())
        return data if isinstance(data, dict) else {}
    except (OSError, ValueError):
        return {}


def _recorded_wall(path: Path) -> float | None:
    """The ``wall_s`` a result file records for its run, if it does."""
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    wall = data.get("wall_s") if isinstance(data, dict) else None
    return float(wall) if isinstance(wall, (int, float)) and not isinstance(wall, bool) else None


def _run_time(experiment, results: Path | None, quick: bool) -> str:
    """The wall time of ``experiment``'s last recorded run (``quick``: of its last short run): what `conduit
    experiment` recorded in ``results/runs.json`` (``runs_quick.json``), else the ``wall_s`` of the result file the run
    wrote. An entry with one run per algorithm shows each; "not recorded" when no run of it is on record."""
    if results is None:
        return "-"
    runs, suffix = _recorded_runs(results, quick), "_quick" if quick else ""
    parts = ([(f"{experiment.name} --algo {a}", f"rllib_compare_{a}", a) for a in experiment.algos]
             or [(experiment.name, experiment.outputs[0] if experiment.outputs else None, "")])
    shown = []
    for key, stem, label in parts:
        record = runs.get(key)
        wall = record.get("wall_s") if isinstance(record, dict) else None
        if isinstance(wall, (int, float)) and not isinstance(wall, bool):
            when = f"run {str(record.get('date', '?'))[:10]}"
        elif stem is not None and (wall := _recorded_wall(results / f"{stem}{suffix}.json")) is not None:
            when = f"{stem}{suffix}.json"
        else:
            continue
        shown.append((label, wall, when))
    if not shown:
        return "not recorded"
    if len(parts) == 1:
        label, wall, when = shown[0]
        return f"{wall:.0f} s ({when})"
    return ", ".join(f"{label} {wall:.0f} s" for label, wall, _ in shown)


def _format_experiments(experiments: Sequence, results: Path | None) -> str:
    """The ``--list`` table of ``experiments`` (the catalogue's entries) with the run times on record in
    ``results`` (see ``_run_time``); the catalogue itself types none."""
    rows = [("NAME", "CLAIM", "LAST FULL RUN", "LAST --quick RUN")]
    rows += [(e.name, e.claim, _run_time(e, results, False), _run_time(e, results, True)) for e in experiments]
    widths = [max(len(row[i]) for row in rows) for i in range(4)]
    helps = ["WHAT"] + [e.help for e in experiments]
    lines = [" ".join(cell.ljust(width) for cell, width in zip(row, widths)) + " " + what
             for row, what in zip(rows, helps)]
    lines.append("")
    lines.append("Run times: wall seconds of the last run on record on the machine that made the results (runs.json, "
                 "runs_quick.json or the result file in experiments/results/); not recorded: no run of it there. "
                 "conduit experiment NAME [--quick] [script options]; conduit experiment report regenerates "
                 "experiments/REPORT.md")
    return "\n".join(lines)


def _missing(modules: Sequence[str]) -> list[str]:
    import importlib.util

    out = []
    for name in modules:
        try:
            found = importlib.util.find_spec(name) is not None
        except (ImportError, ValueError):
            found = False
        if not found:
            out.append(name)
    return out


def _take_option(argv: list[str], option: str) -> tuple[str | None, list[str]]:
    """Remove ``option VALUE`` / ``option=VALUE`` from argv: (value or None, the rest)."""
    rest, value, i = [], None, 0
    while i < len(argv):
        arg = argv[i]
        if arg == option and i + 1 < len(argv):
            value, i = argv[i + 1], i + 2
            continue
        if arg.startswith(option + "="):
            value = arg.split("=", 1)[1]
        else:
            rest.append(arg)
        i += 1
    return value, rest


def _relative(path: Path, root: Path) -> str:
    try:
        return str(path.resolve().relative_to(root.resolve()))
    except ValueError:
        return str(path)


def _record_run(results: Path, key: str, entry: dict, quick: bool) -> None:
    """Add the run to experiments/results/runs.json (runs_quick.json for --quick): what ran, how long, what it wrote.
    The report reads run times from here for result files that do not record their own."""
    path = results / ("runs_quick.json" if quick else "runs.json")
    try:
        data = json.loads(path.read_text()) if path.is_file() else {}
        if not isinstance(data, dict):
            data = {}
    except (OSError, ValueError):
        data = {}
    data[key] = entry
    try:
        results.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(data, indent=1, sort_keys=True) + "\n")
    except OSError as exc:  # a read-only checkout: the run itself succeeded
        print(f"conduit experiment: warning: could not record the run in {path}: {exc}", file=sys.stderr)


def _run_experiment(args: argparse.Namespace) -> int:
    import datetime
    import shlex
    import time

    rest = list(args.args or [])
    name = args.name
    catalogue, catalogue_note = _load_catalogue()
    if catalogue is None:
        print(f"conduit experiment{' ' + name if name and name != 'list' else ''}: error: {catalogue_note}",
              file=sys.stderr)
        return 2
    if args.list or name == "list":
        print(_format_experiments(catalogue.EXPERIMENTS, Path(catalogue.__file__).parent / "results"))
        return 0
    if name is None:
        print(_format_experiments(catalogue.EXPERIMENTS, None))
        print("conduit experiment: error: name an experiment (or --list)", file=sys.stderr)
        return 2
    by_name = {e.name: e for e in catalogue.EXPERIMENTS}
    experiment = by_name.get(name)
    if experiment is None:
        print(f"conduit experiment: error: unknown experiment {name!r}; choose one of "
              f"{', '.join(by_name)} (conduit experiment --list)", file=sys.stderr)
        return 2
    asked = args.quick or "--quick" in rest  # --quick, given before or after the name
    rest = [a for a in rest if a != "--quick"]
    quick = asked or any(flag in rest for flag in experiment.quick_flags)  # a short run: recorded apart
    flag = list(experiment.quick_args) if asked else []  # the script's own way to a short run
    missing = _missing(experiment.needs)
    if missing:
        extra = "'.[rllib]' -c constraints/cpu.txt" if {"ray", "torch", "conduit_rllib"} & set(missing) else "'.[bench]'"
        print(f"conduit experiment {name}: error: needs {', '.join(missing)}, not installed here. Install with: "
              f"pip install {extra}" + (" (and matplotlib for the figures: pip install '.[bench]')"
                                        if "matplotlib" in missing and "bench" not in extra else ""), file=sys.stderr)
        return 2
    if experiment.devices:
        warning = configure_devices(experiment.devices)
        if warning:
            print(f"conduit experiment {name}: warning: {warning}", file=sys.stderr)
    mod, note = _import_experiment(experiment.module)
    if mod is None:
        print(f"conduit experiment {name}: error: {note}", file=sys.stderr)
        return 2
    note = note or catalogue_note  # the catalogue, loaded first, found the checkout
    if note:
        print(f"conduit experiment {name}: {note}", file=sys.stderr)
    results = Path(getattr(mod, "RESULTS", Path(mod.__file__).parent / "results"))
    suffix = "_quick" if quick else ""
    runs: list[tuple[str, list[str], list[Path]]] = []  # (record key, script argv, outputs)
    if experiment.algos:
        algo, rest = _take_option(rest, "--algo")
        out, rest = _take_option(rest, "--out")
        algos = [algo] if algo else list(experiment.algos)
        if out and len(algos) > 1:
            print(f"conduit experiment {name}: error: --out names one file; name one algorithm with --algo",
                  file=sys.stderr)
            return 2
        for a in algos:
            path = Path(out) if out else results / f"rllib_compare_{a}{suffix}.json"
            runs.append((f"{name} --algo {a}", ["--algo", a] + flag + rest
                         + ["--out", str(path)], [path, path.with_suffix(".png")]))
    else:
        outputs = [results / f"{stem}{suffix}{ext}" for stem in experiment.outputs for ext in (".json", ".png")]
        runs.append((name, flag + rest, outputs))
    status = 0
    for key, argv, outputs in runs:
        start, started = time.perf_counter(), time.time()
        print(f"conduit experiment {name}: python -m experiments.{experiment.module} {shlex.join(argv)}",
              file=sys.stderr, flush=True)
        saved, sys.argv = sys.argv, [f"conduit experiment {name}", *argv]  # the script's usage names this command
        try:
            result = mod.main(argv)
        finally:
            sys.argv = saved
        code = result if isinstance(result, int) and not isinstance(result, bool) else 0
        wall = time.perf_counter() - start
        if code == 0 and experiment.name != "report" and "-h" not in argv and "--help" not in argv:
            written = [_relative(p, results.parent.parent) for p in outputs
                       if p.is_file() and p.stat().st_mtime >= started - 1]
            user = ["experiment", name] + (["--quick"] if asked else []) + [a for a in args.args or []
                                                                           if a != "--quick"]
            _record_run(results, key, {
                "command": "conduit " + shlex.join(user),
                "script": f"python -m experiments.{experiment.module} {shlex.join(argv)}",
                "wall_s": wall, "quick": quick, "outputs": written,
                "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")}, quick)
            print(f"conduit experiment {name}: done in {wall:.0f} s", file=sys.stderr)
        status = status or code
    return status


COMMANDS: tuple[Command, ...] = (
    Command("demo", "run synthetic actors -> the data plane -> a jitted DQN learner, and report what the plane did",
            _demo_arguments, _run_demo),
    Command("bench", "run the benchmark suite (W1-W6 against NumPy, cpprb, Flashbax, TorchRL) from a checkout's "
                     "benchmarks/", _bench_arguments, _run_bench),
    Command("plan", "plan where the plane's state lives on a topology (a preset, a JSON file, or this machine) and "
                    "explain why", _plan_arguments, _run_plan),
    Command("experiment", "run one of a checkout's experiments (the catalogue in experiments/catalogue.py: "
                          "breakdown, scheduling, ablation, ...; --list lists them)",
            _experiment_arguments, _run_experiment),
)


# ------------------------------------------------------------------------------------------------------------------
# entry point
# ------------------------------------------------------------------------------------------------------------------
class _Parser(argparse.ArgumentParser):
    """An argument error is one line naming the flag, and where to look for the usage (not the usage itself)."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def build_parser() -> argparse.ArgumentParser:
    from conduit_jax import __version__

    parser = _Parser(
        prog="conduit", description="Conduit-JAX: the RL experience path as an explicit data plane on JAX.")
    parser.add_argument("--version", action="version", version=f"conduit-jax {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for command in COMMANDS:
        command_parser = sub.add_parser(command.name, help=command.help, description=command.help)
        command.add_arguments(command_parser)
        command_parser.set_defaults(run=command.run)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.run(args)
    except BrokenPipeError:  # stdout closed early (`conduit demo | head`): stop quietly, as other CLI tools do
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1


if __name__ == "__main__":
    sys.exit(main())
