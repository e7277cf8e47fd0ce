"""Chapter 04 (FSDP1's FlatParameter): the exercises' one-line checkers.

Each ``check_*`` takes the reader's function, runs it on cases whose answers come from the
package's own implementation (or from a real run), prints one line (✓ or ✗ with the first
failing case) and returns True/False. ``tests/test_exercises.py`` checks that every checker
accepts a correct solution and rejects a wrong one.
"""

from __future__ import annotations

import torch

from minifsdp.notebook import check


def check_flat_layout(fn) -> bool:
    """``fn(numels, world_size, align)`` -> ``(offsets, padded_numel)``: each parameter starts
    at a multiple of ``align`` elements, the total is padded to a multiple of ``world_size``
    (``minifsdp.flat_param.flat_layout``, Note [flat layout])."""
    from minifsdp.flat_param import flat_layout

    layouts = [([70, 7, 21, 3], 3, 4), ([70, 7, 21, 3], 1, 4), ([5], 4, 1), ([8, 8], 2, 4),
               ([1, 1, 1], 2, 4), ([288, 32, 18432, 64], 4, 4), ([3, 5, 7], 8, 2), ([0, 4], 2, 4)]
    return check("flat layout", [(args, flat_layout(*args)) for args in layouts], fn)


def check_size_wrap(fn) -> bool:
    """``fn(model, min_num_params)`` -> names of the units that a size-based auto-wrap policy
    picks, children before parents (``minifsdp.wrap.plan_units``, Note [policy contract]): a
    module becomes a unit when the elements of it that no unit below took are at least
    ``min_num_params``; a ``ModuleList``/``ModuleDict`` is never a unit, nor is the root."""
    from minifsdp.models import GPT, GPTConfig, MnistCNN
    from minifsdp.wrap import plan_units, size_based_auto_wrap_policy

    nested = torch.nn.Sequential(torch.nn.Sequential(torch.nn.Linear(30, 30), torch.nn.ReLU(),
                                                     torch.nn.Linear(30, 2)),
                                 torch.nn.Linear(2, 40), torch.nn.Linear(40, 40))
    cases = []
    for model, sizes in [(MnistCNN(), (100, 20_000, 1_000_000, 2_000_000)),
                         (GPT(GPTConfig()), (1_000, 10_000, 20_000)),
                         (nested, (100, 1_000, 1_500, 3_000))]:
        for n in sizes:
            plan = plan_units(model, size_based_auto_wrap_policy(n))
            cases.append(((model, n), [name for name, _ in plan]))
    return check("size-based wrap", cases, fn)


def fsdp1_step_wire_bytes(padded_numels: list[int], n: int, strategy: str) -> float:
    """Bytes one rank sends per fp32 step of ``minifsdp.fsdp1`` (``minifsdp.comm``'s
    accounting). ``padded_numels``: each unit's flat parameter, padded; the *last* is the root."""
    ag = rs = lambda numel: (n - 1) / n * 4 * numel
    if strategy == "no_shard":
        return sum(2 * (n - 1) / n * 4 * p for p in padded_numels)
    forward = sum(ag(p) for p in padded_numels)
    # FULL_SHARD frees every unit but the root after forward, so gathers them again
    backward = sum(ag(p) for p in padded_numels[:-1]) if strategy == "full_shard" else 0.0
    return forward + backward + sum(rs(p) for p in padded_numels)


def check_fsdp1_step_wire_bytes(fn, measured: list[tuple] | None = None) -> bool:
    """``fn(padded_numels, n, strategy)`` -> wire bytes one rank sends per step, ``strategy``
    one of ``full_shard``, ``shard_grad_op``, ``no_shard`` (Note [sharding strategies]).
    ``measured``: ``((padded_numels, n, strategy), bytes)`` from real runs."""
    cases = [((units, n, st), fsdp1_step_wire_bytes(units, n, st))
             for units in ([1_199_884], [18_752, 1_179_776, 1_396], [8_448, 8_448, 12_544])
             for n in (1, 2, 4) for st in ("full_shard", "shard_grad_op", "no_shard")]
    close = lambda a, b: abs(a - b) <= 1e-9 * max(1.0, b)
    return check("FSDP1 bytes per step", [*cases, *(measured or [])], fn, close=close)
