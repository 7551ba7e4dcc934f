"""Why fp32 SDPA gradients drift when the forward and the backward run in different systems.

Issue 20, item 10: on the H200, fp32 SDPA with its forward under ``gemslib.enable()`` and its
backward outside (or the reverse) gave gradients 7-13 times the fp32 tolerance at q (4, 4, 3, 8),
k/v (4, 4, 6, 8). This prints, per shape, the error of each (forward, backward) pairing
against float64, and the forwards' own errors (out, lse) against float64, so the cause shows.

    python -m benchmark.experiments.sdpa_fp32_pairing
"""

from __future__ import annotations

from functools import partial

import torch

from gemslib.fused import _attention_sdpa as sdpa
from gemslib.fused import attention as attention_ops


def _relative(actual, expected) -> float:
    return float((actual.double() - expected).norm() / expected.norm().clamp_min(1e-300))


def _reference(q, k, v, causal, grad_out):
    leaves = [t.detach().double().requires_grad_() for t in (q, k, v)]
    out, lse = attention_ops.attention_reference(*leaves, causal)
    grads = torch.autograd.grad(out, leaves, grad_out.double())
    return out.detach(), lse.detach(), grads


def _grads(q, k, v, causal, grad_out, forward_in_gemslib: bool, backward_in_gemslib: bool):
    """(dq, dk, dv) through the efficient backend's aten forward and backward, each either
    torch's kernel or gemslib's implementation of it (what enable() would run)."""
    forward = (partial(sdpa._aten_efficient, attention_ops._launch_forward) if forward_in_gemslib
               else torch.ops.aten._scaled_dot_product_efficient_attention)
    backward = (partial(sdpa._aten_efficient_backward, attention_ops._launch_backward)
                if backward_in_gemslib
                else torch.ops.aten._scaled_dot_product_efficient_attention_backward)
    out, lse, seed, offset = forward(q, k, v, None, True, 0.0, causal)
    return backward(grad_out, q, k, v, None, out, lse, seed, offset, 0.0, [True, True, True, False],
                    causal)[:3]


def main() -> None:
    for scale in (1.0, 3.0):
        print(f"\n=== inputs randn * {scale}")
        run(scale)


def run(scale: float) -> None:
    torch.manual_seed(0)
    shapes = [((4, 4, 3, 8), (4, 4, 6, 8)), ((2, 4, 77, 64), (2, 4, 77, 64)),
              ((1, 2, 130, 32), (1, 2, 200, 32))]
    print("fp32 tolerance (rtol) 1.3e-6; errors are norm-wise relative to float64")
    for q_shape, kv_shape in shapes:
        for causal in (False, True):
            q = torch.randn(q_shape, device="cuda") * scale
            k = torch.randn(kv_shape, device="cuda") * scale
            v = torch.randn(kv_shape, device="cuda") * scale
            grad_out = torch.randn(q_shape[:3] + (kv_shape[-1],), device="cuda")
            ref_out, ref_lse, ref_grads = _reference(q, k, v, causal, grad_out)
            # the forwards' own outputs
            torch_out, torch_lse = torch.ops.aten._scaled_dot_product_efficient_attention(
                q, k, v, None, True, 0.0, causal)[:2]
            ours_out, ours_lse = attention_ops._launch_forward(q, k, v, causal, q_shape[-1] ** -0.5)
            seq_q = q_shape[2]
            print(f"\nq {q_shape} kv {kv_shape} causal={causal}")
            print(f"  out error: torch efficient {_relative(torch_out, ref_out):.2e}, "
                  f"gemslib {_relative(ours_out, ref_out):.2e}")
            print(f"  lse max abs error: torch efficient "
                  f"{(torch_lse[..., :seq_q].double() - ref_lse).abs().max().item():.2e}, "
                  f"gemslib {(ours_lse.double() - ref_lse).abs().max().item():.2e}; "
                  f"between them {(torch_lse[..., :seq_q] - ours_lse).abs().max().item():.2e}")
            for fwd in (False, True):
                for bwd in (False, True):
                    grads = _grads(q, k, v, causal, grad_out, fwd, bwd)
                    errors = ", ".join(f"{name} {_relative(g, r):.2e}" for name, g, r in
                                       zip("dq dk dv".split(), grads, ref_grads))
                    print(f"  forward {'gemslib' if fwd else 'torch  '} backward "
                          f"{'gemslib' if bwd else 'torch  '}: {errors}")


if __name__ == "__main__":
    main()
