"""The GPT-2 family (Hugging Face's ``GPT2LMHeadModel``, tied embeddings): config and presets (:mod:`.config`),
defined graph (:mod:`.graph`), single-device reference (:mod:`.reference`), Hugging Face interop (:mod:`.hf`)."""
from __future__ import annotations

from ..._lazy import lazy_exports

_EXPORTS = {
    "GPTConfig": ".config", "GPT_PRESETS": ".config", "TP_SPLIT": ".config", "init_parameter": ".config",
    "build_gpt_graph": ".graph", "param_shapes": ".graph", "layer_param_names": ".graph",
    "GPTReference": ".reference",
}

__all__, __getattr__, __dir__ = lazy_exports(__name__, _EXPORTS, globals())
