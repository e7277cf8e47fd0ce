"""Chapter 06 (prefetch and overlap): the exercises' solutions, right and wrong, for the checkers
in minifsdp/labs/ch06.py; the tests that every checker gets are in tests/exercise_checks.py."""



from exercise_checks import checker_tests

from minifsdp.labs import ch06


def backward_collectives(order, prefetch):
    *units, root = order
    rev, out = units[::-1], []
    for k, g in enumerate(rev):
        if not prefetch or k == 0:
            out.append(("all_gather", g))
        if prefetch and k + 1 < len(rev):
            out.append(("all_gather", rev[k + 1]))
        out.append(("reduce_scatter", g))
    return out + [("reduce_scatter", root)]


def backward_collectives_gathers_root(order, prefetch):
    """Forgets that the root keeps its parameters from forward to backward."""
    return [("all_gather", order[-1])] + backward_collectives(order, prefetch)


def backward_collectives_prefetch_after_reduce(order, prefetch):
    """Issues the prefetch only after the group's own reduce-scatter: no overlap with its
    backward."""
    *units, root = order
    out = []
    for g in units[::-1]:
        out += [("all_gather", g), ("reduce_scatter", g)]
    return out + [("reduce_scatter", root)]


def forward_events(order, prefetch):
    out = []
    for k, g in enumerate(order):
        if k == 0 or not prefetch:
            out.append(("issue", g))
        out.append(("wait", g))
        if prefetch and k + 1 < len(order):
            out.append(("issue", order[k + 1]))
        out.append(("compute", g))
    return out


def forward_events_issue_after_compute(order, prefetch):
    """Prefetches after the group's compute: too late to overlap it."""
    out = []
    for k, g in enumerate(order):
        if k == 0 or not prefetch:
            out.append(("issue", g))
        out += [("wait", g), ("compute", g)]
        if prefetch and k + 1 < len(order):
            out.append(("issue", order[k + 1]))
    return out


def forward_events_all_upfront(order, prefetch):
    """Issues every all-gather at the start (unbounded memory)."""
    if not prefetch:
        return forward_events(order, False)
    return [("issue", g) for g in order] + [e for g in order
                                            for e in (("wait", g), ("compute", g))]


def exposed_ms(compute_ms, comm_ms, prefetch):
    if not prefetch:
        return float(sum(comm_ms))
    t = exposed = comm_ms[0]
    for c, m in zip(compute_ms, comm_ms[1:]):
        arrive = t + m
        t += c
        exposed += max(0.0, arrive - t)
        t = max(t, arrive)
    return exposed


def exposed_ms_no_first(compute_ms, comm_ms, prefetch):
    """Thinks prefetch hides the first all-gather too."""
    return exposed_ms(compute_ms, comm_ms, prefetch) - (comm_ms[0] if prefetch else 0)


def exposed_ms_in_aggregate(compute_ms, comm_ms, prefetch):
    """Overlaps the totals, as if any compute could hide any transfer."""
    if not prefetch:
        return float(sum(comm_ms))
    return max(float(comm_ms[0]), sum(comm_ms) - sum(compute_ms[:-1]))


# checker -> (the name it prints, a correct solution, wrong solutions)
SOLUTIONS = {
    "check_backward_collectives": ("backward collectives", backward_collectives,
                                   [backward_collectives_gathers_root,
                                    backward_collectives_prefetch_after_reduce]),
    "check_forward_events": ("forward events", forward_events,
                             [forward_events_issue_after_compute, forward_events_all_upfront]),
    "check_exposed_ms": ("exposed all-gather time", exposed_ms,
                         [exposed_ms_no_first, exposed_ms_in_aggregate]),
}

(test_every_checker_has_solutions_here, test_accepts_a_correct_solution,
 test_rejects_a_wrong_solution, test_a_wrong_solution_gets_a_one_line_verdict,
 test_a_stub_is_not_implemented_yet) = checker_tests(ch06, SOLUTIONS)
