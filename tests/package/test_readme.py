"""The README, kept honest where a test can: the commands and flags it shows exist, the
virtual environment its commands create is ignored by git, the CPU install names the CPU wheel
index, the logging example prints."""

import contextlib
import importlib
import io
import os
import re
import subprocess
import sys
from functools import cache
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
README = (ROOT / "README.md").read_text()

# the project's command lines: what README text calls them -> the module whose main() runs it
COMMANDS = {"gemslib": "gemslib.__main__", "gemslib demo": "gemslib.demo",
            "gemslib.tune": "gemslib.tune", "benchmark": "benchmark.__main__",
            "benchmark.readme": "benchmark.readme", "benchmark.models": "benchmark.models",
            "benchmark.decode": "benchmark.decode", "benchmark.host": "benchmark.host"}
FLAG = re.compile(r"(?<![\w-])--[a-z][-a-z]*")


def _fenced_blocks(text: str) -> list[tuple[str, str]]:
    """(language, body) of every fenced code block."""
    return re.findall(r"^```(\w*)\n(.*?)^```", text, flags=re.S | re.M)


def _inline_spans(text: str) -> list[str]:
    """Inline code spans outside fenced blocks, their line breaks made spaces."""
    prose = re.sub(r"^```.*?^```", "", text, flags=re.S | re.M)
    return [" ".join(span.split()) for span in re.findall(r"`([^`]+)`", prose)]


def _command_lines() -> list[str]:
    """Shell lines of the fenced blocks (comments dropped) and inline spans that run
    ``python -m``."""
    lines = [line.split(" #")[0] for language, body in _fenced_blocks(README)
             if language in ("", "bash", "sh", "shell") for line in body.splitlines()]
    return [line for line in lines + _inline_spans(README) if "python -m " in line]


@cache
def _options(command: str) -> frozenset[str]:
    """The --options a command line's --help lists (its parser, run in this process)."""
    main = importlib.import_module(COMMANDS[command]).main
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed), pytest.raises(SystemExit):
        main(["--help"])
    return frozenset(FLAG.findall(printed.getvalue()))


def _invocations() -> list[tuple[str, str]]:
    """(command, the rest of the line) for every README use of the project's command lines."""
    found = []
    for line in _command_lines():
        for match in re.finditer(r"python -m ([\w.]+)(.*?)(?=python -m |$)", line):
            module, rest = match.groups()
            if module == "gemslib" and rest.split()[:1] == ["demo"]:
                module, rest = "gemslib demo", rest.split(None, 1)[1] if rest.split()[1:] else ""
            if module in COMMANDS:
                found.append((module, rest))
    return found


def test_the_readme_shows_every_command_line():
    assert {command for command, _ in _invocations()} == set(COMMANDS)


def test_every_flag_of_a_readme_command_exists():
    unknown = [(command, flag) for command, rest in _invocations()
               for flag in FLAG.findall(rest) if flag not in _options(command)]
    assert not unknown, f"README uses flags the command lines do not list in --help: {unknown}"


def test_every_flag_named_in_the_prose_is_an_option_of_some_command_line():
    known = frozenset().union(*(_options(command) for command in COMMANDS))
    named = {FLAG.match(span).group() for span in _inline_spans(README) if FLAG.match(span)}
    assert named, "expected the README to name options such as --timings"
    assert named <= known, f"README names options no command line has: {sorted(named - known)}"


def test_the_virtual_environment_the_readme_creates_is_ignored_by_git():
    ignored = {line.strip().rstrip("/") for line in (ROOT / ".gitignore").read_text().splitlines()}
    created = set(re.findall(r"python3? -m venv (\S+)", README))
    assert created, "expected the README to create a virtual environment"
    assert {name.rstrip("/") for name in created} <= ignored
    assert {".venv", "venv"} <= ignored


def test_the_cpu_install_names_the_cpu_wheel_index():
    torch_installs = [line for _, body in _fenced_blocks(README) for line in body.splitlines()
                      if re.match(r"\s*(python -m )?pip install (-\S+ )*torch\b", line)
                      and "cpu" in line.lower()]
    assert torch_installs, "expected the README to show how to install torch's CPU build"
    for line in torch_installs:
        assert "--index-url https://download.pytorch.org/whl/cpu" in line, line
    if re.search(r"wheel index", README, flags=re.I):
        assert "--index-url https://download.pytorch.org/whl/" in README
    assert "TRITON_INTERPRET=1 python " in README  # how a user script runs on the CPU


def test_the_logging_example_prints(tmp_path):
    """The README's logging block, then one override call: something reaches stderr."""
    examples = [body for language, body in _fenced_blocks(README)
                if language == "python" and 'getLogger("gemslib")' in body
                and "import gemslib" not in body]
    assert len(examples) == 1, "expected one python block that sets up gemslib's logging"
    example = examples[0]
    script = example + ("import torch, torch.nn.functional as F, gemslib\n"
                        "from gemslib import runtime\n"
                        "with gemslib.enable():\n"
                        "    F.silu(torch.randn(4, 8, device=runtime.device_type()))\n")
    # the conftest's TRITON_INTERPRET=1 (no GPU) is in os.environ: the script inherits it
    done = subprocess.run([sys.executable, "-c", script], cwd=tmp_path, env=dict(os.environ),
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "gemslib" in done.stderr and "aten::silu" in done.stderr, done.stderr
