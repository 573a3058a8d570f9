"""The run plumbing every nanolap script shares (nanochat keeps the same in nanochat/common.py): options and config
files, devices and processes, seeds and schedules, checkpoints and the output folder, logging and the RESULT line.
The model itself is in nanolap.py; this file imports it only to build a model from options or from a checkpoint.
"""

import ast
import atexit
import difflib
import hashlib
import json
import math
import os
import platform
import random
import re
import shlex
import socket
import subprocess
import sys
import tempfile
import threading
import time
from contextlib import contextmanager, nullcontext, suppress
from dataclasses import asdict, fields

import torch
import torch.distributed as dist

from nanolap import PRESETS, Config, build_model, make_config


class UsageError(ValueError):
    """A mistake in the user's input: scripts print it as one line, without a traceback."""


# ---- options: plain commented globals of a script, --key=value overrides and config files, never code
def _typed(key, value, default):
    if isinstance(value, str) and not isinstance(default, str) or default is None:
        with suppress(ValueError, SyntaxError):  # a bare word stays a string: --dataset=cifar10
            value = ast.literal_eval(value)
    if default is None or value is None:
        return value
    value = float(value) if isinstance(default, float) and type(value) is int else value  # --lr=1 is 1.0
    n_lap_list = key == "n_lap" and isinstance(value, (list, tuple))
    if not (n_lap_list or type(value) is type(default) or isinstance(value, type(default)) and not isinstance(value, bool)):
        raise UsageError(f"--{key}={value!r} has type {type(value).__name__}, expected {type(default).__name__} like the default {default!r}")
    return list(value) if isinstance(value, tuple) else value

def parse_args(defaults, argv=None):
    """defaults, then config files and --key=value options in command-line order -> a new dict."""
    config = dict(defaults)
    for arg in sys.argv[1:] if argv is None else argv:
        key, has_value, text = arg[2:].partition("=")
        if arg.startswith("--") and key not in config:
            raise UsageError(f"unknown option --{key};{_closest(key, config, '--')} --help lists every option")
        if arg.startswith("--") and not has_value and not isinstance(config[key], bool):
            raise UsageError(f"--{key} needs a value: --{key}=...")
        if arg.startswith("--"):
            config[key] = _typed(key, text if has_value else "True", defaults[key])  # --flag is --flag=True
            continue
        if not os.path.isfile(arg):
            raise UsageError(f"{arg!r} is neither a --key=value option nor a config file")
        try:
            tree = ast.parse(open(arg).read(), arg)
        except SyntaxError as e:
            raise UsageError(f"config file {arg}: line {e.lineno}: {e.msg}")
        for node in tree.body:
            where = f"config file {arg}: line {node.lineno}"
            if not (isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name)):
                raise UsageError(f"{where}: only `key = value` lines are allowed")
            if node.targets[0].id not in config:
                raise UsageError(f"{where}: unknown key {node.targets[0].id!r};"
                                 f"{_closest(node.targets[0].id, config)} --help lists every option")
            try:
                value = ast.literal_eval(node.value)
            except ValueError:
                raise UsageError(f"{where}: {node.targets[0].id} must be a literal value")
            config[node.targets[0].id] = _typed(node.targets[0].id, value, defaults[node.targets[0].id])
    return config

def _closest(name, names, prefix=""):
    """' did you mean --a or --b?' for the nearest valid names (difflib), '' when none is near."""
    close = difflib.get_close_matches(name, list(names), n=3, cutoff=0.6)
    return f" did you mean {' or '.join(prefix + c for c in close)}?" if close else ""

def configure(namespace, argv=None, schedule=()):
    """Resolve a script's options (see declared_options) into it; --help lists them with their comments.
    --resume: the options saved in out_dir/ckpt.pt are the base and the command line goes on top, but neither the model,
    the data (Config fields, preset, dataset, seed) nor the `schedule` length (a longer one would raise the learning
    rate of a cooled-down run again) may change. Returns (config, checkpoint or None)."""
    install_error_handler()
    argv = sys.argv[1:] if argv is None else argv
    comments = declared_options(namespace)
    options = {k: namespace[k] for k in comments}
    if {"-h", "--help"} & set(argv):
        print(namespace["__doc__"].strip() + "\n\noptions (--key=value, or key = value lines in a config file):")
        print("\n".join(f"  --{k}={v!r}  # {comments[k]}" for k, v in options.items()))
        sys.exit(0)
    config, ckpt = parse_args(options, argv), None
    _defaults.update(options)  # finished_run() names the options a run was given: those that differ from these
    if config.get("resume"):
        ckpt = load_checkpoint(os.path.join(config["out_dir"], CHECKPOINT), "--resume: ")
        saved = {k: v for k, v in ckpt.get("config", {}).items() if k in options}
        config = parse_args({**options, **saved, "resume": True, "out_dir": config["out_dir"]}, argv)
        fixed = [f.name for f in fields(Config)] + ["preset", "dataset", "seed", *schedule]
        changed = [f"--{k}={config[k]!r} (checkpoint: {saved[k]!r})" for k in fixed if k in saved and config[k] != saved[k]]
        if changed:
            raise UsageError(f"--resume continues a run exactly: it cannot change the model, data or schedule ({', '.join(changed)}). "
                             f"To train longer, run the longer schedule in a new --out_dir (--stop_at_step stops early)")
    namespace.update(config)
    return config, ckpt

_defaults = {}  # the running script's option defaults, kept by configure() for finished_run()

def check_options(config, at_least=None, above_zero=(), fractions=(), choices=None):
    """A script's rules for its options, declared once and worded alike: at_least {minimum: [keys]},
    above_zero [keys] (> 0), fractions [keys] (in [0, 1]), choices {key: allowed values}. Raises UsageError."""
    def require(key, ok, why):
        if not ok:
            raise UsageError(f"--{key}={config[key]!r}: {why}")
    for minimum, keys in (at_least or {}).items():
        for key in keys:
            require(key, config[key] >= minimum, f"must be at least {minimum}")
    for key in above_zero:
        require(key, config[key] > 0, "must be greater than 0")
    for key in fractions:
        require(key, 0 <= config[key] <= 1, "must lie in [0, 1]")
    for key, allowed in (choices or {}).items():
        require(key, config[key] in allowed, f"choose one of {', '.join(map(str, allowed))}")

def check_resume(ckpt, kind, model_config):
    """--resume continues one run: the checkpoint must hold a `kind` run of the same model. Raises UsageError."""
    if ckpt.get("kind") != kind:
        raise UsageError(f"--resume: the checkpoint holds a {ckpt.get('kind')} run, not a {kind} one; use a new --out_dir")
    if asdict(Config(**ckpt["model_config"])) != asdict(model_config):  # a field added since takes its default
        raise UsageError("--resume: the checkpoint holds a different model; do not change model options on resume, "
                         "or use a new --out_dir")

def declared_options(namespace):
    """{option: its comment}, in the script's order: the top-level `name = value  # comment` lines of the script's file
    whose name is lower-case and whose value is a literal (None, bool, int, float, str, list). Any other global, a
    constant, an import or a line without a comment, never becomes an option by accident."""
    lines = re.findall(r"^([a-z]\w*) = .*?  # (.*)$", open(namespace["__file__"]).read(), re.M)
    literal = (type(None), bool, int, float, str, list)
    return {k: why for k, why in lines if k.islower() and isinstance(namespace.get(k, ()), literal)}

def install_error_handler():
    """Input mistakes, a non-finite loss, running out of GPU memory and Ctrl-C end in one stderr line (no traceback)
    from the first process."""
    def handler(kind, error, tb):
        rank = int(os.environ.get("RANK", 0))
        if issubclass(kind, KeyboardInterrupt):
            message = "interrupted; the last checkpoint is intact (continue with --resume)"
        elif issubclass(kind, (UsageError, OSError, FloatingPointError)):  # OSError: a missing file, a full disk, ...
            message = f"error: {error}"
        elif is_out_of_memory(error):
            message = f"error: out of memory {_memory_advice[0]}" if _memory_advice else f"error: {error}".split("\n")[0]
        elif not (rank > 0 and issubclass(kind, RuntimeError)):  # not a lost peer (rank 0 says why)
            return sys.__excepthook__(kind, error, tb)
        if rank == 0:
            print(message, file=sys.__stderr__, flush=True)  # torch's process group wraps sys.stderr
        remove_empty_out_dirs()
        os._exit(1)  # skip the process group's destructor, which can abort once a peer is gone
    sys.excepthook = handler

def is_out_of_memory(error):
    """A CUDA out-of-memory error, or MPS's (a RuntimeError: 'MPS backend out of memory ...')."""
    mps = isinstance(error, RuntimeError) and "MPS backend out of memory" in str(error)
    return isinstance(error, torch.OutOfMemoryError) or mps

_memory_advice = []  # what a run says when its device's memory runs out: set by on_out_of_memory

def on_out_of_memory(advice):
    """The error handler's one line when memory runs out later in this run: the run, the batch it tried, and what to lower."""
    _memory_advice[:] = [advice]

def config_from_options(options, kind, **fixed):
    """Model Config of a script's options: preset, then options named like Config fields (None = keep), then `fixed`."""
    names = [name for name, p in PRESETS.items() if p["model"] == kind]
    if options["preset"] not in names:
        raise UsageError(f"--preset={options['preset']!r}: choose one of {names}")
    overrides = {f.name: options[f.name] for f in fields(Config) if f.name in options}
    try:
        return make_config(options["preset"], **{**overrides, **fixed})
    except ValueError as e:  # the model's rules, as a usage error
        raise UsageError(str(e)) from None

# ---- devices and processes
def resolve_device(device):
    """'auto' = cuda, else mps, else cpu; 'cpu', 'cuda', 'cuda:N' and 'mps' are checked to exist."""
    kind, has = device.split(":")[0], dict(cpu=True, cuda=torch.cuda.is_available(), mps=torch.backends.mps.is_available())
    if device == "auto":
        return "cuda" if has["cuda"] else "mps" if has["mps"] else "cpu"
    if not has.get(kind, False):
        raise UsageError(f"--device={device}: this machine has no {kind.upper()} device; use --device=cpu (or auto)"
                         if kind in has else f"--device={device!r}: choose auto, cpu, cuda, cuda:N or mps")
    return device

def launch_cpu_processes(nprocs, device):
    """DDP on a CPU without torchrun: with nprocs > 1 on the CPU, run this command in nprocs single-threaded processes
    that form a gloo group (torchrun's variables, set here), and exit with their status; else (or in them) return.
    Where their group cannot start, this process says so in one line and returns: it trains alone."""
    if nprocs < 1:
        raise UsageError(f"--cpu_procs={nprocs}: must be at least 1")
    if "NANOLAP_LAUNCHER" in os.environ:  # one of the processes: stop when the launcher is gone
        threading.Thread(target=_exit_with_launcher, args=(int(os.environ["NANOLAP_LAUNCHER"]),), daemon=True).start()
    if nprocs == 1 or "RANK" in os.environ or resolve_device(device) != "cpu":
        return
    with socket.create_server(("127.0.0.1", 0)) as s:  # a free port for the process group
        port = s.getsockname()[1]
    env = dict(os.environ, WORLD_SIZE=str(nprocs), LOCAL_WORLD_SIZE=str(nprocs), MASTER_ADDR="127.0.0.1",
               MASTER_PORT=str(port), NANOLAP_LAUNCHER=str(os.getpid()), OMP_NUM_THREADS="1", OMP_WAIT_POLICY="PASSIVE")
    env[GROUP_ERROR_FILE] = os.path.join(tempfile.gettempdir(), f"nanolap-group-error-{os.getpid()}.txt")
    with suppress(OSError):  # left by a killed launcher of the same process id
        os.remove(env[GROUP_ERROR_FILE])
    procs = [subprocess.Popen([sys.executable, *sys.argv], env=dict(env, RANK=str(r), LOCAL_RANK=str(r))) for r in range(nprocs)]
    with suppress(KeyboardInterrupt):  # they got the same Ctrl-C and stop cleanly
        while all(p.poll() in (None, 0) for p in procs) and any(p.poll() is None for p in procs):
            time.sleep(0.1)
    with suppress(subprocess.TimeoutExpired):  # one failed: the first process speaks for all, give it time to say why
        procs[0].wait(timeout=10)
    for p in procs:  # the others would wait for the failed one forever
        p.terminate() if p.poll() is None else None
        p.wait()
    if os.path.isfile(env[GROUP_ERROR_FILE]):  # their process group did not start: this process trains alone
        with open(env[GROUP_ERROR_FILE]) as f:
            reason = f.read()
        os.remove(env[GROUP_ERROR_FILE])
        print(f"note: the gloo process group of {nprocs} CPU processes cannot start here ({reason}); training in this "
              f"one process instead, as --cpu_procs=1 does (where batch_size is per process, the global batch is "
              f"{nprocs} times smaller)", flush=True)
        return
    sys.exit(next((abs(p.returncode) for p in procs if p.returncode), 0))

GROUP_ERROR_FILE = "NANOLAP_GROUP_ERROR"  # names the file where the processes say why their group failed

def gloo_environment(os_name, torch_version):
    """The environment a CPU process group needs. PyTorch 2.4 and later ask their TCPStore for libuv, which its Windows
    builds lack: "use_libuv was requested but PyTorch was build without libuv support" (pytorch #139990); USE_LIBUV=0
    is the workaround."""
    version = tuple(int(part) for part in re.findall(r"\d+", torch_version)[:2])
    return {"USE_LIBUV": "0"} if os_name == "nt" and version >= (2, 4) else {}

def _exit_with_launcher(launcher):
    while os.getppid() == launcher:
        time.sleep(1)
    os._exit(1)

def setup_distributed(device="auto"):
    """Under torchrun: GPU LOCAL_RANK (nccl) or CPU (gloo) per process; returns (rank, local_rank, world, device)."""
    device = resolve_device(device)
    if "RANK" not in os.environ:
        return 0, 0, 1, device
    rank = int(os.environ["RANK"])
    local_rank = int(os.environ["LOCAL_RANK"])
    world = int(os.environ["WORLD_SIZE"])
    if device.startswith("cuda"):
        device = f"cuda:{local_rank}"
        torch.cuda.set_device(device)
    else:
        os.environ.update(gloo_environment(os.name, torch.__version__))
    try:
        dist.init_process_group("nccl" if device.startswith("cuda") else "gloo")
    except Exception as e:  # launch_cpu_processes falls back to one process; under torchrun the error stands
        if GROUP_ERROR_FILE not in os.environ:
            raise
        with open(os.environ[GROUP_ERROR_FILE], "w") as f:
            f.write(str(e).strip().split("\n")[0] or type(e).__name__)
        os._exit(1)
    return rank, local_rank, world, device

def start_processes(out_dir, resume, cpu_procs, device):
    """A training run's start, alike in every script: the first process prepares out_dir (a bad one fails once,
    before any other process starts), a CPU run launches its cpu_procs processes, each joins the process group,
    and on CUDA float32 matmuls run in TF32 (bfloat16 autocast covers most of them anyway).
    Returns (rank, local_rank, world, device)."""
    if os.environ.get("RANK", "0") == "0":
        prepare_out_dir(out_dir, resume)
    launch_cpu_processes(cpu_procs, device)
    rank, local_rank, world, device = setup_distributed(device)
    if device.startswith("cuda"):
        # the flags hold for the whole process: teardown_distributed puts back what it found, so a run inside a test
        # process (tests/test_gpt.py) leaves later float32 checks in float32
        _tf32_found.append((torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32))
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    return rank, local_rank, world, device

_tf32_found = []  # the TF32 flags as start_processes found them

def teardown_distributed():
    """The end of a process of a group: after the last collective, leave without the interpreter's finalisation.
    gloo's worker threads outlive destroy_process_group (even without the DDP model), and one that drops a Python
    object while the interpreter finalises is killed in C++: SIGABRT, 'terminate called without an active exception'.
    Every run ends here: the TF32 flags go back to what start_processes found."""
    if _tf32_found:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = _tf32_found[0]
        _tf32_found.clear()
    if not dist.is_initialized():
        return
    dist.barrier()  # nobody tears the group down while a peer still talks to it
    dist.destroy_process_group()
    atexit._run_exitfuncs()  # what a normal exit would still do (remove_empty_out_dirs), with the interpreter alive
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)

def print0(*args):
    """print on the first process only, as one write, so that lines of processes never interleave."""
    if not dist.is_initialized() or dist.get_rank() == 0:
        print(" ".join(map(str, args)) + "\n", end="", flush=True)

def all_reduce_mean(x, device="cpu"):
    """Mean of a number or tensor over processes (identity without a process group)."""
    t = torch.as_tensor(x, dtype=torch.float64, device=device)
    if dist.is_initialized():
        dist.all_reduce(t)
        t /= dist.get_world_size()
    return t.item() if t.ndim == 0 else t

def amp_dtype(device, requested="auto"):
    """The dtype of --dtype on device. 'auto': bfloat16 where the GPU has bfloat16 tensor cores (capability 8.0 and up,
    as nanochat decides); float16 with a gradient scaler below (a T4: torch.cuda.is_bf16_supported() says True there,
    but bfloat16 is emulated, slowly, and the memory-efficient attention kernel takes only float16); float32 on a CPU
    and on MPS."""
    if requested not in ("auto", "float32", "bfloat16", "float16"):
        raise UsageError(f"--dtype={requested!r}: choose auto, float32, bfloat16 or float16")
    if requested != "auto":
        return getattr(torch, requested)
    if not str(device).startswith("cuda"):
        return torch.float32
    return torch.bfloat16 if torch.cuda.get_device_capability(device) >= (8, 0) else torch.float16

def autocast(device, dtype):
    """(context, dtype) of --dtype (amp_dtype). float16 needs a torch.amp.GradScaler, enabled=dtype == torch.float16."""
    amp = amp_dtype(device, dtype)
    return (nullcontext() if amp == torch.float32 else torch.autocast(str(device).split(":")[0], dtype=amp)), amp

def dtype_words(amp):
    """How a run names its arithmetic (amp_dtype's answer) in its first lines."""
    if amp == torch.float16:
        return "float16 autocast with a gradient scaler"
    return "bfloat16 autocast" if amp == torch.bfloat16 else "float32"

def check_compile(compile_model, device):
    """--compile_model on a CUDA GPU needs Triton (the inductor backend writes Triton kernels) and a GPU Triton can
    drive: without, one line before any training instead of a traceback at the first forward."""
    from torch.utils._triton import has_triton  # imports torch's compiler: only where it is wanted
    if compile_model and str(device).startswith("cuda") and not has_triton():
        raise UsageError("--compile_model: torch.compile needs Triton on a CUDA GPU, and this Python has none (or it "
                         "cannot drive this GPU); run without --compile_model, or install Triton (pip install "
                         "triton; on Windows pip install triton-windows)")

# Dense tensor-core peaks (no 2:4 sparsity) in float16 and bfloat16 with float32 accumulation, FLOP/s, from NVIDIA's product
# datasheets (data-centre cards: the sparse figures halved) and the GA102 (Ampere) and AD102 (Ada) GeForce whitepapers
# ("FP16 Tensor TFLOPS with FP32 Accumulate"): from Ampere on the two dtypes have one peak; T4 and V100 have float16 only.
# Keys match whole names as peak_flops spells them (upper case, words apart, without "NVIDIA", "Tesla", "GeForce" and
# the memory words "80GB", "HBM3": boards spell one chip "A100-SXM4-80GB", "A100-SXM-80GB" or "A100 80GB PCIe").
# An H100 PCIe is no H100 SXM, an A10G no A10, an L40 no L40S, and a MIG slice or a laptop RTX 4090 is a smaller
# chip: no MFU for those.
GPU_PEAK_FLOPS = {
    r"H100( SXM5?)?": 989e12, r"H100 PCIE": 756e12, r"H100 NVL": 835e12, r"H200( SXM)?": 989e12, r"H200 NVL": 835e12,
    r"GH200": 989e12, r"A100( SXM4?| PCIE)?": 312e12, r"A10": 125e12, r"L4": 121e12, r"L40S": 362e12, r"L40": 181e12,
    r"T4": 65e12, r"V100 SXM2": 125e12, r"V100 PCIE": 112e12, r"RTX A6000": 154.8e12, r"RTX 4090": 165.2e12,
    r"RTX 4080": 97.5e12, r"RTX 3090 TI": 80e12, r"RTX 3090": 71e12, r"RTX 3080": 59.5e12,
}
# the table's GPUs before Ampere, as peak_flops spells them: float16 tensor cores only, bfloat16 is emulated there
NO_BFLOAT16_TENSOR_CORES = r"T4|V100( .*)?"

def peak_flops(device, name=None, dtype=torch.float16):
    """Dense peak FLOP/s of a CUDA device (or of a GPU called `name`) in dtype, for MFU; None for a CPU, an unknown
    GPU, float32 (TF32 peaks are not in the table) and bfloat16 on a GPU without bfloat16 tensor cores."""
    if name is None and not str(device).startswith("cuda") or dtype == torch.float32:
        return None
    words = re.split(r"[\s_-]+", (name or torch.cuda.get_device_name(device)).strip().upper())
    chip = " ".join(w for w in words if w not in ("NVIDIA", "TESLA", "GEFORCE") and not re.fullmatch(r"\d+GB|HBM\w*", w))
    if dtype == torch.bfloat16 and re.fullmatch(NO_BFLOAT16_TENSOR_CORES, chip):
        return None
    return next((flops for key, flops in GPU_PEAK_FLOPS.items() if re.fullmatch(key, chip)), None)

def machine_name(device):
    """What a run trains on, as one word for its RESULT line and log (floats differ between machines: compare runs
    of one machine): the GPU's name, or the CPU's model name and the vector instructions torch's kernels use."""
    if str(device).startswith("cuda"):
        name = torch.cuda.get_device_name(device)
    else:
        name = f"{cpu_model_name()} {torch.backends.cpu.get_cpu_capability()}"
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

def print_param_checksum(params, rank, world):
    """Every process of a DDP run reports its weights: the ranks must agree exactly (read_param_checksums)."""
    print(f"rank {rank}/{world} param_checksum={sum(p.double().sum().item() for p in params):.10e}\n", end="", flush=True)

def read_param_checksums(text):
    """{rank: checksum text} of the print_param_checksum lines in text (the ranks' lines may interleave)."""
    return dict(re.findall(r"rank (\d+)/\d+ param_checksum=([-+0-9.]+e[-+]\d+)", text))

# ---- seeds: everything random in a step is a function of (seed, step, ...), so a resume is exact
def step_seed(*parts):
    """A seed from ints, e.g. (seed, step, rank): Python hashes int tuples alike in every process and run."""
    return hash(tuple(parts)) & 0x7FFF_FFFF_FFFF_FFFF

def rng_state():
    cuda = {"cuda": torch.cuda.get_rng_state_all()} if torch.cuda.is_available() else {}
    return {"python": random.getstate(), "torch": torch.get_rng_state(), **cuda}

def set_rng_state(state):
    random.setstate(state["python"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])

# ---- schedules
def cosine_schedule(step, total, start, end, warmup=0, warmup_start=0.0, warmup_from=0):
    """A linear warm-up from warmup_start to start over the first `warmup` steps, then a half cosine from start to end
    at step `total` (and end after it); start == end: a warm-up, then constant. Warm-up step s is (s + warmup_from) /
    warmup of the way: warmup_from 0 begins at warmup_start (DINO), 1 ends on start at step warmup - 1 (nanoGPT)."""
    if step < warmup:
        return warmup_start + (start - warmup_start) * (step + warmup_from) / warmup
    progress = min((step - warmup) / max(total - warmup, 1), 1.0)
    return end + 0.5 * (start - end) * (1 + math.cos(math.pi * progress))

# ---- checkpoints and the output folder
def clean_state_dict(state_dict):
    """Strip the prefixes that torch.compile (_orig_mod.) and DDP (module.) add to parameter names."""
    return {re.sub(r"(^|(?<=\.))(_orig_mod|module)\.", "", k): v for k, v in state_dict.items()}

@contextmanager
def atomic_write(path):
    """`with atomic_write(path) as f:` writes a binary temporary file, fsyncs it and renames it to path: a killed
    write leaves the old file (or none), the next write removes its leftovers; an error inside the block writes nothing."""
    folder = os.path.dirname(os.path.abspath(path))
    os.makedirs(folder, exist_ok=True)
    for name in [n for n in os.listdir(folder) if n.startswith(os.path.basename(path) + ".tmp")]:
        os.remove(os.path.join(folder, name))
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

def content_checksum(obj):
    """sha256 of a checkpoint's contents: every tensor's dtype, shape and bytes, and the rest (keys, numbers, text) by
    repr, in order. Saved inside the checkpoint, it catches what torch.load does not: a flipped bit in the weights."""
    h = hashlib.sha256()
    def feed(x):
        if isinstance(x, torch.Tensor):
            t = x.detach().cpu().contiguous()
            h.update(f"{t.dtype}{tuple(t.shape)}".encode())
            h.update(t.reshape(-1).view(torch.uint8).numpy())
        elif isinstance(x, (dict, list, tuple)):
            h.update(f"{type(x).__name__}{len(x)}".encode())
            for key, value in x.items() if isinstance(x, dict) else enumerate(x):
                h.update(repr(key).encode())
                feed(value)
        else:
            h.update(repr(x).encode())
    feed(obj)
    return h.hexdigest()

def save_checkpoint(obj, path):
    with atomic_write(path) as f:
        torch.save(dict(obj, checksum=content_checksum(obj)), f)

def _damaged(path, context, reason):
    return UsageError(f"{context}{path} cannot be read ({reason}): the file is damaged or truncated (an interrupted copy?)"
                      + ("; restore it, or start afresh without --resume" if context.startswith("--resume") else "; restore it"))

def load_checkpoint(path, context="", map_location="cpu"):
    """torch.load with weights_only=True (tensors and plain data, never code), its checksum verified, failing in one line.
    A checkpoint saved before checksums loads with a note."""
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{context}no checkpoint at {path}")
    try:
        ckpt = torch.load(path, map_location=map_location, weights_only=True)
    except Exception as e:
        if "Unsupported global" in str(e):
            raise UsageError(f"{context}{path} holds Python objects, which could run code: it is not loaded") from None
        reason = [line.strip() for line in str(e).split("WeightsUnpickler error:")[-1].splitlines() if line.strip()]
        raise _damaged(path, context, (reason or [type(e).__name__])[0].split('. ')[0][:100]) from None
    if not isinstance(ckpt, dict):
        raise UsageError(f"{context}{path} is not a nanolap checkpoint (a dict of tensors and plain data)")
    checksum = ckpt.pop("checksum", None)
    if checksum is None:
        print(f"note: {path} has no checksum (saved before nanolap wrote them): loaded without a check")
    elif checksum != content_checksum(ckpt):
        raise _damaged(path, context, "its contents do not match their checksum")
    return ckpt

def load_model(path_or_ckpt, key="model", map_location="cpu"):
    """Rebuild a model from a nanolap checkpoint (a path or an already loaded dict)."""
    ckpt = load_checkpoint(path_or_ckpt, "", map_location) if isinstance(path_or_ckpt, str) else path_or_ckpt
    model = build_model(Config(**ckpt["model_config"]))
    model.load_state_dict(clean_state_dict(ckpt[key]))
    return model

# the files that describe a run: what a training script writes into its out_dir, and what analyze.py writes there
CHECKPOINT = "ckpt.pt"
LOG = "log.jsonl"  # one JSON line per evaluation
RESULT = "result.txt"  # the RESULT line
ANALYSIS = "analysis.json"
SUMMARY = "summary.md"
RUN_FILES = (CHECKPOINT, LOG, RESULT)
ANALYSIS_FILES = ("analysis", ANALYSIS, "analysis_all.json", SUMMARY)

def describes_a_run(out_dir, name):
    """Whether out_dir/name describes the run trained there: its files, or analyze.py's outputs (figures, a folder
    holding an analysis.json, as --out=out_dir/NAME writes) made from its checkpoint."""
    path = os.path.join(out_dir, name)
    return (name in RUN_FILES or name in ANALYSIS_FILES or name.endswith(".png")
            or os.path.isdir(path) and not name.startswith("previous-") and os.path.isfile(os.path.join(path, ANALYSIS)))

_made_out_dirs = []  # out_dirs this process created: removed again if the run ends before writing into them

def remove_empty_out_dirs():
    for folder in _made_out_dirs:
        with suppress(OSError):  # not empty (the run wrote something) or gone: leave it
            os.rmdir(folder)

def prepare_out_dir(out_dir, resume):
    """Make out_dir and prove it writable; a fresh run moves everything that describes an earlier run (its files and
    its analysis) together to out_dir/previous-<time>/. A folder made here goes again if the run fails before using it."""
    made = not os.path.isdir(out_dir)
    try:
        os.makedirs(out_dir, exist_ok=True)
        open(os.path.join(out_dir, ".write-test"), "w").close()
        os.remove(os.path.join(out_dir, ".write-test"))
    except OSError as e:
        raise UsageError(f"--out_dir={out_dir} cannot be written ({e.strerror or e}); choose another --out_dir") from None
    if made and not _made_out_dirs:
        atexit.register(remove_empty_out_dirs)  # the error handler calls it too: os._exit skips atexit
    if made:
        _made_out_dirs.append(out_dir)
    old = sorted(n for n in os.listdir(out_dir) if describes_a_run(out_dir, n))
    if old and not resume:
        aside = tempfile.mkdtemp(prefix=time.strftime("previous-%Y%m%d-%H%M%S-"), dir=out_dir)  # a new, unique folder
        for name in old:
            os.replace(os.path.join(out_dir, name), os.path.join(aside, name))
        print(f"note: {out_dir} held an earlier run: its {', '.join(old)} moved to {aside}", flush=True)

def finished_run(config, step, total, option, longer):
    """--resume of a run at the end of its schedule: nothing to train, its files stay byte for byte. Says how to train
    longer: a new run whose schedule `option` is `longer` (continuing would raise a cooled-down learning rate again),
    with the options this run was given (those that differ from the script's defaults). Exits with status 0."""
    out_dir = config["out_dir"]
    given = {k: v for k, v in config.items() if k not in ("resume", "out_dir", option) and v != _defaults.get(k)}
    new = {"out_dir": os.path.normpath(out_dir) + "-long", option: longer, **given}
    command = " ".join(["python", sys.argv[0]] + [shlex.quote(f"--{k}={_option_text(v)}") for k, v in new.items()])
    if int(os.environ.get("RANK", 0)) == 0:  # under torchrun every process gets here, before any process group
        print(f"{out_dir} holds a finished run (step {step} of {total}): --resume has nothing to train and leaves its "
              f"files as they are. To train longer, start a new --out_dir with a longer --{option}: {command}", flush=True)
    teardown_distributed()
    sys.exit(0)

def _option_text(value):
    """How value is written after --key= so that parse_args reads it back."""
    if isinstance(value, list):
        return json.dumps(value, separators=(",", ":"))
    return value if isinstance(value, str) else repr(value)

# ---- logging and the RESULT line
def append_jsonl(path, record):
    with open(path, "a") as f:
        f.write(json.dumps(record) + "\n")

def write_result(out_dir, **values):
    """Print the run's last line `RESULT key=value ...` (floats: 4 decimals, lists: no spaces), kept in result.txt.
    Training scripts write the shared keys n_lap params seed dataset steps seconds first, then their own metrics."""
    line = "RESULT " + " ".join(f"{k}={_result_value(v)}" for k, v in values.items())
    print(line + "\n", end="", flush=True)
    with open(os.path.join(out_dir, RESULT), "w") as f:
        f.write(line + "\n")

def _result_value(v):
    if isinstance(v, float):
        return f"{v:.4f}"
    if isinstance(v, list):
        return json.dumps(v, separators=(",", ":"))
    return str(v)

def parse_result(text):
    """The key=value pairs (strings, in order) of the last RESULT line in text, {} without one. Found anywhere in a
    line: under PYTHONUNBUFFERED print writes a line and its newline apart, and another process can write between."""
    lines = re.findall(r"RESULT (\S.*)", text)
    return dict(word.split("=", 1) for word in lines[-1].split() if "=" in word) if lines else {}

def read_result(run_dir):
    """parse_result of run_dir/result.txt; {} without one."""
    path = os.path.join(run_dir, RESULT)
    return parse_result(open(path).read()) if os.path.isfile(path) else {}

def check_finite(loss, step):
    """Stop before the optimiser step when the loss is NaN or inf; the last checkpoint stays intact."""
    if not math.isfinite(float(loss)):
        raise FloatingPointError(f"non-finite loss {float(loss)} at step {step}: stopping before the optimiser "
                                 f"step; the last checkpoint is intact. Try a lower learning rate or --grad_clip.")

def format_time(seconds):
    s = int(seconds)
    return f"{s // 3600}h{s // 60 % 60:02d}m" if s >= 3600 else f"{s // 60}m{s % 60:02d}s"

