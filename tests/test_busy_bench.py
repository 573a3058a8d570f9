"""dev/busy_bench.py's plumbing on a fake tree whose scripts print progress lines at once: the parsing of each
script's progress line, the interleaving, the busy loop's end, the table. No timing is asserted."""

import json
import os
import re
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "dev"))
import busy_bench  # noqa: E402
import common  # noqa: E402
from common import UsageError  # noqa: E402

# the progress line of every script (common.progress_line) at step {} and speed {}, in each script's unit
UNITS = {"train_vit.py": "img/s", "train_gpt.py": "tok/s", "train_dino.py": "img/s"}
LINE = "step {{}}/2000 | loss 2.8002 | lr 2.00e-02 | {{}} {} | ep 0.03 | eta 5m34s"
FAKE = """import os, sys
def running(pid):  # is process pid a busy loop of the bench that started this script (not of another bench)?
    try:
        parent = int(open(f"/proc/{{pid}}/stat").read().rsplit(")", 1)[1].split()[1])
        return parent == os.getppid() and open(f"/proc/{{pid}}/cmdline", "rb").read().endswith({loop!r})
    except OSError:
        return False
busy = any(running(pid) for pid in os.listdir("/proc") if pid.isdigit())
with open(os.path.join(os.path.dirname(os.path.abspath(__file__)), "calls.txt"), "a") as f:
    f.write(repr((sys.argv, busy, os.environ.get("OMP_NUM_THREADS"))) + "\\n")
speeds = {speeds} if busy else {speeds_alone}
for step, speed in enumerate(speeds):
    print({line!r}.format(25 * (step + 1), speed))
"""


def fake_tree(root, scale):
    """A tree whose scripts print 3 progress lines each: speeds 9999 (the warm-up), then 100 and 300 x scale alone,
    and half that next to the busy loop; analyze.py only records its call."""
    os.makedirs(root)
    for name, line in [(name, LINE.format(unit)) for name, unit in UNITS.items()] + [("analyze.py", "")]:
        alone = ["9,999", f"{100 * scale:,}", f"{300 * scale:,}"]
        busy = ["9,999", f"{50 * scale:,}", f"{150 * scale:,}"]
        with open(os.path.join(root, name), "w") as f:
            f.write(FAKE.format(loop=busy_bench.BUSY_LOOP.encode() + b"\0", speeds=busy if line else [],
                                speeds_alone=alone if line else [], line=line))
    return str(root)


def test_progress_lines_of_each_script_are_parsed():
    for line, unit in [(LINE.format(unit), unit) for unit in ("img/s", "tok/s")]:
        out = "config: ...\neval step 0: val_loss 4.4\n" + "\n".join(line.format(25 * i, s) for i, s in
                                                                       enumerate(["12,000", "2,000", "4,000", "3,000"]))
        assert busy_bench.parse_speed(out) == 3000.0  # the first line (warm-up) is left out
        assert busy_bench.SPEED.findall(out)[0][1] == unit
    assert busy_bench.parse_speed("no progress") is None
    assert busy_bench.parse_speed(LINE.format("tok/s").format(25, "1,234")) == 1234.0  # a single line is all there is
    printed = common.progress_line(25, 2000, 2.8, 0.02, 1234.4, "tok/s", 0.5, "mfu 1.0%")  # as the scripts print it
    assert busy_bench.SPEED.findall(printed) == [("1,234", "tok/s")]


@pytest.mark.slow  # six seconds of subprocesses
def test_two_trees_interleaved_with_a_busy_loop(tmp_path):
    new, old = fake_tree(tmp_path / "new", 2), fake_tree(tmp_path / "old", 1)
    out = tmp_path / "out"
    env = dict(os.environ, OMP_NUM_THREADS="1")  # the bench must not hand it on: it measures the defaults
    done = subprocess.run([sys.executable, os.path.join(ROOT, "dev", "busy_bench.py"), f"--trees={new},{old}",
                           "--rounds=2", "--scripts=gpt,analyze", f"--out_dir={out}"],
                          capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    order = re.findall(r"round (\d)/2 (\w+) +(alone|busy) +(\S+):", done.stdout)
    assert [(r, s, c, t) for r, s, c, t in order if s == "gpt"] == [  # the rounds and trees alternate who goes first
        ("1", "gpt", "alone", new), ("1", "gpt", "busy", new), ("1", "gpt", "busy", old), ("1", "gpt", "alone", old),
        ("2", "gpt", "busy", new), ("2", "gpt", "alone", new), ("2", "gpt", "alone", old), ("2", "gpt", "busy", old)]
    calls = [eval(line) for line in open(os.path.join(new, "calls.txt"))]
    vit_prep = [argv for argv, _, _ in calls if argv[0].endswith("train_vit.py")]
    assert len(vit_prep) == 1  # analyze.py without vit in the list: one unmeasured ViT run to analyse
    assert [busy for argv, busy, _ in calls if argv[0].endswith("train_gpt.py")] == [False, True, True, False]
    assert all(omp is None for _, _, omp in calls)
    analyze = [argv for argv, _, _ in calls if argv[0].endswith("analyze.py")]
    assert len(analyze) == 4 and all(argv[1] == str(out / "tree0" / "analyze-input") for argv in analyze)
    rows = {(r["script"], r["tree"]): r for r in json.load(open(out / "busy_bench.json"))[:-1]}
    gpt_new, gpt_old = rows["gpt", new], rows["gpt", old]
    assert gpt_new["alone"] == 400.0 and gpt_new["busy"] == 200.0 and gpt_new["busy_over_alone"] == 0.5
    assert gpt_new["vs_first"] == 1.0 and gpt_old["vs_first"] == 0.5 and gpt_old["alone"] == 200.0
    assert rows["analyze", new]["unit"] == "samples/s"  # and a busy loop left running would show in a later alone run


@pytest.mark.slow
def test_bad_options(tmp_path):
    for options, message in (((ROOT, "gpt,bert", 1), "--scripts='gpt,bert': choose among vit,gpt,dino,analyze"),
                             ((str(tmp_path), "gpt", 1), f"{tmp_path} holds no nanolap code"),
                             ((ROOT, "gpt", 0), "--rounds=0: must be at least 1")):
        with pytest.raises(UsageError, match=re.escape(message)):
            busy_bench.parse_options(*options)
    assert busy_bench.parse_options(f"{ROOT},", "analyze,vit", 1) == ([ROOT], ["vit", "analyze"])
    done = subprocess.run([sys.executable, os.path.join(ROOT, "dev", "busy_bench.py"), "--rounds=0",
                           f"--out_dir={tmp_path / 'out'}"], capture_output=True, text=True, timeout=60)
    assert done.returncode == 1 and "--rounds=0: must be at least 1" in done.stderr, done.stderr  # as a user sees it
