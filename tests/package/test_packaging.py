"""The distribution: a wheel maps ops/, fused/, tune_configs/ under gemslib and works installed."""

import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


# what a build reads: everything else (build/, egg-info, caches, peer wheels) stays behind
_SOURCES = ("pyproject.toml", "README.md", "gemslib", "ops", "fused", "tune_configs")


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    """A wheel built from a copy of the sources, so that nothing left in the checkout's own
    build/ (setuptools reuses it, deleted modules included) ends up in it."""
    source = tmp_path_factory.mktemp("source")
    for name in _SOURCES:
        if (ROOT / name).is_dir():
            shutil.copytree(ROOT / name, source / name,
                            ignore=shutil.ignore_patterns("__pycache__"))
        else:
            shutil.copy2(ROOT / name, source / name)
    out = tmp_path_factory.mktemp("wheel")
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation",
                    "-q", "-w", str(out), str(source)], check=True, capture_output=True)
    (path,) = out.glob("gemslib-*.whl")
    return path


def test_wheel_holds_the_mapped_subpackages_and_both_yaml_files(wheel):
    names = set(zipfile.ZipFile(wheel).namelist())
    for expected in ("gemslib/__init__.py", "gemslib/runtime/__init__.py",
                     "gemslib/runtime/plans.py", "gemslib/ops/__init__.py",
                     "gemslib/ops/silu.py", "gemslib/fused/__init__.py",
                     "gemslib/tune_configs/__init__.py", "gemslib/tune_configs/default.yaml",
                     "gemslib/tune_configs/nvidia_h200.yaml", "gemslib/tune_configs/README.md",
                     "gemslib/runtime/_launch.cpp",  # the native replay, built where it runs
                     *(f"gemslib/runtime/{header.name}"
                       for header in (ROOT / "gemslib" / "runtime").glob("_launch_*.h"))):
        assert expected in names, expected
    top_level = {name.split("/")[0] for name in names}
    assert top_level == {"gemslib", next(n for n in top_level if n.endswith(".dist-info"))}, \
        f"only gemslib may be installed at the top level, got {sorted(top_level)}"


def test_installed_wheel_imports_and_finds_its_configs(wheel, tmp_path):
    target = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "-q", "--target",
                    str(target), str(wheel)], check=True, capture_output=True)
    code = ("import gemslib, gemslib.runtime as r, gemslib.ops.silu, gemslib.fused; "
            "assert gemslib.__file__.startswith(%r), gemslib.__file__; "
            "print(r.shipped_configs_dir()); print(sorted(gemslib.registered_ops()))" % str(target))
    env = dict(os.environ, PYTHONPATH=str(target))
    result = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env,
                            capture_output=True, text=True, check=True)
    configs_dir, ops = result.stdout.splitlines()
    assert Path(configs_dir) == target / "gemslib" / "tune_configs"
    assert (Path(configs_dir) / "nvidia_h200.yaml").is_file()
    assert ops == "['attention', 'rms_norm', 'silu', 'softmax']"
    no_generic = subprocess.run([sys.executable, "-c", "import ops"], cwd=tmp_path, env=env,
                                capture_output=True, text=True)
    assert no_generic.returncode != 0
