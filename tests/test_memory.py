"""MemoryTracker against torch's own trackers, and the analytic model against both.

The headline checks are byte-exact: our tracker's peak equals torch's ``MemTracker`` (plain
models) and ``FSDPMemTracker`` (``fully_shard`` at world size 1) on the same training step,
and ``minifsdp.analytic`` predicts the saved activations and the step's peak exactly.
"""

from __future__ import annotations

import copy
import json

import pytest
import torch
import torch.nn.functional as F
from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker
from torch.distributed._tools.mem_tracker import MemTracker
from torch.distributed.fsdp import fully_shard

from minifsdp import analytic
from minifsdp.memory import CATEGORIES, MemoryTracker, tag
from minifsdp.models import GPT, GPTConfig, MnistCNN, count_params

OPTIMIZERS = {
    "adam": lambda ps: torch.optim.Adam(ps, lr=1e-3),
    "adamw": lambda ps: torch.optim.AdamW(ps, lr=1e-3),
    "sgd": lambda ps: torch.optim.SGD(ps, lr=1e-2),
    "sgd_momentum": lambda ps: torch.optim.SGD(ps, lr=1e-2, momentum=0.9),
    "adadelta": lambda ps: torch.optim.Adadelta(ps),
}


def cnn_loss(out, y):
    return F.nll_loss(out, y)


def gpt_loss(logits, y):
    return F.cross_entropy(logits.view(-1, logits.size(-1)), y.view(-1))


def make_cnn(batch=64, dropout=0.0):
    torch.manual_seed(0)
    x, y = torch.randn(batch, 1, 28, 28), torch.randint(0, 10, (batch,))
    return MnistCNN(dropout=dropout), x, y, cnn_loss


def make_gpt(batch=8, **cfg):
    torch.manual_seed(0)
    model = GPT(GPTConfig(**cfg))
    c = model.cfg
    x = torch.randint(0, c.vocab_size, (batch, c.seq_len))
    y = torch.randint(0, c.vocab_size, (batch, c.seq_len))
    return model, x, y, gpt_loss


MODELS = {"cnn": (make_cnn, "adam"), "gpt": (make_gpt, "adamw")}


def train_step(model, opt, x, y, loss_fn):
    loss = loss_fn(model(x), y)
    loss.backward()
    opt.step()
    opt.zero_grad()


def tracked_step(model, opt, x, y, loss_fn, modules=True) -> MemoryTracker:
    """One step under our tracker, counting the batch as activations."""
    mt = MemoryTracker(model, opt)
    if modules:
        mt.track_modules(model)
    with mt:
        mt.register((x, y), "activations")
        train_step(model, opt, x, y, loss_fn)
    return mt


def warmed_up(kind, fsdp_mesh=None, **kwargs):
    """Model, optimizer and batch after one step (so Adam's state exists), plus a snapshot."""
    make, opt_name = MODELS[kind]
    model, x, y, loss_fn = make(**kwargs)
    if fsdp_mesh is not None:
        leaves = [m for m in model.modules() if isinstance(m, (torch.nn.Conv2d, torch.nn.Linear))]
        for m in leaves if kind == "cnn" else model.blocks:
            fully_shard(m, mesh=fsdp_mesh)
        fully_shard(model, mesh=fsdp_mesh)
    opt = OPTIMIZERS[opt_name](model.parameters())
    train_step(model, opt, x, y, loss_fn)
    snapshot = copy.deepcopy((model.state_dict(), opt.state_dict()))
    return model, opt, x, y, loss_fn, snapshot


def restore(model, opt, snapshot):
    model.load_state_dict(snapshot[0])
    opt.load_state_dict(snapshot[1])


def torch_peak(tracker) -> int:
    (peak,) = tracker.get_tracker_snapshot("peak").values()  # one device: the CPU
    return peak["Total"]


# ---- our peak == torch's peak, byte for byte --------------------------------------------------


@pytest.mark.parametrize("kind", ["cnn", "gpt"])
def test_peak_equals_torch_memtracker(kind):
    model, opt, x, y, loss_fn, snapshot = warmed_up(kind)
    # torch counts what `track_external` hands it (params, grads, optimizer state, the batch)
    # when entered, and everything ops create afterwards: the same as ours.
    theirs = MemTracker()
    theirs.track_external(model, opt, x, y)
    with theirs:
        train_step(model, opt, x, y, loss_fn)
    restore(model, opt, snapshot)
    ours = tracked_step(model, opt, x, y, loss_fn)
    assert ours.peak == torch_peak(theirs)
    assert ours.peak == sum(ours.peak_by_category.values())
    # Sensitivity: without the batch registered we miss exactly its bytes (the CNN's x and y
    # are never the output of an op, so nothing else would count them).
    if kind == "cnn":
        restore(model, opt, snapshot)
        blind = MemoryTracker(model, opt)
        with blind:
            train_step(model, opt, x, y, loss_fn)
        assert torch_peak(theirs) - blind.peak == x.nbytes + y.nbytes


@pytest.mark.filterwarnings("ignore:FSDP2-wrapped module")
@pytest.mark.parametrize("kind", ["cnn", "gpt"])
def test_peak_equals_torch_fsdp_memtracker(kind, cpu_mesh):
    model, opt, x, y, loss_fn, snapshot = warmed_up(kind, fsdp_mesh=cpu_mesh)
    theirs = FSDPMemTracker(model, opt)
    theirs.track_inputs((x, y))
    with theirs:
        train_step(model, opt, x, y, loss_fn)
    restore(model, opt, snapshot)
    ours = tracked_step(model, opt, x, y, loss_fn)
    assert ours.peak == torch_peak(theirs)
    # DTensor parameters count by their local shards, and they are all here at world size 1.
    assert ours.current()["params"] == 4 * count_params(model)


# ---- the tracker's own behaviour --------------------------------------------------------------


def test_categories_sum_to_total_and_timeline_is_small():
    model, opt, x, y, loss_fn, _ = warmed_up("cnn")
    mt = tracked_step(model, opt, x, y, loss_fn)
    assert 50 < len(mt.timeline) < 2000
    for s in mt.timeline:
        assert s["total"] == sum(s[c] for c in CATEGORIES)
    assert max(s["total"] for s in mt.timeline) == mt.peak
    assert json.loads(json.dumps(mt.to_dict()))["peak"] == mt.peak
    phases = {s["phase"] for s in mt.timeline}
    assert {"forward conv1", "backward fc1", "optimizer step"} <= phases
    assert mt.peak_phase == "backward"  # relu's backward after max_pool's (see analytic.py)
    # Grads and optimizer state exist (and are named) at the end of the step.
    assert mt.timeline[-1]["optimizer"] == analytic.optimizer_state_bytes(model.parameters())


def test_tracker_can_be_reentered_and_leaves_no_hooks():
    model, opt, x, y, loss_fn, _ = warmed_up("cnn", batch=8)
    mt = MemoryTracker(model, opt)
    mt.track_modules(model)
    peaks = []
    for _ in range(2):
        with mt:
            train_step(model, opt, x, y, loss_fn)
        peaks.append((mt.peak, mt.peak_phase))
    assert peaks[0] == peaks[1] and peaks[0][1] == "optimizer step"
    assert not model.conv1._forward_hooks and not model.conv1._backward_hooks


def test_lazily_created_optimizer_state_is_named_during_the_first_step():
    model, x, y, loss_fn = make_cnn(batch=2)
    opt = torch.optim.Adam(model.parameters())
    with MemoryTracker(model, opt) as mt:
        train_step(model, opt, x, y, loss_fn)
    assert mt.peak_phase == "optimizer step"
    assert mt.peak_by_category["optimizer"] == analytic.optimizer_state_bytes(model.parameters())
    assert mt.peak_by_category["other"] == analytic.adam_temporaries(
        [p.numel() for p in model.parameters()]
    )


def test_params_bytes_are_4_per_parameter():
    for model in (MnistCNN(), GPT(GPTConfig(tie_embeddings=True))):
        with MemoryTracker(model) as mt:
            pass
        assert mt.current()["params"] == 4 * count_params(model)


def test_freed_tensor_is_no_longer_counted():
    with MemoryTracker() as mt:
        a = torch.empty(1000)
        view = a[10:]  # a view: same storage, counted once
        assert mt.current()["total"] == 4000
        del a
        assert mt.current()["total"] == 4000  # the view keeps the storage alive
        del view
        assert mt.current()["total"] == 0
    assert mt.peak == 4000


def test_resize_to_zero_frees_and_resize_back_allocates():
    resize = torch.UntypedStorage.resize_
    with MemoryTracker() as mt:
        t = torch.empty(1000)
        t.untyped_storage().resize_(0)
        assert mt.current()["total"] == 0
        t.untyped_storage().resize_(4000)
        assert mt.current()["total"] == 4000
    assert torch.UntypedStorage.resize_ is resize  # the patch is undone on exit


def test_tag_is_a_noop_outside_a_tracker_and_names_comm_inside():
    buf = torch.empty(256)
    tag(buf, "comm")  # no tracker: nothing happens, nothing breaks
    with MemoryTracker() as mt:
        tag(buf, "comm")
        assert mt.current()["comm"] == 1024
    tag(buf, "comm")
    assert mt.current()["comm"] == 1024  # the exited tracker heard nothing


def test_timeline_is_thinned_but_keeps_the_peak():
    with MemoryTracker(max_samples=64) as mt:
        for i in range(300):
            t = torch.empty(1000 + (i == 123) * 5000)
            del t
    assert len(mt.timeline) <= 64
    assert max(s["total"] for s in mt.timeline) == mt.peak == 24000


# ---- the analytic model -----------------------------------------------------------------------


def test_zero_paper_figure_1():
    gb = analytic.zero_paper_example()
    assert {s: float(f"{v:.3g}") for s, v in gb.items()} == {
        "ddp": 120.0,
        "zero1": 31.4,
        "zero2": 16.6,
        "zero3": 1.88,
    }


def test_model_state_formulas():
    psi, n = 1000, 4
    k = analytic.optimizer_bytes_per_param("adam", mixed_precision=False)  # 8
    fp32 = {s: analytic.model_state_bytes(psi, n, s, 4, 4, k)["total"] for s in analytic.STAGES}
    assert fp32 == {
        "ddp": 16 * psi,
        "zero1": 8 * psi + 8 * psi / n,
        "zero2": 4 * psi + 12 * psi / n,
        "zero3": 16 * psi / n,
    }
    assert analytic.model_state_bytes(psi, n, "fsdp") == analytic.model_state_bytes(psi, n, "zero3")
    assert [analytic.optimizer_bytes_per_param(o, False) for o in analytic.OPTIMIZER_STATES] == [
        0,
        4,
        8,
        8,
        8,
    ]


@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_optimizer_state_bytes_match_torch(name):
    model, x, y, loss_fn = make_cnn(batch=2)
    opt = OPTIMIZERS[name](model.parameters())
    train_step(model, opt, x, y, loss_fn)
    actual = sum(
        v.nbytes for s in opt.state.values() for v in s.values() if isinstance(v, torch.Tensor)
    )
    assert analytic.optimizer_state_bytes(model.parameters(), name) == actual


def measured_saved_bytes(model, x, y, loss_fn) -> int:
    """Bytes of the distinct storages autograd saves in forward + loss, parameters excluded."""
    params = {id(p.untyped_storage()) for p in model.parameters()}
    saved = {}

    def pack(t):
        st = t.untyped_storage()
        if id(st) not in params:
            saved[id(st)] = st.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = loss_fn(model(x), y)  # keeps the graph, hence the storages (and ids), alive
    assert loss.requires_grad
    return sum(saved.values())


@pytest.mark.parametrize("batch,dropout", [(1, 0.0), (64, 0.0), (16, 0.25)])
def test_cnn_activation_formula(batch, dropout):
    model, x, y, loss_fn = make_cnn(batch, dropout)
    assert analytic.activation_bytes(model, batch) == measured_saved_bytes(model, x, y, loss_fn)


@pytest.mark.parametrize(
    "cfg",
    [
        dict(),
        dict(batch=3, vocab_size=256, n_layer=3, d_model=32, n_head=2, seq_len=48),
        dict(batch=2, dropout=0.1),  # attention dropout: SDPA's math path
    ],
)
def test_gpt_activation_formula(cfg):
    model, x, y, loss_fn = make_gpt(**cfg)
    batch = x.shape[0]
    assert analytic.activation_bytes(model, batch) == measured_saved_bytes(model, x, y, loss_fn)
    assert analytic.activation_bytes(
        "gpt", batch, **{k: v for k, v in cfg.items() if k != "batch"}
    ) == analytic.activation_bytes(model, batch)


# Tolerance: none where the peak is held by activations or by Adam's step: on torch 2.14.1,
# CPU, fp32 the prediction is exact, and a torch upgrade that changes what a kernel saves or
# allocates should fail here and be re-derived. 5% (an undershoot) for SGD with tiny
# activations, whose peak sits late in backward (Note [where the peak is]).
@pytest.mark.parametrize(
    "kind,kwargs,optimizer,moment,tolerance",
    [
        ("cnn", dict(batch=4), "adam", "optimizer step", 0),
        ("cnn", dict(batch=64), "adam", "backward relu(conv2)", 0),
        ("cnn", dict(batch=8, dropout=0.25), "sgd", "backward relu(conv2)", 0),
        ("gpt", dict(batch=8), "adamw", "backward last mlp", 0),
        ("gpt", dict(batch=4, vocab_size=256), "adamw", "backward loss", 0),
        ("gpt", dict(batch=1, d_model=128, seq_len=8), "adamw", "optimizer step", 0),
        ("gpt", dict(batch=4, d_model=128, seq_len=8), "sgd", "optimizer step", 0.05),
    ],
)
def test_predicted_step_peak(kind, kwargs, optimizer, moment, tolerance):
    model, x, y, loss_fn = MODELS[kind][0](**kwargs)
    opt = OPTIMIZERS[optimizer](model.parameters())
    train_step(model, opt, x, y, loss_fn)
    mt = tracked_step(model, opt, x, y, loss_fn, modules=False)
    predicted = analytic.predict_step_peak(model, x.shape[0], optimizer)
    assert predicted["moment"] == moment
    if tolerance == 0:
        assert predicted["peak"] == mt.peak
    else:
        assert 0 <= mt.peak - predicted["peak"] <= tolerance * mt.peak
