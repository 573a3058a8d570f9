"""
The instructor's tools for the exercises (exercises/README.md):

    python exercises/instructor.py --students-copy DIR   # the repository for a class, without the answers
    python exercises/instructor.py --write-expected      # exercises/expected.json from the reference solutions

The students' copy holds what git sees (the tracked files and the untracked ones it does not ignore: no runs, data or
virtual environment), without HELD_BACK and without the passages of the pages that point to them. --write-expected
runs the reference solutions on fixed inputs the way exercises/check.py runs a student's code, with its helpers, so
that the file holds what the checks compare with.
"""

import json
import os
import re
import shutil
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))  # the repo root: nanolap, common, geometry
import torch  # noqa: E402

import check  # noqa: E402  (exercises/check.py, beside this file: the exercises' files, fixed layers, cached steps)
import common  # noqa: E402
import geometry  # noqa: E402
from nanolap import MixedHeadAttention, make_config  # noqa: E402

HELD_BACK = ("exercises/solutions/", "exercises/INSTRUCTOR.md")  # what a students' copy leaves out
# a passage of a page that points to HELD_BACK, left out of the students' copy with its two markers
INSTRUCTORS_ONLY = re.compile(r"<!-- instructors only -->\n.*?<!-- end of instructors only -->\n\n?", re.S)

# ---- the students' copy --------------------------------------------------------------------------------------------

def committed_starters(root):
    """Every starter as the last commit holds it (git show HEAD:...), by path; a UsageError names those it lacks."""
    committed = {}
    missing = []
    for name in check.FILES.values():
        path = f"exercises/{name}"
        shown = subprocess.run(["git", "show", f"HEAD:./{path}"], cwd=root, capture_output=True, timeout=60)
        if shown.returncode == 0:
            committed[path] = shown.stdout
        else:
            missing.append(path)
    if missing:
        raise common.UsageError(f"--students-copy takes the starters from the last commit, which lacks "
                                f"{', '.join(missing)}: commit them first")
    return committed


def copy_file(root, path, dest):
    """Copy the file at path (relative to root) into dest; a page (.md) without its passages for instructors."""
    os.makedirs(os.path.dirname(os.path.join(dest, path)), exist_ok=True)
    shutil.copy2(os.path.join(root, path), os.path.join(dest, path))
    if path.endswith(".md"):
        with open(os.path.join(dest, path), encoding="utf-8", newline="") as f:
            page = f.read()
        with open(os.path.join(dest, path), "w", encoding="utf-8", newline="") as f:
            f.write(INSTRUCTORS_ONLY.sub("", page))


def students_copy(dest):
    """Copy the repository as git sees it to the new folder dest, without HELD_BACK and the pages' passages that point
    to it. The starters come from the last commit, not from the working tree: an instructor who tried an exercise here
    must not hand out the solved file."""
    root = os.path.dirname(HERE)
    if os.path.exists(dest):
        raise common.UsageError(f"--students-copy={dest}: it exists already; name a new folder")
    try:
        listed = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=root,
                                capture_output=True, text=True, timeout=60)
    except OSError:
        listed = None
    if listed is None or listed.returncode != 0:
        raise common.UsageError(f"--students-copy needs git and the repository's git checkout ({root} is none)")
    starters = committed_starters(root)
    files = [f for f in listed.stdout.split("\0") if f and not f.startswith(HELD_BACK) and f not in starters
             and os.path.isfile(os.path.join(root, f))]
    for f in files:
        copy_file(root, f, dest)
    changed = []
    for f, content in starters.items():
        os.makedirs(os.path.dirname(os.path.join(dest, f)), exist_ok=True)
        with open(os.path.join(dest, f), "wb") as out:
            out.write(content)
        working = os.path.join(root, f)
        if not os.path.isfile(working) or open(working, "rb").read() != content:
            changed.append(f)
    print(f"wrote {dest}: {len(files) + len(starters)} files, without {' and '.join(HELD_BACK)}; the starters as "
          f"last committed")
    if changed:
        print(f"  not from this working tree, where they differ (solved?): {', '.join(changed)}")

# ---- the expected values --------------------------------------------------------------------------------------------

def write_expected():
    """exercises/expected.json: fixed inputs (small integers, exact in any float type; the layers' weights quarters of
    them) and what the reference solutions of exercises 4, 7, 9 and 10 return for them. Run it after changing a case
    or a solution."""
    g = torch.Generator().manual_seed(0)

    def ints(*shape, low=-9, high=10):
        return torch.randint(low, high, shape, generator=g).float()
    x = ints(4, 5, 3)
    hand = torch.tensor([[[7.0, 0.0], [-7.0, 0.0], [0.0, 1.0], [0.0, -1.0]]])  # centred; eigenvalues 98 and 2
    cases = {4: [("random tokens", x), ("shifted sequences", x + ints(4, 1, 3, low=-50, high=50)),
                 ("identical tokens in each sequence", ints(4, 1, 3).expand(4, 5, 3))],
             7: [("hand case, eigenvalues 98 and 2", hand), ("the same tokens shifted by (100, 100)", hand + 100),
                 ("random tokens", ints(6, 9, 5)), ("tokens of rank 3 in 8 dimensions", ints(6, 9, 3) @ ints(3, 8))]}
    ex4 = check.load(4, solution=True)
    ex7 = check.load(7, solution=True)
    values = {4: lambda h: {"within_seq_frac": ex4.within_seq_frac(h)},
              7: lambda h: {f"k_{alpha}": ex7.k_alpha(h, alpha) for alpha in geometry.ALPHAS}}
    written = {number: [dict(name=name, h=h.tolist(), **values[number](h)) for name, h in inputs]
               for number, inputs in cases.items()}
    C = check.SMALL["n_embd"]
    # weights of a quarter and tokens of a few units: scores of order 1, so that P is neither uniform nor one-hot
    weights = dict(qkv=ints(3 * C, C, low=-2, high=3) / 4, proj=ints(C, C, low=-2, high=3) / 4)
    h = ints(1, 6, C, low=-3, high=4)  # (B, T, C)
    layer = MixedHeadAttention(make_config("gpt-tiny", vocab_size=10, **check.SMALL), n_lap=1)
    attn = check.fixed_layer(layer, weights)
    out = check.cached_steps(check.load(9, solution=True), attn, h)[0]
    written[9] = [dict(name="2 heads of size 4, the second Laplacian, 6 tokens", n_lap=1,
                       **{k: w.tolist() for k, w in weights.items()}, h=h.tolist(), out=out.tolist())]
    relative = check.load(10, solution=True).AttnScaleAttention(make_config("vit-cpu", bias=False, **check.SMALL))
    module = check.fixed_layer(relative, weights)
    lam = torch.tensor([0.5, -2.0])
    with torch.no_grad():
        module.lam.copy_(lam)
        out = module(h)
    written[10] = [dict(name="2 heads of size 4, lambda 0.5 and -2, 6 tokens", lam=lam.tolist(),
                        **{k: w.tolist() for k, w in weights.items()}, h=h.tolist(), out=out.tolist())]
    lines = [f'"{number}": [\n' + ",\n".join(json.dumps(case) for case in exercise_cases) + "\n]"
             for number, exercise_cases in written.items()]  # one case per line
    with common.atomic_write(check.EXPECTED) as f:
        f.write(("{\n" + ",\n".join(lines) + "\n}\n").encode())
    print(f"wrote {check.EXPECTED}")

# ---- run ------------------------------------------------------------------------------------------------------------

def main(argv=None):
    """--students-copy DIR or --write-expected; returns the exit status (2: a one-line error, or no such command)."""
    argv = sys.argv[1:] if argv is None else list(argv)
    try:
        if argv[:1] == ["--students-copy"] and len(argv) == 2:
            students_copy(argv[1])
        elif argv == ["--write-expected"]:
            write_expected()
        else:
            print(__doc__.strip())
            return 0 if {"-h", "--help"} & set(argv) else 2
    except common.UsageError as e:
        print(f"error: {e}")
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
