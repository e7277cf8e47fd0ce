"""The two models the series trains.

* ``MnistCNN`` -- the CNN of PyTorch's FSDP tutorial (1,199,882 parameters). Small enough
  that every chapter can train it on CPU in seconds; big enough (``fc1`` holds 98% of the
  parameters) that sharding it visibly changes memory.
* ``GPT`` -- a small GPT-style decoder (pre-LayerNorm blocks, causal self-attention, MLP).
  Depth and width are arguments, so the same class serves a 20k-parameter unit test and a
  model whose optimizer state dominates memory.

Note [dropout and parity]: dropout draws a random mask per sample. A single process
training on the global batch draws *one* mask for all samples; N data-parallel ranks draw N
masks from N generators. The two runs are then different computations, so parity tests build
the models with ``dropout=0.0``. Nothing else in these models is random after init.

Note [activation checkpointing]: ``apply_activation_checkpointing(gpt)`` runs each block's
``attn`` and ``mlp`` under ``torch.utils.checkpoint.checkpoint(..., use_reentrant=False)``.
Forward then keeps, of each region, only its input (the LayerNorm's output, which the
checkpoint holds); the tensors the region's ops would save (q, k, v, the attention output, the
4C-wide MLP hidden, dropout masks, ...) are dropped and recomputed by re-running the region's
forward when backward first needs one. The saving is most of a block's activations:
``16BTC + 4BT + BHT`` saved bytes become ``4BTC + 4BT`` (fp32; Note [what a checkpointed block
saves] in ``minifsdp/analytic.py``). The price is a second forward of each region, minus its
last matmul (Note [early stop]). It replaces the *instance's* ``forward`` -- no wrapper module, so
parameter names and state-dict keys are unchanged (torch's ``checkpoint_wrapper`` would add
``_checkpoint_wrapped_module.``). Dropout still matches bit for bit: the checkpoint saves the
RNG state at the region's forward and replays it, in a forked RNG, for the recomputation.

Why the regions sit strictly *inside* a Block, FSDP's unit: the recomputation calls the
region's forward function, not ``Block.__call__``, so none of FSDP's module hooks -- all on the
Block and the root -- run again inside backward. The Block's pre-backward hook (on its output)
has already all-gathered its parameters before any of its backward nodes runs, and the
recomputed ops read the parameters registered on the modules right then: the same unsharded
tensors that forward used. So checkpointing costs no collective: with ``reshard_after_forward``
the pre-backward all-gather, which the gradients need anyway, serves the recomputation too;
without it the parameters never left. Checkpointing a *whole* unit (``checkpoint(block, x)``)
re-runs ``Block.__call__`` in backward, i.e. FSDP's forward hooks: minifsdp's fsdp2 then only
makes sure the parameters are unsharded (Note [recomputed in backward] in
``fsdp2/fsdp_state.py``, tested against torch's), and minifsdp's fsdp1 refuses with a clear
error (its regions-inside-units runs bit for bit like fsdp2's:
``tests/test_activation_checkpointing.py``).

Note [early stop]: the recomputation stops as soon as every tensor the region saved is back
(torch's default, ``torch.utils.checkpoint.set_checkpoint_early_stop(True)``). An op saves
its *inputs* before its kernel runs, so the region's last op -- ``proj`` in attn and in mlp,
which saves only its input and weight -- is never re-run: per block, the recomputation costs
the qkv and fc matmuls (``2BT * 7C^2`` FLOPs), attention and gelu, not the two ``proj``
matmuls (``2BT * 5C^2``). FLOP-counted in ``tests/test_activation_checkpointing.py``.
"""

from __future__ import annotations

import functools
import math
from dataclasses import asdict, dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F


class MnistCNN(nn.Module):
    """The FSDP tutorial's MNIST classifier.

    Shapes: ``x`` ``(B, 1, 28, 28)`` float -> log-probabilities ``(B, 10)``.

    Example:
        >>> model = MnistCNN(dropout=0.0)
        >>> model(torch.zeros(2, 1, 28, 28)).shape
        torch.Size([2, 10])
        >>> sum(p.numel() for p in model.parameters())
        1199882
    """

    def __init__(self, dropout: float = 0.25):
        super().__init__()
        self.conv1 = nn.Conv2d(1, 32, 3, 1)
        self.conv2 = nn.Conv2d(32, 64, 3, 1)
        # The tutorial uses p=0.25 after pooling and p=0.5 after fc1; keep that ratio.
        self.dropout1 = nn.Dropout(dropout)
        self.dropout2 = nn.Dropout(min(2 * dropout, 0.9))
        self.fc1 = nn.Linear(9216, 128)
        self.fc2 = nn.Linear(128, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.relu(self.conv1(x))
        x = F.relu(self.conv2(x))
        x = F.max_pool2d(x, 2)
        x = self.dropout1(x)
        x = torch.flatten(x, 1)
        x = F.relu(self.fc1(x))
        x = self.dropout2(x)
        x = self.fc2(x)
        return F.log_softmax(x, dim=1)


@dataclass
class GPTConfig:
    """Size of a ``GPT``. The defaults train in a few seconds on one CPU core."""

    vocab_size: int = 64
    seq_len: int = 64
    n_layer: int = 2
    n_head: int = 4
    d_model: int = 64
    dropout: float = 0.0
    tie_embeddings: bool = False

    def to_dict(self) -> dict:
        return asdict(self)


class CausalSelfAttention(nn.Module):
    """Multi-head attention with a causal mask. ``(B, T, C) -> (B, T, C)``."""

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        assert cfg.d_model % cfg.n_head == 0, "d_model must be divisible by n_head"
        self.n_head = cfg.n_head
        self.qkv = nn.Linear(cfg.d_model, 3 * cfg.d_model)
        self.proj = nn.Linear(cfg.d_model, cfg.d_model)
        self.dropout = cfg.dropout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        q, k, v = self.qkv(x).split(C, dim=2)
        # (B, T, C) -> (B, n_head, T, head_dim)
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(
            q, k, v, is_causal=True, dropout_p=self.dropout if self.training else 0.0
        )
        return self.proj(y.transpose(1, 2).contiguous().view(B, T, C))


class MLP(nn.Module):
    """Position-wise feed-forward, 4x expansion. ``(B, T, C) -> (B, T, C)``."""

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.fc = nn.Linear(cfg.d_model, 4 * cfg.d_model)
        self.proj = nn.Linear(4 * cfg.d_model, cfg.d_model)
        self.drop = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.drop(self.proj(F.gelu(self.fc(x))))


class Block(nn.Module):
    """One pre-LayerNorm transformer block -- the unit that FSDP wraps in later chapters."""

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.d_model)
        self.attn = CausalSelfAttention(cfg)
        self.ln2 = nn.LayerNorm(cfg.d_model)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    """A small GPT-style language model.

    Shapes: ``idx`` ``(B, T)`` int64 token ids with ``T <= cfg.seq_len`` -> logits
    ``(B, T, vocab_size)``.

    Example:
        >>> model = GPT(GPTConfig(n_layer=2, d_model=32, n_head=4))
        >>> model(torch.zeros(3, 16, dtype=torch.long)).shape
        torch.Size([3, 16, 64])
    """

    def __init__(self, cfg: GPTConfig | None = None):
        super().__init__()
        self.cfg = cfg = cfg or GPTConfig()
        self.tok_emb = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.pos_emb = nn.Embedding(cfg.seq_len, cfg.d_model)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.d_model)
        self.head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.head.weight = self.tok_emb.weight
        self.init_weights()

    @torch.no_grad()
    def init_weights(self) -> None:
        """GPT-2 style init. Kept separate so meta-device init (chapter 05) can call it."""
        for name, p in self.named_parameters():
            if p.dim() >= 2:
                std = 0.02
                if name.endswith("proj.weight"):  # residual projections, scaled by depth
                    std = 0.02 / math.sqrt(2 * self.cfg.n_layer)
                nn.init.normal_(p, mean=0.0, std=std)
            elif name.endswith("bias"):
                nn.init.zeros_(p)
            else:  # LayerNorm weights
                nn.init.ones_(p)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        B, T = idx.shape
        if T > self.cfg.seq_len:
            raise ValueError(f"sequence length {T} exceeds the model's seq_len {self.cfg.seq_len}")
        pos = torch.arange(T, device=idx.device)
        x = self.tok_emb(idx) + self.pos_emb(pos)
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))


# ---- activation checkpointing --------------------------------------------------------------

def apply_activation_checkpointing(model: GPT) -> GPT:
    """Recompute every block's ``attn`` and ``mlp`` in backward instead of saving their
    activations (Note [activation checkpointing]). In place; returns ``model``.

    Example:
        >>> model = apply_activation_checkpointing(GPT(GPTConfig(n_layer=1, d_model=32)))
        >>> [k for k, _ in model.named_parameters()][2]      # names unchanged
        'blocks.0.ln1.weight'
        >>> model(torch.zeros(2, 8, dtype=torch.long)).sum().backward()
    """
    for block in model.blocks:
        for region in (block.attn, block.mlp):
            if "forward" in region.__dict__:
                raise ValueError(f"{type(region).__name__}.forward was already replaced "
                                 "(activation checkpointing applied twice?)")
            region.forward = _checkpointed(region.forward)  # the bound class method
    return model


def _checkpointed(forward):
    """``forward`` run under ``torch.utils.checkpoint.checkpoint``, non-reentrant."""
    from torch.utils.checkpoint import checkpoint

    @functools.wraps(forward)
    def run(*args, **kwargs):
        return checkpoint(forward, *args, use_reentrant=False, **kwargs)

    return run


def count_params(model: nn.Module) -> int:
    """Number of distinct parameters (a tied weight counts once), i.e. the ZeRO paper's Ψ."""
    return sum(p.numel() for p in model.parameters())


def build_model(name: str, **kwargs) -> nn.Module:
    """Build a model by name: ``"cnn"`` (``MnistCNN``) or ``"gpt"`` (``GPT``, kwargs -> GPTConfig).

    Example:
        >>> count_params(build_model("gpt", n_layer=1, d_model=32))
        18912
    """
    if name == "cnn":
        return MnistCNN(**kwargs)
    if name == "gpt":
        return GPT(GPTConfig(**kwargs))
    raise ValueError(f"unknown model {name!r}; expected 'cnn' or 'gpt'")
