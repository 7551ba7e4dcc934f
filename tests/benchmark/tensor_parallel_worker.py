"""One rank of tests/benchmark/test_tensor_parallel.py (not a test module): a tiny Llama built the same
way on every rank, its layers sharded over the ranks with torch's tensor-parallel styles (q, k,
v, gate, up column-parallel; o and down row-parallel, whose outputs are all-reduced), run eager,
under ``gemslib.enable()`` and through ``backend="gemslib"``; writes each way's largest logit
error against the unsharded model, whether eager still gives what it gave before the compile
(which merges the shards in place), the backend's fusion report, and a second compile's error
(at another length, over the merged shards) against eager, as JSON.

On a machine with a GPU both ranks share it (gloo all-reduces CUDA tensors) and run the
compiled kernels; elsewhere they run on the CPU under the Triton interpreter.

    RANK=r WORLD_SIZE=2 MASTER_ADDR=127.0.0.1 MASTER_PORT=p python tests/benchmark/tensor_parallel_worker.py OUT DEVICE
"""

import json
import os
import sys

if sys.argv[2] == "cpu":
    os.environ["TRITON_INTERPRET"] = "1"
    os.environ["CUDA_VISIBLE_DEVICES"] = ""

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import transformers  # noqa: E402
from torch.distributed.device_mesh import init_device_mesh  # noqa: E402
from torch.distributed.tensor.parallel import (ColwiseParallel, RowwiseParallel,  # noqa: E402
                                               parallelize_module)

import gemslib  # noqa: E402

PLAN = {"self_attn.q_proj": ColwiseParallel(), "self_attn.k_proj": ColwiseParallel(),
        "self_attn.v_proj": ColwiseParallel(), "self_attn.o_proj": RowwiseParallel(),
        "mlp.gate_proj": ColwiseParallel(), "mlp.up_proj": ColwiseParallel(),
        "mlp.down_proj": RowwiseParallel()}


def main(out_path: str, device: str) -> None:
    dist.init_process_group("gloo")
    try:
        config = transformers.LlamaConfig(
            vocab_size=96, hidden_size=64, intermediate_size=112, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, head_dim=16)
        torch.manual_seed(0)  # the same weights and ids on every rank
        model = transformers.LlamaForCausalLM(config).float().eval().to(device)
        for name, parameter in model.named_parameters():
            if "norm" in name:
                parameter.data.uniform_(0.5, 1.5)
        ids = torch.randint(3, 96, (2, 11)).to(device)
        with torch.no_grad():
            reference = model(ids).logits
        mesh = init_device_mesh(device, (dist.get_world_size(),))
        for layer in model.model.layers:
            parallelize_module(layer, mesh, PLAN)

        def error_against(logits, expected):
            return ((logits - expected).abs().max() / expected.abs().max()).item()

        def error(logits):
            return error_against(logits, reference)

        with torch.no_grad():
            eager = model(ids).logits
            result = {"eager": error(eager)}
            with gemslib.enable():
                result["enable"] = error(model(ids).logits)
            gemslib.reset_fusion_report()
            compiled = torch.compile(model, backend="gemslib", fullgraph=True)
            result["backend"] = error(compiled(ids).logits)
            # the merged shards alias one buffer: the eager model computes what it did before
            result["eager_unchanged"] = torch.equal(model(ids).logits, eager)
            result["fusions"] = gemslib.fusion_report()
            # a new compile (another length) fakeifies the merged shards again
            torch._dynamo.reset()
            shorter = ids[:, :7]
            recompiled = torch.compile(model, backend="gemslib", fullgraph=True)(shorter).logits
            result["recompiled"] = error_against(recompiled, model(shorter).logits)
        with open(out_path, "w") as f:
            json.dump(result, f)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
    # as benchmark.tensor_parallel.leave_without_teardown: the interpreter's teardown beside
    # gloo's threads aborts now and then after all is written (exit -6)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
