"""The prepared-corpus contract (issue 44): format checks, the global sample order, ``rows=``, validation batches,
documents, the fit to a model, the runtime's data hooks, and memory (a batch reads only its rows).

Every corpus here is written by hand with numpy (independent of ``prepare``), and every expected batch is computed
from the raw ``.bin`` with numpy and ``np.random.default_rng([seed, epoch]).permutation`` — never through the class
under test.
"""
from __future__ import annotations

import hashlib
import json
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch

from hspmd_sdk.data import CorpusError, TokenCorpus
from hspmd_sdk.runtime import data as rdata

TRAIN_TOKENS, VAL_TOKENS = 10_000, 3_000
#: Train ids below VAL_LOW, val ids from VAL_LOW: a val row can never be a train sample.
VAL_LOW, VOCAB = 500, 1000


def write_corpus(root: Path, train: np.ndarray, val: np.ndarray, train_starts: np.ndarray,
                 val_starts: np.ndarray, vocab: int, *, tokenizer_vocab: int | None = None) -> Path:
    """A corpus directory in the SPEC §14 format, written field by field."""
    root.mkdir(parents=True, exist_ok=True)
    dtype = "<u2" if vocab <= 65536 else "<u4"
    h = hashlib.sha256()
    for split, tokens, starts in (("train", train, train_starts), ("val", val, val_starts)):
        raw = np.asarray(tokens, dtype=dtype).tobytes()
        (root / f"{split}.bin").write_bytes(raw)
        (root / f"{split}.idx").write_bytes(np.asarray(starts, dtype="<i8").tobytes())
        h.update(raw)
    meta = {"format_version": 1, "vocab_size": vocab, "dtype": "uint16" if dtype == "<u2" else "uint32",
            "splits": {s: {"tokens": int(t.size), "documents": int(st.size), "max_token_id": int(t.max())}
                       for s, t, st in (("train", train, train_starts), ("val", val, val_starts))},
            "tokenizer": {"source": "hand-written", "vocab_size": tokenizer_vocab or vocab, "eot_token": "<eot>",
                          "eot_id": 0},
            "digest": h.hexdigest()[:32]}
    (root / "meta.json").write_text(json.dumps(meta))
    return root


def _starts(n: int, docs: int, rng: np.random.Generator) -> np.ndarray:
    return np.concatenate([[0], np.sort(rng.choice(np.arange(1, n), size=docs - 1, replace=False))])


@pytest.fixture(scope="module")
def corpus_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    rng = np.random.default_rng(0)
    train = rng.integers(1, VAL_LOW, TRAIN_TOKENS)
    val = rng.integers(VAL_LOW, VOCAB, VAL_TOKENS)
    return write_corpus(tmp_path_factory.mktemp("corpus"), train, val, _starts(TRAIN_TOKENS, 40, rng),
                        _starts(VAL_TOKENS, 7, rng), VOCAB)


@pytest.fixture()
def corpus(corpus_dir: Path) -> TokenCorpus:
    return TokenCorpus(corpus_dir)


def expected_batch(path: Path, step: int, batch: int, seq: int, seed: int) -> np.ndarray:
    """Step ``step``'s samples from the raw train.bin: stream positions step*B.. through per-epoch permutations."""
    tokens = np.fromfile(path / "train.bin", dtype="<u2").astype(np.int64)
    n = tokens.size // (seq + 1)
    rows = []
    for pos in range(step * batch, (step + 1) * batch):
        i = np.random.default_rng([seed, pos // n]).permutation(n)[pos % n]
        rows.append(tokens[i * (seq + 1):(i + 1) * (seq + 1)])
    return np.stack(rows)


# ---- the global order -------------------------------------------------------------------------------------------
@pytest.mark.parametrize("step", [0, 3, 9, 10])  # 588 samples of 17: step 9 of 64 crosses into epoch 1
def test_a_step_is_the_sample_indices_windows_of_the_raw_bin(corpus: TokenCorpus, corpus_dir: Path,
                                                              step: int) -> None:
    got = corpus.global_batch(step, 64, 16, seed=5)
    assert got.dtype == torch.int64 and got.shape == (64, 17)
    assert np.array_equal(got.numpy(), expected_batch(corpus_dir, step, 64, 16, seed=5))


def test_same_seed_and_step_same_batch_in_a_new_process_view(corpus: TokenCorpus, corpus_dir: Path) -> None:
    a = corpus.global_batch(4, 8, 32, seed=1)
    assert torch.equal(a, TokenCorpus(corpus_dir).global_batch(4, 8, 32, seed=1))
    assert not torch.equal(a, corpus.global_batch(5, 8, 32, seed=1))
    assert not torch.equal(a, corpus.global_batch(4, 8, 32, seed=2))
    corpus.global_batch(900, 8, 32, seed=1)  # other epochs in between: the cache must not change the answer
    assert torch.equal(a, corpus.global_batch(4, 8, 32, seed=1))


@pytest.mark.parametrize("rows", [(0, 8), (0, 3), (3, 8), (5, 5), (7, 8)])
def test_rows_are_the_full_batch_rows(corpus: TokenCorpus, rows: tuple[int, int]) -> None:
    full = corpus.global_batch(2, 8, 16, seed=3)
    assert torch.equal(corpus.global_batch(2, 8, 16, seed=3, rows=rows), full[rows[0]:rows[1]])
    val = corpus.val_batch(1, 8, 16)
    assert torch.equal(corpus.val_batch(1, 8, 16, rows=rows), val[rows[0]:rows[1]])


def test_rows_read_only_their_samples(corpus: TokenCorpus, monkeypatch: pytest.MonkeyPatch) -> None:
    import os

    reads: list[tuple[int, int]] = []
    real = os.pread

    def spy(fd: int, n: int, offset: int) -> bytes:
        reads.append((n, offset))
        return real(fd, n, offset)

    monkeypatch.setattr(os, "pread", spy)
    corpus.global_batch(6, 16, 16, seed=0, rows=(4, 7))
    n = TRAIN_TOKENS // 17
    positions = range(6 * 16 + 4, 6 * 16 + 7)
    want = [int(np.random.default_rng([0, p // n]).permutation(n)[p % n]) * 17 * 2 for p in positions]
    assert reads == [(34, o) for o in want]  # 17 uint16 tokens at each of the three samples, nothing else


@pytest.mark.parametrize("make", [lambda d: rdata.SyntheticTokens(300),
                                  lambda d: rdata.StdlibBytes(max_bytes=200_000)])
def test_the_toy_sources_take_rows_too(make: object, corpus_dir: Path) -> None:
    ds = make(corpus_dir)  # type: ignore[operator]
    full = ds.global_batch(3, 6, 16, 7)
    assert torch.equal(ds.global_batch(3, 6, 16, 7, rows=(2, 5)), full[2:5])
    with pytest.raises(ValueError, match=r"rows=\(4, 7\)"):
        ds.global_batch(3, 6, 16, 7, rows=(4, 7))


def test_bad_rows_are_refused(corpus: TokenCorpus) -> None:
    with pytest.raises(ValueError, match=r"rows=\(3, 2\) is not a range"):
        corpus.global_batch(0, 4, 16, 0, rows=(3, 2))


# ---- validation ------------------------------------------------------------------------------------------------
def test_val_batches_are_consecutive_val_windows_and_never_train_data(corpus: TokenCorpus, corpus_dir: Path) -> None:
    val = np.fromfile(corpus_dir / "val.bin", dtype="<u2").astype(np.int64)
    nv = VAL_TOKENS // 33
    for index in (0, 1, 11, 12):  # 90 samples of 33, batches of 8: index 11 wraps around
        got = corpus.val_batch(index, 8, 32).numpy()
        want = [val[(k % nv) * 33:(k % nv + 1) * 33] for k in range(index * 8, index * 8 + 8)]
        assert np.array_equal(got, np.stack(want))
        assert got.min() >= VAL_LOW  # val tokens only: train ids are all below VAL_LOW
    for step in range(0, 40, 7):
        assert int(corpus.global_batch(step, 16, 32, seed=0).max()) < VAL_LOW


# ---- documents ---------------------------------------------------------------------------------------------------
def test_documents_are_views_of_the_bin_cut_at_the_idx(corpus: TokenCorpus, corpus_dir: Path) -> None:
    tokens = np.fromfile(corpus_dir / "train.bin", dtype="<u2")
    starts = np.fromfile(corpus_dir / "train.idx", dtype="<i8").tolist() + [tokens.size]
    docs = corpus.documents("train")
    assert len(docs) == 40
    for d, a, b in zip(docs, starts[:-1], starts[1:]):
        assert np.array_equal(d, tokens[a:b])
        assert np.shares_memory(d, corpus.tokens("train"))  # a view: no copy
    assert sum(d.size for d in corpus.documents("val")) == VAL_TOKENS


# ---- the fit to a model ------------------------------------------------------------------------------------------
def test_check_is_empty_for_a_corpus_that_fits(corpus: TokenCorpus) -> None:
    assert corpus.check(8, 32, VOCAB) == []


def test_check_names_every_problem(tmp_path: Path, corpus: TokenCorpus, corpus_dir: Path) -> None:
    top = int(np.fromfile(corpus_dir / "val.bin", dtype="<u2").max())
    beyond = corpus.check(8, 32, 800)
    assert any(f"token id {top} is beyond the model's vocabulary of 800" in p for p in beyond)
    assert any("has 1000 tokens but the model's vocabulary has only 800" in p for p in beyond)
    assert corpus.check(8, 32, VOCAB + 24) == []  # a padded model vocabulary (GPT-2's 50304) is fine
    short = corpus.check(400, 32, VOCAB)  # 303 train samples, 90 val samples of 33
    assert any("train.bin: 303 samples" in p and "fewer than the 400 of one training step" in p for p in short)
    assert any("val.bin: 90 samples" in p and "one validation batch" in p for p in short)
    mismatch = write_corpus(tmp_path / "c", np.arange(1, 200), np.arange(1, 50), np.array([0]), np.array([0]),
                            1000, tokenizer_vocab=1024)
    assert TokenCorpus(mismatch).check(1, 8, 1000) == [
        f"{mismatch / 'meta.json'}: tokenizer 'hand-written' has 1024 tokens but the model's vocabulary has only "
        "1000; set the model's vocab_size to 1024 (or more)"]


def test_a_corpus_shorter_than_one_sample_is_an_error(corpus: TokenCorpus) -> None:
    with pytest.raises(CorpusError, match="train.bin: 10000 tokens is shorter than one sample"):
        corpus.global_batch(0, 2, 20_000, 0)
    with pytest.raises(CorpusError, match="val.bin: 3000 tokens is shorter than one sample"):
        corpus.val_batch(0, 2, 5_000)


# ---- bad files ---------------------------------------------------------------------------------------------------
def _copy(src: Path, dst: Path) -> Path:
    dst.mkdir()
    for f in src.iterdir():
        (dst / f.name).write_bytes(f.read_bytes())
    return dst


@pytest.mark.parametrize("name", ["train.bin", "val.bin", "train.idx", "val.idx", "meta.json"])
def test_a_missing_file_is_named(tmp_path: Path, corpus_dir: Path, name: str) -> None:
    d = _copy(corpus_dir, tmp_path / "c")
    (d / name).unlink()
    with pytest.raises(CorpusError, match=rf"{name}: missing.*train.bin, val.bin, train.idx, val.idx and meta.json"):
        TokenCorpus(d)


@pytest.mark.parametrize("name", ["train.bin", "val.idx"])
def test_an_empty_file_is_named(tmp_path: Path, corpus_dir: Path, name: str) -> None:
    d = _copy(corpus_dir, tmp_path / "c")
    (d / name).write_bytes(b"")
    with pytest.raises(CorpusError, match=rf"{name}: empty file"):
        TokenCorpus(d)


def test_a_truncated_bin_is_named(tmp_path: Path, corpus_dir: Path) -> None:
    d = _copy(corpus_dir, tmp_path / "c")
    raw = (d / "train.bin").read_bytes()
    (d / "train.bin").write_bytes(raw[:-1])  # half a token
    with pytest.raises(CorpusError, match=r"train.bin: truncated: 19999 bytes is not a whole number of uint16"):
        TokenCorpus(d)
    (d / "train.bin").write_bytes(raw[:-100])  # whole tokens, but fewer than meta.json's
    with pytest.raises(CorpusError, match=r"train.bin: truncated or replaced: it holds 9950 tokens but meta.json "
                                          r"says 10000; prepare the corpus again"):
        TokenCorpus(d)


@pytest.mark.parametrize("starts", [[0, 50, 50, 900], [3, 50, 60, 900], [0, 50, 60, 3000], [0, 60, 50, 900]])
def test_bad_document_offsets_are_named(tmp_path: Path, corpus_dir: Path, starts: list[int]) -> None:
    d = _copy(corpus_dir, tmp_path / "c")
    meta = json.loads((d / "meta.json").read_text())
    meta["splits"]["val"]["documents"] = len(starts)
    (d / "meta.json").write_text(json.dumps(meta))
    (d / "val.idx").write_bytes(np.array(starts, dtype="<i8").tobytes())
    with pytest.raises(CorpusError, match=r"val.idx: document offsets must start at 0 and increase strictly"):
        TokenCorpus(d)


def test_bad_meta_is_named(tmp_path: Path, corpus_dir: Path) -> None:
    d = _copy(corpus_dir, tmp_path / "c")
    meta = json.loads((d / "meta.json").read_text())
    (d / "meta.json").write_text(json.dumps({**meta, "format_version": 99}))
    with pytest.raises(CorpusError, match="meta.json: format_version 99 is newer"):
        TokenCorpus(d)
    (d / "meta.json").write_text(json.dumps({**meta, "vocab_size": 70_000}))
    with pytest.raises(CorpusError, match="meta.json: dtype uint16 does not match vocab_size 70000"):
        TokenCorpus(d)
    (d / "meta.json").write_text(json.dumps({**meta, "colour": 1}))
    with pytest.raises(CorpusError, match="meta.json: invalid meta \\(colour: Extra inputs"):
        TokenCorpus(d)
    with pytest.raises(CorpusError, match="no such directory, not a prepared corpus"):
        TokenCorpus(tmp_path / "nowhere")


def test_a_corpus_travels_as_its_path(corpus: TokenCorpus) -> None:
    import pickle

    wire = pickle.dumps(corpus)
    assert len(wire) < 1000  # the path, never the tokens
    assert torch.equal(pickle.loads(wire).global_batch(3, 4, 16, 0), corpus.global_batch(3, 4, 16, 0))


def test_verify_recomputes_the_digest(tmp_path: Path, corpus_dir: Path) -> None:
    TokenCorpus(corpus_dir).verify()
    d = _copy(corpus_dir, tmp_path / "c")
    raw = bytearray((d / "val.bin").read_bytes())
    raw[10] ^= 1
    (d / "val.bin").write_bytes(bytes(raw))
    with pytest.raises(CorpusError, match="a .bin file was changed"):
        TokenCorpus(d).verify()


# ---- the runtime's hooks -----------------------------------------------------------------------------------------
def test_dataset_for_a_corpus_directory(corpus_dir: Path) -> None:
    ds = rdata.dataset_for(str(corpus_dir), VOCAB)
    assert isinstance(ds, TokenCorpus) and ds.vocab_size == VOCAB
    assert np.array_equal(ds.global_batch(1, 4, 16, 0).numpy(), expected_batch(corpus_dir, 1, 4, 16, 0))
    with pytest.raises(CorpusError, match=r"token id \d+ is beyond the model's vocabulary of 512"):
        rdata.dataset_for(corpus_dir, 512)
    with pytest.raises(ValueError, match="not '/no/such/dir'.*holds train.bin, val.bin, train.idx, val.idx"):
        rdata.dataset_for("/no/such/dir", VOCAB)


def test_documents_for_a_corpus_directory_travel_as_the_directory(corpus_dir: Path) -> None:
    docs = rdata.documents_for(str(corpus_dir), VOCAB)
    tokens = np.fromfile(corpus_dir / "train.bin", dtype="<u2")
    starts = np.fromfile(corpus_dir / "train.idx", dtype="<i8").tolist() + [tokens.size]
    arrays = [tokens[a:b].astype(np.int64) for a, b in zip(starts[:-1], starts[1:])]
    assert [d.tolist() for d in docs.docs] == [a.tolist() for a in arrays]
    spec = rdata.data_spec(docs, context=24, tokens_per_step=96, seed=2)
    assert spec["source"] == {"corpus": str(corpus_dir.resolve())}
    in_memory = rdata.data_spec(rdata.Documents(arrays, vocab_size=VOCAB), context=24, tokens_per_step=96, seed=2)
    assert spec["digest"] == in_memory["digest"]  # the same documents, the same identity
    worker = rdata.batches_of(json.loads(json.dumps(spec)))
    reference = rdata.LengthBatches(rdata.Documents(arrays, vocab_size=VOCAB), context=24, tokens_per_step=96, seed=2)
    for step in (0, 5, 17):
        assert [s.tolist() for s in worker.step_sequences(step)] == [s.tolist() for s in reference.step_sequences(step)]


# ---- memory --------------------------------------------------------------------------------------------------------
_RSS_SCRIPT = textwrap.dedent("""
    import json, sys, psutil, torch
    from hspmd_sdk.data import TokenCorpus
    def rss():
        return psutil.Process().memory_info().rss
    def anon():
        for line in open("/proc/self/status"):
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) * 1024
        return 0
    torch.zeros(1)
    before, before_anon = rss(), anon()
    c = TokenCorpus(sys.argv[1])
    for step in range(50):
        b = c.global_batch(step, 8, 1023, seed=0)
        part = c.global_batch(step, 8, 1023, seed=0, rows=(2, 5))
    for index in range(10):
        v = c.val_batch(index, 8, 1023)
    print(json.dumps({"rss": rss() - before, "anon": anon() - before_anon,
                      "samples": c.num_samples(1023)}))
""")


def _big_corpus(root: Path, megabytes: int) -> Path:
    """A corpus whose train.bin has ``megabytes`` MB of uint16 tokens, written in chunks."""
    root.mkdir()
    n = megabytes * (1 << 20) // 2
    chunk = np.arange(1 << 22, dtype=np.uint16)
    with open(root / "train.bin", "wb") as f:
        for start in range(0, n, chunk.size):
            chunk[: min(chunk.size, n - start)].tofile(f)
    val = np.arange(1, 200_000, dtype=np.uint16)
    val.tofile(root / "val.bin")
    np.array([0], dtype="<i8").tofile(root / "train.idx")
    np.array([0], dtype="<i8").tofile(root / "val.idx")
    meta = {"vocab_size": 65536, "dtype": "uint16",
            "splits": {"train": {"tokens": n, "documents": 1, "max_token_id": 65535},
                       "val": {"tokens": int(val.size), "documents": 1, "max_token_id": int(val.max())}},
            "tokenizer": {"source": "none", "vocab_size": 65536, "eot_token": "<eot>", "eot_id": 0},
            "digest": "0" * 32}
    (root / "meta.json").write_text(json.dumps(meta))
    return root


def _rss_growth(corpus: Path) -> dict[str, int]:
    out = subprocess.run([sys.executable, "-c", _RSS_SCRIPT, str(corpus)], capture_output=True, text=True,
                         timeout=120, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("megabytes", [256, pytest.param(1024, marks=pytest.mark.slow)])
def test_batches_of_a_large_corpus_add_a_few_megabytes(tmp_path: Path, megabytes: int) -> None:
    grown = _rss_growth(_big_corpus(tmp_path / "big", megabytes))
    print(f"{megabytes} MB train.bin: RSS +{grown['rss'] / 2**20:.1f} MB, anonymous +{grown['anon'] / 2**20:.1f} MB "
          f"({grown['samples']} samples)")
    assert grown["anon"] < 8 * 2**20  # the permutation (8 bytes a sample) and the batches, never the file
    assert grown["rss"] < 16 * 2**20  # file pages mapped on the way (meta, offsets, library code) included
