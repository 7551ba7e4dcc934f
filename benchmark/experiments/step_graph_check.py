"""Experiment: the host time of a step graph's per-call check of its static inputs.

    python -m benchmark.experiments.step_graph_check [--model llama3.2-1b] [--layers 16]
                                                     [--calls 2000] [--rounds 7]

The question it answers (docs/notes/decode.md, the step graph): what
``gemslib.passes.step_graph`` spends on every call to check that each static input of a
compiled step (the model's parameters and its static cache: one tensor each) is still at the
address the graph was captured with. The inputs are those of ``--model`` with ``--layers``
layers (its parameters, then a K and a V cache tensor a layer), on the GPU where there is one,
else on the CPU (the tiny config; only the number of tensors matters). Printed, us a call,
least of ``--rounds`` blocks of ``--calls``: gemslib's native check (where the module builds),
torch's ``_tensors_data_ptrs_at_indices_equal`` (what CUDA-graph trees call; CUDA builds of
torch only) and a Python loop.
"""

from __future__ import annotations

import argparse
import dataclasses
import time

import torch

from benchmark.models import MODELS, build_model
from gemslib.passes import step_graph
from gemslib.runtime import native


def _least_us(check, args, calls: int, rounds: int) -> float:
    least = float("inf")
    for _ in range(rounds):
        started = time.perf_counter()
        for _ in range(calls):
            check(args)
        least = min(least, (time.perf_counter() - started) / calls * 1e6)
    return least


def main(argv: list[str] | None = None):
    parser = argparse.ArgumentParser(prog="python -m benchmark.experiments.step_graph_check")
    parser.add_argument("--model", choices=list(MODELS), default="llama3.2-1b")
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--calls", type=int, default=2000)
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args(argv)

    on_gpu = torch.cuda.is_available()
    device = "cuda" if on_gpu else "cpu"
    spec = dataclasses.replace(MODELS[args.model], layers=args.layers)
    if not on_gpu:
        from benchmark import realmodels

        spec = realmodels.model_spec(args.model, tiny=True, layers=args.layers)
    model = build_model(spec, device, torch.bfloat16 if on_gpu else torch.float32)
    caches = [torch.zeros(2, device=device) for _ in range(2 * args.layers)]
    inputs = tuple([*model.parameters(), *caches, torch.zeros(1, device=device)])
    indices = list(range(len(inputs) - 1))  # the last one moves (the token)
    pointers = [inputs[i].data_ptr() for i in indices]

    built = None
    try:
        built = native.load(native.build())
    except RuntimeError as err:
        print(f"native module not built: {err}")
    ways = {}
    if built is not None:  # as step_graph._pointer_check calls it on a GPU
        packed = step_graph.packed_pairs(indices, pointers)
        ways["gemslib native"] = lambda a: built.same_data_ptrs(a, packed)
    torch_check = getattr(torch._C, "_tensors_data_ptrs_at_indices_equal", None)
    if torch_check is not None:  # in torch's CUDA builds only
        ways["torch's check"] = lambda a: torch_check(list(a), pointers, indices)
    ways["Python loop"] = lambda a: all(a[i].data_ptr() == p for i, p in zip(indices, pointers))
    print(f"{spec.title} {args.layers}L on {device}: {len(indices)} static inputs checked a call")
    for name, check in ways.items():
        assert check(inputs), name
        print(f"  {name}: {_least_us(check, inputs, args.calls, args.rounds):.2f} us a call")


if __name__ == "__main__":
    main()
