"""Mixed-length data (SPEC §7): documents, chunks, token-budget steps, padded micro-batches — pure, no workers."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from hspmd_sdk import GPTConfig, LlamaConfig
from hspmd_sdk.runtime.data import (Documents, LengthBatches, chunk_documents, length_distribution, padded_rows,
                                    stdlib_files)
from hspmd_sdk.runtime.data import documents_for
from hspmd_sdk.runtime.workers.mixed_worker import micro_batch_feeds, target_placeholders


def _docs(seed: int = 0, n: int = 60) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    lens = np.clip(np.exp(rng.normal(np.log(10), 1.0, n)), 0, 300).astype(int)
    return [rng.integers(0, 256, int(k)) for k in lens]


def _pairs(tokens: np.ndarray) -> list[tuple[int, int, int]]:
    return [(i, int(tokens[i]), int(tokens[i + 1])) for i in range(tokens.size - 1)]


def test_long_documents_are_cut_into_chunks_that_keep_every_next_token_pair_once() -> None:
    doc = np.arange(23) % 7 + np.arange(23) * 10  # distinct tokens: a pair's position is recoverable
    chunks = chunk_documents(Documents([doc, np.array([5]), np.array([], dtype=np.int64)]), 5)
    assert [c.size for c in chunks] == [6, 6, 6, 6, 3]  # 22 pairs: 5 + 5 + 5 + 5 + 2; no pair in 1-token docs
    seen = [(int(c[j]), int(c[j + 1])) for c in chunks for j in range(c.size - 1)]
    assert sorted(seen) == sorted((a, b) for _, a, b in _pairs(doc))
    assert len(seen) == len(set(seen)) == doc.size - 1


def test_steps_depend_only_on_data_seed_budget_and_partition_the_stream() -> None:
    docs = Documents(_docs())
    a = LengthBatches(docs, context=64, tokens_per_step=200, seed=5)
    b = LengthBatches(Documents(_docs()), context=64, tokens_per_step=200, seed=5)
    steps = [a.step_indices(k) for k in range(12)]
    assert steps == [b.step_indices(k) for k in range(12)]  # a fresh object, another process: the same steps
    assert steps != [LengthBatches(docs, context=64, tokens_per_step=200, seed=6).step_indices(k) for k in range(12)]
    for k in range(12):
        assert 1 <= len(steps[k]) and sum(a.step_lengths(k)) <= 200
        assert a.step_targets(k) == sum(int(s.size) - 1 for s in a.step_sequences(k))
    # consecutive steps take consecutive stretches of per-epoch permutations: every sequence once an epoch
    flat = [i for s in steps for i in s]
    n = len(a.sequences)
    assert sorted(flat[:n]) == list(range(n))
    assert max(a.lengths) <= 64 and min(a.lengths) >= 1


def test_bad_documents_and_budgets_are_refused_with_the_reason() -> None:
    with pytest.raises(ValueError, match="nothing to train"):
        LengthBatches(Documents([np.array([3]), np.array([], dtype=np.int64)]), context=8, tokens_per_step=64)
    with pytest.raises(ValueError, match="smaller than one chunk"):
        LengthBatches(Documents(_docs()), context=64, tokens_per_step=63)
    with pytest.raises(ValueError, match=r"\[1\].*1-d array of integer"):
        Documents([np.array([1, 2]), np.array([0.5, 1.5])])
    with pytest.raises(ValueError, match="negative"):
        Documents([np.array([1, -2])])
    with pytest.raises(ValueError, match="vocabulary of 16"):
        Documents([np.array([1, 20])], vocab_size=16)
    with pytest.raises(ValueError, match="no such file"):
        documents_for("/nonexistent/tokens.txt")
    with pytest.raises(ValueError, match="model's vocabulary"):
        documents_for([np.array([1, 300])], 256)


def test_a_tokenized_text_file_is_one_document_a_line(tmp_path: Path) -> None:
    path = tmp_path / "tokens.txt"
    path.write_text("1 2 3 4\n\n7 8\n")
    docs = documents_for(str(path))
    assert [d.tolist() for d in docs.docs] == [[1, 2, 3, 4], [], [7, 8]] and docs.vocab_size == 9
    path.write_text("1 two 3\n")
    with pytest.raises(ValueError, match="tokens.txt:1"):
        Documents.from_file(path)


def test_the_standard_library_one_document_per_file_is_long_tailed() -> None:
    docs = Documents.stdlib(max_files=300)
    lengths = length_distribution(docs)
    assert len(lengths) > 250 and docs.vocab_size == 256
    median, p99 = np.percentile(lengths, [50, 99])
    assert p99 > 8 * median  # a long tail: the longest files dwarf the typical one
    chunks = length_distribution(docs, 512)
    assert chunks.max() == 512 and chunks.sum() == lengths.sum()  # cut, nothing dropped
    files = stdlib_files()[:300]  # one document per file, in corpus order
    assert len(docs) == 300 and all(d.tobytes() == p.read_bytes() for d, p in zip(docs.docs[::50], files[::50]))


@pytest.mark.parametrize("family", ["llama", "gpt"])
def test_padded_micro_batch_feeds_mask_padding_targets_only(family: str) -> None:
    model = LlamaConfig.preset("tiny") if family == "llama" else GPTConfig.preset("tiny")
    graph = model.build_graph()
    seqs = [np.array([5, 6, 7, 8, 9]), np.array([1, 2])]
    rows = padded_rows(seqs)
    assert rows.tolist() == [[5, 6, 7, 8, 9], [1, 2, -100, -100, -100]]
    feeds = micro_batch_feeds(model, graph, seqs)
    targets = target_placeholders(graph)
    assert len(targets) == 1
    (t,) = targets
    assert feeds[t].tolist() == [[6, 7, 8, 9], [2, -100, -100, -100]]
    others = [v for k, v in feeds.items() if k != t]
    assert others and all(int(v.min()) >= 0 for v in others if not torch.is_floating_point(v))
    # the reference's loss over the padded micro-batch is the mean over the real targets (its ignore_index)
    ref = model.build_reference(0)
    tok = next(v for k, v in feeds.items() if k != t)
    with torch.no_grad():
        got = float(ref.loss(tok, feeds[t]))
        want = sum(float(torch.nn.functional.cross_entropy(ref(torch.from_numpy(s[None, :-1]))[0],
                                                           torch.from_numpy(s[1:]), reduction="sum")) for s in seqs)
    assert abs(got - want / 5) < 1e-5
