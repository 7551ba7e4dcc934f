"""SiLU, and the gated activations SiLU-and-multiply (SwiGLU's) and GELU-and-multiply
(GeGLU's: Gemma's MLP), forward and backward.

    silu(x)          = x * sigmoid(x) = x / (1 + exp(-x))
    silu'(x)         = s * (1 + x * (1 - s)),  s = sigmoid(x)
    silu_and_mul(x)  = silu(gate) * up,  x = [gate | up] on the last dim (vLLM convention):
                       x (..., 2d) -> out (..., d)
    gelu_and_mul(x)  = gelu(gate) * up, with torch's two GELUs:
                       "none": gelu(g) = g/2 * (1 + erf(g / sqrt(2)))
                       "tanh": gelu(g) = g/2 * (1 + tanh(sqrt(2/pi) * (g + 0.044715 g^3)))

The two gated operators share one kernel (its ACTIVATION), so one tuned config serves both.

All math in fp32; inputs and outputs fp16, bf16 or fp32. The file reads top-down: kernels,
launchers, references, public functions and custom ops, aten overrides, self-checks, tuning.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from gemslib import checks, layout, pdl, runtime
from gemslib.registry import AtenOverride, SelfCheck, TuneBucket, TuneSpace
_INT32_LIMIT = 2**31 - 2**21  # flat indices stay int32 below this (leaves room for one block)


# --------------------------------------------------------------------------------------------
# Kernels
# --------------------------------------------------------------------------------------------


@triton.jit
def _block_indices(n_elements, INDEX_64: tl.constexpr, BLOCK: tl.constexpr):
    """This program's BLOCK logical element indices and their in-bounds mask."""
    i_n = tl.program_id(0)
    if INDEX_64:
        block_start = i_n.to(tl.int64) * BLOCK
    else:
        block_start = i_n * BLOCK
    o_n = block_start + tl.arange(0, BLOCK)
    return o_n, o_n < n_elements


@triton.jit
def _silu_fwd_kernel(
    x_ptr, y_ptr, n_elements,
    n_1, n_2, n_3,
    stride_x_0, stride_x_1, stride_x_2, stride_x_3,
    stride_y_0, stride_y_1, stride_y_2, stride_y_3,
    STRIDED: tl.constexpr, INDEX_64: tl.constexpr, BLOCK: tl.constexpr,
):
    """y = silu(x) over ``n_elements``: flat storage order, or a 4-d strided walk (dims of
    sizes (n_elements / (n_1 n_2 n_3), n_1, n_2, n_3), each operand with its own strides)."""
    o_n, m_n = _block_indices(n_elements, INDEX_64, BLOCK)
    o_x = layout.element_offsets(o_n, n_1, n_2, n_3, stride_x_0, stride_x_1, stride_x_2,
                                 stride_x_3, STRIDED)
    o_y = layout.element_offsets(o_n, n_1, n_2, n_3, stride_y_0, stride_y_1, stride_y_2,
                                 stride_y_3, STRIDED)
    b_x = tl.load(x_ptr + o_x, mask=m_n).to(tl.float32)
    b_y = b_x / (1.0 + tl.exp(-b_x))
    tl.store(y_ptr + o_y, b_y.to(y_ptr.dtype.element_ty), mask=m_n)


@triton.jit
def _silu_bwd_kernel(
    grad_ptr, x_ptr, dx_ptr, n_elements,
    n_1, n_2, n_3,
    stride_grad_0, stride_grad_1, stride_grad_2, stride_grad_3,
    stride_x_0, stride_x_1, stride_x_2, stride_x_3,
    stride_dx_0, stride_dx_1, stride_dx_2, stride_dx_3,
    STRIDED: tl.constexpr, INDEX_64: tl.constexpr, BLOCK: tl.constexpr,
):
    """dx = grad * silu'(x); the walk as in _silu_fwd_kernel."""
    o_n, m_n = _block_indices(n_elements, INDEX_64, BLOCK)
    o_grad = layout.element_offsets(o_n, n_1, n_2, n_3, stride_grad_0, stride_grad_1,
                                    stride_grad_2, stride_grad_3, STRIDED)
    o_x = layout.element_offsets(o_n, n_1, n_2, n_3, stride_x_0, stride_x_1, stride_x_2,
                                 stride_x_3, STRIDED)
    o_dx = layout.element_offsets(o_n, n_1, n_2, n_3, stride_dx_0, stride_dx_1, stride_dx_2,
                                  stride_dx_3, STRIDED)
    b_grad = tl.load(grad_ptr + o_grad, mask=m_n).to(tl.float32)
    b_x = tl.load(x_ptr + o_x, mask=m_n).to(tl.float32)
    b_sig = 1.0 / (1.0 + tl.exp(-b_x))
    b_dx = b_grad * b_sig * (1.0 + b_x * (1.0 - b_sig))
    tl.store(dx_ptr + o_dx, b_dx.to(dx_ptr.dtype.element_ty), mask=m_n)


@triton.jit
def _row_and_columns(half_width, BLOCK_N: tl.constexpr):
    """(row, its columns) of this program. A 1-d grid walked row-major: neighbouring programs
    take neighbouring column blocks of one row, so the grid sweeps memory in order (a 2-d grid
    with rows on the fast axis jumps a whole row between neighbours, which costs bandwidth)."""
    i_mn = tl.program_id(0)  # int32 division: the int64 one is a long emulated sequence
    n_col_blocks = tl.cdiv(half_width, BLOCK_N)
    i_row = (i_mn // n_col_blocks).to(tl.int64)  # int64 from here: row * stride can pass 2**31
    o_n = (i_mn % n_col_blocks) * BLOCK_N + tl.arange(0, BLOCK_N)
    return i_row, o_n


def _even_columns(args) -> bool:
    return args["half_width"] % args["BLOCK_N"] == 0


SILU, GELU_TANH, GELU_ERF = 0, 1, 2  # a gated kernel's ACTIVATION
_SQRT_2_OVER_PI = 0.7978845608028654
_GELU_CUBIC = 0.044715


@triton.jit
def _gate_activation(b_gate, ACTIVATION: tl.constexpr):
    """(act(gate), act'(gate)) in fp32 for the gated kernels' ACTIVATION."""
    if ACTIVATION == 0:  # SILU
        b_sig = 1.0 / (1.0 + tl.exp(-b_gate))
        b_act = b_gate * b_sig
        b_slope = b_sig * (1.0 + b_gate * (1.0 - b_sig))
    elif ACTIVATION == 1:  # GELU_TANH
        # (1 + tanh(u)) / 2 = sigmoid(2u) and (1 - tanh(u)) / 2 = sigmoid(-2u), each from its
        # own exp: no 1 + tanh(u) cancelling where the gate is far below zero
        b_2u = 2.0 * 0.7978845608028654 * (b_gate + 0.044715 * b_gate * b_gate * b_gate)
        b_up_half = 1.0 / (1.0 + tl.exp(-b_2u))
        b_down_half = 1.0 / (1.0 + tl.exp(b_2u))
        b_act = b_gate * b_up_half
        b_slope = b_up_half + 2.0 * b_gate * b_up_half * b_down_half * 0.7978845608028654 * (
            1.0 + 3.0 * 0.044715 * b_gate * b_gate)
    else:  # GELU_ERF
        b_cdf = 0.5 * (1.0 + tl.math.erf(b_gate * 0.7071067811865476))
        b_act = b_gate * b_cdf
        b_slope = b_cdf + b_gate * 0.3989422804014327 * tl.exp(-0.5 * b_gate * b_gate)
    return b_act, b_slope


@triton.heuristics({"EVEN_N": _even_columns})
@triton.jit
def _silu_and_mul_fwd_kernel(
    x_ptr, out_ptr, half_width,
    stride_x_row, stride_x_col, stride_out_row,
    ACTIVATION: tl.constexpr,
    BLOCK_N: tl.constexpr, EVEN_N: tl.constexpr, PDL: tl.constexpr = False,
    PDL_EARLY: tl.constexpr = False,
):
    """out[row, c] = act(x[row, c]) * x[row, half_width + c], act silu or a GELU
    (ACTIVATION); one program per (row, col block). PDL: launched dependent
    (runtime.dependent_launch_here), it first waits for the kernel before it on the
    stream; PDL_EARLY: then lets the next one launch (gemslib.pdl)."""
    pdl.wait_for_previous_kernel(PDL, PDL_EARLY)
    i_row, o_n = _row_and_columns(half_width, BLOCK_N)
    m_n = o_n < half_width
    if EVEN_N:  # no partial block in any row: unpredicated loads and stores
        m_n = None
    p_gate = x_ptr + i_row * stride_x_row + o_n * stride_x_col
    b_gate = tl.load(p_gate, mask=m_n).to(tl.float32)
    b_up = tl.load(p_gate + half_width * stride_x_col, mask=m_n).to(tl.float32)
    if ACTIVATION == 0:  # silu alone: its derivative is not needed here
        b_out = b_gate / (1.0 + tl.exp(-b_gate)) * b_up
    else:
        b_out = _gate_activation(b_gate, ACTIVATION)[0] * b_up
    tl.store(out_ptr + i_row * stride_out_row + o_n, b_out.to(out_ptr.dtype.element_ty), mask=m_n)


@triton.heuristics({"EVEN_N": _even_columns})
@triton.jit
def _silu_and_mul_bwd_kernel(
    grad_ptr, x_ptr, dx_ptr, half_width,
    stride_grad_row, stride_x_row, stride_x_col, stride_dx_row,
    ACTIVATION: tl.constexpr,
    BLOCK_N: tl.constexpr, EVEN_N: tl.constexpr,
):
    """d gate = grad * up * act'(gate),  d up = grad * act(gate)."""
    i_row, o_n = _row_and_columns(half_width, BLOCK_N)
    m_n = o_n < half_width
    if EVEN_N:  # no partial block in any row: unpredicated loads and stores
        m_n = None
    p_gate = x_ptr + i_row * stride_x_row + o_n * stride_x_col
    b_gate = tl.load(p_gate, mask=m_n).to(tl.float32)
    b_up = tl.load(p_gate + half_width * stride_x_col, mask=m_n).to(tl.float32)
    b_grad = tl.load(grad_ptr + i_row * stride_grad_row + o_n, mask=m_n).to(tl.float32)
    b_act, b_slope = _gate_activation(b_gate, ACTIVATION)
    b_dgate = b_grad * b_up * b_slope
    b_dup = b_grad * b_act
    p_dx = dx_ptr + i_row * stride_dx_row + o_n
    tl.store(p_dx, b_dgate.to(dx_ptr.dtype.element_ty), mask=m_n)
    tl.store(p_dx + half_width, b_dup.to(dx_ptr.dtype.element_ty), mask=m_n)


SILU_FWD = runtime.TunedKernel("silu", "silu_fwd", _silu_fwd_kernel,
                               tunables=("BLOCK",), shape_keys=("numel",))
SILU_BWD = runtime.TunedKernel("silu", "silu_bwd", _silu_bwd_kernel,
                               tunables=("BLOCK",), shape_keys=("numel",))
SILU_AND_MUL_FWD = runtime.TunedKernel("silu", "silu_and_mul_fwd", _silu_and_mul_fwd_kernel,
                                       tunables=("BLOCK_N",), shape_keys=("rows", "cols"),
                                       dependent_launch=True)
SILU_AND_MUL_BWD = runtime.TunedKernel("silu", "silu_and_mul_bwd", _silu_and_mul_bwd_kernel,
                                       tunables=("BLOCK_N",), shape_keys=("rows", "cols"))


# --------------------------------------------------------------------------------------------
# Launchers (tensors already validated; outputs allocated by the caller)
# --------------------------------------------------------------------------------------------


def _launch_elementwise(kernel: runtime.TunedKernel, inputs: list[torch.Tensor],
                        out: torch.Tensor) -> torch.Tensor:
    """Run an elementwise ``kernel(*inputs, out, n_elements, n_1..n_3, strides of each operand,
    STRIDED, INDEX_64)``.

    Operands share one shape. One dense layout common to all of them runs flat; anything else
    walks strides, and a layout that does not collapse to 4 dims is computed on contiguous
    copies and copied into ``out`` (rare: 5+ dims that no neighbour merging reduces).
    """
    n_elements = out.numel()
    if n_elements == 0:
        return out
    operands = [*inputs, out]
    if all(t.is_contiguous() for t in operands) or layout.same_dense_layout(*operands):
        strided, sizes, strides = False, [1, 1, 1], [0] * (4 * len(operands))
    else:
        padded = layout.padded_layout(out.shape, *[t.stride() for t in operands])
        if padded is None:
            result = torch.empty(out.shape, dtype=out.dtype, device=out.device)
            _launch_elementwise(kernel, [t.contiguous() for t in inputs], result)
            return out.copy_(result)
        shape4, operand_strides = padded
        strided, sizes = True, shape4[1:]
        strides = [s for operand in operand_strides for s in operand]
    index_64 = n_elements >= _INT32_LIMIT
    # positional, one group per line (TunedKernel.launch forwards no keyword kernel arguments)
    kernel.launch(lambda meta: (runtime.cdiv(n_elements, meta["BLOCK"]),),
                  *operands,
                  n_elements, *sizes,
                  *strides,
                  strided, index_64,
                  shape=(n_elements,), restore=[t for t in inputs if t is out])
    return out


def _launch_silu_and_mul(x: torch.Tensor, out: torch.Tensor, activation: int = SILU
                         ) -> torch.Tensor:
    if out.numel() == 0:
        return out
    half_width = x.shape[-1] // 2
    rows_in, rows_out = layout.as_rows(x), out.view(-1, half_width)
    n_rows = rows_in.shape[0]
    SILU_AND_MUL_FWD.launch(
        lambda meta: (n_rows * runtime.cdiv(half_width, meta["BLOCK_N"]),),
        rows_in, rows_out, half_width,
        rows_in.stride(0), rows_in.stride(1), rows_out.stride(0),
        activation,
        shape=(n_rows, half_width))
    return out


def _launch_silu_and_mul_backward(grad: torch.Tensor, x: torch.Tensor, activation: int = SILU
                                  ) -> torch.Tensor:
    half_width = x.shape[-1] // 2
    dx = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    if dx.numel() == 0:
        return dx
    rows_in, rows_dx = layout.as_rows(x), dx.view(-1, 2 * half_width)
    rows_grad = layout.as_rows(grad)
    if rows_grad.stride(-1) != 1:
        rows_grad = rows_grad.contiguous()
    n_rows = rows_in.shape[0]
    SILU_AND_MUL_BWD.launch(
        lambda meta: (n_rows * runtime.cdiv(half_width, meta["BLOCK_N"]),),
        rows_grad, rows_in, rows_dx, half_width,
        rows_grad.stride(0), rows_in.stride(0), rows_in.stride(1), rows_dx.stride(0),
        activation,
        shape=(n_rows, half_width))
    return dx


# --------------------------------------------------------------------------------------------
# Plain PyTorch references (any dtype; tests run them in float64)
# --------------------------------------------------------------------------------------------


def silu_reference(x: torch.Tensor) -> torch.Tensor:
    return x * torch.sigmoid(x)


def silu_backward_reference(grad: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    sig = torch.sigmoid(x)
    return grad * sig * (1 + x * (1 - sig))


def silu_and_mul_reference(x: torch.Tensor) -> torch.Tensor:
    gate, up = x.chunk(2, dim=-1)
    return gate * torch.sigmoid(gate) * up


def silu_and_mul_backward_reference(grad: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    gate, up = x.chunk(2, dim=-1)
    sig = torch.sigmoid(gate)
    return torch.cat([grad * up * sig * (1 + gate * (1 - sig)), grad * gate * sig], dim=-1)


def gelu_and_mul_reference(x: torch.Tensor, approximate: str = "none") -> torch.Tensor:
    gate, up = x.chunk(2, dim=-1)
    return F.gelu(gate, approximate=approximate) * up


def gelu_and_mul_backward_reference(grad: torch.Tensor, x: torch.Tensor,
                                    approximate: str = "none") -> torch.Tensor:
    gate, up = x.chunk(2, dim=-1)
    return torch.cat([torch.ops.aten.gelu_backward(grad * up, gate, approximate=approximate),
                      grad * F.gelu(gate, approximate=approximate)], dim=-1)


# --------------------------------------------------------------------------------------------
# Public functions and custom ops
# --------------------------------------------------------------------------------------------


def _check_out(function: str, out: torch.Tensor, shape, like: torch.Tensor) -> None:
    checks.tensor(function, "out", out)
    if tuple(out.shape) != tuple(shape):
        raise ValueError(f"{function}: out must have shape {tuple(shape)}, got {tuple(out.shape)}")
    checks.like(function, "out", out, like)
    if layout.has_internal_overlap(out):
        raise ValueError(f"{function}: out has overlapping elements (a stride-0 dim)")


def _silu_into(x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    if not runtime.kernel_runs(x, out):
        return out.copy_(F.silu(x))
    if layout.partly_overlaps(x, out):
        x = x.clone()  # read a private copy so no element is read after it was written
    return _launch_elementwise(SILU_FWD, [x], out)


_SILU_CALLS = runtime.CallPlans("silu")
_SILU_AND_MUL_CALLS = runtime.CallPlans("silu_and_mul")
_GELU_AND_MUL_CALLS = runtime.CallPlans("gelu_and_mul")


def silu(x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """``x * sigmoid(x)`` elementwise; any shape and strides.

    The result has ``x``'s layout when ``x`` is dense (like ``torch.empty_like``). With ``out``
    (same shape, dtype and device) nothing is allocated. Differentiable.

    Args:
        x: (...) floating tensor, any strides. The kernel takes fp16, bf16 and fp32 (math in
            fp32) on the kernel device; other dtypes and devices are computed by torch.
        out: optional (...) tensor of ``x``'s shape, dtype and device, without overlapping
            elements; it may be ``x`` itself (in place).

    Returns:
        (...) tensor of ``x``'s shape and dtype; ``out`` when given.

    Raises:
        TypeError: ``x`` or ``out`` is not a tensor, or ``x`` is not floating-point.
        ValueError: ``out`` has another shape, dtype or device, or overlapping elements.
    """
    if out is None:
        key, planned = _SILU_CALLS.replayed(x)
        if planned is not None:
            return planned
    checks.float_tensor("gemslib.silu", "x", x)
    if out is None:
        if runtime.wants_custom_op(x):
            return _silu_op(x)
        if not runtime.kernel_runs(x):
            return F.silu(x)
        return _SILU_CALLS.plan(key, (x,), lambda: _launch_elementwise(SILU_FWD, [x],
                                                                       torch.empty_like(x)))
    _check_out("gemslib.silu", out, x.shape, x)
    return _silu_into(x, out)


def _silu_backward(grad: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    dx = torch.empty_like(x)
    if not runtime.kernel_runs(grad, x) or grad.dtype != x.dtype or grad.shape != x.shape:
        return dx.copy_(silu_backward_reference(grad, x))
    return _launch_elementwise(SILU_BWD, [grad, x], dx)


def silu_and_mul(x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """``silu(gate) * up`` for ``x = [gate | up]`` split on the last dim.

    x: (..., 2d) with any strides -> (..., d), contiguous (or written into ``out``).
    Differentiable.

    Args:
        x: (..., 2d) floating tensor, any strides: ``gate = x[..., :d]``, ``up = x[..., d:]``.
            The kernel takes fp16, bf16 and fp32 (math in fp32) on the kernel device; other
            dtypes and devices are computed by torch.
        out: optional (..., d) tensor of ``x``'s dtype and device, without overlapping
            elements.

    Returns:
        (..., d) tensor of ``x``'s dtype; ``out`` when given.

    Raises:
        TypeError: ``x`` or ``out`` is not a tensor, or ``x`` is not floating-point.
        ValueError: ``x`` is 0-d or its last dim is odd; ``out`` has another shape, dtype or
            device, or overlapping elements.
    """
    key = None
    if out is None:
        key, planned = _SILU_AND_MUL_CALLS.replayed(x)
        if planned is not None:
            return planned
    return _gated_and_mul("gemslib.silu_and_mul", x, out, SILU, silu_and_mul_reference,
                          _SILU_AND_MUL_CALLS, key, _silu_and_mul_op)


def gelu_and_mul(x: torch.Tensor, approximate: str = "none",
                 out: torch.Tensor | None = None) -> torch.Tensor:
    """``gelu(gate) * up`` for ``x = [gate | up]`` split on the last dim (GeGLU; Gemma's MLP
    with ``approximate="tanh"``).

    x: (..., 2d) with any strides -> (..., d), contiguous (or written into ``out``).
    Differentiable.

    Args:
        x: (..., 2d) floating tensor, any strides, as for ``silu_and_mul``.
        approximate: torch.nn.functional.gelu's: ``"none"`` (erf) or ``"tanh"``.
        out: optional (..., d) tensor of ``x``'s dtype and device, without overlapping
            elements.

    Returns:
        (..., d) tensor of ``x``'s dtype; ``out`` when given.

    Raises:
        TypeError: ``x`` or ``out`` is not a tensor, ``x`` is not floating-point, or
            ``approximate`` is not a string.
        ValueError: ``approximate`` is neither "none" nor "tanh"; ``x`` is 0-d or its last
            dim is odd; ``out`` has another shape, dtype or device, or overlapping elements.
    """
    tanh = _tanh_approximation("gemslib.gelu_and_mul", approximate)
    key = None
    if out is None:
        key, planned = _GELU_AND_MUL_CALLS.replayed(x, tanh)
        if planned is not None:
            return planned
    return _gated_and_mul("gemslib.gelu_and_mul", x, out, GELU_TANH if tanh else GELU_ERF,
                          lambda t: gelu_and_mul_reference(t, approximate), _GELU_AND_MUL_CALLS,
                          key, _gelu_and_mul_op, (tanh,))


def _tanh_approximation(function: str, approximate) -> bool:
    if not isinstance(approximate, str):
        raise TypeError(f"{function}: approximate must be a string ('none' or 'tanh'), got "
                        f"{type(approximate).__name__}")
    if approximate not in ("none", "tanh"):
        raise ValueError(f"{function}: approximate must be 'none' or 'tanh' (as in "
                         f"torch.nn.functional.gelu), got {approximate!r}")
    return approximate == "tanh"


def _gated_and_mul(function: str, x, out, activation: int, reference, plans, key, op,
                   op_args: tuple = ()) -> torch.Tensor:
    """The path of a gated activation's call that its plan did not serve: checks, then the
    custom op (autograd), torch (what the kernel does not take) or the kernel."""
    checks.float_tensor(function, "x", x)
    if x.dim() == 0 or x.shape[-1] % 2:
        raise ValueError(f"{function}: x's last dim must be even (x = [gate | up]), "
                         f"got shape {tuple(x.shape)}")
    out_shape = (*x.shape[:-1], x.shape[-1] // 2)
    if out is None:
        if runtime.wants_custom_op(x):
            return op(x, *op_args)
        if not runtime.kernel_runs(x):
            return reference(x)
        return plans.plan(key, (x, *op_args), lambda: _launch_silu_and_mul(
            x, torch.empty(out_shape, dtype=x.dtype, device=x.device), activation))
    _check_out(function, out, out_shape, x)
    if not runtime.kernel_runs(x) or layout.memory_overlaps(x, out):
        return out.copy_(reference(x))
    if out.dim() > 0 and (out.stride(-1) != 1 or not layout.viewable_as_rows(out)):
        return out.copy_(_launch_silu_and_mul(x, torch.empty(out_shape, dtype=x.dtype,
                                                                device=x.device), activation))
    return _launch_silu_and_mul(x, out, activation)


def _silu_and_mul_backward(grad: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    if not runtime.kernel_runs(grad, x) or grad.dtype != x.dtype:
        return silu_and_mul_backward_reference(grad, x)
    return _launch_silu_and_mul_backward(grad, x)


def _silu_impl(x: torch.Tensor) -> torch.Tensor:
    return _silu_into(x, torch.empty_like(x))


def _silu_and_mul_impl(x: torch.Tensor) -> torch.Tensor:
    return silu_and_mul(x, out=torch.empty((*x.shape[:-1], x.shape[-1] // 2), dtype=x.dtype,
                                           device=x.device))


def _silu_and_mul_fake(x, *tanh):
    torch._check(x.dim() > 0 and x.shape[-1] % 2 == 0,
                 lambda: f"gemslib.{'gelu' if tanh else 'silu'}_and_mul: x's last dim must be "
                         f"even, got {tuple(x.shape)}")
    return x.new_empty((*x.shape[:-1], x.shape[-1] // 2))


def _gelu_and_mul_impl(x: torch.Tensor, tanh: bool) -> torch.Tensor:
    return gelu_and_mul(x, "tanh" if tanh else "none", out=torch.empty(
        (*x.shape[:-1], x.shape[-1] // 2), dtype=x.dtype, device=x.device))


def _gelu_and_mul_backward(grad: torch.Tensor, x: torch.Tensor, tanh: bool) -> torch.Tensor:
    if not runtime.kernel_runs(grad, x) or grad.dtype != x.dtype:
        return gelu_and_mul_backward_reference(grad, x, "tanh" if tanh else "none")
    return _launch_silu_and_mul_backward(grad, x, GELU_TANH if tanh else GELU_ERF)


def _save_input(ctx, inputs, output):
    ctx.save_for_backward(inputs[0])


def _silu_grad(ctx, grad, ops):
    (x,) = ctx.saved_tensors
    return ops.silu_backward(grad, x)


def _silu_and_mul_grad(ctx, grad, ops):
    (x,) = ctx.saved_tensors
    return ops.silu_and_mul_backward(grad, x)


def _save_input_and_tanh(ctx, inputs, output):
    ctx.save_for_backward(inputs[0])
    ctx.tanh = inputs[1]


def _gelu_and_mul_grad(ctx, grad, ops):
    (x,) = ctx.saved_tensors
    return ops.gelu_and_mul_backward(grad, x, ctx.tanh), None


_silu_backward_op = runtime.CustomOp("silu_backward", _silu_backward,
                                     fake=lambda grad, x: torch.empty_like(x))
_silu_op = runtime.CustomOp("silu", _silu_impl, fake=torch.empty_like, setup_context=_save_input,
                            backward=_silu_grad, uses=(_silu_backward_op,))
_silu_and_mul_backward_op = runtime.CustomOp("silu_and_mul_backward", _silu_and_mul_backward,
                                             fake=lambda grad, x: x.new_empty(x.shape))
_silu_and_mul_op = runtime.CustomOp("silu_and_mul", _silu_and_mul_impl, fake=_silu_and_mul_fake,
                                    setup_context=_save_input, backward=_silu_and_mul_grad,
                                    uses=(_silu_and_mul_backward_op,))
_gelu_and_mul_backward_op = runtime.CustomOp(
    "gelu_and_mul_backward", _gelu_and_mul_backward, fake=lambda grad, x, tanh: x.new_empty(x.shape))
_gelu_and_mul_op = runtime.CustomOp("gelu_and_mul", _gelu_and_mul_impl, fake=_silu_and_mul_fake,
                                    setup_context=_save_input_and_tanh,
                                    backward=_gelu_and_mul_grad,
                                    uses=(_gelu_and_mul_backward_op,))


# --------------------------------------------------------------------------------------------
# aten overrides: F.silu forward and backward (autograd's silu_backward) run these kernels
# --------------------------------------------------------------------------------------------


def _unsupported_dtype(*tensors: torch.Tensor) -> str | None:
    dtypes = {t.dtype for t in tensors}
    if len(dtypes) != 1 or next(iter(dtypes)) not in runtime.KERNEL_DTYPES:
        return f"dtypes {sorted(map(str, dtypes))}"
    return None


def _why_not_silu(self):
    return _unsupported_dtype(self)


def _why_not_silu_(self):
    return _unsupported_dtype(self) or (
        "overlapping elements" if layout.has_internal_overlap(self) else None)


def _why_not_silu_out(self, *, out):
    if out.shape != self.shape:
        return "out needs resizing"
    if layout.has_internal_overlap(out):
        return "out has overlapping elements"
    if layout.partly_overlaps(self, out):
        return "out partly overlaps the input (torch raises)"
    return _unsupported_dtype(self, out)


def _why_not_silu_backward(grad_output, self):
    if grad_output.shape != self.shape:
        return "broadcasting"
    return _unsupported_dtype(grad_output, self)


def _aten_silu(self):
    return _silu_into(self, torch.empty_like(self))


def _aten_silu_(self):
    return _silu_into(self, self)


def _aten_silu_out(self, *, out):
    return _silu_into(self, out)


ATEN_OVERRIDES = (
    AtenOverride("aten::silu", _aten_silu, _why_not_silu),
    AtenOverride("aten::silu_", _aten_silu_, _why_not_silu_),
    AtenOverride("aten::silu.out", _aten_silu_out, _why_not_silu_out),
    AtenOverride("aten::silu_backward", _silu_backward, _why_not_silu_backward),
)


# --------------------------------------------------------------------------------------------
# Self-checks for `python -m gemslib`
# --------------------------------------------------------------------------------------------


def _random(shape, device, dtype):
    return torch.randn(shape, device=device, dtype=torch.float32).mul_(3).to(dtype)


_WIDTH = 4099  # odd on purpose: not a multiple of any block


SELF_CHECKS = (
    SelfCheck("silu", lambda device, dtype, rows: (_random((rows, _WIDTH), device, dtype),),
              run=silu, reference=silu_reference, torch_peer=F.silu),
    SelfCheck("silu_backward",
              lambda device, dtype, rows: (_random((rows, _WIDTH), device, dtype),
                                           _random((rows, _WIDTH), device, dtype)),
              run=_silu_backward, reference=silu_backward_reference,
              torch_peer=torch.ops.aten.silu_backward),
    SelfCheck("silu_and_mul",
              lambda device, dtype, rows: (_random((rows, 2 * _WIDTH), device, dtype),),
              run=silu_and_mul, reference=silu_and_mul_reference,
              torch_peer=lambda x: F.silu(x[..., : x.shape[-1] // 2]) * x[..., x.shape[-1] // 2:]),
    SelfCheck("silu_and_mul_backward",
              lambda device, dtype, rows: (_random((rows, _WIDTH), device, dtype),
                                           _random((rows, 2 * _WIDTH), device, dtype)),
              run=_silu_and_mul_backward, reference=silu_and_mul_backward_reference,
              torch_peer=silu_and_mul_backward_reference),
    SelfCheck("gelu_and_mul",
              lambda device, dtype, rows: (_random((rows, 2 * _WIDTH), device, dtype),),
              run=lambda x: gelu_and_mul(x, "tanh"),
              reference=lambda x: gelu_and_mul_reference(x, "tanh"),
              torch_peer=lambda x: F.gelu(x[..., : x.shape[-1] // 2], approximate="tanh")
              * x[..., x.shape[-1] // 2:]),
)


# --------------------------------------------------------------------------------------------
# Tuning (python -m gemslib.tune): candidates, and a bf16 problem per bucket
# --------------------------------------------------------------------------------------------

def _silu_problem(rows: int, cols: int, backward: bool, gated: bool):
    def make(device):
        x = torch.randn(rows, 2 * cols if gated else cols, device=device, dtype=torch.bfloat16)
        grad = torch.randn(rows, cols, device=device, dtype=torch.bfloat16)
        if gated:
            return (lambda: _silu_and_mul_backward(grad, x)) if backward else \
                (lambda: silu_and_mul(x))
        return (lambda: _silu_backward(grad, x)) if backward else (lambda: silu(x))
    return make


_ELEMENTWISE_CANDIDATES = tuple({"BLOCK": block, "num_warps": warps}
                                for block in (512, 1024, 2048, 4096, 8192)
                                for warps in (2, 4, 8, 16) if block // (32 * warps) >= 4)
_GATED_CANDIDATES = tuple({"BLOCK_N": block, "num_warps": warps}
                          for block in (512, 1024, 2048, 4096)
                          for warps in (2, 4, 8, 16) if block // (32 * warps) >= 4)

TUNING = tuple(
    TuneSpace(kernel, candidates, (
        TuneBucket(small, f"{small_rows}x{cols}", _silu_problem(small_rows, cols, backward, gated)),
        TuneBucket(None, f"{large_rows}x{cols}", _silu_problem(large_rows, cols, backward, gated))))
    for kernel, candidates, backward, gated, small, small_rows, large_rows, cols in (
        # elementwise: up to a million elements the launch dominates, past it the stream
        (SILU_FWD, _ELEMENTWISE_CANDIDATES, False, False, {"numel": 1 << 20}, 64, 4096, 14336),
        (SILU_BWD, _ELEMENTWISE_CANDIDATES, True, False, {"numel": 1 << 20}, 64, 4096, 14336),
        # gated: decode/prefill-sized row counts, then the largest batches
        (SILU_AND_MUL_FWD, _GATED_CANDIDATES, False, True, {"rows": 8192}, 4096, 16384, 14336),
        (SILU_AND_MUL_BWD, _GATED_CANDIDATES, True, True, {"rows": 8192}, 4096, 16384, 14336)))
