"""Exercise 7 (30 minutes): the spectrum by hand. The task is in exercises/README.md.

Fix k_alpha(h, alpha), then run:  python exercises/check.py 7 --run=out/ex5/back
"""

import torch


def k_alpha(h, alpha=0.99):
    """Mean over sequences of k_alpha: for each sequence X_i (T, d) of tokens h (N, T, d), centre its tokens,
    take the eigenvalues of X~_i^T X~_i from largest to smallest, and find the smallest k whose top k reach
    the fraction alpha of their sum.

    Replace this body: it forgets to centre the tokens, so the mean token counts as a direction of spread and
    the check fails."""
    ks = []
    for X in h.double():
        lam = torch.linalg.eigvalsh(X.T @ X).flip(0).clamp(min=0)  # (d,), largest first
        share = lam.cumsum(0) / lam.sum()
        ks.append(int((share < alpha).sum()) + 1)  # the first k whose share reaches alpha
    return sum(ks) / len(ks)
