"""The Llama family (the paper's Table 6 models): config and presets (:mod:`.config`), defined graph
(:mod:`.graph`), single-device reference (:mod:`.reference`), Hugging Face interop (:mod:`.hf`)."""
from __future__ import annotations

from ..._lazy import lazy_exports

_EXPORTS = {
    "LlamaConfig": ".config", "MODEL_PRESETS": ".config", "TP_SPLIT": ".config", "init_parameter": ".config",
    "build_llama_graph": ".graph", "param_shapes": ".graph", "layer_param_names": ".graph",
    "LlamaReference": ".reference",
}

__all__, __getattr__, __dir__ = lazy_exports(__name__, _EXPORTS, globals())
