"""Test accuracy of a trained model, whatever its strategy: ``train --eval`` (chapter 02's
CNN, as the PyTorch FSDP tutorial reports it). Note [test accuracy] below."""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from minifsdp.data import mnist
from minifsdp.dist import DistInfo


@torch.no_grad()
def evaluate(model: nn.Module, info: DistInfo, samples: int = 10_000, batch: int = 500) -> dict:
    """Test loss and accuracy of the trained model on the first ``samples`` MNIST test images,
    as the PyTorch FSDP tutorial's ``test()`` reports them: each rank evaluates its shard, the
    sums are all-reduced (Note [test accuracy]).

    Returns ``{"test_accuracy", "test_loss", "test_correct", "test_samples"}``, the same on every
    rank: ``test_correct`` of ``test_samples`` images right, ``test_loss`` the mean NLL.

    Note [test accuracy]: rank r takes the contiguous images ``[r P, (r + 1) P)``, P = ceil(n /
    N), in batches of ``batch`` -- the tutorial's DistributedSampler would pad the last shard
    with repeated images and count them twice. Every rank runs the *same* number of forwards
    of the same shapes (a short shard's missing rows are masked out, not skipped): under FSDP a
    forward is collective (each unit all-gathers), so a rank with one forward fewer would hang
    the others. The forwards are the wrapped model's own, under ``no_grad`` and ``eval()``:
    sharded strategies gather each unit and free it again as in training (a root that keeps
    its parameters for a backward that never comes is resharded at the end). With the same
    parameters and the same batches, strategies that are bitwise equal therefore report the
    same count and the same loss, bit for bit (tests/test_train.py).
    """
    ds = mnist(train=False)
    n = min(samples, len(ds.tensors[1]))
    per = -(-n // info.world_size)
    first = info.rank * per
    sums = torch.zeros(3, dtype=torch.float64, device=info.device)  # loss, correct, images
    model.eval()
    for start in range(0, per, batch):
        idx = torch.arange(first + start, first + min(start + batch, per))
        mine = idx < n  # the last shard is short: its missing rows are masked
        x, y = ds.tensors[0][idx.clamp(max=n - 1)], ds.tensors[1][idx.clamp(max=n - 1)]
        out = model(x.to(info.device))
        y, mine = y.to(info.device), mine.to(info.device)
        nll = F.nll_loss(out.float(), y, reduction="none")
        right = (out.argmax(1) == y) & mine
        sums += torch.stack([nll[mine].double().sum(), right.sum().double(), mine.sum().double()])
    model.train()
    _reshard(model)
    if info.world_size > 1:
        dist.all_reduce(sums)
    loss, correct, count = sums.tolist()
    return {"test_accuracy": correct / count, "test_loss": loss / count,
            "test_correct": int(correct), "test_samples": int(count)}


def _reshard(model: nn.Module) -> None:
    """Free what FSDP2 (ours or torch's) kept unsharded after a forward without backward: its
    root keeps its parameters for the backward (``reshard_after_forward`` is False there)."""
    from torch.distributed.fsdp import FSDPModule as TorchFSDPModule

    from minifsdp.fsdp2 import FSDPModule

    for m in model.modules():
        if isinstance(m, (FSDPModule, TorchFSDPModule)):
            m.reshard()
