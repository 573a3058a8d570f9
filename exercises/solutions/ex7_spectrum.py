"""Exercise 7: the spectrum by hand. Reference solution."""

import torch


def k_alpha(h, alpha=0.99):
    """Mean over sequences of k_alpha: for each sequence X_i (T, d) of tokens h (N, T, d), centre its tokens,
    take the eigenvalues of X~_i^T X~_i from largest to smallest, and find the smallest k whose top k reach
    the fraction alpha of their sum."""
    ks = []
    for X in h.double():
        Xc = X - X.mean(dim=0)  # (T, d): the sequence's own mean token removed
        lam = torch.linalg.eigvalsh(Xc.T @ Xc).flip(0).clamp(min=0)  # (d,), largest first
        share = lam.cumsum(0) / lam.sum()
        ks.append(int((share < alpha).sum()) + 1)  # the first k whose share reaches alpha
    return sum(ks) / len(ks)
