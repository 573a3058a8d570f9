"""Exercise 9 (30 minutes): the KV cache of a Laplacian head. The task is in exercises/README.md.

Write cached_step(attn, x, cache), then run:  python exercises/check.py 9
"""

import torch  # noqa: F401 (for your code)
import torch.nn.functional as F  # noqa: F401 (for your code)


def cached_step(attn, x, cache):
    """One generation step of the causal nanolap.MixedHeadAttention `attn` (no RoPE) for the newest token x (B, 1, C).
    cache holds "k" and "v" (B, H, t, D), the normed keys and the values of the t earlier tokens (t = 0 at the first
    step): append this token's to them, and return the layer's output (B, 1, C) at the new position.

    Replace this body: it ignores the earlier tokens, as if the new token were the first. Every head outputs the
    token's own value, which only an attention head does and only at position 0, and nothing is cached, so the check
    fails."""
    v = attn.qkv(x).chunk(3, dim=-1)[2]  # (B, 1, C): this token's values, head after head
    return attn.proj(v)
