"""Training on several GPUs (or CPU processes) with torch.distributed, launched by torchrun:

    torchrun --nproc_per_node 8 -m train.pipeline --out runs/e3 --device cuda --minutes 60

Every rank loads the target. Replies: rank r generates every world-th chunk of prompts, each chunk its own
part file as in one process, so the parts (and a resume under another number of ranks) are those of one
process. Training: each optimizer step's batch is split by rows across the ranks, the head is wrapped in
DistributedDataParallel and the loss is normalised by the whole batch's counts (train/trainer.py), so N ranks
take the step one process would. Rank 0 alone logs, checkpoints, exports and evaluates.

Without torchrun's environment nothing here starts a process group: the helpers answer for one process.
"""
from __future__ import annotations

import os

import torch
import torch.distributed as dist

TORCHRUN_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")


def launched() -> bool:
    """Started by torchrun (or another launcher that sets its variables)."""
    return "RANK" in os.environ or int(os.environ.get("WORLD_SIZE", "1")) > 1


def init(device: torch.device) -> torch.device:
    """Joins the process group: nccl with one GPU per rank (cuda:LOCAL_RANK), gloo on the CPU. Checks the
    environment first, so a launch without torchrun fails with one line rather than a rendezvous error.
    -> this rank's device."""
    missing = [k for k in TORCHRUN_ENV if k not in os.environ]
    if missing:
        raise ValueError(f"a distributed run needs {', '.join(missing)} in the environment: launch it with "
                         f"torchrun --nproc_per_node N -m train.pipeline ...")
    device = local_device(device)
    if device.type == "cuda":
        torch.cuda.set_device(device)  # kernels and collectives use the current device
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    return device


def local_device(device: torch.device) -> torch.device:
    """A CUDA device -> this rank's GPU, cuda:LOCAL_RANK (one GPU per rank)."""
    if device.type != "cuda" or not launched():
        return device
    local = int(os.environ.get("LOCAL_RANK", "0"))
    if local >= torch.cuda.device_count():
        raise ValueError(f"LOCAL_RANK {local}: only {torch.cuda.device_count()} CUDA device(s) on this node "
                         f"(--nproc_per_node must not exceed them)")
    return torch.device("cuda", local)


def rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def world() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


def where() -> str:
    """' (rank r of N)' in a launched run (every rank reports its own error), '' otherwise."""
    return f" (rank {os.environ.get('RANK', '?')} of {os.environ.get('WORLD_SIZE', '?')})" if launched() else ""


def barrier():
    if world() > 1:
        dist.barrier()


def all_reduce(t: torch.Tensor, op: str = "sum") -> torch.Tensor:
    """t summed (or maxed) over the ranks, in place (on the backend's device: a GPU tensor with nccl)."""
    if world() > 1:
        dist.all_reduce(t, dist.ReduceOp.SUM if op == "sum" else dist.ReduceOp.MAX)
    return t


def reduce(values: list[float], op: str = "sum") -> list[float]:
    """Host numbers summed (or maxed) over the ranks; unchanged in one process."""
    if world() == 1:
        return list(values)
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else "cpu"
    return all_reduce(torch.tensor(values, dtype=torch.float64, device=device), op).tolist()


def close():
    if dist.is_initialized():
        dist.destroy_process_group()
