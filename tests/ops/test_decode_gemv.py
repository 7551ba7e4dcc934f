"""decode_gemv against float64 references: every prologue and epilogue, both product forms,
split K, the torch path past 16 rows, layouts, gradients, errors, the custom op."""

import pytest
import torch

import gemslib
from helpers import ON_GPU, opcheck_overloads, random_tensor
from gemslib import runtime
from gemslib.fused import decode_gemv as gemv_ops
from gemslib.runtime import cuda, env

# interpreter: fp16/fp32 (bf16 tl.dot is wrong there); GPU: bf16 too
DOT_DTYPES = [torch.float16, torch.bfloat16, torch.float32] if ON_GPU else [torch.float16, torch.float32]
_UNIT_ROUNDOFF = {torch.float16: 2.0 ** -11, torch.bfloat16: 2.0 ** -8, torch.float32: 2.0 ** -24,
                  torch.float64: 2.0 ** -53}
# "norm+1": Gemma's (1 + g), weight_offset 1
PROLOGUES = ["none", "norm", "norm+1", "silu", "gelu_tanh", "gelu_erf"]
EPILOGUES = ["none", "bias", "residual", "bias+residual"]
# N and K not multiples of any block: 200 = 3 x 64 + 8, 72 = 2 x 32 + 8 (4 x 16 + 8)
N_OUT, N_IN = 200, 72


def _config(block_n=64, block_k=32, split_k=1, gemv=1, stream_k=0):
    return runtime.LaunchConfig((("BLOCK_K", block_k), ("BLOCK_N", block_n), ("GEMV", gemv),
                                 ("SPLIT_K", split_k), ("STREAM_K", stream_k)), 4, 1)


def _inputs(rows, dtype, prologue="none", epilogue="bias+residual", n_out=N_OUT, n_in=N_IN):
    """decode_gemv's keyword arguments: fresh random x (rows, K) or (rows, 2K) = [gate | up],
    W (N, K) scaled as a projection's, and what the prologue and epilogue take."""
    gated = prologue if prologue in ("silu", "gelu_tanh", "gelu_erf") else None
    norm = prologue.startswith("norm")
    return dict(
        x=random_tensor((rows, 2 * n_in if gated else n_in), dtype, scale=1.0),
        weight=random_tensor((n_out, n_in), dtype, scale=max(n_in, 1) ** -0.5),
        bias=random_tensor((n_out,), dtype, scale=1.0) if "bias" in epilogue else None,
        residual=random_tensor((rows, n_out), dtype, scale=1.0) if "residual" in epilogue
        else None,
        norm_weight=random_tensor((n_in,), dtype, scale=1.0) if norm else None,
        weight_offset=1.0 if prologue == "norm+1" else 0.0, gated=gated)


def _call(inputs, **extra):
    inputs = {**inputs, **extra}
    return gemslib.decode_gemv(inputs.pop("x"), inputs.pop("weight"), inputs.pop("bias"),
                               **inputs)


def _reference_terms(inputs, eps=1e-6):
    """(the float64 reference, the sums of absolute values its outputs combine)."""
    wide = {name: t.double() if isinstance(t, torch.Tensor) else t for name, t in inputs.items()}
    expected = gemv_ops.decode_gemv_reference(**wide, eps=eps)
    activations = gemv_ops._prologue(wide["x"], wide["norm_weight"], eps, wide["weight_offset"],
                                     wide["gated"])
    bound = activations.abs() @ wide["weight"].abs().t()
    for addend in (wide["bias"], wide["residual"]):
        if addend is not None:
            bound = bound + addend.abs()
    return expected, bound


def _assert_close(actual, inputs, eps=1e-6):
    """Within the rounding the operator makes: the prologue rounded to the input dtype (one
    unit roundoff u per product), one more rounding of the products' sum on the torch path,
    fp32 arithmetic over K and the few fp32 steps of the prologue and epilogue, the output
    rounded once; bounded by the sums of absolute values (a dot product's error bound)."""
    dtype = inputs["x"].dtype
    expected, bound = _reference_terms(inputs, eps)
    u = _UNIT_ROUNDOFF[dtype]
    n_in = inputs["weight"].shape[1]
    tolerance = (2 * u + (n_in + 4) * 2.0 ** -24) * bound + u * expected.abs() + 1e-30
    error = (actual.double() - expected).abs()
    assert actual.shape == expected.shape and actual.dtype == dtype and actual.is_contiguous()
    assert bool((error <= tolerance).all()), \
        f"max error {error.max().item():.3g}, worst error / tolerance {(error / tolerance).max().item():.3g}"


@pytest.fixture
def poisoned_outputs(monkeypatch):
    """Every float tensor torch.empty makes (the output, the split partials) starts as NaN,
    so an element the kernel does not write shows."""
    empty = torch.empty

    def nan_empty(*args, **kwargs):
        made = empty(*args, **kwargs)
        return made.fill_(float("nan")) if made.is_floating_point() else made
    monkeypatch.setattr(torch, "empty", nan_empty)


@pytest.mark.parametrize("dtype", DOT_DTYPES)
@pytest.mark.parametrize("rows", [1, 3, 16])
@pytest.mark.parametrize("epilogue", EPILOGUES)
@pytest.mark.parametrize("prologue", PROLOGUES)
def test_matches_reference(prologue, epilogue, rows, dtype, poisoned_outputs):
    """Every prologue and epilogue at one row (multiply-and-sum), 3 and 16 rows (tl.dot),
    with ragged last column tile and K step."""
    inputs = _inputs(rows, dtype, prologue, epilogue)
    with gemv_ops.DECODE_GEMV.forced(_config()) as shapes:
        out = _call(inputs)
    assert shapes == [(rows, N_OUT, N_IN, inputs["x"].element_size())]  # the kernel ran
    _assert_close(out, inputs)


@pytest.mark.parametrize("dtype", DOT_DTYPES)
@pytest.mark.parametrize("prologue", PROLOGUES)
def test_one_row_through_the_dot_tile(prologue, dtype, poisoned_outputs):
    """GEMV 0: one row takes the 16-row tl.dot tile (15 rows masked) instead of the
    multiply-and-sum products, and gives the same within rounding."""
    inputs = _inputs(1, dtype, prologue)
    with gemv_ops.DECODE_GEMV.forced(_config(gemv=0)):
        out = _call(inputs)
    _assert_close(out, inputs)


@pytest.mark.parametrize("dtype", DOT_DTYPES)
@pytest.mark.parametrize("sharing", [{}, {"split_k": 3}, {"stream_k": 4}])
@pytest.mark.parametrize("prologue", PROLOGUES)
def test_one_row_summed_after_the_loop(prologue, sharing, dtype, poisoned_outputs):
    """GEMV 2: one row's products added up in a (BLOCK_N, BLOCK_K) tile and summed over K
    once after the loop, alone, with K split and with stream-K shares (a share's tile is
    summed after its own K steps): the same within rounding as the reference; a tile of 4
    rows, the narrowest the tuner tries."""
    inputs = _inputs(1, dtype, prologue)
    config = _config(block_n=4, block_k=16, gemv=gemv_ops.SUM_AT_END_GEMV, **sharing)
    with gemv_ops.DECODE_GEMV.forced(config) as shapes:
        out = _call(inputs)
    assert shapes == [(1, N_OUT, N_IN, inputs["x"].element_size())]  # the kernel ran
    _assert_close(out, inputs)


# how the K steps are shared: split in whole 16-wide steps (72 -> 32 + 32 + 8; asked in 8 ->
# 5 splits of 16, the last 8), or STREAM_K programs (the interpreter's one "SM" x STREAM_K)
# sharing the 7 column tiles x 5 K steps equally: one takes all; 4 cut tiles between two
# programs; 7 take a whole tile each; 64 (more than the 35 iterations) one iteration each,
# five contributors a tile
_SHARINGS = {"3-splits": {"split_k": 3}, "fewer-splits-than-asked": {"split_k": 8},
             "stream-K-1": {"stream_k": 1}, "stream-K-4": {"stream_k": 4},
             "stream-K-7": {"stream_k": 7}, "stream-K-64": {"stream_k": 64}}


@pytest.mark.parametrize("dtype", DOT_DTYPES)
@pytest.mark.parametrize("rows", [1, 3, 16])
@pytest.mark.parametrize("prologue", ["none", "norm+1", "silu"])
@pytest.mark.parametrize("sharing", list(_SHARINGS))
def test_shared_k_sums_every_part_and_resets_its_counters(sharing, prologue, rows, dtype,
                                                          poisoned_outputs):
    """K shared between programs (``_SHARINGS``): the partials of a column tile added by the
    last of its programs to arrive, which then runs the epilogue. Two calls give the same
    bits (the parts are added in order, whatever the arrival order), and every arrival
    counter is back at 0 after each."""
    inputs = _inputs(rows, dtype, prologue)
    with gemv_ops.DECODE_GEMV.forced(_config(block_n=32, block_k=16, **_SHARINGS[sharing])):
        first = _call(inputs)
        plain = _call(inputs, bias=None, residual=None)  # the same scratch, no epilogue
        again = _call(inputs)
    _assert_close(first, inputs)
    _assert_close(plain, {**inputs, "bias": None, "residual": None})
    assert torch.equal(first, again)
    for counters, _ in cuda._split_scratch_cache.values():
        assert not counters.any()


@pytest.mark.parametrize("dtype", DOT_DTYPES)
@pytest.mark.parametrize("rows,n_out,n_in", [(1, 200, 600), (1, 2100, 40), (5, 200, 600),
                                             (16, 70, 300)])
def test_the_shipped_configs_match_reference(rows, n_out, n_in, dtype):
    """The configs the default file gives (one row, more rows, fp32), K split where it has
    splits (600 over 4 -> 3 splits of 256 at 16 bits), with the norm and with the gate."""
    for prologue in ("norm", "gelu_tanh"):
        inputs = _inputs(rows, dtype, prologue, n_out=n_out, n_in=n_in)
        _assert_close(_call(inputs), inputs)


@pytest.mark.parametrize("dtype", DOT_DTYPES)
@pytest.mark.parametrize("rows", [17, 40])
@pytest.mark.parametrize("prologue", ["none", "norm+1", "gelu_erf"])
def test_more_than_16_rows_are_computed_by_torch(prologue, rows, dtype, monkeypatch):
    """Past a decode step's rows: the prologue, torch.matmul and the epilogue in torch (the
    kernel not launched), within the same bound."""
    monkeypatch.setattr(gemv_ops.DECODE_GEMV, "launch",
                        lambda *args, **kwargs: pytest.fail("the kernel was launched"))
    inputs = _inputs(rows, dtype, prologue)
    _assert_close(_call(inputs), inputs)


def test_a_signature_of_more_than_16_rows_goes_straight_to_torch(monkeypatch):
    """Where call plans apply (off the interpreter), the first call of a signature past 16 rows
    is checked and decided, and the next calls of that signature go to the torch path with
    their own tensors, unchecked."""
    monkeypatch.setattr(runtime, "INTERPRETER", False)
    monkeypatch.setattr(env, "INTERPRETER", False)  # what the call plans read
    checked, routed = [], []
    check, torch_forward = gemv_ops._check, gemv_ops._torch_forward
    monkeypatch.setattr(gemv_ops, "_check", lambda *args: checked.append(1) or check(*args))
    monkeypatch.setattr(gemv_ops, "_torch_forward",
                        lambda *args: routed.append(args) or torch_forward(*args))
    try:
        calls = [_inputs(20, torch.float32, "norm") for _ in range(3)]
        outs = [_call(inputs) for inputs in calls]
        assert len(checked) == 1 and len(routed) == 3
        assert [args[0] is inputs["x"] for args, inputs in zip(routed, calls)] == [True] * 3
        for out, inputs in zip(outs, calls):
            _assert_close(out, inputs)
    finally:
        gemv_ops._CALLS.clear()


@pytest.mark.parametrize("rows", [1, 3])
@pytest.mark.parametrize("prologue", ["norm", "silu"])
def test_strided_rows(prologue, rows):
    """x, the weight and the residual as rows of wider tensors (row strides past their
    widths), a strided bias and norm weight (copied: they are vectors)."""
    inputs = _inputs(rows, torch.float32, prologue)
    inputs["x"] = random_tensor((rows, inputs["x"].shape[1] + 5), torch.float32,
                                scale=1.0)[:, 3:3 + inputs["x"].shape[1]]
    inputs["weight"] = random_tensor((N_OUT, N_IN + 8), torch.float32, scale=0.1)[:, :N_IN]
    inputs["residual"] = random_tensor((rows, N_OUT + 3), torch.float32)[:, :N_OUT]
    inputs["bias"] = random_tensor((2 * N_OUT,), torch.float32)[::2]
    if inputs["norm_weight"] is not None:
        inputs["norm_weight"] = random_tensor((2 * N_IN,), torch.float32)[1::2]
    with gemv_ops.DECODE_GEMV.forced(_config(split_k=2)):
        out = _call(inputs)
    _assert_close(out, inputs)


@pytest.mark.parametrize("rows", [1, 3])
def test_nan_and_inf_stay_in_their_row(rows):
    """A NaN in x's first row makes that row NaN (with the norm, its rms too) and leaves the
    others alone; an inf in the residual reaches its one output element."""
    for prologue in ("none", "norm"):
        inputs = _inputs(rows + 1, torch.float32, prologue)
        inputs["x"][0, 5] = float("nan")
        inputs["residual"][-1, 7] = float("inf")
        with gemv_ops.DECODE_GEMV.forced(_config()):
            out = _call(inputs)
        expected, _ = _reference_terms(inputs)
        assert torch.equal(out.isnan(), expected.isnan()) and out[0].isnan().all()
        assert torch.equal(out.isinf(), expected.isinf()) and out[-1, 7] == float("inf")
        torch.testing.assert_close(out[1:].double(), expected[1:], rtol=1e-5, atol=1e-5)


def test_empty_and_zero_width_inputs():
    """No rows, no output columns, or no K: the epilogue alone (residual + bias)."""
    inputs = _inputs(0, torch.float32, "norm")
    assert _call(inputs).shape == (0, N_OUT)
    inputs = _inputs(3, torch.float32, "silu", n_out=0)
    assert _call(inputs).shape == (3, 0)
    for prologue in ("none", "norm", "silu"):
        inputs = _inputs(3, torch.float32, prologue, n_in=0)
        torch.testing.assert_close(_call(inputs), inputs["residual"] + inputs["bias"])


def test_float64_and_bf16_are_right_everywhere():
    """float64 is computed by torch; bf16 runs the kernel on a GPU, and under the interpreter
    (whose bf16 tl.dot is wrong) torch computes it, never a silently wrong kernel result."""
    for dtype in (torch.float64, torch.bfloat16):
        for rows in (1, 5):
            inputs = _inputs(rows, dtype, "norm+1")
            _assert_close(_call(inputs), inputs)


def test_gradients_match_autograd_of_the_reference():
    """The forward by the kernel (fp32), the backward by this file's formulas, against
    autograd of the float64 reference, for each prologue."""
    for prologue in ("none", "norm+1", "silu", "gelu_tanh", "gelu_erf"):
        inputs = _inputs(3, torch.float32, prologue)
        names = [name for name in ("x", "weight", "bias", "residual", "norm_weight")
                 if inputs[name] is not None]
        leaves = {name: inputs[name].detach().requires_grad_() for name in names}
        ours = _call({**inputs, **leaves})
        grad = random_tensor(ours.shape, torch.float32)
        ours_grads = torch.autograd.grad(ours, list(leaves.values()), grad)
        wide = {name: t.detach().double().requires_grad_() for name, t in leaves.items()}
        expected = gemv_ops.decode_gemv_reference(**{**inputs, **wide})
        expected_grads = torch.autograd.grad(expected, list(wide.values()), grad.double())
        for name, a, b in zip(names, ours_grads, expected_grads):
            torch.testing.assert_close(a.double(), b, rtol=1e-4, atol=1e-5,
                                       msg=lambda m: f"{prologue} {name}: {m}")


@pytest.mark.parametrize("prologue", ["none", "norm+1", "silu", "gelu_tanh", "gelu_erf"])
def test_backward_is_exact_in_float64(prologue):
    """float64 runs torch's forward and this file's backward: gradcheck and gradgradcheck
    compare it with finite differences."""
    inputs = _inputs(2, torch.float64, prologue, n_out=3, n_in=4)
    names = [name for name in ("x", "weight", "bias", "residual", "norm_weight")
             if inputs[name] is not None]
    options = {name: value for name, value in inputs.items() if name not in names}

    def call(*tensors):
        return _call({**options, **dict(zip(names, tensors))})
    tensors = [inputs[name].requires_grad_() for name in names]
    assert torch.autograd.gradcheck(call, tensors)
    assert torch.autograd.gradgradcheck(call, tensors)


@pytest.mark.parametrize("prologue", ["none", "norm+1", "gelu_tanh"])
def test_custom_op_passes_opcheck(prologue):
    for epilogue in ("bias+residual", "none"):
        inputs = _inputs(3, torch.float32, prologue, epilogue, n_out=20, n_in=24)
        opcheck_overloads(torch.ops.gemslib.decode_gemv,
                          (inputs["x"], inputs["weight"], inputs["bias"], inputs["residual"],
                           inputs["norm_weight"], 1e-6, inputs["weight_offset"],
                           gemv_ops._activation_code(inputs["gated"])))


def test_traces_under_torch_compile_fullgraph():
    inputs = _inputs(4, torch.float32, "norm+1", n_out=16, n_in=32)

    def block(x, weight, bias, residual, norm_weight):
        return gemslib.decode_gemv(x, weight, bias, residual=residual, norm_weight=norm_weight,
                                   weight_offset=1.0) * 2

    compiled = torch.compile(block, fullgraph=True, backend="inductor" if ON_GPU else "aot_eager")
    names = ("x", "weight", "bias", "residual", "norm_weight")
    leaves = [inputs[name].detach().requires_grad_() for name in names]
    out = compiled(*leaves)
    torch.testing.assert_close(out, block(*(inputs[name] for name in names)))
    compiled_grads = torch.autograd.grad(out.sum(), leaves)
    eager_leaves = [t.detach().requires_grad_() for t in leaves]
    eager_grads = torch.autograd.grad(block(*eager_leaves).sum(), eager_leaves)
    for ours, eager in zip(compiled_grads, eager_grads):
        torch.testing.assert_close(ours, eager)


# (the prologue of the call, what is wrong with it, the error, its message)
@pytest.mark.parametrize("prologue,change,error,match", [
    ("norm", lambda a: a.update(weight=a["weight"][:, :-1].contiguous()), ValueError,
     r"weight must be \(N, K\) with K = x.shape\[1\] = 8, got shape \(4, 7\)"),
    ("silu", lambda a: a.update(weight=random_tensor((4, 16), torch.float32)),
     ValueError, r"weight must be \(N, K\) with K = x.shape\[1\] // 2 = 8, got shape \(4, 16\)"),
    ("norm", lambda a: a.update(weight=a["weight"][0]), ValueError, r"weight must be \(N, K\)"),
    ("norm", lambda a: a.update(norm_weight=a["norm_weight"][:-1]), ValueError,
     r"norm_weight must be \(8,\) to match x's last dim, got shape \(7,\)"),
    ("norm", lambda a: a.update(bias=a["bias"][:-1]), ValueError, r"bias must be \(4,\)"),
    ("norm", lambda a: a.update(residual=a["residual"][:, :-1]), ValueError,
     r"residual must be \(M, N\) = \(3, 4\) like the output, got shape \(3, 3\)"),
    ("norm", lambda a: a.update(weight=a["weight"].double()), ValueError,
     "weight must be torch.float32 on .* like x, got torch.float64"),
    ("norm", lambda a: a.update(residual=a["residual"].half()), ValueError,
     "residual must be torch.float32 on .* like x, got torch.float16"),
    ("norm", lambda a: a.update(norm_weight=a["norm_weight"].to("meta")), ValueError,
     "norm_weight must be torch.float32 on .* like x, got torch.float32 on meta"),
    ("norm", lambda a: a.update(bias=[1.0] * 4), TypeError,
     "bias must be a torch.Tensor, got list"),
    ("norm", lambda a: a.update(x=a["x"].to(torch.int32)), TypeError,
     "x must be floating-point, got torch.int32"),
    ("norm", lambda a: a.update(x=a["x"][0]), ValueError,
     r"x must be 2-d \(M, K\), got shape \(8,\)"),
    ("norm", lambda a: a.update(x=a["x"][None]), ValueError, r"x must be 2-d \(M, K\)"),
    ("norm", lambda a: a.update(x=a["x"].t().contiguous().t()), ValueError,
     r"x's last dim must be contiguous \(stride 1\), got strides \(1, 3\)"),
    ("norm", lambda a: a.update(weight=a["weight"].t().contiguous().t()), ValueError,
     r"weight's last dim must be contiguous \(stride 1\)"),
    ("norm", lambda a: a.update(residual=a["residual"].t().contiguous().t()), ValueError,
     r"residual's last dim must be contiguous \(stride 1\)"),
    ("silu", lambda a: a.update(x=a["x"][:, :-1]), ValueError,
     r"with gated='silu', x must be \(M, 2I\) = \[gate \| up\], an even last dim; got shape "
     r"\(3, 15\)"),
    ("norm", lambda a: a.update(gated="relu"), ValueError,
     "gated must be None or one of 'silu', 'gelu_tanh', 'gelu_erf', got 'relu'"),
    ("norm", lambda a: a.update(gated=True), TypeError,
     "gated must be None or one of .*, got bool"),
    ("norm", lambda a: a.update(gated="silu"), ValueError,
     "norm_weight and gated are mutually exclusive"),
    ("silu", lambda a: a.update(weight_offset=1.0), ValueError,
     "weight_offset .* needs a norm_weight; got norm_weight=None with weight_offset=1.0"),
    ("norm", lambda a: a.update(eps="1e-6"), TypeError, "argument 'eps' must be float, not str"),
    ("norm", lambda a: a.update(weight_offset=None), TypeError,
     "argument 'weight_offset' must be float, not NoneType"),
])
def test_bad_inputs_name_the_argument(prologue, change, error, match):
    inputs = _inputs(3, torch.float32, prologue, n_out=4, n_in=8)
    change(inputs)
    with pytest.raises(error, match=match):
        _call(inputs)


# --------------------------------------------------------------------------------------------
# decode_gemv_merged: over merged_linear's weights (what the decode graph rewrite calls)
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("layout", ["end to end", "apart", "one bias missing"])
@pytest.mark.parametrize("prologue", ["norm", "norm+1", "none"])
def test_over_merged_weights_is_over_their_concatenation(prologue, layout):
    """decode_gemv_merged computes decode_gemv over the weights (and biases) concatenated: a
    view of them where they lie end to end in one buffer (merged_linear's parameters), else
    a copy; a missing bias beside others adds nothing to its columns."""
    widths = (40, 24, 24)
    inputs = _inputs(3, torch.float32, prologue, "bias+residual", n_out=sum(widths), n_in=N_IN)
    weights = list(inputs["weight"].split(widths))
    biases = list(inputs["bias"].split(widths))
    if layout == "apart":
        weights, biases = [w.clone() for w in weights], [b.clone() for b in biases]
    if layout == "one bias missing":
        biases[1] = None
        inputs["bias"] = torch.cat([biases[0], torch.zeros(widths[1], device=biases[0].device),
                                    biases[2]])
    merged, _ = gemv_ops.merged_weights(weights, biases)
    assert (merged.data_ptr() == inputs["weight"].data_ptr()) == (layout != "apart")
    out = torch.ops.gemslib.decode_gemv_merged(
        inputs["x"], weights, biases, inputs["residual"], inputs["norm_weight"], 1e-6,
        inputs["weight_offset"], gemv_ops.NO_GATE)
    _assert_close(out, inputs)


def test_over_merged_weights_passes_opcheck():
    inputs = _inputs(2, torch.float32, "norm", "residual", n_out=20, n_in=24)
    weights = list(inputs["weight"].split([12, 8]))
    opcheck_overloads(torch.ops.gemslib.decode_gemv_merged,
                      (inputs["x"], weights, [None, None], inputs["residual"],
                       inputs["norm_weight"], 1e-6, 0.0, gemv_ops.NO_GATE),
                      test_utils=("test_schema", "test_faketensor", "test_aot_dispatch_dynamic"))


def test_a_last_dim_that_is_not_contiguous_in_a_graph_goes_to_torch():
    """The op (what a compiled graph calls, with the layouts inductor chose) computes a call
    whose x has a strided last dim by torch, right, where the public function refuses it."""
    inputs = _inputs(3, torch.float32, "norm", "residual", n_out=20, n_in=24)
    x = inputs["x"].t().contiguous().t()
    out = torch.ops.gemslib.decode_gemv(x, inputs["weight"], None, inputs["residual"],
                                        inputs["norm_weight"], 1e-6, 0.0, gemv_ops.NO_GATE)
    _assert_close(out, {**inputs, "bias": None})
