"""The command lines: bad arguments are argparse errors, --help is plain text and names every
command, and the GPU-only commands agree on what they do without a GPU.

Every command runs in a subprocess and stops at argument parsing (or at the GPU check), before
any kernel runs, so each takes about a second.
"""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from gemslib import __main__ as main_job
from gemslib import cli, demo

ROOT = Path(__file__).resolve().parents[2]


def _run(*args, env=None, cwd=ROOT):
    return subprocess.run([sys.executable, "-m", *args], cwd=cwd, capture_output=True,
                          text=True, env=dict(os.environ) if env is None else env, timeout=120)


@pytest.mark.parametrize("args,argument,expected", [
    (["--rows", "0"], "--rows", "expected a positive integer, got '0'"),
    (["--rows", "-3"], "--rows", "expected a positive integer, got '-3'"),
    (["--time-rows", "many"], "--time-rows", "expected a positive integer, got 'many'"),
    (["demo", "--prefill", "abc"], "--prefill", "expected BxS with positive integers"),
    (["demo", "--prefill", "1x0"], "--prefill", "expected BxS with positive integers"),
    (["demo", "--decode", "2x"], "--decode", "expected BxKV with positive integers"),
    (["demo", "--layers", "0"], "--layers", "expected a positive integer, got '0'"),
])
def test_bad_arguments_are_usage_errors_that_name_the_argument(args, argument, expected):
    done = _run("gemslib", *args)
    assert done.returncode == 2, done.stdout + done.stderr
    assert f"error: argument {argument}: {expected}" in done.stderr, done.stderr
    assert "Traceback" not in done.stderr and "FAIL" not in done.stdout, done.stdout + done.stderr


def test_argument_types_accept_what_they_should():
    assert cli.positive_int("7") == 7
    assert cli.size_pair("BxS")("2X16") == (2, 16)
    args = demo.parse_args(["--layers", "3", "--prefill", "1x24", "--decode", "2x20"])
    assert (args.layers, args.prefill, args.decode) == (3, (1, 24), (2, 20))
    assert demo.parse_args([]).prefill is None  # the defaults depend on the device
    assert main_job.build_parser().parse_args(["--rows", "5"]).rows == 5


def test_help_names_the_demo_command_in_plain_text():
    done = _run("gemslib", "--help")
    assert done.returncode == 0, done.stderr
    assert "python -m gemslib demo" in done.stdout and "--rows" in done.stdout
    assert "exit codes" in done.stdout
    assert "`" not in done.stdout, done.stdout
    assert cli.plain_help("``python -m x``: run `y`") == "python -m x: run y"


@pytest.mark.parametrize("command,options", [
    (["gemslib", "demo"], ["--prefill", "--decode", "--layers"]),
    (["gemslib.tune"], ["--quick", "--ops"]),
    (["benchmark"], ["--quick", "--forward-only"]),
])
def test_every_help_is_plain_text_with_exit_codes(command, options):
    done = _run(*command, "--help")
    assert done.returncode == 0, done.stderr
    assert "`" not in done.stdout, done.stdout
    assert "exit codes" in done.stdout and all(option in done.stdout for option in options)


def test_gpu_only_commands_say_so_in_one_line_and_exit_1_without_a_gpu(tmp_path):
    env = dict(os.environ, TRITON_INTERPRET="1", CUDA_VISIBLE_DEVICES="")
    bench = _run("benchmark", "--quick", "--out", str(tmp_path / "results"), env=env)
    tune = _run("gemslib.tune", "--quick", "--out", str(tmp_path / "tuned.yaml"), env=env)
    for done in (bench, tune):
        assert done.returncode == 1, done.stdout + done.stderr
        said = [line for line in done.stderr.splitlines() if "needs a CUDA GPU" in line]
        assert len(said) == 1 and "no CUDA GPU" in said[0], done.stderr
        assert "Traceback" not in done.stderr
    assert not list(tmp_path.iterdir())  # nothing written
