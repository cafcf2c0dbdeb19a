"""What every family's single-device reference shares: ``forward`` (embed, the blocks in order, the head) and the
``loss`` the runtime's references train with.  A family's reference implements ``embed_tokens``, ``block(i, h)``,
``head`` and ``replicated(i, h)`` (the part of block ``i`` that TP leaves whole, for the cost model's profile)."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class DecoderReference(nn.Module):
    """A decoder-only LM as a sequence of ``len(self.layers)`` blocks between an embedding and a head."""

    layers: nn.ModuleList

    def embed_tokens(self, tokens: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def block(self, i: int, h: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def head(self, h: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.embed_tokens(tokens)
        for i in range(len(self.layers)):
            h = self.block(i, h)
        return self.head(h)

    def loss(self, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Mean cross-entropy over all real target positions (targets ``-100`` are padding), in fp32 whatever the
        module's dtype."""
        logits = self(tokens)
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), targets.reshape(-1))
