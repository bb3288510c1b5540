"""Fine-tune a BERT classifier with the Hugging Face Trainer, its all-reduce planned by usbyte-opt.

The Trainer is ``usbyte_opt.integrations.transformers.UsbyteTrainer``: the plain
``transformers.Trainer`` plus ``schedule=``. The schedule decides the path: a ``ddp-tuned``
schedule runs the Trainer's own DDP with the planned buckets, any other the usbyte-opt runtime.
The model is built from a config (nothing is downloaded) and trained on a seeded synthetic data
set. ``build`` (the profiler's factory) builds the ``--size bench`` model (the default size;
a schedule given to another size stops with an error that names both). On two CPU ranks, from
the repository root::

    PYTHONPATH=examples usbyte-opt profile hf_train:build -b 8 --nproc-per-node 2 --device cpu -o profiles/hf.json
    usbyte-opt optimize profiles/hf.json --mode fence -o schedules/hf.json                 # the runtime
    usbyte-opt optimize profiles/hf.json --strategy ddp-tuned -o schedules/hf-ddp.json     # stock DDP
    usbyte-opt launch --schedule schedules/hf.json --nproc-per-node 2 examples/hf_train.py --size bench
    torchrun --nproc-per-node 2 examples/hf_train.py --size bench --baseline               # the plain Trainer

``--schedule PATH`` overrides ``$USBYTE_SCHEDULE`` (which ``usbyte-opt launch`` sets).
``--report PATH``: rank 0 writes the run's figures as JSON (per-step wall time after two
warm-up steps, and the sum of all parameters after training). Rank 0 prints one summary line.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time

import torch

#: Model sizes: tiny (seconds on a CPU, for the tests) and bench (a few million parameters,
#: where communication matters on two CPU ranks).
SIZES = {
    "tiny": dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
                 vocab_size=100, seq=16, batch=4),
    "bench": dict(hidden_size=256, num_hidden_layers=4, num_attention_heads=4, intermediate_size=1024,
                  vocab_size=8192, seq=32, batch=8),
}
LABELS = 4
LR = 1e-3


def model(size: str = "bench") -> torch.nn.Module:
    """The BERT classifier of ``size``, seeded, dropout off (the same weights on every run)."""
    from transformers import BertConfig, BertForSequenceClassification

    s = SIZES[size]
    torch.manual_seed(0)
    cfg = BertConfig(hidden_size=s["hidden_size"], num_hidden_layers=s["num_hidden_layers"],
                     num_attention_heads=s["num_attention_heads"], intermediate_size=s["intermediate_size"],
                     vocab_size=s["vocab_size"], max_position_embeddings=max(64, s["seq"]),
                     num_labels=LABELS, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    net = BertForSequenceClassification(cfg)
    net.usbyte_model_name = f"hf_train BERT --size {size}"  # how usbyte-opt names it (profile, errors)
    return net


class Data(torch.utils.data.Dataset):
    """Seeded random token sequences (some padded) with random labels."""

    def __init__(self, n: int, size: str):
        s = SIZES[size]
        g = torch.Generator().manual_seed(1)
        lengths = torch.randint(s["seq"] // 2, s["seq"] + 1, (n,), generator=g)
        self.mask = (torch.arange(s["seq"])[None, :] < lengths[:, None]).long()
        self.ids = torch.randint(1, s["vocab_size"], (n, s["seq"]), generator=g) * self.mask
        self.labels = torch.randint(0, LABELS, (n,), generator=g)

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "attention_mask": self.mask[i], "labels": self.labels[i]}


def build(batch_size: int):
    """The profiler's factory (``usbyte_opt.models``): the ``bench`` model, a batch of its
    inputs, its loss and the Trainer's optimizer (AdamW at ``learning_rate``, whose step the
    profiler times). Its tensor names are the model's own, which is the module
    ``UsbyteTrainer`` gives the runtime and DDP."""
    from usbyte_opt.models import RandomTargetLoss

    data = Data(batch_size, "bench")
    inputs = (data.ids, data.mask)
    net = model("bench")
    return (net, inputs, RandomTargetLoss(LABELS, (batch_size,), pick=lambda out: out.logits),
            torch.optim.AdamW(net.parameters(), lr=LR))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--schedule", default=None,
                    help="schedule file or 'auto' (default: $USBYTE_SCHEDULE, else the runtime's default plan)")
    ap.add_argument("--baseline", action="store_true",
                    help="the plain transformers.Trainer with its own DDP, no usbyte-opt")
    ap.add_argument("--steps", type=int, default=10, help="optimizer steps (default: 10)")
    ap.add_argument("--accum", type=int, default=1, help="gradient accumulation steps (default: 1)")
    ap.add_argument("--clip", type=float, default=1.0, help="max_grad_norm (default: 1.0)")
    ap.add_argument("--size", choices=sorted(SIZES), default="bench", help="model size (default: bench)")
    ap.add_argument("--batch-size", type=int, default=None, help="per-rank batch size (default: the size's)")
    ap.add_argument("--no-verify", action="store_true",
                    help="runtime path: run the schedule as given, without timing it against DDP's buckets")
    ap.add_argument("--report", metavar="PATH", help="rank 0 writes the run's figures here as JSON")
    a = ap.parse_args()

    from transformers import PrinterCallback, Trainer, TrainerCallback, TrainingArguments

    cuda = torch.cuda.is_available()
    ws = int(os.environ.get("WORLD_SIZE", "1"))
    batch = a.batch_size or SIZES[a.size]["batch"]
    data = Data(a.steps * a.accum * batch * ws, a.size)
    out_dir = tempfile.TemporaryDirectory(prefix="hf-train-")   # nothing is saved there
    args = TrainingArguments(output_dir=out_dir.name, use_cpu=not cuda, ddp_backend="nccl" if cuda else "gloo",
                             per_device_train_batch_size=batch, gradient_accumulation_steps=a.accum,
                             max_steps=a.steps, max_grad_norm=a.clip, learning_rate=LR, warmup_steps=2,
                             logging_steps=1, save_strategy="no", report_to=[], disable_tqdm=True,
                             dataloader_num_workers=0, seed=0, log_level="warning")

    class Clock(TrainerCallback):
        """Wall time of each optimizer step (from the end of the previous one)."""

        def __init__(self):
            self.stamps: list[float] = []

        def _stamp(self) -> None:
            if cuda:
                torch.cuda.synchronize()
            self.stamps.append(time.perf_counter())

        def on_train_begin(self, *args, **kwargs):
            self._stamp()

        def on_step_end(self, *args, **kwargs):
            self._stamp()

    clock = Clock()
    net = model(a.size)
    if a.baseline:
        trainer = Trainer(model=net, args=args, train_dataset=data, callbacks=[clock])
        path = "baseline"
    else:
        from usbyte_opt.integrations.transformers import UsbyteTrainer

        trainer = UsbyteTrainer(model=net, args=args, train_dataset=data, callbacks=[clock],
                                schedule=a.schedule,
                                runtime_options={"verify": False} if a.no_verify else None)
        path = trainer.usbyte_plan.path
    trainer.remove_callback(PrinterCallback)   # the summary line below instead of a line per step
    trainer.train()        # UsbyteTrainer: every update applied when it returns

    steps = [(e - s) * 1e3 for s, e in zip(clock.stamps, clock.stamps[1:])]
    kept = steps[2:] if len(steps) > 2 else steps
    checksum = float(sum(p.detach().double().sum().item() for p in net.parameters()))
    if trainer.is_world_process_zero():
        median = statistics.median(kept) if kept else 0.0
        if a.report:
            with open(a.report, "w") as f:
                json.dump({"trainer": "transformers", "path": path, "steps": len(steps), "ms_per_step": kept,
                           "median_ms": median, "param_checksum": checksum}, f)
        norms = [e["grad_norm"] for e in trainer.state.log_history if "grad_norm" in e]
        print(f"hf_train {a.size} ({path}): {len(steps)} steps, median {median:.1f} ms/step after 2 warm-up, "
              f"last grad_norm {norms[-1] if norms else float('nan'):.4f}, param checksum {checksum:.6f}, "
              f"world size {ws}", flush=True)
    out_dir.cleanup()


if __name__ == "__main__":
    main()
