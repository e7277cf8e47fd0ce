"""Sharded checkpoints: save, crash, resume bit for bit, reshard, export (chapter 08).

    save_checkpoint("runs/ck", model, opt, step=40)   # -> runs/ck/step_000040, runs/ck/latest
    info = load_checkpoint("runs/ck", model, opt)     # the latest: {"step": 40, ...}
    full = export_full_state_dict("runs/ck", "gpt.pt")  # offline, one process, plain tensors

Every rank calls ``save_checkpoint`` / ``load_checkpoint`` (they are collectives), with the
directory on a filesystem every rank sees (shared across nodes). Built on
``torch.distributed.checkpoint`` (DCP) and ``get_state_dict`` / ``set_state_dict``, so it takes
``fsdp2`` and ``torch_fsdp2`` (DTensor shards), ``torch_fsdp1`` (its sharded state dict), and
the replicated ``single``, ``ddp``, ``bucketed_ddp`` and ``torch_ddp``; ``zero1``/``zero2``/
``fsdp1`` raise ``NotImplementedError`` (``_check_supported`` says why and what to use).

Note [sharded vs full state dicts]: a *full* state dict is the whole model as plain tensors:
every parameter all-gathered, then one process writes everything -- the full model's bytes in
one rank's memory and through one writer. A *sharded* one is what ``model.state_dict()``
returns under FSDP2 (Note [state dicts] in ``fsdp2/api.py``): DTensors whose local rows are
already on the rank, so each rank writes its own rows, in parallel, and no tensor data crosses
the network: only DCP's planning is collective (``_save_state_dict`` in torch's
state_dict_saver.py gathers the local plans on the coordinator and scatters the global plan
back, ``_DistWrapper.reduce_scatter``, then gathers the write results for ``.metadata``,
``_DistWrapper.all_reduce``: small pickled objects). Replicated tensors (DDP's parameters,
Adam's ``step``) are the same on every rank: DCP writes each once, on the rank with the fewest
bytes planned so far.

Note [what DCP stores]: ``dcp.save`` writes, per rank r, ``__r_0.distcp`` (its chunks, byte
after byte) and, from rank 0 after every rank reported what it wrote, ``.metadata``: for each
flattened key (``model.blocks.0.attn.qkv.weight``, ``optim.state.<same>.exp_avg``, ...) the
global shape, dtype and chunks (offsets, sizes), and where each chunk's bytes are (file,
offset, length). We add ``rank{r}_rng.pt`` (that rank's random generators) and, last,
``manifest.json`` (step, world size, every file's size, the caller's ``extra``).

Note [atomic save]: a crash half-way through a save must never cost the last good checkpoint.
So ranks write into ``step_000040.tmp``; after a barrier, rank 0 writes the manifest, renames
the directory to ``step_000040`` (a rename is atomic) and only then repoints ``latest``
(written to ``latest.tmp``, fsynced, ``os.replace``-d). A crash before the rename leaves a
``.tmp`` directory that no reader looks at (the next save deletes it); ``latest`` still names
the previous step. Saving a step that already exists (a resumed run) first moves the old one
to ``step_000040.old``; a crash between that rename and the next leaves ``latest`` naming a
missing directory, so ``find_checkpoint`` then takes ``step_000040.old``, the last good one
(the next save deletes it). The ``keep`` newest step directories are kept. A load checks first:
manifest present and parseable, every listed file present with its recorded size, ``.metadata``
readable -- on rank 0, which broadcasts the verdict, so every rank raises the same
``CheckpointError`` instead of some ranks waiting in a collective for the others. (Sizes catch
truncation, not flipped bits: DCP keeps no checksums. Bytes that no longer unpickle fail in
DCP's read, which DCP reports to every rank.)

Note [resharding]: DCP loads into the tensors the *current* model has. A DTensor says which
rows this rank needs (its ``Shard(0)`` chunk of the global shape); torch's own
``DefaultLoadPlanner`` already reshards: ``create_read_items_for_chunk_list``
(planner_helpers.py) intersects it with the chunks in ``.metadata``, one ``ReadItem`` per
overlap (``ReshardingLoadPlanner`` below re-derives the same reads for dim-0 shards, for lab
08). ``FileSystemReader.read_data`` (filesystem.py) then reads, per ``ReadItem``, the stored
chunk's whole byte range, ``torch.load``s it and narrows it to the overlap: a rank reads every
saved chunk that overlaps its rows in full, not only the overlapping bytes. ``chunk_dim0`` is
``torch.chunk``, DTensor's own rule, so the stored chunks are what DCP expects
(tests/test_checkpoint.py checks the offsets). (10, 8) saved at N = 4 is rows 0-2 | 3-5 | 6-8 |
9; at N = 3 rank 1 needs rows 4-7: rows 4-5 from ``__1_0.distcp``, 6-7 from ``__2_0.distcp``.
Adam's ``exp_avg`` is a DTensor laid out like its parameter, so it reshards the same way; a
plain (DDP) tensor loads into a DTensor and back, i.e. a checkpoint also switches strategies.

Note [bitwise resume]: the resumed run is the uninterrupted one, bit for bit, when it restores
(1) parameters and optimizer state, Adam's ``step`` included (its bias correction), (2) the
data position: step s is batch ``s mod E`` of epoch ``s // E`` (E batches an epoch; each epoch
reshuffles with ``seed + epoch``), so ``rank_loader(start_batch=...)`` skips to it without
loading the skipped batches, and (3) every rank's random generators (dropout; a DataLoader's
base seed). (3) holds only at the same world size: at another N the rank files do not map to
the new ranks and the global batches are split differently, so a resharded run continues the
same training -- same weights, same optimizer state, same samples per epoch -- not the same bits.
"""

from __future__ import annotations

import dataclasses
import json
import os
import random
import re
import shutil
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn as nn
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import MetadataIndex, TensorStorageMetadata
from torch.distributed.checkpoint.planner import LoadItemType, ReadItem
from torch.distributed.checkpoint.planner_helpers import _create_chunk_list
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_state_dict,
)

FORMAT = "minifsdp-checkpoint/1"
MANIFEST, LATEST = "manifest.json", "latest"
STEP_DIR = re.compile(r"step_(\d+)")


class CheckpointError(RuntimeError):
    """A checkpoint is missing, incomplete or corrupt; the message names the path and what."""


# ---- save -----------------------------------------------------------------------------------

def save_checkpoint(path: str | os.PathLike, model: nn.Module,
                    optimizer: torch.optim.Optimizer | None, *, step: int,
                    extra: dict | None = None, keep: int | None = 2,
                    before_commit: Callable[[Path], None] | None = None) -> Path:
    """Save a sharded checkpoint as ``<path>/step_{step:06d}`` and point ``<path>/latest`` at
    it (Note [atomic save]); call on every rank. Returns the step directory.

    Args:
        extra: JSON-serialisable data stored in the manifest (e.g. the run's configuration).
        keep: how many step directories to keep (the highest steps); ``None`` keeps all.
        before_commit: called on every rank once the files are written, before the rename
            (tests crash there: ``--kill-during-save`` in ``minifsdp.train``).

    Example: ``save_checkpoint("runs/ck", model, opt, step=40)`` writes
    ``runs/ck/step_000040/{.metadata, __0_0.distcp, __1_0.distcp, rank0_rng.pt, rank1_rng.pt,
    manifest.json}`` at N = 2 and ``runs/ck/latest`` = ``step_000040``.
    """
    _check_supported(model, optimizer)
    root = Path(path)
    final, tmp = root / f"step_{step:06d}", root / f"step_{step:06d}.tmp"
    rank, world = _rank(), _world()

    def prepare():
        root.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)  # a crashed save of this very step
        tmp.mkdir()

    _on_rank0(prepare)
    with open(tmp / f"rank{rank}_rng.pt", "wb") as f:
        torch.save(rng_state(), f)
        f.flush()
        os.fsync(f.fileno())  # as DCP does its own files (FileSystemWriter(sync_files=True))
    try:
        dcp.save(_state_dict(model, optimizer), checkpoint_id=tmp)
    except CheckpointException as e:  # a write failed (on any rank): raised on every rank
        raise CheckpointError(f"{tmp}: DCP could not save: {_reason(e)}") from e
    if before_commit is not None:
        before_commit(tmp)
    if world > 1:
        dist.barrier()  # every rank's files are complete

    def commit():
        files = {f.name: f.stat().st_size for f in sorted(tmp.iterdir())}
        manifest = {"format": FORMAT, "step": step, "world_size": world,
                    "strategy": (extra or {}).get("strategy", type(model).__name__),
                    "torch": torch.__version__, "files": files, "extra": extra or {}}
        _write_atomic(tmp / MANIFEST, json.dumps(manifest, indent=1))
        aside = root / f"{final.name}.old"
        if final.exists():  # saving a step again (a resumed run): move the old one aside
            shutil.rmtree(aside, ignore_errors=True)
            os.rename(final, aside)
        os.rename(tmp, final)
        _write_atomic(root / LATEST, final.name + "\n")
        shutil.rmtree(aside, ignore_errors=True)
        for stale in root.glob("step_*.tmp"):  # crashed saves of other steps
            shutil.rmtree(stale, ignore_errors=True)
        steps = sorted((p for p in root.iterdir() if STEP_DIR.fullmatch(p.name)),
                       key=lambda p: int(STEP_DIR.fullmatch(p.name)[1]))
        for old in steps[:-keep] if keep else []:
            if old != final:
                shutil.rmtree(old)

    _on_rank0(commit)
    return final


# ---- validate and load ----------------------------------------------------------------------

def find_checkpoint(path: str | os.PathLike) -> Path:
    """``path`` itself if it is a step directory, else the one its ``latest`` file names (or
    that one's ``.old`` copy, if a re-save of the same step crashed: Note [atomic save])."""
    path = Path(path)
    pointer = path / LATEST
    if pointer.is_file():
        name = pointer.read_text().strip()
        if (path / name).is_dir():
            return path / name
        if (path / f"{name}.old").is_dir():  # a re-save crashed between its renames
            return path / f"{name}.old"          # (Note [atomic save])
        raise CheckpointError(f"{pointer} names {name!r}, which does not exist in {path}")
    if path.is_dir() and ((path / MANIFEST).exists() or (path / ".metadata").exists()
                          or any(path.glob("*.distcp")) or STEP_DIR.match(path.name)):
        return path  # validate() says what is wrong with it, if anything
    if path.is_dir():
        raise CheckpointError(f"{path}: neither a checkpoint (no {MANIFEST}) nor a checkpoint "
                              f"directory (no {LATEST} file)")
    raise CheckpointError(f"{path}: no such checkpoint (the path does not exist)")


def validate(path: str | os.PathLike) -> dict:
    """Check a step directory without loading it; return its manifest.

    Raises ``CheckpointError`` for: no manifest (an interrupted save, or not ours), an
    unreadable manifest, a listed file missing or of another size (truncated, overwritten),
    an unreadable ``.metadata``. Local file checks only: no process group needed. A
    completeness check, not a content check: sizes, not checksums, so a file rewritten with
    other bytes of the same length passes.
    """
    path = Path(path)
    file = path / MANIFEST
    if not file.exists():
        raise CheckpointError(f"{path}: no {MANIFEST}: the save did not finish (it is written "
                              "last) or this is not a minifsdp checkpoint")
    try:
        manifest = json.loads(file.read_text())
        files, step, world = manifest["files"], manifest["step"], manifest["world_size"]
    except (ValueError, KeyError, TypeError) as e:
        raise CheckpointError(f"{file}: unreadable manifest ({type(e).__name__}: {e})") from e
    if manifest.get("format") != FORMAT:
        raise CheckpointError(f"{file}: format {manifest.get('format')!r}, expected {FORMAT!r}")
    for name, size in files.items():
        f = path / name
        if not f.is_file():
            raise CheckpointError(f"{path}: {name} is missing (the manifest lists it; step "
                                  f"{step}, saved by {world} ranks)")
        if f.stat().st_size != size:
            raise CheckpointError(f"{path}: {name} has {f.stat().st_size} bytes, the manifest "
                                  f"says {size} (truncated or overwritten)")
    if ".metadata" not in files:
        raise CheckpointError(f"{path}: the manifest lists no DCP .metadata")
    try:
        dcp.FileSystemReader(path).read_metadata()
    except Exception as e:
        raise CheckpointError(f"{path}/.metadata is unreadable ({type(e).__name__}: {e})") from e
    return manifest


def load_checkpoint(path: str | os.PathLike, model: nn.Module,
                    optimizer: torch.optim.Optimizer | None = None) -> dict:
    """Load a checkpoint (a step directory, or a root's ``latest``) into ``model`` and
    ``optimizer`` in place, at any world size (Note [resharding]); call on every rank.

    Returns ``{"step", "extra", "path", "world_size" (the saving run's), "rng_restored"}``.
    Raises ``CheckpointError`` on every rank if the checkpoint is incomplete or corrupt.

    Example: ``load_checkpoint("runs/ck", model, opt)["step"]`` -> ``40``.
    """
    _check_supported(model, optimizer)

    def check():
        found = find_checkpoint(path)
        return found, validate(found)

    ckpt, manifest = _on_rank0(check)
    state = _state_dict(model, optimizer)
    try:
        # a read failing on one rank raises on all
        dcp.load(state, checkpoint_id=ckpt, planner=ReshardingLoadPlanner())
    except (Exception, CheckpointException) as e:  # the latter is a BaseException
        raise CheckpointError(f"{ckpt}: DCP could not load it into this "
                              f"{type(model).__name__}: {_reason(e)}") from e
    target = _unwrap(model)
    if optimizer is None:
        set_model_state_dict(target, state["model"])
    else:
        set_state_dict(target, optimizer, model_state_dict=state["model"],
                       optim_state_dict=state["optim"])
    same_world = manifest["world_size"] == _world()
    if same_world:
        set_rng_state(torch.load(ckpt / f"rank{_rank()}_rng.pt", weights_only=True))
    return {"step": manifest["step"], "extra": manifest["extra"], "path": ckpt,
            "world_size": manifest["world_size"], "rng_restored": same_world}


def rows_to_read(d0: int, world_size: int, rank: int,
                 saved: list[tuple[int, int]]) -> list[tuple[int, int, int]]:
    """Which rows ``rank`` of ``world_size`` loads from which saved chunk, for a tensor of
    ``d0`` rows sharded on dim 0 (Note [resharding]). ``saved``: each saved chunk's global rows
    ``(start, stop)``, in ``.metadata`` order. Returns ``[(chunk, start, stop), ...]`` in row
    order: the global rows ``[start, stop)`` of saved chunk ``chunk`` that fall in this rank's
    ``chunk_dim0`` rows (``torch.chunk``: ``ceil(d0 / N)`` each, the last ones shorter or empty).

    Example: ``rows_to_read(10, 3, 1, [(0, 3), (3, 6), (6, 9), (9, 10)])`` ->
    ``[(1, 4, 6), (2, 6, 8)]`` (Note [resharding]'s example).
    """
    per = -(-d0 // world_size)
    lo, hi = min(rank * per, d0), min((rank + 1) * per, d0)
    reads = []
    for i, (a, b) in sorted(enumerate(saved), key=lambda x: x[1]):
        if min(hi, b) > max(lo, a):
            reads.append((i, max(lo, a), min(hi, b)))
    return reads


class ReshardingLoadPlanner(dcp.DefaultLoadPlanner):
    """DCP's default load planner, except that the reads of a tensor sharded on dim 0 (FSDP2's
    ``Shard(0)`` DTensors, their Adam state) come from ``rows_to_read`` (Note [resharding]);
    the same reads DCP's own sweep makes, so loads are unchanged."""

    def create_local_plan(self):
        plan = super().create_local_plan()
        default: dict[str, list[ReadItem]] = {}
        for item in plan.items:
            default.setdefault(item.dest_index.fqn, []).append(item)
        items = []
        for fqn, obj in self.state_dict.items():
            reads = self._row_reads(fqn, obj)
            items += default.get(fqn, []) if reads is None else reads
        return dataclasses.replace(plan, items=items)

    def _row_reads(self, fqn: str, obj: Any) -> list[ReadItem] | None:
        from torch.distributed.tensor import DTensor, Shard

        md = self.metadata.state_dict_metadata.get(fqn)
        if not (isinstance(obj, DTensor) and obj.device_mesh.ndim == 1 and obj.dim() > 0
                and obj.placements == (Shard(0),) and isinstance(md, TensorStorageMetadata)
                and obj.device_mesh.get_coordinate() is not None
                and all(list(c.sizes[1:]) == list(md.size[1:]) for c in md.chunks)):
            return None
        saved = [(c.offsets[0], c.offsets[0] + c.sizes[0]) for c in md.chunks]
        n, rank = obj.device_mesh.size(), obj.device_mesh.get_local_rank()
        [local] = _create_chunk_list(obj)  # this rank's rows, as DTensor placed them
        lo, rest = local.offsets[0], [0] * (obj.dim() - 1)
        dest = MetadataIndex(fqn, local.offsets, 0)
        # seam "checkpoint.rows_to_read" (lab 08)
        return [ReadItem(type=LoadItemType.TENSOR, dest_index=dest,
                         dest_offsets=torch.Size([a - lo, *rest]),
                         storage_index=MetadataIndex(fqn, md.chunks[i].offsets, i),
                         storage_offsets=torch.Size([a - saved[i][0], *rest]),
                         lengths=torch.Size([b - a, *md.size[1:]]))
                for i, a, b in rows_to_read(md.size[0], n, rank, saved)]


def export_full_state_dict(checkpoint_path: str | os.PathLike,
                           out_file: str | os.PathLike | None = None) -> dict[str, torch.Tensor]:
    """The model's full parameters from a checkpoint, as plain CPU tensors under the model's
    own names (no optimizer state read); saved with ``torch.save`` to ``out_file`` if given.
    Offline: one process, no process group, any saving world size.

    Example::

        export_full_state_dict("runs/ck", "gpt.pt")
        GPT(cfg).load_state_dict(torch.load("gpt.pt"))     # a plain one-process model
    """
    ckpt = find_checkpoint(checkpoint_path)
    validate(ckpt)
    meta = dcp.FileSystemReader(ckpt).read_metadata()
    full = {k.removeprefix("model."): torch.empty(m.size, dtype=m.properties.dtype)
            for k, m in meta.state_dict_metadata.items()
            if k.startswith("model.") and isinstance(m, TensorStorageMetadata)}
    with warnings.catch_warnings():  # "torch.distributed is disabled": yes, on purpose
        warnings.filterwarnings("ignore", "torch.distributed is disabled")
        dcp.load({"model": full}, checkpoint_id=ckpt, no_dist=True)
    if out_file is not None:
        torch.save(full, out_file)
    return full


def rank_bytes(path: str | os.PathLike, rank: int) -> int:
    """Bytes rank ``rank`` wrote into a step directory: its ``__rank_*.distcp`` and RNG file."""
    path = Path(path)
    return sum(f.stat().st_size for f in [*path.glob(f"__{rank}_*.distcp"),
                                          *path.glob(f"rank{rank}_rng.pt")])


# ---- random generators ----------------------------------------------------------------------

def rng_state() -> dict[str, Any]:
    """This process's generators: torch CPU, the current CUDA device's (if used), Python's."""
    state = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


# ---- helpers --------------------------------------------------------------------------------

def _check_supported(model: nn.Module, optimizer: torch.optim.Optimizer | None) -> None:
    from minifsdp.fsdp1 import FullyShardedDataParallel
    from minifsdp.zero import ZeroOptimizer

    if isinstance(optimizer, ZeroOptimizer):
        raise NotImplementedError(
            "minifsdp.checkpoint: ZeRO-1/2 (minifsdp.zero) keep the optimizer state as one "
            "flat 1-D slice per bucket, with no parameter names for DCP to map; checkpoint "
            "with --strategy fsdp2 or torch_fsdp2 (sharded) or ddp / torch_ddp (replicated)")
    if isinstance(model, FullyShardedDataParallel):
        raise NotImplementedError(
            "minifsdp.checkpoint: minifsdp.fsdp1's state_dict() is a full (all-gathered) one "
            "and its FlatParameter shards carry no DTensor layout for DCP; use --strategy "
            "fsdp2 or torch_fsdp2 (or torch_fsdp1), or fsdp1.full_state_dict for a full copy")


def _unwrap(model: nn.Module) -> nn.Module:
    """Our DDP wrappers hold the model as ``.module``: save its own names (torch's DDP
    ``get_state_dict`` unwraps itself)."""
    from minifsdp.ddp import BucketedDDP, NaiveDDP

    return model.module if isinstance(model, (NaiveDDP, BucketedDDP)) else model


def _state_dict(model: nn.Module, optimizer: torch.optim.Optimizer | None) -> dict:
    """``{"model": ..., "optim": ...}`` keyed by parameter names, DTensors where sharded.
    A fresh optimizer gets its state created first (a step with zero gradients and lr 0)."""
    if optimizer is None:
        return {"model": get_model_state_dict(_unwrap(model))}
    msd, osd = get_state_dict(_unwrap(model), optimizer)
    return {"model": msd, "optim": osd}


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _world() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


def _on_rank0(fn: Callable[[], Any]) -> Any:
    """Run ``fn`` on rank 0 and broadcast its result, or its error: then every rank raises
    the same ``CheckpointError`` (no rank left waiting in a collective)."""
    result, error = None, None
    if _rank() == 0:
        try:
            result = fn()
        except Exception as e:  # noqa: BLE001 -- any failure must reach every rank
            error = str(e) if isinstance(e, CheckpointError) else f"{type(e).__name__}: {e}"
    if _world() > 1:
        box = [result, error]
        dist.broadcast_object_list(box, src=0)
        result, error = box
    if error is not None:
        raise CheckpointError(error)
    return result


def _reason(e: BaseException) -> str:
    """One line per failing rank (DCP's ``CheckpointException`` carries every traceback)."""
    if isinstance(e, CheckpointException):
        return "; ".join(f"rank {r}: {_reason(exc)}" for r, (exc, _) in sorted(
            e.failures.items()))
    line = (str(e).strip().splitlines() or [""])[0]
    return f"{type(e).__name__}: {line[:120] + '...' if len(line) > 120 else line}"


def _write_atomic(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` so that a reader sees the old file or the new, never half."""
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(fd)  # the rename itself is durable
    finally:
        os.close(fd)
