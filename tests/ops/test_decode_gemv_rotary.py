"""decode_gemv_rotary (a decode step's q/k/v projection, its rotary and its static cache's
update in one launch) against float64 references: both prologues, biases, both pair layouts,
the per-head q/k norm, split K, the paths torch takes, errors, the custom op."""

import pytest
import torch

from helpers import DEVICE, ON_GPU, assert_device_side_assert, opcheck_overloads, random_tensor
from gemslib import runtime
from gemslib.fused import decode_gemv as gemv_ops
from gemslib.runtime import cuda

DOT_DTYPES = [torch.float16, torch.bfloat16, torch.float32] if ON_GPU else \
    [torch.float16, torch.float32]
_UNIT_ROUNDOFF = {torch.float16: 2.0 ** -11, torch.bfloat16: 2.0 ** -8, torch.float32: 2.0 ** -24,
                  torch.float64: 2.0 ** -53}
OP = torch.ops.gemslib.decode_gemv_rotary
EPS = 1e-6


def _config(block_n=32, block_k=32, split_k=1, gemv=1):
    return runtime.LaunchConfig((("BLOCK_K", block_k), ("BLOCK_N", block_n), ("GEMV", gemv),
                                 ("SPLIT_K", split_k)), 4, 1)


def _inputs(batch, seq, q_heads, kv_heads, head_dim, dtype, *, n_in=72, length=9,
            norm="norm", bias=True, qk_norm=None, interleaved=False, table_batch="B"):
    """The op's arguments: x (B S, K), the q, k and v weights (scaled as projections') apart,
    their biases, the norm before them (None, or weight and offset), per-token tables with
    unequal halves, distinct cache rows for the tokens, caches full of old values, and the
    per-head q/k norm (None, or weights and offset)."""
    widths = (q_heads * head_dim, kv_heads * head_dim, kv_heads * head_dim)
    angles = torch.rand(batch if table_batch == "B" else 1, seq, head_dim, device=DEVICE) * 6.3
    return dict(
        x=random_tensor((batch * seq, n_in), dtype, scale=1.0),
        weights=[random_tensor((width, n_in), dtype, scale=n_in ** -0.5) for width in widths],
        biases=[random_tensor((width,), dtype, scale=1.0) if bias else None for width in widths],
        norm_weight=random_tensor((n_in,), dtype, scale=1.0) if norm else None,
        eps=EPS, weight_offset=1.0 if norm == "norm+1" else 0.0,
        cos=angles.cos().to(dtype), sin=angles.sin().to(dtype), interleaved=interleaved,
        cache_position=torch.randperm(length, device=DEVICE)[:seq],
        k_cache=random_tensor((batch, kv_heads, length, head_dim), dtype),
        v_cache=random_tensor((batch, kv_heads, length, head_dim), dtype),
        n_q_heads=q_heads,
        q_weight=random_tensor((head_dim,), dtype, scale=1.0) if qk_norm else None,
        k_weight=random_tensor((head_dim,), dtype, scale=1.0) if qk_norm else None,
        qk_eps=EPS, qk_offset=1.0 if qk_norm == "1+w" else 0.0)


def _call(inputs):
    """The op on copies of the caches: (q, k_cache, v_cache)."""
    args = {**inputs, "k_cache": inputs["k_cache"].clone(), "v_cache": inputs["v_cache"].clone()}
    q = OP(*args.values())
    return q, args["k_cache"], args["v_cache"]


def _wide(t):
    return t.double() if isinstance(t, torch.Tensor) and t.is_floating_point() else t


def _expected(inputs):
    """(q, k_cache, v_cache) in float64, and the tolerance of each: the projection's error
    bound (its sums of absolute values, as decode_gemv's tests take it) scaled as the head is
    (by the q/k norm), times the largest of each head's, through the rotation (|cos| + |sin|
    <= sqrt 2) and the roundings of the projection's output, the rotation's and the norm's."""
    wide = {name: _wide(t) for name, t in inputs.items()}
    wide["weights"] = [w.double() for w in inputs["weights"]]
    wide["biases"] = [_wide(b) for b in inputs["biases"]]
    weight, bias = gemv_ops.merged_weights(wide["weights"], wide["biases"])
    caches = wide["k_cache"].clone(), wide["v_cache"].clone()
    q = gemv_ops.decode_gemv_rotary_reference(
        wide["x"], weight, bias, wide["norm_weight"], EPS, wide["weight_offset"], wide["cos"],
        wide["sin"], wide["interleaved"], wide["cache_position"], *caches, wide["n_q_heads"],
        wide["q_weight"], wide["k_weight"], EPS, wide["qk_offset"])

    dtype = inputs["x"].dtype
    u, n_in = _UNIT_ROUNDOFF[dtype], inputs["x"].shape[1]
    activations = gemv_ops._prologue(wide["x"], wide["norm_weight"], EPS, wide["weight_offset"],
                                     None)
    y = activations @ weight.t() + (bias if bias is not None else 0)
    bound = activations.abs() @ weight.abs().t() + (bias.abs() if bias is not None else 0)
    batch, kv_heads, _, head_dim = inputs["k_cache"].shape
    q_heads = inputs["n_q_heads"]
    heads = lambda t: t.view(t.shape[0], -1, head_dim)  # noqa: E731
    scale = torch.ones_like(heads(y))
    if inputs["q_weight"] is not None:
        rstd = heads(y).pow(2).mean(-1, keepdim=True).add(EPS).rsqrt()
        for first, last, weight_ in ((0, q_heads, wide["q_weight"]),
                                     (q_heads, q_heads + kv_heads, wide["k_weight"])):
            scale[:, first:last] = rstd[:, first:last] * (weight_ + wide["qk_offset"]).abs()
    head_bound = (heads(bound) * scale).amax(-1, keepdim=True) * 1.5
    # the projection's error, one rounding of its output, the norm's (about sqrt(K) units of
    # the head's bound over its rms), the rotation's rounding
    grain = ((2 * u + (n_in + 4) * 2.0 ** -24) * 8 + 2 * u) * head_bound
    grain = grain.expand_as(scale).reshape(y.shape)
    q_grain, *kv_grains = gemv_ops._heads(grain, batch, q_heads, kv_heads, head_dim)
    tolerance_q = q_grain.reshape(q.shape) + 2 * u * q.abs()
    tolerances = []
    for cache, tokens in zip(caches, kv_grains):
        tolerance = torch.zeros_like(cache)
        tolerance[:, :, wide["cache_position"]] = tokens.transpose(1, 2)
        tolerances.append(tolerance + 2 * u * cache.abs())
    return (q, *caches), (tolerance_q, *tolerances)


def _assert_matches(results, inputs):
    expected, tolerances = _expected(inputs)
    for name, got, want, tolerance in zip(("q", "k_cache", "v_cache"), results, expected,
                                          tolerances):
        assert got.shape == want.shape and got.dtype == inputs["x"].dtype, name
        error = (got.double() - want).abs()
        assert bool((error <= tolerance).all()), \
            f"{name}: max error {error.max().item():.3g}, worst error / tolerance " \
            f"{(error / tolerance.clamp_min(1e-300)).max().item():.3g}"
    # every row of the caches that no token writes keeps its old value, bit for bit
    kept = torch.ones(inputs["k_cache"].shape[2], dtype=torch.bool, device=DEVICE)
    kept[inputs["cache_position"]] = False
    for got, old in zip(results[1:], (inputs["k_cache"], inputs["v_cache"])):
        assert torch.equal(got[:, :, kept], old[:, :, kept])


@pytest.fixture
def poisoned_outputs(monkeypatch):
    """Every float tensor torch.empty makes (q, the split partials) starts as NaN."""
    empty = torch.empty

    def nan_empty(*args, **kwargs):
        made = empty(*args, **kwargs)
        return made.fill_(float("nan")) if made.is_floating_point() else made
    monkeypatch.setattr(torch, "empty", nan_empty)


def _kernel_ran(inputs, config=None):
    """(the op's results, whether the fused kernel ran), with ``config`` forced."""
    with gemv_ops.DECODE_GEMV_ROTARY.forced(config or _config()) as shapes:
        results = _call(inputs)
    return results, bool(shapes)


# (B, S, Hq, Hk, D): a decode step of one row (the multiply-and-sum GEMV), GQA of 3 rows,
# two tokens a sequence over a table of one sequence, MQA, 16 rows, a head dim whose half
# is odd (pairs across the tile's edges)
SHAPES = [(1, 1, 4, 2, 16), (3, 1, 4, 2, 16), (2, 2, 4, 2, 16), (2, 1, 3, 1, 12),
          (16, 1, 2, 1, 8), (1, 1, 2, 2, 10)]


@pytest.mark.parametrize("dtype", DOT_DTYPES)
@pytest.mark.parametrize("interleaved", [False, True], ids=["neox", "gptj"])
@pytest.mark.parametrize("norm,bias", [("norm", True), ("norm+1", False), (None, True)])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "B{}S{}Hq{}Hk{}D{}".format(*s))
def test_matches_reference(shape, norm, bias, interleaved, dtype, poisoned_outputs):
    """q rotated into its own tensor, k rotated and v as projected written into the caches at
    the tokens' rows, the rest of the caches untouched: the projection (norm prologue or none,
    biases or none) then rotary_into_cache, in float64."""
    batch, seq = shape[:2]
    inputs = _inputs(*shape, dtype, norm=norm, bias=bias, interleaved=interleaved,
                     table_batch=1 if seq > 1 else "B")
    results, ran = _kernel_ran(inputs)
    assert ran
    _assert_matches(results, inputs)


@pytest.mark.parametrize("dtype", DOT_DTYPES)
@pytest.mark.parametrize("interleaved", [False, True], ids=["neox", "gptj"])
@pytest.mark.parametrize("offset", ["w", "1+w"])
@pytest.mark.parametrize("shape,block_n", [((1, 1, 4, 2, 16), 32), ((3, 1, 2, 1, 32), 16),
                                           ((2, 1, 2, 2, 8), 64)],
                         ids=["two-heads-a-tile", "tile-grown-to-a-head", "eight-heads-a-tile"])
def test_the_per_head_qk_norm_matches_reference(shape, block_n, offset, interleaved, dtype,
                                                poisoned_outputs):
    """With q_weight and k_weight (Qwen3's per-head norm; Gemma-3's 1 + w) each q and k head
    is RMS-normalised before it is rotated, v's heads are not. A tile narrower than a head is
    grown to one (BLOCK_N 16 for D 32: 32, its K step and splits scaled)."""
    inputs = _inputs(*shape, dtype, qk_norm=offset, interleaved=interleaved)
    results, ran = _kernel_ran(inputs, _config(block_n=block_n))
    assert ran
    _assert_matches(results, inputs)
    unnormed, _ = _expected({**inputs, "q_weight": None, "k_weight": None})
    assert (results[0].double() - unnormed[0]).abs().max() > 0.1  # the norm is not a no-op


@pytest.mark.parametrize("dtype", DOT_DTYPES)
@pytest.mark.parametrize("qk_norm", [None, "w"])
@pytest.mark.parametrize("split_k", [1, 3])
def test_one_row_summed_after_the_loop(split_k, qk_norm, dtype, poisoned_outputs):
    """GEMV 2 at one row: the products summed over K once after the loop, in narrow tiles
    (4 rows: two pairs) and with K split; with the per-head norm the tile grows to a head."""
    inputs = _inputs(1, 1, 4, 2, 16, dtype, qk_norm=qk_norm)
    config = _config(block_n=4, block_k=16, split_k=split_k, gemv=gemv_ops.SUM_AT_END_GEMV)
    results, ran = _kernel_ran(inputs, config)
    assert ran
    _assert_matches(results, inputs)


def test_a_tile_grown_to_whole_heads_keeps_its_size_and_program_count():
    grown = gemv_ops._whole_heads(_config(block_n=32, block_k=256, split_k=2), 128)
    assert grown.meta_dict == {"BLOCK_N": 128, "BLOCK_K": 64, "SPLIT_K": 8, "GEMV": 1}
    assert (grown.num_warps, grown.num_stages) == (4, 1)
    kept = _config(block_n=256)
    assert gemv_ops._whole_heads(kept, 128) is kept


@pytest.mark.parametrize("dtype", DOT_DTYPES)
@pytest.mark.parametrize("rows", [1, 3])
@pytest.mark.parametrize("split_k", [3, 8], ids=["3-splits", "fewer-splits-than-asked"])
def test_split_k_sums_every_split_and_resets_its_counters(split_k, rows, dtype,
                                                          poisoned_outputs):
    """K 72 split in 16-wide steps, the last program of each tile to arrive adds the partials
    and rotates and writes: the same bits twice, every arrival counter back at 0."""
    inputs = _inputs(rows, 1, 4, 2, 16, dtype, qk_norm="w")
    config = _config(block_n=16, block_k=16, split_k=split_k)
    first, ran = _kernel_ran(inputs, config)
    again, _ = _kernel_ran(inputs, config)
    assert ran
    _assert_matches(first, inputs)
    assert all(torch.equal(a, b) for a, b in zip(first, again))
    for counters, _ in cuda._split_scratch_cache.values():
        assert not counters.any()


def test_the_shipped_configs_match_reference():
    """The default file's config for the shape (no config forced)."""
    inputs = _inputs(1, 1, 8, 2, 32, torch.float32, n_in=300, qk_norm="w")
    _assert_matches(_call(inputs), inputs)


@pytest.mark.parametrize("case", ["partial rotary", "odd head pairs with the qk norm",
                                  "17 rows", "float64", "bf16 in the interpreter"])
def test_calls_the_kernel_does_not_take_are_computed_by_torch(case):
    """decode_gemv then rotary_into_cache, as the graph had them: a table shorter than the
    head (partial rotary), a per-head norm over heads of 5 pairs (not a power of 2: a tile
    could not hold whole heads), more than 16 rows, a dtype the kernel does not take."""
    if case == "bf16 in the interpreter" and ON_GPU:
        pytest.skip("on a GPU the kernel takes bf16 (test_matches_reference)")
    shape, dtype, extra = (2, 1, 4, 2, 16), torch.float32, {}
    if case == "odd head pairs with the qk norm":
        shape, extra = (2, 1, 4, 2, 10), {"qk_norm": "w"}
    elif case == "17 rows":
        shape = (17, 1, 2, 1, 8)
    elif case == "float64":
        dtype = torch.float64
    elif case == "bf16 in the interpreter":
        dtype = torch.bfloat16
    inputs = _inputs(*shape, dtype, **extra)
    if case == "partial rotary":
        inputs["cos"], inputs["sin"] = inputs["cos"][..., :8], inputs["sin"][..., :8]
    results, ran = _kernel_ran(inputs)
    assert not ran
    _assert_matches(results, inputs)


def test_custom_op_passes_opcheck():
    """The schema's mutations (k_cache, v_cache) and the fake are what the op does."""
    for qk_norm in (None, "w"):
        inputs = _inputs(2, 1, 4, 2, 16, torch.float32, n_in=24, qk_norm=qk_norm)
        opcheck_overloads(OP, tuple(inputs.values()),
                          test_utils=("test_schema", "test_faketensor",
                                      "test_aot_dispatch_dynamic"))


def _bad(inputs, **changed):
    return OP(*{**inputs, **changed}.values())


def test_bad_inputs_name_the_argument():
    inputs = _inputs(2, 1, 4, 2, 16, torch.float32, n_in=24)
    k_cache = inputs["k_cache"]
    with pytest.raises(ValueError, match=r"the weights must have \(Hq \+ 2 Hk\) D = \(3 \+ 2 x "
                                         r"2\) x 16 = 112 rows"):
        _bad(inputs, n_q_heads=3)
    with pytest.raises(ValueError, match=r"n_q_heads must be an int >= 1, got 0"):
        _bad(inputs, n_q_heads=0)
    with pytest.raises(ValueError, match=r"x must have B S = 2 x 1 rows"):
        _bad(inputs, x=inputs["x"][:1])
    with pytest.raises(ValueError, match=r"k_cache must be \(B, Hk, L, D\)"):
        _bad(inputs, k_cache=k_cache[0])
    with pytest.raises(ValueError, match="v_cache must be torch.float32"):
        _bad(inputs, v_cache=inputs["v_cache"].half())
    with pytest.raises(ValueError, match=r"weight must be \(N, K\) with K = x.shape\[1\] = 24"):
        _bad(inputs, weights=[w[:, :20] for w in inputs["weights"]])
    with pytest.raises(ValueError, match="q_weight and k_weight go together"):
        _bad(inputs, q_weight=torch.ones(16, device=DEVICE))
    with pytest.raises(ValueError, match="k_cache shares memory with x"):
        _bad(inputs, x=k_cache.view(-1)[:48].view(2, 24))
    with pytest.raises(ValueError, match="k_cache and v_cache share memory"):
        _bad(inputs, v_cache=k_cache)


_BAD_CACHE_ROW_ON_GPU = r"""
import torch, gemslib
d = dict(device="cuda")
x, weight = torch.randn(2, 32, **d), torch.randn(64, 32, **d)
angles = torch.rand(2, 1, 16, **d)
k_cache, v_cache = torch.zeros(2, 1, 8, 16, **d), torch.zeros(2, 1, 8, 16, **d)
torch.ops.gemslib.decode_gemv_rotary(x, [weight], [None], None, 1e-6, 0.0, angles.cos(),
                                     angles.sin(), False, torch.tensor([ROW], **d), k_cache,
                                     v_cache, 2)
torch.cuda.synchronize()
"""


@pytest.mark.parametrize("row", [9, -1])
def test_a_cache_row_outside_the_cache_is_an_error(row):
    """A cache_position outside [0, L) never writes outside the caches: on the CPU an
    IndexError; on a GPU the kernel's device-side assert (in a subprocess)."""
    if ON_GPU:
        assert_device_side_assert(_BAD_CACHE_ROW_ON_GPU.replace("ROW", str(row)),
                                  "cache_position must be in [0, the cache's length)")
        return
    inputs = _inputs(2, 1, 4, 2, 16, torch.float32, n_in=24)
    before = inputs["k_cache"].clone(), inputs["v_cache"].clone()
    with pytest.raises(IndexError, match=r"cache_position must be in \[0, 9\)"):
        _bad(inputs, cache_position=torch.tensor([row], device=DEVICE))
    assert torch.equal(inputs["k_cache"], before[0]) and torch.equal(inputs["v_cache"], before[1])
