"""Exercise 3: the causal case. Reference solution."""

import torch
import torch.nn.functional as F


def first_position_logits(model, idx):
    """The logits (B, vocab) that the nanolap GPT `model` predicts at position 0 of idx (B, T), computed from token 0
    alone. A causal row 0 of P is (1, 0, ..., 0): an attention head outputs v_0 there, a Laplacian head
    v_0 - v_0 = 0. (nanolap's GPT blocks have no LayerScale and no dropout at evaluation.)"""
    x = F.rms_norm(model.wte(idx[:, 0]), (model.config.n_embd,))  # (B, d): token 0 after the embedding norm
    for block in model.blocks:
        attn = block.attn
        v0 = attn.qkv(block.norm1(x)).chunk(3, dim=-1)[2]  # (B, d): the values of token 0, head after head
        A = (attn.n_head - attn.n_lap) * attn.head_dim  # channels of the attention heads; the rest are Laplacian
        v0 = torch.cat([v0[:, :A], torch.zeros_like(v0[:, A:])], dim=-1)  # Laplacian heads: v_0 - v_0 = 0
        x = x + attn.proj(v0)
        x = x + block.mlp(block.norm2(x))
    logits = model.lm_head(model.norm(x)).float()
    cap = model.config.softcap
    return cap * torch.tanh(logits / cap) if cap else logits
