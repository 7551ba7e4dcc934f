"""apply_rotary: layouts, GQA, partial rotary, positions, in place, gradients, custom op."""

import pytest
import torch

import gemslib
from helpers import (DEVICE, DTYPES, ON_GPU, assert_device_side_assert, opcheck_overloads,
                     random_tensor)
from gemslib import runtime
from gemslib.accuracy import assert_close_to_reference
from gemslib.ops import rotary as rotary_ops

# (q shape, k heads, rot_dim / 2, positions kind)
CASES = [
    ((2, 5, 4, 16), 2, 8, None),          # (B, S, H, D), GQA, full rotary, default positions
    ((2, 5, 4, 16), 4, 6, "batch"),       # partial rotary (12 of 16), explicit (B, S) positions
    ((7, 3, 10), 1, 4, "tokens"),         # (T, H, D), MQA, odd head dim split 8 + 2
    ((1, 9, 3, 8), 3, 4, None),
    ((3, 1, 1, 2), 1, 1, "batch"),        # 1 token, 1 head, D = 2
    ((0, 4, 2, 8), 2, 4, None),           # empty
]
if ON_GPU:
    CASES += [((4, 1024, 32, 128), 8, 64, None), ((1, 4096, 40, 128), 8, 32, "batch")]


def _inputs(q_shape, k_heads, half, positions_kind, dtype):
    # default positions run to the sequence length (B, S, H, D) or token count (T, H, D)
    max_position = max(40, q_shape[-3])
    q = random_tensor(q_shape, dtype, scale=1.0)
    k = random_tensor((*q_shape[:-2], k_heads, q_shape[-1]), dtype, scale=1.0)
    angles = torch.rand(max_position, half, device=DEVICE) * 6.3
    cos, sin = angles.cos().to(dtype), angles.sin().to(dtype)
    positions = None
    if positions_kind is not None:
        positions = torch.randint(0, max_position, q_shape[:-2], device=DEVICE)
    return q, k, cos, sin, positions


def _reference(q, k, cos, sin, positions, interleaved):
    return rotary_ops.rotary_reference(q.double(), k.double(), cos.double(), sin.double(),
                                       positions, interleaved)


@pytest.mark.parametrize("interleaved", [False, True], ids=["neox", "gptj"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("q_shape,k_heads,half,positions_kind", CASES)
def test_matches_reference(q_shape, k_heads, half, positions_kind, dtype, interleaved):
    q, k, cos, sin, positions = _inputs(q_shape, k_heads, half, positions_kind, dtype)
    q_rot, k_rot = gemslib.apply_rotary(q, k, cos, sin, positions, interleaved)
    expected_q, expected_k = _reference(q, k, cos, sin, positions, interleaved)
    assert_close_to_reference(q_rot, expected_q, dtype, msg="q")
    assert_close_to_reference(k_rot, expected_k, dtype, msg="k")
    q_copy, k_copy = q.clone(), k.clone()
    result = gemslib.apply_rotary(q_copy, k_copy, cos, sin, positions, interleaved, inplace=True)
    assert result[0] is q_copy and result[1] is k_copy
    torch.testing.assert_close(q_copy, q_rot, rtol=0, atol=0)
    torch.testing.assert_close(k_copy, k_rot, rtol=0, atol=0)


def test_transposed_head_major_views_need_no_copy():
    q = random_tensor((2, 4, 6, 16), torch.float32).transpose(1, 2)  # (B, H, S, D) storage
    k = random_tensor((2, 2, 6, 16), torch.float32).transpose(1, 2)
    angles = torch.rand(6, 8, device=DEVICE) * 6.3
    q_rot, k_rot = gemslib.apply_rotary(q, k, angles.cos(), angles.sin())
    assert q_rot.stride() == q.stride()
    expected_q, expected_k = _reference(q, k, angles.cos(), angles.sin(), None, False)
    assert_close_to_reference(q_rot, expected_q, torch.float32)
    assert_close_to_reference(k_rot, expected_k, torch.float32)
    gemslib.apply_rotary(q, k, angles.cos(), angles.sin(), inplace=True)
    assert_close_to_reference(q, expected_q, torch.float32)


def test_a_slice_of_a_fused_qkv_projection():
    qkv = random_tensor((3, 5, 4 + 2 + 2, 16), torch.float32)
    q, k = qkv[:, :, :4], qkv[:, :, 4:6]
    angles = torch.rand(5, 8, device=DEVICE) * 6.3
    expected_q, expected_k = _reference(q, k, angles.cos(), angles.sin(), None, True)
    gemslib.apply_rotary(q, k, angles.cos(), angles.sin(), interleaved=True, inplace=True)
    assert_close_to_reference(qkv[:, :, :4], expected_q, torch.float32)
    assert_close_to_reference(qkv[:, :, 4:6], expected_k, torch.float32)


@pytest.mark.parametrize("interleaved", [False, True], ids=["neox", "gptj"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_gradients_are_the_inverse_rotation(dtype, interleaved):
    q, k, cos, sin, positions = _inputs((2, 5, 4, 16), 2, 6, "batch", dtype)
    _assert_gradients_are_float64_autograd_s(q, k, cos, sin, positions, interleaved, dtype)


def _assert_gradients_are_float64_autograd_s(q, k, cos, sin, positions, interleaved, dtype):
    """dq and dk of apply_rotary for random incoming gradients, against autograd through the
    float64 reference; returns (q, k, grad_q, grad_k) with q.grad and k.grad set."""
    q.requires_grad_()
    k.requires_grad_()
    grad_q, grad_k = random_tensor(q.shape, dtype), random_tensor(k.shape, dtype)
    q_rot, k_rot = gemslib.apply_rotary(q, k, cos, sin, positions, interleaved)
    torch.autograd.backward([q_rot, k_rot], [grad_q, grad_k])
    q64, k64 = q.detach().double().requires_grad_(), k.detach().double().requires_grad_()
    ref_q, ref_k = rotary_ops.rotary_reference(q64, k64, cos.double(), sin.double(), positions,
                                               interleaved)
    torch.autograd.backward([ref_q, ref_k], [grad_q.double(), grad_k.double()])
    assert_close_to_reference(q.grad, q64.grad, dtype, msg="dq")
    assert_close_to_reference(k.grad, k64.grad, dtype, msg="dk")
    return q, k, grad_q, grad_k


def test_bad_input_names_the_argument():
    q, k, cos, sin, _ = _inputs((2, 5, 4, 16), 2, 8, None, torch.float32)
    with pytest.raises(ValueError, match="must agree on the token dims and the head dim"):
        gemslib.apply_rotary(q, k[:, :4], cos, sin)
    with pytest.raises(ValueError, match="rot_dim = 2 \\* cos.shape\\[1\\] = 20 exceeds the head dim 16"):
        gemslib.apply_rotary(q, k, torch.ones(40, 10, device=DEVICE), torch.ones(40, 10, device=DEVICE))
    with pytest.raises(ValueError, match="cos and sin must both be"):
        gemslib.apply_rotary(q, k, cos, sin[:, :4])
    with pytest.raises(TypeError, match="positions must be an integer tensor"):
        gemslib.apply_rotary(q, k, cos, sin, torch.zeros(2, 5, device=DEVICE))
    with pytest.raises(ValueError, match=r"positions must have shape \(2, 5\)"):
        gemslib.apply_rotary(q, k, cos, sin, torch.zeros(5, dtype=torch.long, device=DEVICE))
    with pytest.raises(ValueError, match="5 positions need cos/sin with at least that many rows"):
        gemslib.apply_rotary(q, k, cos[:3], sin[:3])
    with pytest.raises(ValueError, match="k must be torch.float32"):
        gemslib.apply_rotary(q, k.half(), cos, sin)
    with pytest.raises(RuntimeError, match="inplace=True cannot be used"):
        gemslib.apply_rotary(q.clone().requires_grad_(), k, cos, sin, inplace=True)


def test_float64_falls_back_to_torch():
    q, k, cos, sin, positions = _inputs((2, 3, 2, 8), 1, 4, "batch", torch.float64)
    q_rot, k_rot = gemslib.apply_rotary(q, k, cos, sin, positions)
    expected_q, expected_k = _reference(q, k, cos, sin, positions, False)
    torch.testing.assert_close(q_rot, expected_q)
    torch.testing.assert_close(k_rot, expected_k)


def test_custom_op_passes_opcheck():
    # two tokens a sequence: opcheck calls the op (in the interpreter on the CPU) some dozen
    # times, forward and backward, to check its registrations (the values against the
    # reference are the tests' above)
    q, k, cos, sin, positions = _inputs((2, 2, 4, 16), 2, 6, "batch", torch.float32)
    for interleaved in (False, True):
        opcheck_overloads(torch.ops.gemslib.rotary,
                          (q.requires_grad_(), k.requires_grad_(), cos, sin, positions,
                           interleaved, False))


def test_traces_under_torch_compile_fullgraph():
    q, k, cos, sin, positions = _inputs((2, 5, 4, 16), 2, 8, "batch", torch.float32)

    def attention_inputs(q, k):
        q_rot, k_rot = gemslib.apply_rotary(q, k, cos, sin, positions)
        return (q_rot * 2.0).sum() + (k_rot * k_rot).sum()

    compiled = torch.compile(attention_inputs, fullgraph=True,
                             backend="inductor" if ON_GPU else "aot_eager")
    q.requires_grad_()
    k.requires_grad_()
    compiled(q, k).backward()
    q64, k64 = q.detach().double().requires_grad_(), k.detach().double().requires_grad_()
    ref_q, ref_k = rotary_ops.rotary_reference(q64, k64, cos.double(), sin.double(), positions)
    ((ref_q * 2.0).sum() + (ref_k * ref_k).sum()).backward()
    assert_close_to_reference(q.grad, q64.grad, torch.float32)
    assert_close_to_reference(k.grad, k64.grad, torch.float32)


def test_in_place_on_views_of_one_buffer_compiles_fullgraph():
    """q and k as views of a fused QKV projection, rotated in place inside a compiled
    function: the compiler sees the writes (the buffer afterwards holds the rotated values)."""
    heads, kv_heads, dim = 4, 2, 16
    _, _, cos, sin, positions = _inputs((2, 5, heads, dim), kv_heads, 8, "batch", torch.float32)
    qkv = random_tensor((2, 5, (heads + 2 * kv_heads) * dim), torch.float32)
    expected_q, expected_k = rotary_ops.rotary_reference(
        qkv[..., :heads * dim].view(2, 5, heads, dim).double(),
        qkv[..., heads * dim:(heads + kv_heads) * dim].view(2, 5, kv_heads, dim).double(),
        cos.double(), sin.double(), positions)

    def rotate_projection(qkv):
        q = qkv[..., :heads * dim].view(2, 5, heads, dim)
        k = qkv[..., heads * dim:(heads + kv_heads) * dim].view(2, 5, kv_heads, dim)
        gemslib.apply_rotary(q, k, cos, sin, positions, inplace=True)
        return qkv * 1.0

    compiled = torch.compile(rotate_projection, fullgraph=True,
                             backend="inductor" if ON_GPU else "aot_eager")
    untouched_v = qkv[..., (heads + kv_heads) * dim:].clone()
    result = compiled(qkv)
    for rotated in (result, qkv):  # the returned value and the mutated input
        assert_close_to_reference(rotated[..., :heads * dim].view(2, 5, heads, dim),
                                  expected_q, torch.float32)
        assert_close_to_reference(
            rotated[..., heads * dim:(heads + kv_heads) * dim].view(2, 5, kv_heads, dim),
            expected_k, torch.float32)
        assert torch.equal(rotated[..., (heads + kv_heads) * dim:], untouched_v)


@pytest.mark.parametrize("block_h", [2, 8])
@pytest.mark.parametrize("loop_heads", [0, 1], ids=["head-blocks-in-grid", "heads-looped"])
@pytest.mark.parametrize("interleaved", [False, True], ids=["neox", "gptj"])
def test_both_program_layouts_match_reference(loop_heads, interleaved, block_h):
    """Head blocks spread over the grid or looped inside one program per token: BLOCK_H 2 with
    5 query heads and 3 key heads leaves a partial last block of each, and k runs out of
    blocks before q in the looped layout; BLOCK_H 8 takes each token's q and k in one step."""
    q, k, cos, sin, positions = _inputs((2, 4, 5, 12), 3, 4, "batch", torch.float32)
    config = runtime.LaunchConfig((("BLOCK_H", block_h), ("LOOP_HEADS", loop_heads)), 2, 1)
    with rotary_ops.ROTARY.forced(config):
        q_rot, k_rot = gemslib.apply_rotary(q, k, cos, sin, positions, interleaved)
    expected_q, expected_k = _reference(q, k, cos, sin, positions, interleaved)
    assert_close_to_reference(q_rot, expected_q, torch.float32)
    assert_close_to_reference(k_rot, expected_k, torch.float32)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("table", ["half, positions", "full"])
@pytest.mark.parametrize("block_h, loop_heads", [(2, 0), (2, 1), (8, 1)],
                         ids=["head-blocks-in-grid", "heads-looped", "one-step"])
@pytest.mark.parametrize("interleaved", [False, True], ids=["neox", "gptj"])
def test_rotary_with_the_heads_rms_normalised_first(interleaved, block_h, loop_heads, table,
                                                    dtype):
    """rotary_qk_norm (the graph passes' fusion of Qwen3's per-head q/k norm): each head of q
    and k normalised over head_dim with its own weight, then rotated, in both program layouts
    (partial last head blocks), q a head-major transposed view, against float64."""
    batch, seq, q_heads, k_heads, dim = 2, 5, 5, 3, 16
    q = random_tensor((batch, q_heads, seq, dim), dtype, scale=3.0).transpose(1, 2)
    k = random_tensor((batch, seq, k_heads, dim), dtype, scale=3.0)
    if table == "full":
        angles = torch.rand(1, seq, dim, device=DEVICE, dtype=torch.float64) * 6.3
        positions = None
    else:
        angles = torch.rand(20, dim // 2, device=DEVICE, dtype=torch.float64) * 6.3
        positions = torch.randint(0, 20, (batch, seq), device=DEVICE)
    cos, sin = angles.cos().to(dtype), angles.sin().to(dtype)
    q_weight, k_weight = (random_tensor((dim,), dtype, scale=0.5) + 1 for _ in range(2))
    config = runtime.LaunchConfig((("BLOCK_H", block_h), ("LOOP_HEADS", loop_heads)), 2, 1)
    with rotary_ops.ROTARY.forced(config):
        q_rot, k_rot = torch.ops.gemslib.rotary_qk_norm(q, k, cos, sin, positions, interleaved,
                                                        q_weight, k_weight, 1e-6)
    expected = rotary_ops.rotary_qk_norm_reference(
        q.double(), k.double(), cos.double(), sin.double(), positions, interleaved,
        q_weight.double(), k_weight.double(), 1e-6)
    assert q_rot.shape == q.shape and k_rot.shape == k.shape
    assert_close_to_reference(q_rot, expected[0], dtype, reduction_len=dim)
    assert_close_to_reference(k_rot, expected[1], dtype, reduction_len=dim)


@pytest.mark.parametrize("dtype", DTYPES)
def test_rotary_qk_norm_scales_by_offset_plus_weight(dtype):
    """Gemma-3's (1 + w) per-head norm: weight_offset 1 scales each head by 1 + weight, against
    float64, in both layouts of the launch (one head block a program, and looped heads)."""
    q = random_tensor((2, 5, 4, 32), dtype, scale=3.0)
    k = random_tensor((2, 5, 2, 32), dtype, scale=3.0)
    angles = torch.rand(1, 5, 32, device=DEVICE, dtype=torch.float64) * 6.3
    cos, sin = angles.cos().to(dtype), angles.sin().to(dtype)
    q_weight, k_weight = (random_tensor((32,), dtype, scale=0.5) for _ in range(2))
    args64 = (q.double(), k.double(), cos.double(), sin.double(), None, False,
              q_weight.double(), k_weight.double(), 1e-6)
    expected = rotary_ops.rotary_qk_norm_reference(*args64, 1.0)
    for loop_heads in (0, 1):
        config = runtime.LaunchConfig((("BLOCK_H", 2), ("LOOP_HEADS", loop_heads)), 2, 1)
        with rotary_ops.ROTARY.forced(config):
            q_rot, k_rot = torch.ops.gemslib.rotary_qk_norm(q, k, cos, sin, None, False,
                                                            q_weight, k_weight, 1e-6, 1.0)
        assert_close_to_reference(q_rot, expected[0], dtype, reduction_len=32)
        assert_close_to_reference(k_rot, expected[1], dtype, reduction_len=32)
    without = rotary_ops.rotary_qk_norm_reference(*args64)
    assert (expected[0] - without[0]).abs().max() > 0.1  # the offset is not a no-op here


def test_rotary_qk_norm_passes_opcheck_and_falls_back_for_float64():
    q, k = random_tensor((2, 3, 4, 8), torch.float32), random_tensor((2, 3, 2, 8), torch.float32)
    angles = torch.rand(1, 3, 8, device=DEVICE)
    weights = (random_tensor((8,), torch.float32) + 1, random_tensor((8,), torch.float32) + 1)
    opcheck_overloads(torch.ops.gemslib.rotary_qk_norm,
                      (q, k, angles.cos(), angles.sin(), None, False, *weights, 1e-6),
                      test_utils=("test_schema", "test_faketensor"))
    q64, k64 = q.double(), k.double()
    got = torch.ops.gemslib.rotary_qk_norm(q64, k64, angles.cos().double(),
                                           angles.sin().double(), None, False,
                                           *(w.double() for w in weights), 1e-6)
    expected = rotary_ops.rotary_qk_norm_reference(q64, k64, angles.cos().double(),
                                                   angles.sin().double(), None, False,
                                                   *(w.double() for w in weights), 1e-6)
    for g, e in zip(got, expected):
        torch.testing.assert_close(g, e, rtol=0, atol=0)


_BAD_POSITION_ON_GPU = r"""
import torch, gemslib
q = torch.randn(1, 3, 2, 16, device="cuda")
k = torch.randn(1, 3, 1, 16, device="cuda")
angles = torch.rand(10, 8, device="cuda")
gemslib.apply_rotary(q, k, angles.cos(), angles.sin(),
                     positions=torch.tensor([[0, POSITION, 2]], device="cuda"))
torch.cuda.synchronize()
"""


@pytest.mark.parametrize("position", [10, -1, 100000])
def test_positions_outside_the_table_are_an_error(position):
    """A position outside [0, cos.shape[0]) never reads outside cos/sin: on the CPU an
    IndexError naming positions; on a GPU the kernel's device-side assert (in a subprocess:
    it leaves the CUDA context unusable)."""
    if ON_GPU:
        assert_device_side_assert(_BAD_POSITION_ON_GPU.replace("POSITION", str(position)),
                                  "positions must be in [0, cos.shape[0])")
        return
    q, k, cos, sin, _ = _inputs((1, 3, 2, 16), 1, 8, None, torch.float32)
    positions = torch.tensor([[0, position, 2]])
    for call in (lambda: gemslib.apply_rotary(q, k, cos[:10], sin[:10], positions=positions),
                 lambda: gemslib.apply_rotary(q.clone(), k.clone(), cos[:10], sin[:10],
                                              positions=positions, inplace=True),
                 lambda: gemslib.apply_rotary(q.double(), k.double(), cos[:10].double(),
                                              sin[:10].double(), positions=positions)):
        with pytest.raises(IndexError, match=r"positions must be in \[0, 10\)"):
            call()


def test_in_place_rotation_of_shared_memory_is_an_error():
    q, k, cos, sin, _ = _inputs((1, 3, 2, 16), 2, 8, None, torch.float32)
    with pytest.raises(ValueError, match="q and k that do not share memory"):
        gemslib.apply_rotary(q, q, cos, sin, inplace=True)
    with pytest.raises(ValueError, match="overlapping elements"):
        gemslib.apply_rotary(q[:, :, :1].expand(1, 3, 2, 16), k, cos, sin, inplace=True)
    # out of place, shared inputs are only read: both rotate alike
    q_rot, k_rot = gemslib.apply_rotary(q, q, cos, sin)
    expected, _ = _reference(q, q, cos, sin, None, False)
    assert_close_to_reference(q_rot, expected, torch.float32)
    assert_close_to_reference(k_rot, expected, torch.float32)


@pytest.mark.parametrize("argument", ["interleaved", "inplace"])
@pytest.mark.parametrize("value", [1, "yes", None])
def test_flags_must_be_bools_as_torch_requires(argument, value):
    q, k, cos, sin, _ = _inputs((1, 3, 2, 16), 1, 8, None, torch.float32)
    with pytest.raises(TypeError, match=f"argument '{argument}' must be bool"):
        gemslib.apply_rotary(q, k, cos, sin, **{argument: value})


# --------------------------------------------------------------------------------------------
# The full per-token table (B or 1, S, rot_dim), as transformers' models compute it
# --------------------------------------------------------------------------------------------

# (q shape, k heads, rot_dim, table batch); odd sizes, GQA, partial rotary, a batch-1 table
FULL_CASES = [
    ((3, 5, 4, 16), 2, 16, "B"),
    ((3, 5, 4, 16), 2, 16, 1),
    ((2, 7, 3, 10), 1, 6, "B"),         # partial rotary (6 of 10), MQA
    ((1, 9, 5, 6), 5, 6, 1),
    ((11, 3, 12), 2, 12, 1),            # (T, H, D) with a (1, T, rot_dim) table
    ((0, 4, 2, 8), 2, 8, 1),            # empty
]


def _full_table_inputs(q_shape, k_heads, rot_dim, table_batch, dtype, strided=False):
    """q, k and a full table whose halves differ (nothing duplicated): the kernel must read
    the angle of each feature. ``strided``: the table is a slice of a wider buffer."""
    q = random_tensor(q_shape, dtype, scale=1.0)
    k = random_tensor((*q_shape[:-2], k_heads, q_shape[-1]), dtype, scale=1.0)
    batch, seq = (q_shape[0], q_shape[1]) if len(q_shape) == 4 else (1, q_shape[0])
    rows = batch if table_batch == "B" else 1
    width = rot_dim + 5 if strided else rot_dim
    angles = torch.rand(rows, seq, width, device=DEVICE) * 6.3
    cos, sin = angles.cos().to(dtype)[..., :rot_dim], angles.sin().to(dtype)[..., 3:3 + rot_dim] \
        if strided else angles.sin().to(dtype)
    return q, k, cos, sin


def _model_formula(x, cos, sin):
    """transformers' q * cos + rotate_half(q) * sin on (B, H, S, D) in float64, cos (B|1, S, D)."""
    x = x.double()
    cos, sin = cos.double().unsqueeze(1), sin.double().unsqueeze(1)
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


@pytest.mark.parametrize("interleaved", [False, True], ids=["neox", "gptj"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("q_shape,k_heads,rot_dim,table_batch", FULL_CASES)
def test_full_table_matches_reference(q_shape, k_heads, rot_dim, table_batch, dtype, interleaved):
    q, k, cos, sin = _full_table_inputs(q_shape, k_heads, rot_dim, table_batch, dtype)
    q_rot, k_rot = gemslib.apply_rotary(q, k, cos, sin, interleaved=interleaved)
    expected_q, expected_k = _reference(q, k, cos, sin, None, interleaved)
    assert_close_to_reference(q_rot, expected_q, dtype, msg="q")
    assert_close_to_reference(k_rot, expected_k, dtype, msg="k")
    q_copy, k_copy = q.clone(), k.clone()
    gemslib.apply_rotary(q_copy, k_copy, cos, sin, interleaved=interleaved, inplace=True)
    torch.testing.assert_close(q_copy, q_rot, rtol=0, atol=0)
    torch.testing.assert_close(k_copy, k_rot, rtol=0, atol=0)


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_full_table_is_the_model_formula_on_head_major_views(dtype):
    """(B, H, S, D) q and k passed as transposed views, a strided batch-B table whose halves
    differ: the result is transformers' formula, and keeps the views' layout."""
    q = random_tensor((3, 7, 5, 12), dtype, scale=1.0).transpose(1, 2)   # (B, H, S, D) view
    k = random_tensor((3, 7, 2, 12), dtype, scale=1.0).transpose(1, 2)
    _, _, cos, sin = _full_table_inputs((3, 7, 5, 12), 2, 12, "B", dtype, strided=True)
    assert cos.stride(-1) == 1 and not cos.is_contiguous() and not sin.is_contiguous()
    q_rot, k_rot = gemslib.apply_rotary(q.transpose(1, 2), k.transpose(1, 2), cos, sin)
    assert q_rot.transpose(1, 2).stride() == q.stride()
    assert_close_to_reference(q_rot.transpose(1, 2), _model_formula(q, cos, sin), dtype, msg="q")
    assert_close_to_reference(k_rot.transpose(1, 2), _model_formula(k, cos, sin), dtype, msg="k")


@pytest.mark.parametrize("loop_heads", [0, 1], ids=["head-blocks-in-grid", "heads-looped"])
@pytest.mark.parametrize("interleaved", [False, True], ids=["neox", "gptj"])
def test_full_table_in_both_program_layouts(loop_heads, interleaved):
    q, k, cos, sin = _full_table_inputs((2, 4, 5, 12), 3, 8, "B", torch.float32)
    config = runtime.LaunchConfig((("BLOCK_H", 2), ("LOOP_HEADS", loop_heads)), 2, 1)
    with rotary_ops.ROTARY.forced(config):
        q_rot, k_rot = gemslib.apply_rotary(q, k, cos, sin, interleaved=interleaved)
    expected_q, expected_k = _reference(q, k, cos, sin, None, interleaved)
    assert_close_to_reference(q_rot, expected_q, torch.float32)
    assert_close_to_reference(k_rot, expected_k, torch.float32)


@pytest.mark.parametrize("interleaved", [False, True], ids=["neox", "gptj"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
@pytest.mark.parametrize("table_batch", ["B", 1])
def test_full_table_gradients_are_the_transposed_rotation(table_batch, dtype, interleaved):
    """With halves that differ the transpose is not the rotation by -sin: dq must be autograd's
    of the float64 forward."""
    q, k, cos, sin = _full_table_inputs((2, 5, 3, 14), 2, 10, table_batch, dtype)
    q, k, grad_q, _ = _assert_gradients_are_float64_autograd_s(q, k, cos, sin, None,
                                                               interleaved, dtype)
    # differentiable backward: dq is linear in grad_q, and its own backward (the transpose of
    # the transpose) is the forward rotation
    q2, grad_q2 = q.detach().requires_grad_(), grad_q.detach().requires_grad_()
    q_rot2, _ = gemslib.apply_rotary(q2, k.detach(), cos, sin, interleaved=interleaved)
    (dq,) = torch.autograd.grad(q_rot2, q2, grad_q2, create_graph=True)
    vector = random_tensor(q.shape, dtype)
    (again,) = torch.autograd.grad(dq, grad_q2, vector)
    expected, _ = _reference(vector, k, cos, sin, None, interleaved)
    assert_close_to_reference(again, expected, dtype, msg="second order")


def test_full_table_float64_falls_back_to_torch():
    q, k, cos, sin = _full_table_inputs((2, 3, 2, 8), 1, 8, "B", torch.float64)
    q_rot, k_rot = gemslib.apply_rotary(q, k, cos, sin)
    torch.testing.assert_close(q_rot, _model_formula(q.transpose(1, 2), cos, sin).transpose(1, 2))
    torch.testing.assert_close(k_rot, _model_formula(k.transpose(1, 2), cos, sin).transpose(1, 2))


def test_full_table_bad_input_names_the_argument():
    q, k, cos, sin = _full_table_inputs((2, 5, 4, 16), 2, 16, "B", torch.float32)
    with pytest.raises(ValueError, match=r"per-token cos/sin table for q \(2, 5, 4, 16\) must be "
                                         r"\(2 or 1, 5, rot_dim\), got \(3, 5, 16\)"):
        gemslib.apply_rotary(q, k, *(torch.ones(3, 5, 16, device=q.device),) * 2)
    with pytest.raises(ValueError, match=r"must be \(2 or 1, 5, rot_dim\), got \(2, 4, 16\)"):
        gemslib.apply_rotary(q, k, cos[:, :4], sin[:, :4])
    with pytest.raises(ValueError, match="rot_dim = cos.shape\\[2\\] must be even and at most "
                                         "the head dim 16, got 7"):
        gemslib.apply_rotary(q, k, cos[..., :7], sin[..., :7])
    with pytest.raises(ValueError, match="got 18"):
        gemslib.apply_rotary(q, k, *(torch.ones(2, 5, 18, device=q.device),) * 2)
    with pytest.raises(ValueError, match="so positions must be None"):
        gemslib.apply_rotary(q, k, cos, sin, torch.zeros(2, 5, dtype=torch.long, device=q.device))
    with pytest.raises(ValueError, match=r"cos and sin must both be \(max_position, rot_dim // 2\) "
                                         r"or \(B or 1, S, rot_dim\), got \(2, 5, 16\) and \(5, 16\)"):
        gemslib.apply_rotary(q, k, cos, sin[0])
    with pytest.raises(ValueError, match="cos and sin must both be"):
        gemslib.apply_rotary(q, k, cos[None], sin[None])


def test_full_table_custom_op_passes_opcheck():
    for table_batch in ("B", 1):
        q, k, cos, sin = _full_table_inputs((2, 2, 4, 16), 2, 12, table_batch, torch.float32)
        for interleaved in (False, True):
            opcheck_overloads(torch.ops.gemslib.rotary,
                              (q.requires_grad_(), k.requires_grad_(), cos, sin, None,
                               interleaved, False))


# --------------------------------------------------------------------------------------------
# rotary_into_cache: a decode step's rotary and its static cache's update in one launch
# --------------------------------------------------------------------------------------------

# (B, S, Hq, Hk, D, rot_dim, cache length, table batch)
CACHE_CASES = [
    (2, 1, 4, 2, 16, 16, 9, "B"),        # a decode step, GQA
    (3, 5, 6, 3, 10, 10, 12, 1),         # several tokens (a prefill into the cache), D = 10
    (2, 3, 4, 1, 12, 8, 7, "B"),         # MQA, partial rotary: k's last 4 features copied
    (1, 1, 1, 1, 2, 2, 1, 1),            # one row of one head
    (2, 0, 4, 2, 8, 8, 5, 1),            # no tokens: the caches stay as they were
]
if ON_GPU:
    CACHE_CASES += [(16, 1, 32, 8, 128, 128, 4096, "B"), (4, 64, 28, 4, 128, 128, 512, 1)]


def _cache_inputs(batch, seq, q_heads, k_heads, head_dim, rot_dim, length, table_batch, dtype):
    """q, k, v as (B, S, H, D) views of head-major tensors (as a model's projections give
    them), a per-token table with unequal halves, caches full of old values, and distinct
    rows of the cache for the tokens."""
    def head_major(heads):
        return random_tensor((batch, heads, seq, head_dim), dtype, scale=1.0).transpose(1, 2)

    rows = batch if table_batch == "B" else 1
    angles = torch.rand(rows, seq, rot_dim, device=DEVICE) * 6.3
    caches = [random_tensor((batch, k_heads, length, head_dim), dtype) for _ in range(2)]
    positions = torch.randperm(length, device=DEVICE)[:seq]
    return (head_major(q_heads), head_major(k_heads), head_major(k_heads),
            angles.cos().to(dtype), angles.sin().to(dtype), positions, *caches)


def _cache_reference(q, k, v, cos, sin, interleaved, positions, k_cache, v_cache):
    """q rotated, and the caches after the update, in float64."""
    k_ref, v_ref = k_cache.double(), v_cache.double()
    q_ref = rotary_ops.rotary_into_cache_reference(
        q.double(), k.double(), v.double(), cos.double(), sin.double(), interleaved, positions,
        k_ref, v_ref)
    return q_ref, k_ref, v_ref


@pytest.mark.parametrize("interleaved", [False, True], ids=["neox", "gptj"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", CACHE_CASES)
def test_rotary_into_cache_matches_reference(case, dtype, interleaved):
    """q rotated into a new tensor; k rotated (its features past rot_dim as they were) and v
    written into the caches at the tokens' rows; every other row of the caches untouched."""
    q, k, v, cos, sin, positions, k_cache, v_cache = _cache_inputs(*case, dtype)
    q_ref, k_ref, v_ref = _cache_reference(q, k, v, cos, sin, interleaved, positions, k_cache,
                                           v_cache)
    q_rot = torch.ops.gemslib.rotary_into_cache(q, k, v, cos, sin, interleaved, positions,
                                                k_cache, v_cache)
    assert_close_to_reference(q_rot, q_ref, dtype, msg="q")
    assert_close_to_reference(k_cache, k_ref, dtype, msg="k_cache")
    torch.testing.assert_close(v_cache, v_ref.to(dtype), rtol=0, atol=0, msg="v_cache")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", [CACHE_CASES[0], CACHE_CASES[1], CACHE_CASES[2]],
                         ids=["decode", "tokens", "partial-rotary"])
@pytest.mark.parametrize("offset", [0.0, 1.0], ids=["w", "1+w"])
def test_rotary_into_cache_with_the_per_head_qk_norm_matches_reference(case, dtype, offset):
    """With q_weight and k_weight (Qwen3's per-head q/k RMSNorm; Gemma-3's (1 + w) with
    weight_offset 1), each head of q and k is normalised and scaled before it is rotated; the
    caches get the normed, rotated k and v as it was. A partial rotary (rot_dim < D) is
    computed by torch, to the same result."""
    q, k, v, cos, sin, positions, k_cache, v_cache = _cache_inputs(*case, dtype)
    head_dim, eps = q.shape[-1], 1e-6
    q_weight, k_weight = (random_tensor((head_dim,), dtype, scale=1.0) for _ in range(2))
    k_ref, v_ref = k_cache.double(), v_cache.double()
    q_ref = rotary_ops.rotary_into_cache_reference(
        q.double(), k.double(), v.double(), cos.double(), sin.double(), False, positions,
        k_ref, v_ref, q_weight.double(), k_weight.double(), eps, offset)
    q_rot = torch.ops.gemslib.rotary_into_cache(q, k, v, cos, sin, False, positions, k_cache,
                                                v_cache, q_weight, k_weight, eps, offset)
    assert_close_to_reference(q_rot, q_ref, dtype, reduction_len=head_dim, msg="q")
    assert_close_to_reference(k_cache, k_ref, dtype, reduction_len=head_dim, msg="k_cache")
    torch.testing.assert_close(v_cache, v_ref.to(dtype), rtol=0, atol=0, msg="v_cache")
    unnormed = rotary_ops.rotary_into_cache_reference(
        q.double(), k.double(), v.double(), cos.double(), sin.double(), False, positions,
        k_cache.double().clone(), v_cache.double().clone())
    assert (q_ref - unnormed).abs().max() > 0.1  # the norm is not a no-op on these inputs


@pytest.mark.parametrize("block_h", [2, 8])
@pytest.mark.parametrize("loop_heads", [0, 1], ids=["head-blocks-in-grid", "heads-looped"])
def test_rotary_into_cache_in_both_program_layouts(loop_heads, block_h):
    """BLOCK_H 2 with 5 query heads and 3 key heads leaves partial blocks of k and v heads,
    and k and v run out of blocks before q in the looped layout."""
    q, k, v, cos, sin, positions, k_cache, v_cache = _cache_inputs(2, 3, 5, 3, 12, 12, 6, "B",
                                                                   torch.float32)
    q_ref, k_ref, v_ref = _cache_reference(q, k, v, cos, sin, False, positions, k_cache, v_cache)
    config = runtime.LaunchConfig((("BLOCK_H", block_h), ("LOOP_HEADS", loop_heads)), 2, 1)
    with rotary_ops.ROTARY.forced(config):
        q_rot = torch.ops.gemslib.rotary_into_cache(q, k, v, cos, sin, False, positions,
                                                    k_cache, v_cache)
    assert_close_to_reference(q_rot, q_ref, torch.float32)
    assert_close_to_reference(k_cache, k_ref, torch.float32)
    torch.testing.assert_close(v_cache, v_ref.float(), rtol=0, atol=0)


def test_rotary_into_cache_passes_opcheck():
    """The schema's mutations (k_cache, v_cache) and the fake are what the op does."""
    for interleaved in (False, True):
        args = _cache_inputs(2, 2, 4, 2, 16, 16, 5, "B", torch.float32)
        q, k, v, cos, sin, positions, k_cache, v_cache = args
        opcheck_overloads(torch.ops.gemslib.rotary_into_cache,
                          (q, k, v, cos, sin, interleaved, positions, k_cache, v_cache))
    weights = [torch.randn(16, device=q.device) for _ in range(2)]
    opcheck_overloads(torch.ops.gemslib.rotary_into_cache,
                      (q, k, v, cos, sin, False, positions, k_cache, v_cache, *weights, 1e-6))


def test_rotary_into_cache_bad_input_names_the_argument():
    q, k, v, cos, sin, positions, k_cache, v_cache = _cache_inputs(2, 2, 4, 2, 16, 16, 5, "B",
                                                                   torch.float32)
    op = torch.ops.gemslib.rotary_into_cache

    def call(**changed):
        args = dict(q=q, k=k, v=v, cos=cos, sin=sin, interleaved=False,
                    cache_position=positions, k_cache=k_cache, v_cache=v_cache)
        args.update(changed)
        return op(*args.values())

    with pytest.raises(ValueError, match="rotary_into_cache: k_cache must be"):
        call(k_cache=k_cache[:, :1])
    with pytest.raises(ValueError, match="v must have k's shape"):
        call(v=v[:, :, :1])
    with pytest.raises(ValueError, match="v_cache must be torch.float32"):
        call(v_cache=v_cache.half())
    with pytest.raises(ValueError, match="per-token"):
        call(cos=cos[0], sin=sin[0])
    with pytest.raises(TypeError, match=r"cache_position must be \(2,\) integers"):
        call(cache_position=positions.float())
    with pytest.raises(TypeError, match=r"cache_position must be \(2,\) integers"):
        call(cache_position=positions[:1])
    with pytest.raises(ValueError, match="k_cache and v_cache share memory"):
        call(v_cache=k_cache)
    weight = torch.ones(16, device=DEVICE)
    with pytest.raises(ValueError, match="q_weight and k_weight go together"):
        op(q, k, v, cos, sin, False, positions, k_cache, v_cache, weight, None, 1e-6)
    with pytest.raises(ValueError, match=r"k_weight must be \(16,\)"):
        op(q, k, v, cos, sin, False, positions, k_cache, v_cache, weight, weight[:8], 1e-6)
    with pytest.raises(ValueError, match="q_weight must be torch.float32"):
        op(q, k, v, cos, sin, False, positions, k_cache, v_cache, weight.half(), weight, 1e-6)
    buffer = torch.randn(2, 4, 5, 16, device=DEVICE)
    with pytest.raises(ValueError, match="k_cache shares memory with k"):
        call(k=buffer[:, 2:4].transpose(1, 2)[:, :2], k_cache=buffer[:, :2])


_BAD_CACHE_ROW_ON_GPU = r"""
import torch, gemslib
k_cache, v_cache = torch.zeros(2, 2, 8, 16, device="cuda"), torch.zeros(2, 2, 8, 16, device="cuda")
q, k, v = torch.randn(2, 1, 4, 16, device="cuda"), torch.randn(2, 1, 2, 16, device="cuda"), torch.randn(2, 1, 2, 16, device="cuda")
angles = torch.rand(2, 1, 16, device="cuda")
torch.ops.gemslib.rotary_into_cache(q, k, v, angles.cos(), angles.sin(), False,
                                    torch.tensor([ROW], device="cuda"), k_cache, v_cache)
torch.cuda.synchronize()
"""


@pytest.mark.parametrize("row", [8, -1])
def test_a_cache_row_outside_the_cache_is_an_error(row):
    """A cache_position outside [0, L) never writes outside the caches: on the CPU an
    IndexError; on a GPU the kernel's device-side assert (in a subprocess)."""
    if ON_GPU:
        assert_device_side_assert(_BAD_CACHE_ROW_ON_GPU.replace("ROW", str(row)),
                                  "cache_position must be in [0, the cache's length)")
        return
    q, k, v, cos, sin, _, k_cache, v_cache = _cache_inputs(2, 1, 4, 2, 16, 16, 8, "B",
                                                           torch.float32)
    before = k_cache.clone(), v_cache.clone()
    with pytest.raises(IndexError, match=r"cache_position must be in \[0, 8\)"):
        torch.ops.gemslib.rotary_into_cache(q, k, v, cos, sin, False,
                                            torch.tensor([row], device=DEVICE), k_cache, v_cache)
    assert torch.equal(k_cache, before[0]) and torch.equal(v_cache, before[1])
