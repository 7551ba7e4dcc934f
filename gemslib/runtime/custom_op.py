"""Whether a kernel takes a call (the predicates every operator asks first), and
:class:`CustomOp`: one operator of ``torch.ops.gemslib`` with its eager autograd Function and
its ``graph`` overload, the form compiled graphs launch it in."""

from __future__ import annotations

import functools
from typing import Callable, Mapping, Sequence

import torch

from gemslib.runtime import env, native
from gemslib.runtime.plans import CallPlans, native_replay_allowed
from gemslib.runtime.recording import recordable


def on_kernel_device(tensor: torch.Tensor) -> bool:
    """True when ``tensor`` lives where the kernels can run (CUDA, or CPU when interpreted)."""
    return tensor.is_cpu if env.INTERPRETER else tensor.is_cuda  # attributes: cheap on the hot path


KERNEL_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def kernel_runs(*tensors: torch.Tensor | None) -> bool:
    """The Triton kernels take these tensors (``None`` entries ignored): a kernel dtype, on the
    kernel device. Anything else is computed by torch."""
    for t in tensors:  # a plain loop: this runs on every call
        if t is not None and (t.dtype not in KERNEL_DTYPES or not on_kernel_device(t)):
            return False
    return True


# Triton 3.6's interpreter computes tl.dot on bf16 operands wrongly (it multiplies the raw bit
# patterns), so under the interpreter bf16 calls of the dot-product kernels go to torch. Tests
# that only record launches (to compile them for sm_90) switch this on.
interpret_bf16_dots = False


def dot_kernel_runs(*tensors: torch.Tensor | None) -> bool:
    """:func:`kernel_runs` for kernels built on ``tl.dot``: also False for bf16 tensors under
    the interpreter (see ``interpret_bf16_dots``)."""
    if not kernel_runs(*tensors):
        return False
    return not env.INTERPRETER or interpret_bf16_dots or all(
        t is None or t.dtype != torch.bfloat16 for t in tensors)


INTERPRETER_BF16_DOT = "bf16 under the Triton interpreter (its bf16 tl.dot is wrong)"


def wants_custom_op(*tensors: torch.Tensor | None) -> bool:
    """Route a public call through its ``torch.ops.gemslib`` op, because autograd or
    torch.compile has to see it; otherwise the launcher is called directly (less host time)."""
    if torch.is_grad_enabled():
        for t in tensors:
            if t is not None and t.requires_grad:
                return True
    return torch.compiler.is_compiling()


class CustomOp:
    """One operator of ``torch.ops.gemslib``, defined once from its pieces.

    ``impl`` computes it (tensors in, tensors out) and ``fake`` gives its outputs' shapes and
    dtypes for tracing; with ``backward`` it is differentiable, and :meth:`__call__` runs it
    the way the caller's context needs:

    * while torch.compile traces, the custom op (``register_fake`` + ``register_autograd``), so
      the graph holds ``torch.ops.gemslib.<name>`` and its backward op;
    * otherwise an eager ``torch.autograd.Function`` with the same ``impl``, ``setup_context``
      and ``backward``: the custom op's Python dispatch costs more host time per forward +
      backward than the kernels take at most sizes (see docs/notes/host-path.md).

    ``setup_context(ctx, inputs, output)`` saves what the backward needs (register_autograd's
    form). ``backward(ctx, *grads, ops)`` returns one gradient per input; ``ops`` holds the
    operators named in ``uses`` (and this one), by name, each as the graph needs it: under
    torch.compile their custom ops, in eager mode their ``impl`` (no dispatch), or their eager
    Functions when ``differentiable_backward``.

    Unless ``differentiable_backward`` (the backward is built from differentiable calls), an
    eager backward with ``create_graph=True`` raises instead of giving second derivatives that
    silently miss this operation.

    Each operator also has the overload ``torch.ops.gemslib.<name>.graph`` (see
    :func:`define_graph_overload`): the same computation without autograd, planned per
    signature and replayed in C++, which gemslib's graph passes put in compiled graphs.
    """

    def __init__(self, name: str, impl: Callable, fake: Callable, *,
                 mutates_args: Sequence[str] = (), setup_context: Callable | None = None,
                 backward: Callable | None = None, uses: Sequence[CustomOp] = (),
                 differentiable_backward: bool = False):
        self.name, self.impl = name, impl
        self.op = torch.library.custom_op(f"gemslib::{name}",
                                          recordable(name, impl, bool(mutates_args)),
                                          mutates_args=mutates_args)
        self.op.register_fake(fake)
        self.graph_op = define_graph_overload(name, recordable(name, impl, bool(mutates_args)),
                                              fake, mutates_args=mutates_args)
        self.eager_function: type[torch.autograd.Function] | None = None
        if backward is None:
            return
        operators = (self, *uses)
        traced = _OpCalls({o.name: o.op for o in operators})
        # eager: a differentiable backward calls differentiable operators (this one's Function
        # exists once __init__ returns, hence _apply); any other calls the bare implementations
        eager = _OpCalls({
            o.name: o._apply if differentiable_backward and (o is self or o.eager_function)
            else o.impl for o in operators})
        self.op.register_autograd(functools.partial(backward, ops=traced),
                                  setup_context=setup_context)
        self.eager_function = _eager_function(
            self.function_name, impl, setup_context, functools.partial(backward, ops=eager),
            differentiable_backward)

    @property
    def function_name(self) -> str:
        """The eager Function's name (what ``grad_fn`` shows): ``silu_and_mul`` ->
        ``SiluAndMulFunction``."""
        return "".join(part.capitalize() for part in self.name.split("_")) + "Function"

    def _apply(self, *args):
        return self.eager_function.apply(*args)

    def __call__(self, *args):
        if self.eager_function is None or torch.compiler.is_compiling():
            return self.op(*args)
        return self.eager_function.apply(*args)


class _OpCalls:
    """The operators a backward calls, as attributes (``ops.silu_backward(grad, x)``)."""

    def __init__(self, calls: Mapping[str, Callable]):
        self.__dict__.update(calls)


def _eager_function(name: str, forward: Callable, setup_context: Callable, backward: Callable,
                    differentiable_backward: bool) -> type[torch.autograd.Function]:
    if not differentiable_backward:
        first_order = backward

        def backward(ctx, *grads):
            if torch.is_grad_enabled():  # autograd enables grad in backward only for create_graph
                raise RuntimeError(f"gemslib: {name} has no second derivative (a backward with "
                                   "create_graph=True went through it)")
            return first_order(ctx, *grads)

    def forward_and_setup(ctx, *args):
        # the older forward(ctx, ...) form: Function.apply binds default arguments with
        # inspect.signature on every call when setup_context is separate, which is slow
        output = forward(*args)
        setup_context(ctx, args, output)
        return output

    return type(name, (torch.autograd.Function,), {
        "forward": staticmethod(forward_and_setup), "backward": staticmethod(backward)})


# --------------------------------------------------------------------------------------------
# The graph overload: what a compiled graph calls
# --------------------------------------------------------------------------------------------

GRAPH_OVERLOAD = "graph"
_graph_library: torch.library.Library | None = None
_native_registrations: dict[str, object] = {}  # "gemslib::<name>.graph" -> its replay kernel
GRAPH_PLANS: dict[str, CallPlans] = {}  # "gemslib::<name>.graph" -> its calls' plans


def define_graph_overload(name: str, run: Callable, fake: Callable, *,
                          mutates_args: Sequence[str] = ()) -> torch._ops.OpOverload:
    """Define ``gemslib::<name>.graph``, ``run`` (tensors in, tensors out) as a compiled graph
    calls it, and return it.

    Inductor's generated code calls each custom op of a graph through the dispatcher, once per
    run of the graph; what that call costs on the host is paid at every step that is not
    replayed from a CUDA graph. The default overload pays for its autograd kernel (Python,
    even under no_grad) and for ``run``'s own checks and choices; this overload has no
    autograd (gemslib's passes run after autograd has been split off, so nothing of a graph
    needs it) and its calls are planned per signature (:class:`CallPlans`, after autograd):
    from the third call of a signature on, a call is its allocations and launches, and for a
    functional operator, where :mod:`.native` is on, it is replayed by a C++ kernel registered
    after autograd without entering Python at all. Calls a plan cannot serve (lists of
    tensors, a torch fallback, a recording tuner) run ``run`` itself."""
    global _graph_library
    if _graph_library is None:
        _graph_library = torch.library.Library("gemslib", "FRAGMENT")
    schema = torch.library.infer_schema(run, mutates_args=mutates_args)
    _graph_library.define(f"{name}.{GRAPH_OVERLOAD}{schema}")
    qualified = f"gemslib::{name}.{GRAPH_OVERLOAD}"
    parsed = torch._C.parse_schema(f"gemslib::{name}.{GRAPH_OVERLOAD}{schema}")
    if any(_is_tensor_list(argument.type) for argument in parsed.arguments):
        # a list of tensors has no plan key: the call runs ``run`` itself, without first
        # computing a key that the list ends (1.6 of merged_linear's 11 us a call on a CPU)
        def kernel(*args):
            return run(*args)
        return _register_graph_overload(name, kernel, fake)
    plans = GRAPH_PLANS[qualified] = CallPlans(qualified, below_autograd=True)
    replayed_natively = not mutates_args  # the C++ kernel bumps no version counters

    def kernel(*args):
        key, planned = plans.replayed(*args)
        if planned is not None:
            return planned
        if replayed_natively and key is not None and qualified not in _native_registrations:
            # before the call that plans: its plan is then kept under the key the C++ kernel
            # makes from the dispatcher's stack
            table = plans.native_table()
            _native_registrations[qualified] = None if table is None else \
                native.module().register_replay(qualified, table, native_replay_allowed)
        return plans.plan(key, args, lambda: run(*args))

    return _register_graph_overload(name, kernel, fake)


def _is_tensor_list(kind) -> bool:
    if not isinstance(kind, torch.ListType):
        return False
    element = kind.getElementType()
    if isinstance(element, torch.OptionalType):
        element = element.getElementType()
    return isinstance(element, torch.TensorType)


def _register_graph_overload(name: str, kernel: Callable, fake: Callable
                             ) -> torch._ops.OpOverload:
    kernel.__name__ = f"gemslib_{name}_{GRAPH_OVERLOAD}"
    _graph_library.impl(f"{name}.{GRAPH_OVERLOAD}", kernel, "CompositeExplicitAutograd")
    torch.library.register_fake(f"gemslib::{name}.{GRAPH_OVERLOAD}", fake, lib=_graph_library)
    return getattr(getattr(torch.ops.gemslib, name), GRAPH_OVERLOAD)
