"""Lab 00's planted bugs: ring steps a learner plausibly gets wrong (Note [ring all-reduce]).

Each function replaces one seam (``@replaces``); tests/test_labs.py checks that the checker
rejects it and points where the bug shows first.
"""

import torch
import torch.distributed as dist
from torch.distributed import ReduceOp

from minifsdp.labs.seams import replaces
from minifsdp.ring import _COMBINE, _exchange, _ring


@replaces("ring.reduce_scatter")
@torch.no_grad()
def schedule_one_step_off(output, input, op=ReduceOp.SUM, group=None):
    """Sends chunk (me - step) instead of (me - step - 1): at step 0 each rank sends the
    chunk it must end up owning, so every sum lands on the wrong rank."""
    n, me, right, left = _ring(group)
    chunks = input.detach().reshape(-1).clone().view(n, -1)
    received = torch.empty_like(chunks[0])
    for step in range(n - 1):
        _exchange(chunks[(me - step) % n], received, right, left, group, tag="rs")
        _COMBINE[op](chunks[(me - step - 1) % n], received)
    output.copy_(chunks[me].view(output.shape))


@replaces("ring.reduce_scatter")
@torch.no_grad()
def avg_never_divided(output, input, op=ReduceOp.SUM, group=None):
    """Treats AVG like SUM (``_COMBINE`` adds for both) and forgets the one division by N."""
    n, me, right, left = _ring(group)
    chunks = input.detach().reshape(-1).clone().view(n, -1)
    received = torch.empty_like(chunks[0])
    for step in range(n - 1):
        _exchange(chunks[(me - step - 1) % n], received, right, left, group, tag="rs")
        _COMBINE[op](chunks[(me - step - 2) % n], received)
    output.copy_(chunks[me].view(output.shape))


@replaces("ring.reduce_scatter")
@torch.no_grad()
def sums_into_the_input(output, input, op=ReduceOp.SUM, group=None):
    """Accumulates in the caller's tensor instead of a scratch copy (no ``clone``)."""
    n, me, right, left = _ring(group)
    chunks = input.detach().reshape(-1).view(n, -1)
    received = torch.empty_like(chunks[0])
    for step in range(n - 1):
        _exchange(chunks[(me - step - 1) % n], received, right, left, group, tag="rs")
        _COMBINE[op](chunks[(me - step - 2) % n], received)
    if op == ReduceOp.AVG:
        chunks[me].div_(n)
    output.copy_(chunks[me].view(output.shape))


@replaces("ring.all_gather")
@torch.no_grad()
def gather_into_the_next_slot(output, input, group=None):
    """Receives the left neighbour's chunk into slot (me - step + 1): chunks land one rank off."""
    n, me, right, left = _ring(group)
    chunks = output.view(n, -1)
    chunks[me].copy_(input.reshape(-1))
    for step in range(n - 1):
        _exchange(chunks[(me - step) % n], chunks[(me - step + 1) % n], right, left, group,
                  tag="ag")


@replaces("ring.all_gather")
@torch.no_grad()
def blocking_send_then_recv(output, input, group=None):
    """The obvious ring step, ``send(right); recv(left)``: every rank sits in send, nobody
    reaches recv (Note [ring deadlock]). Must end as a "hang" within seconds."""
    n, me, right, left = _ring(group)
    chunks = output.view(n, -1)
    chunks[me].copy_(input.reshape(-1))
    for step in range(n - 1):
        dist.send(chunks[(me - step) % n].contiguous(), group_dst=right, group=group)
        dist.recv(chunks[(me - step - 1) % n], group_src=left, group=group)


# What the checker must say about each bug: the report's status, the jobs to run (the smallest
# that shows the bug), and where the first divergence is (case, checked value) or the line.
EXPECTED = {
    "schedule_one_step_off": dict(status="diverged", world_sizes=(2,),
                                  case="reduce-scatter, 4 element(s) per rank", name="output"),
    "avg_never_divided": dict(status="diverged", world_sizes=(2,), name="result",
                              hint="a sum where a mean is expected"),
    "sums_into_the_input": dict(status="diverged", world_sizes=(2,),
                                name="input after the call (leave it untouched)"),
    "gather_into_the_next_slot": dict(status="diverged", world_sizes=(3,),
                                      case="all-gather, 5 element(s) per rank", name="output"),
    "blocking_send_then_recv": dict(status="hang", world_sizes=(2,), where="lab00.py:78"),
}
