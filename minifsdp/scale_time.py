"""Time at scale: step time and MFU of FSDP and HSDP from FLOPs, wire bytes and two links.

``minifsdp.scale`` says what a step costs in bytes; this module turns those bytes and the
step's FLOPs into seconds. Compute runs at an *achievable* FLOP/s, every collective costs a
latency plus its wire bytes over a bus bandwidth (NVLink inside a node, the network across
nodes), prefetching hides communication behind the compute of the neighbouring layer, and
the step time and MFU are what comes out::

    t = step_time(PRESETS["70B"], 64, micro_batch=1, seq_len=4096)          # FSDP over 64
    t["step"], t["exposed"], t["mfu"]
    step_time(PRESETS["70B"], 64, 1, 4096, shard=8)["mfu"]                  # HSDP, 8 x 8

Note [model FLOPs]: a token costs ``6 Psi' + 12 L h s`` FLOPs forward and backward (PaLM,
arXiv:2204.02311, appendix B; torchtitan's ``get_nparams_and_flops``): 2 per weight forward
and 4 backward, Psi' the parameters without the input embeddings (a lookup, not a matmul;
a tied head counts once), plus attention's two s x s matmuls per layer, counted in full (a
causal kernel skips about half). That is the *model* FLOPs, the numerator of MFU.
Activation checkpointing runs each block's forward again in backward: the *hardware* does
``8 Psi'_blocks + 16 L h s`` for the blocks, but MFU still counts 6 and 12, so checkpointing
costs MFU a quarter even when nothing else does.

Note [hardware defaults]: ``H100`` holds, per GPU: peak dense bf16 989 TFLOP/s (NVIDIA's
H100 SXM figure); achievable 794.5 TFLOP/s, the "maximum achievable matmul FLOPS" measured
for H100 SXM in stas00/ml-engineering, compute/accelerator/README.md (MAMF table, 80.3% of
peak) -- the best a large bf16 matmul does, so compute time here is a lower bound and MFU an
upper one; NVLink 4: 900 GB/s both directions, so 450e9 B/s bus bandwidth, the line rate;
8 GPUs a node. The network: one 400 Gb/s NIC per GPU, 8 per node (DGX H100; torchtitan's
benchmarks/llama3_h100_202412_torchtitan.md: "400 Gb/s per GPU"); ``inter_bw`` is the node's
8 NICs together, 8 x 50 GB/s = 400e9 B/s. A ring that spans nodes with all 8 of a node's GPUs
in it does not squeeze through one NIC: NCCL builds one ring per channel and puts each
channel's node-crossing hop on a different NIC, so all 8 NICs carry a share (NCCL's own cost
model, src/graph/tuning.cc ``ncclTopoTuneModel``: busBw = nChannels x per-channel speed), and
its bus bandwidth is bounded by 400e9 B/s at line rate. Groups with fewer GPUs per node get
fewer NICs (Note [a group's share of the NICs]). A vendor's cluster-validation guide lists
400-450 GB/s as the all_reduce_perf bus bandwidth to expect at 8 GB and more on H100 SXM with
NVLink and IB NDR (Saturn Cloud, "Validating Multi-Node GPU Clusters with NCCL Tests",
saturncloud.io/blog/crusoe-nccl-cluster-validation), without saying which algorithm: a ring
cannot exceed 400 at line rate, so a figure above it comes from another one, in-network
reduction (NVLS, SHARP) above all. Line rates make communication times lower bounds.

Note [a group's share of the NICs]: the GPUs of a node each have their own NIC, and every
group of one mesh dimension runs its collective at the same time (each rank issues the same
collective at the same point of the step). A group with ``k`` of its ranks on a node sends
and receives its node-crossing traffic through the NICs of those k GPUs, while the node's
other GPUs' NICs carry their own groups' traffic: its bus bandwidth across nodes is
``k x 50 GB/s = inter_bw x k / gpus_per_node``, set by the node where it has fewest ranks.
FSDP's ring over all N ranks has k = 8 on every node: all 8 NICs, 400 GB/s. HSDP 8 x N/8
shards within a node, so each replicate group has k = 1, one GPU per node, and the node's 8
replicate groups all-reduce at once through its 8 NICs: one NIC, 50 GB/s, each -- routing a
group through a neighbour's NIC (NCCL's PXN) frees no bandwidth, since that NIC carries its
own group's all-reduce. NCCL's tuning marks the case as well: ``ppn = nRanks / nNodes``, "if
ppn < 2, then we are sending/receiving at the same GPU through the NIC, apply some bw
discount" (src/graph/tuning.cc, ``ncclTopoTuneModel``; the discount it applies is to the
LL128 protocol, 0.7 instead of 0.92, and is not modelled here). Not modelled either: a
network oversubscribed above the leaf switches.

Note [collective time]: ``latency + wire / busbw``, with wire = (N-1)/N S for all-gather and
reduce-scatter and 2(N-1)/N S for all-reduce, S the full tensor's bytes -- nccl-tests' bus
bandwidth convention (its doc/PERFORMANCE.md), so one measured busbw serves every N and op. The
link: a group whose ranks share a node (ranks are numbered node by node) runs at ``intra_bw``;
a group that spans nodes runs at its share of ``inter_bw``, k / 8 of it with k of its ranks per
node (Note [a group's share of the NICs]): FSDP's ring 400 GB/s, only 1.1x below NVLink; HSDP's
replicate group, one rank per node, 50 GB/s. The latency is a *ring's*, as NCCL models it
(src/graph/tuning.cc, Ring/Simple, the protocol of large messages): a base of 8.4 us plus one
per-hop latency per ring step -- N-1 steps for all-gather and reduce-scatter, 2(N-1) for
all-reduce -- of which the steps that cross nodes (nodes-1, resp. 2(nodes-1)) cost 14 us (NCCL
2.18.1 and later; 2.17 charged 9.6) and the rest 3.4 us (NVLink). So a ring's latency grows
linearly with N: 4.8 ms for an all-gather over 1024 GPUs, as much as moving 1.9 GB. We model
the ring for all three ops. NCCL has only the ring for all-gather and reduce-scatter at these
sizes (PAT, its logarithmic algorithm, is for one GPU per node), but for all-reduce it may pick
a tree, whose latency grows with log2(nodes) instead (tuning.cc: 2 ((N/nodes - 1) intra +
log2(nodes) inter)) at a lower bandwidth: for HSDP's all-reduce the ring is the pessimistic
choice. Not modelled: congestion, stragglers, SHARP / NVLS in-network reductions.

Note [exposed communication at scale]: one compute stream, one communication stream, and
prefetching one unit ahead (chapter 06). Each stretch of compute hides the communication
issued beside it: in forward, block i's compute hides block i+1's all-gather; the head's
backward hides the last block's all-gather; block i's backward hides block i-1's all-gather
plus block i+1's reduce-scatter (and, for HSDP, all-reduce). What does not fit is exposed::

    exposed = first + sum over stretches of max(0, comm - compute) + last

``first``: the root's and block 0's all-gathers, which nothing precedes; ``last``: block 0's
and the root's reduce-scatters, which nothing follows. So zero communication gives step =
compute, zero compute gives step = all communication, and ``overlap=False`` (no prefetch)
exposes all of it. Limits, all optimistic: a stretch cannot lend its slack to the next
(real streams can, so the model overstates exposure of unbalanced layers, never of balanced
ones); all-gather and reduce-scatter share one link serially; the optimizer step, data
loading and stragglers are not modelled.

Note [checking the time model on gloo]: ``minifsdp.demos.comm_time`` measures gloo's latency
(a one-element collective) and bus bandwidth (an 8 MiB one) per op and times the
collectives of a real FSDP2 step, at N = 2 and 4; ``predict_messages`` gives the model's
time for each of those messages from the measured pair. gloo on one CPU has no NVLink,
network or second stream: what this checks is the collective-time law (latency + bus-
convention bytes / bandwidth, summed over a step's messages), not overlap or scale.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from minifsdp.scale import PRESETS, Transformer

LINKS = ("intra", "inter")


@dataclass(frozen=True)
class Hardware:
    """One GPU and its links (Note [hardware defaults]). FLOP/s, bytes/s, seconds."""

    peak_flops: float = 989e12
    achievable_flops: float = 794.5e12
    intra_bw: float = 450e9
    inter_bw: float = 400e9  # a node's NICs together (one per GPU)
    base_latency: float = 8.4e-6
    intra_latency: float = 3.4e-6  # per ring step on NVLink
    inter_latency: float = 14e-6  # per ring step that crosses nodes (NCCL >= 2.18.1)
    gpus_per_node: int = 8

    def bandwidth(self, level: str, per_node: int | None = None) -> float:
        """Bus bandwidth of ``"intra"`` (one node) or ``"inter"``: a group spanning nodes with
        ``per_node`` of its ranks on each (the fewest on any; default all ``gpus_per_node``)
        gets that share of a node's NICs (Note [a group's share of the NICs]).

        Example:
            >>> H100.bandwidth("inter") / 1e9, H100.bandwidth("inter", per_node=1) / 1e9
            (400.0, 50.0)
        """
        if level not in LINKS:
            raise ValueError(f"unknown link {level!r}; expected one of {LINKS}")
        if level == "intra":
            return self.intra_bw
        k = self.gpus_per_node if per_node is None else per_node
        if not 1 <= k <= self.gpus_per_node:
            raise ValueError(f"per_node={per_node}: a group has 1 to {self.gpus_per_node} "
                             "of its ranks on each node it spans")
        return self.inter_bw * k / self.gpus_per_node


H100 = Hardware()
LLAMA31_8B = Transformer(32, 4096, 32, 8, 14336, 128256, 8192)  # Llama 3.1 8B's config.json

# What torchtitan reports for FSDP2 alone (1-D) on H100s (pytorch/torchtitan
# benchmarks/llama3_h100_202412_torchtitan.md, docs/performance.md until June 2025, Tables 1 and
# 3, the tables of its paper, arXiv 2410.06511): Llama 3.1 8B, local batch size 2, selective
# activation checkpointing, no torch.compile, no Float8; tokens/s per GPU. The file does not
# state the sequence length: 8192 is seq_len in torchtitan's train_configs/llama3_8b.toml at the
# commit it lists (9dec370). Its "33% to 39% MFU" are, by its tables, without and with
# torch.compile (5,762 and 6,667 tok/s on 8 GPUs), though its sentence pairs them the other way.
PUBLISHED = [
    {"model": "Llama 3.1 8B", "gpus": 8, "micro_batch": 2, "seq_len": 8192, "tps": 5762},
    {"model": "Llama 3.1 8B", "gpus": 128, "micro_batch": 2, "seq_len": 8192, "tps": 5605},
]
PUBLISHED_URL = ("https://github.com/pytorch/torchtitan/blob/main/benchmarks/"
                 "llama3_h100_202412_torchtitan.md")
# torchtitan's 70B and 405B rows on the same H100s, all with tensor (and for 405B pipeline)
# parallelism, torch.compile and full activation checkpointing: a configuration this model does
# not describe (it covers FSDP and HSDP only), so they are drawn for reference, not compared.
# Tokens/s per GPU; "dp", "tp", "pp" the mesh's degrees; "float8": Float8 linears, for which
# torchtitan reports no MFU (two peaks). The files do not state the sequence length: 8192 is
# seq_len in torchtitan's llama3_70b.toml and llama3_405b.toml at the commits they list.
PUBLISHED_TP_PP_URLS = {
    "2024-12": PUBLISHED_URL,  # Tables 4 and 5
    "2025-06": ("https://github.com/pytorch/torchtitan/blob/main/benchmarks/"
                "asyncTP_llama3_h100_2025-06_torchtitan.md"),
}
PUBLISHED_TP_PP = [
    {"model": "70B", "gpus": 256, "dp": 32, "tp": 8, "pp": 1, "micro_batch": 16, "seq_len": 8192,
     "tps": 597.3, "float8": False, "what": "TP", "source": "2025-06"},
    {"model": "70B", "gpus": 256, "dp": 32, "tp": 8, "pp": 1, "micro_batch": 16, "seq_len": 8192,
     "tps": 652.4, "float8": False, "what": "async TP", "source": "2025-06"},
    {"model": "70B", "gpus": 256, "dp": 32, "tp": 8, "pp": 1, "micro_batch": 16, "seq_len": 8192,
     "tps": 829, "float8": True, "what": "TP", "source": "2024-12"},
    {"model": "70B", "gpus": 256, "dp": 32, "tp": 8, "pp": 1, "micro_batch": 16, "seq_len": 8192,
     "tps": 876, "float8": True, "what": "async TP", "source": "2024-12"},
    {"model": "405B", "gpus": 512, "dp": 8, "tp": 8, "pp": 8, "micro_batch": 32, "seq_len": 8192,
     "tps": 100, "float8": True, "what": "async TP, PP 1F1B", "source": "2024-12"},
    {"model": "405B", "gpus": 512, "dp": 8, "tp": 8, "pp": 8, "micro_batch": 32, "seq_len": 8192,
     "tps": 128, "float8": True, "what": "async TP, PP interleaved 1F1B", "source": "2024-12"},
]
# The Llama 3 paper (arXiv 2407.21783, Table 4): 38-43% BF16 MFU on 8K-16K H100s with 4-D
# parallelism (TP 8, CP, PP 16, FSDP) -- a reference level, not a configuration modelled here.
LLAMA3_MFU = (0.38, 0.43)


# ---- compute ---------------------------------------------------------------------------------

def _embedding_params(model: Transformer) -> int:
    pos = model.max_seq_len * model.d_model if model.style == "gpt2" else 0
    return pos + (0 if model.tie_embeddings else model.vocab_size * model.d_model)


def forward_flops_per_token(model: Transformer, seq_len: int) -> tuple[float, float]:
    """(one block, the head with the final norm): forward FLOPs per token (Note [model
    FLOPs]). Three times their sum over the model is ``flops_per_token``."""
    block = sum(math.prod(s) for s in model.block_shapes())
    head = model.num_params() - _embedding_params(model) - model.n_layer * block
    return 2 * block + 4 * model.d_model * seq_len, 2 * head


def flops_per_token(model: Transformer, seq_len: int) -> float:
    """Model FLOPs per token, forward + backward: ``6 Psi' + 12 L h s`` (Note [model FLOPs]).

    Example:
        >>> round(flops_per_token(LLAMA31_8B, 8192) / 1e9, 1)   # 6 x 7.5e9 + 12.9e9
        57.9
    """
    block, head = forward_flops_per_token(model, seq_len)
    return 3 * (model.n_layer * block + head)


# ---- communication ---------------------------------------------------------------------------

def bus_factor(op: str, n: int) -> float:
    """Wire bytes per byte of the full tensor (Note [collective time]).

    Example:
        >>> bus_factor("all_reduce", 4), bus_factor("all_gather", 4)
        (1.5, 0.75)
    """
    if op == "all_reduce":
        return 2 * (n - 1) / n
    if op in ("all_gather", "reduce_scatter"):
        return (n - 1) / n
    raise ValueError(f"unknown collective {op!r}; expected all_gather, reduce_scatter, all_reduce")


def ring_latency(op: str, n: int, nodes: int, hw: Hardware = None) -> float:
    """Seconds of latency of a ring ``op`` over ``n`` ranks on ``nodes`` nodes, NCCL's model
    (Note [collective time]): base + intra x (steps - inter steps) + inter x inter steps.

    Example:
        >>> round(ring_latency("all_gather", 1024, 128) * 1e3, 2)   # 896 NVLink + 127 network
        4.83
    """
    hw = hw or H100
    if n == 1:
        return 0.0
    k = 2 if op == "all_reduce" else 1
    steps, inter = k * (n - 1), k * (nodes - 1)
    return hw.base_latency + (steps - inter) * hw.intra_latency + inter * hw.inter_latency


def collective_time(op: str, full_bytes: float, n: int, busbw: float, latency: float) -> float:
    """Seconds for one collective over ``n`` ranks of a ``full_bytes`` tensor (S: all-gather's
    output, reduce-scatter's input, all-reduce's buffer): ``latency + bus_factor * S / busbw``;
    0 for a group of one, which sends nothing.

    Example:
        >>> collective_time("all_gather", 8e9, 8, busbw=400e9, latency=0.0)  # 7e9 B at 400 GB/s
        0.0175
    """
    if n == 1:
        return 0.0
    return latency + bus_factor(op, n) * full_bytes / busbw


def full_bytes(op: str, payload: float, n: int) -> float:
    """S from ``minifsdp.comm``'s record ``bytes`` (the input payload: all-gather's input is
    one shard, Note [bytes vs wire bytes])."""
    return payload * n if op == "all_gather" else payload


def predict_messages(messages: list[dict], latency: dict[str, float],
                     busbw: dict[str, float]) -> list[float]:
    """The model's seconds for each logged collective (``op``, ``bytes``, ``group_size``) given
    a measured latency and bus bandwidth per op (Note [checking the time model on gloo])."""
    return [collective_time(m["op"], full_bytes(m["op"], m["bytes"], m["group_size"]),
                            m["group_size"], busbw[m["op"]], latency[m["op"]])
            for m in messages]


def _span(groups: list[range], gpus_per_node: int) -> tuple[int, int]:
    """(nodes, per_node) of the slowest of ``groups`` of ranks numbered node by node: the most
    nodes one spans, and the fewest ranks one has on a node (Note [a group's share of the NICs]).

    Example:
        >>> _span([range(0, 16, 8), range(4, 16, 8)], 8)   # one rank on each of 2 nodes
        (2, 1)
    """
    nodes, per_node = 0, gpus_per_node
    for g in groups:
        counts: dict[int, int] = {}
        for r in g:
            counts[r // gpus_per_node] = counts.get(r // gpus_per_node, 0) + 1
        nodes, per_node = max(nodes, len(counts)), min(per_node, *counts.values())
    return nodes, per_node


# ---- one step --------------------------------------------------------------------------------

def schedule(model: Transformer, n_gpus: int, micro_batch: int, seq_len: int,
             hw: Hardware = H100, shard: int | None = None, param_bytes: int = 2,
             reduce_bytes: int = 4, activation_checkpointing: bool = True,
             reshard_after_forward: bool = True) -> dict:
    """The step as Note [exposed communication at scale] sees it: ``stretches`` (name, compute
    s, comm s hidden behind it), the exposed edges ``first`` and ``last``, and every
    ``collective`` (unit, op, S bytes, group size, nodes spanned, fewest ranks on a node,
    link, seconds). ``shard``:
    HSDP's shard group size (None: FSDP over all ``n_gpus``). ``param_bytes`` /
    ``reduce_bytes``: bytes per element of the all-gathers and of the gradient reductions --
    the defaults are bf16 parameters with an fp32 reduce, chapter 07's advice and torchtitan's
    default (``mixed_precision_reduce = "float32"``, torchtitan/config/job_config.py); pass
    ``reduce_bytes=2`` for a bf16 reduce, 4 and 4 for fp32 training."""
    s_deg = n_gpus if shard is None else shard
    if s_deg < 1 or n_gpus % s_deg:
        raise ValueError(f"shard={shard}: must divide the {n_gpus} GPUs into equal groups")
    r_deg, gpn = n_gpus // s_deg, hw.gpus_per_node
    # ranks are numbered node by node: a shard group is s_deg consecutive ranks, a replicate
    # group every s_deg-th one; all groups of a kind run at once, sharing the nodes' NICs
    # (Note [a group's share of the NICs])
    shard_span = _span([range(g * s_deg, (g + 1) * s_deg) for g in range(r_deg)], gpn)
    rep_span = _span([range(j, n_gpus, s_deg) for j in range(s_deg)], gpn)
    colls: list[dict] = []

    def coll(unit: str, op: str, numel: int, n: int, span: tuple[int, int]) -> float:
        size = (param_bytes if op == "all_gather" else reduce_bytes) * numel
        nodes, per_node = span
        link = "intra" if nodes == 1 else "inter"
        t = collective_time(op, size, n, hw.bandwidth(link, per_node if nodes > 1 else None),
                            ring_latency(op, n, nodes, hw))
        colls.append({"unit": unit, "op": op, "bytes": size, "n": n, "nodes": nodes,
                      "per_node": per_node, "link": link, "seconds": t})
        return t

    root, block = (sum(math.prod(s) for s in u) for u in model.units()[:2])

    def ag(unit: str) -> float:
        return coll(unit, "all_gather", root if unit == "root" else block, s_deg, shard_span)

    def rs(unit: str) -> float:  # HSDP: reduce-scatter in the node, all-reduce the 1/S slice
        numel = root if unit == "root" else block
        t = coll(unit, "reduce_scatter", numel, s_deg, shard_span)
        return t + (coll(unit, "all_reduce", numel // s_deg, r_deg, rep_span) if r_deg > 1 else 0)

    tokens, rate = micro_batch * seq_len, hw.achievable_flops
    f_block, f_head = (tokens * f / rate for f in forward_flops_per_token(model, seq_len))
    b_block = (3 if activation_checkpointing else 2) * f_block  # recompute + backward
    blocks = [f"blocks.{i}" for i in range(model.n_layer)]
    first = ag("root") + ag(blocks[0])
    stretches = [(f"forward {b}", f_block, ag(blocks[i + 1]) if i + 1 < len(blocks) else 0.0)
                 for i, b in enumerate(blocks)]
    stretches.append(("forward head", f_head, 0.0))
    last_ag = ag(blocks[-1]) if reshard_after_forward else 0.0
    stretches.append(("backward head", 2 * f_head, last_ag))
    for i in reversed(range(len(blocks))):
        comm = ag(blocks[i - 1]) if reshard_after_forward and i > 0 else 0.0
        comm += rs(blocks[i + 1]) if i + 1 < len(blocks) else 0.0
        stretches.append((f"backward {blocks[i]}", b_block, comm))
    last = rs(blocks[0]) + rs("root")
    return {"stretches": stretches, "first": first, "last": last, "collectives": colls}


def exposed_time(stretches: list[tuple[str, float, float]], first: float, last: float) -> float:
    """``first + sum(max(0, comm - compute)) + last`` (Note [exposed communication at scale]).

    Example:
        >>> exposed_time([("a", 2.0, 1.0), ("b", 1.0, 3.0)], first=0.5, last=0.25)
        2.75
    """
    return first + sum(max(0.0, comm - compute) for _, compute, comm in stretches) + last


def step_time(model: Transformer, n_gpus: int, micro_batch: int, seq_len: int,
              hw: Hardware = H100, shard: int | None = None, param_bytes: int = 2,
              reduce_bytes: int = 4, activation_checkpointing: bool = True,
              reshard_after_forward: bool = True, overlap: bool = True) -> dict[str, float]:
    """Seconds of one step (one micro-batch of ``micro_batch x seq_len`` tokens per GPU) and
    what follows from them. Keys: compute, comm (every collective's time), exposed, step
    (= compute + exposed), mfu (model FLOPs / (step x peak)), tokens_per_s (per GPU),
    comm_intra / comm_inter (seconds on each link).

    Example:
        >>> t = step_time(PRESETS["7B"], 8, 1, 4096)    # one node: NVLink hides the middle
        >>> round(t["mfu"], 3)   # full checkpointing: 6/8 of 794.5/989, less the edges
        0.595
    """
    plan = schedule(model, n_gpus, micro_batch, seq_len, hw, shard, param_bytes, reduce_bytes,
                    activation_checkpointing, reshard_after_forward)
    compute = sum(c for _, c, _ in plan["stretches"])
    comm = sum(c["seconds"] for c in plan["collectives"])
    exposed = (exposed_time(plan["stretches"], plan["first"], plan["last"]) if overlap
               else comm)
    step = compute + exposed
    tokens = micro_batch * seq_len
    return {"compute": compute, "comm": comm, "exposed": exposed, "step": step,
            "mfu": flops_per_token(model, seq_len) * tokens / (step * hw.peak_flops),
            "tokens_per_s": tokens / step,
            **{f"comm_{lv}": sum(c["seconds"] for c in plan["collectives"] if c["link"] == lv)
               for lv in LINKS}}


def published_mfu(row: dict, model: Transformer = LLAMA31_8B, hw: Hardware = H100) -> float:
    """A published tokens/s per GPU as MFU, with this module's FLOPs and ``hw.peak_flops``."""
    return row["tps"] * flops_per_token(model, row["seq_len"]) / hw.peak_flops


__all__ = ["H100", "LLAMA31_8B", "LLAMA3_MFU", "PRESETS", "PUBLISHED", "PUBLISHED_TP_PP",
           "PUBLISHED_TP_PP_URLS", "PUBLISHED_URL", "Hardware",
           "bus_factor", "collective_time", "exposed_time", "flops_per_token",
           "forward_flops_per_token", "full_bytes", "predict_messages", "published_mfu",
           "ring_latency",
           "schedule", "step_time"]
