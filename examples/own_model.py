"""The smallest complete use of ray_ep inside your own model (no Ray): one MoE layer, forward
and backward, on every rank of a torch.distributed group. Run it with

    torchrun --standalone --nproc_per_node 2 examples/own_model.py

On GPUs: ``init_process_group("nccl")`` after ``torch.cuda.set_device(local_rank)``, and drop
``backend`` and the fp32 wire dtypes from the config (nvshmem backend, bf16 rows).
"""

import torch
import torch.distributed as dist

from ray_ep import EPCommunicator, EPConfig
from ray_ep.nn import MoE, average_gradients

dist.init_process_group("gloo")  # torchrun, Ray Train or your own actors set the rendezvous
rank, world = dist.get_rank(), dist.get_world_size()
cfg = EPConfig(hidden_size=64, n_experts=8, top_k=2, intermediate_size=128, max_tokens_per_rank=256,
               gpus_per_node=world, backend="torch", dispatch_dtype="fp32", combine_dtype="fp32")
with EPCommunicator(cfg) as comm:  # collective; every rank must pass the same config
    layer = MoE(comm, seed=0)  # router and shared experts replicated, routed experts: this rank's
    x = torch.randn(100, 64, generator=torch.Generator().manual_seed(rank))
    out = layer(x)  # route, dispatch, experts, combine: every rank at once
    out.square().mean().backward()  # the backward is collective too
    average_gradients(layer, comm)  # gradients of the mean loss over all ranks' tokens
    if rank == 0:
        print(f"rank 0 of {world}: out {list(out.shape)}, experts {list(comm.local_expert_ids)} here, "
              f"|grad| of their gate_up {layer.w_gate_up.grad.norm():.4f}")
dist.destroy_process_group()
