"""benchmark/experiments/ is the record behind benchmark/NOTES.md: each experiment must keep
importing against today's gemslib, so that it can be re-run, and must run nothing on import."""

import ast
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
EXPERIMENTS = sorted(p for p in (REPO / "benchmark" / "experiments").glob("*.py")
                     if p.name != "__init__.py")

_IMPORT_EACH = """
import importlib, json, sys, traceback
failures = {}
for name in sys.argv[1:]:
    try:
        importlib.import_module(f"benchmark.experiments.{name}")
    except BaseException:
        failures[name] = traceback.format_exc(limit=-3)
print(json.dumps(failures))
"""


def test_there_are_experiments():
    assert len(EXPERIMENTS) >= 5


@pytest.mark.parametrize("path", EXPERIMENTS, ids=lambda p: p.stem)
def test_experiment_runs_only_under_a_main_guard(path):
    """Module level holds a docstring, imports, definitions and constants; the work starts in
    ``if __name__ == "__main__":``."""
    tree = ast.parse(path.read_text())
    guards = [node for node in tree.body if isinstance(node, ast.If)
              and isinstance(node.test, ast.Compare) and isinstance(node.test.left, ast.Name)
              and node.test.left.id == "__name__"]
    assert len(guards) == 1, f"{path.name}: no `if __name__ == \"__main__\":`"
    calls = [node for node in tree.body if isinstance(node, ast.Expr)
             and isinstance(node.value, ast.Call)]
    assert not calls, f"{path.name}: module-level calls at lines {[c.lineno for c in calls]}"


def test_every_experiment_imports_without_a_gpu():
    """Each experiment imports (as ``python -m benchmark.experiments.NAME`` would, without the
    interpreter) on a machine without a GPU: its imports of gemslib's modules and names still
    resolve."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    result = subprocess.run([sys.executable, "-c", _IMPORT_EACH, *(p.stem for p in EXPERIMENTS)],
                            cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    failures = json.loads(result.stdout.strip().splitlines()[-1])
    assert not failures, "\n".join(f"{name}:\n{trace}" for name, trace in failures.items())
