"""Exercise 3 (20 minutes): the causal case. The task is in exercises/README.md.

Fix first_position_logits(model, idx), then run:  python exercises/check.py 3
"""

import torch
import torch.nn.functional as F


def first_position_logits(model, idx):
    """The logits (B, vocab) that the nanolap GPT `model` predicts at position 0 of idx (B, T), computed from token 0
    alone. (nanolap's GPT blocks have no LayerScale and no dropout at evaluation.)

    Replace this body's marked line: it treats every head as an attention head, whose output at position 0 is v_0
    (row 0 of a causal P is (1, 0, ..., 0)). That is right for n_lap = 0 only, so the check fails."""
    x = F.rms_norm(model.wte(idx[:, 0]), (model.config.n_embd,))  # (B, d): token 0 after the embedding norm
    for block in model.blocks:
        attn = block.attn
        v0 = attn.qkv(block.norm1(x)).chunk(3, dim=-1)[2]  # (B, d): the values of token 0, head after head
        x = x + attn.proj(v0)  # replace this line: what do the trailing attn.n_lap heads output at position 0?
        x = x + block.mlp(block.norm2(x))
    logits = model.lm_head(model.norm(x)).float()
    cap = model.config.softcap
    return cap * torch.tanh(logits / cap) if cap else logits
