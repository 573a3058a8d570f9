"""
How the CPU defaults keep their speed next to other work: train_vit.py, train_gpt.py, train_dino.py (each for a
fixed short number of steps) and analyze.py (on the ViT run just trained), each alone and next to one process that
keeps one core busy (a plain Python loop, as a browser tab or a second terminal would), as plain `python` runs them:
their own defaults, OMP_NUM_THREADS and OMP_WAIT_POLICY unset. Rounds interleave (alone, busy; the next round busy,
alone) and trees too, so that a drifting machine speed cancels in the ratios.

    python dev/busy_bench.py                                    # this tree: about 6 minutes on 2 idle cores
    python dev/busy_bench.py --trees=.,/work/base --rounds=1    # before/after: about 10 minutes
    python dev/busy_bench.py --scripts=gpt,analyze --rounds=3

Speed: the median of a script's own progress lines (img/s, tok/s) after its first one (which holds the warm-up);
for analyze.py, samples analysed per second of its wall time (start-up included). busy/alone is the median over
rounds of each round's pair; a fair share of 2 cores next to one busy core is 0.5. With several trees, `vs first`
is the median over rounds of this tree's speed alone over the first tree's. A tree is only read (cwd), never written:
every output goes to out_dir.
"""

import json
import os
import re
import statistics
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repo root
from common import UsageError  # noqa: E402
from configurator import configure  # noqa: E402

trees = "."  # code trees to measure, separated by commas (e.g. .,/work/base); the first is the reference of `vs first`
scripts = "vit,gpt,dino,analyze"  # which to measure, separated by commas
rounds = 2  # interleaved rounds; each runs every script alone and busy
vit_steps = 150  # optimizer steps of each run (about 15 s on 2 idle cores)
gpt_steps = 100  # optimizer steps of each GPT run
dino_steps = 100  # optimizer steps of each DINO run
analyze_samples = 500  # analyze.py --max_samples
out_dir = "/tmp/busy_bench"  # the runs' folders, their logs and busy_bench.json go here

SCRIPTS = ("vit", "gpt", "dino", "analyze")
SPEED = re.compile(r"^step \d+/\d+ \|.*?([\d,.]+) (img/s|tok/s)", re.M)  # the scripts' one progress line
# keeps one core busy, as another program would, and ends with the bench (even a killed one)
BUSY_LOOP = "import os\nparent = os.getppid()\nwhile os.getppid() == parent:\n    for _ in range(10 ** 6):\n        pass"


def log_every(steps):
    """Six progress lines per run, whatever its length (a stopped run prints none after its last full interval)."""
    return f"--log_interval={max(1, steps // 6)}"


def command(script, run_dir, vit_dir):
    """argv of one measured run (relative to its tree) and the unit of its speed."""
    if script == "vit":
        return ["train_vit.py", f"--stop_at_step={vit_steps}", log_every(vit_steps), f"--out_dir={run_dir}"], "img/s"
    if script == "gpt":  # no evaluation after step 0, no sample
        return ["train_gpt.py", f"--stop_at_step={gpt_steps}", log_every(gpt_steps), "--eval_interval=100000",
                "--max_new_tokens=0", f"--out_dir={run_dir}"], "tok/s"
    if script == "dino":  # small k-NN evaluations at step 0 and at the stop
        return ["train_dino.py", f"--stop_at_step={dino_steps}", log_every(dino_steps), "--eval_train=1000",
                "--eval_val=500", f"--out_dir={run_dir}"], "img/s"
    return ["analyze.py", vit_dir, f"--max_samples={analyze_samples}", f"--out={run_dir}"], "samples/s"


def parse_speed(stdout):
    """The median of the speeds of a training script's progress lines after the first; None without any."""
    speeds = [float(value.replace(",", "")) for value, _ in SPEED.findall(stdout)]
    return statistics.median(speeds[1:] or speeds) if speeds else None


def run_once(tree, script, busy, run_dir, vit_dir):
    """One run of `script` in `tree` (next to a busy loop if busy) -> (speed, unit); its output goes to run_dir.log."""
    argv, unit = command(script, run_dir, vit_dir)
    os.makedirs(os.path.dirname(run_dir), exist_ok=True)
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "OMP_WAIT_POLICY", "MKL_NUM_THREADS")}
    env.update(PYTHONUNBUFFERED="1", CUDA_VISIBLE_DEVICES="")  # the CPU defaults, as `python script` runs them
    env.pop("PYTHONPATH", None)  # each tree imports its own nanolap.py
    loop = subprocess.Popen([sys.executable, "-c", BUSY_LOOP]) if busy else None
    try:
        t0 = time.perf_counter()
        done = subprocess.run([sys.executable, *argv], cwd=tree, env=env, capture_output=True, text=True)
        seconds = time.perf_counter() - t0
    finally:
        if loop is not None:
            loop.kill()
            loop.wait()
    with open(run_dir + ".log", "w") as f:
        f.write(done.stdout + done.stderr)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)} in {tree} failed ({done.returncode}); its output: {run_dir}.log")
    speed = analyze_samples / seconds if script == "analyze" else parse_speed(done.stdout)
    if speed is None:
        raise RuntimeError(f"{' '.join(argv)} in {tree} printed no progress line with a speed; see {run_dir}.log")
    return speed, unit


def measure(tree_list, script_list, n_rounds, out):
    """{(tree, script): {"alone": [speed per round], "busy": [...], "unit": ...}}, the rounds interleaved."""
    speeds = {(t, s): {"alone": [], "busy": []} for t in tree_list for s in script_list}
    vit_dirs = {t: os.path.join(out, f"tree{i}", "analyze-input") for i, t in enumerate(tree_list)}
    for i, tree in enumerate(tree_list):
        if "analyze" in script_list and "vit" not in script_list:  # analyze.py needs a ViT run of its tree
            run_once(tree, "vit", False, vit_dirs[tree], None)
    for r in range(n_rounds):
        for script in script_list:
            for i, tree in enumerate(tree_list):
                for busy in (False, True) if (r + i) % 2 == 0 else (True, False):  # who goes first alternates
                    condition = "busy" if busy else "alone"
                    run_dir = os.path.join(out, f"tree{i}", f"{script}-r{r}-{condition}")
                    speed, unit = run_once(tree, script, busy, run_dir, vit_dirs[tree])
                    speeds[tree, script][condition].append(speed)
                    speeds[tree, script]["unit"] = unit
                    print(f"round {r + 1}/{n_rounds} {script:<8} {condition:<6} {tree}: {speed:,.1f} {unit}", flush=True)
                if script == "vit":  # analyze.py reads the latest ViT run of its tree
                    vit_dirs[tree] = os.path.join(out, f"tree{i}", f"vit-r{r}-alone")
    return speeds


def table(speeds, tree_list, script_list):
    """Rows (script, tree, alone, busy, busy/alone, vs first, unit): medians over rounds, ratios paired per round."""
    rows = []
    for script in script_list:
        first = speeds[tree_list[0], script]["alone"]
        for tree in tree_list:
            s = speeds[tree, script]
            ratio = statistics.median(b / a for a, b in zip(s["alone"], s["busy"]))
            vs_first = statistics.median(a / f for a, f in zip(s["alone"], first))
            rows.append((script, tree, statistics.median(s["alone"]), statistics.median(s["busy"]), ratio, vs_first, s["unit"]))
    return rows


def parse_options(trees, scripts, rounds):
    """The lists of trees (absolute paths) and scripts (in SCRIPTS' order) the options name; a UsageError if they
    name an unknown script or a folder without nanolap code, or ask for no round."""
    tree_list = [os.path.abspath(t) for t in trees.split(",") if t]
    script_list = [s for s in SCRIPTS if s in scripts.split(",")]  # vit before analyze, which reads its run
    unknown = set(scripts.split(",")) - set(SCRIPTS)
    if unknown or not script_list:
        raise UsageError(f"--scripts={scripts!r}: choose among {','.join(SCRIPTS)} (separated by commas)")
    missing = [t for t in tree_list if not os.path.isfile(os.path.join(t, "train_gpt.py"))]
    if missing or not tree_list:
        raise UsageError(f"--trees={trees!r}: {', '.join(missing) or 'no tree'} holds no nanolap code (train_gpt.py)")
    if rounds < 1:
        raise UsageError(f"--rounds={rounds}: must be at least 1")
    return tree_list, script_list


if __name__ == "__main__":
    configure(globals())
    tree_list, script_list = parse_options(trees, scripts, rounds)
    os.makedirs(out_dir, exist_ok=True)
    print(f"{os.cpu_count()} CPUs; {rounds} round(s) of {', '.join(script_list)} alone and next to one busy core, "
          f"in {', '.join(tree_list)}; logs in {out_dir}", flush=True)
    speeds = measure(tree_list, script_list, rounds, out_dir)
    rows = table(speeds, tree_list, script_list)
    print(f"\n{'script':<9}{'alone':>11}{'busy':>11}{'busy/alone':>12}{'vs first':>10}  unit       tree")
    for script, tree, alone, busy, ratio, vs_first, unit in rows:
        print(f"{script:<9}{alone:>11,.1f}{busy:>11,.1f}{ratio:>12.3f}{vs_first:>10.3f}  {unit:<10} {tree}")
    with open(os.path.join(out_dir, "busy_bench.json"), "w") as f:
        json.dump([dict(zip(("script", "tree", "alone", "busy", "busy_over_alone", "vs_first", "unit"), row))
                   for row in rows] + [{"runs": {f"{t} {s}": v for (t, s), v in speeds.items()}}], f, indent=1)
