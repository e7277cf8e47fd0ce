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


@replaces("ring.reduce_scatter")
@torch.no_grad()
def folds_every_op_but_max_by_adding(output, input, op=ReduceOp.SUM, group=None):
    """Special-cases MAX and adds for everything else, instead of folding with ``_COMBINE[op]``:
    SUM and AVG come out right, MIN and PRODUCT become sums."""
    n, me, right, left = _ring(group)
    chunks = input.detach().reshape(-1).clone().view(n, -1)
    received = torch.empty_like(chunks[0])
    for step in range(n - 1):
        _exchange(chunks[(me - step - 1) % n], received, right, left, group, tag="rs")
        acc = chunks[(me - step - 2) % n]
        if op == ReduceOp.MAX:
            torch.maximum(acc, received, out=acc)
        else:
            acc.add_(received)
    if op == ReduceOp.AVG:
        chunks[me].div_(n)
    output.copy_(chunks[me].view(output.shape))


@replaces("ring.reduce_scatter")
@torch.no_grad()
def accumulates_in_fp32(output, input, op=ReduceOp.SUM, group=None):
    """Upcasts the scratch copy to fp32 "for precision": right values, but a bf16 tensor now
    travels as fp32, twice the ring's bytes (Note [ring bytes])."""
    n, me, right, left = _ring(group)
    chunks = input.detach().reshape(-1).float().clone().view(n, -1)
    received = torch.empty_like(chunks[0])
    for step in range(n - 1):
        _exchange(chunks[(me - step - 1) % n], received, right, left, group, tag="rs")
        _COMBINE[op](chunks[(me - step - 2) % n], received)
    if op == ReduceOp.AVG:
        chunks[me].div_(n)
    output.copy_(chunks[me].view(output.shape))


@replaces("ring.all_gather")
@torch.no_grad()
def copies_the_input_unflattened(output, input, group=None):
    """``chunks[me].copy_(input)``: a 1-D input fits its row, a (2, 3) input does not."""
    n, me, right, left = _ring(group)
    chunks = output.view(n, -1)
    chunks[me].copy_(input)
    for step in range(n - 1):
        _exchange(chunks[(me - step) % n], chunks[(me - step - 1) % n], right, left, group,
                  tag="ag")


@replaces("ring.reduce_scatter")
@torch.no_grad()
def exchanges_over_the_default_group(output, input, op=ReduceOp.SUM, group=None):
    """Computes the ring within ``group`` but sends over the default group (``group=None`` to
    ``_exchange``): its right and left are group ranks used as global ranks. Right on the
    default group; over ranks 1..N-1 it talks to the wrong processes."""
    n, me, right, left = _ring(group)
    chunks = input.detach().reshape(-1).clone().view(n, -1)
    received = torch.empty_like(chunks[0])
    for step in range(n - 1):
        _exchange(chunks[(me - step - 1) % n], received, right, left, None, tag="rs")
        _COMBINE[op](chunks[(me - step - 2) % n], received)
    if op == ReduceOp.AVG:
        chunks[me].div_(n)
    output.copy_(chunks[me].view(output.shape))


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
    "folds_every_op_but_max_by_adding": dict(status="diverged", world_sizes=(2,),
                                             case="reduce-scatter, MAX, MIN and PRODUCT",
                                             name="output (MIN)", hint="_COMBINE[op]"),
    "accumulates_in_fp32": dict(status="diverged", world_sizes=(2,),
                                case="reduce-scatter, bf16, output (2, 3)", name="bytes sent",
                                hint="fp32 where the input is bf16"),
    "copies_the_input_unflattened": dict(status="crash", world_sizes=(2,),
                                         where="lab00.py:124"),
    "exchanges_over_the_default_group": dict(status="crash", world_sizes=(3,),
                                             where="lab00.py:140"),
}
