"""Exercise 4 (30 minutes): depth and oversmoothing. The task is in exercises/README.md.

Write within_seq_frac(h), then run:  python exercises/check.py 4
"""


def within_seq_frac(h):
    """WithinSeqVar / TotalVar of tokens h (N, T, d): N sequences of T tokens.
    WithinSeqVar = mean_it |h_it - mu_i|^2 with mu_i the mean token of sequence i,
    TotalVar = mean_it |h_it - mu_G|^2 with mu_G the mean of all N * T tokens.

    Replace this body: it measures every token's spread around the global mean mu_G, not around its own sequence's
    mean mu_i, so it always returns 1 and the check fails."""
    h = h.double()
    mu_G = h.mean(dim=(0, 1))  # (d,)
    spread = (h - mu_G).square().sum(-1).mean()
    return (spread / spread).item()
