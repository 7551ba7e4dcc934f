"""Render a benchmark run's results.json as the README's benchmark tables.

    python -m benchmark.readme RESULTS_JSON                     # print the markdown
    python -m benchmark.readme RESULTS_JSON --readme README.md  # put it between the markers
    python -m benchmark.readme RESULTS_JSON --plots DIR         # also draw the plots (no GPU)

One table per operator, one row per shape: gemslib's time, its % of the roofline, each peer's
time, the best peer and gemslib's speedup over it (best peer's time / gemslib's time; below
1.00x the cell says "behind"). The roofline is the run's own: GB/s against the measured copy
bandwidth, or TFLOP/s against the measured bf16 matmul rate for operators that count FLOPs.
A header names the GPU, the versions, the date, the command and those ceilings.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
from pathlib import Path

from benchmark import harness

START = "<!-- benchmark-table:start -->"
END = "<!-- benchmark-table:end -->"
# what render() reads; everything else in results.json is optional
REQUIRED = {"environment": ("gpu", "torch", "triton", "date"), "ceilings": ("copy_gbps",)}
ROW_KEYS = ("op", "shape", "dtype", "peers")


class ReportError(ValueError):
    """results.json or the README is not what the report needs; the message names the file."""


def read(path: Path) -> dict:
    """The JSON document at ``path``, or a :class:`ReportError` naming the file."""
    try:
        report = json.loads(Path(path).read_text())
    except FileNotFoundError:
        raise ReportError(f"{path}: no such file") from None
    except json.JSONDecodeError as err:
        raise ReportError(f"{path}: not JSON ({err})") from None
    if not isinstance(report, dict):
        raise ReportError(f"{path}: not a results.json written by python -m benchmark")
    return report


def check(report: dict, source: str) -> None:
    """Raise a :class:`ReportError` naming ``source`` and every key render() needs but
    ``report`` lacks."""
    missing = []
    for section, keys in REQUIRED.items():
        if isinstance(report.get(section), dict):
            missing += [f"{section}.{key}" for key in keys if key not in report[section]]
        else:
            missing.append(section)
    rows = report.get("summary")
    if not isinstance(rows, list):
        missing.append("summary")
        rows = []
    for i, row in enumerate(rows):
        missing += [f"summary[{i}].{key}" for key in ROW_KEYS
                    if not isinstance(row, dict) or key not in row]
    if missing:
        raise ReportError(f"{source} lacks {', '.join(missing)} "
                          "(is it a results.json written by python -m benchmark?)")
    if not rows:
        raise ReportError(f"{source} has no rows in its summary")


def _cell(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def _escape(text: str) -> str:
    return str(text).replace("|", "\\|")


def speedup_cell(speedup: float | None) -> str:
    """``"1.10x"``; ``"0.87x (behind)"`` when gemslib is slower than the best peer as printed
    (0.996 shows as 1.00x, not behind); ``"-"`` when there is no peer time to compare."""
    if speedup is None:
        return "-"
    shown = f"{speedup:.2f}"
    return f"{shown}x (behind)" if float(shown) < 1 else f"{shown}x"


def roofline_cell(row: dict, ceilings: harness.Ceilings) -> str:
    """gemslib's share of the run's ceiling and which ceiling: ``"91.8% copy"``,
    ``"86.0% matmul"``; ``"-"`` when it has none (it failed, or counts neither)."""
    basis = harness.roofline(row.get("gbps"), row.get("tflops"), ceilings)
    pct = row.get("pct_of_ceiling")
    return "-" if basis is None or pct is None else f"{pct:.1f}% {basis}"


def header(report: dict) -> list[str]:
    """The lines above the tables: GPU, versions, date, command, ceilings and how to read."""
    env, ceilings = report["environment"], report["ceilings"]
    gpu = env["gpu"] + (f" ({env['sms']} SMs)" if env.get("sms") else "")
    software = [f"torch {env['torch']}" + (f" (CUDA {env['cuda']})" if env.get("cuda") else ""),
                f"Triton {env['triton']}"]
    software += [f"{name} {version}" for name, version in (env.get("peers") or {}).items()]
    run = f"{gpu}, {', '.join(software)}; {env['date']}"
    if report.get("command"):
        run += f"; `{report['command']}`"
    ceiling = f"copy {ceilings['copy_gbps']:.0f} GB/s (device to device, read + write)"
    matmul = ceilings.get("matmul_tflops")
    ceiling += f", bf16 matmul 8192^3 {matmul:.0f} TFLOP/s" if matmul else \
        ", matmul rate not measured"
    dtypes = sorted({row["dtype"] for row in report["summary"]})
    return [f"**{run}.**", "",
            f"Ceilings measured in this run: {ceiling}. Times in microseconds ({', '.join(dtypes)}, "
            "best of three round-robin medians of `triton.testing.do_bench`). \"% of roofline\" "
            "is gemslib's GB/s over the copy bandwidth, or its TFLOP/s over the matmul rate for "
            "operators that count FLOPs. \"vs best peer\" is the best peer's time over gemslib's; "
            "gemslib's own variants and \"(bound)\" columns are shown but are not peers. "
            "\"-\": not run, or failed."]


def op_table(rows: list[dict], ceilings: harness.Ceilings) -> list[str]:
    """One operator's markdown table: a row per shape, a column per peer it was timed against
    (in the order they were timed), and a note column when gemslib failed or disagreed."""
    peers = list(dict.fromkeys(peer for row in rows for peer in row["peers"]))
    noted = any(row.get("error") for row in rows)
    head = ["operator", "shape", "gemslib", "% of roofline", *peers, "best peer", "vs best peer"]
    align = ["---", "---", "---:", "---:", *["---:"] * len(peers), "---", "---:"]
    if noted:
        head.append("note")
        align.append("---")
    lines = ["| " + " | ".join(map(_escape, head)) + " |", "| " + " | ".join(align) + " |"]
    for row in rows:
        cells = [row["op"], row["shape"], _cell(row.get("gemslib_us"), ".1f"),
                 roofline_cell(row, ceilings),
                 *[_cell(row["peers"].get(peer), ".1f") for peer in peers],
                 row.get("best_peer") or "-", speedup_cell(row.get("speedup"))]
        if noted:
            cells.append(row.get("error") or "")
        lines.append("| " + " | ".join(map(_escape, cells)) + " |")
    return lines


def render(report: dict, source: str = "results.json") -> str:
    """The markdown for ``report`` (a results.json's content): the header, then one table per
    operator in the order the run timed them. ``source`` names the file in errors."""
    check(report, source)
    ceilings = harness.Ceilings(copy_gbps=report["ceilings"]["copy_gbps"],
                                matmul_tflops=report["ceilings"].get("matmul_tflops"))
    by_op: dict[str, list[dict]] = {}
    for row in report["summary"]:
        by_op.setdefault(row["op"], []).append(row)
    lines = ["<!-- generated by `python -m benchmark.readme` from a run's results.json; "
             "edits here are overwritten -->", *header(report)]
    for rows in by_op.values():
        lines += ["", *op_table(rows, ceilings)]
    return "\n".join(lines) + "\n"


def replace_between_markers(text: str, markdown: str, name: str) -> str:
    """``text`` with everything between the START and END marker lines replaced by
    ``markdown``; the markers and all text outside them are kept as they are. ``name`` (the
    README's path) is named in the error when the markers are missing, repeated or reversed."""
    for marker in (START, END):
        count = text.count(marker)
        if count != 1:
            raise ReportError(f"{name} has {count or 'no'} {marker} marker"
                              f"{'s' if count > 1 else ''}; it needs one {START} line and one "
                              f"{END} line after it, around the generated tables")
    start, end = text.index(START) + len(START), text.index(END)
    if end < start:
        raise ReportError(f"{name}: {END} comes before {START}")
    return text[:start] + "\n" + markdown.strip("\n") + "\n" + text[end:]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmark.readme",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("results", type=Path, help="a results.json written by python -m benchmark")
    parser.add_argument("--readme", type=Path,
                        help=f"replace the text between {START} and {END} in this file "
                             "(default: print the markdown)")
    parser.add_argument("--plots", type=Path, metavar="DIR",
                        help="also draw one PNG per operator from the JSON into DIR "
                             "(needs matplotlib)")
    args = parser.parse_args(argv)
    try:
        report = read(args.results)
        markdown = render(report, str(args.results))
        if args.readme is None:
            print(markdown, end="")
        else:
            try:
                text = args.readme.read_text()
            except FileNotFoundError:
                raise ReportError(f"{args.readme}: no such file") from None
            args.readme.write_text(replace_between_markers(text, markdown, str(args.readme)))
            print(f"wrote {len(report['summary'])} rows from {args.results} into {args.readme}")
        if args.plots is not None:
            if not isinstance(report.get("results"), list):
                raise ReportError(f"{args.results} lacks results (the timings the plots show)")
            if importlib.util.find_spec("matplotlib") is None:
                raise ReportError("--plots needs matplotlib: pip install '.[bench]'")
            results, ceilings, env = harness.load_json(args.results)
            written = harness.plot(results, ceilings, args.plots, env["gpu"])
            print(f"wrote {len(written)} plot(s) into {args.plots}")
    except ReportError as err:
        print(f"python -m benchmark.readme: {err}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
