"""Exercise 2 (30 minutes): a Laplacian head from scratch. The task is in exercises/README.md.

Write mixed_head_attention(attn, x) in at most 15 lines, then run:  python exercises/check.py 2
"""

import torch  # noqa: F401 (for your code)


def mixed_head_attention(attn, x):
    """What nanolap.MixedHeadAttention `attn` computes for tokens x (B, T, C), with P written out: the trailing
    attn.n_lap heads output (I - P) V, the others P V, then the output projection.

    Replace this body: it leaves attention out altogether, as if P were the identity, so every head outputs its
    own token's value and the check fails."""
    v = attn.qkv(x).chunk(3, dim=-1)[2]  # (B, T, C): the values of all heads, head after head
    return attn.proj(v)
