"""Chapter 01 (memory anatomy): the exercises' solutions, right and wrong, for the checkers in
minifsdp/labs/ch01.py; the tests that every checker gets are in tests/exercise_checks.py."""


import torch
from exercise_checks import checker_tests

from minifsdp.labs import ch01


def model_states(psi, n, stage):
    """ZeRO paper, section 3.1: fp16 weights (2 psi) and gradients (2 psi), K = 12 psi of fp32
    master weights, momentum and variance; stage 1 shards K, stage 2 also the gradients,
    stage 3 also the weights."""
    p, g, k = 2 * psi, 2 * psi, 12 * psi
    return {"ddp": p + g + k, "zero1": p + g + k / n, "zero2": p + (g + k) / n,
            "zero3": (p + g + k) / n}[stage]


def model_states_zero1_shards_grads(psi, n, stage):
    return model_states(psi, n, "zero2" if stage == "zero1" else stage)


def model_states_no_master_copy(psi, n, stage):
    p, g, k = 2 * psi, 2 * psi, 8 * psi  # K = 8: momentum and variance only
    return {"ddp": p + g + k, "zero1": p + g + k / n, "zero2": p + (g + k) / n,
            "zero3": (p + g + k) / n}[stage]


def test_model_states_reproduces_the_zero_paper():
    # Figure 1 of the ZeRO paper: Psi = 7.5B, N = 64 -> 120, 31.4, 16.6, 1.9 GB per device
    gb = {s: model_states(7.5e9, 64, s) / 1e9 for s in ["ddp", "zero1", "zero2", "zero3"]}
    assert {s: round(v, 1) for s, v in gb.items()} == {
        "ddp": 120.0, "zero1": 31.4, "zero2": 16.6, "zero3": 1.9}


def adam_state_bytes(model):
    """Measured: take one real Adam step and add up every tensor in its state."""
    opt = torch.optim.Adam(model.parameters())
    sum(p.sum() for p in model.parameters()).backward()
    opt.step()
    return sum(t.numel() * t.element_size() for state in opt.state.values()
               for t in state.values() if isinstance(t, torch.Tensor))


def adam_state_bytes_no_step(model):
    return sum(8 * p.numel() for p in model.parameters())  # exp_avg + exp_avg_sq only


def adam_state_bytes_k12(model):
    return sum(12 * p.numel() for p in model.parameters())  # mixed precision's K, not fp32's


def _peak(batch):
    from minifsdp.analytic import predict_step_peak

    return predict_step_peak("cnn", batch, "adam", dropout=0.0)


def largest_batch(budget_bytes):
    """Every moment of the step costs a + s * batch bytes: solve each for the largest batch,
    take the smallest, then make sure it fits and one more sample does not."""
    m0, m1 = _peak(0)["moments"], _peak(1)["moments"]
    batch = min((budget_bytes - m0[k]) // (m1[k] - m0[k]) for k in m0 if m1[k] > m0[k])
    while _peak(batch)["peak"] > budget_bytes:
        batch -= 1
    while _peak(batch + 1)["peak"] <= budget_bytes:
        batch += 1
    return batch


def largest_batch_end_of_forward(budget_bytes):
    """The textbook guess: the peak is at the end of the forward pass."""
    batch = 0
    while _peak(batch + 1)["moments"]["end of forward"] <= budget_bytes:
        batch += 1
    return batch


def largest_batch_plus_one(budget_bytes):
    return largest_batch(budget_bytes) + 1  # the first batch that does *not* fit


# checker -> (the name it prints, a correct solution, wrong solutions)
SOLUTIONS = {
    "check_model_states": ("model states", model_states,
                           [model_states_zero1_shards_grads, model_states_no_master_copy]),
    "check_adam_state_bytes": ("Adam state bytes", adam_state_bytes,
                               [adam_state_bytes_no_step, adam_state_bytes_k12]),
    "check_largest_batch": ("largest batch", largest_batch,
                            [largest_batch_end_of_forward, largest_batch_plus_one]),
}

(test_every_checker_has_solutions_here, test_accepts_a_correct_solution,
 test_rejects_a_wrong_solution, test_a_wrong_solution_gets_a_one_line_verdict,
 test_a_stub_is_not_implemented_yet) = checker_tests(ch01, SOLUTIONS)
