"""The SDPA backend operators that ``F.scaled_dot_product_attention`` reaches (CUDA: flash, cuDNN
or memory-efficient, whichever torch picks; CPU: its flash kernel), each with its backward
operator, adapted to attention.py's kernels: which calls they take (``_why_not_*``) and each
backend's layouts of arguments and results. Each forward saves the lse in its backend's own
layout and units (natural log), so a forward and a backward may run in different enable()
scopes: either half reads what the other wrote.

Each ``_aten_*`` adapter takes the kernels' entry point first, ``forward(q, k, v, causal, scale,
out) -> (o, lse)`` or ``backward(grad_out, q, k, v, o, lse, grad_lse, causal, scale) -> (dq,
dk, dv)``; attention.py binds it in its ``ATEN_OVERRIDES``, so this module does not import
attention.py.
"""

from __future__ import annotations

import torch

from gemslib import runtime
from gemslib.fused._attention_common import default_scale


def _why_not_sdpa(query, key, value, attn_bias=None, dropout_p=0.0, scale=None):
    """Why the kernels do not take this SDPA call (None: they do)."""
    if query.dtype not in runtime.KERNEL_DTYPES:
        return f"dtype {query.dtype}"
    if not runtime.dot_kernel_runs(query):
        return runtime.INTERPRETER_BF16_DOT
    if attn_bias is not None:
        return "an attention mask or bias"
    if dropout_p:
        return "dropout"
    if query.dim() != 4 or key.dim() != 4 or value.dim() != 4:
        return "inputs that are not (B, H, S, D)"
    if key.shape[1] == 0 or query.shape[1] % key.shape[1] or key.shape[-1] != query.shape[-1]:
        return "head counts or head dims the kernel does not pair"
    if max(query.shape[-1], value.shape[-1]) > 256:
        return "a head dim over 256"
    if min(query.shape[-1], value.shape[-1]) == 0:
        return "a head dim of 0"
    return None


_FP32_PAIRING = ("fp32 SDPA that records gradients (torch's backward, wherever it runs, "
                 "recomputes the scores in its own arithmetic; an lse from gemslib's pairs with "
                 "them only to their fp32 rounding)")


def _why_not_sdpa_forward(query, key, value, attn_bias=None, dropout_p=0.0, scale=None):
    """:func:`_why_not_sdpa` for the forward operators. An fp32 forward that autograd records
    stays torch's: its backward may run outside enable() and its scores, recomputed there by
    torch, round differently from gemslib's; at peaked rows the difference to the saved lse
    does not cancel, and the gradients' error grows well past torch's own (see
    docs/notes/attention.md). So fp32 SDPA training under enable() is torch's forward and
    backward; fp32 inference is gemslib's."""
    if query.dtype == torch.float32 and torch.is_grad_enabled() and (
            query.requires_grad or key.requires_grad or value.requires_grad):
        return _FP32_PAIRING
    return _why_not_sdpa(query, key, value, attn_bias, dropout_p, scale)


def _matching_layout(query, shape):
    """An empty tensor of ``shape`` whose dimensions are laid out in the order of query's
    strides (torch's SDPA backends give their outputs q's layout; their fake kernels say so,
    and torch.compile checks real outputs against them)."""
    if tuple(query.shape) == tuple(shape):
        if query.is_contiguous():
            # also when only a dim of size 1 (one query row) is out of order: empty_like keeps
            # its stride on real tensors, the fake kernels' (on meta) are plain contiguous
            return torch.empty(shape, dtype=query.dtype, device=query.device)
        return torch.empty_like(query)
    order = sorted(range(4), key=lambda dim: query.stride(dim), reverse=True)
    return torch.empty([shape[dim] for dim in order], dtype=query.dtype,
                       device=query.device).permute([order.index(dim) for dim in range(4)])


def _sdpa_outputs(forward, query, key, value, is_causal, scale, out=None):
    default = default_scale(query.shape[-1])
    if out is None:
        out = _matching_layout(query, (*query.shape[:3], value.shape[-1]))
    return forward(query, key, value, is_causal, default if scale is None else scale, out)


def _aten_flash_for_cpu(forward, query, key, value, dropout_p=0.0, is_causal=False, *,
                        attn_mask=None, scale=None):
    out, lse = _sdpa_outputs(forward, query, key, value, is_causal, scale)
    # torch's CPU kernel keeps lse as (B, Sq, H) memory seen as (B, H, Sq)
    batch, heads, seq_q = lse.shape
    return out, lse.new_empty((batch, seq_q, heads)).transpose(1, 2).copy_(lse)


def _why_not_flash_for_cpu(query, key, value, dropout_p=0.0, is_causal=False, *, attn_mask=None,
                           scale=None):
    return _why_not_sdpa_forward(query, key, value, attn_mask, dropout_p, scale)


def _sdpa_gradients(backward, grad_out, query, key, value, out, logsumexp, is_causal, scale,
                    heads_last: bool):
    """(dq, dk, dv) for an SDPA backward operator. ``logsumexp``: the forward's, in any
    backend's layout ((B, H, Sq), cuDNN's (B, H, Sq, 1), efficient's padded (B, H, >= Sq), CPU's
    strided). The gradients take the layout of torch's fake kernel for the operator: like the
    inputs (CUDA flash, cuDNN), or ``heads_last`` (B, S, H, D) memory (CPU flash, efficient)."""
    default = default_scale(query.shape[-1])
    lse = logsumexp[..., 0] if logsumexp.dim() == 4 else logsumexp[..., :query.shape[2]]
    grads = backward(grad_out, query, key, value, out, lse.float().contiguous(), None, is_causal,
                     default if scale is None else scale)
    layouts = [torch.empty_permuted(t.shape, (0, 2, 1, 3), dtype=t.dtype, device=t.device)
               if heads_last else torch.empty_like(t) for t in (query, key, value)]
    return tuple(grad if grad.stride() == want.stride() else want.copy_(grad)
                 for grad, want in zip(grads, layouts))


def _why_not_sdpa_backward(grad_out, query, key, value, attn_bias=None, dropout_p=0.0,
                           scale=None):
    # the same call's forward went to the kernels exactly when _why_not_sdpa said None, and
    # when it did not, torch's forward saved the lse in the layout the backward reads
    if grad_out.dtype != query.dtype:
        return f"grad_out in {grad_out.dtype}, inputs in {query.dtype}"
    if query.dtype == torch.float32:  # its forward was torch's (_why_not_sdpa_forward)
        return _FP32_PAIRING
    return _why_not_sdpa(query, key, value, attn_bias, dropout_p, scale)


def _aten_flash_for_cpu_backward(backward, grad_out, query, key, value, out, logsumexp, dropout_p,
                                 is_causal, *, attn_mask=None, scale=None):
    return _sdpa_gradients(backward, grad_out, query, key, value, out, logsumexp, is_causal,
                           scale, heads_last=True)


def _why_not_flash_for_cpu_backward(grad_out, query, key, value, out, logsumexp, dropout_p,
                                    is_causal, *, attn_mask=None, scale=None):
    return _why_not_sdpa_backward(grad_out, query, key, value, attn_mask, dropout_p, scale)


def _placeholder(query):
    """An empty tensor where the operator returns one that is unused here (debug mask)."""
    return torch.empty(0, dtype=query.dtype, device=query.device)


def _philox_placeholders(query):
    """(seed, offset) as torch's cuDNN and efficient kernels give them without dropout: 0-d
    int64, left unwritten as torch leaves them (no dropout here, so no backward reads them;
    zeroing them would cost two launches a call)."""
    return (torch.empty((), dtype=torch.int64, device=query.device),
            torch.empty((), dtype=torch.int64, device=query.device))


def _aten_flash(forward, query, key, value, dropout_p=0.0, is_causal=False,
                return_debug_mask=False, *, scale=None):
    out, lse = _sdpa_outputs(forward, query, key, value, is_causal, scale)
    # (output, logsumexp, cum_seq_q, cum_seq_k, max_q, max_k, rng_state, unused, debug_mask)
    # as torch's kernel gives them without dropout: undefined cum_seq (defined ones would
    # tell torch's backward the batch is nested), a (2,) rng state and a 0-d unused, both left
    # unwritten as torch's kernel leaves them without dropout
    return (out, lse, None, None, query.shape[2], key.shape[2],
            torch.empty(2, dtype=torch.uint64, device=query.device),
            torch.empty((), dtype=torch.uint64, device=query.device),
            _placeholder(query))


def _why_not_flash(query, key, value, dropout_p=0.0, is_causal=False, return_debug_mask=False,
                   *, scale=None):
    return "a debug mask" if return_debug_mask else \
        _why_not_sdpa_forward(query, key, value, None, dropout_p, scale)


def _aten_cudnn(forward, query, key, value, attn_bias, compute_log_sumexp, dropout_p=0.0,
                is_causal=False, return_debug_mask=False, *, scale=None):
    out, lse = _sdpa_outputs(forward, query, key, value, is_causal, scale)
    # (output, logsumexp, cum_seq_q, cum_seq_k, max_q, max_k, philox_seed, philox_offset, mask);
    # cuDNN keeps lse as (B, H, Sq, 1)
    return (out, lse.unsqueeze(-1), None, None, query.shape[2], key.shape[2],
            *_philox_placeholders(query), None)


def _why_not_cudnn(query, key, value, attn_bias, compute_log_sumexp, dropout_p=0.0,
                   is_causal=False, return_debug_mask=False, *, scale=None):
    return "a debug mask" if return_debug_mask else \
        _why_not_sdpa_forward(query, key, value, attn_bias, dropout_p, scale)


def _aten_efficient(forward, query, key, value, attn_bias, compute_log_sumexp, dropout_p=0.0,
                    is_causal=False, *, scale=None):
    batch, heads, seq_q, _ = query.shape
    # the efficient kernel's layouts: o as (B, Sq, H, Dv) memory, lse padded to 32 rows (or
    # empty when not asked for)
    out = query.new_empty((batch, seq_q, heads, value.shape[-1])).transpose(1, 2)
    out, lse = _sdpa_outputs(forward, query, key, value, is_causal, scale, out)
    padded = lse.new_zeros((batch, heads, -(-seq_q // 32) * 32 if compute_log_sumexp else 0))
    padded[..., :seq_q] = lse[..., :padded.shape[-1]]
    return out, padded, *_philox_placeholders(query)


def _why_not_efficient(query, key, value, attn_bias, compute_log_sumexp, dropout_p=0.0,
                       is_causal=False, *, scale=None):
    return _why_not_sdpa_forward(query, key, value, attn_bias, dropout_p, scale)


def _aten_flash_backward(backward, grad_out, query, key, value, out, logsumexp, cum_seq_q,
                         cum_seq_k, max_q, max_k, dropout_p, is_causal, philox_seed,
                         philox_offset, *, scale=None):
    return _sdpa_gradients(backward, grad_out, query, key, value, out, logsumexp, is_causal,
                           scale, heads_last=False)


def _why_not_flash_backward(grad_out, query, key, value, out, logsumexp, cum_seq_q, cum_seq_k,
                            max_q, max_k, dropout_p, is_causal, philox_seed, philox_offset, *,
                            scale=None):
    return _why_not_sdpa_backward(grad_out, query, key, value, None, dropout_p, scale)


def _aten_cudnn_backward(backward, grad_out, query, key, value, out, logsumexp, philox_seed,
                         philox_offset, attn_bias, cum_seq_q, cum_seq_k, max_q, max_k, dropout_p,
                         is_causal, *, scale=None):
    return _sdpa_gradients(backward, grad_out, query, key, value, out, logsumexp, is_causal,
                           scale, heads_last=False)


def _why_not_cudnn_backward(grad_out, query, key, value, out, logsumexp, philox_seed,
                            philox_offset, attn_bias, cum_seq_q, cum_seq_k, max_q, max_k,
                            dropout_p, is_causal, *, scale=None):
    return _why_not_sdpa_backward(grad_out, query, key, value, attn_bias, dropout_p, scale)


def _aten_efficient_backward(backward, grad_out, query, key, value, attn_bias, out, logsumexp,
                             philox_seed, philox_offset, dropout_p, grad_input_mask,
                             is_causal=False, *, scale=None):
    dq, dk, dv = _sdpa_gradients(backward, grad_out, query, key, value, out, logsumexp,
                                 is_causal, scale, heads_last=True)
    return dq, dk, dv, _placeholder(query)  # no bias, no bias gradient


def _why_not_efficient_backward(grad_out, query, key, value, attn_bias, out, logsumexp,
                                philox_seed, philox_offset, dropout_p, grad_input_mask,
                                is_causal=False, *, scale=None):
    return _why_not_sdpa_backward(grad_out, query, key, value, attn_bias, dropout_p, scale)
