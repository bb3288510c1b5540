"""Observation only (benchmarks/real_clients.py): records what a trainer built and, when its run
ends, saves every rank's final state to ``$USBYTE_RC_DUMP/rank{R}.pt``.

Loaded by Python at start-up from PYTHONPATH; it changes nothing the trainer computes. It
records each optimizer that code outside usbyte-opt's runtime constructs, and at the run's end (right
before ``torch.distributed.destroy_process_group``, else at interpreter exit) finds the data
parallel wrapper(s), the EMA models and the gradient scalers, and saves their ``state_dict()``
(for a wrapper, that of its ``module``: weights and buffers; in a Lightning run, the
LightningModule's; in an Accelerate run, that of each model its ``Accelerator`` prepared,
unwrapped) as a user's script would.

One thing it sets: Python's own ``random`` module, which seeds itself from the operating system
at start-up, is seeded with 0 in every run (arm and rank alike). A trainer that never seeds it
(Accelerate's examples seed numpy and torch only) would otherwise save a different
``random.getstate()`` in every checkpoint of every run, its own DDP runs included; a trainer that
seeds it itself (timm) overrides this. With ``USBYTE_RC_SEED_TORCH`` set (a trainer that never
seeds torch either, whose every run, its own DDP runs included, would otherwise start from other
weights and draw other dropout masks), torch's generator is seeded with 0 in the same way.
"""

import atexit
import gc
import os
import sys
import warnings
import weakref

_DIR = os.environ.get("USBYTE_RC_DUMP")

if _DIR:
    import random

    random.seed(0)

    import torch

    if os.environ.get("USBYTE_RC_SEED_TORCH"):
        torch.manual_seed(0)    # a trainer that never seeds torch (see the module's docstring)
    import torch.distributed as _dist

    _optimizers = []
    _done = []
    _pkg = os.sep + os.path.join("usbyte_opt", "runtime") + os.sep
    _orig_opt_init = torch.optim.Optimizer.__init__

    def _opt_init(self, *args, **kwargs):
        _orig_opt_init(self, *args, **kwargs)
        f = sys._getframe(1)
        while f is not None:
            if _pkg in f.f_code.co_filename:
                return            # the runtime's own (inner) optimizers are not the trainer's
                # (an integration, usbyte_opt.integrations, builds the trainer's: recorded)
            f = f.f_back
        if not any(r() is self for r in _optimizers):
            _optimizers.append(weakref.ref(self))

    torch.optim.Optimizer.__init__ = _opt_init

    def _cpu(obj):
        if isinstance(obj, torch.Tensor):
            return obj.detach().to("cpu", copy=True)
        if isinstance(obj, dict):
            return {k: _cpu(v) for k, v in obj.items()}
        if isinstance(obj, (list, tuple)):
            return type(obj)(_cpu(v) for v in obj)
        return obj

    def _of(kinds):
        """The live objects of these types (skipping dead weak proxies, which compile leaves)."""
        out = []
        for o in gc.get_objects():
            try:
                if isinstance(o, kinds):
                    out.append(o)
            except ReferenceError:
                continue
        return out

    def _wrappers():
        kinds = [torch.nn.parallel.DistributedDataParallel]
        mod = sys.modules.get("usbyte_opt.runtime.wrapper")
        if mod is not None:
            kinds.insert(0, mod.DistributedDataParallel)
        found = _of(tuple(kinds))
        for kind in kinds:                       # the outermost kind the run built
            of_kind = [o for o in found if type(o) is kind]
            if of_kind:
                return of_kind
        return []

    def _dump():
        if _done:
            return
        if not (_dist.is_available() and _dist.is_initialized()) and "RANK" not in os.environ:
            # not a rank: the torchrun launcher (it imports this file too, and exits last), which
            # would otherwise overwrite rank 0's dump with an empty one
            return
        _done.append(True)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            _save()

    def _save():
        rank = _dist.get_rank() if _dist.is_available() and _dist.is_initialized() else int(
            os.environ.get("RANK", "0"))
        out = {"models": [], "optimizers": [], "ema": [], "scalers": [], "wrapper": []}
        for w in _wrappers():
            out["wrapper"].append(f"{type(w).__module__}.{type(w).__qualname__}")
            out["models"].append(_cpu(w.module.state_dict()))
        pl = sys.modules.get("lightning.pytorch")
        if pl is not None:       # a Lightning run: the LightningModule (under DDP, or on the runtime path)
            out["models"] = [_cpu(m.state_dict()) for m in _of(pl.LightningModule)]
        acc = getattr(sys.modules.get("accelerate"), "Accelerator", None)
        accelerators = _of(acc) if acc is not None else []
        if accelerators:         # an Accelerate run: the models its Accelerator prepared (in DDP or not)
            out["models"], out["wrapper"] = [], []
            for a in accelerators:
                for m in a._models:
                    out["wrapper"].append(f"{type(m).__module__}.{type(m).__qualname__}")
                    out["models"].append(_cpu(a.unwrap_model(m).state_dict()))
        for r in _optimizers:
            opt = r()
            if opt is not None:
                out["optimizers"].append(_cpu(opt.state_dict()))
        for o in _of((torch.nn.Module, torch.amp.GradScaler)):
            if isinstance(o, torch.amp.GradScaler):
                out["scalers"].append(_cpu(o.state_dict()))
            elif type(o).__name__.lower().startswith("modelema"):
                out["ema"].append(_cpu(getattr(o, "module", o).state_dict()))
        os.makedirs(_DIR, exist_ok=True)
        torch.save(out, os.path.join(_DIR, f"rank{rank}.pt"))

    _orig_destroy = _dist.destroy_process_group

    def _destroy(*args, **kwargs):
        _dump()
        return _orig_destroy(*args, **kwargs)

    _dist.destroy_process_group = _destroy
    atexit.register(_dump)
