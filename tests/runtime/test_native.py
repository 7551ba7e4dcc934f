"""The native replay of planned calls (gemslib/runtime/_launch.cpp through
gemslib.runtime.native).

On the CPU the module is built and its keying and plan checks are tested (there is no driver
to launch with, so a matching plan hands the call back to Python); on a GPU the planned
operators replay through it and stay right.
"""

import struct

import pytest
import torch
import torch.nn.functional as F

import gemslib
import test_runtime
from helpers import ON_GPU, random_tensor
from gemslib.accuracy import assert_close_to_reference
from gemslib import runtime
from gemslib.runtime import native, plans
from gemslib.ops import rms_norm as rms_norm_ops
from gemslib.ops import silu as silu_ops


@pytest.fixture(scope="module")
def built():
    return native.load(native.build())


def test_the_signature_tells_apart_every_thing_a_plan_depends_on(built):
    """Two calls share a key only where a plan of one serves the other: the same shapes,
    strides, dtypes, devices, 16-byte alignments and requires_grad of the tensors, the same
    values of the plain arguments (a bool, an int and a float of one value apart), the same
    keywords, the same grad mode, and the same pattern of tensors that start together.
    Arguments the table does not key (a tensor subclass, a device object) give no key."""
    table = built.Table(below_autograd=True)
    key = table.key
    storage = torch.zeros(1024)
    a, b = storage[:256].view(16, 16), storage[512:768].view(16, 16)
    assert key(a, 1e-6) == key(b, 1e-6) and key(a, 1e-6) is not None
    different = [
        key(torch.zeros(16, 17), 1e-6),                       # shape
        key(torch.zeros(16, 16).t(), 1e-6),                   # strides
        key(a.to(torch.float16), 1e-6),                       # dtype
        key(storage[1:257].view(16, 16), 1e-6),               # 4 bytes off 16-byte alignment
        key(a.clone().requires_grad_(), 1e-6),                # requires_grad
        key(a, 1e-5), key(a, 1), key(a, True), key(a, None),  # the value and its type
        key(a, [1e-6]), key(a, (1e-6,)),
        key(a, eps=1e-6), key(a, 1e-6, scale=2.0),            # keywords
        key(a, 1e-6, torch.float16),
    ]
    with torch.no_grad():
        different.append(key(a, 1e-6))                        # grad mode
    assert len(set(different + [key(a, 1e-6)])) == len(different) + 1
    assert None not in different
    assert key(a, b) != key(a, a)                             # tensors that start together
    assert key(a, torch.float16) != key(a, torch.float32)
    assert key(a, eps=1e-6, scale=2.0) != key(a, scale=2.0, eps=1e-6)  # keyword order: Python's

    class Sub(torch.Tensor):
        pass

    assert key(a.as_subclass(Sub), 1e-6) is None
    assert key(a, torch.device("cpu")) is None
    assert key(a, object()) is None
    assert key(torch.nn.Parameter(a.clone())) is not None
    # a direct call (not below autograd) that autograd must see has no key
    leaf = a.clone().requires_grad_()
    assert built.Table(below_autograd=False).key(leaf) is None
    with torch.no_grad():
        assert built.Table(below_autograd=False).key(leaf) is not None


def _spec(**changes):
    spec = dict(device=0, inputs=(0,), outputs=(((16, 16), (16, 1), torch.float32, False),),
                scratch=(), launches=((1234, (2, 1, 1), 4, 1, 0, False, False,
                                       ((0, 0, 0), (0, 1, 0), (2, 0, 256))),),
                result=0)
    spec.update(changes)
    return tuple(spec.values())


def test_a_plan_is_checked_when_it_is_kept(built):
    """add() keeps a well-formed plan (also one with a tensor map) under the call's key and
    refuses one whose slots, maps, results or inputs point at nothing, or a map TMA cannot
    take, with the reason; a call the table cannot key keeps nothing. clear() forgets the
    plans."""
    table = built.Table()
    x = torch.zeros(16, 16)
    assert table.add((x, 2), {}, _spec()) is True and table.size == 1
    assert table.add((x, object()), {}, _spec()) is False and table.size == 1
    bad = {
        "a slot past the tensors": dict(launches=((1234, (2, 1, 1), 4, 1, 0, False, False,
                                                   ((0, 5, 0),)),)),
        "a scratch pointer without scratch": dict(launches=((1234, (2, 1, 1), 4, 1, 0, False,
                                                             False, ((1, 0, 0),)),)),
        "a result past the outputs": dict(result=3),
        "an input that is no tensor": dict(inputs=(1,)),
        "a tensor map past the maps": dict(launches=((1234, (2, 1, 1), 4, 1, 0, False, False,
                                                      ((3, 0, 0),)),)),
        "a tensor map without a unit last stride": dict(maps=((9, 2, 3, (1, 16), (16, 16),
                                                               (1, 16), 0),)),
    }
    for what, change in bad.items():
        with pytest.raises(ValueError, match="gemslib"):
            table.add((x, 2), {}, _spec(**change))
        assert table.size == 1, what
    with_map = _spec(launches=((1234, (2, 1, 1), 4, 1, 0, False, False,
                                ((3, 0, 0), (2, 0, 16), (2, 0, 16), (2, 0, 16), (2, 0, 1),
                                 (0, 1, 0))),), maps=((9, 2, 3, (1, 16), (16, 16), (16, 1), 0),))
    assert table.add((x, 4), {}, with_map) is True and table.size == 2
    with pytest.raises(TypeError, match="shape, stride, dtype"):
        table.add((x, 2), {}, _spec(outputs=(((16, 16), (16, 1), "float32", False),)))
    if not ON_GPU:  # no driver: a matching plan gives the call back to the Python path
        assert table.run(x, 2) is None
    assert table.run(x, 3) is None  # no plan for this signature
    table.clear()
    assert table.size == 0


def _plan(types, template, slots, constexprs=(), scratch=()):
    compiled = (lambda *args: None, (3, 1, 1), 99, False, False, (4, 1, 0), constexprs, types,
                None)
    return plans._Plan(torch.device("cuda", 0), (0,),
                       (((8,), (1,), torch.float32, False),), scratch, 0,
                       ((compiled, template, slots),))


def test_a_plan_passes_each_parameter_as_tritons_launcher_packs_it():
    """native_spec: pointers become the call's slots (scratch slots a pair and an offset),
    integers their two's-complement bytes of the parameter's width, floats their IEEE bytes
    (bf16 the top half of fp32's, as Triton truncates), constexprs nothing; a kernel whose
    types are unknown, or a parameter of a type it does not pass, has no native plan."""
    types = ("*fp32", "*fp32", "i32", "i64", "fp32", "bf16", "fp16", "i1", "constexpr", "*i32")
    template = (None, None, -1, 2**40, 1.5, 1.5, -2.0, True, None, None)
    slots = ((0, 0), (1, 1), (9, 2))
    spec = runtime.native_spec(_plan(types, template, slots, constexprs=(),
                                     scratch=((3, 64, 0, 12),)))
    device, inputs, outputs, scratch, launches, result, maps = spec
    assert (device, inputs, scratch, result, maps) == (0, (0,), ((3, 64, 0),), 0, ())
    (function, grid, warps, ctas, shared, cooperative, pdl, params), = launches
    assert (function, grid, warps, ctas, shared) == (99, (3, 1, 1), 4, 1, 0)
    fp32 = int.from_bytes(struct.pack("<f", 1.5), "little")
    assert params == ((0, 0, 0), (0, 1, 0), (2, 0, 0xFFFFFFFF), (2, 0, 2**40), (2, 0, fp32),
                      (2, 0, fp32 >> 16), (2, 0, int.from_bytes(struct.pack("<e", -2.0),
                                                                "little")),
                      (2, 0, 1), (1, 0, 12))
    assert runtime.native_spec(_plan(None, (None,), ((0, 0),))) is None
    assert runtime.native_spec(_plan(("*fp32", ("i32", "i32")), (None, (1, 2)),
                                     ((0, 0),))) is None
    assert runtime.native_spec(_plan(("*fp32", "i32"), (None, 1.5), ((0, 0),))) is None


def test_repeated_calls_replay_natively_where_the_native_path_is_on():
    """On a GPU (where the module builds) the planned operators' repeated calls, direct and
    under enable() (test_runtime's rounds, and the split softmax with kept scratch, and an
    override below autograd), replay through the native tables and give each input's own
    result; on the CPU (the interpreter, no driver) the path is off, saying why, and the
    Python replay serves."""
    if not ON_GPU:
        assert native.module() is None and native.status().startswith("off: ")
        return
    from gemslib import registry

    assert native.status() == "on"
    weight = random_tensor((256,), torch.float16)
    f16 = torch.float16
    for _ in range(5):
        x = random_tensor((5, 256), f16)
        logits = random_tensor((3, 40000), f16)  # the split form, with kept scratch
        assert_close_to_reference(gemslib.softmax(logits), torch.softmax(logits.double(), -1),
                                  f16, 40000)
        leaf = x.clone().requires_grad_()
        with gemslib.enable():
            assert_close_to_reference(torch.softmax(logits, -1),
                                      torch.softmax(logits.double(), -1), f16, 40000)
            assert_close_to_reference(
                F.rms_norm(x, (256,), weight, 1e-5),
                rms_norm_ops.rms_norm_reference(x.double(), weight.double(), 1e-5), f16, 256)
            out = F.silu(leaf)  # planned below autograd: the graph is still recorded
        out.backward(torch.ones_like(out))
        assert_close_to_reference(out, silu_ops.silu_reference(x.double()), f16)
        assert_close_to_reference(leaf.grad, silu_ops.silu_backward_reference(
            torch.ones_like(x).double(), x.double()), f16)
    test_runtime.test_repeated_calls_of_every_planned_operator_stay_right()  # 4 rounds
    assert silu_ops._SILU_CALLS._native.replays >= 2
    assert rms_norm_ops._RMS_NORM_CALLS._native.replays >= 2
    assert rms_norm_ops._ADD_RMS_NORM_CALLS._native.replays >= 2
    from gemslib.ops import softmax as softmax_ops

    assert softmax_ops._SOFTMAX_CALLS._native.replays >= 2
    for aten in ("aten::silu", "aten::_fused_rms_norm", "aten::_softmax"):
        assert registry._override_plans[aten]._native.replays >= 2, aten


def test_a_compiled_graph_s_calls_replay_natively_and_stay_right():
    """The gemslib ops of a compiled graph (its graph overloads) plan their calls and, on a
    GPU, replay them from the kernel after autograd, each run giving its own input's result;
    in the interpreter they are not planned (nothing to replay) and compute the same."""
    from gemslib.runtime.custom_op import GRAPH_PLANS

    torch._dynamo.reset()
    f16 = torch.float16
    weight = random_tensor((256,), f16)

    def norm_and_gate(x, residual):
        total = residual + x
        h = total.float()
        normed = weight * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-5)).to(f16)
        gate, up = torch.cat([normed, x], -1).chunk(2, -1)
        return F.silu(gate) * up, normed, total

    compiled = torch.compile(norm_and_gate, backend="gemslib")
    gemslib.reset_fusion_report()
    plans = GRAPH_PLANS["gemslib::add_rms_norm.graph"]
    replays = plans._native.replays if plans._native is not None else 0
    with torch.no_grad():
        for _ in range(5):
            x, residual = random_tensor((1, 5, 256), f16), random_tensor((1, 5, 256), f16)
            out, normed, total = compiled(x, residual)
            expected_normed, expected_total = rms_norm_ops.add_rms_norm_reference(
                x.double(), residual.double(), weight.double(), 1e-5)
            assert_close_to_reference(total, expected_total, f16)
            assert_close_to_reference(normed, expected_normed, f16, 256)
            assert_close_to_reference(out, silu_ops.silu_reference(normed.double()) * x.double(),
                                      f16)
    assert gemslib.fusion_report() == {"add_rms_norm": 1, "silu_and_mul": 1}
    if ON_GPU:
        assert plans._native.replays - replays >= 2
        assert GRAPH_PLANS["gemslib::silu_and_mul.graph"]._native.replays >= 2
    else:
        assert runtime.call_plan_counts().get("gemslib::add_rms_norm.graph") is None


def test_the_kernel_after_autograd_keeps_a_plan_under_the_key_of_the_call_it_passed_on(built):
    """register_replay's kernel keys a call from the dispatcher's stack: one it has no plan for
    goes on to the backend's kernel, and a plan that kernel keeps (Table.add) is kept under
    the stack's key; the next call of that signature finds it and asks ``allowed`` before
    replaying (here it says no: the plan's kernel is made up). Other signatures are not
    found; a call a Python mode sees is never keyed; after remove() the kernel is gone.
    Results are the backend kernel's."""
    library = torch.library.Library("gemslib_native_test", "DEF")
    library.define("twice(Tensor x, int[] shape, float eps) -> Tensor")
    table = built.Table(below_autograd=True)
    kept, asked = [], []

    def backend(x, shape, eps):
        kept.append(table.add((x, shape, eps), {}, _spec()))  # as CallPlans.plan would
        return x * 2

    library.impl("twice", backend, "CPU")
    twice = torch.ops.gemslib_native_test.twice
    registration = built.register_replay("gemslib_native_test::twice", table,
                                         lambda: asked.append(1) or False)
    try:
        x = torch.randn(16, 16)
        assert torch.equal(twice(x, [16], 1e-6), x * 2)
        assert kept == [True] and table.size == 1 and asked == []
        y = torch.randn(16, 16)
        assert torch.equal(twice(y, [16], 1e-6), y * 2)
        assert asked == [1]  # found under the stack's key
        assert table.size == 2  # passed on: the backend's add keyed it from Python's objects
        twice(y, [16], 1e-5)
        assert asked == [1] and table.size == 3  # another signature: pending again, kept

        class Watching(torch.utils._python_dispatch.TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                return func(*args, **(kwargs or {}))

        with Watching():  # a Python mode sees the call first (fake tensors, say): not keyed
            twice(y, [16], 1e-4)
            twice(y, [16], 1e-4)
        assert asked == [1]
        registration.remove()
        twice(y, [16], 1e-6)
        assert asked == [1]
    finally:
        registration.remove()
        library._destroy()
    with pytest.raises(ValueError, match="namespace::name"):
        built.register_replay("twice", table, lambda: True)


def test_same_data_ptrs_matches_each_listed_input_s_address_and_nothing_else(built):
    """same_data_ptrs(args, packed): True only where every (index, pointer) pair of the
    int64 bytes names a tensor at that address (views count by their own offset); a moved
    tensor, a number, an index past the inputs or bad bytes say no or raise, never read
    outside the inputs."""
    import array

    weight, cache = torch.randn(8, 4), torch.zeros(16)
    view = cache[4:]
    args = (weight, 3, cache, view)

    def packed(*pairs):
        return array.array("q", [value for pair in pairs for value in pair]).tobytes()

    listed = packed((0, weight.data_ptr()), (2, cache.data_ptr()), (3, view.data_ptr()))
    assert built.same_data_ptrs(args, listed) is True
    assert built.same_data_ptrs(list(args), listed) is True
    assert built.same_data_ptrs(args, packed()) is True
    assert built.same_data_ptrs((weight.clone(), 3, cache, view), listed) is False
    assert built.same_data_ptrs(args, packed((3, cache.data_ptr()))) is False  # view != base
    assert built.same_data_ptrs(args, packed((1, 3))) is False  # a number is no tensor
    assert built.same_data_ptrs(args, packed((4, 0))) is False
    assert built.same_data_ptrs(args, packed((-1, 0))) is False
    with pytest.raises(ValueError, match="pairs"):
        built.same_data_ptrs(args, b"\0" * 12)
    with pytest.raises(TypeError, match="tuple or list"):
        built.same_data_ptrs(weight, listed)
