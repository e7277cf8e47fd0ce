"""MNIST ships in data/, is verified, and is split across ranks without overlap."""

import gzip
import shutil

import pytest
import torch

from minifsdp.data import (
    MNIST_FILES,
    MarkovTokens,
    data_root,
    global_batch_loader,
    mnist,
    prepare_mnist,
    rank_loader,
)


@pytest.fixture
def mnist_copy(tmp_path):
    """A private copy of data/MNIST (the .gz files and checksums) to damage freely."""
    src = data_root() / "MNIST"
    dst = tmp_path / "MNIST"
    dst.mkdir()
    for f in [*(f"{n}.gz" for n in MNIST_FILES), "SHA256SUMS.raw"]:
        shutil.copy(src / f, dst / f)
    return tmp_path


def test_real_mnist_matches_its_published_facts():
    train = mnist(train=True)
    labels = train.tensors[1]
    assert len(train) == 60_000 and len(mnist(train=False)) == 10_000
    assert labels[:10].tolist() == [5, 0, 4, 1, 9, 2, 1, 3, 1, 4]
    assert torch.bincount(labels).tolist() == [5923, 6742, 5958, 6131, 5842, 5421, 5918,
                                               6265, 5851, 5949]
    assert abs(float(train.tensors[0].mean())) < 1e-3  # normalised with the tutorial's mean


def test_corrupted_file_is_named_in_the_error(mnist_copy):
    # Same length, different content: decompresses fine, fails the checksum.
    gz = mnist_copy / "MNIST" / "t10k-labels-idx1-ubyte.gz"
    raw = bytearray(gzip.decompress(gz.read_bytes()))
    raw[100] ^= 0xFF
    gz.write_bytes(gzip.compress(bytes(raw)))
    with pytest.raises(ValueError, match=r"t10k-labels-idx1-ubyte\.gz failed its checksum"):
        prepare_mnist(mnist_copy)
    # the bad decompressed file is not left behind to be trusted next time
    assert not (mnist_copy / "MNIST" / "raw" / "t10k-labels-idx1-ubyte").exists()


def test_truncated_gzip_is_named_in_the_error(mnist_copy):
    gz = mnist_copy / "MNIST" / "train-labels-idx1-ubyte.gz"
    gz.write_bytes(gz.read_bytes()[:1000])
    with pytest.raises(ValueError, match=r"train-labels-idx1-ubyte\.gz is corrupted"):
        prepare_mnist(mnist_copy)


def test_corrupted_deflate_stream_is_named_and_leaves_no_temporary(mnist_copy):
    # A valid gzip header, then a flipped byte inside the compressed data: zlib itself fails
    # (zlib.error, "invalid ... distance"), not gzip's CRC check at the end.
    gz = mnist_copy / "MNIST" / "t10k-images-idx3-ubyte.gz"
    data = bytearray(gz.read_bytes())
    for i in range(2000, 2400):
        data[i] ^= 0x5A
    gz.write_bytes(bytes(data))
    with pytest.raises(ValueError, match=r"t10k-images-idx3-ubyte\.gz is corrupted"):
        prepare_mnist(mnist_copy)
    raw = mnist_copy / "MNIST" / "raw"
    assert not [p.name for p in raw.iterdir() if p.name.endswith(".tmp")]


def test_missing_file_is_named_in_the_error(mnist_copy):
    (mnist_copy / "MNIST" / "train-images-idx3-ubyte.gz").unlink()
    with pytest.raises(FileNotFoundError, match=r"train-images-idx3-ubyte\.gz"):
        prepare_mnist(mnist_copy)


def test_rank_shards_are_disjoint_and_union_is_the_global_batch():
    ds = torch.utils.data.TensorDataset(torch.arange(40))
    ws, local = 4, 2
    shards = [[b[0] for b in rank_loader(ds, local, r, ws, seed=3)] for r in range(ws)]
    seen = torch.cat([torch.cat(s) for s in shards])
    assert len(set(seen.tolist())) == 40  # every sample exactly once per epoch
    glob = [b[0] for b in global_batch_loader(ds, local, ws, seed=3)]
    for step, g in enumerate(glob):  # step k's global batch = the ranks' k-th batches
        assert torch.equal(g, torch.cat([shards[r][step] for r in range(ws)]))


def test_markov_tokens_loss_floor():
    ds = MarkovTokens(vocab_size=16, seq_len=8, num_seqs=4, branching=1)
    assert ds.entropy_rate == pytest.approx(0.0, abs=1e-9)  # deterministic chain
    ds = MarkovTokens(vocab_size=64, branching=4)
    assert 0 < ds.entropy_rate < torch.log(torch.tensor(4.0)).item()
    x, y = ds[5]
    assert torch.equal(x[1:], y[:-1])


def test_verified_file_changed_later_is_checked_again(mnist_copy):
    prepare_mnist(mnist_copy)  # decompress, verify, stamp
    raw = mnist_copy / "MNIST" / "raw" / "t10k-labels-idx1-ubyte"
    data = bytearray(raw.read_bytes())
    data[200] ^= 0xFF
    raw.write_bytes(bytes(data))  # same size, new mtime: the stamp no longer vouches for it
    with pytest.raises(ValueError, match=r"t10k-labels-idx1-ubyte\.gz failed its checksum"):
        prepare_mnist(mnist_copy)


def _markov_sampled_afresh(vocab_size, seq_len, num_seqs, branching, seed):
    """The corpus as MarkovTokens sampled it before it had a cache: the oracle for the cache."""
    g = torch.Generator().manual_seed(seed)
    succ = torch.stack([torch.randperm(vocab_size, generator=g)[:branching]
                        for _ in range(vocab_size)])
    w = torch.rand(vocab_size, branching, generator=g) + 0.1
    P = torch.zeros(vocab_size, vocab_size, dtype=torch.float64)
    P.scatter_(1, succ, (w / w.sum(1, keepdim=True)).double())
    seqs = torch.empty(num_seqs, seq_len + 1, dtype=torch.long)
    seqs[:, 0] = torch.randint(vocab_size, (num_seqs,), generator=g)
    for t in range(seq_len):
        seqs[:, t + 1] = torch.multinomial(P[seqs[:, t]], 1, generator=g).squeeze(1)
    return seqs


def test_cached_tokens_are_the_tokens_sampled_afresh(tmp_path):
    """Note [a cached corpus]: a cold cache, a warm one, a damaged file and a file of another
    corpus all give the sequences sampled afresh, and a bad file is replaced."""
    args = dict(vocab_size=32, seq_len=8, num_seqs=64, branching=3, seed=7)
    want = _markov_sampled_afresh(**args)
    cold = MarkovTokens(**args, cache=tmp_path).seqs
    (path,) = tmp_path.glob("markov-*.pt")
    assert torch.equal(cold, want) and torch.equal(torch.load(path), want)
    assert torch.equal(MarkovTokens(**args, cache=tmp_path).seqs, want)  # warm: loaded
    path.write_bytes(path.read_bytes()[:100])  # truncated
    assert torch.equal(MarkovTokens(**args, cache=tmp_path).seqs, want)
    assert torch.equal(torch.load(path), want)  # replaced
    other = want.clone()
    other[:, 1] = (other[:, 1] + 1) % 32  # begins differently: not this generator's draws
    torch.save(other, path)
    assert torch.equal(MarkovTokens(**args, cache=tmp_path).seqs, want)
    other = want.clone()
    other[:, 5] = (other[:, 5] + 1) % 32  # differs later: the check cannot see it...
    torch.save(other, path)
    assert torch.equal(MarkovTokens(**args, cache=tmp_path).seqs, other)  # ...so it is trusted
    assert not list(tmp_path.glob(".*tmp"))  # no half-written file left


def test_our_idx_reader_gives_torchvisions_mnist():
    from torchvision.datasets import MNIST

    for train in (True, False):
        ours, theirs = mnist(train=train), MNIST(str(prepare_mnist()), train=train, download=False)
        images = (theirs.data.unsqueeze(1).float() / 255.0 - 0.1307) / 0.3081
        assert torch.equal(ours.tensors[0], images) and torch.equal(ours.tensors[1], theirs.targets)
        assert ours.tensors[1].dtype == theirs.targets.dtype == torch.int64


def test_a_damaged_idx_header_is_named(tmp_path):
    from minifsdp.data import read_idx

    src = prepare_mnist() / "MNIST" / "raw" / "t10k-labels-idx1-ubyte"
    bad = tmp_path / "labels"
    bad.write_bytes(src.read_bytes()[:-3])
    with pytest.raises(ValueError, match=r"labels: header says \[10000\]"):
        read_idx(bad, 1)
    with pytest.raises(ValueError, match="labels is not an IDX file of unsigned bytes with 3"):
        read_idx(bad, 3)
