"""rms_norm_swiglu against float64 references: values, gradients, layouts, errors."""

import pytest
import torch

import gemslib
from helpers import ON_GPU, random_tensor, opcheck_overloads
from gemslib import runtime
from gemslib.runtime import env
from gemslib.fused import rms_norm_swiglu as swiglu_ops

# interpreter: fp16/fp32 (bf16 tl.dot is wrong there); GPU: bf16 too
DOT_DTYPES = [torch.float16, torch.bfloat16, torch.float32] if ON_GPU else [torch.float16, torch.float32]
_UNIT_ROUNDOFF = {torch.float16: 2.0 ** -11, torch.bfloat16: 2.0 ** -8, torch.float32: 2.0 ** -24}

# (x shape, I): one row (decode), odd sizes, several row tiles of both buckets, 3-d and 1-d x
CASES = [((1, 64), 48), ((5, 48), 24), ((40, 100), 70), ((130, 64), 130), ((2, 3, 40), 33),
         ((64,), 20)]
if ON_GPU:
    CASES += [((16, 4096), 14336), ((4096, 3584), 18944), ((300, 1000), 777), ((1, 4096), 11008)]
# on sm_90 16-bit inputs with >= 128 rows take the pre-pass + the Gluon matmul's SwiGLU form
HOPPER = ON_GPU and torch.cuda.get_device_capability() == (9, 0)


def _inputs(x_shape, n_out, dtype):
    n_in = x_shape[-1]
    x = random_tensor(x_shape, dtype, scale=1.0)
    norm_weight = random_tensor((n_in,), dtype, scale=1.0)
    gate_up_weight = random_tensor((2 * n_out, n_in), dtype, scale=max(n_in, 1) ** -0.5)
    return x, norm_weight, gate_up_weight


def _assert_close(actual, x, norm_weight, gate_up_weight, eps=1e-6):
    x64 = x.double()
    normed = x64 * torch.rsqrt(x64.pow(2).mean(-1, keepdim=True) + eps) * norm_weight.double()
    _assert_swiglu_close(actual, normed, gate_up_weight, x.dtype)


def _assert_swiglu_close(actual, normed, gate_up_weight, dtype, gelu=None):
    """silu(n @ Wg.T) * (n @ Wu.T) for n = ``normed`` (float64), within the rounding the fused
    form makes: x * g rounded to the input dtype, fp32 sums over K, the output rounded once.
    Each projection's error is bounded as a dot product's (by the sums of absolute values,
    B_G and B_U); the product silu(G) U then errs by at most 1.1 e_G |U| + |G| e_U + e_G e_U
    (|silu'| <= 1.1, |silu(G)| <= |G|). ``gelu`` ("tanh" or "none"): gelu(G) U instead, as
    F.gelu's form (|gelu'| <= 1.13 in both, |gelu(G)| <= |G|)."""
    w64 = gate_up_weight.double()
    expected = swiglu_ops.linear_swiglu_reference(normed, w64) if gelu is None else \
        swiglu_ops.linear_geglu_reference(normed, w64, gelu)
    gate, up = torch.nn.functional.linear(normed, w64).chunk(2, dim=-1)
    bound_gate, bound_up = (normed.abs() @ w64.abs().t()).chunk(2, dim=-1)
    u = _UNIT_ROUNDOFF[dtype]
    relative = 2 * u + normed.shape[-1] * 2.0 ** -24
    error_gate, error_up = relative * bound_gate, relative * bound_up
    slope = 1.1 if gelu is None else 1.13
    tolerance = slope * error_gate * up.abs() + gate.abs() * error_up + error_gate * error_up \
        + u * expected.abs() + 1e-30
    error = (actual.double() - expected).abs()
    assert actual.shape == expected.shape and actual.dtype == dtype
    assert bool((error <= tolerance).all()), \
        f"max error {error.max().item():.3g}, worst error / tolerance {(error / tolerance).max().item():.3g}"


@pytest.mark.parametrize("dtype", DOT_DTYPES)
@pytest.mark.parametrize("x_shape,n_out", CASES)
def test_matches_reference(x_shape, n_out, dtype):
    inputs = _inputs(x_shape, n_out, dtype)
    _assert_close(gemslib.rms_norm_swiglu(*inputs), *inputs)


def test_a_pair_of_weights_is_the_stacked_weight():
    x, norm_weight, gate_up_weight = _inputs((7, 40), 30, torch.float32)
    gate, up = gate_up_weight.chunk(2)
    torch.testing.assert_close(gemslib.rms_norm_swiglu(x, norm_weight, (gate, up)),
                               gemslib.rms_norm_swiglu(x, norm_weight, gate_up_weight),
                               rtol=0, atol=0)


def test_a_pair_that_lies_end_to_end_is_read_in_place_unless_grad_is_wanted(monkeypatch):
    """Rows of one merged weight: no copy; under autograd (a view across both would give the
    second no gradient) and for tensors apart: stacked, with both gradients."""
    x, norm_weight, gate_up_weight = _inputs((7, 40), 30, torch.float32)
    stacks = []
    cat = torch.cat
    monkeypatch.setattr(torch, "cat", lambda tensors, *a, **k: stacks.append(1) or cat(tensors, *a, **k))
    expected = gemslib.rms_norm_swiglu(x, norm_weight, gate_up_weight)
    assert torch.equal(gemslib.rms_norm_swiglu(x, norm_weight, tuple(gate_up_weight.chunk(2))),
                       expected) and stacks == []
    apart = tuple(w.clone() for w in gate_up_weight.chunk(2))
    assert torch.equal(gemslib.rms_norm_swiglu(x, norm_weight, apart), expected)
    assert stacks == [1]
    # two parameters on rows of one buffer, as merged_linear leaves a model's
    buffer = gate_up_weight.clone()
    gate, up = torch.nn.Parameter(torch.empty(0)), torch.nn.Parameter(torch.empty(0))
    gate.data, up.data = buffer[:30], buffer[30:]
    out = gemslib.rms_norm_swiglu(x, norm_weight, (gate, up))
    assert stacks == [1, 1]  # (the backward's own arithmetic concatenates too)
    out.sum().backward()
    stacked = gate_up_weight.clone().requires_grad_()
    gemslib.rms_norm_swiglu(x, norm_weight, stacked).sum().backward()
    torch.testing.assert_close(torch.cat([gate.grad, up.grad]), stacked.grad)


@pytest.mark.parametrize("rows", [3, 100], ids=["decode-bucket", "matmul-bucket"])
def test_strided_inputs(rows):
    """x as a transposed view, the weight with a non-unit last stride (copied), a strided
    norm weight."""
    x = random_tensor((48, rows), torch.float32).t()
    norm_weight = random_tensor((96,), torch.float32)[::2]
    weight = random_tensor((40, 96), torch.float32, scale=0.2)[:, ::2]
    _assert_close(gemslib.rms_norm_swiglu(x, norm_weight, weight, eps=1e-5), x, norm_weight,
                  weight, eps=1e-5)


def test_group_order_covers_every_tile():
    """Small tiles and groups of 3 row tiles over 7 row tiles and 5 column tiles: a partial
    last group, and each output tile written exactly once."""
    inputs = _inputs((100, 32), 70, torch.float32)
    config = runtime.LaunchConfig((("BLOCK_M", 16), ("BLOCK_N", 16), ("BLOCK_K", 16),
                                   ("GROUP_M", 3), ("SPLIT_K", 1), ("VENDOR_GEMM", 0)), 4, 1)
    with swiglu_ops.RMS_NORM_SWIGLU.forced(config):
        _assert_close(gemslib.rms_norm_swiglu(*inputs), *inputs)


@pytest.mark.parametrize("split", [2, 3, 8])
@pytest.mark.parametrize("normalize", [True, False], ids=["rms_norm_swiglu", "linear_swiglu"])
def test_split_k_sums_every_split_and_resets_its_counters(split, normalize):
    """K split over programs (decode): uneven last splits (K 100 in 16-wide steps), more splits
    than K steps allow (8: fewer are launched), several row and column tiles; twice in a row,
    so the arrival counters the last program resets are reused."""
    config = runtime.LaunchConfig((("BLOCK_M", 16), ("BLOCK_N", 16), ("BLOCK_K", 16),
                                   ("GROUP_M", 1), ("SPLIT_K", split), ("VENDOR_GEMM", 0)), 4, 1)
    for rows in (5, 40, 5):
        x, norm_weight, weight = _inputs((rows, 100), 37, torch.float32)
        with swiglu_ops.RMS_NORM_SWIGLU.forced(config) as shapes:
            if normalize:
                _assert_close(gemslib.rms_norm_swiglu(x, norm_weight, weight), x, norm_weight,
                              weight)
            else:
                _assert_swiglu_close(torch.ops.gemslib.linear_swiglu(x, list(weight.chunk(2))),
                                     x.double(), weight, torch.float32)
        assert shapes == [(rows, 37, 100, 4)]


@pytest.mark.parametrize("dtype", DOT_DTYPES)
@pytest.mark.parametrize("normalize", [True, False], ids=["rms_norm_swiglu", "linear_swiglu"])
def test_a_vendor_gemm_config_runs_norm_matmul_and_silu_and_mul(dtype, normalize, monkeypatch):
    """VENDOR_GEMM 1: gemslib's rms_norm (none for linear_swiglu), torch's matmul of the whole
    [gate | up] weight, gemslib's silu_and_mul into the output; the fused kernel not launched.
    Within the fused form's bound: the projections' extra rounding is below it."""
    config = runtime.LaunchConfig((("BLOCK_M", 16), ("BLOCK_N", 16), ("BLOCK_K", 16),
                                   ("GROUP_M", 1), ("SPLIT_K", 1), ("VENDOR_GEMM", 1)), 4, 1)
    x, norm_weight, weight = _inputs((2, 9, 40), 37, dtype)
    matmuls = []
    linear = torch.nn.functional.linear
    monkeypatch.setattr(torch.nn.functional, "linear",
                        lambda *args: matmuls.append(args[1].shape) or linear(*args))
    monkeypatch.setattr(swiglu_ops.RMS_NORM_SWIGLU, "launch",
                        lambda *args, **kwargs: pytest.fail("the fused kernel was launched"))
    with swiglu_ops.RMS_NORM_SWIGLU.forced(config) as shapes:
        out = gemslib.rms_norm_swiglu(x, norm_weight, weight) if normalize else \
            torch.ops.gemslib.linear_swiglu(x, list(weight.chunk(2)))
    assert shapes == [(18, 37, 40, x.element_size())] and matmuls == [(74, 40)]
    if normalize:
        _assert_close(out, x, norm_weight, weight)
    else:
        _assert_swiglu_close(out, x.double(), weight, dtype)


def test_a_signature_decided_for_three_kernels_goes_straight_to_them(monkeypatch):
    """Where call plans apply (off the interpreter), the first call of a signature whose
    config says VENDOR_GEMM is checked and decided, and the next calls of that signature go
    to the three kernels with their own tensors, unchecked; a call that autograd must see
    has no key, so it is never routed so."""
    monkeypatch.setattr(runtime, "INTERPRETER", False)
    monkeypatch.setattr(env, "INTERPRETER", False)  # what the call plans read
    monkeypatch.setattr(runtime, "dot_kernel_runs", lambda x: True)
    monkeypatch.setattr(swiglu_ops, "_takes_three_kernels", lambda x, w: True)
    checked, routed = [], []
    check = swiglu_ops._check
    monkeypatch.setattr(swiglu_ops, "_check", lambda *args: checked.append(1) or check(*args))
    monkeypatch.setattr(swiglu_ops, "_three_kernels", lambda *args: routed.append(args) or args[0])
    try:
        inputs = [_inputs((3, 40), 8, torch.float16) for _ in range(3)]
        outs = [gemslib.rms_norm_swiglu(*args, eps=1e-5) for args in inputs]
        assert len(checked) == 1 and [out is args[0] for out, args in zip(outs, inputs)] == [True] * 3
        assert [len(args) for args in routed] == [4, 5, 5] and routed[2][3] == 1e-5
        gemslib.rms_norm_swiglu(*inputs[0])  # eps 1e-6: another signature
        assert len(checked) == 2 and routed[-1][3] == 1e-6
        x, norm_weight, weight = inputs[0]
        assert swiglu_ops._CALLS.signature(x.requires_grad_(), norm_weight, weight, 1e-5,
                                           True) is None
    finally:
        swiglu_ops._CALLS.clear()


@pytest.mark.parametrize("rows", [1, 5, 130])
def test_repeated_calls_of_one_signature_stay_right(rows):
    """Fresh inputs of one signature again and again (on a GPU the later calls replay: the
    split-K kernel's launch plan at decode rows, the three kernels' route at prefill rows)
    give each input's own result."""
    for _ in range(4):
        x, norm_weight, weight = _inputs((rows, 256), 40, torch.float16)
        _assert_close(gemslib.rms_norm_swiglu(x, norm_weight, weight), x, norm_weight, weight)


@pytest.mark.parametrize("dtype", DOT_DTYPES)
def test_the_three_kernel_form_computes_rms_norm_swiglu(dtype):
    x, norm_weight, weight = _inputs((2, 9, 40), 37, dtype)
    out = swiglu_ops._three_kernels(x, norm_weight, weight, 1e-6, True)
    assert out.shape == (2, 9, 37) and out.is_contiguous()
    _assert_close(out, x, norm_weight, weight)


def test_the_decision_follows_the_config():
    x, _, weight = _inputs((5, 40), 8, torch.float16)
    for vendor in (0, 1):
        config = runtime.LaunchConfig((("BLOCK_M", 16), ("BLOCK_N", 16), ("BLOCK_K", 16),
                                       ("GROUP_M", 1), ("SPLIT_K", 1), ("VENDOR_GEMM", vendor)),
                                      4, 1)
        with swiglu_ops.RMS_NORM_SWIGLU.forced(config) as shapes:
            assert swiglu_ops._takes_three_kernels(x, weight) is bool(vendor)
        assert shapes == [(5, 8, 40, 2)]
    assert not swiglu_ops._takes_three_kernels(x[:0], weight)


def test_a_recorded_workload_holds_calls_that_run_as_three_kernels():
    """gemslib.tune --model tunes the buckets a forward's calls reach: a call its config
    sends to cuBLAS launches no rms_norm_swiglu kernel, and is recorded all the same."""
    config = runtime.LaunchConfig((("BLOCK_M", 16), ("BLOCK_N", 16), ("BLOCK_K", 16),
                                   ("GROUP_M", 1), ("SPLIT_K", 1), ("VENDOR_GEMM", 1)), 4, 1)
    x, norm_weight, weight = _inputs((5, 40), 8, torch.float16)
    with runtime.recording_calls() as calls, swiglu_ops.RMS_NORM_SWIGLU.forced(config):
        torch.ops.gemslib.rms_norm_swiglu(x, norm_weight, weight, 1e-6)
    assert ("rms_norm_swiglu.rms_norm_swiglu", (5, 8, 40, 2)) in calls


def test_the_hopper_path_wants_enough_tiles_to_fill_the_gpu():
    """128 x 256 tiles of (rows, weight rows), at least MIN_WAVES per SM: 4 x 132 on an
    H200."""
    hopper = swiglu_ops._rms_norm_linear_silu_hopper
    assert hopper.tiles(128, 256) == 1 and hopper.tiles(129, 257) == 4
    assert hopper.tiles(4096, 2 * 14336) == 32 * 112
    waves = hopper.MIN_WAVES * 132
    assert hopper.fills_the_gpu(4096, 2 * 14336, 132)  # Llama-3-8B's MLP at 4096 tokens
    assert not hopper.fills_the_gpu(128, 2 * 2752, 132)  # a quarter of Llama-2-7B's, 128 rows
    rows = 128 * waves // 4  # 4 column tiles: the bar exactly, and a tile short of it
    assert hopper.fills_the_gpu(rows, 4 * 256, 132)
    assert not hopper.fills_the_gpu(rows - 128, 4 * 256, 132)


HOPPER_CASES = [((300, 256), 520, False), ((2, 150, 200), 300, False),
                ((4000, 1024), 2000, True), ((128, 64), 256, False)] if HOPPER else \
    [((130, 64), 40, True)]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16] if ON_GPU else [torch.float16])
@pytest.mark.parametrize("x_shape,n_out,view", HOPPER_CASES)
def test_hopper_path_takes_16_bit_row_blocks_and_matches_reference(x_shape, n_out, view, dtype,
                                                                   monkeypatch):
    """On sm_90 each such call runs the pre-pass and the SwiGLU matmul (counted; the products
    made small enough to test by asking for no waves of tiles): ragged row and column tiles
    (I not a multiple of the 128-column tile: the last gate block reads up rows into masked
    columns), 3-d x, x rows with a stride; elsewhere the Triton kernel."""
    monkeypatch.setattr(swiglu_ops._rms_norm_linear_silu_hopper, "MIN_WAVES", 0)
    x, norm_weight, weight = _inputs(x_shape, n_out, dtype)
    if view:  # rows of a wider tensor: the pre-pass reads them in place
        x = random_tensor((*x_shape[:-1], x_shape[-1] + 24), dtype, scale=1.0)[..., :x_shape[-1]]
    calls = []
    hopper_forward = swiglu_ops._rms_norm_linear_silu_hopper.forward_gated
    monkeypatch.setattr(swiglu_ops._rms_norm_linear_silu_hopper, "forward_gated",
                        lambda *args, **kwargs: calls.append(args) or hopper_forward(*args, **kwargs))
    out = gemslib.rms_norm_swiglu(x, norm_weight, weight)
    assert len(calls) == int(HOPPER)
    _assert_close(out, x, norm_weight, weight)


def test_empty_and_zero_width_inputs():
    x, norm_weight, weight = _inputs((0, 16), 8, torch.float32)
    assert gemslib.rms_norm_swiglu(x, norm_weight, weight).shape == (0, 8)
    x, norm_weight, weight = _inputs((3, 0), 5, torch.float32)
    torch.testing.assert_close(gemslib.rms_norm_swiglu(x, norm_weight, weight), torch.zeros(
        3, 5, device=x.device))


def test_float64_is_computed_by_torch():
    inputs = _inputs((4, 24), 10, torch.float64)
    torch.testing.assert_close(gemslib.rms_norm_swiglu(*inputs),
                               swiglu_ops.rms_norm_swiglu_reference(*inputs))


def test_gradients_match_autograd_of_the_reference():
    leaves = [t.detach().requires_grad_() for t in _inputs((2, 5, 24), 18, torch.float32)]
    ours = gemslib.rms_norm_swiglu(*leaves)
    grad = random_tensor(ours.shape, torch.float32)
    ours_grads = torch.autograd.grad(ours, leaves, grad)
    leaves64 = [t.detach().double().requires_grad_() for t in leaves]
    expected_grads = torch.autograd.grad(swiglu_ops.rms_norm_swiglu_reference(*leaves64),
                                         leaves64, grad.double())
    for name, a, b in zip(("x", "norm_weight", "gate_up_weight"), ours_grads, expected_grads):
        torch.testing.assert_close(a.double(), b, rtol=1e-4, atol=1e-5, msg=lambda m: f"{name}: {m}")


def test_backward_is_exact_in_float64():
    """float64 runs torch's forward and this file's hand-written backward: gradcheck and
    gradgradcheck compare it with finite differences."""
    inputs = [t.requires_grad_() for t in _inputs((3, 6), 4, torch.float64)]
    assert torch.autograd.gradcheck(gemslib.rms_norm_swiglu, inputs)
    assert torch.autograd.gradgradcheck(gemslib.rms_norm_swiglu, inputs)


def test_custom_op_passes_opcheck():
    x, norm_weight, weight = _inputs((3, 16), 8, torch.float32)
    opcheck_overloads(torch.ops.gemslib.rms_norm_swiglu, (x, norm_weight, weight, 1e-6))


def test_traces_under_torch_compile_fullgraph():
    inputs = _inputs((4, 32), 16, torch.float32)

    def block(x, norm_weight, weight):
        return gemslib.rms_norm_swiglu(x, norm_weight, weight) * 2

    compiled = torch.compile(block, fullgraph=True, backend="inductor" if ON_GPU else "aot_eager")
    leaves = [t.detach().requires_grad_() for t in inputs]
    out = compiled(*leaves)
    torch.testing.assert_close(out, block(*inputs))
    compiled_grads = torch.autograd.grad(out.sum(), leaves)
    eager_leaves = [t.detach().requires_grad_() for t in leaves]
    eager_grads = torch.autograd.grad(block(*eager_leaves).sum(), eager_leaves)
    for ours, eager in zip(compiled_grads, eager_grads):
        torch.testing.assert_close(ours, eager)


@pytest.mark.parametrize("args,error,match", [
    (lambda x, g, w: (x, g, w[:, :-1]), ValueError, r"gate_up_weight must be \(2I, K\) with K = "),
    (lambda x, g, w: (x, g, w[:-1]), ValueError, r"gate_up_weight must be \(2I, K\)"),
    (lambda x, g, w: (x, g[:-1], w), ValueError, "norm_weight must be"),
    (lambda x, g, w: (x, g, w.double()), ValueError, "gate_up_weight must be torch.float32"),
    (lambda x, g, w: (x, g, "w"), TypeError, "gate_up_weight must be a torch.Tensor"),
    (lambda x, g, w: (x, g, (w, w, w)), TypeError, "a pair"),
    (lambda x, g, w: (x, g, (w, w[:-1])), ValueError, "one shape"),
    (lambda x, g, w: (x.to(torch.int32), g, w), TypeError, "x must be floating-point"),
    (lambda x, g, w: (x[0, 0], g, w), ValueError, "x must be"),
])
def test_bad_inputs_name_the_argument(args, error, match):
    inputs = _inputs((3, 8), 4, torch.float32)
    with pytest.raises(error, match=match):
        gemslib.rms_norm_swiglu(*args(*inputs))


def test_bf16_is_right_everywhere():
    """bf16 runs the kernel on a GPU; under the interpreter (whose bf16 tl.dot is wrong) torch
    computes it, never a silently wrong kernel result."""
    inputs = _inputs((5, 48), 24, torch.bfloat16)
    _assert_close(gemslib.rms_norm_swiglu(*inputs), *inputs)


@pytest.mark.parametrize("eps", ["1e-6", None, torch.ones(2)])
def test_eps_must_be_a_float_as_torch_requires(eps):
    with pytest.raises(TypeError, match="argument 'eps' must be float"):
        gemslib.rms_norm_swiglu(*_inputs((3, 8), 4, torch.float32), eps=eps)


# --------------------------------------------------------------------------------------------
# linear_swiglu: the graph's form (the projections of x itself)
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DOT_DTYPES)
@pytest.mark.parametrize("x_shape,n_out", [((1, 64), 48), ((40, 100), 70), ((130, 64), 130)]
                         + ([((4096, 3584), 18944), ((300, 1000), 777)] if ON_GPU else []))
@pytest.mark.parametrize("merged", [True, False], ids=["end-to-end", "apart"])
def test_linear_swiglu_matches_reference(x_shape, n_out, dtype, merged, monkeypatch):
    """Weights that lie end to end are read in place (the merged parameters), others copied;
    on sm_90, 16-bit inputs of 128 or more rows take the Gluon matmul without its pre-pass
    (counted)."""
    x, _, gate_up_weight = _inputs(x_shape, n_out, dtype)
    weights = list(gate_up_weight.chunk(2)) if merged else \
        [w.clone() for w in gate_up_weight.chunk(2)]
    normalized = []
    hopper_forward = swiglu_ops._rms_norm_linear_silu_hopper.forward_gated
    monkeypatch.setattr(swiglu_ops._rms_norm_linear_silu_hopper, "forward_gated",
                        lambda *args, normalize, **kwargs: normalized.append(normalize) or
                        hopper_forward(*args, normalize=normalize, **kwargs))
    out = torch.ops.gemslib.linear_swiglu(x, weights)
    _assert_swiglu_close(out, x.double(), gate_up_weight, dtype)
    hopper = HOPPER and dtype != torch.float32 and x_shape[0] >= 128 and \
        swiglu_ops._rms_norm_linear_silu_hopper.fills_the_gpu(
            x_shape[0], 2 * n_out, runtime.multiprocessor_count(x.get_device()))
    assert normalized == ([False] if hopper else [])


def test_linear_swiglu_takes_strided_rows():
    x = random_tensor((130, 96), torch.float16, scale=1.0)[:, :64]
    _, _, weight = _inputs((130, 64), 40, torch.float16)
    _assert_swiglu_close(torch.ops.gemslib.linear_swiglu(x, list(weight.chunk(2))), x.double(),
                         weight, torch.float16)


def test_linear_swiglu_passes_opcheck():
    x, _, weight = _inputs((3, 16), 8, torch.float32)
    opcheck_overloads(torch.ops.gemslib.linear_swiglu, (x, list(weight.chunk(2))))


# --------------------------------------------------------------------------------------------
# linear_geglu: the same GEMM with gelu(gate) * up in its epilogue (Gemma's MLP)
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DOT_DTYPES)
@pytest.mark.parametrize("x_shape,n_out", [((1, 64), 48), ((2, 20, 100), 70), ((130, 64), 130)]
                         + ([((2048, 3072), 24576), ((300, 1000), 777)] if ON_GPU else []))
@pytest.mark.parametrize("approximate", ["tanh", "none"])
def test_linear_geglu_matches_reference(x_shape, n_out, dtype, approximate, monkeypatch):
    """Both of F.gelu's forms in the epilogue, against float64; on sm_90, 16-bit inputs of 128
    or more rows that fill the GPU take the Gluon matmul with that activation (counted: a
    Gemma-7B MLP at 2048 tokens does), the rest the Triton kernel with it."""
    x, _, gate_up_weight = _inputs(x_shape, n_out, dtype)
    x = x * 2  # gates out to +-6 and beyond: both of gelu's tails, where the forms differ most
    activations = []
    hopper_forward = swiglu_ops._rms_norm_linear_silu_hopper.forward_gated
    monkeypatch.setattr(swiglu_ops._rms_norm_linear_silu_hopper, "forward_gated",
                        lambda *args, activation, **kwargs: activations.append(activation) or
                        hopper_forward(*args, activation=activation, **kwargs))
    out = torch.ops.gemslib.linear_geglu(x, list(gate_up_weight.chunk(2)), approximate == "tanh")
    _assert_swiglu_close(out, x.double(), gate_up_weight, dtype, gelu=approximate)
    rows = out.numel() // n_out
    hopper = HOPPER and dtype != torch.float32 and rows >= 128 and \
        swiglu_ops._rms_norm_linear_silu_hopper.fills_the_gpu(
            rows, 2 * n_out, runtime.multiprocessor_count(x.get_device()))
    expected = swiglu_ops.GELU_TANH if approximate == "tanh" else swiglu_ops.GELU_ERF
    assert activations == ([expected] if hopper else [])


def test_linear_geglu_forms_differ_and_each_is_its_own():
    """The tanh and erf forms are told apart: each output matches its own reference far more
    closely than the other form's (which differ by ~1e-3 of the gate's scale)."""
    x, _, weight = _inputs((40, 64), 48, torch.float32)
    x = x * 3
    tanh = torch.ops.gemslib.linear_geglu(x, list(weight.chunk(2)), True).double()
    erf = torch.ops.gemslib.linear_geglu(x, list(weight.chunk(2)), False).double()
    ref_tanh, ref_erf = (swiglu_ops.linear_geglu_reference(x.double(), weight.double(), form)
                         for form in ("tanh", "none"))
    gap = (ref_tanh - ref_erf).abs().max()
    assert gap > 1e-4
    assert (tanh - ref_tanh).abs().max() < gap / 20 and (erf - ref_erf).abs().max() < gap / 20


def test_linear_geglu_passes_opcheck():
    x, _, weight = _inputs((3, 16), 8, torch.float32)
    for tanh in (True, False):
        opcheck_overloads(torch.ops.gemslib.linear_geglu, (x, list(weight.chunk(2)), tanh))
