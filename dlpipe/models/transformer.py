"""A tiny decoder-only (causal) transformer for the token sequence dataset."""

from __future__ import annotations

import torch
from torch import nn


class TinyTransformer(nn.Module):
    """Token and learned position embeddings, pre-norm causal encoder layers, final LayerNorm, linear head.

    ``nn.TransformerEncoder`` with a causal mask is a GPT-style decoder: position t attends only to
    positions <= t, so logits at t predict token t + 1.

    Args:
        vocab_size: number of token ids (input and output), >= 1.
        seq_len: longest input sequence (size of the position table), >= 1.
        d_model: embedding width, >= 1 and divisible by n_heads.
        n_heads: attention heads per layer, >= 1.
        n_layers: number of encoder layers, >= 1.
        dropout: dropout probability in embeddings, attention and feed-forward, in [0, 1).
    """

    def __init__(
        self,
        vocab_size: int = 128,
        seq_len: int = 64,
        d_model: int = 64,
        n_heads: int = 4,
        n_layers: int = 2,
        dropout: float = 0.0,
    ):
        super().__init__()
        for key, value in (
            ("vocab_size", vocab_size), ("seq_len", seq_len), ("d_model", d_model),
            ("n_heads", n_heads), ("n_layers", n_layers),
        ):  # fmt: skip
            if value < 1:
                raise ValueError(f"model.{key}={value}: must be >= 1")
        if d_model % n_heads:
            raise ValueError(f"model.d_model={d_model} is not divisible by model.n_heads={n_heads}")
        if not 0.0 <= dropout < 1.0:
            raise ValueError(f"model.dropout={dropout}: must be >= 0 and < 1")
        self.seq_len = seq_len
        self.tok_emb = nn.Embedding(vocab_size, d_model)
        self.pos_emb = nn.Embedding(seq_len, d_model)
        self.drop = nn.Dropout(dropout)
        layer = nn.TransformerEncoderLayer(
            d_model, n_heads, dim_feedforward=4 * d_model, dropout=dropout,
            activation="gelu", batch_first=True, norm_first=True,
        )  # fmt: skip
        # enable_nested_tensor only applies to padding masks (none here) and warns with norm_first.
        self.encoder = nn.TransformerEncoder(layer, n_layers, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, vocab_size)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """[B, T] token ids with T <= seq_len -> logits [B, T, vocab_size]."""
        t = tokens.shape[1]
        if t > self.seq_len:
            raise ValueError(f"input length {t} exceeds model.seq_len={self.seq_len}")
        positions = torch.arange(t, device=tokens.device)
        x = self.drop(self.tok_emb(tokens) + self.pos_emb(positions))
        mask = nn.Transformer.generate_square_subsequent_mask(t, device=tokens.device, dtype=x.dtype)
        # is_causal=True is a hint that lets attention use its fused causal kernel; the mask stays the truth.
        x = self.encoder(x, mask=mask, is_causal=True)
        return self.head(self.norm(x))
