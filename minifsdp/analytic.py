"""The analytic memory model: what a training step *should* cost, from first principles.

Two halves:

* **Model states** (the ZeRO paper, Rajbhandari et al. 2020, section 3.1): parameters,
  gradients and optimizer state, and how DDP / ZeRO-1 / ZeRO-2 / ZeRO-3 (= FSDP) split them
  over N data-parallel ranks. This is the formula the series keeps coming back to.
* **Activations and the step peak** of *our* two models: the exact bytes autograd saves
  for backward, derived layer by layer from the architecture, and the peak of a whole
  training step (forward, backward, optimizer step), which ``tests/test_memory.py`` checks
  against ``MemoryTracker``.

Everything below the ZeRO section assumes fp32 on CPU, as measured with torch 2.14.1 (which
kernel runs, and hence what it saves, is a property of the torch build and the device).

Note [the 16 bytes per parameter]: mixed-precision Adam keeps, per parameter, an fp16/bf16
weight (2 bytes) and gradient (2 bytes), plus an fp32 master weight, momentum and variance
(4 + 4 + 4 = K = 12 bytes): 16 bytes per parameter before a single activation. ZeRO shards
the K part (stage 1), then the gradients (stage 2), then the parameters too (stage 3; FSDP).
In fp32 training there is no master copy: 4 + 4 bytes for the weight and gradient and 4
per optimizer state (Adam: 2 states, so 16 bytes again, by coincidence).

Note [Adam's step counter]: torch's Adam/AdamW/Adadelta keep ``state["step"]`` as a 0-d fp32
*tensor* per parameter tensor, so the exact state is ``8 * Psi + 4 * n_tensors`` bytes,
not ``8 * Psi``. Negligible, but we want byte-exact agreement with the tracker.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from minifsdp.models import GPT, GPTConfig, MnistCNN, build_model

GB = 1e9  # the ZeRO paper's GB are decimal
F32 = 4  # bytes per fp32 element
I64 = 8  # bytes per int64 element (token ids, targets, max-pool indices)

# Optimizer -> fp32 state tensors per parameter (and whether it keeps a per-tensor step).
OPTIMIZER_STATES = {"sgd": 0, "sgd_momentum": 1, "adam": 2, "adamw": 2, "adadelta": 2}
_HAS_STEP_TENSOR = {"adam", "adamw", "adadelta"}
STAGES = ("ddp", "zero1", "zero2", "zero3")  # "fsdp" is accepted as another name for zero3


# ---- model states: the ZeRO paper ----------------------------------------------------------


def optimizer_bytes_per_param(optimizer: str = "adam", mixed_precision: bool = True) -> int:
    """K, the optimizer-state bytes per parameter (Note [the 16 bytes per parameter]).

    Example:
        >>> optimizer_bytes_per_param("adam")  # fp32 master + momentum + variance
        12
        >>> optimizer_bytes_per_param("sgd_momentum", mixed_precision=False)
        4
    """
    return F32 * OPTIMIZER_STATES[optimizer] + (F32 if mixed_precision else 0)


def model_state_bytes(
    psi: float,
    n: int = 1,
    stage: str = "ddp",
    param_bytes: int = 2,
    grad_bytes: int = 2,
    k: int = 12,
) -> dict[str, float]:
    """Per-rank bytes of parameters, gradients and optimizer state under a ZeRO stage.

    ``psi`` parameters, ``n`` data-parallel ranks. The defaults are the paper's
    mixed-precision Adam (2 + 2 + 12 bytes); pass ``param_bytes=4, grad_bytes=4,
    k=optimizer_bytes_per_param(name, mixed_precision=False)`` for fp32 training.

    =====  ==========================
    ddp    (2 + 2 + K) * psi
    zero1  (2 + 2) * psi + K * psi / N
    zero2  2 * psi + (2 + K) * psi / N
    zero3  (2 + 2 + K) * psi / N
    =====  ==========================

    Example:
        >>> model_state_bytes(7.5e9, 64, "zero3")["total"] / GB
        1.875
    """
    stage = "zero3" if stage == "fsdp" else stage
    if stage not in STAGES:
        raise ValueError(f"unknown stage {stage!r}; expected one of {STAGES} or 'fsdp'")
    shard_p, shard_g, shard_os = {
        "ddp": (1, 1, 1),
        "zero1": (1, 1, n),
        "zero2": (1, n, n),
        "zero3": (n, n, n),
    }[stage]
    out = {
        "params": param_bytes * psi / shard_p,
        "grads": grad_bytes * psi / shard_g,
        "optimizer": k * psi / shard_os,
    }
    return {**out, "total": sum(out.values())}


def zero_paper_example() -> dict[str, float]:
    """The ZeRO paper's Figure 1 example: Psi = 7.5B, N = 64, K = 12, in GB per rank.

    Example:
        >>> {s: round(gb, 2) for s, gb in zero_paper_example().items()}
        {'ddp': 120.0, 'zero1': 31.41, 'zero2': 16.64, 'zero3': 1.88}
    """
    return {s: model_state_bytes(7.5e9, 64, s)["total"] / GB for s in STAGES}


def optimizer_state_bytes(params, optimizer: str = "adam") -> int:
    """Exact fp32 bytes of torch's optimizer state for ``params`` (Note [Adam's step counter]).

    Example:
        >>> optimizer_state_bytes(MnistCNN().parameters(), "adam")  # 8 tensors
        9599088
    """
    params = list(params)
    per_tensor = F32 if optimizer in _HAS_STEP_TENSOR else 0
    return sum(F32 * OPTIMIZER_STATES[optimizer] * p.numel() + per_tensor for p in params)


# ---- activations: what autograd saves ------------------------------------------------------


def cnn_activation_bytes(batch: int, dropout: float = 0.0) -> int:
    """Bytes autograd saves for backward in ``MnistCNN`` (train mode) plus ``F.nll_loss``.

    Walk the forward and ask of every op what its backward needs (parameters excluded: they
    are model state, not activations). ``B`` = ``batch``; fp32 unless said otherwise.

    Example:
        >>> cnn_activation_bytes(64)
        22289412
    """
    b, drop = batch, dropout > 0
    saved = [
        b * 1 * 28 * 28 * F32,  # conv1 saves its input x (the batch itself)
        b * 32 * 26 * 26 * F32,  # relu saves its *output*; conv2 saves the same tensor
        b * 64 * 24 * 24 * F32,  # relu's output again, which max_pool2d also saves
        b * 64 * 12 * 12 * I64,  # max_pool2d's argmax indices: int64, twice the pooled bytes
        b * 9216 * F32,  # fc1 saves its input (pooled, or the dropout output)
        b * 9216 * F32 * drop,  # dropout (CPU, p > 0) saves its mask, as fp32 (!) not bool
        b * 128 * F32,  # relu's output, saved by relu and, without dropout, by fc2
        b * 128 * F32 * 2 * drop,  # dropout2's fp32 mask, and its output that fc2 saves
        b * 10 * F32,  # log_softmax saves its output
        b * I64 + F32,  # nll_loss saves the targets (int64) and a 0-d fp32 total_weight
    ]
    # The pooled tensor itself (input of dropout) is not saved when p > 0: mul by a mask
    # needs only the mask. With p == 0, nn.Dropout is the identity and saves nothing.
    return sum(int(x) for x in saved)


def gpt_block_activation_bytes(batch: int, cfg: GPTConfig, seq_len: int | None = None,
                               activation_checkpointing: bool = False) -> int:
    """Bytes autograd saves for backward in one ``Block`` of a ``GPT`` (train mode), its
    input included; without (``16BTC + 2 * 2BT + BHT``) or with activation checkpointing
    (``4BTC + 2 * 2BT``). ``B, T, C, H`` = batch, sequence length, d_model, heads; fp32.

    Note [what attention saves on CPU]: with ``dropout == 0`` torch 2.14 runs SDPA with its
    fused CPU flash-attention kernel, which saves q, k, v (views of the qkv projection's
    output: one ``B*T*3C`` storage), its output ``B*T*C`` (laid out so that the
    ``transpose(1, 2).contiguous()`` before ``proj`` is free: one storage, also saved by
    ``proj``) and a ``B*H*T`` logsumexp, never the ``T x T`` attention matrix. With dropout
    it falls back to the math path, which materializes and saves ``T x T`` matrices three
    times (softmax output, dropout mask, dropped weights) plus copies of q, k, v.

    Note [what a checkpointed block saves]: ``apply_activation_checkpointing`` runs ``attn``
    and ``mlp`` under a non-reentrant ``checkpoint``, which saves each region's input ``h``
    for backward (with an autograd function of its own, so it is saved like any other
    tensor) and hides everything the region's ops save. What the block still saves lies
    outside the regions: ln1's input and stats, attn's input (ln1's output), ln2's input and
    stats, mlp's input (ln2's output) -- ``4BTC + 2 * 2BT``, with or without dropout. The
    regions' own saved tensors come back in backward, one region at a time, when the
    recomputation runs the region's forward again (``gpt_recompute_bytes``).

    Example:
        >>> cfg = GPTConfig()  # T 64, C 64, H 4
        >>> gpt_block_activation_bytes(8, cfg), gpt_block_activation_bytes(8, cfg, None, True)
        (2113536, 532480)
    """
    b, t, c, h = batch, seq_len or cfg.seq_len, cfg.d_model, cfg.n_head
    btc, ln_stats = b * t * c * F32, 2 * b * t * F32  # LayerNorm saves mean and rstd, fp32
    if activation_checkpointing:  # Note [what a checkpointed block saves]
        return btc + ln_stats + btc + btc + ln_stats + btc  # ln1, attn's input, ln2, mlp's
    per_block = [
        btc + ln_stats,  # ln1 saves its input x (the residual stream) and its stats
        btc,  # qkv (Linear) saves its input, ln1's output
        btc + ln_stats,  # ln2 saves x after the attention residual, and its stats
        btc,  # mlp.fc saves its input, ln2's output
        4 * btc,  # gelu saves its input, mlp.fc's output (4C wide)
        4 * btc,  # mlp.proj saves its input, gelu's output
    ]
    if cfg.dropout == 0:  # Note [what attention saves on CPU]: the flash path
        per_block += [3 * btc, btc, b * h * t * F32]  # qkv output, attention output, lse
    else:  # the math path: q*scale, k^T, v copies and the output; 3 TxT; mlp's fp32 mask
        per_block += [4 * btc, 3 * b * h * t * t * F32, btc]
    return sum(per_block)


def gpt_activation_bytes(batch: int, cfg: GPTConfig, seq_len: int | None = None,
                         activation_checkpointing: bool = False) -> int:
    """Bytes autograd saves for backward in ``GPT`` (train mode) plus ``F.cross_entropy``.

    ``B, T, C, V`` = batch, sequence length, d_model, vocab; fp32 on CPU. The blocks'
    share is ``gpt_block_activation_bytes`` each; with ``activation_checkpointing`` only
    that share changes (Note [what a checkpointed block saves]).

    Example:
        >>> gpt_activation_bytes(8, GPTConfig())  # vocab 64, T 64, C 64, 2 layers
        4633092
        >>> gpt_activation_bytes(8, GPTConfig(), activation_checkpointing=True)
        1470980
    """
    b, t, c, v = batch, seq_len or cfg.seq_len, cfg.d_model, cfg.vocab_size
    btc, ln_stats = b * t * c * F32, 2 * b * t * F32
    per_block = gpt_block_activation_bytes(batch, cfg, seq_len, activation_checkpointing)
    return sum(
        [
            b * t * I64 + t * I64,  # the embeddings save their indices: token ids and positions
            cfg.n_layer * per_block,
            btc + ln_stats,  # ln_f saves its input and stats
            btc,  # head saves its input, ln_f's output
            b * t * v * F32,  # cross_entropy = log_softmax (saves its output) ...
            b * t * I64 + F32,  # ... + nll_loss (saves the targets and a 0-d total_weight)
        ]
    )


def gpt_recompute_bytes(batch: int, cfg: GPTConfig, seq_len: int | None = None
                        ) -> dict[str, int]:
    """Bytes one checkpointed region re-creates in backward, by region (Note [what a
    checkpointed block saves]): what its ops save beyond the region's input, which the
    checkpoint kept. They live from the recomputation to the end of that region's backward,
    one region at a time, on top of ``gpt_activation_bytes(..., activation_checkpointing=True)``.

    ``attn``: the qkv output ``3BTC``, the attention output ``BTC``, the logsumexp ``BHT``
    (dropout 0: the flash path); ``mlp``: gelu's input and output, ``4BTC`` each. The
    recomputation stops once these exist, before each region's ``proj`` (Note [early stop]
    in ``minifsdp/models.py``).

    Example:
        >>> gpt_recompute_bytes(8, GPTConfig())  # B 8, T 64, C 64, H 4
        {'attn': 532480, 'mlp': 1048576}
    """
    if cfg.dropout != 0:
        raise NotImplementedError("GPT with dropout: SDPA's math path; measure it instead")
    b, t, c = batch, seq_len or cfg.seq_len, cfg.d_model
    btc = b * t * c * F32
    return {"attn": 3 * btc + btc + b * cfg.n_head * t * F32, "mlp": 4 * btc + 4 * btc}


def activation_bytes(
    model: nn.Module | str, batch: int, seq_len: int | None = None,
    activation_checkpointing: bool = False, **model_kwargs
) -> int:
    """Saved-for-backward bytes of ``MnistCNN`` or ``GPT`` (a module, or "cnn"/"gpt" + kwargs),
    the GPT's optionally with its blocks checkpointed.

    Example:
        >>> activation_bytes("gpt", 8, n_layer=2) == gpt_activation_bytes(8, GPTConfig())
        True
        >>> activation_bytes("gpt", 8, activation_checkpointing=True, n_layer=2)
        1470980
    """
    model = _meta_model(model, **model_kwargs)
    if isinstance(model, MnistCNN):
        if activation_checkpointing:
            raise ValueError("activation checkpointing is defined for the GPT's blocks only")
        return cnn_activation_bytes(batch, model.dropout1.p)
    return gpt_activation_bytes(batch, model.cfg, seq_len, activation_checkpointing)


# ---- the peak of a training step -----------------------------------------------------------


def _meta_model(model: nn.Module | str, **model_kwargs) -> nn.Module:
    """A model to read shapes from; built on the meta device (no memory) if given a name."""
    if isinstance(model, str):
        with torch.device("meta"):
            model = build_model(model, **model_kwargs)
    if not isinstance(model, (MnistCNN, GPT)):
        raise TypeError(f"the analytic model knows MnistCNN and GPT, not {type(model).__name__}")
    return model


def adam_temporaries(numels: list[int]) -> int:
    """Peak bytes of temporaries inside one single-tensor (CPU) Adam/AdamW ``step()``.

    Per parameter, ``denom = (exp_avg_sq.sqrt() / bias_correction2_sqrt).add_(eps)`` holds
    two temporaries of the parameter's size at the division, while the previous parameter's
    ``denom`` is still bound to the Python variable. Everything else is in place, including
    AdamW's decoupled weight decay (Adam's L2 ``weight_decay > 0`` would add a temporary).

    Example:
        >>> adam_temporaries([10, 1000, 5])  # 2 * 1000 + 10 elements
        8040
    """
    prev = [0, *numels[:-1]]
    return max((2 * n + p) * F32 for n, p in zip(numels, prev)) if numels else 0


def step_peak_moments(
    model: nn.Module | str,
    batch: int,
    optimizer: str = "adam",
    seq_len: int | None = None,
    **model_kwargs,
) -> dict[str, int]:
    """Live bytes at each moment of a training step that can hold its peak.

    For the step ``loss = loss_fn(model(x), y); loss.backward(); opt.step();
    opt.zero_grad()`` in fp32 on CPU, in steady state (optimizer state exists, grads are
    None before backward), with the batch ``(x, y)`` counted. Each moment is
    ``P + OS + (part of) G + (part of) A + working memory``; ``8`` bytes are the 0-d loss
    and the 0-d 1.0 that ``backward()`` starts from.

    Note [where the peak is]: not at the end of the forward pass, the textbook's guess
    (listed for comparison: it never wins for these models). Backward first *adds* memory:
    gradients of activations and of weights appear before the activations they replace are
    freed. So the peak is early in backward when activations dominate, and inside
    ``optimizer.step()`` when model states dominate (Adam's temporaries on top of
    ``P + G + OS``). Exact on torch 2.14.1 for Adam/AdamW, and for SGD while activations
    dominate. With SGD and tiny activations the peak moves late into backward, at whichever
    weight gradient appears with most others already accumulated; we do not model that
    moment, and undershoot by up to ~5% (measured).

    Example:
        >>> m = step_peak_moments("cnn", 64, dropout=0.0)
        >>> max(m, key=m.get)
        'backward relu(conv2)'
    """
    model = _meta_model(model, **model_kwargs)
    if optimizer not in ("adam", "adamw", "sgd", "sgd_momentum"):
        raise ValueError(f"no model of {optimizer!r}'s step temporaries")
    numels = [p.numel() for p in model.parameters()]
    P = G = F32 * sum(numels)
    OS = optimizer_state_bytes(model.parameters(), optimizer)
    temps = adam_temporaries(numels) if optimizer.startswith("adam") else 0  # SGD: in place
    A = activation_bytes(model, batch, seq_len)
    if isinstance(model, MnistCNN):
        b = batch
        batch_bytes = b * 28 * 28 * F32 + b * I64
        relu1, relu2 = b * 32 * 26 * 26 * F32, b * 64 * 24 * 24 * F32
        g_fc = F32 * sum(p.numel() for m in (model.fc1, model.fc2) for p in m.parameters())
        return {
            "end of forward": P + OS + A + 4,
            # fc2's and fc1's backward are done (their grads exist, their inputs are freed);
            # max_pool2d's backward has made a relu2-sized gradient and relu's backward makes
            # another, while relu2's output (saved by max_pool2d) and relu1's (saved by conv2)
            # are still alive: 3 relu2-sized tensors.
            "backward relu(conv2)": P + OS + g_fc + batch_bytes + relu1 + 3 * relu2 + 8,
            "optimizer step": P + G + OS + batch_bytes + temps + 4,
        }
    cfg = model.cfg
    if cfg.dropout != 0:
        raise NotImplementedError("GPT with dropout: SDPA's math path; measure it instead")
    b, t, c = batch, seq_len or cfg.seq_len, cfg.d_model
    btc, btv, ln_stats = b * t * c * F32, b * t * cfg.vocab_size * F32, 2 * b * t * F32
    batch_bytes = 2 * b * t * I64
    g_head = F32 * model.head.weight.numel()
    g_ln_f = F32 * sum(p.numel() for p in model.ln_f.parameters())
    g_proj = F32 * sum(p.numel() for p in model.blocks[-1].mlp.proj.parameters())
    return {
        # Inside cross_entropy: log_softmax's output (saved) next to the logits (not saved).
        "end of forward": P + OS + A - 4 + btv,
        # log_softmax's backward: grads of its output and of its input, next to the output.
        "backward loss": P + OS + A + 4 + 2 * btv,
        # head's backward: log-probs freed; grad of the logits, of head's weight and input.
        "backward head": P + OS + A + 4 + g_head + btc,
        # The last block's mlp.proj: what the loss, head and ln_f saved is freed (log-probs,
        # head's input, ln_f's input and stats) and their grads kept; alive are the
        # residual-stream grad (B,T,C), the 4C-wide grad of gelu's output and mlp.proj's
        # weight grads, next to every block's activations.
        "backward last mlp": sum(
            [
                P + OS + A + 4,
                -(btv + btc + btc + ln_stats),  # log-probs, head's and ln_f's inputs, ln_f's stats
                g_head + g_ln_f + g_proj,
                btc + 4 * btc,  # the residual-stream grad, the grad of gelu's output
            ]
        ),
        "optimizer step": P + G + OS + batch_bytes + temps + 4,
    }


def predict_step_peak(
    model: nn.Module | str,
    batch: int,
    optimizer: str = "adam",
    seq_len: int | None = None,
    **model_kwargs,
) -> dict:
    """Predicted peak bytes of one training step and the moment it happens.

    Returns ``{"peak": bytes, "moment": name, "moments": step_peak_moments(...)}``.

    Example:
        >>> predict_step_peak("cnn", 1, "adam", dropout=0.0)["moment"]
        'optimizer step'
    """
    moments = step_peak_moments(model, batch, optimizer, seq_len, **model_kwargs)
    moment = max(moments, key=moments.get)
    return {"peak": moments[moment], "moment": moment, "moments": moments}
