"""The byte-level standard-library dataset: determinism, shapes, vocabulary, per-pipeline splits."""
from __future__ import annotations

import sysconfig
from pathlib import Path

import numpy as np
import pytest
import torch

from hspmd_sdk.runtime import data

SEQ = 32
MAX_BYTES = 2_000_000


@pytest.fixture(scope="module")
def ds() -> data.StdlibBytes:
    return data.StdlibBytes(max_bytes=MAX_BYTES)


@pytest.fixture(scope="module")
def reference_corpus() -> bytes:
    """The corpus rebuilt independently: sorted stdlib *.py outside site-/dist-packages, concatenated."""
    root = Path(sysconfig.get_paths()["stdlib"])
    rels = sorted(p.relative_to(root).as_posix() for p in root.rglob("*.py")
                  if not {"site-packages", "dist-packages", "__pycache__"} & set(p.relative_to(root).parts))
    out = bytearray()
    for rel in rels:
        out += (root / rel).read_bytes()
        if len(out) >= MAX_BYTES:
            break
    return bytes(out[:MAX_BYTES])


def test_same_seed_and_step_same_batch(ds: data.StdlibBytes) -> None:
    a = ds.global_batch(5, 8, SEQ, seed=1)
    b = data.StdlibBytes(max_bytes=MAX_BYTES).global_batch(5, 8, SEQ, seed=1)
    assert torch.equal(a, b)
    assert not torch.equal(a, ds.global_batch(6, 8, SEQ, seed=1))
    assert not torch.equal(a, ds.global_batch(5, 8, SEQ, seed=2))


def test_shape_dtype_vocab(ds: data.StdlibBytes) -> None:
    b = ds.global_batch(0, 6, SEQ, seed=0)
    assert b.shape == (6, SEQ + 1) and b.dtype == torch.int64
    assert int(b.min()) >= 0 and int(b.max()) < data.VOCAB_SIZE == ds.vocab_size
    x, y = data.inputs_targets(b)
    assert x.shape == y.shape == (6, SEQ)
    assert torch.equal(x[:, 1:], y[:, :-1])


def test_rows_are_packed_windows_of_the_corpus(ds: data.StdlibBytes, reference_corpus: bytes) -> None:
    idx = data.sample_indices(3, 4, ds.num_samples(SEQ), seed=7)
    b = ds.global_batch(3, 4, SEQ, seed=7)
    train = len(reference_corpus) - len(reference_corpus) // 100  # the last 1% is validation's
    assert ds.num_samples(SEQ) == train // (SEQ + 1)
    for row, i in zip(b.tolist(), idx.tolist()):
        start = i * (SEQ + 1)
        assert bytes(row) == reference_corpus[start:start + SEQ + 1]


def test_validation_reads_the_held_out_tail_only(ds: data.StdlibBytes, reference_corpus: bytes) -> None:
    """Validation batches are consecutive windows of the corpus's last 1%; no training sample reaches it."""
    train = len(reference_corpus) - len(reference_corpus) // 100
    n_val = (len(reference_corpus) - train) // (SEQ + 1)
    assert ds.num_val_samples(SEQ) == n_val > 8
    for index in (0, 1, n_val // 4 + 1):  # the last wraps around
        v = ds.val_batch(index, 4, SEQ)
        for r, row in enumerate(v.tolist()):
            start = train + ((index * 4 + r) % n_val) * (SEQ + 1)
            assert bytes(row) == reference_corpus[start:start + SEQ + 1]
    assert torch.equal(ds.val_batch(1, 4, SEQ, rows=(1, 3)), ds.val_batch(1, 4, SEQ)[1:3])
    last_train_end = (ds.num_samples(SEQ)) * (SEQ + 1)
    assert last_train_end <= train


def test_a_sample_across_two_files_is_read_whole(reference_corpus: bytes) -> None:
    """Windows that span a file boundary equal the concatenation (the reader crosses files)."""
    first = data.stdlib_files()[0].stat().st_size
    ds = data.StdlibBytes(max_bytes=MAX_BYTES)
    assert bytes(ds.read(first - 5, 40)) == reference_corpus[first - 5:first + 35]


def test_an_epoch_visits_every_sample_once() -> None:
    n, bsz = 10, 5
    first_epoch = np.concatenate([data.sample_indices(s, bsz, n, seed=3) for s in range(2)])
    assert sorted(first_epoch.tolist()) == list(range(n))
    # a batch that straddles an epoch boundary is still deterministic and in range
    straddle = data.sample_indices(1, 7, n, seed=3)
    assert straddle.min() >= 0 and straddle.max() < n
    assert np.array_equal(straddle, data.sample_indices(1, 7, n, seed=3))


def test_split_batch_by_pipeline_sizes(ds: data.StdlibBytes) -> None:
    b = ds.global_batch(0, 10, SEQ, seed=0)
    parts = data.split_batch(b, [4, 0, 6])
    assert [p.shape[0] for p in parts] == [4, 0, 6]
    assert torch.equal(torch.cat(parts), b)
    assert data.pipeline_slices([3, 5]) == [slice(0, 3), slice(3, 8)]
    with pytest.raises(ValueError, match="sum to 9, not the global batch size 10"):
        data.split_batch(b, [4, 5])


def test_file_lengths_are_mixed_and_match_the_files() -> None:
    lengths = data.file_lengths()
    files = data.stdlib_files()
    assert len(lengths) == len(files) > 100
    assert lengths[:5] == [len(f.read_bytes()) for f in files[:5]]
    assert max(lengths) > 100 * max(1, int(np.median(lengths)) // 100)  # a wide spread of lengths


def test_synthetic_tokens() -> None:
    syn = data.SyntheticTokens(vocab_size=50)
    a = data.global_batch(2, 3, 16, 0, dataset=syn)
    assert a.shape == (3, 17) and a.dtype == torch.int64 and int(a.max()) < 50
    assert torch.equal(a, syn.global_batch(2, 3, 16, 0))
    assert not torch.equal(a, syn.global_batch(3, 3, 16, 0))


def test_too_long_sample_is_a_clear_error() -> None:
    tiny = data.StdlibBytes(max_bytes=100)
    with pytest.raises(ValueError, match="shorter than one sample"):
        tiny.global_batch(0, 1, 200, 0)
