"""The benchmark report, from a synthetic run on the CPU: plots per operator, the full tables
and the summary rendered from results.json, and the project's README and docs/benchmarks.md
holding what the kept run renders to. No GPU, no timing: the synthetic "times" are made up."""

import json
from pathlib import Path

import pytest

from benchmark import harness, readme
from benchmark.harness import Case, Ceilings

CEILINGS = Ceilings(copy_gbps=4000.0, matmul_tflops=700.0)
ENV = {"gpu": "NVIDIA H200", "sms": 132, "torch": "2.11.0+cu130", "cuda": "13.0",
       "triton": "3.6.0", "python": "3.12.3", "peers": {"Liger-Kernel": "0.8.5"},
       "date": "2026-12-01 10:00 UTC"}
COMMAND = "python -m benchmark --quick"


def _ms(ms):
    """An implementation whose "median" is ``ms`` (run_case's median_ms is patched to call it)."""
    return lambda: ms


def _fails():
    raise RuntimeError("no kernel for this shape")


def _cases():
    silu_bytes = 2 * 4096 * 14336 * 2
    return [
        # memory-bound, gemslib ahead (1.10x torch.compile); FlagGems errors
        Case("silu", "4096x14336", "bf16", silu_bytes,
             {"gemslib": _ms(0.060), "torch eager": _ms(0.075), "torch.compile": _ms(0.066),
              "FlagGems": _fails}),
        # gemslib behind: torch.compile 20.0 us against gemslib's 23.0 (0.87x)
        Case("rms_norm", "4096x4096", "bf16", 2 * 4096 * 4096 * 2,
             {"gemslib": _ms(0.023), "torch.compile": _ms(0.020), "Liger-Kernel": _ms(0.025)}),
        # Liger-Kernel not run at this shape; 16 KB in 4 us is ~700x below the row above
        Case("rms_norm", "1x4096", "bf16", 2 * 4096 * 2,
             {"gemslib": _ms(0.004), "torch.compile": _ms(0.006)}),
        # compute-bound: FLOPs only, so TFLOP/s against the matmul rate
        Case("attention", "B1 H32 S8192 D128", "bf16", 0,
             {"gemslib": _ms(1.8256), "SDPA cuDNN": _ms(1.7801), "FA2": _ms(3.1321)},
             flops=4 * 32 * 8192 * 8192 * 128),
    ]


@pytest.fixture
def run(monkeypatch, tmp_path):
    """A synthetic run through the harness's own path: run_case, summarize, write_json."""
    monkeypatch.setattr(harness, "median_ms", lambda fn: fn())
    results = [r for case in _cases() for r in harness.run_case(case, CEILINGS, rounds=1)]
    rows = harness.summarize(results)
    path = tmp_path / "results.json"
    harness.write_json(path, results, rows, CEILINGS, ENV, COMMAND)
    return path


def test_plot_specs_pick_each_operators_unit_and_ceiling(run):
    results, ceilings, env = harness.load_json(run)
    specs = {spec.op: spec for spec in harness.plot_specs(results, ceilings, env["gpu"])}
    assert list(specs) == ["attention", "rms_norm", "silu"]

    attention = specs["attention"]
    assert attention.unit == "TFLOP/s" and attention.ceiling == 700.0
    assert attention.ceiling_label == "bf16 matmul 700 TFLOP/s"
    assert attention.title == "attention: TFLOP/s, higher is better (NVIDIA H200)"
    tflops = 4 * 32 * 8192 * 8192 * 128 / 1.8256 / 1e9
    assert attention.values["gemslib"] == [pytest.approx(tflops)]
    assert set(attention.values) == {"gemslib", "SDPA cuDNN", "FA2"}

    silu = specs["silu"]
    assert silu.unit == "GB/s" and silu.ceiling == 4000.0 and silu.ceiling_label == "copy 4000 GB/s"
    assert "FlagGems" not in silu.values  # failed at every shape: no bars, no legend entry
    assert silu.values["gemslib"] == [pytest.approx(2 * 4096 * 14336 * 2 / 0.060 / 1e6)]
    assert not silu.log_scale

    rms_norm = specs["rms_norm"]
    assert rms_norm.shapes == ["4096x4096", "1x4096"]
    assert rms_norm.values["Liger-Kernel"] == [pytest.approx(4096 * 4096 * 4 / 0.025 / 1e6), None]
    assert rms_norm.log_scale  # one row and 4096 rows differ ~700x


def test_an_operator_without_bytes_or_flops_is_plotted_as_time():
    results = [harness.Result("noop", "1", "bf16", "gemslib", 3.0, None, None, None),
               harness.Result("noop", "1", "bf16", "torch eager", 5.0, None, None, None)]
    (spec,) = harness.plot_specs(results, Ceilings(copy_gbps=4000.0), "GPU")
    assert spec.unit == "us" and spec.ceiling is None and "lower is better" in spec.title
    assert spec.values == {"gemslib": [3.0], "torch eager": [5.0]}


def test_without_a_matmul_ceiling_tflops_are_plotted_without_a_line(run):
    results, _, _ = harness.load_json(run)
    specs = harness.plot_specs(results, Ceilings(copy_gbps=4000.0), "GPU")
    (attention,) = [s for s in specs if s.op == "attention"]
    assert attention.unit == "TFLOP/s" and attention.ceiling is None
    assert attention.ceiling_label is None


def test_plots_are_drawn_from_results_json_one_png_per_operator(run, tmp_path):
    """From the JSON alone (no CUDA): one PNG per operator, the TFLOP/s-only one included.
    matplotlib is in the ``test`` extra."""
    results, ceilings, env = harness.load_json(run)
    written = harness.plot(results, ceilings, tmp_path / "plots", env["gpu"])
    assert sorted(p.name for p in written) == ["attention.png", "rms_norm.png", "silu.png"]
    for path in written:
        assert path.read_bytes().startswith(b"\x89PNG")


def test_run_case_judges_flops_against_matmul_and_bytes_against_copy(run):
    data = json.loads(run.read_text())
    pct = {(r["op"], r["shape"]): r["pct_of_ceiling"] for r in data["summary"]}
    assert pct[("attention", "B1 H32 S8192 D128")] == pytest.approx(
        100 * 4 * 32 * 8192 * 8192 * 128 / 1.8256 / 1e9 / 700.0)
    assert pct[("silu", "4096x14336")] == pytest.approx(
        100 * 2 * 4096 * 14336 * 2 / 0.060 / 1e6 / 4000.0)


def _tables(markdown):
    """{op: [{column: cell}]} from the rendered markdown's tables."""
    tables, head = {}, None
    for line in markdown.splitlines():
        if not line.startswith("| "):
            head = None
            continue
        cells = [cell.strip() for cell in line.strip("|").split(" | ")]
        if head is None:
            head = cells
        elif not cells[0].startswith("---"):
            row = dict(zip(head, cells))
            tables.setdefault(row["operator"], []).append(row)
    return tables


def _row(markdown, op, shape):
    (row,) = [row for row in _tables(markdown)[op] if row["shape"] == shape]
    return row


def test_markdown_has_one_row_per_operator_and_shape(run):
    markdown = readme.render(json.loads(run.read_text()))
    tables = _tables(markdown)
    assert list(tables) == ["silu", "rms_norm", "attention"]  # the order the run timed them
    assert [(op, row["shape"]) for op, rows in tables.items() for row in rows] == \
        [(case.op, case.shape) for case in _cases()]
    # each table has the peers its operator was timed against, in that order
    assert list(tables["attention"][0]) == ["operator", "shape", "gemslib", "% of roofline",
                                            "SDPA cuDNN", "FA2", "best peer", "vs best peer"]


def test_header_names_the_gpu_versions_date_command_and_ceilings(run):
    markdown = readme.render(json.loads(run.read_text()))
    head = markdown.split("\n| ")[0]
    for text in ("NVIDIA H200 (132 SMs)", "torch 2.11.0+cu130 (CUDA 13.0)", "Triton 3.6.0",
                 "Liger-Kernel 0.8.5", "2026-12-01 10:00 UTC", "`python -m benchmark --quick`",
                 "copy 4000 GB/s", "bf16 matmul 8192^3 700 TFLOP/s", "bf16"):
        assert text in head, text


def test_speedup_behind_marks_roofline_and_missing_peers(run):
    markdown = readme.render(json.loads(run.read_text()))
    silu = _row(markdown, "silu", "4096x14336")
    assert silu["gemslib"] == "60.0" and silu["torch.compile"] == "66.0"
    assert silu["best peer"] == "torch.compile" and silu["vs best peer"] == "1.10x"
    assert silu["FlagGems"] == "-"  # errored
    assert silu["% of roofline"] == f"{100 * 2 * 4096 * 14336 * 2 / 60.0 / 1e3 / 4000:.1f}% copy"
    behind = _row(markdown, "rms_norm", "4096x4096")
    assert behind["vs best peer"] == "0.87x (behind)" and behind["best peer"] == "torch.compile"
    small = _row(markdown, "rms_norm", "1x4096")
    assert small["Liger-Kernel"] == "-" and small["vs best peer"] == "1.50x"  # not run there
    attention = _row(markdown, "attention", "B1 H32 S8192 D128")
    assert attention["vs best peer"] == "0.98x (behind)" and attention["FA2"] == "3132.1"
    tflops = 4 * 32 * 8192 * 8192 * 128 / 1.8256 / 1e9
    assert attention["% of roofline"] == f"{100 * tflops / 700:.1f}% matmul"


def test_speedup_cell_says_behind_only_when_the_printed_figure_is_below_one():
    assert readme.speedup_cell(0.996) == "1.00x"
    assert readme.speedup_cell(0.994) == "0.99x (behind)"
    assert readme.speedup_cell(2.0) == "2.00x" and readme.speedup_cell(None) == "-"


def test_a_gemslib_failure_gets_a_note_column(monkeypatch):
    monkeypatch.setattr(harness, "median_ms", lambda fn: fn())
    case = Case("softmax", "8x8", "bf16", 1000, {"gemslib": _fails, "torch eager": _ms(0.001)})
    results = harness.run_case(case, CEILINGS, rounds=1)
    report = {"environment": ENV, "ceilings": {"copy_gbps": 4000.0},
              "summary": harness.summarize(results)}
    markdown = readme.render(report)
    row = _row(markdown, "softmax", "8x8")
    assert row["gemslib"] == "-" and row["vs best peer"] == "-" and row["torch eager"] == "1.0"
    assert row["note"] == "RuntimeError: no kernel for this shape"
    assert "matmul rate not measured" in markdown


README = f"""# gemslib

## Benchmarks

Some text the owner wrote.

{readme.START}
The generated table goes here.
{readme.END}

| old | hand-written table |
| --- | --- |
"""


def test_readme_markers_are_replaced_and_the_rest_is_untouched(run, tmp_path, capsys):
    path = tmp_path / "README.md"
    path.write_text(README)
    assert readme.main([str(run), "--readme", str(path)]) == 0
    text = path.read_text()
    markdown = readme.render(json.loads(run.read_text()))
    before, after = README.split("The generated table goes here.\n")
    assert text == before + markdown + after
    assert "wrote 4 rows" in capsys.readouterr().out
    assert readme.main([str(run), "--readme", str(path)]) == 0  # again: the same text
    assert path.read_text() == text


def test_without_readme_the_markdown_is_printed(run, capsys):
    assert readme.main([str(run)]) == 0
    assert capsys.readouterr().out == readme.render(json.loads(run.read_text()))


def test_a_readme_without_markers_is_an_error_naming_it(run, tmp_path, capsys):
    path = tmp_path / "README.md"
    path.write_text(README.replace(readme.END, ""))
    assert readme.main([str(run), "--readme", str(path)]) == 1
    err = capsys.readouterr().err
    assert f"{path} has no {readme.END} marker" in err
    assert path.read_text() == README.replace(readme.END, "")  # left as it was
    with pytest.raises(readme.ReportError, match="README.md has 2 .* markers"):
        readme.replace_between_markers(README + readme.START, "x", "README.md")
    with pytest.raises(readme.ReportError, match="README.md: .* comes before"):
        readme.replace_between_markers(f"{readme.END}\n{readme.START}\n", "x", "README.md")


def test_a_results_json_without_the_needed_keys_is_an_error_naming_it(run, tmp_path, capsys):
    report = json.loads(run.read_text())
    del report["environment"]["gpu"], report["ceilings"], report["summary"][1]["peers"]
    broken = tmp_path / "broken.json"
    broken.write_text(json.dumps(report))
    assert readme.main([str(broken)]) == 1
    err = capsys.readouterr().err
    assert f"{broken} lacks environment.gpu, ceilings, summary[1].peers" in err
    assert readme.main([str(tmp_path / "absent.json")]) == 1
    assert "absent.json: no such file" in capsys.readouterr().err
    with pytest.raises(readme.ReportError, match="run.json lacks summary"):
        readme.render({"environment": ENV, "ceilings": {"copy_gbps": 1.0}}, "run.json")


def test_plots_from_the_command_line(run, tmp_path, capsys):
    assert readme.main([str(run), "--plots", str(tmp_path / "plots")]) == 0
    assert sorted(p.name for p in (tmp_path / "plots").iterdir()) == \
        ["attention.png", "rms_norm.png", "silu.png"]
    assert "wrote 3 plot(s)" in capsys.readouterr().out


ROOT = Path(__file__).resolve().parents[2]
# the run whose tables README.md and docs/benchmarks.md show, kept so that both regenerate
KEPT_RUN = ROOT / "docs" / "results" / "nvidia_h200-quick-2026-11-30.json"


def _between(text, start, end):
    return text.split(start)[1].split(end)[0].strip("\n") + "\n"


def test_the_projects_readme_holds_the_summary_and_docs_the_full_tables():
    """README.md: the summary markers once, in order, around render_summary of the kept run;
    docs/benchmarks.md: the table markers likewise around render of it."""
    report = json.loads(KEPT_RUN.read_text())
    for name, start, end, make in (
            ("README.md", readme.SUMMARY_START, readme.SUMMARY_END, readme.render_summary),
            ("docs/benchmarks.md", readme.START, readme.END, readme.render)):
        path = ROOT / name
        text = path.read_text()
        replaced = readme.replace_between_markers(text, "TABLE", str(path), start, end)
        assert replaced.count("TABLE") == 1
        assert replaced.split(start)[0] == text.split(start)[0]
        assert replaced.split(end)[1] == text.split(end)[1]
        assert _between(text, start, end) == make(report, str(KEPT_RUN)), \
            f"{name}'s generated part is not what python -m benchmark.readme makes of {KEPT_RUN}"
        assert readme.fill(text, report, name) == text


def test_summary_has_one_row_per_operator_at_its_largest_problem(run):
    report = json.loads(run.read_text())
    markdown = readme.render_summary(report)
    head, table = markdown.split("\n\n", 1)
    for text in ("NVIDIA H200 (132 SMs)", "torch 2.11.0+cu130 (CUDA 13.0)", "Triton 3.6.0",
                 "Liger-Kernel 0.8.5", "2026-12-01 10:00 UTC", "`python -m benchmark --quick`",
                 "copy 4000 GB/s", "bf16 matmul 700 TFLOP/s"):
        assert text in head, text
    rows = [[cell.strip() for cell in line.strip("|").split(" | ")]
            for line in table.splitlines()[2:]]
    assert [row[:2] for row in rows] == [["silu", "4096x14336"], ["rms_norm", "4096x4096"],
                                         ["attention", "B1 H32 S8192 D128"]]
    assert rows[0][4:] == ["torch.compile 66.0", "1.10x"]
    assert rows[1][4:] == ["torch.compile 20.0", "0.87x (behind)"]  # 4096 rows, not the 1-row case
    assert rows[2][3].endswith("% matmul")


def test_readme_option_fills_each_files_markers_and_summary_prints(run, tmp_path, capsys):
    report = json.loads(run.read_text())
    summary_file, tables_file = tmp_path / "README.md", tmp_path / "tables.md"
    summary_file.write_text(f"# top\n{readme.SUMMARY_START}\nold\n{readme.SUMMARY_END}\ntail\n")
    tables_file.write_text(README)
    assert readme.main([str(run), "--readme", str(summary_file), "--readme", str(tables_file)]) == 0
    assert summary_file.read_text() == \
        f"# top\n{readme.SUMMARY_START}\n{readme.render_summary(report)}{readme.SUMMARY_END}\ntail\n"
    assert readme.render(report) in tables_file.read_text()
    assert capsys.readouterr().out.count("wrote 4 rows") == 2
    assert readme.main([str(run), "--summary"]) == 0
    assert capsys.readouterr().out == readme.render_summary(report)


def test_a_file_without_any_markers_is_an_error_and_nothing_is_written(run, tmp_path, capsys):
    good, bare = tmp_path / "good.md", tmp_path / "bare.md"
    good.write_text(README)
    bare.write_text("# no markers\n")
    assert readme.main([str(run), "--readme", str(good), "--readme", str(bare)]) == 1
    assert f"{bare} has no {readme.START} marker nor {readme.SUMMARY_START} marker" in \
        capsys.readouterr().err
    assert good.read_text() == README  # every file is checked before any is written
