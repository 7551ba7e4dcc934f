"""``python -m benchmark.host``: the host-cost table's path (the times mean nothing on the CPU;
no test asserts one)."""

import pytest
import torch

from benchmark import host


def test_every_way_is_timed_in_its_scope_and_set_against_torch(monkeypatch):
    """Each case's ways are timed inside their scope (enable() for the enable way), a missing
    call is a dash, a failing one is reported, and the ratios are over torch eager's figure."""
    import contextlib

    entered = []

    @contextlib.contextmanager
    def recording(way):
        entered.append(way)
        yield

    monkeypatch.setattr(host, "_scope", lambda way: lambda: recording(way))

    def failing():
        raise RuntimeError("no such case here")

    monkeypatch.setattr(host, "cases", lambda device: {
        "double 3": {"gemslib": lambda: torch.ones(3) + 1, "gemslib-bound": None,
                     "torch": lambda: torch.ones(3) * 2, "enable": lambda: torch.ones(3) * 2,
                     "flaggems": None, "liger": None},
        "broken 1": {"gemslib": failing, "gemslib-bound": failing, "torch": lambda: torch.ones(1),
                     "enable": None, "flaggems": None, "liger": None}})
    results = host.run(calls=3, device=torch.device("cpu"), warmup=1)
    assert entered == ["gemslib", "enable", "torch", "gemslib", "gemslib-bound", "torch"]
    row = results["double 3"]
    assert all(isinstance(row[way], float) and row[way] > 0
               for way in ("gemslib", "enable", "torch"))
    assert row["liger"] is None and row["flaggems"] is None and row["ratios"]["torch"] == 1.0
    assert row["ratios"]["gemslib"] == row["gemslib"] / row["torch"]
    assert results["broken 1"]["gemslib"].startswith("RuntimeError: no such case here")
    markdown = host.format_markdown(results, "header")
    assert "| double 3 | " in markdown and "| broken 1 | failed | - | failed |" in markdown
    assert markdown.count("\n|") == 4  # the head, its rule and one row per case


def test_without_a_gpu_nothing_runs(monkeypatch, capsys, tmp_path):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert host.main(["--calls", "5", "--out", str(tmp_path)]) == 1
    assert "needs a CUDA GPU" in capsys.readouterr().err
    assert not list(tmp_path.iterdir())


@pytest.mark.parametrize("bad", ["0", "-3", "x"])
def test_calls_must_be_a_positive_count(bad, capsys):
    with pytest.raises(SystemExit) as stop:
        host.main(["--calls", bad])
    assert stop.value.code == 2 and "--calls" in capsys.readouterr().err


def test_every_case_is_a_valid_call_of_its_way():
    """Each case's gemslib call, and its torch call plain and under ``enable()``, run once at
    their decode sizes (in the interpreter on the CPU), so a signature the table gets wrong
    fails here, not on the GPU. On the CPU a torch call may have no kernel (torch has no CPU
    ``_fused_rms_norm_backward``, until an ``enable()`` in the process installed gemslib's):
    it must still run under ``enable()``, whose override serves it."""
    from helpers import DEVICE

    for name, ways in host.cases(torch.device(DEVICE)).items():
        if ways["gemslib"] is not None:
            ways["gemslib"]()
        try:
            ways["torch"]()
        except NotImplementedError:
            assert DEVICE != "cuda", name
        with host._scope("enable")():
            ways["enable"]()


def test_a_launch_in_a_compiled_graph_is_the_stack_less_its_projections(monkeypatch):
    """The compiled-graph table compiles each stack with and without the form per way, takes
    the difference per layer as the form's launch, fuses the form under gemslib, and sets each
    way against inductor's (the times mean nothing on the CPU)."""
    monkeypatch.setattr(host, "GRAPH_LAYERS", 1)
    results = host.run_graphs(calls=2, device=torch.device("cpu"), warmup=1,
                              forms=("rms_norm",), ways=("inductor", "gemslib"))
    row = results["rms_norm"]
    assert row["gemslib"]["fused"] and row["inductor"]["fused"]
    for way in ("inductor", "gemslib"):
        assert row[way]["per_launch"] == row[way]["stack"] - row[way]["projections"]
    assert row["gemslib"]["fusions"] == {"rms_norm": 1} and row["inductor"]["fusions"] == {}
    assert row["gemslib"]["ratio"] == row["gemslib"]["per_launch"] / row["inductor"]["per_launch"]
    markdown = host.format_graph_markdown(results)
    assert "| rms_norm | " in markdown and "| - | - |" in markdown  # ways not run: dashes


@pytest.fixture
def verdicts_say_inductor(monkeypatch):
    """The file in use measured inductor faster for every rms_norm (its verdicts read)."""
    import dataclasses

    from gemslib.runtime import configs

    monkeypatch.delenv(configs.VERDICTS_ENV, raising=False)
    selected, default = configs.active_configs()
    says_inductor = dataclasses.replace(selected, verdicts={"rms_norm": ((None, "inductor"),)})
    monkeypatch.setattr(configs, "_active", (says_inductor, default))


def test_the_graph_table_sets_the_verdicts_aside_and_says_where_a_form_is_not_fused(
        monkeypatch, verdicts_say_inductor):
    """A launch figure needs the fusion in the graph: the gemslib ways compile with the
    verdicts set aside, and a form left unfused all the same reads "not fused", never a
    figure of inductor's kernel under gemslib's name."""
    import contextlib

    from gemslib import runtime

    monkeypatch.setattr(host, "GRAPH_LAYERS", 1)
    results = host.run_graphs(calls=1, device=torch.device("cpu"), warmup=1,
                              forms=("rms_norm",), ways=("inductor", "gemslib"))
    assert results["rms_norm"]["gemslib"]["fusions"] == {"rms_norm": 1}
    monkeypatch.setattr(runtime, "ignoring_verdicts", contextlib.nullcontext)
    results = host.run_graphs(calls=1, device=torch.device("cpu"), warmup=1,
                              forms=("rms_norm",), ways=("inductor", "gemslib"))
    row = results["rms_norm"]
    assert row["gemslib"]["fusions"] == {} and not row["gemslib"]["fused"]
    markdown = host.format_graph_markdown(results)
    line = next(line for line in markdown.splitlines() if line.startswith("| rms_norm |"))
    cells = [cell.strip() for cell in line.strip("|").split("|")]
    # form, inductor, gemslib, gemslib-python, gemslib-default, ratio
    assert cells[2] == "not fused" and cells[3:] == ["-", "-", "-"], line
    assert cells[1] == f"{row['inductor']['per_launch']:.1f}"
