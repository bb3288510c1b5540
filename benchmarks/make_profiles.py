"""Regenerate the shipped profiles in ``profiles/``: six real architectures, measured on this
CPU with the profiler and rescaled to a V100-class GPU on an 8-worker 25 Gbit/s cluster.

Needs torchvision and transformers beside torch (torchvision may need its own environment,
see docs/profiles.md)::

    python benchmarks/make_profiles.py                 # all six, ~5 minutes on 2 cores
    python benchmarks/make_profiles.py --only gpt2     # one of them

Method, per model (also written into each profile's ``meta.method``):

1. **Measure** with :func:`usbyte_opt.profiler.profile_model` at world size 1 on the CPU, at a
   small batch, one intra-op thread (a shared 2-core machine: two threads stalled on a busy
   core made steps 40x slower), warm-up 1, medians of ``--repeats``. This gives the shapes,
   the per-tensor ready/need offsets and the forward:backward split.
2. **Count** the forward FLOPs of one sample with ``torch.utils.flop_counter`` on the same
   model, and ResNet-50's the same way.
3. **Rescale** so that forward+backward of the shipped batch takes ``batch / throughput``
   on a V100: ResNet-50 v1.5 trains at 367 img/s on one V100-16GB in FP32 (NVIDIA
   DeepLearningExamples, PyTorch ResNet50 v1.5 README, "Training performance: NVIDIA
   DGX-1 16GB"). Other models are assumed to reach ResNet-50's achieved FLOP rate there:
   ``throughput = 367 * flops(resnet50) / flops(model)``. ready/need offsets scale with
   backward/forward. The CPU's per-layer shares are kept as measured.
4. **Update cost**: SGD with momentum streams 5 float32 values per element (read param,
   grad, buffer; write buffer, param) through HBM2 at 900 GB/s (V100 data sheet):
   ``update_ms = numel * 20 / 900e6``. Kernel-launch overhead is ignored (foreach kernels).
5. **Comm**: ring of 8 workers on 25 Gbit/s Ethernet, hop latency chosen so that
   alpha = 1.3 ms (the US-Byte authors' 8-worker fit): alpha 1.3 ms, algbw 1.786 GB/s,
   via :func:`usbyte_opt.planning.cost.retarget`.
"""

from __future__ import annotations

import argparse
import datetime as dt
import platform
import time
import warnings
from pathlib import Path

import torch
from torch.utils.flop_counter import FlopCounterMode

REPO = Path(__file__).resolve().parents[1]

from usbyte_opt import __version__  # noqa: E402
from usbyte_opt.formats import Profile, TensorSpec, save_profile  # noqa: E402
from usbyte_opt.models import resolve, transformers_factory  # noqa: E402
from usbyte_opt.profiler import ProfileOptions, ProfileWarning, analytic_comm, profile_model  # noqa: E402

#: The anchor: ResNet-50 v1.5, PyTorch, 1x V100-16GB, FP32 (NVIDIA DeepLearningExamples).
ANCHOR_THROUGHPUT = 367.0
ANCHOR_SOURCE = ("NVIDIA DeepLearningExamples, PyTorch/Classification/ConvNets/resnet50v1.5 README, "
                 "Training performance: NVIDIA DGX-1 16GB (8x V100 16GB), 1 GPU, FP32: 367 img/s")
HBM_GBS = 900.0          # V100 HBM2 bandwidth (data sheet)
SGD_BYTES_PER_ELEM = 20  # momentum SGD: read p, g, buf; write buf, p (float32)

#: name -> (MODEL spec, shipped batch, CPU batch, CPU repeats, sequence length or None)
MODELS = {
    "resnet50": ("resnet50", 64, 4, 5, None),
    "resnet152": ("resnet152", 32, 2, 5, None),
    "vgg16": ("vgg16", 32, 2, 5, None),
    "densenet201": ("densenet201", 32, 4, 5, None),
    "bert-base": ("bert-base", 32, 4, 5, 128),
    "gpt2": ("gpt2", 4, 1, 3, 1024),
}


def forward_flops(spec: str) -> float:
    """FLOPs of one sample's forward pass, counted by ``torch.utils.flop_counter``."""
    factory, _ = resolve(spec)
    model, inputs, _ = factory(1)
    model.train()
    with FlopCounterMode(display=False) as fc, torch.no_grad():
        model(*inputs)
    return float(fc.get_total_flops())


def make(name: str, repeats: int | None, out_dir: Path, anchor_flops: float) -> Profile:
    spec, batch, cpu_batch, cpu_repeats, seq = MODELS[name]
    factory = transformers_factory(spec, seq) if seq else resolve(spec)[0]
    t0 = time.perf_counter()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ProfileWarning)  # world size 1 is intended here
        cpu = profile_model(factory, cpu_batch, ProfileOptions(warmup=1, repeats=repeats or cpu_repeats,
                                                               optimizer="sgd"), name=name, device="cpu")
    wall = time.perf_counter() - t0
    flops = forward_flops(spec)
    throughput = ANCHOR_THROUGHPUT * anchor_flops / flops
    compute_ms = 1e3 * batch / throughput
    share_f = cpu.forward_ms / (cpu.forward_ms + cpu.backward_ms)
    F, B = compute_ms * share_f, compute_ms * (1 - share_f)
    kf, kb = F / cpu.forward_ms, B / cpu.backward_ms
    tensors = tuple(
        TensorSpec(t.name, t.shape, t.dtype, round(min(t.ready_ms * kb, B), 6), round(min(t.need_ms * kf, F), 6),
                   round(t.numel * SGD_BYTES_PER_ELEM / (HBM_GBS * 1e6), 6))
        for t in cpu.tensors)
    comm = analytic_comm()
    m = cpu.meta
    meta = {
        "source": "measured on CPU with usbyte-opt profile, rescaled to a V100-class GPU",
        "usbyte_opt": __version__,
        "model": spec + (f" (sequence length {seq})" if seq else " (224x224 images)"),
        "created": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "device": "cuda (V100-class, rescaled)",
        "backend": "analytic",
        "dtype": m["dtype"],
        "batch_size": batch,
        "world_size": comm.world_size,
        "hosts": comm.world_size,
        "optimizer": "sgd",
        "torch": torch.__version__,
        "method": "benchmarks/make_profiles.py: CPU per-tensor shares, forward+backward scaled to "
                  "batch/throughput, throughput = 367 img/s (ResNet-50, V100 FP32) x FLOP ratio; "
                  "update_ms = numel*20 B / 900 GB/s; comm: 8-worker 25 Gbit/s ring, alpha 1.3 ms",
        "measured": {"machine": f"{platform.machine()} {platform.processor() or ''}".strip() + ", 1 thread",
                     "torch": m["torch"], "batch_size": cpu_batch, "repeats": m["repeats"],
                     "forward_ms": cpu.forward_ms, "backward_ms": cpu.backward_ms, "step_ms": m["step_ms"],
                     "spread": m["spread"], "wall_s": round(wall, 1),
                     "no_grad_tensors": m["no_grad_tensors"],
                     "functional_use_tensors": m["functional_use_tensors"]},
        "scaling": {"reference": ANCHOR_SOURCE, "anchor_throughput_per_s": ANCHOR_THROUGHPUT,
                    "anchor_forward_flops": anchor_flops, "forward_flops_per_sample": flops,
                    "throughput_per_s": round(throughput, 3), "compute_ms": round(compute_ms, 6),
                    "forward_factor": round(kf, 9), "backward_factor": round(kb, 9),
                    "flops_counter": "torch.utils.flop_counter.FlopCounterMode, one sample"},
        "update": f"SGD momentum roofline: {SGD_BYTES_PER_ELEM} bytes/element at {HBM_GBS:g} GB/s",
        # The text is digested in the shipped files; it names the function by its old path.
        "comm": "analytic: ring of 8 workers, 25 Gbit/s Ethernet (busbw 3.125 GB/s), hop latency "
                "92.857 us so alpha = 1.3 ms (the US-Byte authors' 8-worker fit); "
                "usbyte_opt.cost.retarget ring formula",
    }
    prof = Profile(name, round(F, 6), round(B, 6), tensors, comm, meta)
    save_profile(prof, out_dir / f"{name}.json")
    return prof


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", nargs="*", choices=list(MODELS), help="models to regenerate")
    ap.add_argument("--repeats", type=int, help="timed CPU iterations (default per model)")
    ap.add_argument("--out", type=Path, default=REPO / "profiles")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    anchor = forward_flops("resnet50")
    print(f"{'profile':<12} {'tensors':>7} {'MB':>8} {'F ms':>8} {'B ms':>8} {'thr/s':>8} {'cpu s':>6}")
    for name in args.only or list(MODELS):
        p = make(name, args.repeats, args.out, anchor)
        mb = sum(t.nbytes for t in p.tensors) / 1e6
        print(f"{name:<12} {len(p.tensors):>7} {mb:>8.1f} {p.forward_ms:>8.2f} {p.backward_ms:>8.2f} "
              f"{p.meta['scaling']['throughput_per_s']:>8.1f} {p.meta['measured']['wall_s']:>6.1f}", flush=True)


if __name__ == "__main__":
    main()
