"""``prepare`` and ``hspmd data`` (issue 44): local text / JSON lines / parquet files -> a prepared corpus, checked
by reading the files back with numpy and decoding with ``tokenizers`` directly (not through ``TokenCorpus``)."""
from __future__ import annotations

import json
import time
from pathlib import Path

import numpy as np
import pytest

from hspmd_sdk.cli import main
from hspmd_sdk.data import CorpusError, TokenCorpus, prepare, stdlib_corpus, stdlib_source_files

tokenizers = pytest.importorskip("tokenizers")
pq = pytest.importorskip("pyarrow.parquet")
pa = pytest.importorskip("pyarrow")

EOT = "<|endoftext|>"
TEXTS = [f"document {i}: " + " ".join(["naïve café", "λx. x + 1", "def f(a):\n    return a  # ünïcode"][i % 3]
                                       for _ in range(5 + i)) + "\n" for i in range(6)]
ROWS = ["first row, with a comma", "second row\nspans two lines", "", "fourth row: 😀 emoji"]
PARQUET = ["parquet one", "parquet two: ∑ x²"]


@pytest.fixture(scope="module")
def inputs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("inputs")
    for i, t in enumerate(TEXTS):
        (d / f"doc{i}.txt").write_text(t)
    (d / "rows.jsonl").write_text("".join(json.dumps({"text": t, "id": i}) + "\n" for i, t in enumerate(ROWS)))
    pq.write_table(pa.table({"body": PARQUET, "n": [1, 2]}), d / "table.parquet")
    return d


def documents_in_order() -> list[str]:
    """The non-empty documents in input order (a directory is read sorted by path: doc*.txt, rows, table)."""
    return [t for t in TEXTS + ROWS + PARQUET if t]


def read_split(out: Path, split: str, dtype: str = "<u2") -> list[list[int]]:
    tokens = np.fromfile(out / f"{split}.bin", dtype=dtype)
    starts = np.fromfile(out / f"{split}.idx", dtype="<i8").tolist() + [tokens.size]
    return [tokens[a:b].tolist() for a, b in zip(starts[:-1], starts[1:])]


def decoded(out: Path, tok_path: Path | None = None, dtype: str = "<u2") -> dict[str, list[str]]:
    tok = tokenizers.Tokenizer.from_file(str(tok_path or out / "tokenizer.json"))
    return {s: [tok.decode(d, skip_special_tokens=False) for d in read_split(out, s, dtype)] for s in ("train", "val")}


def parquet_input(inputs: Path) -> list[Path]:
    """Text and jsonl (text column) in one prepare; parquet has its text in 'body' (a second call)."""
    return sorted(p for p in inputs.iterdir() if p.suffix != ".parquet")


@pytest.fixture(scope="module")
def trained(inputs: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return prepare(parquet_input(inputs), tmp_path_factory.mktemp("out") / "corpus", train_tokenizer_vocab=400,
                   val_fraction=0.3, seed=1, progress=False)


# ---- the format, round trip ----------------------------------------------------------------------------------------
def test_trained_tokenizer_round_trip(trained: Path) -> None:
    texts = [t for t in TEXTS + ROWS if t]
    got = decoded(trained)
    assert sorted(got["train"] + got["val"]) == sorted(t + EOT for t in texts)  # every document + end of text
    order = [t + EOT for t in texts]
    for split in ("train", "val"):  # input order kept within each split
        assert got[split] == [t for t in order if t in got[split]]
    assert len(got["val"]) == round(len(texts) * 0.3)
    meta = json.loads((trained / "meta.json").read_text())
    tok = tokenizers.Tokenizer.from_file(str(trained / "tokenizer.json"))
    assert meta["vocab_size"] == tok.get_vocab_size() <= 400 and meta["dtype"] == "uint16"
    assert meta["tokenizer"]["eot_token"] == EOT and meta["tokenizer"]["eot_id"] == tok.token_to_id(EOT)
    assert meta["tokenizer"]["trained"] is True
    for split in ("train", "val"):
        docs = read_split(trained, split)
        assert meta["splits"][split] == {"tokens": sum(map(len, docs)), "documents": len(docs),
                                         "max_token_id": max(max(d) for d in docs)}
        assert all(d[-1] == meta["tokenizer"]["eot_id"] for d in docs)
    import hashlib
    raw = (trained / "train.bin").read_bytes() + (trained / "val.bin").read_bytes()
    assert meta["digest"] == hashlib.sha256(raw).hexdigest()[:32]
    assert meta["format_version"] == 1
    assert not [p.name for p in trained.parent.iterdir() if p.name != "corpus"]  # no temporary left


def test_val_documents_are_not_train_documents(trained: Path) -> None:
    got = decoded(trained)
    assert got["val"] and not set(got["val"]) & set(got["train"])
    corpus = TokenCorpus(trained)
    val = np.fromfile(trained / "val.bin", dtype="<u2").astype(np.int64)
    train = np.fromfile(trained / "train.bin", dtype="<u2").astype(np.int64)
    nv, nt = val.size // 9, train.size // 9
    for i in range(5):  # validation batches: consecutive val.bin windows, wrapping around
        want = [val[(k % nv) * 9:(k % nv + 1) * 9] for k in range(2 * i, 2 * i + 2)]
        assert np.array_equal(corpus.val_batch(i, 2, 8).numpy(), np.stack(want))
    for s in range(3):  # training batches: train.bin windows only
        rows = corpus.global_batch(s, 4, 8, seed=0).numpy()
        assert all(any(np.array_equal(r, train[j * 9:(j + 1) * 9]) for j in range(nt)) for r in rows)


def test_given_tokenizer_file_and_hugging_face_directory(inputs: Path, tmp_path: Path) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(["some other text to learn merges from"] * 10, trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<pad>", "</s>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False))
    hf = tmp_path / "hf-tokenizer"
    hf.mkdir()
    tok.save(str(hf / "tokenizer.json"))
    (hf / "tokenizer_config.json").write_text(json.dumps({"eos_token": {"content": "</s>"}}))
    for source in (hf, hf / "tokenizer.json"):
        out = prepare([inputs / "table.parquet"], tmp_path / f"out-{source.name}", tokenizer=source,
                      text_field="body", val_fraction=0.5, progress=False)
        got = decoded(out, hf / "tokenizer.json")
        assert sorted(got["train"] + got["val"]) == sorted(t + "</s>" for t in PARQUET)
        meta = json.loads((out / "meta.json").read_text())
        assert meta["tokenizer"]["source"] == str(source.resolve())
        assert meta["tokenizer"]["eot_id"] == tok.token_to_id("</s>") and meta["vocab_size"] == tok.get_vocab_size()
        assert (out / "tokenizer.json").read_bytes() == (hf / "tokenizer.json").read_bytes()


def test_a_vocabulary_beyond_uint16_is_stored_as_uint32(inputs: Path, tmp_path: Path) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {f"w{i}": i for i in range(69_996)}
    vocab |= {"parquet": 69_996, "one": 69_997, "two:": 69_998, "[UNK]": 69_999, "</s>": 70_000}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.save(str(tmp_path / "tokenizer.json"))
    out = prepare([inputs / "table.parquet"], tmp_path / "out", tokenizer=tmp_path / "tokenizer.json",
                  text_field="body", val_fraction=0.5, progress=False)
    meta = json.loads((out / "meta.json").read_text())
    assert meta["dtype"] == "uint32" and meta["vocab_size"] == 70_001
    docs = sorted(read_split(out, "train", "<u4") + read_split(out, "val", "<u4"))
    assert docs == sorted([[69_996, 69_997, 70_000], [69_996, 69_998, 69_999, 69_999, 70_000]])
    assert int(TokenCorpus(out).global_batch(0, 1, 2, 0).min()) >= 69_996


def test_same_seed_same_corpus_other_seed_other_split(inputs: Path, tmp_path: Path, trained: Path) -> None:
    again = prepare(parquet_input(inputs), tmp_path / "again", train_tokenizer_vocab=400, val_fraction=0.3, seed=1,
                    progress=False)
    assert TokenCorpus(again).digest == TokenCorpus(trained).digest
    other = prepare(parquet_input(inputs), tmp_path / "other", train_tokenizer_vocab=400, val_fraction=0.3, seed=2,
                    progress=False)
    assert decoded(other)["val"] != decoded(trained)["val"]


# ---- bad input -----------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("kwargs, match", [
    ({}, "pass exactly one of tokenizer="),
    ({"train_tokenizer_vocab": 300, "tokenizer": "x"}, "pass exactly one of tokenizer="),
    ({"train_tokenizer_vocab": 300, "val_fraction": 0.0}, "val_fraction must be between 0 and 1"),
    ({"tokenizer": "/no/tokenizer.json"}, r"/no/tokenizer.json: no such tokenizer file"),
    ({"train_tokenizer_vocab": 100}, "needs a vocabulary of at least 258"),
])
def test_bad_arguments_are_named(inputs: Path, tmp_path: Path, kwargs: dict, match: str) -> None:
    with pytest.raises(CorpusError, match=match):
        prepare([inputs / "doc0.txt", inputs / "doc1.txt"], tmp_path / "out", progress=False, **kwargs)
    assert not list(tmp_path.iterdir())  # nothing written


def test_bad_inputs_are_named(inputs: Path, tmp_path: Path) -> None:
    go = dict(train_tokenizer_vocab=300, progress=False)
    with pytest.raises(CorpusError, match=r"/no/such.txt: no such input file"):
        prepare(["/no/such.txt"], tmp_path / "a", **go)
    with pytest.raises(CorpusError, match=r"doc0.txt: 1 document\(s\); a corpus needs at least 2"):
        prepare([inputs / "doc0.txt"], tmp_path / "b", **go)
    with pytest.raises(CorpusError, match=r"table.parquet: no column 'text' \(columns: body, n\)"):
        prepare([inputs / "table.parquet"], tmp_path / "c", **go)
    with pytest.raises(CorpusError, match=r"table.parquet: column 'n' holds int64, not text"):
        prepare([inputs / "table.parquet"], tmp_path / "c", text_field="n", **go)
    bad = tmp_path / "latin1.txt"
    bad.write_bytes("caf\u00e9".encode("latin-1"))
    with pytest.raises(CorpusError, match=r"latin1.txt.*could not be read as UTF-8 text"):
        prepare([bad, inputs / "doc0.txt"], tmp_path / "d", **go)
    with pytest.raises(CorpusError, match=r"empty: a directory without input files"):
        (tmp_path / "empty").mkdir()
        prepare([tmp_path / "empty"], tmp_path / "e", **go)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["empty", "latin1.txt"]


def test_a_tokenizer_without_end_of_text_is_named(inputs: Path, tmp_path: Path) -> None:
    from tokenizers import Tokenizer, models

    Tokenizer(models.WordLevel({"a": 0, "[UNK]": 1}, unk_token="[UNK]")).save(str(tmp_path / "tokenizer.json"))
    with pytest.raises(CorpusError, match=r"tokenizer.json has no end-of-text token .*pass eot_token="):
        prepare(parquet_input(inputs), tmp_path / "out", tokenizer=tmp_path / "tokenizer.json", progress=False)


def test_an_existing_output_is_kept_unless_overwrite(trained: Path, inputs: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    with pytest.raises(CorpusError, match=r"out: already exists; .*--overwrite"):
        prepare(parquet_input(inputs), out, train_tokenizer_vocab=300, progress=False)
    assert (out / "keep.txt").read_text() == "mine"
    prepare(parquet_input(inputs), out, train_tokenizer_vocab=300, progress=False, overwrite=True)
    assert not (out / "keep.txt").exists() and TokenCorpus(out).vocab_size > 256
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]


def test_a_crash_leaves_no_half_corpus(inputs: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import hspmd_sdk.data.pipeline as prep

    def crash(*args: object, **kwargs: object) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr(prep, "_write_splits", crash)
    with pytest.raises(KeyboardInterrupt):
        prepare(parquet_input(inputs), tmp_path / "out", train_tokenizer_vocab=300, progress=False)
    assert list(tmp_path.iterdir()) == []


def test_a_model_that_does_not_fit_is_named(trained: Path) -> None:
    corpus = TokenCorpus(trained)
    vocab = corpus.vocab_size
    assert corpus.check(2, 8, vocab) == []
    problems = corpus.check(2, 8, 300)
    assert any("beyond the model's vocabulary of 300" in p for p in problems)
    assert any(f"has {vocab} tokens but the model's vocabulary has only 300" in p for p in problems)
    assert any("fewer than the 100000 of one training step" in p for p in corpus.check(100_000, 8, vocab))


# ---- the command line ----------------------------------------------------------------------------------------------
def test_cli_prepare_and_show(inputs: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "cli"
    assert main(["data", "prepare", str(inputs / "table.parquet"), "--out", str(out), "--train-tokenizer", "300",
                 "--text-field", "body", "--val-fraction", "0.5", "--seed", "3", "--no-progress"]) == 0
    printed = capsys.readouterr().out
    assert f"wrote {out}" in printed and "train:" in printed and "val:" in printed
    assert sorted(decoded(out)["train"] + decoded(out)["val"]) == sorted(t + EOT for t in PARQUET)
    assert main(["data", "show", str(out)]) == 0
    shown = capsys.readouterr().out
    first = read_split(out, "train")[0]
    assert f"first {len(first)} tokens: {first}" in shown
    assert any(f"decoded: {t + EOT!r}" in shown for t in PARQUET)


def test_cli_errors_are_one_line(inputs: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["data", "show", str(inputs)]) == 1
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "meta.json: missing" in err and err.count("\n") == 1
    assert main(["data", "prepare", str(inputs), "--out", str(tmp_path / "o"), "--tokenizer",
                 str(tmp_path / "none.json"), "--no-progress"]) == 1
    assert "none.json: no such tokenizer file" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:  # one of --tokenizer / --train-tokenizer
        main(["data", "prepare", str(inputs), "--out", str(tmp_path / "o")])
    assert e.value.code == 2
    assert not (tmp_path / "o").exists()


# ---- the standard-library corpus -----------------------------------------------------------------------------------
def test_stdlib_corpus_is_prepared_once_and_reused(tmp_path: Path) -> None:
    start = time.perf_counter()
    out = stdlib_corpus(cache_dir=tmp_path)
    first = time.perf_counter() - start
    corpus = TokenCorpus(out)
    files = stdlib_source_files()
    meta = corpus.meta
    assert meta.vocab_size == 8192 and meta.dtype == "uint16"
    assert meta.splits["train"].documents + meta.splits["val"].documents == sum(f.stat().st_size > 0 for f in files)
    assert not any({"test", "tests", "idlelib", "site-packages"} & set(f.parts) for f in files)
    tok = tokenizers.Tokenizer.from_file(str(out / "tokenizer.json"))
    texts = {f.read_text(errors="replace") + EOT for f in files}
    docs = read_split(out, "train")
    assert tok.decode(docs[0], skip_special_tokens=False) in texts
    assert tok.decode(read_split(out, "val")[-1], skip_special_tokens=False) in texts
    assert corpus.check(8, 256, 8192) == []
    print(f"stdlib corpus: {first:.1f} s, {meta.splits['train'].tokens} + {meta.splits['val'].tokens} tokens")
    start = time.perf_counter()
    assert stdlib_corpus(cache_dir=tmp_path) == out
    assert time.perf_counter() - start < 1.0  # reused, not prepared again
    assert sorted(p.name for p in tmp_path.iterdir()) == [out.name]


@pytest.mark.slow
def test_stdlib_corpus_is_the_same_every_time(tmp_path: Path) -> None:
    a = TokenCorpus(stdlib_corpus(cache_dir=tmp_path / "a"))
    b = TokenCorpus(stdlib_corpus(cache_dir=tmp_path / "b"))
    assert a.digest == b.digest and a.meta == b.meta


def test_progress_bars_only_when_asked(inputs: Path, tmp_path: Path, capfd: pytest.CaptureFixture[str]) -> None:
    prepare(parquet_input(inputs), tmp_path / "quiet", train_tokenizer_vocab=300, progress=False)
    quiet = capfd.readouterr()
    assert quiet.out == "" and quiet.err == ""
    prepare(parquet_input(inputs), tmp_path / "loud", train_tokenizer_vocab=300, progress=True)
    assert "tokenize" in capfd.readouterr().err


def test_prepare_never_reaches_the_network(inputs: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import socket

    tried: list[object] = []

    def refuse(*args: object, **kwargs: object) -> None:
        tried.append(args[:2])
        raise OSError("no network in this test")

    monkeypatch.setattr(socket, "getaddrinfo", refuse)
    monkeypatch.setattr(socket.socket, "connect", refuse)
    out = prepare(parquet_input(inputs), tmp_path / "out", train_tokenizer_vocab=300, progress=False)
    assert tried == [] and TokenCorpus(out).meta.splits["train"].documents > 0
