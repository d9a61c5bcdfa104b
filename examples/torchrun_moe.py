"""The model of ``train_moe.py`` trained under torchrun, with no Ray: the EPCommunicator needs
nothing but a torch.distributed process group.

    torchrun --nproc_per_node 2 examples/torchrun_moe.py --steps 20          # CPU: gloo, torch backend
    torchrun --nproc_per_node 4 examples/torchrun_moe.py --steps 20 --gpu    # GPUs: NCCL group, nvshmem backend

(``python -m torch.distributed.run`` is the same as ``torchrun``.) Rank 0 prints the loss per
step and the median step time split.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.distributed as dist

from ray_ep import EPCommunicator
from train_moe import GPU_ENV, Settings, ep_config, summary, train


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--gpu", action="store_true", help="one GPU per rank (LOCAL_RANK), nvshmem backend")
    p.add_argument("--global-batch", type=int, default=Settings.global_batch)
    args = p.parse_args(argv)
    s = Settings(steps=args.steps, gpu=args.gpu, global_batch=args.global_batch)
    if args.gpu:
        for k, v in GPU_ENV.items():  # before NCCL and NVSHMEM start: NVLink multicast off
            os.environ.setdefault(k, v)
        device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", device_id=device)
    else:
        device = torch.device("cpu")
        torch.set_num_threads(1)
        dist.init_process_group("gloo")
    rank, R = dist.get_rank(), dist.get_world_size()
    if s.global_batch % R:
        p.error(f"--global-batch {s.global_batch} must be divisible by the {R} ranks")
    with EPCommunicator(ep_config(s, R), device=device) as comm:
        history = train(comm, s)
    if rank == 0:
        print(f"torchrun_moe: {R} ranks, backend {comm.backend}, "
              f"{s.global_batch} x {s.seq_len - 1} tokens per step")
        for step, loss in enumerate(history["losses"], 1):
            print(f"step {step:>5}  loss {loss:.4f}")
        m = summary(s, history)
        print(f"step {m['step_s'] * 1e3:.1f} ms (forward {m['forward_s'] * 1e3:.1f}, "
              f"backward {m['backward_s'] * 1e3:.1f}, grad sync + optimizer {m['optimizer_s'] * 1e3:.1f}; "
              f"median), {m['tokens_per_s']:.0f} tokens/s")
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
