"""Run a function on R fresh processes that form a torch.distributed group (no Ray): the way
torchrun ranks or Ray Train workers hold an EPCommunicator.

``run_ranks(fn, R, *args)`` spawns R processes, each joins a gloo group (NCCL with
``backend="nccl"``: rank r then uses GPU r), calls ``fn(rank, *args)`` and sends back its
result or its exception (type name and text). Results come back in rank order; the parent
kills every process still running after ``timeout_s``. ``fn`` must be a module-level
function of an importable module (spawned processes import it by name).
"""

from __future__ import annotations

import datetime
import multiprocessing as mp
import os
import queue
import socket
import traceback


class RankError(Exception):
    """A rank raised: ``errors[r]`` = (exception type name, message) of each rank that did."""

    def __init__(self, errors: dict[int, tuple[str, str]], tracebacks: dict[int, str]):
        self.errors = errors
        super().__init__("\n".join(f"rank {r}: {tb}" for r, tb in sorted(tracebacks.items())))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _main(fn, rank: int, world_size: int, port: int, backend: str, args: tuple, out) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)  # R processes share a few cores
    if backend == "nccl":
        # NVLink multicast off in NCCL and NVSHMEM (docs/design.md), before either starts
        os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
        os.environ.setdefault("NVSHMEM_DISABLE_NVLS", "1")
        torch.cuda.set_device(rank)
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size,
                            timeout=datetime.timedelta(seconds=120),
                            **({"device_id": torch.device("cuda", rank)} if backend == "nccl" else {}))
    try:
        out.put((rank, "ok", fn(rank, *args), ""))
    except BaseException as e:  # noqa: BLE001 - every failure goes back to the test
        out.put((rank, "error", (type(e).__name__, str(e)), traceback.format_exc()))
    finally:
        try:
            dist.destroy_process_group()
        except Exception:  # a rank that timed out leaves a broken group behind
            pass
        out.close()
        out.join_thread()  # the result is in the pipe before the process goes
    os._exit(0)  # skip interpreter teardown: a broken gloo group may block it


def run_ranks(fn, world_size: int, *args, backend: str = "gloo", timeout_s: float = 300.0) -> list:
    """``[fn(0, *args), ..., fn(R - 1, *args)]`` computed on R ranks; RankError if any raised."""
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_main, args=(fn, r, world_size, port, backend, args, out), daemon=True)
             for r in range(world_size)]
    for p in procs:
        p.start()
    results, errors, tracebacks = {}, {}, {}
    try:
        for _ in range(world_size):
            rank, status, value, tb = out.get(timeout=timeout_s)
            if status == "ok":
                results[rank] = value
            else:
                errors[rank], tracebacks[rank] = value, tb
    except queue.Empty:
        raise TimeoutError(f"ranks {sorted(set(range(world_size)) - set(results) - set(errors))} did not finish "
                           f"within {timeout_s:g} s") from None
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
    if errors:
        raise RankError(errors, tracebacks)
    return [results[r] for r in range(world_size)]
