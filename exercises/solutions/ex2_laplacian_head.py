"""Exercise 2: a Laplacian head from scratch. Reference solution."""

import torch


def mixed_head_attention(attn, x):
    """What nanolap.MixedHeadAttention `attn` computes for tokens x (B, T, C), with P written out: the trailing
    attn.n_lap heads output (I - P) V, the others P V, then the output projection."""
    B, T, C = x.shape
    H, D = attn.n_head, attn.head_dim
    q, k, v = attn.qkv(x).view(B, T, 3, H, D).unbind(2)  # each (B, T, H, D)
    q, k, v = attn.q_norm(q).transpose(1, 2), attn.k_norm(k).transpose(1, 2), v.transpose(1, 2)  # (B, H, T, D)
    scores = q @ k.transpose(-2, -1) / D ** 0.5  # (B, H, T, T)
    if attn.causal:  # token t sees tokens 0..t
        scores = scores.masked_fill(torch.ones(T, T, dtype=torch.bool).triu(1), float("-inf"))
    P = scores.softmax(dim=-1)  # (B, H, T, T), rows sum to 1
    laplacian = torch.eye(T) - P  # (B, H, T, T)
    is_lap = (torch.arange(H) >= H - attn.n_lap).view(1, H, 1, 1)  # the trailing n_lap heads
    y = torch.where(is_lap, laplacian, P) @ v  # (B, H, T, D)
    return attn.proj(y.transpose(1, 2).reshape(B, T, C))
