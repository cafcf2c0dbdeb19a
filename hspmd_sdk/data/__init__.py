"""Training data (SPEC §14): prepared token corpora, memory-mapped, in a deterministic global order.

* :func:`prepare` turns local text / JSON lines / parquet files into a prepared corpus directory
  (``train.bin``, ``val.bin``, ``train.idx``, ``val.idx``, ``meta.json``: :mod:`.format`);
* :class:`TokenCorpus` opens one (checked, read-only memory maps) and serves fixed-length training batches in the
  order of :func:`sample_indices`, validation batches, and documents for mixed-length training;
* :func:`stdlib_corpus` is a real corpus available offline everywhere: the standard library's source, prepared
  once and cached.

``data="DIR"`` in a run trains on the corpus in ``DIR`` (``runtime.data.dataset_for``).  Names are imported
lazily: ``import hspmd_sdk.data`` pulls in neither torch, ``datasets`` nor ``tokenizers``.
"""
from __future__ import annotations

from .._lazy import lazy_exports

_EXPORTS = {
    "TokenCorpus": ".corpus",
    "CorpusError": ".format",
    "CorpusMeta": ".format",
    "SplitMeta": ".format",
    "TokenizerMeta": ".format",
    "FORMAT_VERSION": ".format",
    "dtype_for": ".format",
    "sample_indices": ".order",
    "epoch_permutation": ".order",
    "PermutationCache": ".order",
    "prepare": ".pipeline",
    "stdlib_corpus": ".stdlib",
    "stdlib_source_files": ".stdlib",
    "load_tokenizer": ".tokenizer",
    "train_bpe": ".tokenizer",
    "EOT_TOKEN": ".tokenizer",
}

__all__, __getattr__, __dir__ = lazy_exports(__name__, _EXPORTS, globals())
