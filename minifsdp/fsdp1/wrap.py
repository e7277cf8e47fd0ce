"""Auto-wrap policies for FSDP1: which modules become units, and which unit owns a parameter.

``minifsdp.fsdp1.FullyShardedDataParallel(model, auto_wrap_policy=...)`` asks ``plan_units`` for
the units (children before parents), ``assign_owners`` for the unit that flattens each
parameter, then wraps each unit as a nested ``FullyShardedDataParallel``; the root keeps the
rest. Nothing here communicates or allocates: the plan is a pure function of the module tree.

Note [policy contract]: torch FSDP1's, so that its policies work here and ours there (the tests
check both ways): ``policy(module=m, recurse=True, nonwrapped_numel=n)`` says whether to look
inside ``m`` (n = all of m's elements); after the children are done,
``policy(module=m, recurse=False, nonwrapped_numel=n)`` says whether ``m`` becomes a unit, n
being now the elements of ``m`` that no unit below it took. A policy is thus a size or type test
applied bottom-up, and the root is never asked (it is the user's ``FullyShardedDataParallel``).

Note [tied parameters across units]: a tied parameter is flattened once, so one unit owns it, and
that unit must be unsharded whenever any user of the parameter runs. A unit's forward encloses
its sub-units' forwards, so the deepest unit enclosing *all* the modules that register the
parameter works: ``assign_owners`` picks it. (torch FSDP1 gives the parameter to the first unit
that reaches it, bottom-up; if a user sits outside that unit, the parameter is freed under it.)
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch.nn as nn

Policy = Callable[..., bool]  # policy(module=, recurse=, nonwrapped_numel=) -> bool
Skip = Callable[[nn.Module], bool]  # modules to leave alone (units wrapped before)


def size_based_auto_wrap_policy(min_num_params: int = int(1e8),
                                force_leaf_modules: Iterable[type] = (nn.MultiheadAttention,),
                                exclude_wrap_modules: Iterable[type] = (nn.ModuleList,
                                                                        nn.ModuleDict)) -> Policy:
    """A unit wherever at least ``min_num_params`` elements are not yet in a unit below (torch's
    defaults: never inside ``force_leaf_modules``, never a container of ``exclude_wrap_modules``).

    Example:
        >>> from minifsdp.models import MnistCNN
        >>> cnn = MnistCNN()
        >>> [name for name, _ in plan_units(cnn, size_based_auto_wrap_policy(10_000))]
        ['conv2', 'fc1']
    """
    leaves, excluded = tuple(force_leaf_modules), tuple(exclude_wrap_modules)

    def policy(module: nn.Module, recurse: bool, nonwrapped_numel: int) -> bool:
        large = nonwrapped_numel >= min_num_params
        return large and not isinstance(module, leaves if recurse else excluded)

    return policy


def transformer_auto_wrap_policy(layer_classes: Iterable[type]) -> Policy:
    """A unit for every module of one of ``layer_classes``.

    Example:
        >>> from minifsdp.models import GPT, Block
        >>> [name for name, _ in plan_units(GPT(), transformer_auto_wrap_policy({Block}))]
        ['blocks.0', 'blocks.1']
    """
    classes = tuple(layer_classes)
    if not classes or not all(isinstance(c, type) and issubclass(c, nn.Module) for c in classes):
        raise ValueError(f"layer_classes must be nn.Module subclasses, got {classes!r}")
    return lambda module, recurse, nonwrapped_numel: recurse or isinstance(module, classes)


def plan_units(root: nn.Module, policy: Policy,
               skip: Skip = lambda m: False) -> list[tuple[str, nn.Module]]:
    """``(name, module)`` of the units ``policy`` picks below ``root``, children before parents
    (Note [policy contract]; torch's ``_recursive_wrap`` with ``only_wrap_children=True``).
    Modules for which ``skip`` is true are not entered.

    Example: see ``size_based_auto_wrap_policy``.
    """
    plan: list[tuple[str, nn.Module]] = []

    def visit(name: str, m: nn.Module) -> int:  # returns the elements wrapped in m
        numel = sum(p.numel() for p in m.parameters())
        if not policy(module=m, recurse=True, nonwrapped_numel=numel):
            return 0
        wrapped = sum(visit(f"{name}.{c}" if name else c, child)
                      for c, child in m.named_children() if not skip(child))
        if m is not root and policy(module=m, recurse=False, nonwrapped_numel=numel - wrapped):
            plan.append((name, m))
            return numel
        return wrapped

    visit("", root)
    return plan


def assign_owners(root: nn.Module, units: list[nn.Module],
                  skip: Skip = lambda m: False) -> dict[int, nn.Module]:
    """``id(parameter) -> the unit (one of units, or root) that flattens it``: the deepest unit
    enclosing every module that registers it (Note [tied parameters across units]).

    Example:
        >>> from minifsdp.models import GPT, GPTConfig
        >>> gpt = GPT(GPTConfig(tie_embeddings=True))
        >>> owner = assign_owners(gpt, [gpt.tok_emb, gpt.head])    # both use the tied weight
        >>> owner[id(gpt.tok_emb.weight)] is gpt, owner[id(gpt.pos_emb.weight)] is gpt
        (True, True)
    """
    ids = {id(u) for u in units}
    parent: dict[int, nn.Module | None] = {id(root): None}
    users: dict[int, list[nn.Module]] = {}

    def walk(m: nn.Module, unit: nn.Module) -> None:
        for p in m._parameters.values():
            if p is not None:
                users.setdefault(id(p), []).append(unit)
        for child in m.children():
            if skip(child):
                continue
            if id(child) in ids:
                parent[id(child)] = unit
            walk(child, child if id(child) in ids else unit)

    def chain(u: nn.Module | None) -> list[nn.Module]:  # u, its enclosing unit, ..., root
        out = []
        while u is not None:
            out.append(u)
            u = parent[id(u)]
        return out

    walk(root, root)
    owner = {}
    for i, us in users.items():
        common = chain(us[0])
        for u in us[1:]:
            enclosing = {id(c) for c in chain(u)}
            common = [c for c in common if id(c) in enclosing]
        owner[i] = common[0]
    return owner
