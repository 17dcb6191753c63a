"""Importing the runtime stays framework-agnostic: no torch, no ray (ray is imported lazily in distributed/)."""

import json
import os
import subprocess
import sys

import pytest

FORBIDDEN = ("torch", "ray", "ray.rllib", "tensorflow")


def test_import_does_not_pull_in_frameworks():
    code = ("import json, sys; import conduit_jax; "
            f"print(json.dumps({{m: m in sys.modules for m in {list(FORBIDDEN)!r}}}))")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                            env={**os.environ, "JAX_PLATFORMS": "cpu"})
    assert result.returncode == 0, result.stderr
    loaded = json.loads(result.stdout.strip().splitlines()[-1])
    assert loaded == {m: False for m in FORBIDDEN}, f"import conduit_jax loaded {[m for m, v in loaded.items() if v]}"


def test_the_cli_answers_help_and_argument_errors_without_jax():
    """``conduit --help`` and a malformed argument answer before JAX is imported (heavy imports only where a
    command runs), and the error is one line naming the flag."""
    code = ("import sys\nfrom conduit_jax import cli\n"
            "for argv in (['--help'], ['demo', '--help'], ['plan', '--spec', 'obs:float32:8x', '--capacity', '8']):\n"
            "    try:\n        cli.main(argv)\n    except SystemExit:\n        pass\n"
            "print('jax loaded' if 'jax' in sys.modules else 'no jax', file=sys.stderr)")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    errors = result.stderr.strip().splitlines()
    assert errors[-1] == "no jax", result.stderr
    assert errors[:-1] == ["conduit plan: error: argument --spec: leaf 'obs': expected a shape like 84x84x4 (positive "
                           "ints joined by x), got '8x' (see conduit plan --help)"]
    assert "--schedule" in result.stdout  # the demo's help was printed


@pytest.mark.parametrize("args, flag", [
    (["--reserve=-5GB"], "--reserve"),
    (["--host-reserve=-1GB"], "--host-reserve"),
    (["--reserve", "infGB"], "--reserve"),
    (["--reserve", "nanGB"], "--reserve"),
    (["--ingest-rate", "inf"], "--ingest-rate"),
    (["--ingest-rate", "nan"], "--ingest-rate"),
    (["--step-time", "-1"], "--step-time"),
    (["--batch-size", "0"], "--batch-size"),
    (["--batches-per-step", "0"], "--batches-per-step"),
    (["--window", "0"], "--window"),
    (["--learners", "0"], "--learners"),
    (["--capacity", "0"], "--capacity"),
    (["--topology", "{file}"], "--topology"),
    (["--topology", "{dir}"], "--topology"),
    (["--topology", "bogus"], "--topology"),
    (["--topology", "emulated_cpu:abc"], "--topology"),
    (["--topology", "cluster:2:dgx_h100:nan"], "--topology"),
])
def test_plan_flag_errors_are_one_line_naming_the_flag(args, flag, tmp_path, capsys):
    """A value that cannot work (negative, infinite, NaN, not a topology) is refused while parsing, as argparse
    refuses a malformed one: exit status 2, one line naming the flag."""
    from conduit_jax import cli

    (tmp_path / "hostname").write_text("myhost\n")
    args = [a.format(file=tmp_path / "hostname", dir=tmp_path) for a in args]
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["plan", "--spec", "400", "--capacity", "64", "--topology", "emulated_cpu", *args])
    assert exit_info.value.code == 2
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"conduit plan: error: argument {flag}: "), captured.err
    assert captured.out == ""


def test_public_api_resolves():
    import conduit_jax

    for name in conduit_jax.__all__:
        assert getattr(conduit_jax, name) is not None, name
    for name in ("CapacityError", "ConfigError", "NotEnoughDataError", "SpecError"):
        assert issubclass(getattr(conduit_jax, name), conduit_jax.ConduitError)
        assert issubclass(getattr(conduit_jax, name), ValueError)


def test_no_import_cycle_between_modules():
    """Every ``conduit_jax`` import (top level or inside a function) points one way: a module never reaches itself
    again through others (a package importing its own submodules, and they the package's other submodules, aside)."""
    import ast
    from pathlib import Path

    root = Path(__file__).resolve().parents[1] / "conduit_jax"
    paths = {}
    for path in root.rglob("*.py"):
        parts = path.relative_to(root.parent).with_suffix("").parts
        paths[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    graph = {}
    for module, path in paths.items():
        targets = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("conduit_jax"):
                # `from package import submodule` imports the submodule; `from module import name`, the module
                targets |= {f"{node.module}.{alias.name}" if f"{node.module}.{alias.name}" in paths else node.module
                            for alias in node.names}
            elif isinstance(node, ast.Import):
                targets |= {alias.name for alias in node.names if alias.name.startswith("conduit_jax")}
        graph[module] = targets

    def family(a, b):  # a package and its own submodules
        return a.startswith(b + ".") or b.startswith(a + ".")

    def reaches(start, goal, seen):
        for target in graph.get(start, ()):
            if target in graph and target not in ("conduit_jax", start) and not family(start, target) \
                    and target not in seen:
                if target == goal or reaches(target, goal, seen | {target}):
                    return True
        return False

    cycles = [m for m in graph if m != "conduit_jax" and reaches(m, m, set())]
    assert cycles == [], f"modules in an import cycle: {cycles}"
