"""Public DDP trainers, as published and with only their DDP line changed to usbyte-opt's.

Each trainer runs on 2 gloo ranks (CPU) in each configuration three times: with torch's DDP,
with torch's DDP again (the control: the configuration is deterministic when both are equal
bitwise), and with its DDP line changed to ``usbyte_opt.DistributedDataParallel`` and a
schedule in ``$USBYTE_SCHEDULE``. Compared, tensor by tensor with ``torch.equal``: every
rank's final model (weights and buffers), optimizer state, EMA model and gradient scaler, the
checkpoints the trainer wrote and the metrics it logged. The verdict per configuration is
"equal", "refused (message)" (a ``UsbyteError`` on every rank) or "DIFFERS: what, max abs
diff". See benchmarks/real_clients.md.

The trainers' code is never part of this repository: it is obtained at run time, at a pinned
commit, into a cache (``$USBYTE_RC_CACHE``, default ``~/.cache/usbyte-opt/real_clients``):
from a local checkout or git directory (``--source NAME=PATH`` or ``$USBYTE_RC_SRC_<NAME>``),
else by ``git clone`` of its public repository. Their Python dependencies that are not
installed (Pillow; for Accelerate's example torchdata, tensorboardX and protobuf) are installed
into the cache with pip. torchvision, which has no build
beside a CPU torch, is satisfied by ``benchmarks/real_clients_shims/torchvision`` (imports
only; what runs follows torchvision). ``benchmarks/real_clients_shims/observe`` records and
saves the final state (observation only). Data are synthetic and made here; no weights are
downloaded (Accelerate's example loads random ones, made here, from a local Hugging Face cache).

    python benchmarks/real_clients.py                       # every trainer and configuration
    python benchmarks/real_clients.py --trainers nanogpt --configs plain,noclip --iterations 6
"""

from __future__ import annotations

import argparse
import dataclasses
import glob
import importlib.util
import json
import math
import os
import re
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
SHIMS = HERE / "real_clients_shims"
#: The usbyte-opt the runs import (``--usbyte``: another checkout, for example an older commit's).
USBYTE_ROOT = ROOT
DEFAULT_CACHE = Path(os.environ.get("USBYTE_RC_CACHE") or Path.home() / ".cache" / "usbyte-opt" / "real_clients")


@dataclasses.dataclass
class Trainer:
    name: str
    repo: str                        # owner/name of the public repository
    commit: str
    script: str                      # the training script, relative to the source tree
    #: Applied to both runs: what torch's DDP needs to run at all on CPU/gloo (file, old, new).
    port: list[tuple[str, str, str]]
    #: The one-line change to usbyte-opt (file, old, new), applied on top of the port.
    patch: tuple[str, str, str]
    configs: dict[str, list[str]]
    slow: set[str]
    #: (run dir, configuration arguments, iterations) -> (command-line arguments, cwd).
    argv: Callable[[Path, Path, list[str], int], tuple[list[str], Path]]
    #: (source tree, run dir, rank logs) -> {label: path or text}: what the trainer wrote and logged
    #: (written under the tree's out/, at the same relative path in every run, moved to the run dir).
    outputs: Callable[[Path, Path, dict[int, str]], dict[str, Any]]
    needs_pil: bool = False          # imports torchvision and PIL: the stand-in, and Pillow
    #: The environment of both runs, and what the usbyte run sets on top of it.
    env: dict[str, str] = dataclasses.field(default_factory=dict)
    usbyte_env: dict[str, str] = dataclasses.field(default_factory=dict)
    #: Only these paths of the repository are taken (default: all of it).
    paths: list[str] = dataclasses.field(default_factory=list)
    #: (source tree, run dir, iterations) -> environment entries of both runs made for this run.
    run_env: Callable[[Path, Path, int], dict[str, str]] | None = None
    #: (cache, PYTHONPATH so far) -> more PYTHONPATH entries: what else the trainer imports or
    #: reads, obtained into the cache (raises Unobtainable).
    deps: Callable[[Path, list[str]], list[str]] | None = None
    #: Iterations of the ``auto`` run that plans the ``planned`` schedule.
    plan_iterations: int = 16             # PLAN_ITERATIONS


# ---------------------------------------------------------------------------------------------
# timm (pytorch-image-models): train.py, its ImageNet trainer

def _timm_argv(tree: Path, run: Path, config: list[str], iterations: int) -> tuple[list[str], Path]:
    # One folder per size in the cache (cache/work/<tree> -> cache), not per run directory: the
    # saved args name it, and a DDP run made for one schedule is compared with the others'.
    data = _image_folder(tree.parent.parent / "timm-images", per_class=iterations)
    # 2 ranks x batch 4 over 4 classes x `iterations` images: iterations // 2 steps in each of 2 epochs.
    args = [str(data), "--model", "test_efficientnet", "--num-classes", "4", "--input-size", "3", "32", "32",
            "--crop-pct", "1.0", "-b", "4", "--epochs", "2", "--warmup-epochs", "0", "--sched", "cosine",
            "--no-aug", "--no-prefetcher", "-j", "1", "--device", "cpu", "--log-interval", "1", "--seed", "0",
            "--lr", "0.05", "--output", "out", "--experiment", "run", "--checkpoint-hist", "2"]
    return args + config, tree


def _timm_outputs(tree: Path, run: Path, logs: dict[int, str]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    _move_out(tree, run)
    for f in sorted((run / "out" / "run").glob("*")):
        if f.name == "summary.csv":
            out["summary.csv (logged metrics)"] = f.read_text()
        elif f.suffix in (".tar", ".pth"):
            out[f"checkpoint {f.name}"] = f
    return out


TIMM = Trainer(
    name="timm",
    repo="huggingface/pytorch-image-models",
    commit="aa4b5850c1543fa488abf260f18390eda46cf85d",
    script="train.py",
    port=[("train.py", "task.prepare_distributed(device_ids=[device],",
           "task.prepare_distributed(device_ids=None if device.type == 'cpu' else [device],")],
    patch=("timm/task/classification.py",
           "from torch.nn.parallel import DistributedDataParallel as DDP",
           "from usbyte_opt import DistributedDataParallel as DDP"),
    configs={
        "plain": ["--opt", "sgd"],
        "clip": ["--opt", "sgd", "--clip-grad", "1.0"],
        "adamw": ["--opt", "adamw", "--lr", "1e-3"],
        "bf16": ["--opt", "sgd", "--amp", "--amp-dtype", "bfloat16"],
        "accum2": ["--opt", "sgd", "--grad-accum-steps", "2"],
        "ema": ["--opt", "sgd", "--model-ema", "--model-ema-decay", "0.9"],
        "lamb": ["--opt", "lamb", "--lr", "1e-3"],
        "distbn-none": ["--opt", "sgd", "--dist-bn", ""],
        "distbn-broadcast": ["--opt", "sgd", "--dist-bn", "broadcast"],
        "no-ddp-bb": ["--opt", "sgd", "--no-ddp-bb"],
        # Compiled before DDP wraps it (timm's task.compile), validation on the compiled module.
        "compile": ["--opt", "sgd", "--torchcompile", "inductor"],
        "compile-aot": ["--opt", "sgd", "--torchcompile", "aot_eager"],
    },
    slow={"compile", "compile-aot"},
    argv=_timm_argv,
    outputs=_timm_outputs,
    needs_pil=True,
)


def _move_out(tree: Path, run: Path) -> None:
    if (tree / "out").exists():
        shutil.rmtree(run / "out", ignore_errors=True)
        shutil.move(str(tree / "out"), str(run / "out"))


def _image_folder(root: Path, per_class: int) -> Path:
    """A tiny ImageFolder of 32x32 PNGs (4 classes), the same for every run."""
    root = root.with_name(f"{root.name}-{per_class}")
    if (root / ".done").exists():
        return root
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(0)
    for split, n in (("train", per_class), ("validation", 2)):
        for c in range(4):
            d = root / split / f"class{c}"
            d.mkdir(parents=True, exist_ok=True)
            for i in range(n):
                a = rng.integers(0, 256, (32, 32, 3), dtype=np.uint8)
                a[..., c % 3] //= 2
                Image.fromarray(a).save(d / f"{i:03d}.png")
    (root / ".done").write_text("")
    return root


# ---------------------------------------------------------------------------------------------
# nanoGPT: train.py

def _nanogpt_argv(tree: Path, run: Path, config: list[str], iterations: int) -> tuple[list[str], Path]:
    import pickle

    import numpy as np

    d = tree / "data" / "synth"            # train.py reads data/<dataset> and configurator.py from its cwd
    d.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    rng.integers(0, 64, 4096, dtype=np.uint16).tofile(d / "train.bin")
    rng.integers(0, 64, 1024, dtype=np.uint16).tofile(d / "val.bin")
    with open(d / "meta.pkl", "wb") as f:
        pickle.dump({"vocab_size": 64}, f)
    half = max(1, iterations // 2)
    args = ["--dataset=synth", "--device=cpu", "--backend=gloo", "--dtype=float32", "--compile=False",
            "--n_layer=2", "--n_head=2", "--n_embd=32", "--block_size=32", "--batch_size=4", "--dropout=0.0",
            f"--max_iters={iterations}", f"--eval_interval={half}", "--eval_iters=2", "--log_interval=1",
            "--warmup_iters=2", f"--lr_decay_iters={iterations}", "--learning_rate=0.001",
            "--gradient_accumulation_steps=4", "--out_dir=out"]
    return args + config, tree


_NANOGPT_LINE = re.compile(r"^(step \d+: train loss \S+ val loss \S+|iter \d+: loss \S+)")


def _nanogpt_outputs(tree: Path, run: Path, logs: dict[int, str]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    _move_out(tree, run)
    lines = [m.group(1).rstrip(",") for line in logs.get(0, "").splitlines()
             if (m := _NANOGPT_LINE.match(line.replace(",", "")))]
    out["logged losses (rank 0)"] = "\n".join(lines)
    ck = run / "out" / "ckpt.pt"
    if ck.exists():
        out["checkpoint ckpt.pt"] = ck
    return out


NANOGPT = Trainer(
    name="nanogpt",
    repo="karpathy/nanoGPT",
    commit="3adf61e154c3fe3fca428ad6bc3818b27a3b8291",
    script="train.py",
    port=[("train.py", "    device = f'cuda:{ddp_local_rank}'\n    torch.cuda.set_device(device)\n",
           "    device = f'cuda:{ddp_local_rank}' if backend == 'nccl' else 'cpu'\n"
           "    torch.cuda.set_device(device) if backend == 'nccl' else None\n"),
          ("train.py", "model = DDP(model, device_ids=[ddp_local_rank])",
           "model = DDP(model, device_ids=[ddp_local_rank] if backend == 'nccl' else None)")],
    patch=("train.py", "from torch.nn.parallel import DistributedDataParallel as DDP",
           "from usbyte_opt import DistributedDataParallel as DDP"),
    configs={
        "plain": [],                                       # accumulation 2 per rank, clipping 1.0
        "noclip": ["--grad_clip=0.0"],
        "accum1": ["--gradient_accumulation_steps=2"],
        "float16": ["--dtype=float16"],                    # the GradScaler path (torch disables it on CPU)
        "compile": ["--compile=True"],
    },
    slow={"compile"},
    argv=_nanogpt_argv,
    outputs=_nanogpt_outputs,
)

# ---------------------------------------------------------------------------------------------
# Lightning: examples/pytorch/basics/transformer.py (the installed lightning runs it)

def _lightning_cwd(tree: Path) -> Path:
    return tree.parent / (tree.name.rsplit("-", 1)[0] + "-cwd")      # the same for both copies of a tag


def _lightning_argv(tree: Path, run: Path, config: list[str], iterations: int) -> tuple[list[str], Path]:
    # Both runs in one folder: Lightning's checkpoints hold their absolute paths.
    cwd = _lightning_cwd(tree)
    shutil.rmtree(cwd, ignore_errors=True)
    (cwd / "data").mkdir(parents=True)
    import numpy as np

    # WikiText2 reads ./data/wikitext-2.txt (and downloads it only when missing). The example
    # splits off 2 x 2000 sequences of 35 tokens for validation and test; the rest is training:
    # 81 sequences, 3 batches of 20 per rank and epoch (the last of 1). The run stops after
    # `iterations` optimizer steps (_lightning_env), not after the example's 20 epochs.
    rng = np.random.default_rng(0)
    words = [f"w{i}" for i in range(50)]
    n_tokens = (4000 + 2 * 2 * 20 + 1) * 35 + 35
    toks = rng.integers(0, 50, n_tokens)
    lines = [" ".join(words[t] for t in toks[i:i + 34]) for i in range(0, n_tokens, 35)]
    (cwd / "data" / "wikitext-2.txt").write_text("\n".join(lines) + "\n")
    return config, cwd


def _lightning_env(tree: Path, run: Path, iterations: int) -> dict[str, str]:
    # The Trainer's max_steps, which the example leaves unset, from Lightning's own environment.
    return {"PL_TRAINER_MAX_STEPS": str(iterations)}


def _lightning_outputs(tree: Path, run: Path, logs: dict[int, str]) -> dict[str, Any]:
    cwd = _lightning_cwd(tree)
    out: dict[str, Any] = {}
    if (cwd / "lightning_logs").exists():
        shutil.move(str(cwd / "lightning_logs"), str(run / "lightning_logs"))
    for f in sorted((run / "lightning_logs").rglob("*")):
        if f.suffix == ".ckpt":
            out[f"checkpoint {f.name}"] = f
        elif f.name == "metrics.csv":
            out["metrics.csv (logged metrics)"] = f.read_text()
    rows = [line for line in logs.get(0, "").splitlines() if re.match(r"^\W*\s*test_loss\s", line)]
    out["test results (rank 0)"] = "\n".join(rows)
    return out


LIGHTNING = Trainer(
    name="lightning",
    repo="Lightning-AI/pytorch-lightning",
    commit="7f0c3436cd3f6ad3753125672024fc415cbcb414",
    script="examples/pytorch/basics/transformer.py",
    port=[],
    patch=("examples/pytorch/basics/transformer.py", "import lightning as L\n",
           "import lightning as L; import usbyte_opt.integrations.lightning  # registers the strategy \"usbyte\"\n"),
    configs={
        "plain": [],                                                 # SGD, gradient_clip_val=0.25
        "bf16": ["env:PL_TRAINER_PRECISION=bf16-mixed"],
        "accum2": ["env:PL_TRAINER_ACCUMULATE_GRAD_BATCHES=2"],
    },
    slow=set(),
    argv=_lightning_argv,
    outputs=_lightning_outputs,
    # The Trainer's arguments that the example does not set, from Lightning's own PL_TRAINER_*.
    env={"PL_TRAINER_ACCELERATOR": "cpu", "PL_TRAINER_DEVICES": "2", "PL_TRAINER_STRATEGY": "ddp",
         "PL_TRAINER_ENABLE_PROGRESS_BAR": "False"},
    usbyte_env={"PL_TRAINER_STRATEGY": "usbyte"},
    paths=["examples/pytorch/basics", "LICENSE"],
    run_env=_lightning_env,
)

# ---------------------------------------------------------------------------------------------
# Accelerate: examples/complete_cv_example.py (the installed accelerate runs it)

#: The example's hard-coded batch size per process and epochs.
_ACC_BATCH, _ACC_EPOCHS = 64, 3


def _accelerate_steps(iterations: int) -> int:
    """Optimizer steps per epoch (each rank, batch 64): `iterations` over the 3 epochs."""
    return max(1, math.ceil(iterations / _ACC_EPOCHS))


def _pets_folder(root: Path, steps: int) -> Path:
    """The example's data: `<label>_<n>.jpg` files (4 labels), 80% of them training, so that
    each of 2 ranks gets `steps` full batches of 64 per epoch (the other 20% evaluate)."""
    n_train = 2 * _ACC_BATCH * steps
    total = n_train * 5 // 4
    root = root.with_name(f"{root.name}-{total}")
    if (root / ".done").exists():
        return root
    import numpy as np
    from PIL import Image

    shutil.rmtree(root, ignore_errors=True)
    root.mkdir(parents=True)
    rng = np.random.default_rng(0)
    for i in range(total):
        c = i % 4
        a = rng.integers(0, 256, (48, 64, 3), dtype=np.uint8)
        a[..., c % 3] //= 2
        a[: 12 * (c + 1), :, (c + 1) % 3] = 255
        Image.fromarray(a).save(root / f"{'abcd'[c]}_{i}.jpg", quality=90)
    (root / ".done").write_text("")
    return root


def _from_earlier(config: list[str], run: Path) -> tuple[list[str], list[tuple[str, Path]]]:
    """``from:CONFIG:PATH`` arguments: PATH in what this arm's run of CONFIG wrote (its out/),
    in the same run directory tree; returns the arguments and the (CONFIG, path) needed."""
    args, need = [], []
    for c in config:
        if c.startswith("from:"):
            _, cfg, rel = c.split(":", 2)
            path = run.parent.parent / cfg / run.name / "out" / rel
            args.append(str(path))
            need.append((cfg, path))
        else:
            args.append(c)
    return args, need


def _resumed(config: list[str], run: Path, snapshot: Path) -> tuple[list[str], int]:
    """A resuming configuration (``from:CONFIG:FILE``): that earlier run's file copied to
    ``snapshot``, where this run loads and saves it (a failed earlier run left none: this one
    starts afresh). Returns the other arguments and how many earlier runs it continues."""
    args, need = _from_earlier(config, run)
    for _, path in need:
        if path.exists():
            shutil.copy(path, snapshot)
        args.remove(str(path))
    return args, len(need)


def _accelerate_argv(tree: Path, run: Path, config: list[str], iterations: int) -> tuple[list[str], Path]:
    data = _pets_folder(tree.parent / "accelerate-pets", _accelerate_steps(iterations))
    args = ["--data_dir", str(data), "--cpu", "--output_dir", "out", "--project_dir", "out/logs"]
    return args + _from_earlier(config, run)[0], tree


def _accelerate_env(tree: Path, run: Path, iterations: int) -> dict[str, str]:
    hub = tree.parent.parent / "hf-hub"                          # cache/work/<tree> -> cache/hf-hub
    return {"HF_HOME": str(hub), "HF_HUB_CACHE": str(hub / "hub"), "HF_HUB_OFFLINE": "1",
            "HF_HUB_DISABLE_TELEMETRY": "1"}


#: Made in a subprocess that imports timm: the random weights the example's
#: create_model("resnet50d", pretrained=True) loads, in a Hugging Face hub cache.
_HUB_WEIGHTS = r"""
import os, sys, torch, timm
from safetensors.torch import save_file
cache, commit = sys.argv[1], sys.argv[2]
torch.manual_seed(0)
m = timm.create_model("resnet50d", pretrained=False)
repo = m.pretrained_cfg["hf_hub_id"]
d = os.path.join(cache, "models--" + repo.replace("/", "--"))
os.makedirs(os.path.join(d, "refs"), exist_ok=True)
os.makedirs(os.path.join(d, "snapshots", commit), exist_ok=True)
save_file({k: v.contiguous() for k, v in m.state_dict().items()},
          os.path.join(d, "snapshots", commit, "model.safetensors"))
with open(os.path.join(d, "refs", "main"), "w") as f:
    f.write(commit)
print(repo)
"""

#: What the example imports beyond accelerate, torch, numpy, timm and Pillow, for the
#: configurations that use it (each installed alone, without its dependencies).
_ACCELERATE_PIP = [("torchdata", "torchdata==0.11.0"),          # --use_stateful_dataloader
                   ("tensorboardX", "tensorboardX==2.6.5"),     # --with_tracking (log_with="all")
                   ("google/protobuf", "protobuf==6.33.5")]


def _accelerate_deps(cache: Path, pypath: list[str]) -> list[str]:
    """timm's source (the timm trainer's pinned commit), the hub cache with its random resnet50d
    weights, and the packages above, in the cache."""
    timm = source_tree(TIMM, cache)
    hub = cache / "hf-hub" / "hub"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(timm), *pypath]), "OMP_NUM_THREADS": "1"}
    if not (hub / ".done").exists():
        r = subprocess.run([sys.executable, "-c", _HUB_WEIGHTS, str(hub), "0" * 40], env=env,
                           capture_output=True, text=True)
        if r.returncode:
            raise Unobtainable(f"accelerate: the resnet50d weights could not be made: {r.stderr.strip()[-300:]}")
        (hub / ".done").write_text(r.stdout)
    target = cache / "pydeps-accelerate"
    for mod, spec in _ACCELERATE_PIP:
        if not (target / mod).is_dir():
            # Only some configurations import these (the example as published does not): one
            # that cannot be installed fails those configurations' own DDP runs ("ddp-failed").
            r = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--disable-pip-version-check",
                                "--no-deps", "--target", str(target), spec], capture_output=True, text=True)
            if r.returncode:
                print(f"accelerate: {spec} could not be installed (the configurations that use it will fail): "
                      f"{r.stderr.strip()[-200:]}", file=sys.stderr, flush=True)
    if str(target) not in sys.path:
        sys.path.append(str(target))            # tracked scalars are read with tensorboardX here
    return [str(timm), str(target)]


_ACC_LINE = re.compile(r"^epoch \d+: \S+$")


def _accelerate_outputs(tree: Path, run: Path, logs: dict[int, str]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    _move_out(tree, run)
    lines = [line.strip() for line in logs.get(0, "").splitlines() if _ACC_LINE.match(line.strip())]
    out["accuracy per epoch (rank 0)"] = "\n".join(lines)
    for d in sorted((run / "out").glob("*_*")):              # save_state's epoch_N / step_N folders
        for f in sorted(d.iterdir()):
            out[f"checkpoint {d.name}/{f.name}"] = f
    for f in sorted((run / "out" / "logs").rglob("events.out.tfevents.*")):
        # The tracker's run folder is named by the wall time it started at: compared by the
        # rest of its path.
        where = re.sub(r"\b\d{9,}\.\d+\b", "<time>", str(f.parent.relative_to(run / "out" / "logs")))
        out[f"tracked scalars {where}"] = _tensorboard_scalars(f)
    return out


def _tensorboard_scalars(path: Path) -> str:
    """The (tag, step, value) of every scalar in a TensorBoard event file (not the wall times)."""
    import struct

    from tensorboardX.proto import event_pb2

    rows, data = [], path.read_bytes()
    i = 0
    while i + 12 <= len(data):
        (n,) = struct.unpack("<Q", data[i:i + 8])
        ev = event_pb2.Event.FromString(data[i + 12:i + 12 + n])
        i += 12 + n + 4
        for v in ev.summary.value:
            if v.WhichOneof("value") == "simple_value":
                rows.append(f"{v.tag} {ev.step} {v.simple_value!r}")
    return "\n".join(rows)


ACCELERATE = Trainer(
    name="accelerate",
    repo="huggingface/accelerate",
    commit="16cb6eb80dd9aa8b4df1a63ef57863e455d53b83",
    script="examples/complete_cv_example.py",
    port=[],
    patch=("examples/complete_cv_example.py", "= accelerator.prepare(\n",
           '= __import__("usbyte_opt.integrations.accelerate", fromlist=["prepare"]).prepare(accelerator,\n'),
    configs={
        "plain": [],                                  # Adam on the classifier, OneCycleLR, frozen backbone
        "ckpt-epoch": ["--checkpointing_steps", "epoch"],
        "ckpt-step1": ["--checkpointing_steps", "1"],
        "resume": ["--checkpointing_steps", "epoch", "--resume_from_checkpoint", "from:ckpt-epoch:epoch_0"],
        "stateful": ["--use_stateful_dataloader", "--checkpointing_steps", "epoch"],
        "tracking": ["--with_tracking"],
        "bf16": ["--mixed_precision", "bf16"],
    },
    slow={"bf16"},
    argv=_accelerate_argv,
    outputs=_accelerate_outputs,
    needs_pil=True,
    paths=["examples", "LICENSE"],
    run_env=_accelerate_env,
    deps=_accelerate_deps,
    plan_iterations=12,
)

# ---------------------------------------------------------------------------------------------
# pytorch/examples: distributed/minGPT-ddp, the DDP tutorial's GPT trainer (hydra, torchrun)

_MINGPT = "distributed/minGPT-ddp/mingpt"
#: The characters per sample, the text's first characters taken (the vocabulary, and so the
#: model's shapes, are the same for every number of iterations), the epochs (each validated
#: and saved).
_MG_BLOCK, _MG_TEXT, _MG_EPOCHS = 32, 2048, 2
#: The published configuration's text (tinyshakespeare, in the repository), 1115394 characters.
_MG_CHARS = 1115394


def _mingpt_argv(tree: Path, run: Path, config: list[str], iterations: int) -> tuple[list[str], Path]:
    # The published model, data and loop, made small: 2 layers of width 64 on the text's first
    # characters, each rank's batch such that it takes ceil(iterations / epochs) steps per epoch
    # (90% of the samples train, DistributedSampler over 2 ranks).
    steps = max(1, math.ceil(iterations / _MG_EPOCHS))
    train = int((_MG_TEXT - _MG_BLOCK) * 0.9)
    batch = math.ceil(train / (2 * steps))
    (tree / "out").mkdir(parents=True, exist_ok=True)
    snap = tree / "out" / "gpt_snapshot.pt"
    args, earlier = _resumed(config, run, snap)
    epochs = _MG_EPOCHS * (1 + earlier)
    return ["data_config.path=data/input.txt", f"data_config.truncate={_MG_TEXT / _MG_CHARS!r}",
            f"data_config.block_size={_MG_BLOCK}", "gpt_config.n_layer=2", "gpt_config.n_head=2",
            "gpt_config.n_embd=64", f"trainer_config.batch_size={batch}", "trainer_config.data_loader_workers=0",
            f"trainer_config.max_epochs={epochs}", "trainer_config.save_every=1",
            f"trainer_config.snapshot_path={snap}", *args], tree / _MINGPT


_MG_LINE = re.compile(r"^\[RANK0\] Epoch \d+ \| Iter \d+ \| (Train|Eval) Loss \S+$")


def _mingpt_outputs(tree: Path, run: Path, logs: dict[int, str]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    _move_out(tree, run)
    out["logged losses (rank 0)"] = "\n".join(line.strip() for line in logs.get(0, "").splitlines()
                                              if _MG_LINE.match(line.strip()))
    snap = run / "out" / "gpt_snapshot.pt"
    if snap.exists():
        out["checkpoint gpt_snapshot.pt"] = snap
    return out


#: What the example imports beyond torch, fsspec and boto3: hydra and its configuration library.
_MINGPT_PIP = [("hydra", "hydra-core==1.3.2"), ("omegaconf", "omegaconf==2.3.0"),
               ("antlr4", "antlr4-python3-runtime==4.9.3")]


def _mingpt_deps(cache: Path, pypath: list[str]) -> list[str]:
    target = cache / "pydeps-mingpt"
    for mod, spec in _MINGPT_PIP:
        if not (target / mod).is_dir():
            r = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--disable-pip-version-check",
                                "--no-deps", "--target", str(target), spec], capture_output=True, text=True)
            if r.returncode:
                raise Unobtainable(f"mingpt: {spec} could not be installed: {r.stderr.strip()[-200:]}")
    for mod in ("boto3", "fsspec"):
        if importlib.util.find_spec(mod) is None:
            raise Unobtainable(f"mingpt: the example imports {mod}, which is not installed (pip install {mod})")
    return [str(target)]


MINGPT = Trainer(
    name="mingpt",
    repo="pytorch/examples",
    commit="77f55b912142e11fcfdf5b530231fb9c52f181e8",
    script=f"{_MINGPT}/main.py",
    # torch.accelerator has no current accelerator on a CPU-only machine: the device, the
    # backend (gloo) and DDP's device_ids follow torch's CPU ones; the example's check for two
    # GPUs applies where there is an accelerator.
    port=[(f"{_MINGPT}/trainer.py", 'self.device: torch.device = torch.device(f"{self.acc}:{self.local_rank}")',
           'self.device: torch.device = torch.device(f"{self.acc}:{self.local_rank}") if self.acc is not None '
           'else torch.device("cpu")'),
          (f"{_MINGPT}/trainer.py", "self.model = model.to(self.local_rank)", "self.model = model.to(self.device)"),
          (f"{_MINGPT}/trainer.py", "source = source.to(self.local_rank)", "source = source.to(self.device)"),
          (f"{_MINGPT}/trainer.py", "targets = targets.to(self.local_rank)", "targets = targets.to(self.device)"),
          (f"{_MINGPT}/trainer.py", "self.model = DDP(self.model, device_ids=[self.local_rank])",
           "self.model = DDP(self.model, device_ids=None if self.device.type == 'cpu' else [self.local_rank])"),
          (f"{_MINGPT}/main.py", '    device: torch.device = torch.device(f"{acc}:{rank}")',
           '    device: torch.device = torch.device(f"{acc}:{rank}") if acc is not None else torch.device("cpu")'),
          (f"{_MINGPT}/main.py", "    torch.accelerator.set_device_index(rank)",
           "    torch.accelerator.set_device_index(rank) if acc is not None else None"),
          (f"{_MINGPT}/main.py", "    if not verify_min_gpu_count(min_gpus=_min_gpu_count):",
           "    if torch.accelerator.is_available() and not verify_min_gpu_count(min_gpus=_min_gpu_count):")],
    patch=(f"{_MINGPT}/trainer.py", "from torch.nn.parallel import DistributedDataParallel as DDP",
           "from usbyte_opt import DistributedDataParallel as DDP"),
    configs={
        "plain": [],                                   # fp16 autocast and GradScaler, clipping, AdamW
        "fp32": ["trainer_config.use_amp=False"],
        "resume": ["from:plain:gpt_snapshot.pt"],      # 2 more epochs from plain's last snapshot
    },
    slow=set(),
    argv=_mingpt_argv,
    outputs=_mingpt_outputs,
    # The example never seeds torch: every run, its own DDP runs included, starts from other
    # weights and draws other dropout masks, unless the observer seeds it.
    env={"USBYTE_RC_SEED_TORCH": "1"},
    paths=["distributed/minGPT-ddp", "LICENSE"],
    deps=_mingpt_deps,
)

# ---------------------------------------------------------------------------------------------
# pytorch/examples: distributed/ddp-tutorial-series/multigpu_torchrun.py, the DDP tutorial's
# own script (a linear model on random data, snapshots, torchrun's restarts)

_TUTORIAL = "distributed/ddp-tutorial-series"
#: The dataset's size as published (MyTrainDataset(2048)), and the epochs of a run.
_TUT_SAMPLES, _TUT_EPOCHS = 2048, 2


def _tutorial_argv(tree: Path, run: Path, config: list[str], iterations: int) -> tuple[list[str], Path]:
    # Run from out/, where the script writes (and looks for) its snapshot.pt; the batch per
    # rank such that each rank takes ceil(iterations / epochs) steps per epoch.
    steps = max(1, math.ceil(iterations / _TUT_EPOCHS))
    out = tree / "out"
    out.mkdir(parents=True, exist_ok=True)
    args, earlier = _resumed(config, run, out / "snapshot.pt")
    epochs = _TUT_EPOCHS * (1 + earlier)
    return [str(epochs), "1", "--batch_size", str(math.ceil(_TUT_SAMPLES / 2 / steps)), *args], out


def _tutorial_outputs(tree: Path, run: Path, logs: dict[int, str]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    _move_out(tree, run)
    snap = run / "out" / "snapshot.pt"
    if snap.exists():
        out["checkpoint snapshot.pt"] = snap
    return out


TUTORIAL = Trainer(
    name="ddp-tutorial",
    repo="pytorch/examples",
    commit="77f55b912142e11fcfdf5b530231fb9c52f181e8",
    script=f"{_TUTORIAL}/multigpu_torchrun.py",
    # The script hard-codes CUDA and NCCL: the CPU and gloo here.
    port=[(f"{_TUTORIAL}/multigpu_torchrun.py",
           '    torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))\n    init_process_group(backend="nccl")\n',
           '    init_process_group(backend="gloo")\n'),
          (f"{_TUTORIAL}/multigpu_torchrun.py", '        self.gpu_id = int(os.environ["LOCAL_RANK"])\n',
           '        self.gpu_id = int(os.environ["LOCAL_RANK"])\n        self.device = torch.device("cpu")\n'),
          (f"{_TUTORIAL}/multigpu_torchrun.py", "self.model = model.to(self.gpu_id)",
           "self.model = model.to(self.device)"),
          (f"{_TUTORIAL}/multigpu_torchrun.py", "self.model = DDP(self.model, device_ids=[self.gpu_id])",
           "self.model = DDP(self.model, device_ids=None)"),
          (f"{_TUTORIAL}/multigpu_torchrun.py", 'loc = f"cuda:{self.gpu_id}"', 'loc = self.device'),
          (f"{_TUTORIAL}/multigpu_torchrun.py", "source = source.to(self.gpu_id)", "source = source.to(self.device)"),
          (f"{_TUTORIAL}/multigpu_torchrun.py", "targets = targets.to(self.gpu_id)",
           "targets = targets.to(self.device)")],
    patch=(f"{_TUTORIAL}/multigpu_torchrun.py", "from torch.nn.parallel import DistributedDataParallel as DDP",
           "from usbyte_opt import DistributedDataParallel as DDP"),
    configs={
        "plain": [],                                     # SGD, a snapshot every epoch (rank 0)
        "resume": ["from:plain:snapshot.pt"],            # 2 more epochs from plain's snapshot
    },
    slow=set(),
    argv=_tutorial_argv,
    outputs=_tutorial_outputs,
    # Its data (MyTrainDataset: torch.rand) and its model are never seeded.
    env={"USBYTE_RC_SEED_TORCH": "1"},
    paths=[_TUTORIAL, "LICENSE"],
)

TRAINERS = {t.name: t for t in (TIMM, NANOGPT, LIGHTNING, ACCELERATE, MINGPT, TUTORIAL)}


# ---------------------------------------------------------------------------------------------
# Obtaining the sources

class Unobtainable(Exception):
    """A trainer's source (or a dependency) could not be had here: the run is skipped."""


def _git(*args: str, cwd: Path | None = None, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run(["git", *args], cwd=cwd, capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, "GIT_TERMINAL_PROMPT": "0"})


def _git_dir(path: Path) -> Path | None:
    for cand in (path / ".git", path / "repo", path):
        if (cand / "objects").is_dir() and (cand / "HEAD").exists():
            return cand
    return None


def source_tree(t: Trainer, cache: Path, source: str | None = None, clone_timeout: float = 300) -> Path:
    """The trainer's files at its pinned commit, unmodified, in the cache."""
    dest = cache / "src" / f"{t.name}-{t.commit[:12]}"
    if (dest / ".complete").exists():
        return dest
    env_name = t.name.upper().replace("-", "_")
    source = source or os.environ.get(f"USBYTE_RC_SRC_{env_name}")
    tmp = dest.with_name(dest.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    gd: Path | None = None
    why = ""
    if source:
        gd = _git_dir(Path(source))
        if gd is None and (Path(source) / t.script).exists():   # a plain tree: taken as the commit
            shutil.copytree(source, tmp, dirs_exist_ok=True, ignore=shutil.ignore_patterns(".git"))
    else:
        clone = cache / "git" / t.name
        if not _git_dir(clone):
            shutil.rmtree(clone, ignore_errors=True)
            try:
                r = _git("clone", "--bare", "--filter=blob:none", f"https://github.com/{t.repo}", str(clone),
                         timeout=clone_timeout)
                why = r.stderr.strip().splitlines()[-1] if r.returncode else ""
            except (OSError, subprocess.TimeoutExpired) as e:
                why = str(e)
        gd = _git_dir(clone)
    if gd is not None:
        paths = " ".join(f"'{p}'" for p in t.paths)
        a = subprocess.run(f"git --git-dir '{gd}' archive {t.commit} {paths} | tar -x -C '{tmp}'", shell=True,
                           capture_output=True, text=True)
        if a.returncode:
            why = a.stderr.strip()
    if not (tmp / t.script).exists():
        shutil.rmtree(tmp, ignore_errors=True)
        raise Unobtainable(f"{t.name}: {t.repo}@{t.commit[:12]} not obtainable ({why or 'no source'}); "
                           f"give a checkout with --source {t.name}=PATH or $USBYTE_RC_SRC_{env_name}")
    (tmp / ".complete").write_text(t.commit)
    shutil.rmtree(dest, ignore_errors=True)
    tmp.rename(dest)
    return dest


def _replace(text: str, old: str, new: str, where: str) -> str:
    if text.count(old) != 1:
        raise RuntimeError(f"{where}: expected the line {old!r} once, found {text.count(old)}")
    return text.replace(old, new)


def patched_trees(t: Trainer, src: Path, cache: Path, tag: str = "bench") -> dict[str, Path]:
    """Two working copies: "ddp" (the CPU port only) and "usbyte" (the port and the one line)."""
    trees = {}
    for arm in ("ddp", "usbyte"):
        d = cache / "work" / f"{t.name}-{t.commit[:12]}-{tag}-{arm}"
        shutil.rmtree(d, ignore_errors=True)
        shutil.copytree(src, d)
        edits = list(t.port) + ([t.patch] if arm == "usbyte" else [])
        for rel, old, new in edits:
            p = d / rel
            p.write_text(_replace(p.read_text(), old, new, f"{t.name}:{rel}"))
        trees[arm] = d
    return trees


def python_deps(t: Trainer, cache: Path) -> list[str]:
    """Extra entries for PYTHONPATH: the observer, and for a trainer that imports torchvision the
    stand-in and, where missing, Pillow installed into the cache."""
    paths = [str(SHIMS / "observe")]
    if t.needs_pil:
        paths.append(str(SHIMS))
        try:
            import PIL  # noqa: F401
        except ImportError:
            target = cache / "pydeps"
            if not (target / "PIL").is_dir():
                r = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--disable-pip-version-check",
                                    "--target", str(target), "pillow"], capture_output=True, text=True)
                if r.returncode:
                    raise Unobtainable(f"{t.name}: Pillow could not be installed: {r.stderr.strip()[-200:]}") from None
            paths.append(str(target))
            if str(target) not in sys.path:
                sys.path.append(str(target))    # the synthetic images are written with it here too
    if t.deps:
        paths += t.deps(cache, paths)
    return paths


# ---------------------------------------------------------------------------------------------
# Running and comparing

def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclasses.dataclass
class Run:
    rc: int
    logs: dict[int, str]
    state: dict[int, Any]
    outputs: dict[str, Any]
    seconds: float
    dir: Path


#: Seconds one run (one arm of one configuration) may take before it is killed (``--timeout``).
RUN_TIMEOUT_S = 900.0
#: Exit status recorded for a run killed at its time limit.
TIMED_OUT = -9


def _failure(r: Run) -> str:
    """Why a run failed: its time limit, or the last error line of its logs."""
    if r.rc == TIMED_OUT:
        return f"killed at its time limit, {r.seconds:.0f} s (--timeout)"
    return _last_error(r.logs.get(0, "") + r.logs.get(1, ""))


def run_once(t: Trainer, tree: Path, run: Path, config: list[str], iterations: int, pypath: list[str],
             schedule: str | None, timeout: float | None = None) -> Run:
    import torch

    timeout = RUN_TIMEOUT_S if timeout is None else timeout

    for cfg, path in _from_earlier(config, run)[1]:     # what an earlier run of this arm wrote
        if not path.exists():
            run_once(t, tree, run.parent.parent / cfg / run.name, t.configs[cfg], iterations, pypath, schedule,
                     timeout)
    shutil.rmtree(run, ignore_errors=True)
    shutil.rmtree(tree / "out", ignore_errors=True)
    run.mkdir(parents=True)
    cfg_env = dict(c[4:].split("=", 1) for c in config if c.startswith("env:"))
    args, cwd = t.argv(tree, run, [c for c in config if not c.startswith("env:")], iterations)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("USBYTE_", "TORCHELASTIC_", "PL_"))}
    env.update(t.env)
    env.update(t.run_env(tree, run, iterations) if t.run_env else {})
    env.update(cfg_env)
    env.update(PYTHONPATH=os.pathsep.join(pypath + [str(USBYTE_ROOT)] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH")
                                                                  else [])),
               USBYTE_RC_DUMP=str(run / "dump"), OMP_NUM_THREADS="1", PYTHONHASHSEED="0",
               HF_HUB_OFFLINE="1", TORCHINDUCTOR_CACHE_DIR=str(run.parent / "inductor"))
    if schedule:
        env.update(t.usbyte_env)
        env["USBYTE_SCHEDULE"] = schedule
        env["USBYTE_AUTO_DIR"] = str(run / "auto")
    logdir = run / "logs"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-addr", "127.0.0.1",
           "--master-port", str(_free_port()), "--log-dir", str(logdir), "--redirects", "3",
           str(tree / t.script), *args]
    t0 = time.perf_counter()
    try:
        p = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
        rc = p.returncode
    except subprocess.TimeoutExpired:
        rc = TIMED_OUT
    secs = time.perf_counter() - t0
    logs: dict[int, str] = {}
    for rank in (0, 1):
        parts = []
        for name in ("stdout.log", "stderr.log"):
            for f in glob.glob(str(logdir / "**" / str(rank) / name), recursive=True):
                parts.append(Path(f).read_text(errors="replace"))
        logs[rank] = "\n".join(parts)
    state = {}
    for rank in (0, 1):
        f = run / "dump" / f"rank{rank}.pt"
        if f.exists():
            state[rank] = torch.load(f, weights_only=False)
    return Run(rc, logs, state, t.outputs(tree, run, logs) if rc == 0 else {}, secs, run)


def _diffs(a: Any, b: Any, path: str, out: list[tuple[str, float]]) -> None:
    import numpy as np
    import torch

    if isinstance(a, argparse.Namespace) and isinstance(b, argparse.Namespace):
        a, b = vars(a), vars(b)
    elif isinstance(a, np.ndarray) and isinstance(b, np.ndarray):      # numpy's RNG state
        a, b = torch.from_numpy(a.copy()), torch.from_numpy(b.copy())
    elif (type(a) is type(b) and hasattr(a, "__dict__") and not isinstance(a, (torch.Tensor, type))
          and type(a).__eq__ is object.__eq__):                        # a pickled object (a sampler)
        a, b = vars(a), vars(b)
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        if a.shape != b.shape or a.dtype != b.dtype:
            out.append((f"{path} (shape/dtype {tuple(a.shape)} {a.dtype} vs {tuple(b.shape)} {b.dtype})", math.inf))
        elif not torch.equal(a, b):
            if a.is_floating_point() or a.is_complex():
                d = (a.double() - b.double()).abs()
                d = torch.nan_to_num(d, nan=math.inf)
                out.append((path, float(d.max()) if d.numel() else 0.0))
            else:
                out.append((path, float((a.long() - b.long()).abs().max())))
    elif isinstance(a, dict) and isinstance(b, dict):
        for k in sorted(set(a) | set(b), key=str):
            if k not in a or k not in b:
                out.append((f"{path}.{k} (only in {'the first' if k in a else 'the second'})", math.inf))
            else:
                _diffs(a[k], b[k], f"{path}.{k}" if path else str(k), out)
    elif isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        if len(a) != len(b):
            out.append((f"{path} (length {len(a)} vs {len(b)})", math.inf))
        for i, (x, y) in enumerate(zip(a, b)):
            _diffs(x, y, f"{path}[{i}]", out)
    elif isinstance(a, float) and isinstance(b, float) and not (a == b or (a != a and b != b)):
        out.append((path, abs(a - b)))
    elif type(a) is not type(b) or (not isinstance(a, float) and a != b):
        if not (isinstance(a, (int, float)) and isinstance(b, (int, float)) and a == b):
            out.append((f"{path} ({_short(a)} vs {_short(b)})", math.inf))


def _short(v: Any) -> str:
    s = repr(v)
    return s if len(s) < 40 else s[:37] + "..."


def _text_diff(a: str, b: str) -> tuple[str, float] | None:
    if a == b:
        return None
    la, lb = a.splitlines(), b.splitlines()
    for i, (x, y) in enumerate(zip(la, lb)):
        if x != y:
            nx = [float(v) for v in re.findall(r"-?\d+\.\d+(?:e-?\d+)?", x)]
            ny = [float(v) for v in re.findall(r"-?\d+\.\d+(?:e-?\d+)?", y)]
            m = max((abs(p - q) for p, q in zip(nx, ny)), default=math.inf)
            return f"line {i + 1}: {x.strip()[:60]!r} vs {y.strip()[:60]!r}", m
    return f"{len(la)} vs {len(lb)} lines", math.inf


def compare(a: Run, b: Run) -> list[tuple[str, float]]:
    """What differs between two finished runs: (what, max abs diff)."""

    out: list[tuple[str, float]] = []
    for rank in (0, 1):
        sa, sb = a.state.get(rank), b.state.get(rank)
        if sa is None or sb is None:
            out.append((f"rank {rank}: final state not saved", math.inf))
            continue
        if not sa.get("models") or not sb.get("models"):
            out.append((f"rank {rank}: no final model saved", math.inf))
            continue
        labels = {"models": "model", "optimizers": "optimizer", "ema": "ema", "scalers": "scaler"}
        for key, label in labels.items():
            xa, xb = sa.get(key, []), sb.get(key, [])
            if len(xa) != len(xb):
                out.append((f"rank {rank}: {len(xa)} vs {len(xb)} {label}(s) found", math.inf))
            for i, (x, y) in enumerate(zip(xa, xb)):
                _diffs(x, y, f"rank {rank} {label}{'' if len(xa) == 1 else i}", out)
    for k in sorted(set(a.outputs) | set(b.outputs)):
        va, vb = a.outputs.get(k), b.outputs.get(k)
        if va is None or vb is None:
            out.append((f"{k}: written by one run only", math.inf))
        elif isinstance(va, str):
            d = _text_diff(va, vb)
            if d:
                out.append((f"{k}: {d[0]}", d[1]))
        else:
            _diffs(_load(va), _load(vb), k, out)
    return out


def _load(path: Path) -> Any:
    import torch

    if path.suffix == ".safetensors":
        from safetensors.torch import load_file

        return load_file(path)
    return torch.load(path, weights_only=False)


_REFUSAL = re.compile(r"usbyte_opt\.errors\.\w+: (.*)|^(?:\[rank\d\]: )?(\w*UsbyteError\w*: .*)$", re.M)


def refusal(run: Run) -> tuple[str, list[int]]:
    """A failed usbyte run's refusal (its last usbyte-opt error) and the ranks that raised one.
    Its ``usbyte-opt:`` lines say what it ran, not why it stopped: a run that stopped on
    another error (a crash in torch) is no refusal."""
    msgs = {}
    for rank, log in run.logs.items():
        ms = [m.group(1) or m.group(2) for m in _REFUSAL.finditer(log)]
        if ms:
            msgs[rank] = ms[-1].strip()
    msg = next(iter(msgs.values()), "")
    return msg, sorted(msgs)


def _last_error(log: str) -> str:
    lines = [line for line in log.splitlines() if re.search(r"Error|error:|Exception", line)]
    return lines[-1].strip()[:200] if lines else "(no error line)"


def _usbyte_lines(log: str) -> list[str]:
    """What usbyte-opt said on a rank (its lines start with "usbyte-opt", continued indented)."""
    out: list[str] = []
    inside = False
    for line in log.splitlines():
        if line.startswith("usbyte-opt"):
            out.append(line.strip())
            inside = True
        elif inside and line.startswith("  "):
            out[-1] += " " + line.strip()
        else:
            inside = False
    return out[:8]


_CKPT = re.compile(r"^(checkpoint \S+?\.(?:pth\.tar|pth|pt|ckpt|safetensors|bin|pkl))\.(.*)$")


def summarize(diffs: list[tuple[str, float]], limit: int = 8) -> str:
    """The differences grouped by rank (or file), object and kind of tensor, each with its largest."""
    if not diffs:
        return "equal"
    groups: dict[str, tuple[int, float, str]] = {}
    for what, m in diffs:
        ck = _CKPT.match(what)
        if ck:
            lead, path = ck.group(1), ck.group(2)
        elif what.startswith("rank ") and what.count(" ") == 2:
            lead, path = what.rsplit(" ", 1)
        else:                                                   # a text or a structural difference
            lead, path = "", what
        if lead and path.count(".") > 1 and " " not in path:
            head = f"{lead} {path.split('.')[0]}.*.{path.split('.')[-1]}"
        else:
            head = f"{lead} {path}".strip()
        n, best, ex = groups.get(head, (0, -1.0, path))
        groups[head] = (n + 1, max(best, m), path if m > best else ex)
    parts = []
    for h, (n, m, ex) in groups.items():
        size = "" if math.isinf(m) else f"max abs diff {m:.3g}"
        if h.endswith(ex):
            parts.append(f"{h} ({size})" if size else h)
        else:
            parts.append(f"{h}: {n} tensor(s), {size or 'structure'} (largest: {ex})")
    return "; ".join(parts[:limit]) + (f"; +{len(parts) - limit} more" if len(parts) > limit else "")


def run_config(t: Trainer, trees: dict[str, Path], pypath: list[str], config: str, iterations: int,
               work: Path, schedule: str, control: bool = True, ddp: Run | None = None) -> dict[str, Any]:
    """One configuration: its DDP run (or ``ddp``, one already made), the control, the usbyte run."""
    base = work / t.name / config
    args = t.configs[config]
    if ddp is None:
        ddp = run_once(t, trees["ddp"], base / "ddp", args, iterations, pypath, None)
    row: dict[str, Any] = {"trainer": t.name, "config": config, "args": args, "iterations": iterations,
                           "schedule": schedule, "seconds": {"ddp": round(ddp.seconds, 1)}, "_ddp": ddp}
    if ddp.rc != 0:
        row.update(control="n/a", result=f"not run: its own DDP run failed ({_failure(ddp)})",
                   status="ddp-failed")
        return row
    if control:
        ctl = run_once(t, trees["ddp"], base / "ddp2", args, iterations, pypath, None)
        row["seconds"]["control"] = round(ctl.seconds, 1)
        cd = compare(ddp, ctl) if ctl.rc == 0 else [("control run failed", math.inf)]
        row["control"] = "equal" if not cd else "NONDETERMINISTIC: " + summarize(cd)
    us = run_once(t, trees["usbyte"], base / "usbyte", args, iterations, pypath, schedule)
    row["seconds"]["usbyte"] = round(us.seconds, 1)
    wrappers = sorted({w for s in us.state.values() for w in s.get("wrapper", [])})
    row["usbyte_wrapper"] = wrappers
    row["usbyte_lines"] = _usbyte_lines(us.logs.get(0, ""))
    if us.rc != 0:
        msg, ranks = refusal(us)
        if msg and ranks == [0, 1]:
            row.update(result=f"refused ({msg})", status="refused")
        elif msg:
            row.update(result=f"FAILED: refused on rank(s) {ranks} only ({msg})", status="failed")
        else:
            row.update(result=f"FAILED without a refusal (exit {us.rc}): {_failure(us)}", status="failed")
        return row
    diffs = compare(ddp, us)
    row["diffs"] = [[w, m if math.isfinite(m) else "inf"] for w, m in diffs[:200]]
    if not diffs:
        row.update(result="equal", status="equal")
    else:
        row.update(result="DIFFERS: " + summarize(diffs), status="differs")
    return row


#: Iterations of the run that plans a schedule (``auto`` measures 2 + 5 + 4 before it plans),
#: unless the trainer says otherwise (``Trainer.plan_iterations``).
PLAN_ITERATIONS = 16


def planned_schedule(t: Trainer, trees: dict[str, Path], pypath: list[str], work: Path) -> Path:
    """A schedule planned for the trainer's model as a user gets one: its patched run with
    ``USBYTE_SCHEDULE=auto`` writes it to ``$USBYTE_AUTO_DIR/schedule.json``."""
    run = work / t.name / "_plan"
    keep = work / t.name / "schedule.json"
    if keep.exists():
        return keep
    r = run_once(t, trees["usbyte"], run, t.configs[next(iter(t.configs))], t.plan_iterations, pypath, "auto")
    f = run / "auto" / "schedule.json"
    if r.rc != 0 or not f.exists():
        raise RuntimeError(f"{t.name}: the auto run wrote no schedule (exit {r.rc}): "
                           f"{_last_error(r.logs.get(0, ''))}")
    shutil.copy(f, keep)
    return keep


def markdown_table(doc: dict[str, Any]) -> str:
    """The matrix of a --json file as a Markdown table."""
    lines = ["| trainer | configuration | schedule | DDP vs DDP (control) | usbyte-opt vs DDP | usbyte-opt at | "
             "s (DDP / usbyte) |", "|---|---|---|---|---|---|---|"]
    for r in doc["rows"]:
        args = " ".join(a if a else "''" for a in r["args"]) or "(as published)"
        sec = r.get("seconds", {})
        res = r["result"].replace("|", "\\|")
        lines.append(f"| {r['trainer']} | {r['config']} (`{args}`) | {r['schedule']} | {r.get('control', '-')} | "
                     f"{'**' + res + '**' if r['status'] in ('differs', 'failed') else res} | "
                     f"{r.get('usbyte_opt_commit', doc.get('usbyte_opt_commit', ''))} | "
                     f"{sec.get('ddp', '-')} / {sec.get('usbyte', '-')} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    global RUN_TIMEOUT_S
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--trainers", default=",".join(TRAINERS))
    ap.add_argument("--configs", default="", help="comma-separated (default: all but the slow ones)")
    ap.add_argument("--all", action="store_true", help="the slow configurations too")
    ap.add_argument("--iterations", type=int, default=8)
    ap.add_argument("--timeout", type=float, default=RUN_TIMEOUT_S,
                    help="seconds one run (one arm of one configuration) may take (default 900; "
                         "accelerate's bf16 needs about 3000 on 2 CPU cores)")
    ap.add_argument("--schedules", default="auto,planned",
                    help="USBYTE_SCHEDULE of the usbyte runs: auto (planned inside the run: a run this short "
                         "trains on the runtime's DDP-like fallback), planned (a schedule.json an auto run of "
                         f"{PLAN_ITERATIONS} iterations wrote: verification alternates it with DDP's buckets), "
                         "or a schedule file")
    ap.add_argument("--source", action="append", default=[], metavar="NAME=PATH")
    ap.add_argument("--cache", type=Path, default=DEFAULT_CACHE)
    ap.add_argument("--work", type=Path, default=None, help="run directories (default: CACHE/runs)")
    ap.add_argument("--no-control", action="store_true", help="skip the DDP-vs-DDP control run")
    ap.add_argument("--json", type=Path, default=HERE / "real_clients.json")
    ap.add_argument("--merge", action="store_true",
                    help="keep the rows of the existing --json file that this run does not redo")
    ap.add_argument("--usbyte", type=Path, default=ROOT, help="the usbyte-opt checkout the runs import")
    ap.add_argument("--tag", default="bench", help="names the working copies (two runs at once need two tags)")
    ap.add_argument("--table", action="store_true", help="print the --json file's matrix as Markdown and exit")
    a = ap.parse_args(argv)
    RUN_TIMEOUT_S = a.timeout
    if a.table:
        print(markdown_table(json.loads(a.json.read_text())))
        return 0
    sources = dict(s.split("=", 1) for s in a.source)
    global USBYTE_ROOT
    USBYTE_ROOT = a.usbyte.resolve()
    work = a.work or a.cache / "runs"
    rows: list[dict[str, Any]] = []
    meta: dict[str, Any] = {}
    print(f"{'trainer':8} {'schedule':8} {'configuration':17} {'control':9} usbyte vs DDP", flush=True)
    for name in a.trainers.split(","):
        t = TRAINERS[name]
        try:
            src = source_tree(t, a.cache, sources.get(name))
            pypath = python_deps(t, a.cache)
        except Unobtainable as e:
            print(f"{name:8} skipped: {e}", flush=True)
            meta[name] = {"skipped": str(e)}
            continue
        trees = patched_trees(t, src, a.cache, tag=a.tag)
        meta[name] = {"repo": t.repo, "commit": t.commit, "script": t.script,
                      "port": [list(p) for p in t.port], "patch": list(t.patch)}
        configs = a.configs.split(",") if a.configs else [c for c in t.configs if a.all or c not in t.slow]
        ddp_runs: dict[str, Run] = {}
        for sched in a.schedules.split(","):
            if sched == "planned":
                try:
                    sched = str(planned_schedule(t, trees, pypath, work))
                except RuntimeError as e:
                    print(f"{name:8} planned schedule: {e}", flush=True)
                    meta[name]["planned"] = str(e)
                    continue
                meta[name]["planned"] = sched
            label = "auto" if sched == "auto" else "planned" if sched.endswith("schedule.json") else Path(sched).stem
            for c in configs:
                if c not in t.configs:
                    continue
                row = run_config(t, trees, pypath, c, a.iterations, work / label, sched,
                                 control=not a.no_control and c not in ddp_runs, ddp=ddp_runs.get(c))
                ddp_runs[c] = row.pop("_ddp")
                row["schedule"] = label
                if "control" not in row:
                    row["control"] = next((r["control"] for r in rows if r["trainer"] == name
                                           and r["config"] == c and "control" in r), "-")
                rows.append(row)
                print(f"{name:8} {label:8} {c:17} {row.get('control', '-'):9} {row['result']}", flush=True)
    import torch

    commit = _git("rev-parse", "--short", "HEAD", cwd=USBYTE_ROOT).stdout.strip()
    for r in rows:
        r["usbyte_opt_commit"] = commit
    doc = {"torch": torch.__version__, "python": sys.version.split()[0], "iterations": a.iterations,
           "schedules": a.schedules, "trainers": meta, "rows": rows,
           "usbyte_opt_commit": commit}
    if a.json and a.merge and a.json.exists():
        old = json.loads(a.json.read_text())
        redone = {(r["trainer"], r["config"], r["schedule"]) for r in rows}
        doc["rows"] = [r for r in old.get("rows", []) if (r["trainer"], r["config"], r["schedule"]) not in redone]
        doc["rows"] += rows
        doc["trainers"] = {**old.get("trainers", {}), **meta}
    if a.json:
        a.json.write_text(json.dumps(doc, indent=1) + "\n")
    return 1 if any(r["status"] in ("differs", "failed") for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
