"""Train a small MoE transformer with Ray Train: every worker creates an EPCommunicator over the
process group that Ray Train set up, holds its share of the experts and trains on its share
of each batch (experts expert-parallel, everything else data-parallel).

    python examples/train_moe.py --workers 2 --steps 30                 # CPU workers (gloo, torch backend)
    python examples/train_moe.py --workers 4 --gpu --steps 100          # one GPU each: nvshmem backend
    python examples/train_moe.py --workers 2 --steps 40 --storage /tmp/moe --name run1
                                    # run it again with more --steps: it resumes from the last checkpoint

Data: synthetic sequences that count up by a per-sequence stride modulo the vocabulary, so the
loss has somewhere to go (from ln V). Each step draws one global batch from (seed, step) and
rank r trains on its slice; gradients are averaged over the ranks (``average_gradients``), so
R workers take the same steps as one process training on the whole batch. CPU workers move
rows in fp32 (the torch backend), GPUs in bf16 over NVSHMEM with fp32 parameters.

Checkpoints: every ``--checkpoint-every`` steps each rank writes its own file (its experts
differ) into the checkpoint that Ray Train merges; a run started again with the same
``--storage`` and ``--name`` resumes from the latest one with the same number of workers.
Ray Train hears from the workers only then (and at the last step, with the whole loss curve):
each ``ray.train.report`` waits on its controller for about 2.5 s, so a report per step made
a 60-step run take minutes.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from dataclasses import asdict, dataclass

import torch

from ray_ep import EPCommunicator, EPConfig
from ray_ep.nn import MoETransformer, average_gradients

# NVLink multicast off for NVSHMEM and NCCL (set before either starts in the workers)
GPU_ENV = {"NVSHMEM_DISABLE_NVLS": "1", "NCCL_NVLS_ENABLE": "0"}


@dataclass(frozen=True)
class Settings:
    """One training run; the same on every rank."""

    steps: int = 30
    global_batch: int = 8
    """Sequences per step over all ranks (each rank trains on global_batch / world_size)."""
    seq_len: int = 17
    vocab_size: int = 64
    hidden_size: int = 64
    n_layers: int = 2
    n_heads: int = 4
    n_experts: int = 8
    top_k: int = 2
    intermediate_size: int = 64
    n_shared_experts: int = 1
    lr: float = 3e-3
    seed: int = 0
    checkpoint_every: int = 10
    gpu: bool = False


def ep_config(s: Settings, world_size: int) -> EPConfig:
    """The EP config of a run on ``world_size`` ranks (one node): buffers for a rank's share of
    the batch."""
    wire = {} if s.gpu else dict(dispatch_dtype="fp32", combine_dtype="fp32", backend="torch")
    return EPConfig(hidden_size=s.hidden_size, n_experts=s.n_experts, top_k=s.top_k,
                    intermediate_size=s.intermediate_size, n_shared_experts=s.n_shared_experts,
                    max_tokens_per_rank=s.global_batch // world_size * (s.seq_len - 1), gpus_per_node=world_size,
                    **wire)


def batch(s: Settings, step: int, rank: int, world_size: int, device: torch.device) -> torch.Tensor:
    """This rank's slice [global_batch / R, seq_len] of step ``step``'s global batch."""
    g = torch.Generator().manual_seed(s.seed * 100_003 + step)
    start = torch.randint(0, s.vocab_size, (s.global_batch, 1), generator=g)
    stride = torch.randint(1, 4, (s.global_batch, 1), generator=g)
    seqs = (start + stride * torch.arange(s.seq_len)) % s.vocab_size
    per_rank = s.global_batch // world_size
    return seqs[rank * per_rank:(rank + 1) * per_rank].to(device)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def train(comm: EPCommunicator, s: Settings, state: dict | None = None, on_step=None) -> dict:
    """Train from ``state`` (a checkpoint's, or None) up to ``s.steps``; every rank at once.
    ``on_step(step, history, model, optimizer)`` runs after each step. Returns the run's
    history: the mean loss over the ranks per step, and the step time split."""
    R, dev = comm.world_size, comm.device
    model = MoETransformer(comm, vocab_size=s.vocab_size, n_layers=s.n_layers, n_heads=s.n_heads,
                           max_seq_len=s.seq_len, seed=s.seed)
    opt = torch.optim.AdamW(model.parameters(), lr=s.lr)
    first = 0
    if state is not None:
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["optimizer"])
        first = state["step"]
    history = {"losses": [], "forward_s": [], "backward_s": [], "optimizer_s": [], "step_s": []}
    for step in range(first, s.steps):
        tokens = batch(s, step, comm.rank, R, dev)
        _sync(dev)
        t0 = time.perf_counter()
        loss = model.loss(tokens)
        _sync(dev)
        t1 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        _sync(dev)
        t2 = time.perf_counter()
        average_gradients(model, comm)
        opt.step()
        _sync(dev)
        t3 = time.perf_counter()
        mean = loss.detach().clone()
        torch.distributed.all_reduce(mean, group=comm.group)
        history["losses"].append(mean.item() / R)
        for key, dt in (("forward_s", t1 - t0), ("backward_s", t2 - t1), ("optimizer_s", t3 - t2), ("step_s", t3 - t0)):
            history[key].append(dt)
        if on_step is not None:
            on_step(step + 1, history, model, opt)
    return history


def summary(s: Settings, history: dict) -> dict:
    """Median step time and its split, tokens per second (the whole batch)."""
    if not history["step_s"]:
        return {}
    med = {k: statistics.median(v) for k, v in history.items() if k.endswith("_s")}
    return {**med, "tokens_per_s": s.global_batch * (s.seq_len - 1) / med["step_s"]}


def train_loop_per_worker(config: dict) -> None:
    """Ray Train's entry: the process group is up (gloo on CPU, NCCL on GPU)."""
    import ray.train
    import ray.train.torch

    s = Settings(**config["settings"])
    ctx = ray.train.get_context()
    device = ray.train.torch.get_device()
    if device.type == "cuda":
        torch.cuda.set_device(device)
    else:
        torch.set_num_threads(1)  # the workers share the host's cores
    rank, R = ctx.get_world_rank(), ctx.get_world_size()
    state = None
    checkpoint = ray.train.get_checkpoint()
    if checkpoint is not None:
        with checkpoint.as_directory() as path:
            state = torch.load(os.path.join(path, f"rank{rank}.pt"), map_location=device, weights_only=True)

    def on_step(step: int, history: dict, model, opt) -> None:
        metrics = {"step": step, "loss": history["losses"][-1]}
        if step == s.steps:  # the driver reads the run's curve from the last report (rank 0's)
            metrics.update(history=history, summary=summary(s, history), resumed_at=state and state["step"])
        if step % s.checkpoint_every and step != s.steps:
            # no report between checkpoints: each ray.train.report waits on Ray Train's
            # controller (~2.5 s per report on CPU and on GPU hosts, against ~20 ms per step)
            return
        with tempfile.TemporaryDirectory() as tmp:
            torch.save({"model": model.state_dict(), "optimizer": opt.state_dict(), "step": step},
                       os.path.join(tmp, f"rank{rank}.pt"))
            ray.train.report(metrics, checkpoint=ray.train.Checkpoint.from_directory(tmp))

    with EPCommunicator(ep_config(s, R), device=device) as comm:
        train(comm, s, state, on_step)


def run(s: Settings, workers: int, storage: str, name: str) -> dict:
    """Train with a Ray Train TorchTrainer of ``workers`` ranks; returns the run's history."""
    import ray
    from ray.train import RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    if not ray.is_initialized():
        ray.init(num_cpus=max(os.cpu_count() or 1, workers + 1), include_dashboard=False, log_to_driver=False,
                 runtime_env={"env_vars": GPU_ENV} if s.gpu else None)
    if __name__ != "__main__":  # imported (a test): the workers cannot import this file by name
        ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
    trainer = TorchTrainer(
        train_loop_per_worker,
        train_loop_config={"settings": asdict(s)},
        scaling_config=ScalingConfig(num_workers=workers, use_gpu=s.gpu,
                                     resources_per_worker=None if s.gpu else {"CPU": 0.5}),
        run_config=RunConfig(name=name, storage_path=storage),
    )
    result = trainer.fit()
    out = {k: result.metrics.get(k) for k in ("history", "summary", "resumed_at")}
    out["checkpoint"] = result.checkpoint.path if result.checkpoint else None
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workers", type=int, default=2, help="ranks (one GPU each with --gpu)")
    p.add_argument("--steps", type=int, default=Settings.steps)
    p.add_argument("--gpu", action="store_true", help="GPU workers, nvshmem backend")
    p.add_argument("--global-batch", type=int, default=Settings.global_batch, help="sequences per step, all ranks")
    p.add_argument("--seq-len", type=int, default=Settings.seq_len)
    p.add_argument("--hidden-size", type=int, default=Settings.hidden_size)
    p.add_argument("--checkpoint-every", type=int, default=Settings.checkpoint_every)
    p.add_argument("--storage", default=os.path.join(tempfile.gettempdir(), "ray_ep_train"),
                   help="Ray Train storage path (checkpoints)")
    p.add_argument("--name", default=None, help="run name; the same name resumes (default: a new one)")
    args = p.parse_args(argv)
    if args.global_batch % args.workers:
        p.error(f"--global-batch {args.global_batch} must be divisible by --workers {args.workers}")
    s = Settings(steps=args.steps, gpu=args.gpu, global_batch=args.global_batch, seq_len=args.seq_len,
                 hidden_size=args.hidden_size, checkpoint_every=args.checkpoint_every)
    name = args.name or f"train_moe_{time.strftime('%Y%m%d_%H%M%S')}"
    out = run(s, args.workers, args.storage, name)
    losses, first = out["history"]["losses"], out["resumed_at"] or 0
    print(f"train_moe: {args.workers} workers ({'GPU, nvshmem' if s.gpu else 'CPU, torch backend'}), "
          f"{s.global_batch} x {s.seq_len - 1} tokens per step" + (f", resumed at step {first}" if first else ""))
    for i, loss in enumerate(losses):
        step = first + i + 1
        if step == first + 1 or step % max(1, len(losses) // 10) == 0 or step == s.steps:
            print(f"step {step:>5}  loss {loss:.4f}")
    m = out["summary"]
    if m:
        print(f"step {m['step_s'] * 1e3:.1f} ms (forward {m['forward_s'] * 1e3:.1f}, backward "
              f"{m['backward_s'] * 1e3:.1f}, grad sync + optimizer {m['optimizer_s'] * 1e3:.1f}; median), "
              f"{m['tokens_per_s']:.0f} tokens/s; checkpoint {out['checkpoint']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
