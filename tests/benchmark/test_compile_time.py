"""benchmark.compile_time: two processes per backend on one cache directory, the second warm.

The gemslib backend's passes have a stable uuid() (a hash of their source and options), so the
second process loads the compiled graph from inductor's FX graph cache, and what the passes did
(the fusions counted, the projections' parameters merged) is there all the same."""

import json

from benchmark import compile_time


def test_a_warm_process_loads_the_gemslib_graph_from_the_cache_and_reports_its_fusions(tmp_path):
    assert compile_time.main(["--tiny", "--shape", "1x8", "--backends", "gemslib",
                              "--out", str(tmp_path)]) == 0
    results = json.loads((tmp_path / "compile_time.json").read_text())["gemslib"]
    cold, warm = results["cold"], results["warm"]
    assert cold["fx_graph_cache_misses"] >= 1 and cold["fx_graph_cache_hits"] == 0
    assert warm["fx_graph_cache_hits"] >= 1 and warm["fx_graph_cache_misses"] == 0
    assert cold["fusions"] and warm["fusions"] == cold["fusions"]
    assert cold["projections_merged"] and warm["projections_merged"]
    assert "warm gemslib" not in compile_time.table(results and {"gemslib": results})


def test_the_table_gives_warm_gemslib_over_warm_inductor():
    row = {"first_call_s": 2.0, "next_call_s": 0.01, "fx_graph_cache_hits": 1,
           "fx_graph_cache_misses": 0, "fusions": {}}
    results = {"inductor": {"cold": dict(row, first_call_s=10.0), "warm": row},
               "gemslib": {"cold": dict(row, first_call_s=12.0),
                           "warm": dict(row, first_call_s=2.5)}}
    assert "warm gemslib / warm inductor: 1.25x" in compile_time.table(results)
