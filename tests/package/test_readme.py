"""The README and the guides in docs/, kept honest where a test can: the README is short and
opens with its commands, every python block of it runs (on the CPU in the interpreter, in a
subprocess), the commands and flags README and docs show exist, the files they link exist,
the virtual environment its commands create is ignored by git, the CPU install names the CPU
wheel index, the logging example prints."""

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
# the user-facing guides: their commands are checked as the README's are
GUIDES = {name: (ROOT / name).read_text()
          for name in ("README.md", "docs/README.md", "docs/graph-passes.md", "docs/benchmarks.md")}
MAX_LINES = 250
FIRST_SCREEN = 40
TEST_COMMAND = "python -m pytest -n auto"
MAIN_COMMAND = "python -m gemslib demo"

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


def _command_lines(text: str) -> list[str]:
    """Shell lines of the fenced blocks (comments dropped) and inline spans that run
    ``python -m``."""
    lines = [line.split(" #")[0] for language, body in _fenced_blocks(text)
             if language in ("", "bash", "sh", "shell") for line in body.splitlines()]
    return [line for line in lines + _inline_spans(text) if "python -m " in line]


@cache
def _options(command: str) -> frozenset[str]:
    """The --options a command line's --help lists (its parser, run in this process)."""
    main = importlib.import_module(COMMANDS[command]).main
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed), pytest.raises(SystemExit):
        main(["--help"])
    return frozenset(FLAG.findall(printed.getvalue()))


def _invocations(text: str) -> list[tuple[str, str]]:
    """(command, the rest of the line) for every use of the project's command lines in
    ``text``."""
    found = []
    for line in _command_lines(text):
        for match in re.finditer(r"python -m ([\w.]+)(.*?)(?=python -m |$)", line):
            module, rest = match.groups()
            if module == "gemslib" and rest.split()[:1] == ["demo"]:
                module, rest = "gemslib demo", rest.split(None, 1)[1] if rest.split()[1:] else ""
            if module in COMMANDS:
                found.append((module, rest))
    return found


def test_the_readme_is_short_and_opens_with_its_commands():
    lines = README.splitlines()
    assert len(lines) <= MAX_LINES, f"README.md has {len(lines)} lines, at most {MAX_LINES}"
    first_screen = "\n".join(lines[:FIRST_SCREEN])
    for command in (TEST_COMMAND, MAIN_COMMAND, 'torch.compile(model, backend="gemslib")',
                    "pip install"):
        assert command in first_screen, f"{command!r} is not in the README's first screen"


def test_the_readme_and_docs_show_every_command_line():
    shown = {command for text in GUIDES.values() for command, _ in _invocations(text)}
    assert shown == set(COMMANDS)
    assert {"gemslib", "gemslib demo", "gemslib.tune", "benchmark"} <= \
        {command for command, _ in _invocations(README)}


@pytest.mark.parametrize("name", GUIDES)
def test_every_flag_of_a_command_exists(name):
    unknown = [(command, flag) for command, rest in _invocations(GUIDES[name])
               for flag in FLAG.findall(rest) if flag not in _options(command)]
    assert not unknown, f"{name} uses flags the command lines do not list in --help: {unknown}"


def test_every_flag_named_in_the_prose_is_an_option_of_some_command_line():
    known = frozenset().union(*(_options(command) for command in COMMANDS))
    named = {FLAG.match(span).group() for text in GUIDES.values()
             for span in _inline_spans(text) if FLAG.match(span)}
    assert named, "expected the README and docs to name options such as --quick"
    assert named <= known, f"the guides name options no command line has: {sorted(named - known)}"


@pytest.mark.parametrize("name", GUIDES)
def test_every_local_link_names_a_file_that_exists(name):
    links = re.findall(r"\]\(([^)#\s]+)\)", GUIDES[name])
    base = (ROOT / name).parent
    missing = [link for link in links if "://" not in link and not (base / link).exists()]
    assert not missing, f"{name} links files that do not exist: {missing}"


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


PYTHON_BLOCKS = [body for language, body in _fenced_blocks(README) if language == "python"]


def _run_block(body: str, cwd: Path) -> subprocess.CompletedProcess:
    """``body`` as a script of its own, in a fresh interpreter; the conftest's
    TRITON_INTERPRET=1 (no GPU) is in os.environ, so the script inherits it."""
    return subprocess.run([sys.executable, "-c", body], cwd=cwd, env=dict(os.environ),
                          capture_output=True, text=True, timeout=900)


def test_the_readme_has_python_examples():
    assert len(PYTHON_BLOCKS) >= 4
    assert all("import gemslib" in body for body in PYTHON_BLOCKS), \
        "each python block of the README imports what it uses, so that it runs on its own"


@pytest.mark.parametrize("index", range(len(PYTHON_BLOCKS)))
def test_every_python_block_of_the_readme_runs(index, tmp_path):
    body = PYTHON_BLOCKS[index]
    done = _run_block(body, tmp_path)
    assert done.returncode == 0, f"README python block {index}:\n{body}\n{done.stderr}"


def test_the_logging_example_prints(tmp_path):
    """The README's block that sets up gemslib's logging prints the override calls."""
    examples = [body for body in PYTHON_BLOCKS if 'getLogger("gemslib")' in body]
    assert len(examples) == 1, "expected one python block that sets up gemslib's logging"
    done = _run_block(examples[0], tmp_path)
    assert done.returncode == 0, done.stderr
    assert "gemslib" in done.stderr and "aten::silu" in done.stderr, done.stderr
