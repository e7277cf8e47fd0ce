"""Data for the series: real MNIST shipped in ``data/MNIST``, and a synthetic token corpus.

MNIST: the four ``.gz`` files are committed; on first use they are decompressed into
``data/MNIST/raw/`` (git-ignored), each checked against ``data/MNIST/SHA256SUMS.raw``, and read
by ``read_idx`` -- the same tensors ``torchvision.datasets.MNIST(download=False)`` gives
(tested), without importing torchvision, which costs every rank of every job about 2 s of CPU.
Ranks see disjoint shards through ``DistributedSampler``.

Note [same global batch]: data parallelism is only "the same training" as one process if,
at every step, the union of the N rank-local batches *is* the single process's batch.
``DistributedSampler`` gives rank r the indices ``perm[r::N]``; ``global_batch_loader`` below
builds exactly that union for a single process, so ``--strategy single`` can be compared
with N-rank runs number for number.

Tokens: ``MarkovTokens`` samples sequences from a fixed random Markov chain. Unlike random
tokens it has structure to learn, and unlike a text file its best achievable loss is known
in closed form (the chain's entropy rate), so a loss curve can be judged against a floor.

Note [a cached corpus]: sampling the chain draws one exponential per (sequence, vocabulary entry)
at every position (``torch.multinomial``'s one-sample path is an argmax of p / Exp(1)): 2 s of
CPU for the chapters' 4096 sequences x 512 tokens x 32 positions, in every rank of every job. The
sequences are a pure function of the arguments, so the first job saves them to
``data/cache/`` (git-ignored) and later ones load them. A cached file is trusted only if its
first two positions equal ones sampled afresh from the same generator (one position's draws,
1/32 of the cost), which catches a torch whose sampler draws differently; anything else
(missing, unreadable, another shape) is sampled again and replaced. The file is written under
a private name and renamed into place, so ranks racing on a cold cache never read half a file.
"""

from __future__ import annotations

import gzip
import hashlib
import math
import os
import re
import zlib
from pathlib import Path

import torch
from torch.utils.data import DataLoader, Dataset, DistributedSampler, TensorDataset

MNIST_FILES = ("train-images-idx3-ubyte", "train-labels-idx1-ubyte",
               "t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte")
MNIST_MEAN, MNIST_STD = 0.1307, 0.3081  # the tutorial's normalisation constants


def data_root() -> Path:
    """``$MINIFSDP_DATA`` or the checkout's ``data/`` folder."""
    env = os.environ.get("MINIFSDP_DATA")
    return Path(env) if env else Path(__file__).resolve().parent.parent / "data"


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def prepare_mnist(root: Path | None = None) -> Path:
    """Decompress and verify the MNIST files once; return the folder torchvision reads.

    Safe to call from every rank at once: each file is written to a private temporary name
    and renamed into place, and a file already in place is only re-verified.

    Raises:
        FileNotFoundError: a ``.gz`` file or the checksum list is missing (names the file).
        ValueError: a file does not match its sha256 (names the file, expected and actual).
    """
    root = root or data_root()
    src, raw = root / "MNIST", root / "MNIST" / "raw"
    sums_file = src / "SHA256SUMS.raw"
    if not sums_file.exists():
        raise FileNotFoundError(f"MNIST checksum list missing: {sums_file}")
    sums = dict(reversed(line.split()) for line in sums_file.read_text().splitlines() if line)
    raw.mkdir(parents=True, exist_ok=True)
    for name in MNIST_FILES:
        out, gz = raw / name, src / f"{name}.gz"
        if not out.exists():
            if not gz.exists():
                raise FileNotFoundError(f"MNIST file missing: {gz} (the repository ships it)")
            tmp = raw / f".{name}.{os.getpid()}.tmp"
            try:
                with gzip.open(gz, "rb") as f_in, open(tmp, "wb") as f_out:
                    while block := f_in.read(1 << 20):
                        f_out.write(block)
            # gzip.BadGzipFile is an OSError (bad header, CRC), EOFError a truncated file, and
            # zlib.error a corrupted deflate stream: the same fault for a reader, one message.
            except (OSError, EOFError, zlib.error) as e:
                tmp.unlink(missing_ok=True)
                raise ValueError(f"MNIST file {gz} is corrupted and cannot be decompressed: "
                                 f"{e}") from e
            except BaseException:  # Ctrl-C halfway: leave no half-written temporary behind
                tmp.unlink(missing_ok=True)
                raise
            tmp.replace(out)
        # Hashing 55 MB costs seconds in every worker of every run: remember a verified file by
        # its size and mtime, so only a file that changed since its check is hashed again.
        stamp, st = raw / f".{name}.verified", out.stat()
        key = f"{sums[name]} {st.st_size} {st.st_mtime_ns}"
        if stamp.exists() and stamp.read_text() == key:
            continue
        actual = _sha256(out)
        if actual != sums[name]:
            out.unlink(missing_ok=True)  # never leave a bad file for the next run to trust
            raise ValueError(f"MNIST file {gz} failed its checksum: decompressed sha256 is "
                             f"{actual}, expected {sums[name]} (see {sums_file})")
        tmp = raw / f".{name}.{os.getpid()}.stamp"
        tmp.write_text(key)
        tmp.replace(stamp)
    return root


def mnist(train: bool = True, root: Path | None = None) -> TensorDataset:
    """MNIST as a ``TensorDataset`` of normalised images ``(N, 1, 28, 28)`` float32 and labels
    ``(N,)`` int64 (N = 60,000 train / 10,000 test).

    Read by ``read_idx`` and normalised once up front: per-sample transforms in Python would
    dominate a step of this small model on CPU.

    Example:
        >>> ds = mnist(train=False)
        >>> ds[0][0].shape, ds.tensors[1][:5].tolist()
        (torch.Size([1, 28, 28]), [7, 2, 1, 0, 4])
    """
    raw = prepare_mnist(root) / "MNIST" / "raw"
    split = "train" if train else "t10k"
    pixels = read_idx(raw / f"{split}-images-idx3-ubyte", ndim=3)
    labels = read_idx(raw / f"{split}-labels-idx1-ubyte", ndim=1)
    images = (pixels.unsqueeze(1).float() / 255.0 - MNIST_MEAN) / MNIST_STD
    return TensorDataset(images, labels.long())


def read_idx(path: Path, ndim: int) -> torch.Tensor:
    """An IDX file of unsigned bytes (MNIST's format) as a uint8 tensor of ``ndim`` dimensions.

    The format (LeCun's MNIST page): two zero bytes, the type code 0x08 (unsigned byte), the
    number of dimensions, each dimension as a big-endian uint32, then the data in C order.

    Raises:
        ValueError: the header is not that of a uint8 IDX file of ``ndim`` dimensions, or the
            data's length disagrees with it (names the file).

    Example:
        >>> read_idx(prepare_mnist() / "MNIST" / "raw" / "t10k-labels-idx1-ubyte", 1)[:3]
        tensor([7, 2, 1], dtype=torch.uint8)
    """
    data = Path(path).read_bytes()
    head = 4 + 4 * ndim
    if len(data) < head or data[:4] != bytes((0, 0, 0x08, ndim)):
        raise ValueError(f"{path} is not an IDX file of unsigned bytes with {ndim} dimensions "
                         f"(header {data[:4].hex()}, expected 000008{ndim:02x})")
    shape = [int.from_bytes(data[4 + 4 * i:8 + 4 * i], "big") for i in range(ndim)]
    if len(data) - head != math.prod(shape):
        raise ValueError(f"{path}: header says {shape} = {math.prod(shape)} bytes of data, the "
                         f"file has {len(data) - head}")
    return torch.frombuffer(bytearray(data), dtype=torch.uint8, offset=head).view(shape)


class MarkovTokens(Dataset):
    """Token sequences from a fixed random first-order Markov chain.

    Every token has ``branching`` possible successors with random probabilities, so a model
    can learn to predict the next token, but never below the chain's entropy rate
    (``self.entropy_rate`` nats/token, the loss floor).

    Items: ``(x, y)`` int64 tensors of shape ``(seq_len,)``; ``y`` is ``x`` shifted by one.
    ``cache``: the folder the sequences are kept in between jobs, ``data/cache/`` by default
    (Note [a cached corpus]); the dataset is the same with or without it.

    Example:
        >>> ds = MarkovTokens(vocab_size=64, seq_len=16, num_seqs=8)
        >>> x, y = ds[0]
        >>> x.shape, bool((x[1:] == y[:-1]).all()), round(ds.entropy_rate, 3)
        (torch.Size([16]), True, 1.282)
    """

    def __init__(self, vocab_size: int = 64, seq_len: int = 64, num_seqs: int = 4096,
                 branching: int = 4, seed: int = 1234, cache: Path | None = None):
        g = torch.Generator().manual_seed(seed)
        # Sparse transition matrix: `branching` random successors per token, random weights.
        succ = torch.stack([torch.randperm(vocab_size, generator=g)[:branching]
                            for _ in range(vocab_size)])
        w = torch.rand(vocab_size, branching, generator=g) + 0.1
        self.P = torch.zeros(vocab_size, vocab_size, dtype=torch.float64)
        self.P.scatter_(1, succ, (w / w.sum(1, keepdim=True)).double())
        seqs = torch.empty(num_seqs, seq_len + 1, dtype=torch.long)
        seqs[:, 0] = torch.randint(vocab_size, (num_seqs,), generator=g)

        def sample(positions: range) -> None:  # each next token from its row of P, in order
            for t in positions:
                seqs[:, t + 1] = torch.multinomial(self.P[seqs[:, t]], 1, generator=g).squeeze(1)

        fresh = min(1, seq_len)  # positions sampled afresh: the cache's check
        sample(range(fresh))
        # Note [a cached corpus]
        name = re.sub(r"[^\w.-]", "_", f"markov-{vocab_size}-{seq_len}-{num_seqs}-{branching}"
                                        f"-{seed}-torch{torch.__version__}.pt")
        path = (cache or data_root() / "cache") / name
        cached = _load_tokens(path, seqs[:, :fresh + 1], seqs.shape)
        if cached is None:
            sample(range(fresh, seq_len))
            _save_tokens(path, seqs)
        self.seqs = seqs if cached is None else cached

    @property
    def entropy_rate(self) -> float:
        """H = sum_i pi_i * H(P_i): the expected loss (nats) of the true next-token law."""
        pi = torch.full((self.P.shape[0],), 1.0 / self.P.shape[0], dtype=torch.float64)
        for _ in range(1000):  # power iteration to the stationary distribution
            pi = pi @ self.P
        row_h = -(self.P * torch.log(self.P.clamp_min(1e-300))).sum(1)
        return float(pi @ row_h)

    def __len__(self) -> int:
        return len(self.seqs)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.seqs[i, :-1], self.seqs[i, 1:]


def _load_tokens(path: Path, head: torch.Tensor, shape: torch.Size) -> torch.Tensor | None:
    """The cached sequences at ``path`` if they have ``shape`` and begin with ``head`` (Note
    [a cached corpus])."""
    try:
        seqs = torch.load(path, weights_only=True)
    except Exception:  # missing, truncated, not a tensor file: sample again
        return None
    ok = (isinstance(seqs, torch.Tensor) and seqs.dtype == head.dtype and seqs.shape == shape
          and torch.equal(seqs[:, :head.shape[1]], head))
    return seqs if ok else None


def _save_tokens(path: Path, seqs: torch.Tensor) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        torch.save(seqs, tmp)
        tmp.replace(path)
    except OSError:  # a read-only data folder: every job samples afresh, as before the cache
        tmp.unlink(missing_ok=True)


def rank_loader(dataset: Dataset, local_batch: int, rank: int, world_size: int,
                seed: int = 0, start_batch: int = 0) -> DataLoader:
    """This rank's shard of ``dataset`` in batches of ``local_batch`` (shuffled by ``seed``).

    Every rank must pass the same ``seed``: the sampler draws one permutation and rank r
    takes every N-th index of it, so the shards are disjoint and cover the data.

    ``start_batch = k`` resumes the epoch at its k-th batch: the same permutation, the first
    ``k * local_batch`` indices dropped, so the skipped batches are never loaded (Note
    [bitwise resume] in ``minifsdp.checkpoint``).
    """
    sampler = DistributedSampler(dataset, num_replicas=world_size, rank=rank, shuffle=True,
                                 seed=seed, drop_last=True)
    if start_batch:
        # A DataLoader draws a base seed from the *global* generator each time an epoch's
        # iterator starts; the uninterrupted run drew it at batch 0, so a resumed epoch must
        # not draw again (or dropout masks shift): it gets a private generator.
        return DataLoader(dataset, batch_size=local_batch, drop_last=True,
                          sampler=list(sampler)[start_batch * local_batch:],
                          generator=torch.Generator())
    return DataLoader(dataset, batch_size=local_batch, sampler=sampler, drop_last=True)


def global_batch_loader(dataset: Dataset, local_batch: int, world_size: int, seed: int = 0,
                        start_batch: int = 0):
    """Yield, for one process, the concatenation of what ``world_size`` ranks would each load
    with ``rank_loader`` -- the global batch of an N-rank run. See Note [same global batch].

    Shapes: each yielded tensor has ``world_size * local_batch`` rows.
    """
    loaders = [rank_loader(dataset, local_batch, r, world_size, seed, start_batch)
               for r in range(world_size)]
    for parts in zip(*loaders):
        yield tuple(torch.cat(ts) for ts in zip(*parts))
