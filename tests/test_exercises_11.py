"""Chapter 11 (FSDP2's pitfalls): the exercises' solutions, right and wrong, for the checkers
in minifsdp/labs/ch11.py; the tests that every checker gets are in tests/exercise_checks.py."""

from exercise_checks import checker_tests

from minifsdp.labs import ch11


def token_weights(real_tokens, mode):
    """Each rank's mean weighs its tokens 1 / n_r, the average over N ranks 1 / N more; the
    global count weighs every token 1 / sum(n)."""
    n = len(real_tokens)
    if mode == "mean":
        return [1 / (n * t) for t in real_tokens]
    return [1 / sum(real_tokens)] * n


def token_weights_forgets_the_average(real_tokens, mode):
    return [1 / t for t in real_tokens] if mode == "mean" else token_weights(real_tokens, mode)


def token_weights_divides_twice(real_tokens, mode):  # global count, and FSDP's 1 / N too
    n = len(real_tokens)
    return token_weights(real_tokens, mode) if mode == "mean" else [
        1 / (n * sum(real_tokens))] * n


def token_weights_mean_is_global(real_tokens, mode):
    return [1 / sum(real_tokens)] * len(real_tokens)


def reduce_scatter_outcome(sends):
    """The same list on every rank runs right; else the lengths decide whether it runs."""
    if all(s == sends[0] for s in sends):
        return "ok"
    sizes = {sum(numel for _, numel in s) for s in sends}
    return "silently wrong" if len(sizes) == 1 else "fails"


def outcome_by_names_only(sends):  # ignores that equal sizes still run
    return "ok" if all(s == sends[0] for s in sends) else "fails"


def outcome_by_size_only(sends):  # equal sizes are not equal parameters
    return "ok" if len({sum(n for _, n in s) for s in sends}) == 1 else "fails"


def outcome_by_name_sets(sends):  # the order of the layout matters too
    if all({p for p, _ in s} == {p for p, _ in sends[0]} for s in sends):
        return "ok"
    return reduce_scatter_outcome(sends)


SOLUTIONS = {
    "check_token_weights": ("token weights", token_weights,
                            [token_weights_forgets_the_average, token_weights_divides_twice,
                             token_weights_mean_is_global]),
    "check_reduce_scatter_outcome": ("reduce-scatter outcome", reduce_scatter_outcome,
                                     [outcome_by_names_only, outcome_by_size_only,
                                      outcome_by_name_sets]),
}

(test_every_checker_has_solutions_here, test_accepts_a_correct_solution,
 test_rejects_a_wrong_solution, test_a_wrong_solution_gets_a_one_line_verdict,
 test_a_stub_is_not_implemented_yet) = checker_tests(ch11, SOLUTIONS)
