"""
nanolap on one GPU, checked in two commands of at most 5 minutes each, start-up included: no network, and no data
but what the check generates, except Fashion-MNIST for `default` (see Data below).

    python tests/gpu_check.py --only=equal,tests,torchrun,cost --out_dir=out-gpu-check/model   # plans 280 s
    python tests/gpu_check.py --only=scripts,default --out_dir=out-gpu-check/scripts            # plans 280 s

Parts (each adds rows to one table; a failed row makes the exit status 1; a machine without CUDA gets one line and
exit status 2):
  equal     the fused path equals the explicit (I - P) V path on CUDA, logits and gradients, for a ViT and a GPT
            with a mixed per-layer n_lap, attention and uniform graphs: float32 (TF32 off) with SDPA restricted to
            the memory-efficient kernel, half precision autocast restricted to FlashAttention and then to the
            memory-efficient kernel (sdpa_kernel raises when the restricted kernel cannot run, so a passing row ran
            on it). Below compute capability 8.0 FlashAttention cannot run: its rows say so and do not fail
  cost      forward+backward in half precision autocast of ViT-S/16 at 197 tokens and a d12 GPT at T = 1024, each with
            0, 3 and 6 of its 6 heads Laplacian (3 of 6: the mix of gpt_d20's 5 of 10 and of the DINO recipe; 6 of 6:
            the ViT recipes) and the same weights: eager for every layout, then each layout's whole model compiled as
            the scripts' --compile_model does (torch.compile(model)), in COMPILE_ORDER for as long as the compile times
            measured so far say the next one fits; the median of interleaved rounds. It runs in a child process
  scripts   the config/ recipes cut to SCRIPT_STEPS training steps (about a minute once compiled) on generated data,
            in half precision: config/gpt_d20.py as nanochat's d12 (768 wide, 6 heads of 128, 3 Laplacian) at
            T = 1024 with a GPT-2-sized vocabulary; config/vit_cifar10.py's DeiT-III recipe on ViT-S/16 at 224 px (6 of 6
            Laplacian), both compiled as their recipes; config/dino_vits16_imagenet.py's ViT-S/16 (3 of 6 Laplacian,
            2 global crops of 224 px and 8 local ones of 96 px), eager as that recipe. Rows: steps/s, images or tokens/s,
            MFU, compile and warm-up time (training and evaluation graphs; DINO's is warm-up and k-NN), peak memory;
            and the loop's efficiency: the training step's ms (from the progress lines' rate) over the ms its networks
            alone take for one step, measured in the run's process once the script has ended (the CUDA context warm,
            Inductor's cache holding the graphs): the same model config, batch, dtype and compile, built afresh
            from the run's checkpoint, forward and backward on random inputs (DINO: the teacher's forward on the
            global crops too), the median of 3 rounds of 3 passes. 1.00 = the step costs no more than its model;
            the rest is the loop's (data, augmentation, loss, optimizer, EMA, launch gaps). Measured, not derived from
            MFU: the cost part's sizes and batches differ from the recipes'. And the host syncs between progress
            lines, under CUDA's sync debug mode (count_syncs): a recipe that syncs at a step that prints nothing fails
  default   the CPU default ViT recipe to the end, in float32 (TF32 matmuls) as the CPU seeds ran (one process of
            batch 256: the global batch of the CPU default's 2 x 128); its accuracy must lie within their spread
  torchrun  train_gpt.py (and with 2 GPUs train_vit.py) under torchrun with 1 process (2 where there are 2 GPUs):
            with one GPU the world size is 1, so it exercises NCCL's start-up only, no gradient exchange
  tests     the repository's CUDA-only tests (CUDA_TESTS)

Half precision is bfloat16 from compute capability 8.0 on, float16 with a gradient scaler below it (a T4, a V100),
as the scripts' --dtype=auto decides.

The plan. A command has --deadline seconds from its process start (importing torch counts). It first prints its
plan: each part (each run of scripts and torchrun) with the seconds it is planned to take and where they come from:
this GPU's and this torch's last cold measurement in --measured (a JSON file each command updates: a run's seconds
beside its training steps and per step; a cost compile's seconds, when Inductor took no graph from its cache), else
ESTIMATE and training steps from their FLOPs at ASSUMED_MFU. What does not fit is skipped, lowest PRIORITY first (a
row marked skip, RESULT skipped=N; run that part alone with --only), and a script run that does not fit whole is
shortened, down to MIN_STEPS. The plan is made again from the time left as each part starts. A run may take SLACK
times its plan, never the time planned for the runs after it; cost, last in its command, takes what is left and plans
its compiles itself.

A run that outlives its time is asked for its Python stacks (SIGUSR1, which the runs hand to faulthandler; pytest
dumps them itself before its limit) and then killed with every process it started. Each run's output goes line by
line, with the second it came, to out_dir/<part>-<run>.log, so a killed run keeps its lines; its row says its last
line and where its stacks were (compiling, in torch.distributed, or the innermost frame): a slow compile is told from
a hang. Each part's rows and the RESULT line so far go to out_dir/gpu_check.txt and out_dir/result.txt as the part
ends. Should the command itself outlive its deadline by GRACE seconds (a part in this process that hangs), the
watchdog dumps every stack, kills every run and exits in one line: deadline + GRACE + its DUMP_WAIT stay within the
300 seconds a GPU lease allows a command.

The loop of any one run (the README's gpt-small line, say), outside the plan: the scripts part's child process,
    python tests/gpu_check.py --run_script=train_gpt.py --model_passes=True --colour=0 --preset=gpt-small ...
ends with `gpu_check model_fwd_bwd_ms=M passes=1`; the step's ms is 1000 x its tokens (or images) per step / the
progress lines' tok/s (img/s), and its loop efficiency that over M.

Data: the scripts train on generated data (32x32 colour images made by this file, resized on the device; a token
set of 8-token words over GPT-2's vocabulary size, written to out_dir/data). `default` reads Fashion-MNIST's four
.gz files from data/fashion_mnist or the Debian package's folder, checked at the start (missing: a failed row).
"""

import atexit
import builtins
import faulthandler
import gc
import itertools
import json
import math
import os
import re
import runpy
import signal
import statistics
import subprocess
import sys
import threading
import time
import traceback
import warnings
from collections import Counter
from contextlib import nullcontext, suppress
from dataclasses import dataclass, replace
from functools import partial

import numpy as np
import torch
import torch.nn.functional as F

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
import common  # noqa: E402
from common import peak_flops, write_result  # noqa: E402
from configurator import configure  # noqa: E402
from conftest import float32_matmuls, parse_result, randomise  # noqa: E402
from data import images  # noqa: E402
from nanolap import Config, DINOHead, build_model, make_config  # noqa: E402

only = "all"  # comma-separated parts, run in the order given: equal,tests,torchrun,cost,scripts,default (all = these)
rounds = 7  # cost: interleaved rounds; the median ratio is reported
repeats = 3  # cost: forward+backward passes per timing
out_dir = "out-gpu-check"  # the scripts' runs go to out_dir/<run>, the rows to gpu_check.txt, the RESULT line to result.txt
deadline = 280  # seconds for the whole command from its process start (a GPU lease allows 300 a command)
measured = "out-gpu-check/measured.json"  # seconds measured by earlier commands on this GPU and torch: they plan the next

PARTS = ("equal", "tests", "torchrun", "cost", "scripts", "default")
# the tests that skip without CUDA (tests/test_compiled.py checks that this list names every one of them)
CUDA_TESTS = ["tests/test_gpt.py::test_cuda_bf16_training_and_resume",
              "tests/test_nanolap.py::test_cuda_fused_equals_explicit_and_the_fast_kernel_is_eligible"]
CPU_DEFAULT_VAL_ACC = (0.9015, 0.8956, 0.9001)  # RESULTS.md: `python train_vit.py` on a 2-core CPU, seeds 0, 1, 2
# fused against explicit, max |difference| / max |explicit value|: float32 differs by summation order only; half
# precision keeps 8 (bfloat16) or 11 (float16) significant bits, and the two paths round P, P V and V - P V apart
EQUAL_LIMITS = {torch.float32: (1e-4, 1e-3), torch.bfloat16: (5e-2, 1e-1), torch.float16: (5e-2, 1e-1)}  # (logits, grads)
COST_LIMIT = 1.10  # Laplacian / all-attention step time: one subtraction per head should cost almost nothing
COST_LAYOUTS = (0, 3, 6)  # cost: Laplacian heads of 6 per layer
# cost's compiles by priority (a ratio needs its model's n_lap = 0 too): the GPT at gpt_d20's mix, the ViT all-Laplacian
# as the ViT recipes, the ViT at the DINO recipe's 3 of 6, the GPT all-Laplacian
COMPILE_ORDER = [("gpt", 0), ("gpt", 3), ("vit", 0), ("vit", 6), ("vit", 3), ("gpt", 6)]
# Planning estimates in seconds on one GPU, used until this GPU has measured them. Set before any GPU ran; an H200 with
# torch 2.11 then took at most these (equal 4, tests 18, torchrun gpt 20, default 68; scripts gpt 66, vit 77, dino 14
# besides their steps; cold compiles 24-39 s: results/gpu_h200/measured.json), so a slower GPU is planned with room
ESTIMATE = {
    "equal": 30,  # two small models, ten fused-against-explicit comparisons each, eager
    "tests": 60,  # pytest's start and two CUDA-only tests (one trains a tiny GPT twice)
    "torchrun gpt": 30,  # torchrun's agent, NCCL's start, a tiny GPT for 20 steps, eager
    "torchrun vit": 30,
    "default": 70,  # 4,212 eager steps of a 0.2M-parameter ViT (kernel launches, ~10 ms a step) and 18 evaluations
    "cost": 30,  # the least cost needs: start-up and the eager timings; its compiles take what is left
    # each script run ends with its model's passes alone (print_model_passes): a compiled model traced again with its
    # graphs from Inductor's cache (a d12 GPT's took 2-3 s so in the H200's second cost command), then 11 passes
    "scripts gpt": 102,  # start-up 10, compiles 50 (training) + 25 (evaluation), a 1.6 GB checkpoint and 2 evaluations
    #                      10; model passes 7
    "scripts vit": 87,  # start-up and generated images 12, compiles 45 + 20, evaluations and checkpoints 3; model passes 7
    "scripts dino": 28,  # start-up 10, first steps 5 (eager: no compile), k-NN twice and a 100-step linear probe 10;
    #                      model passes 3 (11 of at most a step's 0.23 s on the H200, eager)
}
COMPILE_ESTIMATE = {"gpt": 50, "vit": 45}  # cost: one cold whole-model compile, forward and backward
# to plan training steps from their FLOPs until --measured has their step time (the H200 reached 16-22% compiled, 6.6%
# eager: its first plan was short by up to a third, which SLACK covered)
ASSUMED_MFU = {"compiled": 0.25, "eager": 0.10}
PLANNING_PEAK = 65e12  # FLOP/s to plan with for a GPU that common.peak_flops does not know: a T4's, the slowest there
# what a first GPU run most needs to learn, first: the fast paths are exact, the recipes' models compile and train at
# GPU sizes, what Laplacian heads cost, the CUDA-only tests; torchrun on one GPU only starts NCCL, default repeats a
# CPU result
PRIORITY = ["equal", "scripts gpt", "cost", "scripts vit", "tests", "scripts dino", "torchrun gpt", "default",
            "torchrun vit"]
SCRIPT_STEPS = {"gpt": 100, "vit": 100, "dino": 100}  # training steps of a script run that fits whole
MIN_STEPS = {"gpt": 30, "vit": 40, "dino": 30}  # the fewest that still give two rates between progress lines
STEP_UNIT = {"gpt": 10, "vit": 20, "dino": 10}  # steps come in these (progress lines every 10; the ViT's two epochs)
SCRIPT_MODE = {"gpt": "compiled", "vit": "compiled", "dino": "eager"}  # as config/'s recipes set compile_model
SLACK = 1.5  # a run may take this many times its plan when the runs after it keep theirs
KILLED_FACTOR = 1.25  # a run killed at its limit is planned next time at least this many times the time it had
GRACE = 10  # seconds past the deadline before the watchdog stops the whole command
DUMP_WAIT = 2  # seconds a killed run has to write its stacks
KILL_S = DUMP_WAIT + 2  # seconds a run's kill may take (stacks, SIGKILL, the last lines): kept free of its limit
CHILD_MARGIN = 5  # seconds the cost child ends before its limit (its last timing and its exit)
GIB = 2**30
TOKENS = "gpu_check_tokens"  # the generated token set, in out_dir/data
TOKENS_VOCAB = 50257  # GPT-2's vocabulary size, as config/gpt_d20.py's FineWeb-Edu tokens; train_gpt.py pads it to 50304
ROW_MARK = "gpu_check row "  # the cost child prints each row after this
DATA = {  # the data a run reads, and how a fresh machine gets it
    "fashion_mnist": "data/fashion_mnist/{train,t10k}-{images-idx3,labels-idx1}-ubyte.gz (copy the four files of "
                     "the Debian package dataset-fashion-mnist)",
}


def row(part, check, value, limit="", ok=True, key=None, number=None, skipped=False, measured=None):
    """One line of the table; key=number also goes into the RESULT line. skipped: the plan had no time for it (neither
    passed nor failed). measured: seconds this row's run took, for --measured (item: the plan's name for it)."""
    return dict(part=part, check=check, value=value, limit=limit, ok=bool(ok), key=key, number=number,
                skipped=skipped, measured=measured)


def process_age(pid="self"):
    """Seconds since a process started, from /proc/<pid>/stat (counted from the interpreter's start); 0 without /proc."""
    with suppress(OSError, ValueError, IndexError):
        fields = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
        started = int(fields[19]) / os.sysconf("SC_CLK_TCK")  # field 22, starttime: clock ticks after boot
        return time.clock_gettime(time.CLOCK_BOOTTIME) - started
    return 0.0


# ---- running a command: its lines kept, its stacks dumped, every process killed ----
_runs = itertools.count()  # numbers the commands this process starts
STACK_FRAME = re.compile(r'^\s*File "([^"]+)", line (\d+) in (\S+)')  # a line of a faulthandler dump
STACK_HEADER = re.compile(r"^(Current thread|Thread) 0x[0-9a-f]+ |^Timeout \(")


def run_command(cmd, timeout, env=None, log=None):
    """(return code, output lines with the seconds at which each arrived) of a command run in the repository root;
    return code None when it ran past timeout seconds. Then its processes are asked for their stacks (dump_stacks)
    and killed with every process they started, also those in sessions of their own (torch elastic starts its
    workers so) that would keep the output open: they carry GPU_CHECK_RUN in their environment, which kill_runs
    finds. log: a file that gets each line as it arrives, so a run that is killed, or a check that the watchdog
    stops, leaves its output."""
    token = f"{os.getpid()}-{next(_runs)}"
    env = {**os.environ, **(env or {}), "PYTHONUNBUFFERED": "1", "GPU_CHECK_RUN": token}
    start = time.perf_counter()
    lines = []
    sink = open(log, "w") if log else None

    def read(stream):
        for line in stream:
            lines.append((time.perf_counter() - start, line.rstrip("\n")))
            if sink:
                with suppress(ValueError):  # closed: the command ended while a process still held its output
                    sink.write(f"{lines[-1][0]:8.1f}  {lines[-1][1]}\n")
                    sink.flush()

    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    reader = threading.Thread(target=read, args=(proc.stdout,), daemon=True)
    reader.start()
    reader.join(max(timeout, 0))  # the output ends when every process that holds it has ended
    try:
        code = proc.wait(timeout=max(start + timeout - time.perf_counter(), 0))
    except subprocess.TimeoutExpired:
        code = None
    timed_out = code is None or reader.is_alive()
    if timed_out:
        dump_stacks(token, lines)
    kill_runs(token)  # a timed-out command, and whatever a finished one left running
    if proc.poll() is None:  # no /proc to search (not Linux): its process group at least
        with suppress(OSError):
            os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    reader.join(5)  # the last lines of the killed processes; then stop reading whatever still holds the pipe
    if sink:
        sink.close()
    return (None if timed_out else code), list(lines)


def dump_stacks(token, lines=None, wait=DUMP_WAIT):
    """Ask every process of a run for its Python stacks before it is killed: SIGUSR1, which run_script_here and the
    cost child hand to faulthandler (a process without that handler dies of it, as it would of the kill). Returns
    once `lines` (the run's output so far) has been quiet for 0.3 s, at most `wait` seconds later."""
    for pid in processes_of(token):
        with suppress(OSError):
            os.kill(pid, signal.SIGUSR1)
    end = time.perf_counter() + wait
    seen = -1
    while time.perf_counter() < end and (lines is None or len(lines) != seen):
        seen = -1 if lines is None else len(lines)
        time.sleep(0.3)


def processes_of(token):
    """Process ids of the commands run_command started with this token (`<pid>-` alone: every one of process pid)."""
    found = []
    mark = f"GPU_CHECK_RUN={token}".encode()
    for pid in filter(str.isdigit, os.listdir("/proc") if os.path.isdir("/proc") else []):
        with suppress(OSError):  # gone, or another user's
            environ = open(f"/proc/{pid}/environ", "rb").read().split(b"\0")
            if any(v == mark or token.endswith("-") and v.startswith(mark) for v in environ) and int(pid) != os.getpid():
                found.append(int(pid))
    return found


def kill_runs(token):
    """SIGKILL every process started under token, and its process group: a stalled NCCL worker ignores less."""
    for _ in range(3):  # a dying parent may start no more, but check again for ones caught mid-start
        pids = processes_of(token)
        if not pids:
            return
        for pid in pids:
            with suppress(OSError):
                group = os.getpgid(pid)
                if group != os.getpgrp():
                    os.killpg(group, signal.SIGKILL)
            with suppress(OSError):
                os.kill(pid, signal.SIGKILL)
        time.sleep(0.2)


def where_stopped(lines):
    """What a killed run was doing, from the stacks it dumped (faulthandler: innermost frame first): 'compiling' when
    a frame lies in torch's compiler or Triton, 'in torch.distributed' when one lies there, else the innermost frame of
    the first thread dumped; None when it dumped none."""
    frames = [m.groups() for _, text in lines if (m := STACK_FRAME.match(text))]
    if not frames:
        return None
    if any(re.search(r"torch/_(dynamo|inductor)/|/triton/", path) for path, _, _ in frames):
        return "compiling"
    if any("torch/distributed/" in path for path, _, _ in frames):
        return "in torch.distributed"
    path, line, function = frames[0]
    return f"in {function} ({os.path.basename(path)}:{line})"


def stopped_row(part, name, limit, lines, item=None):
    """The failed row of a run killed at its limit: its last line with its second, and where its stacks were."""
    output = [(t, text) for t, text in lines if not STACK_FRAME.match(text) and not STACK_HEADER.match(text) and text]
    last = f"last line at {output[-1][0]:.0f} s: {output[-1][1][:100]}" if output else "no output"
    where = where_stopped(lines) or "no stack dumped"
    return row(part, f"{name}: runs", f"killed at its limit of {limit:.0f} s, {where}; {last}", "ends in time", False,
               measured=dict(item=item, killed_at_s=round(limit, 1)) if item else None)


def seconds_left(until):
    """Seconds until the perf_counter time `until` (inf for None)."""
    return math.inf if until is None else until - time.perf_counter()


def result_of(lines):
    """The key=value pairs of the last RESULT line ({} without one)."""
    return parse_result("\n".join(text for _, text in lines))


def logged_losses(lines):
    """The losses of a run's progress lines ('| loss 2.3012 |') and of its RESULT line."""
    logged = [float(m) for _, text in lines for m in re.findall(r"\| loss (\S+) \|", text)]
    return logged + [float(v) for k, v in result_of(lines).items() if "loss" in k]


def tail(lines, n=3):
    return " / ".join(text for _, text in lines[-n:])[-300:]


# ---- the plan -----------------------------------------------------------------
@dataclass
class Item:
    """A planned piece of a part (the part itself, or one of its runs): the seconds it is planned to take, fixed_s
    (start-up, compiles, evaluations) plus step_s per training step, and how far its steps may be cut."""
    part: str
    name: str
    fixed_s: float
    step_s: float = 0.0
    steps: int = 0
    min_steps: int = 0
    unit: int = 1
    rest: bool = False  # takes what the later parts leave (cost); fixed_s is the least it needs
    basis: str = "estimate"  # where fixed_s comes from

    def seconds(self, steps=None):
        return self.fixed_s + self.step_s * (self.steps if steps is None else steps)

    def steps_within(self, seconds):
        """The most steps (all of them, or a multiple of unit from min_steps on) that fit into seconds; None when none
        fit."""
        if self.seconds() <= seconds:
            return self.steps
        if not self.step_s:
            return None
        steps = int((seconds - self.fixed_s) / self.step_s + 1e-6) // self.unit * self.unit
        return steps if steps >= self.min_steps else None


def plan(items, seconds):
    """({item name: steps} of the items that fit into `seconds`, {item name: why not} of the others), taken in
    PRIORITY order: a script run that does not fit whole is shortened, down to its min_steps."""
    chosen = {}
    skipped = {}
    left = seconds
    for item in sorted(items, key=lambda i: PRIORITY.index(i.name)):
        steps = item.steps_within(left)
        if steps is None:
            skipped[item.name] = f"needs {item.seconds(item.min_steps):.0f} s ({item.basis}), {max(left, 0):.0f} s left"
            continue
        chosen[item.name] = steps
        left -= item.seconds(steps)
    return chosen, skipped


def turns(part_plan, until):
    """Each run of a part's plan (pairs of Item and steps) as its turn comes: (item, steps, seconds it may run, why not),
    its steps cut to fit the time until `until` that the runs after it leave (steps None: none fit, skip it). A run may
    take SLACK times its plan, a `rest` run all it is left."""
    for n, (item, steps) in enumerate(part_plan):
        later = sum(i.seconds(s) for i, s in part_plan[n + 1:])
        left = seconds_left(until) - later - KILL_S
        fitting = item.steps_within(min(left, item.seconds(steps)))
        if fitting is None:
            why = f"needs {item.seconds(item.min_steps):.0f} s ({item.basis}), {max(left, 0):.0f} s left"
            yield item, None, 0.0, why
            continue
        yield item, fitting, left if item.rest else min(left, SLACK * item.seconds(fitting)), ""


def planned(name, measured, step_s=0.0):
    """(fixed seconds, seconds per step, basis) of an item: this GPU's last cold measurement of it; at least
    KILLED_FACTOR times what it was given when it was last killed at its limit; else ESTIMATE and step_s."""
    seen = measured.get(name, {})
    if seen.get("cold") and "fixed_s" in seen:
        return seen["fixed_s"], seen.get("step_s") or step_s, "measured"
    if "killed_at_s" in seen:
        return max(ESTIMATE[name], KILLED_FACTOR * seen["killed_at_s"]), step_s, "killed before"
    return ESTIMATE[name], step_s, "estimate"


def plan_items(parts, gpu, measured=None):
    """The Items of the parts: one per part, one per run for scripts and torchrun, planned by `planned`; a script
    run's steps from their FLOPs at ASSUMED_MFU of the GPU's peak (PLANNING_PEAK where the table has none)."""
    name, capability, free_gib = gpu
    measured = measured or {}
    peak = peak_flops("cuda", name=name, dtype=half_dtype(capability)) or PLANNING_PEAK
    items = []
    for part in parts:
        if part == "scripts":
            for script, _, _, _, _, flops_per_step, _ in script_runs("cuda", "out", free_gib, capability).values():
                kind = script[6:-3]
                step_s = flops_per_step / (peak * ASSUMED_MFU[SCRIPT_MODE[kind]])
                fixed, step_s, basis = planned(f"scripts {kind}", measured, step_s)
                items.append(Item(part, f"scripts {kind}", fixed, step_s, SCRIPT_STEPS[kind], MIN_STEPS[kind],
                                  STEP_UNIT[kind], basis=basis))
        elif part == "torchrun":
            for kind in ("gpt", "vit")[:max(1, min(2, torch.cuda.device_count()))]:  # the ViT's only with 2 GPUs
                fixed, _, basis = planned(f"torchrun {kind}", measured)
                items.append(Item(part, f"torchrun {kind}", fixed, basis=basis))
        else:
            fixed, _, basis = planned(part, measured)
            items.append(Item(part, part, fixed, rest=part == "cost", basis=basis))
    return items


def plan_lines(items, chosen, skipped, seconds):
    """The plan, one line per item: its seconds and where they come from, or why it is skipped."""
    lines = []
    for item in items:
        if item.name not in chosen:
            lines.append(f"plan: {item.name}: skipped, {skipped[item.name]}")
            continue
        steps = chosen[item.name]
        how = f"{item.fixed_s:.0f} s ({item.basis})"
        how += f" + {steps} steps x {item.step_s:.3f} s" if item.step_s else ""
        how += ", then what the later parts leave" if item.rest else ""
        lines.append(f"plan: {item.name}: {item.seconds(steps):.0f} s = {how}")
    total = sum(i.seconds(chosen[i.name]) for i in items if i.name in chosen)
    lines.append(f"plan: {total:.0f} s of the {seconds:.0f} s left")
    return lines


def load_measured(path, gpu_name):
    """{item name: its measured seconds} that earlier commands on this GPU and torch wrote to path ({} without)."""
    if not path or not os.path.isfile(path):
        return {}
    with open(path) as f:
        return json.load(f).get(f"{gpu_name} | torch {torch.__version__}", {})


def save_measured(path, gpu_name, measured):
    """Keep this GPU's and torch's measured seconds in path, beside those of other machines."""
    everything = {}
    if os.path.isfile(path):
        with open(path) as f:
            everything = json.load(f)
    everything[f"{gpu_name} | torch {torch.__version__}"] = measured
    with common.atomic_write(path) as f:
        f.write(json.dumps(everything, indent=1, sort_keys=True).encode())


# ---- equal: the fused path against the explicit one --------------------------
def model_input(cfg, batch, T=None, device="cpu"):
    """Images (B, C, H, W) for a ViT, token ids (B, T) for a GPT."""
    g = torch.Generator().manual_seed(2)
    if cfg.model == "vit":
        return torch.randn(batch, cfg.in_chans, cfg.img_size, cfg.img_size, generator=g).to(device)
    return torch.randint(0, cfg.vocab_size, (batch, T or cfg.block_size), generator=g).to(device)


def fused_vs_explicit(cfg, x, device="cpu", amp_dtype=torch.float32, backend=None):
    """(logits, gradients) relative differences of the fused path against the explicit one: max |a - b| / max |b|.
    backend: an SDPBackend that the fused path must run on (None = PyTorch's choice)."""
    from torch.nn.attention import sdpa_kernel
    torch.manual_seed(0)
    model = randomise(build_model(cfg), std=0.02, seed=1, gain=1.0).to(device).eval()
    x = x.to(device)
    kind = str(device).split(":")[0]
    out = {}
    for explicit in (False, True):
        model.zero_grad(set_to_none=True)
        amp = nullcontext() if amp_dtype == torch.float32 else torch.autocast(kind, dtype=amp_dtype)
        restrict = sdpa_kernel(backend) if backend is not None and not explicit else nullcontext()
        with amp, restrict:
            logits = model(x, explicit=explicit).float()
            weights = torch.randn(logits.shape, generator=torch.Generator().manual_seed(3)).to(logits.device)
            (logits * weights).sum().backward()  # a generic gradient: every logit counts
        grads = torch.cat([p.grad.float().flatten() for p in model.parameters() if p.grad is not None])
        out[explicit] = (logits.detach(), grads)
    rel = [((a - b).abs().max() / b.abs().max()).item() for a, b in zip(out[False], out[True])]
    return rel[0], rel[1]


def equal_configs():
    """A ViT and a GPT whose layers hold every head layout: no, some and all heads Laplacian."""
    vit = make_config("vit-small", n_lap=[0, 2, 4, 6, 6, 3], num_classes=10)  # 6 heads of 32, 65 tokens
    gpt = make_config("gpt-small", n_lap=[0, 1, 3, 6, 6, 2], vocab_size=512, block_size=256)
    return {"vit": (vit, 8), "gpt": (gpt, 4)}  # config, batch


def half_dtype(capability=None):
    """Half precision for autocast: bfloat16 from compute capability 8.0 (Ampere) on, float16 below it (a T4 or a
    V100 has no bfloat16 tensor cores). capability None: a CPU, bfloat16."""
    return torch.float16 if capability is not None and capability < (8, 0) else torch.bfloat16


def part_equal(device="cuda", configs=None, cases=None, until=None, capability=None):
    """cases: (dtype, SDPA backend) pairs of the attention graph (FlashAttention runs in half precision only, and
    from compute capability 8.0 on: below it its rows say so without failing). until: no case starts after this
    perf_counter time."""
    from torch.nn.attention import SDPBackend
    half = half_dtype(capability)
    cases = cases or [(torch.float32, SDPBackend.EFFICIENT_ATTENTION), (half, SDPBackend.FLASH_ATTENTION),
                      (half, SDPBackend.EFFICIENT_ATTENTION)]
    rows = []
    for kind, (cfg, batch) in (configs or equal_configs()).items():
        for graph in ("attention", "uniform"):
            # the uniform graph calls no SDPA kernel: one row per dtype
            todo = cases if graph == "attention" else [(torch.float32, None), (half, None)]
            for amp_dtype, backend in todo:
                limits = EQUAL_LIMITS[amp_dtype]
                name = f"{kind} {graph} n_lap={cfg.n_lap} {str(amp_dtype).split('.')[1]}"
                name += f" {backend.name.replace('_ATTENTION', '').lower()}" if backend is not None else ""
                if seconds_left(until) <= 0:
                    rows.append(row("equal", name, "not run: the part's time is up", "runs", False))
                    continue
                if backend == SDPBackend.FLASH_ATTENTION and capability is not None and capability < (8, 0):
                    rows.append(row("equal", name, f"not run: FlashAttention needs compute capability 8.0, this GPU "
                                                   f"has {capability[0]}.{capability[1]}", "", True))
                    continue
                try:
                    with float32_matmuls():  # float32 means float32 here (the scripts allow TF32)
                        errors = fused_vs_explicit(replace(cfg, graph=graph), model_input(cfg, batch), device, amp_dtype,
                                                   backend)
                except RuntimeError as e:  # sdpa_kernel: the restricted kernel cannot run
                    rows.append(row("equal", name, str(e).splitlines()[0][:80], "runs", False))
                    continue
                ok = errors[0] <= limits[0] and errors[1] <= limits[1]
                rows.append(row("equal", name, f"logits {errors[0]:.1e}, grads {errors[1]:.1e}",
                                f"{limits[0]:.0e}, {limits[1]:.0e}", ok))
    return rows

# ---- cost: what Laplacian heads cost ------------------------------------------
def train_step(model, x):
    """One forward and backward pass (loss: the GPT's cross-entropy, a ViT's mean square logit)."""
    model.zero_grad(set_to_none=True)
    if x.dtype == torch.long:
        loss = model(x, x)[1]
    else:
        loss = model(x).float().square().mean()
    loss.backward()


def step_time(model, x, repeats, amp):
    """Seconds per forward+backward pass, the mean of `repeats` passes."""
    if x.is_cuda:
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(repeats):
        with amp:
            train_step(model, x)
    if x.is_cuda:
        torch.cuda.synchronize()
    return (time.perf_counter() - t0) / repeats


def layout_models(cfg, layouts, device="cpu"):
    """{n_lap: cfg's model with that many Laplacian heads per layer}, all with the first one's weights: only the head
    type differs."""
    torch.manual_seed(0)
    with torch.device(device):  # a d12 GPT initialises in milliseconds on a GPU, in seconds on its host
        models = {k: build_model(replace(cfg, n_lap=k)) for k in layouts}
    for model in models.values():
        model.load_state_dict(models[layouts[0]].state_dict())
    return models


def interleaved_times(models, x, rounds, repeats, amp=nullcontext()):
    """{n_lap: seconds per pass in each round}, after one warm-up pass each (the compiled ones compile there). Every
    round times each model once, and who goes first rotates from round to round, so drifting machine speed cancels."""
    for model in models.values():
        step_time(model, x, 1, amp)
    layouts = list(models)
    times = {k: [] for k in layouts}
    for r in range(rounds):
        for k in layouts[r % len(layouts):] + layouts[:r % len(layouts)]:
            times[k].append(step_time(models[k], x, repeats, amp))
    return times


def ratio_rows(name, cfg, mode, times):
    """One row per Laplacian layout against n_lap = 0: the median over rounds of their step times' ratio. RESULT key
    lap_cost_<model>_<mode>, with _<k>of<n_head> for a mix."""
    rows = []
    base = times[0]
    for k, measured_times in times.items():
        if k == 0:
            continue
        ratio = statistics.median(t / b for t, b in zip(measured_times, base))
        key = f"lap_cost_{cfg.model}_{mode}" + ("" if k == cfg.n_head else f"_{k}of{cfg.n_head}")
        rows.append(row("cost", f"{name} {mode}: n_lap=0 {1e3 * statistics.median(base):.1f} ms, n_lap={k} of "
                                f"{cfg.n_head} {1e3 * statistics.median(measured_times):.1f} ms",
                        f"{ratio:.3f}", f"<= {COST_LIMIT}", ratio <= COST_LIMIT, key, f"{ratio:.3f}"))
    return rows


def fitting_batch(full, gib_per_item, free_gib):
    """The largest power-of-two fraction of the batch `full` whose estimated memory (gib_per_item each) takes at most
    60% of the GPU's free memory (None: all of it)."""
    batch = full
    while free_gib is not None and batch > 1 and batch * gib_per_item > 0.6 * free_gib:
        batch //= 2
    return batch


def cost_cases(free_gib=None):
    """Sizes a user trains: ViT-S/16 on 224 px images (197 tokens), a d12 GPT (nanochat's) at T = 1024; batches
    halved until they fit the GPU's free memory (estimates for half precision autocast: a ViT-S image 0.08 GiB, a GPT
    sequence 1.5 GiB, a third of it its float32 logits and their gradient, 1024 x 65,536 x 4 bytes = 0.25 GiB a copy)."""
    vit = make_config("vit-s", num_classes=1000)
    gpt = make_config("gpt-d20", n_layer=12, n_embd=768, n_head=6, vocab_size=65536, block_size=1024)
    b_vit = fitting_batch(128, 0.08, free_gib)
    b_gpt = fitting_batch(16, 1.5, free_gib)
    return {f"vit-s/16 T=197 B={b_vit}": (vit, model_input(vit, b_vit)),
            f"gpt d12 T=1024 B={b_gpt}": (gpt, model_input(gpt, b_gpt))}


def cache_counts():
    """(graphs Inductor took from its cache, graphs it compiled) in this process so far; (0, 0) before any compile."""
    utils = sys.modules.get("torch._dynamo.utils")  # not imported: nothing was compiled (and importing it takes seconds)
    if utils is None:
        return 0, 0
    return utils.counters["inductor"]["fxgraph_cache_hit"], utils.counters["inductor"]["fxgraph_cache_miss"]


def compile_fits(target, finished, left, compile_s, order=COMPILE_ORDER):
    """(whether compiling target = (model, n_lap) fits into `left` seconds, the seconds it needs): its compile, its
    partner's when it is an n_lap = 0 (a ratio needs two), and those of the compiles ranked above it in `order` that
    are not `finished` (compiled or given up): they keep their time even where they come later."""
    kind, layout = target
    ahead = [k for k, n in order[:order.index(target)] if (k, n) not in finished]
    need = compile_s[kind] * (2 if layout == 0 else 1) + sum(compile_s[k] for k in ahead)
    return need <= left, need


def emit(rows):
    """The cost child's rows, each a line for the parent (part_cost)."""
    for r in rows:
        print(ROW_MARK + json.dumps(r), flush=True)


def cost_run(spec, start=None):
    """The cost part as a child process, which the parent kills at its limit: eager timings of every layout first,
    then whole-model compiles in COMPILE_ORDER while the compile times measured so far (before the first: spec's from
    --measured, else COMPILE_ESTIMATE) say the next fits into spec's seconds from `start` (a perf_counter time; this
    process's start by default), keeping time for timing the compiled models (at most what their eager timing took).
    Each row goes out as soon as it is known."""
    start = time.perf_counter() - process_age() if start is None else start
    end = start + spec["seconds"]
    device = spec.get("device", "cuda")
    dtype = getattr(torch, spec["dtype"])
    amp = nullcontext() if dtype == torch.float32 else torch.autocast(device.split(":")[0], dtype=dtype)
    compile_s = {**COMPILE_ESTIMATE, **spec["compile_s"]}
    basis = {kind: "measured before" if kind in spec["compile_s"] else "estimate" for kind in compile_s}
    cases = {cfg.model: (name, cfg, x.to(device)) for name, (cfg, x) in cost_cases(spec["free_gib"]).items()}
    models = {}
    eager_s = {}
    for kind, (name, cfg, x) in cases.items():
        print(f"cost: {name}: eager, n_lap {', '.join(map(str, COST_LAYOUTS))} of {cfg.n_head}", flush=True)
        t0 = time.perf_counter()
        models[kind] = layout_models(cfg, COST_LAYOUTS, device)
        times = interleaved_times(models[kind], x, spec["rounds"], spec["repeats"], amp)
        eager_s[kind] = time.perf_counter() - t0
        emit(ratio_rows(name, cfg, "eager", times))
    finished = set()
    for kind, (name, cfg, x) in cases.items():
        if "torch._dynamo" in sys.modules:  # not imported: nothing compiled yet (and importing it takes seconds)
            torch._dynamo.reset()  # the other model's graphs are timed and done with
        compiled = {}
        for target in [t for t in COMPILE_ORDER if t[0] == kind]:
            layout = target[1]
            left = seconds_left(end) - sum(eager_s[k] for k in eager_s)  # eager_s: the models still to be timed
            fits, need = compile_fits(target, finished, left, compile_s)
            finished.add(target)
            check = f"{name} compiled n_lap={layout} of {cfg.n_head}"
            if layout and 0 not in compiled:
                emit([row("cost", check, "skipped: no compiled n_lap=0 to compare with", skipped=True)])
                continue
            if not fits:
                emit([row("cost", check, f"skipped: needs {need:.0f} s ({basis[kind]}: {compile_s[kind]:.0f} s a "
                                         f"compile), {left:.0f} s left", skipped=True)])
                continue
            print(f"cost: compiling {name} n_lap={layout} as one model ({basis[kind]}: {compile_s[kind]:.0f} s), "
                  f"{left:.0f} s left", flush=True)
            hits = cache_counts()[0]
            t0 = time.perf_counter()
            compiled[layout] = torch.compile(models[kind][layout])
            step_time(compiled[layout], x, 1, amp)  # the first pass compiles the forward and the backward graph
            compile_s[kind] = time.perf_counter() - t0
            basis[kind] = "measured here"
            cached = cache_counts()[0] - hits
            emit([row("cost", f"{name} n_lap={layout}: torch.compile of the whole model, forward+backward",
                      f"{compile_s[kind]:.0f} s, {cached} graph(s) from Inductor's cache", "", True, f"compile_s_{kind}",
                      f"{compile_s[kind]:.0f}", measured=dict(item=f"compile {kind}", fixed_s=round(compile_s[kind], 1),
                                                             cold=cached == 0))])
        if len(compiled) > 1:
            print(f"cost: {name}: timing the compiled n_lap {', '.join(map(str, compiled))}", flush=True)
            emit(ratio_rows(name, cfg, "compiled", interleaved_times(compiled, x, spec["rounds"], spec["repeats"], amp)))
        del eager_s[kind]
        del models[kind]
        del compiled
        if torch.cuda.is_available():
            torch.cuda.empty_cache()


def cost_command(spec):
    return [sys.executable, os.path.abspath(__file__), "--cost_run=" + json.dumps(spec)]


def part_cost(device="cuda", cases=None, rounds=7, repeats=3, amp_dtype=torch.bfloat16, until=None, free_gib=None,
              out="out-gpu-check", compile_s=None):
    """On a GPU (cases None): cost_run in a child process with all the time until `until`, whose rows come back as it
    prints them, also when it is killed. cases ({name: (config, input)}, as the CPU tests pass): in this process, the
    all-Laplacian model against the all-attention one, eager and compiled. compile_s: {model: seconds} measured before."""
    if cases is None:
        limit = seconds_left(until) - KILL_S
        spec = dict(seconds=limit - CHILD_MARGIN, dtype=str(amp_dtype).split(".")[1], free_gib=free_gib, rounds=rounds,
                    repeats=repeats, compile_s=compile_s or {})
        code, lines = run_command(cost_command(spec), limit, log=os.path.join(out, "cost.log"))
        rows = [json.loads(text[len(ROW_MARK):]) for _, text in lines if text.startswith(ROW_MARK)]
        if code is None:
            rows.append(stopped_row("cost", "cost run", limit, lines))
        elif code != 0:
            rows.append(row("cost", "cost run", f"exit {code}: {tail(lines)}", "exit 0", False))
        return rows
    rows = []
    amp = nullcontext() if amp_dtype == torch.float32 else torch.autocast(str(device).split(":")[0], dtype=amp_dtype)
    for name, (cfg, x) in cases.items():
        if seconds_left(until) <= 0:
            rows.append(row("cost", name, "not run: the part's time is up", f"<= {COST_LIMIT}", False))
            continue
        models = layout_models(cfg, (0, cfg.n_head), device)
        rows += ratio_rows(name, cfg, "eager", interleaved_times(models, x.to(device), rounds, repeats, amp))
        torch._dynamo.reset()  # an earlier case's graphs would meet these models' and recompile them
        compiled = {k: torch.compile(m) for k, m in models.items()}
        rows += ratio_rows(name, cfg, "compiled", interleaved_times(compiled, x.to(device), rounds, repeats, amp))
    return rows


# ---- scripts: the recipes at GPU sizes, cut short -------------------------------
def colour_images(n_train, n_val=2048, num_classes=10, seed=0):
    """A learnable set of 3x32x32 uint8 images in load_images' format (the repository's synthetic set is 1x28x28):
    each class a random 3x8x8 pattern upsampled to 40x40, each image a random 32x32 window of it plus noise."""
    g = torch.Generator().manual_seed(seed)
    templates = F.interpolate(torch.rand(num_classes, 3, 8, 8, generator=g), size=40, mode="bilinear")
    windows = templates.unfold(2, 32, 1).unfold(3, 32, 1)  # (K, 3, 9, 9, 32, 32): every window of every class

    def make(n):
        y = torch.randint(0, num_classes, (n,), generator=g)
        i, j = torch.randint(0, 9, (2, n), generator=g)
        x = 0.7 * windows[y, :, i, j] + 0.3 * torch.rand(n, 3, 32, 32, generator=g)  # (n, 3, 32, 32)
        return (x * 255).round().to(torch.uint8), y

    train, val = make(n_train), make(n_val)
    pixels = train[0].float() / 255
    return dict(train=train, val=val, num_classes=num_classes, classes=[f"pattern{k}" for k in range(num_classes)],
                mean=pixels.mean(dim=(0, 2, 3)).tolist(), std=pixels.std(dim=(0, 2, 3)).tolist())


def write_tokens(folder, n_train=2**21, n_val=2**17, seed=0):
    """A learnable token set in train_gpt.py's format (uint16 train.bin and val.bin, meta.json) for GPU-sized GPT runs
    without a download: a text of 8-token words drawn from 4096 random ones over GPT-2's vocabulary size, so that 7 of 8
    next tokens follow from the one before. Each token counts as one byte (bits per byte = nats per token / ln 2)."""
    rng = np.random.default_rng(seed)
    # distinct tokens in every word position, so that a token's next one is its word's; the last id is end-of-text
    words = rng.permutation(TOKENS_VOCAB - 1)[:4096 * 8].astype(np.uint16).reshape(4096, 8)
    os.makedirs(folder, exist_ok=True)
    for split, n in (("train", n_train), ("val", n_val)):
        words[rng.integers(0, len(words), n // 8)].tofile(os.path.join(folder, f"{split}.bin"))  # (n // 8, 8) tokens
    meta = dict(vocab_size=TOKENS_VOCAB, tokenizer="gpt2", encoding="gpt2", eot_token=TOKENS_VOCAB - 1,
                token_bytes=[1] * (TOKENS_VOCAB - 1) + [0], corpus=f"gpu-check-words-{seed}",
                source="tests/gpu_check.py: random 8-token words")
    with open(os.path.join(folder, "meta.json"), "w") as f:
        json.dump(meta, f)


SYNC_MARK = "gpu_check syncs_between_lines="  # print_run_facts' line of the host syncs at steps that printed nothing
SYNCS = Counter()  # (step, 'file:line') -> host syncs of the script that runs in this process (count_syncs)
PRINTED = set()  # the steps of that script at which it printed a line


def script_step(script_path):
    """The `step` of the script at script_path that runs in this process (its frame on the stack), or None."""
    frame = sys._getframe(1)
    while frame and frame.f_code.co_filename != script_path:
        frame = frame.f_back
    return frame.f_globals.get("step") if frame else None


def count_syncs(script_path):
    """From here on, the host syncs of the script at script_path by training step: CUDA's sync debug mode warns of each
    (a read of a number, a copy from pageable memory, torch.tensor(numbers, device='cuda'), ...), and each goes to
    SYNCS under the script's `step` and the line that made it; each line the script prints puts its step in PRINTED.
    A sync at a step that printed nothing waits for the GPU between progress lines, where it should run ahead."""
    show = warnings.showwarning
    echo = builtins.print

    def counted(message, category, filename, lineno, file=None, line=None):
        if "synchronizing" not in str(message):
            return show(message, category, filename, lineno, file, line)
        step = script_step(script_path)
        if step is not None:
            SYNCS[step, f"{os.path.relpath(filename, ROOT)}:{lineno}"] += 1

    def printed(*args, **kwargs):
        step = script_step(script_path)
        if step is not None:
            PRINTED.add(step)
        echo(*args, **kwargs)

    warnings.showwarning = counted
    warnings.filterwarnings("always", message=".*synchronizing")  # every one, not the first of each line
    builtins.print = printed
    torch.cuda.set_sync_debug_mode("warn")


def syncs_line():
    """SYNC_MARK's line: the syncs at steps that printed nothing, and the first three places of them."""
    if not torch.cuda.is_available():
        return f"{SYNC_MARK}not counted (no CUDA)"
    between = sorted((key, n) for key, n in SYNCS.items() if key[0] not in PRINTED)
    places = ", ".join(f"step {step} {line} x{n}" for (step, line), n in between[:3])
    return f"{SYNC_MARK}{sum(n for _, n in between)}" + (f" first at {places}" if places else "")


def print_run_facts():
    """The lines a timed run ends with: its peak GPU memory, how many compiled graphs came from Inductor's cache (a warm
    cache makes the compile time say little about a fresh machine), and its host syncs between progress lines."""
    hits, misses = cache_counts()
    print(f"gpu_check compile_cache hits={hits} misses={misses}", flush=True)
    if torch.cuda.is_available():
        print(f"gpu_check peak_memory_gib={torch.cuda.max_memory_allocated() / 2**30:.2f}", flush=True)
    print(syncs_line(), flush=True)


def run_script_here(script, argv, colour=0, model_passes=False):
    """The child of a timed run: `python script argv` in this process, its host syncs counted on a GPU (count_syncs),
    then print_run_facts. colour > 0: --dataset=synthetic means `colour` generated 32x32 colour images (colour_images).
    model_passes: then, once the script has ended, its model's passes alone (print_model_passes). SIGUSR1 dumps every
    thread's stack: the parent sends it before it kills a run that outlived its time."""
    from data import images
    load_images = images.load_images

    def load_colour_images(name, data_dir="data"):
        return colour_images(colour) if name == "synthetic" else load_images(name, data_dir)

    faulthandler.register(signal.SIGUSR1, all_threads=True)
    if colour:
        images.load_images = load_colour_images
    atexit.register(print_run_facts)
    if torch.cuda.is_available():
        count_syncs(os.path.join(ROOT, script))
    sys.argv = [script, *argv]
    runpy.run_path(os.path.join(ROOT, script), run_name="__main__")
    if model_passes:
        print_run_facts()  # the script's own peak memory and graphs, before the passes add theirs
        atexit.unregister(print_run_facts)
        out = next(a.split("=", 1)[1] for a in reversed(argv) if a.startswith("--out_dir="))
        print_model_passes(os.path.join(ROOT, out))


# ---- scripts: the loop against its model ---------------------------------------
MODEL_ROUNDS = 3  # timed rounds of a finished run's model passes: the median round counts
MODEL_REPEATS = 3  # passes per round
MODEL_MARK = "gpu_check model_fwd_bwd_ms="  # the line of print_model_passes


def model_passes(ckpt, device):
    """(one pass, passes per training step) of a finished run's networks, built afresh from its checkpoint (kind,
    model_config, config: the contract analyze.py reads) at the run's sizes, compiled where the run compiled (as its
    script compiles: the whole GPT or ViT, DINO's backbones). One pass is what a training step asks of the networks
    alone, on random inputs of the run's shapes, with a loss that costs next to nothing (a mean square): for the GPT
    and the ViT one micro-batch forward and backward (a step takes its gradient accumulation's count of them); for DINO
    the teacher's forward on the 2 global crops and the student's, backbone and head, forward and backward on every
    crop. Left out, and so in the loop's share: data, augmentation, the real loss, clipping, the optimizer, DINO's EMA
    and centre, logging."""
    config = ckpt["config"]
    cfg = Config(**ckpt["model_config"])
    batch = config["batch_size"]
    compile_model = config.get("compile_model", False)
    if ckpt["kind"] == "dino":
        return dino_pass(cfg, config, device), 1
    model = build_model(cfg).to(device).train()
    model = torch.compile(model) if compile_model else model
    if ckpt["kind"] == "gpt":
        tokens = batch * config["block_size"]
        x = torch.randint(0, cfg.vocab_size, (batch, config["block_size"]), device=device)
        return partial(train_step, model, x), (config["total_batch_size"] or tokens) // tokens
    x = torch.randn(batch, cfg.in_chans, cfg.img_size, cfg.img_size, device=device)
    return partial(train_step, model, x), config["grad_accum"]


def dino_pass(teacher_cfg, config, device):
    """DINO's pass (model_passes): the teacher's forward on the global crops, the student's forward and backward on
    all of them (train_dino.py's DINO wrapper: each crop size through the backbone as one batch, one head call)."""
    student_cfg = replace(teacher_cfg, drop_path=config["drop_path"])  # the checkpoint holds the teacher's config
    head_sizes = (teacher_cfg.n_embd, config["out_dim"], config["head_hidden"], config["head_bottleneck"])
    nets = {}
    for name, cfg in (("student", student_cfg), ("teacher", teacher_cfg)):
        backbone = build_model(cfg).to(device)
        if config.get("compile_model", False):  # as train_dino.py compiles it: a static graph per crop size
            backbone = torch.compile(backbone, dynamic=False)
        nets[name] = (backbone, DINOHead(*head_sizes, norm_last_layer=config["norm_last_layer"]).to(device))
    (student, student_head), (teacher, teacher_head) = nets["student"], nets["teacher"]
    teacher.eval()
    batch = config["batch_size"]
    crops = [torch.randn(2 * batch, teacher_cfg.in_chans, teacher_cfg.img_size, teacher_cfg.img_size, device=device)]
    if config["local_crops"]:
        side = config["local_size"]
        crops.append(torch.randn(config["local_crops"] * batch, teacher_cfg.in_chans, side, side, device=device))

    def one_pass():
        student_head.zero_grad(set_to_none=True)
        student.zero_grad(set_to_none=True)
        with torch.no_grad():
            teacher_head(teacher(crops[0]))
        out = student_head(torch.cat([student(x) for x in crops]))
        out.float().square().mean().backward()

    return one_pass


def pass_seconds(one_pass, amp, rounds=MODEL_ROUNDS, repeats=MODEL_REPEATS):
    """Seconds of one pass: the median over rounds of `repeats` passes each, after two untimed ones (the first
    compiles a compiled model; the second meets a warm allocator)."""
    cuda = torch.cuda.is_available()
    for _ in range(2):
        with amp:
            one_pass()
    times = []
    for _ in range(rounds):
        if cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(repeats):
            with amp:
                one_pass()
        if cuda:
            torch.cuda.synchronize()
        times.append((time.perf_counter() - t0) / repeats)
    return statistics.median(times)


def print_model_passes(out_dir):
    """After a script run, in its process: the milliseconds its networks alone take for one training step
    (model_passes), in the run's dtype, as MODEL_MARK's line. The run's own graphs are dropped first (their memory;
    Inductor's cache on disk still serves these models' graphs). An error here prints its traceback and one line, and
    leaves the run's exit status alone: its rows stand, the loop row says why it has no number."""
    try:
        ckpt = torch.load(os.path.join(out_dir, common.CHECKPOINT), map_location="cpu", mmap=True, weights_only=True)
        device = common.resolve_device(ckpt["config"]["device"])
        amp, _ = common.autocast(device, ckpt["config"]["dtype"])
        if "torch._dynamo" in sys.modules:
            torch._dynamo.reset()
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        one_pass, passes = model_passes(ckpt, device)
        print(f"{MODEL_MARK}{1e3 * passes * pass_seconds(one_pass, amp):.2f} passes={passes}", flush=True)
    except Exception as e:  # noqa: BLE001 (a failed measurement must not hide the run's rows)
        traceback.print_exc()
        print(f"gpu_check model_fwd_bwd_error={type(e).__name__}: {str(e).splitlines()[0][:120] if str(e) else ''}",
              flush=True)


def training_flops_per_token(cfg, T):
    """flops_per_token of cfg's model, built on the meta device: shapes only, no memory."""
    with torch.device("meta"):
        return build_model(cfg).flops_per_token(T)


def dino_flops_per_image(cfg, out_dim=65536, hidden=2048, bottleneck=256, global_tokens=197, local_crops=8,
                         local_tokens=37):
    """Training FLOPs per image of train_dino.py: the student's forward and backward on 2 global and local_crops
    local crops, the teacher's forward on the 2 global ones, each through the backbone (cfg) and the DINO head (its
    matmuls: 2 FLOPs per weight and crop forward, 6 forward and backward)."""
    with torch.device("meta"):
        head = DINOHead(cfg.n_embd, out_dim, hidden, bottleneck)
    crop = {T: training_flops_per_token(cfg, T) * T for T in (global_tokens, local_tokens)}  # forward + backward
    head_forward = 2 * sum(p.numel() for p in head.parameters() if p.ndim >= 2)
    student = 2 * crop[global_tokens] + local_crops * crop[local_tokens] + (2 + local_crops) * 3 * head_forward
    teacher = 2 * (crop[global_tokens] / 3 + head_forward)
    return student + teacher


def script_runs(device="cuda", out="out-gpu-check", free_gib=None, capability=None, steps=None):
    """label -> (script, options, colour images, units per step, unit, training FLOPs per step, data it needs): the
    config/ recipes at GPU sizes, cut to `steps` ({model: steps}; SCRIPT_STEPS) training steps on generated data.
    Batches are halved until they fit the GPU's free memory (estimates: a d12 sequence of 1024 tokens 1.2 GiB, a
    third of it logits over 50,304 tokens; a ViT-S/16 image 0.05 GiB; a DINO image with its 10 crops 0.3 GiB); below
    compute capability 8.0 the runs are float16 with a gradient scaler instead of bfloat16."""
    steps = {**SCRIPT_STEPS, **(steps or {})}
    system = [f"--device={device}", f"--dtype={str(half_dtype(capability)).split('.')[1]}"]
    gpt = make_config("gpt-d20", n_layer=12, n_embd=768, n_head=6, n_lap=3, vocab_size=50304, block_size=1024)
    vit = make_config("vit-s", n_lap=6, num_classes=10, in_chans=3, img_size=224, patch_size=16, pooling="cls")
    dino = make_config("vit-s", n_lap=3, num_classes=0, in_chans=3, img_size=224)
    b_gpt = fitting_batch(32, 1.2, free_gib)
    b_vit = fitting_batch(512, 0.05, free_gib)
    b_dino = fitting_batch(128, 0.3, free_gib)
    n_vit = b_vit * steps["vit"] // 2  # two epochs: the second evaluation tells the evaluation graph's compile apart
    n_dino = b_dino * steps["dino"]  # one epoch
    return {
        f"gpt d12 T=1024 B={b_gpt} n_lap=3/6": ("train_gpt.py", [
            "config/gpt_d20.py", f"--dataset={TOKENS}", f"--data_dir={out}/data", "--n_layer=12", "--n_embd=768",
            "--n_head=6", "--n_lap=3", "--block_size=1024", f"--batch_size={b_gpt}", "--total_batch_size=0",
            f"--max_iters={steps['gpt']}", f"--eval_interval={steps['gpt']}", "--eval_iters=2", "--log_interval=10",
            "--max_new_tokens=0", "--compile_model=True", f"--out_dir={out}/gpt", *system], 0, b_gpt * 1024, "tok",
            b_gpt * 1024 * training_flops_per_token(gpt, 1024), None),
        f"vit-s/16 224px B={b_vit} n_lap=6/6": ("train_vit.py", [
            "config/vit_cifar10.py", "--dataset=synthetic", "--preset=vit-s", "--img_size=224", "--patch_size=16",
            f"--train_subset={n_vit}", "--epochs=2", "--warmup_epochs=1", f"--batch_size={b_vit}", "--log_interval=10",
            "--compile_model=True", f"--out_dir={out}/vit", *system], n_vit, b_vit, "img",
            b_vit * 197 * training_flops_per_token(vit, 197), None),
        f"dino vit-s/16 224+96px B={b_dino} n_lap=3/6": ("train_dino.py", [
            "config/dino_vits16_imagenet.py", "--dataset=synthetic", f"--train_subset={n_dino}", "--epochs=1",
            f"--batch_size={b_dino}", f"--eval_train={min(1024, n_dino)}", "--eval_val=512", "--probe_steps=100",
            "--seg_dataset=none", "--log_interval=10", "--compile_model=False", f"--out_dir={out}/dino", *system],
            n_dino, b_dino, "img", b_dino * dino_flops_per_image(dino), None),
    }


def timed_command(script, options, colour=0, model_passes=False):
    """The command of a timed run: this file runs the script in a child process (run_script_here)."""
    return [sys.executable, os.path.abspath(__file__), f"--run_script={script}", f"--model_passes={model_passes}",
            f"--colour={colour}", *options]


def progress(lines):
    """(seconds, step) of every progress line ('... step N/M | ...')."""
    found = [(t, re.search(r"\bstep (\d+)/\d+ \|", text)) for t, text in lines]
    return [(t, int(m.group(1))) for t, m in found if m]


def timing(lines):
    """(steps/s, compile and warm-up seconds) of a run's output. steps/s is the median rate between progress lines
    that follow each other directly (no evaluation between them). Compile and warm-up, alike for the three scripts:
    the training graph's (the time from the start of training to the first progress line, less its steps at the
    steady rate; training starts at the set-up line 'schedule:', 'batch:' or 'backbone:', or at the evaluation of
    step 0 where one comes first, which is left out) plus the evaluation graph's (the first evaluation's time less
    the last one's, each from the line before it). None where the output has too few progress lines."""
    index = {t: i for i, (t, _) in enumerate(lines)}
    marks = progress(lines)
    rates = [(s1 - s0) / (t1 - t0) for (t0, s0), (t1, s1) in zip(marks, marks[1:])
             if index[t1] == index[t0] + 1 and t1 > t0 and s1 > s0]
    if not rates:
        return None, None
    rate = statistics.median(rates)
    setup = [t for t, text in lines if re.match(r"(schedule|batch|backbone):", text)]
    if not setup:
        return rate, None
    evals = [i for i, (t, text) in enumerate(lines) if re.match(r"eval (step|epoch) \d+:", text) and t > setup[0]]
    before = [lines[i][0] for i in evals if lines[i][0] < marks[0][0]]  # the evaluation of step 0
    train_compile = marks[0][0] - (before[-1] if before else setup[0]) - marks[0][1] / rate
    durations = [lines[i][0] - lines[i - 1][0] for i in evals]
    eval_compile = durations[0] - durations[-1] if len(durations) > 1 else 0.0
    return rate, train_compile + eval_compile


def peak_memory(lines):
    found = [re.search(r"gpu_check peak_memory_gib=([\d.]+)", text) for _, text in lines]
    return next((float(m.group(1)) for m in reversed(found) if m), None)




def compile_cache(lines):
    """(graphs from Inductor's cache, graphs compiled) of a run's print_run_facts line, or None without one."""
    found = [re.search(r"gpu_check compile_cache hits=(\d+) misses=(\d+)", text) for _, text in lines]
    return next(((int(m.group(1)), int(m.group(2))) for m in reversed(found) if m), None)


def failed_run(part, name, code, lines, limit=None, item=None):
    """The row of a run that was killed at its limit (stopped_row), ended badly or without a RESULT line; or None."""
    if code is None:
        return stopped_row(part, name, limit or 0, lines, item)
    if code == 0 and result_of(lines):
        return None
    return row(part, f"{name}: runs", f"exit {code}: {tail(lines)}", "exit 0, RESULT", False)


def script_rows(name, per_step, unit, flops_per_step, peak, code, lines, limit=None, item=None):
    """The rows of one timed run from its output: RESULT with finite losses (or why there is none); steps/s, images or
    tokens/s and MFU; compile and warm-up time, peak GPU memory and the graphs from Inductor's cache; the step's time
    over its model's (loop_row); its host syncs between progress lines (sync_row). A run killed at its limit keeps the
    rows its lines allow. item: the plan's name of the run, whose seconds go to --measured."""
    failed = failed_run("scripts", name, code, lines, limit, item)
    if failed and code is not None:
        return [failed]
    result = result_of(lines)
    rate, compile_s = timing(lines)
    memory = peak_memory(lines)
    cache = compile_cache(lines)
    mfu = f"{flops_per_step * rate / peak:.1%}" if peak and rate else "-"
    losses = logged_losses(lines)
    shown = " ".join(f"{k}={v}" for k, v in result.items() if k in ("steps", "seconds", "val_acc", "val_bpb", "knn_acc"))
    speed = f"{rate:.2f} | {rate * per_step:,.0f} | {mfu}" if rate else "too few progress lines"
    setup = f"{compile_s:.0f} | {'-' if memory is None else memory}" if compile_s is not None else "-"
    setup += f" | {cache[0]} of {sum(cache)}" if cache else ""
    measured = None
    if item and rate and not failed:
        steps = int(result.get("steps", 0))
        measured = dict(item=item, fixed_s=round(lines[-1][0] - steps / rate, 1), step_s=round(1 / rate, 4),
                        cold=not (cache and cache[0]))
    first = failed or row("scripts", f"{name}: RESULT, finite losses", shown, "finite",
                          losses and all(map(math.isfinite, losses)))
    return [first,
            row("scripts", f"{name}: steps/s | {unit}/s | mfu", speed, "", rate is not None or failed is not None,
                f"{name.split()[0]}_{unit}_per_s", f"{rate * per_step:.0f}" if rate else "none", measured=measured),
            row("scripts", f"{name}: compile+warm-up s | peak GiB" + (" | graphs from cache" if cache else ""), setup),
            loop_row(name, rate, lines, killed=code is None),
            sync_row(name, lines, killed=code is None)]


def model_milliseconds(lines):
    """(milliseconds of a step's model passes, or None; print_model_passes' error, or None) of a run's output."""
    found = [re.match(re.escape(MODEL_MARK) + r"([\d.]+) ", text) for _, text in lines]
    error = next((text.split("=", 1)[1] for _, text in lines if text.startswith("gpu_check model_fwd_bwd_error=")), None)
    return next((float(m.group(1)) for m in reversed(found) if m), None), error


def loop_row(name, rate, lines, killed=False):
    """The loop's efficiency: the training step's milliseconds (timing's steps/s, between progress lines) over the
    milliseconds its networks alone take for that step (print_model_passes, in the same process after the run).
    1.0: the step costs no more than its model; the excess is the loop's (data, augmentation, loss, optimizer, EMA,
    logging, launch gaps between them). A killed run has no number and no failure of its own here."""
    model_ms, error = model_milliseconds(lines)
    check = f"{name}: step ms | model fwd+bwd ms | step / model"
    if rate and model_ms:
        step_ms = 1e3 / rate
        return row("scripts", check, f"{step_ms:.1f} | {model_ms:.1f} | {step_ms / model_ms:.2f}", "", True,
                   f"{name.split()[0]}_step_over_model", f"{step_ms / model_ms:.2f}")
    why = error or ("no steps/s" if not rate else "the run ended before its model passes")
    return row("scripts", check, f"not measured: {why}", "", killed and error is None)


def sync_row(name, lines, killed=False):
    """The run's host syncs at steps that printed no line (count_syncs, under CUDA's sync debug mode): each one makes
    the host wait for the GPU between progress lines, so the recipe fails with any. A killed run has no count and no
    failure of its own here; without CUDA nothing is counted."""
    check = f"{name}: host syncs between progress lines"
    said = next((text[len(SYNC_MARK):] for _, text in reversed(lines) if text.startswith(SYNC_MARK)), None)
    if said is None:
        return row("scripts", check, "not counted: the run ended before it said", "0", killed)
    if not said[0].isdigit():  # no CUDA
        return row("scripts", check, said, "0", True)
    count = int(said.split()[0])
    return row("scripts", check, said, "0", count == 0, f"{name.split()[0]}_syncs_between_lines", str(count))


def missing_data(name):
    """'' when the data `name` (a key of DATA, or None) is on disk, else what is missing and how to get it."""
    if name == "fashion_mnist":
        files = [f for pair in images.FASHION_FILES.values() for f in pair]
        folders = [os.path.join(ROOT, "data", "fashion_mnist"), os.path.join(ROOT, "data", "fashion_mnist", "FashionMNIST",
                                                                             "raw"), images.DEBIAN_FASHION]
        found = any(all(os.path.isfile(os.path.join(d, f)) for f in files) for d in folders)
    else:
        found = True
    return "" if found else f"missing {DATA[name]}"


def data_row(part, name, data):
    """A failed row at once for a run whose data are missing, else None."""
    missing = missing_data(data)
    return row(part, f"{name}: data", missing, "on disk", False) if missing else None


def skipped_row(item, why):
    return row(item.part, item.name, f"skipped: {why}", "", True, skipped=True)


def part_scripts(device="cuda", out="out-gpu-check", until=None, free_gib=None, capability=None, plan=None):
    """The script runs of the plan (pairs of Item and steps; None: every run whole), each in its turn (turns)."""
    rows = []
    peak = peak_flops(device, dtype=half_dtype(capability))
    if plan is None:
        plan = [(item, item.steps) for item in plan_items(["scripts"], ("", capability, free_gib))]
    if not os.path.isfile(os.path.join(out, "data", TOKENS, "meta.json")):
        write_tokens(os.path.join(out, "data", TOKENS))
    for item, steps, limit, why in turns(plan, until):
        if steps is None:
            rows.append(skipped_row(item, why))
            continue
        kind = item.name.split()[1]
        runs = script_runs(device, out, free_gib, capability, {kind: steps})
        label, (script, options, colour, per_step, unit, flops_per_step, _) = next(
            (label, run) for label, run in runs.items() if run[0] == f"train_{kind}.py")
        log = os.path.join(out, f"scripts-{kind}.log")
        code, lines = run_command(timed_command(script, options, colour, model_passes=True), limit, log=log)
        rows += script_rows(label, per_step, unit, flops_per_step, peak, code, lines, limit, item.name)
    return rows


# ---- default: the CPU default ViT recipe to the end -------------------------
def seed_band(values=CPU_DEFAULT_VAL_ACC, k=3):
    """mean +- k standard deviations of the CPU seeds: where another seed (or the GPU's arithmetic) lands."""
    mean, sd = statistics.mean(values), statistics.stdev(values)
    return mean - k * sd, mean + k * sd


def default_command(device="cuda", out="out-gpu-check"):
    """The CPU default recipe in one process, in float32 as the CPU seeds ran (the scripts' TF32 matmuls on a GPU)."""
    return timed_command("train_vit.py", [f"--device={device}", "--batch_size=256", "--dtype=float32",
                                          f"--out_dir={out}/vit-default"])


def default_row(code, lines, limit=None):
    """The default recipe's accuracy against the CPU seeds' band."""
    failed = failed_run("default", "train_vit.py --batch_size=256 --dtype=float32", code, lines, limit, "default")
    if failed:
        return failed
    result = result_of(lines)
    low, high = seed_band()
    acc = float(result["val_acc"])
    return row("default", f"train_vit.py default to the end, float32 ({result.get('seconds', '?')} s)",
               f"val_acc {acc:.4f}", f"{low:.4f}..{high:.4f} (CPU seeds)", low <= acc <= high, "vit_default_val_acc",
               f"{acc:.4f}")


def part_default(out="out-gpu-check", timeout=300, until=None):
    limit = min(timeout, seconds_left(until) - KILL_S)
    missing = data_row("default", "train_vit.py default", "fashion_mnist")
    if missing:
        return [missing]
    return [default_row(*run_command(default_command("cuda", out), limit, log=os.path.join(out, "default.log")), limit)]


# ---- torchrun: the NCCL path --------------------------------------------------
def torchrun_commands(nprocs, out="out-gpu-check"):
    """name -> command: each worker runs its script through this file (run_script_here), so a stalled one dumps its
    stack before it is killed."""
    launch = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nprocs}",
              os.path.abspath(__file__)]
    vit = ["--run_script=train_vit.py", "--model_passes=False", "--colour=0", "--dataset=synthetic",
           "--train_subset=1024", "--val_subset=256", "--batch_size=64", "--epochs=1", "--log_interval=4",
           f"--out_dir={out}/torchrun-vit"]
    gpt = ["--run_script=train_gpt.py", "--model_passes=False", "--colour=0", "--preset=gpt-tiny",
           f"--dataset={TOKENS}", f"--data_dir={out}/data", "--max_iters=20", "--eval_interval=20", "--eval_iters=2",
           "--log_interval=5", "--max_new_tokens=0", f"--out_dir={out}/torchrun-gpt"]
    return {"vit": launch + vit, "gpt": launch + gpt}


def torchrun_row(name, nprocs, code, lines, limit=None):
    """A torchrun run: exit 0 and one RESULT line (with one process the world size is 1: NCCL starts, and no gradient
    is exchanged)."""
    failed = failed_run("torchrun", f"{name} torchrun --nproc_per_node={nprocs}", code, lines, limit, f"torchrun {name}")
    if failed:
        return failed
    results = sum(text.startswith("RESULT ") for _, text in lines)
    what = "RESULT" if nprocs > 1 else "RESULT (world size 1: NCCL start-up only)"
    return row("torchrun", f"{name}: torchrun --nproc_per_node={nprocs}", what, "exit 0, one RESULT", results == 1)


def part_torchrun(out="out-gpu-check", until=None, plan=None):
    """The torchrun runs of the plan (pairs of Item and steps; None: the GPT's alone), each in its turn (turns)."""
    nprocs = min(2, torch.cuda.device_count())
    commands = torchrun_commands(nprocs, out)
    plan = plan or [(Item("torchrun", "torchrun gpt", ESTIMATE["torchrun gpt"]), 0)]
    if not os.path.isfile(os.path.join(out, "data", TOKENS, "meta.json")):
        write_tokens(os.path.join(out, "data", TOKENS))
    rows = []
    for item, steps, limit, why in turns(plan, until):
        kind = item.name.split()[1]
        if steps is None:
            rows.append(skipped_row(item, why))
            continue
        code, lines = run_command(commands[kind], limit, log=os.path.join(out, f"torchrun-{kind}.log"))
        rows.append(torchrun_row(kind, nprocs, code, lines, limit))
        if rows[-1]["ok"]:  # its seconds plan the next command
            rows[-1]["measured"] = dict(item=item.name, fixed_s=round(lines[-1][0], 1), cold=True)
    return rows


# ---- tests: the CUDA-only tests ---------------------------------------------
def part_tests(timeout=300, until=None, out="out-gpu-check"):
    """pytest on CUDA_TESTS; pytest dumps its stacks itself (faulthandler_timeout) before the limit."""
    limit = min(timeout, seconds_left(until) - KILL_S)
    code, lines = run_command([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "slow or not slow",
                               "-o", f"faulthandler_timeout={max(int(limit) - DUMP_WAIT - 1, 1)}", *CUDA_TESTS], limit,
                              log=os.path.join(out, "tests.log"))
    if code is None:
        return [stopped_row("tests", f"{len(CUDA_TESTS)} CUDA-only tests", limit, lines, "tests")]
    summary = next((text for _, text in reversed(lines) if re.search(r"\d+ (passed|failed|skipped|error)", text)), tail(lines))
    skipped = "skipped" in summary
    return [row("tests", f"{len(CUDA_TESTS)} CUDA-only tests", summary[-80:], "all pass, none skipped",
                code == 0 and not skipped)]


# ---- the table, the plan at each part, the deadline ---------------------------
PART_DATA = {"default": ("fashion_mnist",)}
ROWS = "gpu_check.txt"  # in out_dir: the plan, then each part's rows, written as the part ends


def print_table(rows, file=None):
    widths = [max(len(str(r[k])) for r in rows + [dict(part="part", check="check", value="value", limit="limit")])
              for k in ("part", "check", "value", "limit")]
    header = ("part", "check", "value", "limit", "ok")
    print("  ".join(h.ljust(w) for h, w in zip(header, widths + [2])), file=file)
    for r in rows:
        mark = "skip" if r.get("skipped") else "ok" if r["ok"] else "FAIL"
        cells = [str(r[k]) for k in ("part", "check", "value", "limit")] + [mark]
        print("  ".join(c.ljust(w) for c, w in zip(cells, widths + [4])), file=file)


def report(lines, out):
    """Print lines and add them to the rows file."""
    with open(os.path.join(out, ROWS), "a") as f:
        for line in lines:
            print(line, flush=True)
            f.write(line + "\n")


def gpu_facts(index=0):
    """(name, compute capability, free memory in GiB) of a GPU."""
    free, _ = torch.cuda.mem_get_info(index)
    return torch.cuda.get_device_name(index), torch.cuda.get_device_capability(index), free / GIB


def part_runners(out, capability=None, free_gib=None, part_plan=None, measured=None):
    """part -> a function of `until` (the perf_counter time by which it must end) that returns the part's rows.
    part_plan: the (Item, steps) pairs of the part about to run; measured: --measured's seconds (cost's compiles)."""
    compiles = {k: v for k, v in (measured or {}).items() if k.startswith("compile ") and v.get("cold")}
    compile_s = {k.split()[1]: v["fixed_s"] for k, v in compiles.items()}
    return dict(equal=partial(part_equal, capability=capability),
                cost=partial(part_cost, rounds=rounds, repeats=repeats, amp_dtype=half_dtype(capability),
                             free_gib=free_gib, out=out, compile_s=compile_s),
                scripts=partial(part_scripts, out=out, free_gib=free_gib, capability=capability, plan=part_plan),
                default=partial(part_default, out=out), torchrun=partial(part_torchrun, out=out, plan=part_plan),
                tests=partial(part_tests, out=out))


def give_up(code):
    """The end of a check that overran its deadline: threads and children may still hang, so no clean exit."""
    os._exit(code)


def overrun(out, running, seconds):
    """The watchdog's action GRACE seconds after the deadline: every run's stacks go to its log and this process's to
    the rows file, every started process is killed, one line, exit 1."""
    dump_stacks(f"{os.getpid()}-", wait=DUMP_WAIT / 2)
    line = (f"gpu_check: the deadline ({seconds:.0f} s + {GRACE} s) passed during part {running[-1]}: stopped; the rows "
            f"of the parts that ended and this process's stacks are in {os.path.join(out, ROWS)}, each run's output "
            f"in its .log there")
    with open(os.path.join(out, ROWS), "a") as f:
        f.write(line + "\n")
        f.flush()
        faulthandler.dump_traceback(file=f, all_threads=True)
    kill_runs(f"{os.getpid()}-")
    print(line, flush=True)
    give_up(1)


def main(parts, out, seconds=None, runners=None, gpu=None, start=None, items=None, measured_path=None):
    """Run the parts in order to end `seconds` (the --deadline) after `start` (a perf_counter time: the process's
    start for a command, now by default); returns the number of failed rows. As each part starts, the plan is made
    again from the time left (plan): the part gets the time its chosen items were planned, times SLACK, but never the
    time planned for the later parts' ones, and a `rest` part (cost) all of that. runners, gpu ((name, capability,
    free GiB)) and items stand in for the real parts, GPU and plan in tests; measured_path: --measured."""
    seconds = deadline if seconds is None else seconds
    start = time.perf_counter() if start is None else start
    end = start + seconds
    name, capability, free_gib = gpu or gpu_facts()
    print(f"gpu_check: {name} (compute capability {capability[0]}.{capability[1]}, {free_gib:.0f} GiB free), "
          f"{torch.cuda.device_count()} GPU(s), torch {torch.__version__}, parts {','.join(parts)}, deadline {seconds} s "
          f"({time.perf_counter() - start:.0f} s of it gone)", flush=True)
    for data in sorted({d for p in parts for d in PART_DATA.get(p, ())}):
        if missing_data(data):
            print(f"gpu_check: {missing_data(data)}: the runs that read it fail", flush=True)
    measured = load_measured(measured_path, name)
    items = plan_items(parts, (name, capability, free_gib), measured) if items is None else items
    open(os.path.join(out, ROWS), "w").close()
    report(plan_lines(items, *plan(items, end - time.perf_counter()), end - time.perf_counter()), out)
    rows = []
    running = ["start"]
    watchdog = threading.Timer(end + GRACE - time.perf_counter(), overrun, args=(out, running, seconds))
    watchdog.daemon = True
    watchdog.start()
    for n, part in enumerate(parts):
        running.append(part)
        t0 = time.perf_counter()
        remaining = [i for i in items if i.part in parts[n:]]
        chosen, skipped = plan(remaining, end - t0)
        mine = [(i, chosen[i.name]) for i in remaining if i.part == part and i.name in chosen]
        later = sum(i.seconds(chosen[i.name]) for i in remaining if i.part != part and i.name in chosen)
        allowed = end - t0 - later
        wanted = SLACK * sum(i.seconds(steps) for i, steps in mine)
        until = t0 + (allowed if any(i.rest for i, _ in mine) else min(allowed, wanted))
        part_rows = [skipped_row(i, skipped[i.name]) for i in remaining if i.part == part and i.name in skipped]
        if mine:
            try:
                part_rows += (runners or part_runners(out, capability, free_gib, mine, measured))[part](until=until)
            except Exception as e:  # one broken part (out of memory, say) still leaves the others' rows
                part_rows.append(row(part, "runs", f"{type(e).__name__}: {str(e).splitlines()[0][:120] if str(e) else ''}",
                                     "no exception", False))
        if torch.cuda.is_available():
            torch.cuda.empty_cache()  # the subprocesses of later parts get the memory back
        took = time.perf_counter() - t0
        rows += part_rows
        print(f"gpu_check: {part} done in {took:.0f} s (it had {until - t0:.0f} s)", flush=True)
        for r in part_rows:
            if r.get("measured"):
                measured[r["measured"]["item"]] = {k: v for k, v in r["measured"].items() if k != "item"}
        if len(mine) == 1 and not mine[0][0].rest and mine[0][0].name == part and all(r["ok"] for r in part_rows):
            measured[part] = dict(fixed_s=round(took, 1), cold=True)  # a part that is one item: its whole time
        if measured_path:
            save_measured(measured_path, name, measured)
        with open(os.path.join(out, ROWS), "a") as f:
            print_table(part_rows, file=f)
        checked = [r for r in rows if not r.get("skipped")]
        result = dict(gpu=name.replace(" ", "_"), torch=torch.__version__, parts=",".join(parts[:n + 1]),
                      checks=len(checked), failed=sum(not r["ok"] for r in checked))
        if len(checked) < len(rows):
            result["skipped"] = len(rows) - len(checked)
        result.update(seconds=round(time.perf_counter() - start), **{r["key"]: r["number"] for r in rows if r["key"]})
        write_result(out, **result)  # the RESULT line so far: a killed check keeps it
    watchdog.cancel()
    print_table(rows)
    if result.get("skipped"):
        print(f"gpu_check: {result['skipped']} check(s) skipped for time: run their part alone (--only=PART)")
    write_result(out, **result)
    return result["failed"]


if __name__ == "__main__" and sys.argv[1:2] and sys.argv[1].startswith("--run_script="):  # timed_command's order
    run_script_here(sys.argv[1].split("=", 1)[1], sys.argv[4:], int(sys.argv[3].split("=", 1)[1]),
                    sys.argv[2] == "--model_passes=True")
elif __name__ == "__main__" and sys.argv[1:2] and sys.argv[1].startswith("--cost_run="):
    faulthandler.register(signal.SIGUSR1, all_threads=True)  # the parent's signal before a kill: stacks, not silence
    cost_run(json.loads(sys.argv[1].split("=", 1)[1]))
elif __name__ == "__main__":
    configure(globals())
    wanted = PARTS if only == "all" else tuple(only.split(","))
    unknown = [p for p in wanted if p not in PARTS]
    if unknown:
        sys.exit(f"error: --only={only}: unknown part(s) {', '.join(unknown)}; choose from {','.join(PARTS)} or all")
    if not torch.cuda.is_available():
        print(f"gpu_check.py needs a CUDA GPU and torch {torch.__version__} sees none; on a CPU run "
              f"python -m pytest -q -m slow tests/test_compiled.py", file=sys.stderr)
        sys.exit(2)
    out_dir = os.path.abspath(out_dir)  # the runs happen in the repository root
    os.makedirs(out_dir, exist_ok=True)
    sys.exit(1 if main(wanted, out_dir, deadline, start=time.perf_counter() - process_age(),
                       measured_path=os.path.abspath(measured)) else 0)
