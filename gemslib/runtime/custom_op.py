"""Whether a kernel takes a call (the predicates every operator asks first), and
:class:`CustomOp`: one operator of ``torch.ops.gemslib`` with its eager autograd Function."""

from __future__ import annotations

import functools
from typing import Callable, Mapping, Sequence

import torch

from gemslib.runtime import env
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
