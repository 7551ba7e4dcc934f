"""Every kernel launch the operators make compiles for Hopper (sm_90), checked on the CPU.

The interpreter runs kernels as Python, so it accepts code the compiler rejects (a plain float
global, a constexpr used where a value must be static, ...). This test records the launches of
representative calls under the interpreter (kernel, argument types, constexprs, num_warps) and
compiles each distinct one with Triton's real compiler for an sm_90 target, down to a cubin,
in a subprocess without ``TRITON_INTERPRET``. No GPU is needed for that.
"""

import json
import os
import subprocess
import sys
from collections.abc import Sequence

import pytest
import torch
from triton.runtime.interpreter import InterpretedFunction
from triton.tools.tensor_descriptor import TensorDescriptor

import gemslib
from helpers import ON_GPU, random_tensor
from gemslib import runtime
from gemslib.runtime import custom_op
from gemslib.fused import attention as attention_ops
from gemslib.fused import rms_norm_linear_silu as fused_ops
from gemslib.ops import rotary as rotary_ops
from gemslib.ops import softmax as softmax_ops

_SHORT_DTYPE = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16",
                torch.float64: "fp64", torch.int64: "i64", torch.int32: "i32",
                torch.int16: "i16", torch.int8: "i8", torch.uint8: "u8", torch.bool: "i1"}


def _describe(value):
    if isinstance(value, torch.Tensor):  # 16-byte aligned: the GPU's launch specialises on it
        return {"pointer": _SHORT_DTYPE[value.dtype], "aligned": value.data_ptr() % 16 == 0}
    if isinstance(value, TensorDescriptor):  # Triton's signature string for a host descriptor
        block = ", ".join(str(size) for size in value.block_shape)
        return {"descriptor": f"tensordesc<{_SHORT_DTYPE[value.base.dtype]}[{block}]>"}
    if isinstance(value, (bool, int, float)) or value is None:
        return {"value": value}
    raise TypeError(f"unexpected kernel argument {type(value).__name__}")


def _record_launches(monkeypatch, calls):
    """Run ``calls`` under the interpreter; return the distinct launches they made."""
    launches = {}
    original_run = InterpretedFunction.run

    def recording_run(self, *args, grid, warmup, **kwargs):
        named = dict(zip(self.arg_names, args))
        named.update(kwargs)
        record = {"module": self.fn.__module__, "kernel": self.fn.__name__,
                  "args": {name: _describe(v) for name, v in named.items()}}
        launches[json.dumps(record, sort_keys=True)] = record
        return original_run(self, *args, grid=grid, warmup=warmup, **kwargs)

    monkeypatch.setattr(InterpretedFunction, "run", recording_run)
    monkeypatch.setattr(custom_op, "interpret_bf16_dots", True)  # the launches, not the values
    for call in calls:
        call()
    return list(launches.values())


_COMPILER = r"""
import importlib, json, sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from triton.runtime.jit import JITFunction
import gemslib.registry
gemslib.registry.operators()  # imports every operator module

failures = []
for record in json.load(sys.stdin):
    kernel = getattr(importlib.import_module(record["module"]), record["kernel"])
    while not isinstance(kernel, JITFunction):  # unwrap triton.heuristics
        kernel = kernel.fn
    args = record["args"]
    options = {k: args.pop(k)["value"] for k in ("num_warps", "num_stages", "debug",
                                                 "sanitize_overflow", "launch_pdl") if k in args}
    # specialised as a launch on the GPU specialises: an int 1 becomes a constant, ints that
    # are multiples of 16 and 16-byte aligned pointers are marked divisible by 16 (what lets
    # loads vectorise and the pipeliner stage them in shared memory)
    signature, constexprs, attrs = {}, {}, {}
    for index, param in enumerate(kernel.params):
        arg = args.get(param.name, {"value": param.default})
        value = arg.get("value")
        if param.is_constexpr or ("value" in arg and value is None):
            signature[param.name] = "constexpr"
            constexprs[param.name] = value
        elif "pointer" in arg:
            signature[param.name] = "*" + arg["pointer"]
            if arg["aligned"] and not param.do_not_specialize_on_alignment:
                attrs[(index,)] = [["tt.divisibility", 16]]
        elif "descriptor" in arg:
            signature[param.name] = arg["descriptor"]
        elif isinstance(value, bool):
            signature[param.name] = "i1"
        elif isinstance(value, float):
            signature[param.name] = "fp32"
        elif value == 1 and not param.do_not_specialize:
            signature[param.name] = "constexpr"
            constexprs[param.name] = 1
        else:
            signature[param.name] = "i32" if -2**31 <= value < 2**31 else "i64"
            if value % 16 == 0 and not param.do_not_specialize:
                attrs[(index,)] = [["tt.divisibility", 16]]
    source = ASTSource(fn=kernel, signature=signature, constexprs=constexprs, attrs=attrs)
    try:
        compiled = triton.compile(source, target=GPUTarget("cuda", 90, 32), options=options)
        assert compiled.asm["cubin"], "no cubin"
        # the launch would fail with OutOfResources past sm_90's 227 KB per block
        assert compiled.metadata.shared <= 232448, f"{compiled.metadata.shared} B of shared memory"
        if constexprs.get("PDL"):  # launched dependent: it waits before it reads
            assert "griddepcontrol.wait" in compiled.asm["ptx"], "no griddepcontrol.wait"
            assert compiled.metadata.launch_pdl, "not compiled for launch_pdl"
        if constexprs.get("PDL_EARLY"):  # then lets the next kernel launch; GEMVs prefetch W
            ptx = compiled.asm["ptx"]
            assert "griddepcontrol.launch_dependents" in ptx, "no launch_dependents"
            assert ptx.index("griddepcontrol.wait") < ptx.index(
                "griddepcontrol.launch_dependents"), "dependents launched before the wait"
            if record["kernel"].startswith("_decode_gemv") and not constexprs.get("STREAM_K"):
                assert "prefetch.global.L2 " in ptx, "no prefetch of W"
                assert ptx.index("prefetch.global.L2") < ptx.index("griddepcontrol.wait"), (
                    "W prefetched after the wait")
    except Exception as err:
        failures.append(f"{record['kernel']} {constexprs} {options}:\n{err}")
print(json.dumps(failures))
"""


def _bf16(*shape):
    return random_tensor(shape, torch.bfloat16, scale=1.0)


def _backward(fn, *inputs, differentiable=None):
    """Forward and backward of ``fn``; the first ``differentiable`` inputs (default all) need grad."""
    count = len(inputs) if differentiable is None else differentiable
    inputs = [t.detach().requires_grad_(i < count) for i, t in enumerate(inputs)]
    out = fn(*inputs)
    out = out if isinstance(out, torch.Tensor) else out[0]
    out.backward(torch.randn_like(out))


def _looped_rotary(q, k, cos, sin):
    config = runtime.LaunchConfig((("BLOCK_H", 4), ("LOOP_HEADS", 1)), 2, 1)
    with rotary_ops.ROTARY.forced(config):
        return gemslib.apply_rotary(q, k, cos, sin)


def _split_softmax(x, chunk):
    config = runtime.LaunchConfig((("CHUNK", chunk),), 4, 1)
    with softmax_ops.SOFTMAX_SPLIT_FWD.forced(config):
        return gemslib.log_softmax(x)


def _fused_with_weight_descriptor(x, norm_weight, weight, split_k=1):
    config = runtime.LaunchConfig((("BLOCK_M", 128), ("BLOCK_N", 128), ("BLOCK_K", 64),
                                   ("GROUP_M", 8), ("USE_TMA", 1), ("SPLIT_K", 1),
                                   ("VENDOR_GEMM", 0)), 8, 3)
    if split_k > 1:  # the decode form: 16-row tiles, K split
        config = runtime.LaunchConfig((("BLOCK_M", 16), ("BLOCK_N", 64), ("BLOCK_K", 128),
                                       ("GROUP_M", 1), ("USE_TMA", 1), ("SPLIT_K", split_k),
                                       ("VENDOR_GEMM", 0)), 2, 3)
    with fused_ops.RMS_NORM_LINEAR_SILU.forced(config):
        return gemslib.rms_norm_linear_silu(x, norm_weight, weight)


def _stream_k_gemv(rows, gemv):
    """decode_gemv with a stream-K config, the norm prologue and both epilogues."""
    from gemslib.fused import decode_gemv as gemv_ops

    config = runtime.LaunchConfig((("BLOCK_N", 32), ("BLOCK_K", 256), ("SPLIT_K", 1),
                                   ("STREAM_K", 4), ("GEMV", gemv)), 4, 3)
    with gemv_ops.DECODE_GEMV.forced(config):
        gemslib.decode_gemv(_bf16(rows, 512), _bf16(100, 512), _bf16(100),
                            residual=_bf16(rows, 100), norm_weight=_bf16(512))


def _summed_at_end_gemv_rotary():
    from gemslib.fused import decode_gemv as gemv_ops

    config = runtime.LaunchConfig((("BLOCK_N", 8), ("BLOCK_K", 512), ("SPLIT_K", 2),
                                   ("GEMV", gemv_ops.SUM_AT_END_GEMV)), 4, 3)
    with gemv_ops.DECODE_GEMV_ROTARY.forced(config):
        _decode_gemv_rotary(_tensors_of(torch.bfloat16), 1, 4, 1024)


def _attention_with_descriptors(q, k, v, causal):
    config = runtime.LaunchConfig((("BLOCK_M", 64), ("BLOCK_N", 64), ("USE_TMA", 1), ("LAZY", 1)),
                                  4, 2)
    with attention_ops.ATTENTION_FWD.forced(config):
        return gemslib.attention(q, k, v, causal=causal)


def _looped_softmax(x):
    config = runtime.LaunchConfig((("BLOCK_M", 1), ("BLOCK_N", 64)), 4, 1)
    with softmax_ops.SOFTMAX_FWD.forced(config), softmax_ops.SOFTMAX_BWD.forced(config):
        _backward(gemslib.softmax, x)


def _rotary_into_cache(loop_heads):
    """rotary_into_cache at a decode step's shape (B2, one token, 4 q and 2 kv heads, D 128)."""
    config = runtime.LaunchConfig((("BLOCK_H", 2), ("LOOP_HEADS", loop_heads)), 4, 1)
    with rotary_ops.ROTARY.forced(config):
        torch.ops.gemslib.rotary_into_cache(
            _bf16(2, 1, 4, 128), _bf16(2, 1, 2, 128), _bf16(2, 1, 2, 128), _bf16(2, 1, 128),
            _bf16(2, 1, 128), False, torch.tensor([5]), _bf16(2, 2, 16, 128),
            _bf16(2, 2, 16, 128))


def _decode_gemv_rotary(tensors, rows, n_q_heads, n_in, head_dim=128):
    """decode_gemv_rotary of ``rows`` sequences (one token each, 2 kv heads of ``head_dim``):
    plain, and with the norm prologue, biases and the per-head q/k norm (tiles of whole
    heads), the interleaved pairs."""
    kv_heads = 2
    weights = [tensors(heads * head_dim, n_in) for heads in (n_q_heads, kv_heads, kv_heads)]
    caches = [tensors(rows, kv_heads, 16, head_dim) for _ in range(2)]
    table = [tensors(rows, 1, head_dim) for _ in range(2)]
    torch.ops.gemslib.decode_gemv_rotary(tensors(rows, n_in), weights, [None] * 3, None, 1e-6,
                                         0.0, *table, False, torch.tensor([5]), *caches,
                                         n_q_heads)
    torch.ops.gemslib.decode_gemv_rotary(
        tensors(rows, n_in), weights, [tensors(w.shape[0]) for w in weights], tensors(n_in),
        1e-6, 0.0, *table, True, torch.tensor([5]), *caches, n_q_heads, tensors(head_dim),
        tensors(head_dim), 1e-6, 1.0)


# Forward and backward of every operator, on the one-block and looped paths of row kernels,
# contiguous and strided, in bf16 (and fp32 where the kernel converts).
CALLS = [
    lambda: gemslib.silu(_bf16(3, 100)),
    lambda: gemslib.silu(_bf16(6, 10).t()),
    lambda: _backward(gemslib.silu, _bf16(3, 100)),
    lambda: _backward(gemslib.silu_and_mul, _bf16(3, 200)),
    lambda: gemslib.silu_and_mul(_bf16(3, 2 * 1100)),
    lambda: _backward(gemslib.rms_norm, _bf16(3, 100), _bf16(100)),
    lambda: _backward(gemslib.rms_norm, _bf16(2, 9000), _bf16(9000)),
    lambda: gemslib.rms_norm(_bf16(3, 100)),
    lambda: gemslib.add_rms_norm(_bf16(3, 100), _bf16(3, 100), _bf16(100)),
    lambda: gemslib.add_rms_norm(_bf16(3, 100), _bf16(3, 100), _bf16(100), inplace=True),
    lambda: _backward(gemslib.softmax, _bf16(3, 100)),
    lambda: _backward(gemslib.log_softmax, _bf16(2, 9000)),
    lambda: softmax_ops._forward(_bf16(3, 100), -1, False, torch.float32),  # fp32 output
    lambda: _looped_rotary(_bf16(2, 5, 4, 16), _bf16(2, 5, 2, 16), _bf16(5, 8), _bf16(5, 8)),
    lambda: _looped_softmax(_bf16(3, 1011)[:, :1003]),  # rows off 16-byte alignment (ALIGN 8)
    lambda: _split_softmax(_bf16(3, 1000), chunk=256),  # both launches of the two-launch form
    # rms_norm_linear_silu: both buckets (decode tiles, matmul tiles), bias or not, fp32 (IEEE)
    lambda: gemslib.rms_norm_linear_silu(_bf16(3, 256), _bf16(256), _bf16(100, 256), _bf16(100)),
    lambda: gemslib.rms_norm_linear_silu(_bf16(100, 256), _bf16(256), _bf16(200, 256)),
    lambda: _fused_with_weight_descriptor(_bf16(100, 256), _bf16(256), _bf16(200, 256)),
    lambda: _fused_with_weight_descriptor(_bf16(3, 512), _bf16(512), _bf16(200, 512), split_k=4),
    lambda: gemslib.rms_norm_linear_silu(*(random_tensor(s, torch.float32)
                                           for s in ((70, 64), (64,), (40, 64), (40,)))),
    # attention: bf16 (values garbage in the interpreter's bf16 dot; only the launch matters)
    lambda: gemslib.attention(_bf16(1, 4, 40, 64), _bf16(1, 2, 50, 64), _bf16(1, 2, 50, 64)),
    lambda: gemslib.attention(_bf16(1, 2, 40, 128), _bf16(1, 2, 40, 128), _bf16(1, 2, 40, 128),
                              causal=True),
    lambda: gemslib.attention(*(random_tensor((1, 1, 20, 40), torch.float32) for _ in range(3))),
    lambda: _attention_with_descriptors(_bf16(1, 4, 40, 128), _bf16(1, 2, 50, 128),
                                        _bf16(1, 2, 50, 128), causal=True),
    lambda: _backward(lambda q, k, v: gemslib.attention(q, k, v, causal=True),
                      _bf16(1, 4, 40, 64), _bf16(1, 2, 50, 64), _bf16(1, 2, 50, 64)),
    lambda: gemslib.decode_attention(_bf16(2, 8, 128), _bf16(2, 2, 300, 128), _bf16(2, 2, 300, 128),
                                     torch.tensor([300, 7])),  # one split: output written directly
    lambda: gemslib.decode_attention(_bf16(1, 4, 128), _bf16(1, 1, 300, 128),
                                     _bf16(1, 1, 300, 128)),  # two splits merged, no seqlens
    # a key mask: the blocks it hides skipped, with lengths (one split) and without (splits)
    lambda: gemslib.decode_attention(_bf16(2, 8, 128), _bf16(2, 2, 300, 128), _bf16(2, 2, 300, 128),
                                     torch.tensor([300, 7]), key_mask=torch.rand(2, 300) < 0.5),
    lambda: gemslib.decode_attention(_bf16(1, 4, 128), _bf16(1, 1, 300, 128),
                                     _bf16(1, 1, 300, 128), key_mask=torch.rand(1, 300) < 0.5),
    # one query row through attention: the decode kernel writing its lse, split and not
    lambda: gemslib.attention(_bf16(1, 4, 1, 128), _bf16(1, 1, 300, 128), _bf16(1, 1, 300, 128)),
    lambda: gemslib.attention(_bf16(2, 8, 1, 64), _bf16(2, 2, 30, 64), _bf16(2, 2, 30, 64)),
    lambda: softmax_ops._softmax_split_fwd_kernel[(3,)](  # the one-launch form (tickets, wait)
        *(lambda x: (x, torch.empty_like(x), torch.empty(3, 1, 2), torch.zeros(5, dtype=torch.int32),
                     3, 100, 1, 100, 100, False, 0))(_bf16(3, 100)), MAX_CHUNKS=2, CHUNK=128),
    lambda: _backward(lambda q, k, c, s: gemslib.apply_rotary(q, k, c, s),
                      _bf16(2, 5, 4, 16), _bf16(2, 5, 2, 16), _bf16(5, 8), _bf16(5, 8), differentiable=2),
    lambda: gemslib.apply_rotary(_bf16(2, 5, 4, 16), _bf16(2, 5, 2, 16), _bf16(9, 6), _bf16(9, 6),
                                 positions=torch.randint(0, 9, (2, 5)), interleaved=True,
                                 inplace=True),
    # a decode step's rotary writing k and v into a static cache, both program layouts
    lambda: _rotary_into_cache(loop_heads=0),
    lambda: _rotary_into_cache(loop_heads=1),
    # decode_gemv: one row (multiply-and-sum, K split), rows on the tl.dot tile, fp32 (IEEE)
    lambda: gemslib.decode_gemv(_bf16(1, 256), _bf16(100, 256), residual=_bf16(1, 100),
                                norm_weight=_bf16(256)),
    lambda: gemslib.decode_gemv(_bf16(3, 512), _bf16(100, 256), _bf16(100), gated="silu"),
    lambda: gemslib.decode_gemv(*(random_tensor(s, torch.float32) for s in ((5, 64), (40, 64))),
                                residual=random_tensor((5, 40), torch.float32)),
    # ... and its stream-K form (programs sharing the tiles' K steps), one row and three
    lambda: _stream_k_gemv(1, gemv=1),
    lambda: _stream_k_gemv(3, gemv=0),
    # ... and one row's products summed after the K loop (GEMV 2), stream-K
    lambda: _stream_k_gemv(1, gemv=2),
    # the q/k/v GEMV with its rotary and cache write: one row, and 3 on the tl.dot tile
    lambda: _decode_gemv_rotary(_tensors_of(torch.bfloat16), 1, 4, 256),
    lambda: _decode_gemv_rotary(_tensors_of(torch.bfloat16), 3, 4, 256),
    # ... and one row's products summed after the K loop (GEMV 2)
    lambda: _summed_at_end_gemv_rotary(),
]


@pytest.mark.skipif(ON_GPU, reason="on a GPU the whole suite compiles the kernels for real")
def test_every_launch_compiles_for_sm90(monkeypatch):
    launches = _record_launches(monkeypatch, CALLS)
    kernels = {launch["kernel"] for launch in launches}
    assert {"_silu_fwd_kernel", "_rms_norm_bwd_kernel", "_softmax_fwd_kernel",
            "_softmax_split_fwd_kernel", "_rotary_kernel", "_rms_norm_linear_silu_kernel",
            "_attention_fwd_kernel", "_attention_bwd_delta_kernel", "_attention_bwd_dkdv_kernel",
            "_attention_bwd_dq_kernel", "_decode_kernel", "_decode_gemv_kernel",
            "_decode_gemv_rotary_kernel"} <= kernels
    # the launches through tensor descriptors (TMA) are among them
    assert any("descriptor" in arg for launch in launches for arg in launch["args"].values())
    # the kernels built for dependent launch (sm_90, the default): each launch also as the GPU
    # then compiles it, PDL set and launch_pdl on
    dependent = [{**launch, "args": {**launch["args"], "PDL": {"value": True},
                                     "launch_pdl": {"value": True}}}
                 for launch in launches if launch["args"].get("PDL") == {"value": False}]
    assert {launch["kernel"] for launch in dependent} == {
        "_rms_norm_fwd_kernel", "_silu_and_mul_fwd_kernel", "_rotary_kernel", "_decode_kernel",
        "_decode_gemv_kernel", "_decode_gemv_rotary_kernel"}
    # and with GEMSLIB_PDL_EARLY: the trigger after the wait, the GEMVs' prefetch before it
    early = [{**launch, "args": {**launch["args"], "PDL_EARLY": {"value": True}}}
             for launch in dependent]
    failures = _compile_failures(launches + dependent + early)
    assert not failures, "\n\n".join(failures)


def _compile_failures(launches) -> list[str]:
    return _run_compiler(_COMPILER, json.dumps(launches))


def _run_compiler(script: str, stdin: str | None = None, args: Sequence[str] = ()):
    """Run ``script`` (with ``args``) in a fresh Python without ``TRITON_INTERPRET`` (Triton's
    real compiler, no GPU needed); return the JSON on its last line of output."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, "-c", script, *args], input=stdin, capture_output=True,
                          text=True, env=env, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def _tensors_of(dtype):
    return lambda *shape: random_tensor(shape, dtype, scale=1.0)


def _grads(fn, *inputs):
    """Forward and backward of ``fn`` with every input needing grad."""
    _backward(fn, *inputs)


def _rotary_sample(tensors, heads, head_dim):
    """Forward and backward with 4 query heads per KV head, ``heads`` in all."""
    kv_heads = max(heads // 5, 1)
    cos, sin = tensors(2, head_dim // 2), tensors(2, head_dim // 2)
    _grads(lambda q, k: gemslib.apply_rotary(q, k, cos, sin),
           tensors(1, 2, heads - kv_heads, head_dim), tensors(1, 2, kv_heads, head_dim))


def _decode_sample(tensors, head_dim, seq_kv):
    """The decode kernel's three ways through its keys: lengths alone, lengths under a key
    mask (a static cache's step), a mask alone; under a mask the scan for the kept run, then
    the plain loop or the masked one."""
    q, k, v = (tensors(2, 4, head_dim), tensors(2, 1, seq_kv, head_dim),
               tensors(2, 1, seq_kv, head_dim))
    lengths, mask = torch.tensor([seq_kv, 1]), torch.rand(2, seq_kv) < 0.5
    for seqlens, key_mask in ((lengths, None), (lengths, mask), (None, mask)):
        gemslib.decode_attention(q, k, v, seqlens, key_mask=key_mask)


def _decode_gemv_sample(tensors, rows, n_out, n_in):
    """decode_gemv's three prologues, the plain one with both epilogues."""
    x, weight = tensors(rows, n_in), tensors(n_out, n_in)
    gemslib.decode_gemv(x, weight, tensors(n_out), residual=tensors(rows, n_out))
    gemslib.decode_gemv(x, weight, norm_weight=tensors(n_in), weight_offset=1.0)
    gemslib.decode_gemv(tensors(rows, 2 * n_in), weight, residual=tensors(rows, n_out),
                        gated="gelu_erf")


# One small call per tuned kernel that launches it for a dtype at given shape keys: the keys a
# bucket bounds take their bound (its largest shapes, the most resources), the others
# ``_UNBOUNDED``'s value. Only the launch is recorded (nothing runs), so sizes cost nothing.
_UNBOUNDED = {"rows": 3, "cols": 40000, "numel": 70000, "tokens": 3, "heads": 40, "head_dim": 256,
              "causal": 1, "seq_q": 300, "seq_kv": 300, "n": 300, "k": 512}
_SAMPLES = {
    "rms_norm.rms_norm_fwd": lambda t, s: gemslib.rms_norm(t(2, s["cols"]), t(s["cols"])),
    "rms_norm.rms_norm_bwd": lambda t, s: _grads(gemslib.rms_norm, t(2, s["cols"]), t(s["cols"])),
    "rms_norm.rms_norm_dweight": lambda t, s: _grads(gemslib.rms_norm, t(2, s["cols"]),
                                                     t(s["cols"])),
    "rotary.rotary": lambda t, s: _rotary_sample(t, s["heads"], s["head_dim"]),
    "silu.silu_fwd": lambda t, s: gemslib.silu(t(s["numel"])),
    "silu.silu_bwd": lambda t, s: _grads(gemslib.silu, t(s["numel"])),
    "silu.silu_and_mul_fwd": lambda t, s: gemslib.silu_and_mul(t(2, 2 * s["cols"])),
    "silu.silu_and_mul_bwd": lambda t, s: _grads(gemslib.silu_and_mul, t(2, 2 * s["cols"])),
    "softmax.softmax_fwd": lambda t, s: gemslib.softmax(t(2, s["cols"])),
    "softmax.softmax_bwd": lambda t, s: _grads(gemslib.softmax, t(2, s["cols"])),
    "softmax.softmax_split_fwd": lambda t, s: gemslib.log_softmax(t(2, s["cols"])),
    "attention.attention_fwd": lambda t, s: gemslib.attention(
        t(1, 2, s["seq_q"], s["head_dim"]), t(1, 1, s["seq_kv"], s["head_dim"]),
        t(1, 1, s["seq_kv"], s["head_dim"]), causal=bool(s["causal"])),
    "attention.attention_bwd_dkdv": lambda t, s: _grads(
        lambda q, k, v: gemslib.attention(q, k, v, causal=True),
        t(1, 2, 40, s["head_dim"]), t(1, 1, 40, s["head_dim"]), t(1, 1, 40, s["head_dim"])),
    "attention.attention_bwd_dq": lambda t, s: _grads(
        lambda q, k, v: gemslib.attention(q, k, v, causal=True),
        t(1, 2, 40, s["head_dim"]), t(1, 1, 40, s["head_dim"]), t(1, 1, 40, s["head_dim"])),
    "decode_attention.decode_attention": lambda t, s: _decode_sample(t, s["head_dim"], s["seq_kv"]),
    "rms_norm_linear_silu.rms_norm_linear_silu": lambda t, s: gemslib.rms_norm_linear_silu(
        t(s["rows"], s["k"]), t(s["k"]), t(s["n"], s["k"]), t(s["n"])),
    "rms_norm_swiglu.rms_norm_swiglu": lambda t, s: gemslib.rms_norm_swiglu(
        t(s["rows"], s["k"]), t(s["k"]), t(2 * s["n"], s["k"])),
    "decode_gemv.decode_gemv": lambda t, s: _decode_gemv_sample(t, s["rows"], s["n"], s["k"]),
    # n: the q heads' rows beside 2 x 2 kv heads of 128
    "decode_gemv.decode_gemv_rotary": lambda t, s: _decode_gemv_rotary(
        t, s["rows"], max(s["n"] // 128 - 4, 1), s["k"]),
}


# configs that choose a Gluon path (its kernel compiled by its own test below), or 0 for the
# Triton kernels, whose own buckets cover them
_GLUON_CHOOSERS = {"softmax.softmax_cluster_fwd", "softmax.softmax_cluster_bwd"}


def _kernel_name(tuned: runtime.TunedKernel) -> str:
    """The Python name of a TunedKernel's jit function (under its triton.heuristics)."""
    fn = tuned.fn
    while not isinstance(fn, InterpretedFunction):
        fn = fn.fn
    return fn.fn.__name__


def _launches_of_every_bucket(monkeypatch, config_file: str):
    """(the launches, the (kernel, bucket, dtype) triples they cover) of every bucket of every
    tuned kernel in ``config_file``, for each kernel dtype the bucket admits, with the bucket's
    config forced. Launches are recorded, not run."""
    path = runtime.shipped_configs_dir() / config_file
    shipped = runtime.load_tune_config(path)
    default = runtime.load_tune_config(runtime.shipped_configs_dir() / "default.yaml")
    monkeypatch.setattr(custom_op, "interpret_bf16_dots", True)
    launches, covered = {}, []

    def recording_run(self, *args, grid, warmup, **kwargs):
        named = dict(zip(self.arg_names, args))
        named.update(kwargs)
        record = {"module": self.fn.__module__, "kernel": self.fn.__name__,
                  "args": {name: _describe(v) for name, v in named.items()}}
        if record["kernel"] == wanted:
            launches[json.dumps(record, sort_keys=True)] = record
            found.append(record)

    monkeypatch.setattr(InterpretedFunction, "run", recording_run)
    assert set(_SAMPLES) | _GLUON_CHOOSERS == set(runtime.KERNELS), \
        "every tuned kernel needs a sample call"
    for key, tuned in sorted(runtime.KERNELS.items()):
        if key in _GLUON_CHOOSERS:
            continue
        buckets = (shipped.ops.get(tuned.op, {}).get(tuned.name)
                   or default.ops[tuned.op][tuned.name])
        wanted = _kernel_name(tuned)
        for index, bucket in enumerate(buckets):
            bound = dict(bucket.max or {})
            for dtype in runtime.KERNEL_DTYPES:
                itemsize = torch.empty((), dtype=dtype).element_size()
                if bound.get("elem_bytes", itemsize) < itemsize:
                    continue  # this bucket never serves the dtype
                meta = bucket.configs[0].meta_dict
                if ("CHUNK" in meta and not meta["CHUNK"]) or meta.get("VENDOR_GEMM"):
                    # the kernel never runs for this bucket: CHUNK 0, its rows are not split;
                    # VENDOR_GEMM 1, torch's matmul between gemslib's norm and activation
                    continue
                shape = {**_UNBOUNDED, **bound, "elem_bytes": itemsize}
                found = []
                with tuned.forced(bucket.configs[0]):
                    _SAMPLES[key](_tensors_of(dtype), shape)
                assert found, f"{key} bucket {index} ({dtype}): the sample launched nothing"
                covered.append((key, index, dtype))
    return list(launches.values()), covered


@pytest.mark.skipif(ON_GPU, reason="on a GPU the whole suite compiles the kernels for real")
@pytest.mark.parametrize("config_file", ["nvidia_h200.yaml", "default.yaml"])
def test_every_bucket_compiles_for_every_dtype_it_serves(monkeypatch, config_file):
    """Each (kernel, bucket, dtype) of a shipped file, launched with the bucket's config at the
    bucket's largest shapes, compiles for sm_90 within its shared memory: a config that does
    not fit a dtype it can be chosen for (an fp32 call once got a bf16-sized matmul tile on the
    H200) fails here."""
    try:
        launches, covered = _launches_of_every_bucket(monkeypatch, config_file)
    finally:
        monkeypatch.undo()
        runtime.reload_configs()
    # default.yaml never splits softmax rows (CHUNK 0), so its split kernel never launches
    assert {key for key, _, _ in covered} >= set(_SAMPLES) - {"softmax.softmax_split_fwd"}
    assert {dtype for _, _, dtype in covered} == set(runtime.KERNEL_DTYPES)
    failures = _compile_failures(launches)
    assert not failures, "\n\n".join(failures)


_VECTOR_COUNTER = r"""
import json, re, sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from gemslib.ops import softmax as softmax_ops
counts = {}
for kernel, n_pointers in ((softmax_ops._softmax_fwd_kernel, 2),
                           (softmax_ops._softmax_bwd_kernel, 3)):
    while not isinstance(kernel, triton.runtime.jit.JITFunction):
        kernel = kernel.fn
    for align in (1, 8):
        names = [param.name for param in kernel.params]
        # pointers 16-byte aligned (as torch allocates), then the sizes and strides, unknown
        signature = {name: "*bf16" if i < n_pointers else "i32"
                     for i, name in enumerate(names[:2 * n_pointers + 2])}
        constexprs = {"LOG": False, "ALIGN": align, "BLOCK_M": 1, "BLOCK_N": 4096,
                      "ONE_PASS": False}
        signature.update({name: "constexpr" for name in constexprs})
        source = ASTSource(fn=kernel, signature=signature, constexprs=constexprs,
                           attrs={(i,): [["tt.divisibility", 16]] for i in range(n_pointers)})
        ptx = triton.compile(source, target=GPUTarget("cuda", 90, 32),
                             options={"num_warps": 16}).asm["ptx"]
        counts[f"{kernel.__name__} {align}"] = [
            len(re.findall(r"ld\.global[.a-z0-9]*\.v4", ptx)),
            len(re.findall(r"st\.global[.a-z0-9]*\.v4", ptx))]
print(json.dumps(counts))
"""


def test_off_alignment_rows_load_and_store_full_vectors():
    """softmax_fwd's and softmax_bwd's looped rows with ALIGN 8 (bf16 rows starting off a 16-byte boundary, an
    odd row stride) compile to 16-byte loads and stores for their inner blocks, where the
    column-by-column walk (ALIGN 1) cannot use any."""
    counts = _run_compiler(_VECTOR_COUNTER)
    assert counts["_softmax_fwd_kernel 1"] == [0, 0]
    loads, stores = counts["_softmax_fwd_kernel 8"]
    assert loads >= 2 and stores >= 1  # both passes load full vectors, the second stores them
    assert counts["_softmax_bwd_kernel 1"] == [0, 0]
    loads, stores = counts["_softmax_bwd_kernel 8"]
    assert loads >= 4 and stores >= 1  # dy and y in both passes


_GLUON_COMPILER = r"""
import json, os, sys
# the fused backward's switches (set before gemslib is imported): with any, only the fused
# backward compiles
SWITCHES = {"no_overlap_dk": ("GEMSLIB_DQ_OVERLAP_DK", "0"),
            "d64": ("GEMSLIB_GLUON_BACKWARD_D64", "1"),
            "d256": ("GEMSLIB_GLUON_FORWARD_D256", "1")}
for switch in sys.argv[1:]:
    name, value = SWITCHES[switch]
    os.environ[name] = value
import torch, triton
from triton.backends.compiler import GPUTarget
from triton.experimental.gluon._runtime import GluonASTSource
from gemslib.fused import _attention_hopper as hopper


def compile_for_sm90(dtype, causal, backward, head_dim=hopper.HEAD_DIM):
    # the forward kernel, or the backward's dK/dV kernel (backward "fused": with dQ), with the
    # launchers' constexprs
    name = {torch.bfloat16: "bf16", torch.float16: "fp16"}[dtype]
    q_layout, kv_layout = hopper.shared_layouts(dtype, head_dim)
    constexprs = {"CAUSAL": causal,
                  "STAGES": hopper.BWD_STAGES if backward else hopper.FORWARD_TILES[head_dim][1],
                  "CONSUMER_REGS": hopper.CONSUMER_REGS, "PRODUCER_REGS": hopper.PRODUCER_REGS}
    block = f"tensordesc<{name}[1, 1, {hopper.ROWS}, {head_dim}],{q_layout!r}>"
    if backward and head_dim != hopper.HEAD_DIM:  # as _launch_backward makes its blocks
        block_layout = hopper.gl.NVMMASharedLayout.get_default_for(
            [1, 1, hopper.KEYS, head_dim], hopper._GL_DTYPES[dtype])
        block = f"tensordesc<{name}[1, 1, {hopper.BWD_ROWS}, {head_dim}],{block_layout!r}>"
    if backward:
        kernel = hopper._attention_bwd_dkdv_hopper
        constexprs.update(FUSED_DQ=backward == "fused", WRITER_REGS=hopper.WRITER_REGS,
                          WRITER_WARPS=hopper.WRITER_WARPS, DQ_DIAG=0)
        signature = {"q_desc": block, "k_desc": block, "v_desc": block, "do_desc": block,
                     "lse_ptr": "*fp32", "delta_ptr": "*fp32", "dk_ptr": f"*{name}",
                     "dv_ptr": f"*{name}", "dq_ptr": "*fp32",
                     "dq_desc": f"tensordesc<fp32[1, {hopper.BWD_ROWS}, {head_dim // 2}],"
                                f"{hopper._DQ_LAYOUT!r}>", "seq_q": "i32", "seq_kv": "i32",
                     "n_kv_heads": "i32", "group_size": "i32", "scale": "fp32",
                     "scale_log2": "fp32"}
    else:
        kernel = hopper._attention_fwd_hopper
        kv_block = (f"tensordesc<{name}[1, 1, {hopper.FORWARD_TILES[head_dim][0]}, {head_dim}],"
                    f"{kv_layout!r}>")
        signature = {"q_desc": block, "k_desc": kv_block, "v_desc": kv_block,
                     "out_ptr": f"*{name}", "lse_ptr": "*fp32", "seq_q": "i32", "seq_kv": "i32",
                     "n_q_heads": "i32", "group_size": "i32", "scale_log2": "fp32",
                     "stride_o_b": "i32", "stride_o_h": "i32", "stride_o_s": "i32"}
    signature.update({key: "constexpr" for key in constexprs})
    source = GluonASTSource(kernel, signature, constexprs)
    return triton.compile(source, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4})


def local_memory_ops(cubin):
    # the SASS's loads and stores of local memory: ptxas's register spills
    import subprocess, tempfile
    with tempfile.NamedTemporaryFile(suffix=".cubin") as handle:
        handle.write(cubin)
        handle.flush()
        sass = subprocess.run([os.path.join(os.path.dirname(triton.__file__), "backends",
                                            "nvidia", "bin", "cuobjdump"), "-sass", handle.name],
                              capture_output=True, text=True, check=True).stdout
    return sum(sass.count(op) for op in (" STL", " LDL"))


def facts(compiled):
    ptx = compiled.asm["ptx"]
    return {"shared": compiled.metadata.shared, "cubin": bool(compiled.asm["cubin"]),
            "spills": local_memory_ops(compiled.asm["cubin"]),
            "wgmma": ptx.count("wgmma.mma_async"), "setmaxnreg": ptx.count("setmaxnreg"),
            "atomic_adds": ptx.count("atom.global.gpu.relaxed.add.f32"),
            "waits_leaving_one": ptx.count("wgmma.wait_group.sync.aligned 1;")}


report = {}
for dtype in (torch.bfloat16, torch.float16):
    for causal in (False, True):
        if "d64" in sys.argv[1:]:  # the forward and the dK/dV kernel (alone, with dQ) at 64
            for backward in (False, True, "fused"):
                report[f"{dtype} {causal} {backward} d64"] = facts(
                    compile_for_sm90(dtype, causal, backward, head_dim=64))
            continue
        if "d256" in sys.argv[1:]:  # the forward at 256
            report[f"{dtype} {causal} False d256"] = facts(
                compile_for_sm90(dtype, causal, False, head_dim=256))
            continue
        for backward in ("fused",) if sys.argv[1:] else (False, True, "fused"):
            report[f"{dtype} {causal} {backward}"] = facts(compile_for_sm90(dtype, causal, backward))
print(json.dumps(report))
"""


@pytest.mark.skipif(ON_GPU, reason="on a GPU the attention tests run this kernel for real")
def test_hopper_attention_kernel_compiles_for_sm90():
    """The Gluon kernels, forward and the backward's dK/dV with and without dQ (bf16/fp16,
    causal or not), compile to cubins within an SM's shared memory (the forward at every head
    dim it takes without spilling a register), with their warpgroups'
    register budgets rebalanced (setmaxnreg: producer down, consumers up) and every product
    issued as wgmma (forward: q.K and p.V; backward: k.q, v.do over D = 128 and p.do, ds.q over
    64 rows; with dQ also ds.k over 2 x 64 keys, added into dq by atomics); also with the
    fused backward's switches (the dq wait after dk's; head dim 64)."""
    report = _run_compiler(_GLUON_COMPILER)
    assert len(report) == 12
    for variant, facts in report.items():
        assert facts["cubin"], variant
        assert facts["shared"] <= 232448, f"{variant}: {facts['shared']} B of shared memory"
        assert facts["setmaxnreg"] >= 2, variant
        # wgmma steps of K = 16: forward 2 x 128 / 16; backward 2 x 128 / 16 + 2 x 64 / 16,
        # with dQ + 2 x 64 / 16
        kind = variant.split()[-1]
        minimum = {"False": 2 * 128 // 16, "True": 2 * 128 // 16 + 2 * 64 // 16,
                   "fused": 2 * 128 // 16 + 4 * 64 // 16}[kind]
        assert facts["wgmma"] >= minimum, variant
        if kind == "False":  # the forward keeps its accumulators in registers (the dK/dV
            assert facts["spills"] == 0, variant  # kernel spills ~32 ops: measured as is)
        # the two warpgroups' 64 x 64 dq halves: 32 elements a thread each
        assert (facts["atomic_adds"] >= 2 * 32) == (kind == "fused"), variant
    # the dq matmuls waited for with dk's still running (the default: one path for both
    # warpgroups, a wait that leaves one group in flight); GEMSLIB_DQ_OVERLAP_DK=0 waits for dq
    # after dk, with the same atomics, and still fits in shared memory
    switched = _run_compiler(_GLUON_COMPILER, args=["no_overlap_dk"])
    assert len(switched) == 4
    for variant, facts in switched.items():
        assert facts["cubin"] and facts["shared"] <= 232448, variant
        assert facts["wgmma"] >= 2 * 128 // 16 + 4 * 64 // 16, variant
        assert facts["atomic_adds"] == report[variant]["atomic_adds"], variant
        assert report[variant]["waits_leaving_one"] >= 1 > facts["waits_leaving_one"], variant
    # GEMSLIB_GLUON_BACKWARD_D64=1: the dK/dV kernel at head dim 64 (s^T, dp^T over D = 64;
    # dv, dk over 64 rows); with GEMSLIB_FUSED_DQ_D64=1 also each warpgroup's partial dq over
    # its 64 keys, the writer's atomics, and a wait that leaves dk's matmul in flight
    # GEMSLIB_GLUON_FORWARD_D64=1: the forward at head dim 64 (q.K over D = 64, p.V over 128
    # keys), its ring as FORWARD_TILES says, within shared memory
    from gemslib.fused._attention_hopper import FORWARD_TILES

    d64 = _run_compiler(_GLUON_COMPILER, args=["d64"])
    assert len(d64) == 12
    for variant, facts in d64.items():
        fused = "fused" in variant
        assert facts["cubin"] and facts["shared"] <= 232448, variant
        assert facts["setmaxnreg"] >= 2, variant
        if variant.split()[-2] == "False":  # the forward
            assert facts["wgmma"] >= 64 // 16 + 128 // 16 and facts["spills"] == 0, variant
            keys, stages = FORWARD_TILES[64]
            assert facts["shared"] >= stages * 2 * keys * 64 * 2, variant
            continue
        assert facts["wgmma"] >= 2 * 64 // 16 + 2 * 64 // 16 + fused * 64 // 16, variant
        assert (facts["atomic_adds"] > 0) == (facts["waits_leaving_one"] > 0) == fused, variant
    # GEMSLIB_GLUON_FORWARD_D256=1: the forward at head dim 256 in 64-key blocks, two stages
    # (64 KB of q, 2 x 64 KB of K/V), its [64, 256] fp32 accumulator a warpgroup unspilled
    d256 = _run_compiler(_GLUON_COMPILER, args=["d256"])
    assert len(d256) == 4
    for variant, facts in d256.items():
        assert facts["cubin"] and 2 * 2 * 64 * 256 * 2 <= facts["shared"] <= 232448, variant
        assert facts["setmaxnreg"] >= 2 and facts["spills"] == 0, variant
        assert facts["wgmma"] >= 256 // 16 + 64 // 16, variant


_FUSED_COMPILER = r"""
import json, torch, triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from triton.experimental.gluon._runtime import GluonASTSource
from gemslib.fused import _rms_norm_linear_silu_hopper as hopper
report = {}
for dtype, name in ((torch.bfloat16, "bf16"), (torch.float16, "fp16")):
    a_layout, b_layout = hopper._shared_layouts(dtype)
    signature = {"xg_desc": f"tensordesc<{name}[{hopper.TILE_ROWS}, {hopper.BLOCK_K}],"
                            f"{a_layout!r}>",
                 "weight_desc": f"tensordesc<{name}[{hopper.BLOCK_N}, {hopper.BLOCK_K}],"
                                f"{b_layout!r}>",
                 "out_ptr": f"*{name}", "rstd_ptr": "*fp32", "bias_ptr": f"*{name}",
                 "n_rows": "i32", "n_out": "i32", "n_in": "i32",
                 "GROUP_M": "constexpr", "STAGES": "constexpr"}
    source = GluonASTSource(hopper._matmul_epilogue, signature,
                            {"GROUP_M": hopper.GROUP_M, "STAGES": hopper.STAGES})
    compiled = triton.compile(source, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4})
    ptx = compiled.asm["ptx"]
    report[f"matmul {name}"] = {"shared": compiled.metadata.shared, "cubin": bool(compiled.asm["cubin"]),
                                "wgmma": ptx.count("wgmma.mma_async"), "setmaxnreg": ptx.count("setmaxnreg")}
    # the gated epilogue: [128, BLOCK_K] gate and up blocks; SiLU with and without the norm's
    # rstd, and without it both GELUs (linear_geglu)
    element = hopper._GL_DTYPES[dtype]
    half_layout = hopper.gl.NVMMASharedLayout.get_default_for([hopper.GATED_BLOCK_N, hopper.BLOCK_K],
                                                              element)
    for rstd, activation in (("*fp32", 0), (None, 0), (None, 1), (None, 2)):
        signature = {"xg_desc": f"tensordesc<{name}[{hopper.TILE_ROWS}, {hopper.BLOCK_K}],"
                                f"{a_layout!r}>",
                     "weight_desc": f"tensordesc<{name}[{hopper.GATED_BLOCK_N}, {hopper.BLOCK_K}],"
                                    f"{half_layout!r}>",
                     "out_ptr": f"*{name}", "rstd_ptr": rstd or "constexpr", "bias_ptr": "constexpr",
                     "n_rows": "i32", "n_out": "i32", "n_in": "i32",
                     "GROUP_M": "constexpr", "STAGES": "constexpr", "GATED": "constexpr",
                     "ACTIVATION": "constexpr"}
        constexprs = {"GROUP_M": hopper.GROUP_M, "STAGES": hopper.STAGES, "GATED": True,
                      "ACTIVATION": activation, "bias_ptr": None,
                      **({} if rstd else {"rstd_ptr": None})}
        compiled = triton.compile(GluonASTSource(hopper._matmul_epilogue, signature, constexprs),
                                  target=GPUTarget("cuda", 90, 32), options={"num_warps": 4})
        ptx = compiled.asm["ptx"]
        report[f"matmul gated {activation} {name} rstd {rstd}"] = {
            "shared": compiled.metadata.shared, "cubin": bool(compiled.asm["cubin"]),
            "wgmma": ptx.count("wgmma.mma_async"), "setmaxnreg": ptx.count("setmaxnreg"),
            "n256": ptx.count("wgmma.mma_async.sync.aligned.m64n256k16")}
    signature = {"x_ptr": f"*{name}", "norm_weight_ptr": f"*{name}", "xg_ptr": f"*{name}",
                 "rstd_ptr": "*fp32", "n_in": "i32", "stride_x_row": "i32", "eps": "fp32",
                 "BLOCK_K": "constexpr"}
    source = ASTSource(fn=hopper._scale_rows_kernel, signature=signature,
                       constexprs={"BLOCK_K": hopper.SCALE_BLOCK})
    prepass = triton.compile(source, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4})
    report[f"pre-pass {name}"] = {"shared": prepass.metadata.shared, "cubin": bool(prepass.asm["cubin"]),
                                  "wgmma": None, "setmaxnreg": None}
print(json.dumps(report))
"""


@pytest.mark.skipif(ON_GPU, reason="on a GPU the rms_norm_linear_silu tests run these for real")
def test_hopper_rms_norm_linear_silu_kernels_compile_for_sm90():
    """The two launches of the Hopper path compile to cubins: the pre-pass, and the Gluon
    matmul within an SM's shared memory, with rebalanced registers (setmaxnreg) and its
    64 x 256 x 64 steps as wgmma; so does the matmul's gated form (the same 256-wide wgmma
    over a stage's gate and up blocks): SwiGLU with and without the norm's row scale, and
    both GELUs' epilogues (linear_geglu)."""
    report = _run_compiler(_FUSED_COMPILER)
    assert len(report) == 12
    for variant, facts in report.items():
        assert facts["cubin"], variant
        assert facts["shared"] <= 232448, f"{variant}: {facts['shared']} B of shared memory"
        if variant.startswith("matmul"):
            assert facts["setmaxnreg"] >= 2, variant
            assert facts["wgmma"] >= 64 // 16, variant
        if variant.startswith("matmul gated"):  # gate and up in one instruction per K step
            assert facts["n256"] == facts["wgmma"], variant


_SOFTMAX_CLUSTER_COMPILER = r"""
import json, re, sys, triton
from triton.backends.compiler import GPUTarget
from triton.experimental.gluon._runtime import GluonASTSource
from gemslib.ops import _softmax_hopper as hopper
backward = sys.argv[1] == "backward"
variants = ((("bf16", 2, 32000, 1, 8, False), ("bf16", 2, 131072, 8, 4, True),
             ("fp16", 2, 50257, 4, 4, False), ("fp32", 4, 50257, 2, 8, True)) if backward else
            (("bf16", 2, 32000, 1, 8, False), ("bf16", 2, 131072, 4, 8, True),
             ("fp16", 2, 50257, 2, 4, False), ("fp32", 4, 152064, 8, 16, False)))
report = {}
for name, size, n_cols, cluster, warps, log in variants:
    n_chunks = hopper.n_chunks(n_cols, size, cluster, warps)
    rows = ("grad", "y", "dx") if backward else ("x", "y")
    signature = {**{f"{row}_ptr": f"*{name}" for row in rows}, "partial_ptr": "*fp32",
                 "n_cols": "i32", **{f"stride_{row}_row": "i32" for row in rows},
                 "LOG": "constexpr", "VEC": "constexpr", "N_CHUNKS": "constexpr"}
    aligned = [["tt.divisibility", 16]]  # as torch allocates, and as eligible() demands
    kernel = hopper._softmax_cluster_bwd_kernel if backward else hopper._softmax_cluster_fwd_kernel
    source = GluonASTSource(kernel, signature,
                            {"LOG": log, "VEC": 16 // size, "N_CHUNKS": n_chunks},
                            attrs={(i,): aligned for i in range(len(rows) + 1)})
    compiled = triton.compile(source, target=GPUTarget("cuda", 90, 32),
                              options={"num_warps": warps, "num_ctas": cluster,
                                       "num_stages": 1})  # as TunedKernel.launch passes them
    ptx = compiled.asm["ptx"]
    report[f"{name} {n_cols} x{cluster} {warps}w"] = {
        "cubin": bool(compiled.asm["cubin"]), "shared": compiled.metadata.shared,
        "slice": hopper.slice_bytes(n_cols, size, cluster, warps), "chunks": n_chunks,
        "cluster": cluster,
        "copies16": len(re.findall(r"cp\.async\.cg\.shared\.global [^;]*, 0x10,", ptx)),
        "stores16": len(re.findall(r"st\.global[.a-z0-9]*\.v4\.b32", ptx)),
        "barriers": ptx.count("barrier.cluster.arrive.release"),
        "waits": ptx.count("barrier.cluster.wait.acquire"), "rank": ptx.count("%cluster_ctarank")}
print(json.dumps(report))
"""


@pytest.mark.skipif(ON_GPU, reason="on a GPU the softmax tests run this kernel for real")
def test_softmax_cluster_kernel_compiles_for_sm90():
    """The Hopper softmax path compiles for a cluster of 1, 2, 4 and 8 CTAs (16- and 32-bit):
    its slice in shared memory, every copy into it 16 bytes and every output store of a
    chunk one 16-byte vector a thread (rows off alignment included: they are walked from the
    boundary before them), and one cluster barrier where the cluster has more than one CTA."""
    report = _run_compiler(_SOFTMAX_CLUSTER_COMPILER, args=["forward"])
    assert len(report) == 4
    for variant, facts in report.items():
        assert facts["cubin"], variant
        assert facts["slice"] <= facts["shared"] <= 232448, variant
        assert facts["copies16"] == facts["chunks"], variant
        assert facts["stores16"] == facts["chunks"], variant
        one_barrier = int(facts["cluster"] > 1)
        assert facts["barriers"] == facts["waits"] == one_barrier, variant
        assert facts["rank"] >= one_barrier, variant


@pytest.mark.skipif(ON_GPU, reason="on a GPU the softmax tests run this kernel for real")
def test_softmax_cluster_backward_kernel_compiles_for_sm90():
    """The backward's Hopper path compiles for clusters of 1-8 CTAs (16- and 32-bit): dy and
    y each copied in 16-byte vectors (two slices in shared memory), dx stored in 16-byte
    vectors, one cluster barrier where the cluster has more than one CTA."""
    report = _run_compiler(_SOFTMAX_CLUSTER_COMPILER, args=["backward"])
    assert len(report) == 4
    for variant, facts in report.items():
        assert facts["cubin"], variant
        assert 2 * facts["slice"] <= facts["shared"] <= 232448, variant
        assert facts["copies16"] == 2 * facts["chunks"], variant
        assert facts["stores16"] == facts["chunks"], variant
        one_barrier = int(facts["cluster"] > 1)
        assert facts["barriers"] == facts["waits"] == one_barrier, variant
