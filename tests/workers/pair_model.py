"""``Pair``, the small net of the FSDP2 workers that shard modules in groups of their own
choosing (``fsdp2_multi_worker.py``, ``fsdp2_custom_comm_worker.py``).

``(B, 8) -> (B, 4)``. Its shapes are chosen for the shards: ``emb`` has 10 rows (uneven at
N = 3: 4, 4, 2) and ``head`` 4 (at N = 3: 2, 2 and an empty shard), so every group meets
padding, and one an empty shard.
"""

import torch
import torch.nn as nn


class Pair(nn.Module):
    """``emb``, two ``blocks``, a ``norm`` and a ``head``; ``tanh`` between them."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Linear(8, 10)
        self.blocks = nn.ModuleList([nn.Linear(10, 10), nn.Linear(10, 10)])
        self.norm = nn.LayerNorm(10)
        self.head = nn.Linear(10, 4)

    def forward(self, x):
        h = torch.tanh(self.emb(x))
        for block in self.blocks:
            h = torch.tanh(block(h))
        return self.head(self.norm(h))
