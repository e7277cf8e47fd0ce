"""Chapter 06 (prefetch and overlap): the exercises' one-line checkers.

Each ``check_*`` takes the reader's function, runs it on cases whose answers come from the
package's own implementation (or from a real run), prints one line (✓ or ✗ with the first
failing case) and returns True/False. ``tests/test_exercises.py`` checks that every checker
accepts a correct solution and rejects a wrong one.
"""

from __future__ import annotations

from minifsdp.notebook import check


def backward_collectives(post_forward_order: list[str], prefetch: bool) -> list[tuple[str, str]]:
    """The collectives one backward issues, in order, for groups whose forwards ended in
    ``post_forward_order`` (the root last; it keeps its parameters, so it is not gathered):
    ``[("all_gather", "blocks.3"), ("reduce_scatter", "blocks.3"), ...]``. With implicit
    backward prefetch each group's pre-backward issues the previous group's all-gather right
    after its own (the root's issues the last unit's); Note [which group is next]."""
    *units, root = post_forward_order
    rev, events = units[::-1], []
    if prefetch and rev:
        events.append(("all_gather", rev[0]))
    for k, g in enumerate(rev):
        if not prefetch:
            events.append(("all_gather", g))
        elif k + 1 < len(rev):
            events.append(("all_gather", rev[k + 1]))
        events.append(("reduce_scatter", g))
    return events + [("reduce_scatter", root)]


def check_backward_collectives(fn, measured: list[tuple] | None = None) -> bool:
    """``fn(post_forward_order, prefetch)`` -> ``[(op, group), ...]`` issued in one backward.
    ``measured``: ``((order, prefetch), events)`` read from real runs' comm logs."""
    orders = [["blocks.0", "blocks.1", "blocks.2", "blocks.3", "root"], ["a", "root"],
              ["conv", "fc1", "fc2", "root"], ["root"]]
    cases = [((o, p), backward_collectives(o, p)) for o in orders for p in (False, True)]
    return check("backward collectives", [*cases, *(measured or [])], fn)


def forward_events(forward_order: list[str], prefetch: bool) -> list[tuple[str, str]]:
    """Issue / wait / compute events of one forward over groups in ``forward_order`` (the root
    first; its forward runs around everyone else's, so its own compute starts right after
    its pre-forward). With implicit forward prefetch a pre-forward issues the next group's
    all-gather right after waiting for its own."""
    events = []
    for k, g in enumerate(forward_order):
        if not (prefetch and k > 0):
            events.append(("issue", g))
        events.append(("wait", g))
        if prefetch and k + 1 < len(forward_order):
            events.append(("issue", forward_order[k + 1]))
        events.append(("compute", g))
    return events


def check_forward_events(fn) -> bool:
    """``fn(forward_order, prefetch)`` -> ``[("issue"|"wait"|"compute", group), ...]``."""
    orders = [["root", "blocks.0", "blocks.1", "blocks.2"], ["root", "a"], ["root"],
              ["root", "conv", "fc1", "fc2"]]
    return check("forward events", [((o, p), forward_events(o, p)) for o in orders
                                    for p in (False, True)], fn)


def exposed_ms(compute_ms: list[float], comm_ms: list[float], prefetch: bool) -> float:
    """Milliseconds a forward waits for all-gathers: group i needs ``comm_ms[i]`` on the wire
    and computes ``compute_ms[i]``. Without prefetch every all-gather is waited for in full;
    with one-ahead prefetch group i+1's transfer overlaps group i's compute (the first cannot
    hide), and one transfer at a time is on the wire."""
    if not prefetch:
        return float(sum(comm_ms))
    # group i+1's all-gather is issued when group i starts computing: only what outlasts
    # that compute is waited for
    return comm_ms[0] + sum(max(0.0, m - c) for c, m in zip(compute_ms, comm_ms[1:]))


def check_exposed_ms(fn) -> bool:
    """``fn(compute_ms, comm_ms, prefetch)`` -> exposed all-gather milliseconds of a forward."""
    cases = [((c, m, p), exposed_ms(c, m, p))
             for c, m in [([5, 5, 5, 5], [2, 2, 2, 2]), ([1, 1, 1], [3, 3, 3]),
                          ([4, 1, 4], [1, 5, 2]), ([10], [3]), ([2, 8, 2, 8], [6, 6, 6, 6]),
                          ([8, 1, 8], [1, 1, 9])]
             for p in (False, True)]
    close = lambda a, b: abs(a - b) <= 1e-9 * max(1.0, b)
    return check("exposed all-gather time", cases, fn, close=close)
