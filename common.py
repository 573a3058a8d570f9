"""The run plumbing every nanolap script shares, as nanochat keeps it in nanochat/common.py: devices, dtype and
processes; seeds and schedules; checkpoints and run folders; logs, errors and the RESULT line. The options are in
configurator.py."""

import atexit
import functools
import json
import logging
import math
import os
import pickle
import platform
import re
import subprocess
import sys
import tempfile
import time
import zipfile
import zlib
from contextlib import contextmanager, nullcontext, suppress

import torch
import torch.distributed as dist

from nanolap import Config, build_model


class UsageError(ValueError):
    """A mistake in the user's input: scripts print it as one line, without a traceback."""


# ---- devices, dtype and processes
def resolve_device(device):
    """'auto' = cuda, else mps, else cpu; 'cpu', 'cuda', 'cuda:N' and 'mps' are checked to exist."""
    kind = device.split(":")[0]
    has = dict(cpu=True, cuda=torch.cuda.is_available(), mps=torch.backends.mps.is_available())
    if device == "auto":
        return "cuda" if has["cuda"] else "mps" if has["mps"] else "cpu"
    if not has.get(kind, False):
        raise UsageError(f"--device={device}: this machine has no {kind.upper()} device; use --device=cpu (or auto)"
                         if kind in has else f"--device={device!r}: choose auto, cpu, cuda, cuda:N or mps")
    return device

def start_processes(out_dir, resume, device, oom_advice=""):
    """A run's start in every script: the first process prepares out_dir before the process group meets; oom_advice
    follows an out-of-memory traceback. Under torchrun each process takes GPU LOCAL_RANK (nccl) or the CPU (gloo).
    Returns (rank, local_rank, world, device)."""
    device = resolve_device(device)
    rank = int(os.environ.get("RANK", 0))
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    world = int(os.environ.get("WORLD_SIZE", 1))
    aside = prepare_out_dir(out_dir, resume) if rank == 0 else None
    sys.excepthook = functools.partial(report_error, out_dir=out_dir, aside=aside, oom_advice=oom_advice)
    if device.startswith("cuda"):  # TF32 for float32 matmuls (bfloat16 autocast covers most of them anyway)
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    if "RANK" in os.environ:  # under torchrun
        if device.startswith("cuda"):
            device = f"cuda:{local_rank}"
            torch.cuda.set_device(device)
        else:
            os.environ.update(gloo_environment())
        dist.init_process_group("nccl" if device.startswith("cuda") else "gloo")
    return rank, local_rank, world, device

def launch_processes(nprocs, device):
    """On a CPU with nprocs > 1, `python train_*.py` runs itself again in nprocs single-threaded processes, as
    `OMP_NUM_THREADS=1 torchrun --standalone --nproc_per_node=nprocs` would, and exits with their status (their own
    lines say what failed); in them, on a GPU or with one process, it returns at once."""
    if nprocs == 1 or "RANK" in os.environ or resolve_device(device) != "cpu":
        return
    from torch.distributed import run as torchrun
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    os.environ.update(OMP_NUM_THREADS="1", **gloo_environment())
    logging.disable(logging.ERROR)  # torchrun's own reports: the processes say what failed
    try:
        torchrun.run(torchrun.parse_args(["--standalone", f"--nproc_per_node={nprocs}", *sys.argv]))
    except (ChildFailedError, SignalException):  # a failed process, or Ctrl-C: the first process has said why
        sys.exit(1)
    except Exception as e:  # no rendezvous: a blocked port, a missing network library
        raise UsageError(f"the {nprocs} CPU processes cannot start here ({str(e).strip().splitlines()[0]}); train in one "
                         f"process with --cpu_procs=1 (raise batch_size {nprocs} times to keep the global batch)") from None
    sys.exit(0)

def gloo_environment():
    """A CPU process group's environment: PyTorch's TCPStore asks for libuv, which its Windows builds lack ("use_libuv
    was requested but PyTorch was build without libuv support", pytorch #139990)."""
    return {"USE_LIBUV": "0"} if os.name == "nt" else {}

def teardown_distributed():
    """The end of a run's process group: every process leaves it together, and all but the first, which have nothing
    left to do, end here without Python's finalisation: a DDP model keeps gloo's threads alive past the group, which
    may abort a finalising process ('terminate called without an active exception'), and torchrun then kills the
    first one, perhaps while it writes."""
    if not dist.is_initialized():
        return
    dist.barrier()
    dist.destroy_process_group()
    if int(os.environ.get("RANK", 0)) > 0:
        exit_unfinalised(0)

def exit_unfinalised(status):
    """End this process as Python's exit would, but without the finalisation in which gloo's threads may abort it."""
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)

def print0(*args):
    """print on the first process only (torchrun's RANK 0, as nanochat decides), as one write: lines never interleave."""
    if int(os.environ.get("RANK", 0)) == 0:
        print(" ".join(map(str, args)) + "\n", end="", flush=True)

def all_reduce_mean(x, device="cpu"):
    """Mean of a number or tensor over processes (identity without a process group)."""
    t = torch.as_tensor(x, dtype=torch.float64, device=device)
    if dist.is_initialized():
        dist.all_reduce(t)
        t /= dist.get_world_size()
    return t.item() if t.ndim == 0 else t

def to_device(t, device):
    """A host tensor on device. To a GPU from pinned memory and without blocking: a copy from pageable memory makes the
    host wait for the GPU's queued work, a sync in the middle of a step."""
    if torch.device(device).type == "cuda":
        return t.pin_memory().to(device, non_blocking=True)
    return t.to(device)

def amp_dtype(device, requested="auto"):
    """The dtype of --dtype on device. 'auto': bfloat16 where the GPU has bfloat16 tensor cores (capability 8.0 and up,
    as nanochat decides); float16 with a gradient scaler below; float32 on a CPU or MPS. 'bfloat16' on a CUDA GPU below
    8.0 (a T4, a V100) falls back to float16 with one line: such a GPU emulates bfloat16 several times slower, and a
    recipe that names bfloat16 (written for an A100 or H100) should still train at the card's speed on Colab's T4."""
    if requested not in ("auto", "float32", "bfloat16", "float16"):
        raise UsageError(f"--dtype={requested!r}: choose auto, float32, bfloat16 or float16")
    if not str(device).startswith("cuda"):
        return torch.float32 if requested == "auto" else getattr(torch, requested)
    capability = torch.cuda.get_device_capability(device)
    bfloat16_cores = capability >= (8, 0)
    if requested == "auto":
        return torch.bfloat16 if bfloat16_cores else torch.float16
    if requested == "bfloat16" and not bfloat16_cores:
        print0(f"--dtype=bfloat16: this GPU (compute capability {capability[0]}.{capability[1]}) has no bfloat16 tensor "
               f"cores and would emulate it slowly; training in float16 with a gradient scaler instead")
        return torch.float16
    return getattr(torch, requested)

def autocast(device, dtype):
    """(context, dtype) of --dtype (amp_dtype). float16 needs a torch.amp.GradScaler, enabled=dtype == torch.float16."""
    amp = amp_dtype(device, dtype)
    return (nullcontext() if amp == torch.float32 else torch.autocast(str(device).split(":")[0], dtype=amp)), amp

# how a run names its arithmetic (amp_dtype's answer) in its first lines
DTYPE_WORDS = {torch.float32: "float32", torch.bfloat16: "bfloat16 autocast",
               torch.float16: "float16 autocast with a gradient scaler"}

def check_compile(compile_model, device):
    """--compile_model on a CUDA GPU needs Triton (inductor writes Triton kernels): without, one line before training."""
    from torch.utils._triton import has_triton  # imports torch's compiler: only where it is wanted
    if compile_model and str(device).startswith("cuda") and not has_triton():
        raise UsageError("--compile_model: torch.compile needs Triton on a CUDA GPU, and this Python has none (or it "
                         "cannot drive this GPU); run without --compile_model, or install Triton (pip install "
                         "triton; on Windows pip install triton-windows)")

# Dense float16/bfloat16 tensor-core FLOP/s for MFU (NVIDIA's datasheets, sparse figures halved; GeForce: "FP16 Tensor
# TFLOPS with FP32 Accumulate"), keyed by whole chip names: an A10G is no A10; a MIG slice or a laptop GPU gets no MFU.
GPU_PEAK_FLOPS = {
    r"H100( SXM5?)?": 989e12, r"H100 PCIE": 756e12, r"H100 NVL": 835e12, r"H200( SXM)?": 989e12, r"H200 NVL": 835e12,
    r"GH200": 989e12, r"A100( SXM4?| PCIE)?": 312e12, r"A10": 125e12, r"L4": 121e12, r"L40S": 362e12, r"L40": 181e12,
    r"T4": 65e12, r"V100 SXM2": 125e12, r"V100 PCIE": 112e12, r"RTX A6000": 154.8e12, r"RTX 4090": 165.2e12,
    r"RTX 4080": 97.5e12, r"RTX 3090 TI": 80e12, r"RTX 3090": 71e12, r"RTX 3080": 59.5e12,
}

def peak_flops(device, name=None, dtype=torch.float16):
    """Dense peak FLOP/s of a CUDA device (or a GPU called `name`) in dtype; None for a CPU, an unknown GPU, float32."""
    if name is None and not str(device).startswith("cuda") or dtype == torch.float32:
        return None
    words = re.split(r"[\s_-]+", (name or torch.cuda.get_device_name(device)).strip().upper())
    chip = " ".join(w for w in words if w not in ("NVIDIA", "TESLA", "GEFORCE") and not re.fullmatch(r"\d+GB|HBM\w*", w))
    if dtype == torch.bfloat16 and re.fullmatch(r"T4|V100( .*)?", chip):  # before Ampere: bfloat16 is emulated
        return None
    return next((flops for key, flops in GPU_PEAK_FLOPS.items() if re.fullmatch(key, chip)), None)

def machine_name(device):
    """One word for the RESULT line (floats differ by machine): the GPU, or the CPU and the vector kernels torch uses."""
    if str(device).startswith("cuda"):
        name = torch.cuda.get_device_name(device)
    else:
        name = f"{cpu_model_name()} {torch.backends.cpu.get_cpu_capability()}"
    name = re.sub(r"\((R|TM)\)", "", name, flags=re.I)  # Intel's trademark signs: Intel(R) Xeon(R) is an Intel Xeon
    return re.sub(r"\s+", "_", name.strip())

def cpu_model_name():
    """The CPU's model name: /proc/cpuinfo on Linux, sysctl on a Mac, else what the platform module says."""
    with suppress(OSError):
        found = re.search(r"^model name\s*:\s*(.+)$", open("/proc/cpuinfo").read(), re.M)
        if found:
            return found.group(1)
    with suppress(OSError, subprocess.SubprocessError):
        return subprocess.run(["sysctl", "-n", "machdep.cpu.brand_string"], capture_output=True, text=True,
                              timeout=5, check=True).stdout.strip()
    return platform.processor() or platform.machine() or "unknown CPU"

# ---- seeds and schedules: everything random in a step is a function of (seed, step, ...), so a resume is exact
# and a checkpoint holds no random state
def step_seed(*parts):
    """A seed from ints, e.g. (seed, step, rank): Python hashes int tuples alike in every process and run."""
    return hash(tuple(parts)) & 0x7FFF_FFFF_FFFF_FFFF

def cosine_schedule(step, total, start, end):
    """start at step 0, then a half cosine to end at step `total` (and end after it). The scripts' get_lr puts a
    linear warm-up before it."""
    progress = min(step / max(total, 1), 1.0)
    return end + 0.5 * (start - end) * (1 + math.cos(math.pi * progress))

# ---- checkpoints and run folders
CHECKPOINT = "ckpt.pt"
LOG = "log.jsonl"  # one JSON line per evaluation
RESULT = "result.txt"  # the RESULT line
ANALYSIS = "analysis.json"  # analyze.py's numbers
SUMMARY = "summary.md"  # analyze.py's and the report's tables
CHECKPOINT_STEPS = {}  # {path: step} of the checkpoints this process saved or verified: what a stopped run names

def clean_state_dict(state_dict):
    """Strip the prefixes that torch.compile (_orig_mod.) and DDP (module.) add to parameter names."""
    return {re.sub(r"(^|(?<=\.))(_orig_mod|module)\.", "", k): v for k, v in state_dict.items()}

@contextmanager
def atomic_write(path):
    """`with atomic_write(path) as f:` writes a binary temporary file, fsyncs it and renames it to path: a killed
    write leaves the old file (or none); an error inside the block writes nothing. Processes writing one path at once
    (two runs generating the same data) each rename a whole file of their own."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = f"{path}.tmp{os.getpid()}"
    try:
        with open(tmp, "wb") as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)

def save_checkpoint(obj, path):  # then remove what a save killed mid-write left (one run writes its out_dir)
    with atomic_write(path) as f:
        torch.save(obj, f)
    CHECKPOINT_STEPS[os.path.abspath(path)] = obj.get("step")
    folder = os.path.dirname(os.path.abspath(path))
    for name in [n for n in os.listdir(folder) if n.startswith(os.path.basename(path) + ".tmp")]:
        os.remove(os.path.join(folder, name))

def load_checkpoint(path, context="", map_location="cpu"):
    """torch.load with weights_only=True (tensors and plain data, never code), after checking the file's bytes against
    the checksums saved with them (damage), failing in one line."""
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{context}no checkpoint at {path}")
    reason = damage(path)
    if reason is None:
        try:
            ckpt = torch.load(path, map_location=map_location, weights_only=True)
        except pickle.UnpicklingError:  # bytes as saved, but more than tensors and plain data
            raise UsageError(f"{context}{path} holds Python objects, which could run code: it is not loaded") from None
        except (RuntimeError, ValueError, EOFError, OSError) as e:  # damage that no checksum covers (zip's directory)
            reason = f"torch.load failed: {type(e).__name__}"
    if reason is not None:
        fix = "restore it, or start afresh without --resume" if context.startswith("--resume") else "restore it"
        raise UsageError(f"{context}{path} cannot be read ({reason}): the file is damaged or truncated (a failing "
                         f"disk, an interrupted copy?); {fix}")
    if not isinstance(ckpt, dict):
        raise UsageError(f"{context}{path} is not a nanolap checkpoint (a dict of tensors and plain data)")
    CHECKPOINT_STEPS[os.path.abspath(path)] = ckpt.get("step")
    return ckpt

def damage(path):
    """What is wrong with a checkpoint's bytes, or None. torch.save writes a zip archive that keeps a CRC-32 checksum of
    each record (the pickle, every tensor's bytes); torch.load never checks them, so a flipped bit in a weight or in the
    optimizer state would load silently. zipfile compares each record with its checksum as it reads it. Records saved
    without checksums (CRC 0: torch.serialization.set_crc32_options(False)) are read unchecked: such checkpoints load."""
    broken = (zipfile.BadZipFile, EOFError, OSError, ValueError, NotImplementedError, RuntimeError, zlib.error)
    with open(path, "rb") as file:  # a file that cannot be opened at all raises its own OSError here
        try:
            archive = zipfile.ZipFile(file)
        except broken:
            return "it is no whole zip archive, as torch.save writes"
        for record in archive.infolist():
            # torch's zip reader (miniz) reads a record whose DOS folder bit (0x10) is set as an empty folder: a bit
            # outside every checksum, which torch.save never sets
            if record.external_attr & 0x10:
                return f"record {record.filename} is marked as a folder"
            if record.CRC == 0:
                continue
            try:
                with archive.open(record) as f:  # reading to the end compares the CRC-32
                    while f.read(1 << 24):
                        pass
            except broken:
                return f"record {record.filename} differs from what was saved"
    return None

def load_model(ckpt):
    """Rebuild the model of a loaded nanolap checkpoint (load_checkpoint)."""
    model = build_model(Config(**ckpt["model_config"]))
    model.load_state_dict(clean_state_dict(ckpt["model"]))
    return model

def prepare_out_dir(out_dir, resume):
    """Make out_dir and prove it writable. A fresh run never overwrites an earlier one: what describes it (checkpoint,
    log, RESULT, analyze.py's files and folders) moves to a new out_dir/previous-<time>-*/, returned (else None)."""
    try:
        os.makedirs(out_dir, exist_ok=True)
        open(os.path.join(out_dir, ".write-test"), "w").close()
        os.remove(os.path.join(out_dir, ".write-test"))
    except OSError as e:
        raise UsageError(f"--out_dir={out_dir} cannot be written ({e.strerror or e}); choose another --out_dir") from None
    run_files = (CHECKPOINT, LOG, RESULT, "analysis", ANALYSIS, "analysis_all.json", SUMMARY)
    old = sorted(n for n in os.listdir(out_dir) if n in run_files or n.endswith(".png")
                 or not n.startswith("previous-") and os.path.isfile(os.path.join(out_dir, n, ANALYSIS)))
    if resume or not old:
        return None
    aside = tempfile.mkdtemp(prefix=time.strftime("previous-%Y%m%d-%H%M%S-"), dir=out_dir)  # a new, unique folder
    for name in old:
        os.replace(os.path.join(out_dir, name), os.path.join(aside, name))
    print(f"note: {out_dir} held an earlier run: its {', '.join(old)} moved to {aside}", flush=True)
    return aside

# ---- logs, errors and the RESULT line
def append_jsonl(path, record):
    """Append record to the log as one line of strict JSON: a number that is not finite (NaN, inf) is written null."""
    record = {k: None if isinstance(v, float) and not math.isfinite(v) else v for k, v in record.items()}
    with open(path, "a") as f:
        f.write(json.dumps(record, allow_nan=False) + "\n")

class LogWindow:
    """The steps since the last progress line, as every loop adds them up: each step's loss and gradient norm, summed
    on the device and read on the host only by read() (at a progress line, before a checkpoint: a read waits for the
    GPU); and, on the host, the loss of the steps since the last log.jsonl record, which a checkpoint keeps."""

    def __init__(self, device, ckpt=None):  # ckpt: a resumed run's checkpoint, whose record goes on
        self.device = device
        self.loss = torch.zeros((), device=device)
        self.norm = torch.zeros((), device=device)
        self.steps = 0
        self.start = time.time()
        self.record_loss = ckpt["record_loss"] if ckpt else 0.0  # the loss summed over the steps since the last
        self.record_steps = ckpt["record_steps"] if ckpt else 0  # record, and their number

    def add(self, loss, grad_norm):
        self.loss += loss
        self.norm += grad_norm
        self.steps += 1

    def read(self, step):
        """Close the window at `step`: its sums, averaged over the processes, must be finite, and its steps join the
        record. Returns the window's mean loss and seconds per step; a new window starts."""
        loss, norm = all_reduce_mean(torch.stack([self.loss, self.norm]), self.device).tolist()
        check_finite(loss, step - 1, first_step=step - self.steps)
        check_finite(norm, step - 1, first_step=step - self.steps, what="gradient norm")
        steps = max(self.steps, 1)
        seconds = time.time() - self.start
        self.record_loss += loss
        self.record_steps += self.steps
        self.loss.zero_()
        self.norm.zero_()
        self.steps = 0
        self.start = time.time()
        return loss / steps, seconds / steps

    def train_loss(self):
        """The mean loss of the steps since the last record (None before any step); the next record starts here."""
        mean = self.record_loss / self.record_steps if self.record_steps else None
        self.record_loss = 0.0
        self.record_steps = 0
        return mean

def progress_line(step, max_iters, loss, lr, speed, unit, seconds_per_step, *fields):
    """The progress line of every script: the step, the mean training loss of the steps since the last line, the
    learning rate, the speed, the script's own fields, and the ETA: the steps left at this window's seconds per step
    (training time: evaluations are not counted)."""
    eta = format_time((max_iters - step) * seconds_per_step)
    return " | ".join([f"step {step}/{max_iters}", f"loss {loss:.4f}", f"lr {lr:.2e}", f"{speed:,.0f} {unit}", *fields,
                       f"eta {eta}"])

def keep_log_until(path, step):
    """On --resume: the log keeps its records up to the checkpoint's step (later ones, and a line cut short, belong to
    the steps the interrupted run loses)."""
    with open(path, "a+") as f:  # a+: the file may not exist yet
        f.seek(0)
        kept = [line for line in f if line.endswith("}\n") and json.loads(line)["step"] <= step]
        f.truncate(0)
        f.writelines(kept)

def log_record(path, record, keys):
    """An evaluation: print `eval step N: key value ...` with the record's own names for keys, and (first process)
    append the record to log.jsonl. Every record begins with the same keys: step, lr, train_loss (the mean training
    loss of the steps since the previous record; null at a run's first) and seconds (since the run began)."""
    words = [f"{k} {record[k]:.4f}" for k in keys if isinstance(record.get(k), float)]
    print0(f"eval step {record['step']}: " + " ".join(words))
    if int(os.environ.get("RANK", 0)) == 0:
        append_jsonl(path, record)

def write_result(out_dir, **values):
    """Print the run's last line `RESULT key=value ...` (floats: 4 decimals, lists: no spaces), kept in result.txt."""
    line = "RESULT " + " ".join(f"{k}={_result_value(v)}" for k, v in values.items())
    print(line + "\n", end="", flush=True)
    os.makedirs(out_dir, exist_ok=True)  # a benchmark's out_dir may not exist yet
    with open(os.path.join(out_dir, RESULT), "w") as f:
        f.write(line + "\n")

def _result_value(v):
    if isinstance(v, float):
        return f"{v:.4f}"
    if isinstance(v, list):
        return json.dumps(v, separators=(",", ":"))
    return str(v)

def read_result(run_dir):
    """The key=value pairs (strings, in order) of run_dir/result.txt, the RESULT line; {} without one."""
    path = os.path.join(run_dir, RESULT)
    if not os.path.isfile(path):
        return {}
    return dict(word.split("=", 1) for word in open(path).read().split() if "=" in word)

def check_finite(value, step, first_step=None, what="loss"):
    """Stop when a loss (or gradient norm) is NaN or inf: the loss of `step`, before its optimizer step; or (first_step
    given) a sum over steps first_step..step, which the loops add up on the device and read on the host only at a
    progress line or before a checkpoint (a read waits for the GPU), so no checkpoint holds these steps' weights."""
    if math.isfinite(float(value)):
        return
    if first_step is None:
        where = f"at step {step}: stopped before the optimizer step"
    else:
        steps = f"at step {step}" if first_step == step else f"in steps {first_step}-{step}"
        where = f"{steps}: stopped before a checkpoint holds the weights of these steps"
    raise FloatingPointError(f"non-finite {what} {float(value)} {where}. Try a lower learning rate or --grad_clip.")

@torch.no_grad()
def check_finite_weights(tensors, step):
    """Stop before a checkpoint would save a NaN or inf: the weights that steps not yet checked may have spoiled (under
    float16 a step's gradient norm is the scaler's 0, so only the weights tell). One host read."""
    if not torch.stack([t.isfinite().all() for t in tensors]).all():
        raise FloatingPointError(f"non-finite weights after step {step}: stopped before they are saved. "
                                 f"Try a lower learning rate or --grad_clip.")

def format_time(seconds):
    s = int(seconds)
    return f"{s // 3600}h{s // 60 % 60:02d}m" if s >= 3600 else f"{s // 60}m{s % 60:02d}s"

def report_error(kind, error, tb, out_dir=None, aside=None, oom_advice=""):
    """The scripts' sys.excepthook: bad input, a non-finite loss and Ctrl-C end in one line from the first process that
    says what was saved where; an error in the code keeps its traceback, out of memory adds advice after it."""
    saved = ""  # what a run that stops now leaves: its checkpoint, or nothing (and where an earlier run went)
    checkpoint = os.path.abspath(os.path.join(out_dir, CHECKPOINT)) if out_dir else ""
    step = CHECKPOINT_STEPS.get(checkpoint)  # known when this run saved the checkpoint or checked it on --resume
    if os.path.isfile(checkpoint) and step is not None:
        saved = f"; the last checkpoint is intact: continue with --resume --out_dir={out_dir} (it holds step {step})"
    elif out_dir and not os.path.isfile(checkpoint):
        saved = "; no checkpoint yet, nothing to resume" + (f"; the earlier run in {out_dir} is in {aside}" if aside else "")
    if issubclass(kind, KeyboardInterrupt):
        message = "interrupted" + saved
    elif issubclass(kind, (UsageError, OSError, FloatingPointError)):
        message = f"error: {error}" + (saved if kind is FloatingPointError else "")
    else:
        sys.__excepthook__(kind, error, tb)
        out_of_memory = isinstance(error, torch.OutOfMemoryError) or "MPS backend out of memory" in str(error)
        message = f"out of memory {oom_advice}" if out_of_memory and oom_advice else None
    if message and int(os.environ.get("RANK", 0)) == 0:
        print(message, file=sys.__stderr__, flush=True)  # a process group prefixes sys.stderr's lines with the rank
    if dist.is_initialized():  # Ctrl-C or an error in a process group: its threads would abort 2 of 12 Ctrl-C'd runs
        exit_unfinalised(1)
