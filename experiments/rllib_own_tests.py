"""RLlib's own replay-buffer unit tests, run unmodified on RLlib's classes and then on the Conduit ones.

Give it test files from a checkout of ray (2.60: ``rllib/utils/replay_buffers/tests/``); they are not shipped in
the ray wheel and not part of this repository::

    python -m experiments.rllib_own_tests ~/ray/rllib/utils/replay_buffers/tests/test_episode_replay_buffer.py \\
        ~/ray/rllib/utils/replay_buffers/tests/test_prioritized_episode_buffer.py \\
        ~/ray/rllib/utils/replay_buffers/tests/test_multi_agent_episode_buffer.py \\
        ~/ray/rllib/utils/replay_buffers/tests/test_multi_agent_prio_episode_buffer.py

Each file runs twice in its own pytest process: as it is, and with this module loaded as a pytest plugin
(``-p experiments.rllib_own_tests``), which replaces RLlib's four episode buffer classes by their Conduit counterparts
in RLlib's modules before the test files import them. Nothing in the test files changes. The per-test outcomes go to
``--out`` (JSON) and a table to stdout; a test that fails natively does not count against Conduit.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ElementTree

ROOT = pathlib.Path(__file__).resolve().parents[1]
RESULTS = ROOT / "experiments" / "results" / "rllib_own_tests.json"
# RLlib module, class name -> the Conduit class that stands for it
SUBSTITUTES = {
    ("ray.rllib.utils.replay_buffers.episode_replay_buffer", "EpisodeReplayBuffer"): "ConduitEpisodeReplayBuffer",
    ("ray.rllib.utils.replay_buffers.prioritized_episode_buffer", "PrioritizedEpisodeReplayBuffer"):
        "ConduitPrioritizedEpisodeReplayBuffer",
    ("ray.rllib.utils.replay_buffers.multi_agent_episode_buffer", "MultiAgentEpisodeReplayBuffer"):
        "ConduitMultiAgentEpisodeReplayBuffer",
    ("ray.rllib.utils.replay_buffers.multi_agent_prioritized_episode_buffer",
     "MultiAgentPrioritizedEpisodeReplayBuffer"): "ConduitMultiAgentPrioritizedEpisodeReplayBuffer",
}


def substitute() -> dict[str, str]:
    """Replace RLlib's classes (in their modules and in ``ray.rllib.utils.replay_buffers``) by the Conduit ones;
    returns what now stands where. The Conduit classes subclass RLlib's, so they are imported first."""
    import importlib

    sys.path.insert(0, str(ROOT / "adapters"))
    import conduit_rllib
    import ray.rllib.utils.replay_buffers as package

    done = {}
    for (module_name, name), conduit_name in SUBSTITUTES.items():
        conduit_class = getattr(conduit_rllib, conduit_name)
        setattr(importlib.import_module(module_name), name, conduit_class)
        if hasattr(package, name):
            setattr(package, name, conduit_class)
        done[f"{module_name}.{name}"] = f"conduit_rllib.{conduit_name}"
    return done


def pytest_configure(config) -> None:  # loaded with -p: before any test module is imported
    substitute()


def run_file(path: pathlib.Path, conduit: bool) -> dict[str, str]:
    """test id -> passed | failed | error | skipped, from one pytest process over ``path``."""
    with tempfile.TemporaryDirectory() as scratch:
        report = pathlib.Path(scratch) / "report.xml"
        command = [sys.executable, "-m", "pytest", str(path), "-q", "-p", "no:cacheprovider", "-p", "no:xdist",
                   "-o", "addopts=", "--rootdir", str(path.parent), f"--junitxml={report}"]
        if conduit:
            command[3:3] = ["-p", "experiments.rllib_own_tests"]
        env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
        subprocess.run(command, cwd=path.parent, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        if not report.exists():
            raise RuntimeError(f"pytest wrote no report for {path} (conduit={conduit})")
        outcomes = {}
        for case in ElementTree.parse(report).getroot().iter("testcase"):
            test = f"{case.get('classname', '').rsplit('.', 1)[-1]}::{case.get('name')}"
            kind = next((child.tag for child in case if child.tag in ("failure", "error", "skipped")), "passed")
            first = next((child for child in case if child.tag in ("failure", "error")), None)
            outcomes[test] = kind if first is None else f"{kind}: {(first.get('message') or '').splitlines()[0][:160]}"
        return outcomes


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("files", nargs="+", type=pathlib.Path, help="RLlib test files (from a ray checkout)")
    parser.add_argument("--out", type=pathlib.Path, default=RESULTS)
    args = parser.parse_args(argv)
    results = {}
    for path in args.files:
        print(f"{path.name}: native ...", file=sys.stderr, flush=True)
        native = run_file(path.resolve(), conduit=False)
        print(f"{path.name}: conduit ...", file=sys.stderr, flush=True)
        conduit = run_file(path.resolve(), conduit=True)
        results[path.name] = {test: {"native": native.get(test), "conduit": conduit.get(test)}
                              for test in sorted(set(native) | set(conduit))}
    counted = [(f, t, r) for f, tests in results.items() for t, r in tests.items() if r["native"] == "passed"]
    passed = sum(r["conduit"] == "passed" for _, _, r in counted)
    for name, tests in results.items():
        print(f"\n{name}")
        for test, outcome in tests.items():
            print(f"  {test:70s} native {outcome['native'].split(':')[0]:8s} conduit {outcome['conduit']}")
    print(f"\n{passed} of {len(counted)} tests that pass on RLlib's classes pass unmodified on Conduit's")
    import ray

    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"ray": ray.__version__, "substituted": list(SUBSTITUTES.values()),
                                    "passed_on_conduit": passed, "passed_natively": len(counted),
                                    "files": results}, indent=1) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
