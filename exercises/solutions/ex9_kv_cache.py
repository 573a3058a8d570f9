"""Exercise 9: the KV cache of a Laplacian head. Reference solution."""

import torch
import torch.nn.functional as F


def cached_step(attn, x, cache):
    """One generation step of the causal nanolap.MixedHeadAttention `attn` (no RoPE) for the newest token x (B, 1, C).
    cache holds "k" and "v" (B, H, t, D), the normed keys and the values of the t earlier tokens (t = 0 at the first
    step): append this token's to them, and return the layer's output (B, 1, C) at the new position."""
    B, _, C = x.shape
    H, D = attn.n_head, attn.head_dim
    q, k, v = attn.qkv(x).view(B, 1, 3, H, D).unbind(2)  # each (B, 1, H, D)
    q, k, v = attn.q_norm(q).transpose(1, 2), attn.k_norm(k).transpose(1, 2), v.transpose(1, 2)  # (B, H, 1, D)
    cache["k"] = torch.cat([cache["k"], k], dim=2)  # (B, H, t + 1, D)
    cache["v"] = torch.cat([cache["v"], v], dim=2)  # (B, H, t + 1, D)
    # the new token may see every cached token and itself: no mask
    pv = F.scaled_dot_product_attention(q, cache["k"], cache["v"])  # (B, H, 1, D): row t of P V
    is_lap = (torch.arange(H) >= H - attn.n_lap).view(1, H, 1, 1)  # the trailing n_lap heads
    y = torch.where(is_lap, v - pv, pv)  # (B, H, 1, D): v_t - sum_s P_ts v_s, with v_t this token's own value
    return attn.proj(y.transpose(1, 2).reshape(B, 1, C))
