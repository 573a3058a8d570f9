"""Exercise 4: depth and oversmoothing. Reference solution."""


def within_seq_frac(h):
    """WithinSeqVar / TotalVar of tokens h (N, T, d): N sequences of T tokens.
    WithinSeqVar = mean_it |h_it - mu_i|^2 with mu_i the mean token of sequence i,
    TotalVar = mean_it |h_it - mu_G|^2 with mu_G the mean of all N * T tokens."""
    h = h.double()
    mu_i = h.mean(dim=1, keepdim=True)  # (N, 1, d)
    mu_G = h.mean(dim=(0, 1))  # (d,)
    return ((h - mu_i).square().sum(-1).mean() / (h - mu_G).square().sum(-1).mean()).item()
