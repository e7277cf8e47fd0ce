"""The analytic model at scale: per-GPU memory and per-step traffic of 7B-405B transformers.

``minifsdp.analytic`` predicts our small runs byte for byte. The same formulas, fed the shapes
of the published Llama models, say what DDP, ZeRO-1/2 and FSDP cost on 8-1024 GPUs::

    m = PRESETS["70B"]                                   # Llama-3-70B's shapes
    memory_per_gpu(m, "fsdp", 64, micro_batch=1, seq_len=4096,
                   activation_checkpointing=True, mp=True)["total"] / 1e9   # 41.6 GB
    comm_bytes_per_gpu(m, "fsdp", 64, mp=True) / 1e9                        # 412.6 GB a step

and, with ``exact=True``, the very same functions reproduce what ``minifsdp.train`` measures
at N = 2 for our GPT, padding and Adam's step counters included (``tests/test_scale.py``).
Seconds per step are ``minifsdp.scale_time``'s: it prices these bytes on NVLink and the network.

Note [Llama shapes]: layers / d_model / heads / kv-heads / FFN hidden / vocab, from the papers
and the released ``config.json`` files: Llama-2-7B 32 / 4096 / 32 / 32 / 11008 / 32000
(Touvron et al. 2023, arXiv:2307.09288, Table 1; hf meta-llama/Llama-2-7b-hf); Llama-3-70B
80 / 8192 / 64 / 8 / 28672 / 128256 and Llama-3.1-405B 126 / 16384 / 128 / 8 / 53248 / 128256
(Llama Team 2024, "The Llama 3 Herd of Models", arXiv:2407.21783, Table 3; hf
meta-llama/Meta-Llama-3-70B, Llama-3.1-405B). A block: RMSNorm, q/k/v/o projections without
bias (k and v ``n_kv_head * head_dim`` wide: grouped-query attention), RMSNorm, a SwiGLU MLP
(gate, up: f x h; down: h x f); RoPE has no parameters; embeddings and head untied. That
gives 6.74B / 70.55B / 405.85B parameters, the published 6.7B / 70.6B / 405.9B.

Note [units and what FSDP holds unsharded]: units as ``minifsdp.train.shard_units``: one per
block, plus the root (embeddings, final norm, head). torch's default keeps the *root*
unsharded from forward to the end of backward (reshard_after_forward=False for the root, as
measured), so the transient is: the root's and two blocks' unsharded parameters (one
computing, one prefetched), the root's and one block's unsharded gradients, and that block's
reduce-scatter input. torchtitan gives the embeddings and the head units of their own, which
matters at 405B, where they are 4.2B parameters, more than a block (3.19B).

Note [mixed precision at scale]: ZeRO counts (2 + 2 + 12) Psi: bf16 weights and gradients,
and an fp32 master copy with Adam's m and v. FSDP2's ``MixedPrecisionPolicy(param_dtype=bf16)``
stores it differently: the fp32 sharded parameter *is* the master copy, so at rest a rank
holds (4 + 4 + 8) Psi / N (fp32 shards, fp32 sharded gradients, Adam) -- the same 16 Psi / N
-- while bf16 exists only in the unsharded units, the activations and on the wire. What mixed
precision buys FSDP is thus half the transient and activation memory and half the traffic
(``mp`` puts the parameters on the wire in bf16; the gradients go in ``reduce_bytes`` per
element, by default what a policy without ``reduce_dtype`` does -- the param dtype, bf16 --
while chapter 07 and torchtitan (``mixed_precision_reduce = "float32"`` in
torchtitan/config/job_config.py) reduce in fp32: pass ``reduce_bytes=4`` for that, which
doubles the reduce-scatter bytes). ``exact=True`` (padding, one 4-byte Adam step per
optimizer tensor) is what we measure at small N; at scale both are negligible and ignored.

Note [activations per layer]: Korthikanti et al. 2022 ("Reducing Activation Recomputation in
Large Transformer Models", eq. 1): a GPT layer saves ``s*b*h*(34 + 5*a*s/h)`` bytes -- 16-bit
activations, 1-byte dropout masks, MHA, a 4h GELU MLP, no tensor/sequence parallelism. The
``5as/h`` term is the s x s softmax, dropout mask and output; FlashAttention (the default here,
and what our CPU runs do: Note [what attention saves on CPU] in analytic.py) saves none of
them. For Llama we apply it unchanged: SwiGLU's three f-wide tensors are ~18-23 sbh vs
GELU's 19, GQA saves smaller k/v and there is no dropout: an estimate to ~15%. Full
checkpointing (a block at a time) keeps each block's input, ``2sbh``, and recomputes one block
at a time. The head adds its input and the fp32 log-probabilities the loss saves, ``4sbV``.
fp32 training doubles the layer terms.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from minifsdp.analytic import model_state_bytes
from minifsdp.fsdp1.flat_param import ALIGN_BYTES, flat_layout
from minifsdp.models import GPTConfig

Shape = tuple[int, ...]
STRATEGIES = ("ddp", "zero1", "zero2", "fsdp", "fsdp1")  # "fsdp" = FSDP2 (fully_shard)
ZERO_BUCKET_BYTES = 25 * 2**20  # minifsdp.zero's default bucket_cap_mb


@dataclass(frozen=True)
class Transformer:
    """A decoder-only transformer's parameter shapes. ``style="llama"``: Note [Llama shapes];
    ``style="gpt2"``: ``minifsdp.models.GPT`` (LayerNorm with bias, Linear biases, one fused
    qkv, 4h GELU MLP, learned positions up to ``max_seq_len``).

    Example:
        >>> PRESETS["7B"].num_params()
        6738415616
        >>> Transformer.from_gpt(GPTConfig()).num_params()   # == count_params(GPT(GPTConfig()))
        112384
    """

    n_layer: int
    d_model: int
    n_head: int
    n_kv_head: int
    ffn_hidden: int
    vocab_size: int
    max_seq_len: int = 4096
    style: str = "llama"
    tie_embeddings: bool = False

    @classmethod
    def from_gpt(cls, cfg: GPTConfig) -> Transformer:
        return cls(cfg.n_layer, cfg.d_model, cfg.n_head, cfg.n_head, 4 * cfg.d_model,
                   cfg.vocab_size, cfg.seq_len, "gpt2", cfg.tie_embeddings)

    def block_shapes(self) -> list[Shape]:
        """One block's parameter shapes, in ``parameters()`` order."""
        h, f = self.d_model, self.ffn_hidden
        if self.style == "gpt2":
            return [(h,), (h,), (3 * h, h), (3 * h,), (h, h), (h,),  # ln1, qkv, proj
                    (h,), (h,), (f, h), (f,), (h, f), (h,)]  # ln2, mlp.fc, mlp.proj
        kv = self.n_kv_head * (h // self.n_head)
        return [(h,), (h, h), (kv, h), (kv, h), (h, h), (h,), (f, h), (f, h), (h, f)]

    def param_shapes(self) -> list[Shape]:
        """Every parameter's shape in ``parameters()`` order (what ZeRO flattens)."""
        h, v, gpt = self.d_model, self.vocab_size, self.style == "gpt2"
        embed = [(v, h)] + ([(self.max_seq_len, h)] if gpt else [])
        final = [(h,), (h,)] if gpt else [(h,)]
        head = [] if self.tie_embeddings else [(v, h)]
        return embed + self.block_shapes() * self.n_layer + final + head

    def units(self) -> list[list[Shape]]:
        """FSDP units: ``[root, block 0, ..., block L-1]`` (Note [units and ...])."""
        blocks, shapes = self.block_shapes(), self.param_shapes()
        n_embed = 2 if self.style == "gpt2" else 1
        root = shapes[:n_embed] + shapes[n_embed + len(blocks) * self.n_layer:]
        return [root] + [blocks] * self.n_layer

    def num_params(self) -> int:
        """Psi."""
        return sum(math.prod(s) for s in self.param_shapes())


PRESETS = {  # Note [Llama shapes]
    "7B": Transformer(32, 4096, 32, 32, 11008, 32000, 4096),
    "70B": Transformer(80, 8192, 64, 8, 28672, 128256, 8192),
    "405B": Transformer(126, 16384, 128, 8, 53248, 128256, 8192),
}


# ---- padding, as minifsdp lays parameters out (exact=True) -----------------------------------

def _fsdp2_padded(s: Shape, n: int) -> int:
    """FSDP2: dim 0 padded to N * ceil(rows / N) (Note [padding] in fsdp2/fsdp_param.py)."""
    return n * -(-s[0] // n) * math.prod(s[1:])


def _fsdp2_local(s: Shape, n: int, rank: int) -> int:
    """Unpadded elements of rank's ``torch.chunk`` of dim 0 (what Adam sees)."""
    c = -(-s[0] // n)
    return max(0, min(c, s[0] - rank * c)) * math.prod(s[1:])


def _fsdp1_padded(shapes: list[Shape], n: int, elem: int) -> int:
    """FSDP1: one flat parameter, 16-byte aligned starts, total padded to N
    (fsdp1/flat_param.py)."""
    return flat_layout([math.prod(s) for s in shapes], n, max(1, ALIGN_BYTES // elem))[1]


def _zero_buckets(shapes: list[Shape], n: int, elem: int) -> list[int]:
    """ZeRO: padded flat bucket sizes, filled from the last parameter (minifsdp.zero)."""
    sizes, size = [0], 0
    for numel in reversed([math.prod(s) for s in shapes]):
        if sizes[-1] and (size + numel) * elem > ZERO_BUCKET_BYTES:
            sizes.append(0)
            size = 0
        sizes[-1] += numel
        size += numel
    return [n * -(-b // n) for b in sizes]


# ---- memory ----------------------------------------------------------------------------------

def _dtypes(strategy: str, mp: bool) -> tuple[int, int, int]:
    """(param, grad, optimizer) bytes per stored element (Note [mixed precision at scale])."""
    return (2, 2, 12) if mp and strategy in ("ddp", "zero1", "zero2") else (4, 4, 8)


def model_states(model: Transformer, strategy: str, n_gpus: int, mp: bool = False,
                 exact: bool = False, rank: int = 0) -> dict[str, float]:
    """Per-rank bytes of params / grads / optimizer state (Adam) with gradients present.

    Example:
        >>> m = PRESETS["7B"]
        >>> round(model_states(m, "fsdp", 64, mp=True)["total"] / 1e9, 3)   # 16 Psi / 64
        1.685
    """
    if strategy not in STRATEGIES:
        raise ValueError(f"unknown strategy {strategy!r}; expected one of {STRATEGIES}")
    pb, gb, k = _dtypes(strategy, mp)
    n, psi = n_gpus, model.num_params()
    if not exact:  # the ZeRO table (analytic.model_state_bytes)
        stage = "zero3" if strategy.startswith("fsdp") else strategy
        return model_state_bytes(psi, n, stage, pb, gb, k)
    shapes = model.param_shapes()
    if strategy == "ddp":
        p = g = o = psi
        steps = len(shapes)
    elif strategy in ("zero1", "zero2"):
        buckets = _zero_buckets(shapes, n, pb)
        p = sum(buckets)
        g = p if strategy == "zero1" else p / n
        o, steps = p / n, len(buckets)
    elif strategy == "fsdp1":
        p = g = o = sum(_fsdp1_padded(u, n, pb) for u in model.units()) / n
        steps = len(model.units())
    else:  # FSDP2: padded shards and their reduce-scatter output; Adam sees the unpadded rows
        p = g = sum(_fsdp2_padded(s, n) for s in shapes) / n
        o, steps = sum(_fsdp2_local(s, n, rank) for s in shapes), len(shapes)
    out = {"params": pb * p, "grads": gb * g, "optimizer": k * o + 4 * steps}
    return {**out, "total": sum(out.values())}


def unsharded_bytes(model: Transformer, strategy: str, n_gpus: int, mp: bool = False) -> float:
    """FSDP's transient full-size units (Note [units and what FSDP holds unsharded]); 0 for
    DDP/ZeRO (their bucket copies, at most ``ZERO_BUCKET_BYTES`` each, are not counted)."""
    if not strategy.startswith("fsdp"):
        return 0.0
    c = 2 if mp else 4  # compute dtype: unsharded params, their gradients, reduce-scatter input
    root, block = (sum(math.prod(s) for s in u) for u in model.units()[:2])
    return c * (root + 2 * block) + c * (root + block) + c * block


def activation_bytes(model: Transformer, micro_batch: int, seq_len: int,
                     checkpointing: bool = False, mp: bool = True,
                     flash_attention: bool = True) -> float:
    """Saved-for-backward bytes per GPU for one micro-batch (Note [activations per layer]).

    Example:
        >>> round(activation_bytes(PRESETS["7B"], 1, 4096) / 1e9, 2)   # 32 * 34 sbh + head
        18.81
    """
    s, b, h, a = seq_len, micro_batch, model.d_model, model.n_head
    scale = 1 if mp else 2
    layer = s * b * h * (34 + (0 if flash_attention else 5 * a * s / h)) * scale
    head = 2 * s * b * h * scale + 4 * s * b * model.vocab_size
    if checkpointing:
        return model.n_layer * 2 * s * b * h * scale + layer + head
    return model.n_layer * layer + head


def memory_per_gpu(model: Transformer, strategy: str, n_gpus: int, micro_batch: int,
                   seq_len: int, activation_checkpointing: bool = False, mp: bool = False,
                   exact: bool = False) -> dict[str, float]:
    """Peak-ish bytes per GPU: model states + FSDP's unsharded units + activations.

    Keys: params, grads, optimizer, unsharded, activations, total. Not counted: the CUDA
    context, allocator fragmentation and framework workspaces (a few GB in practice).
    """
    out = {k: v for k, v in model_states(model, strategy, n_gpus, mp, exact).items()
           if k != "total"}
    out["unsharded"] = unsharded_bytes(model, strategy, n_gpus, mp)
    out["activations"] = activation_bytes(model, micro_batch, seq_len,
                                          activation_checkpointing, mp)
    return {**out, "total": sum(out.values())}


def fits(model: Transformer, strategy: str, n_gpus: int, micro_batch: int = 1,
         seq_len: int = 4096, activation_checkpointing: bool = False, mp: bool = False,
         gpu_bytes: float = 80e9) -> bool:
    """Does ``memory_per_gpu(...)["total"]`` fit in ``gpu_bytes``?"""
    return memory_per_gpu(model, strategy, n_gpus, micro_batch, seq_len,
                          activation_checkpointing, mp)["total"] <= gpu_bytes


# ---- communication ---------------------------------------------------------------------------

def comm_by_op(model: Transformer, strategy: str, n_gpus: int, mp: bool = False,
               exact: bool = False, reshard_after_forward: bool = True,
               reduce_bytes: int | None = None) -> dict[str, float]:
    """Ring wire bytes each GPU sends per step, by collective (``minifsdp.comm``'s formulas:
    all-reduce 2(N-1)/N S, all-gather / reduce-scatter (N-1)/N S, S the full tensor).

    FSDP per unit: all-gather in forward, again in backward if resharded (never the root:
    Note [units and ...]), reduce-scatter of the gradients -- 3 collectives, or 2.
    ``reduce_bytes``: bytes per gradient element on the wire (None: as the parameters, 2 under
    ``mp``, else 4 -- Note [mixed precision at scale]).
    """
    n, f = n_gpus, (n_gpus - 1) / n_gpus
    pb = 2 if mp else 4  # parameters on the wire: bf16 under mp
    gb = pb if reduce_bytes is None else reduce_bytes
    if strategy in ("ddp", "zero1", "zero2"):
        flat = (sum(_zero_buckets(model.param_shapes(), n, pb)) if exact and strategy != "ddp"
                else model.num_params())
        return {"ddp": {"all_reduce": 2 * f * gb * flat},
                "zero1": {"all_reduce": 2 * f * gb * flat, "all_gather": f * pb * flat},
                "zero2": {"reduce_scatter": f * gb * flat, "all_gather": f * pb * flat},
                }[strategy]
    if strategy not in STRATEGIES:
        raise ValueError(f"unknown strategy {strategy!r}; expected one of {STRATEGIES}")
    ag = rs = 0.0
    for i, unit in enumerate(model.units()):
        if not exact:
            size = sum(math.prod(s) for s in unit)
        elif strategy == "fsdp1":  # aligned for the fp32 flat parameter it is gathered from
            size = _fsdp1_padded(unit, n, 4)
        else:
            size = sum(_fsdp2_padded(s, n) for s in unit)
        ag += f * pb * size * (2 if reshard_after_forward and i > 0 else 1)
        rs += f * gb * size
    return {"all_gather": ag, "reduce_scatter": rs}


def comm_bytes_per_gpu(model: Transformer, strategy: str, n_gpus: int, mp: bool = False,
                       exact: bool = False, reshard_after_forward: bool = True,
                       reduce_bytes: int | None = None) -> float:
    """Total wire bytes per GPU per step (``comm_by_op`` summed).

    Example:
        >>> m = PRESETS["7B"]
        >>> round(comm_bytes_per_gpu(m, "fsdp", 8) / comm_bytes_per_gpu(m, "ddp", 8), 2)
        1.48
    """
    return sum(comm_by_op(model, strategy, n_gpus, mp, exact, reshard_after_forward,
                          reduce_bytes).values())


def measured(rank_json: dict, step: int = 0) -> dict[str, float]:
    """What a ``minifsdp.train`` rank JSON says, in ``comm_by_op`` / ``model_states`` terms:
    wire bytes per step by op (comm log over ``steps``), and ``params``, ``optimizer`` at the
    end of tracked ``step`` with ``grads`` from the last sample of its optimizer step."""
    steps = len(rank_json["losses"])
    out: dict[str, float] = {}
    for r in rank_json["comm"]:
        if r["kind"] == "comm":
            out[r["op"]] = out.get(r["op"], 0.0) + r["wire_bytes"] / steps
    mem = rank_json["memory"][step]
    last_opt = [e for e in mem["timeline"] if e["phase"] == "optimizer step"][-1]
    return {**out, "params": mem["current"]["params"], "grads": last_opt["grads"],
            "optimizer": mem["current"]["optimizer"]}


__all__ = ["PRESETS", "STRATEGIES", "Transformer", "activation_bytes", "comm_by_op",
           "comm_bytes_per_gpu", "fits", "measured", "memory_per_gpu", "model_states",
           "unsharded_bytes"]
