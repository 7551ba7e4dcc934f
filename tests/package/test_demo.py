"""``python -m gemslib demo``: Llama-shaped layers five ways, checked against each other, and a
transformers Llama eager and through the gemslib backend."""

import os
import subprocess
import sys

import pytest
import torch

from helpers import DEVICE, ON_GPU
from gemslib import demo


def test_demo_runs_every_way_and_they_agree(tmp_path):
    # the tiny layers on a GPU too (checks only): the full-size run is the demo's own job; 8
    # tokens (the CPU default is 1x24 and 2x20: on the CPU the kernels run in the interpreter)
    result = subprocess.run([sys.executable, "-m", "gemslib", "demo", "--no-time", "--shape",
                             "tiny", "--layers", "2", "--prefill", "1x8", "--decode", "2x8"],
                            cwd=tmp_path, env=dict(os.environ), capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr
    lines = result.stdout.splitlines()
    for kind in ("prefill", "decode"):
        for way in ("eager", "eager + enable()", "gemslib", "torch.compile",
                    "gemslib, compile(fullgraph)"):
            matching = [line for line in lines if line.split()[:1] == [kind] and
                        line.split(None, 1)[1].startswith(way + " (")]
            assert len(matching) == 1 and " ok" in matching[0], (kind, way, result.stdout)
    overrides = [line for line in lines if "overrides that ran:" in line]
    assert len(overrides) == 2, result.stdout  # prefill and decode under enable()
    for line in overrides:
        assert "_fused_rms_norm" in line and "silu" in line and "attention" in line, line
        assert line.endswith("fell back: none"), line
    # the transformers part (installed in the test environment): eager and the gemslib backend
    # on LlamaForCausalLM, both checked against float64/float32, the fusions listed
    for way in ("eager", 'compile(backend="gemslib", fullgraph)'):
        matching = [line for line in lines if line.split()[:1] == ["model"] and
                    line.split(None, 1)[1].startswith(way + " (")]
        assert len(matching) == 1 and " ok" in matching[0], (way, result.stdout)
    (fusions,) = [line for line in lines if "first call (compile)" in line]
    assert "add_rms_norm 4" in fusions and "rms_norm 1" in fusions, fusions
    assert "all ways agree" in result.stdout


def test_the_transformers_part_alone_and_without_transformers(monkeypatch, capsys):
    """--part transformers runs only the model; without transformers the default leaves the
    part out with a note, and asking for it is a usage error."""
    lines = []
    failures = demo.run_transformers(demo.TINY, 1, (1, 8), torch.device(DEVICE), torch.float32,
                                     time_it=False, out=lines.append)
    assert failures == 0, "\n".join(lines)
    assert sum(" ok" in line for line in lines if line.startswith("  model")) == 2, lines
    monkeypatch.setattr(demo, "have_transformers", lambda: False)
    monkeypatch.setattr(demo, "run", lambda *args, **kwargs: 0)
    assert demo.main(["--no-time", "--layers", "1"]) == 0
    assert "transformers is not installed" in capsys.readouterr().out
    with pytest.raises(SystemExit) as usage:
        demo.parse_args(["--part", "transformers"])
    assert usage.value.code == 2


def test_a_wrong_layer_is_reported(monkeypatch):
    """The check can fail: a gemslib layer that is off by 1% is a mismatch, and run() says how
    many."""
    right = demo.gemslib_stack
    monkeypatch.setattr(demo, "gemslib_stack", lambda *args: right(*args) * 1.01)
    lines = []
    failures = demo.run(demo.TINY, 1, (1, 8), (2, 6), torch.device(DEVICE), torch.float32,
                        time_it=False, compile_backend="eager", out=lines.append)
    mismatched = [line for line in lines if "MISMATCH" in line]
    # the gemslib layer, compiled and not, in prefill and decode (and the CUDA graph's step)
    assert failures == len(mismatched) == 4 + ON_GPU, "\n".join(lines)
    assert all("gemslib" in line for line in mismatched)


def test_decode_step_writes_each_sequence_at_its_own_position():
    """Sequences at different lengths in one gemslib decode step give what the torch layer
    gives for each sequence alone (its new K/V land at its own position, it attends to its own
    length)."""
    shape, dtype, device = demo.TINY, torch.float32, torch.device(DEVICE)
    layers = demo.random_layers(shape, 2, device, dtype, seed=3)
    cos, sin = demo.rotary_tables(shape, 16, device)
    lengths = [5, 11]
    caches = demo._new_caches(2, len(lengths), shape, 16, device, dtype)
    demo._fill_caches(caches, 4, 16)
    per_sequence = [[tuple(c[b:b + 1].double() for c in pair) for pair in caches]
                    for b in range(len(lengths))]
    x = torch.randn(len(lengths), 1, shape.hidden, device=device, dtype=dtype)
    positions = torch.tensor(lengths, device=device)[:, None]
    ours = demo.gemslib_stack(x, layers, shape, cos, sin, positions, caches, positions[:, 0] + 1)
    reference_layers = [w.to(torch.float64) for w in layers]
    for b, length in enumerate(lengths):
        expected = demo.torch_stack(x[b:b + 1].double(), reference_layers, shape, cos, sin,
                                    positions[b:b + 1], per_sequence[b], length)
        assert demo._relative_error(ours[b:b + 1], expected) < 2e-5, b
        for (k_cache, v_cache), (k_expected, v_expected) in zip(caches, per_sequence[b]):
            # the new entries and everything before them; nothing past the position is read
            torch.testing.assert_close(k_cache[b:b + 1, :, :length + 1].double(),
                                       k_expected[:, :, :length + 1], rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(v_cache[b:b + 1, :, :length + 1].double(),
                                       v_expected[:, :, :length + 1], rtol=1e-5, atol=1e-5)
