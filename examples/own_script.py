"""A DDP training loop with its one DDP line changed (README, *In your own script*).

    torchrun --nproc-per-node 2 examples/own_script.py            # usbyte-opt's wrapper
    torchrun --nproc-per-node 2 examples/own_script.py --ddp      # the same loop on torch DDP

With ``$USBYTE_SCHEDULE`` set (``usbyte-opt launch --schedule S ... examples/own_script.py``)
the wrapper runs that schedule; without one it runs torch's DDP. Either way the parameters
it ends with are DDP's, bitwise (``tests/test_own_script.py`` runs both on 2 gloo ranks).
Runs on CPU (gloo) and GPU (NCCL) as written.
"""

import os
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

import usbyte_opt

cuda = torch.cuda.is_available()
dist.init_process_group("nccl" if cuda else "gloo")
rank, local_rank = dist.get_rank(), int(os.environ.get("LOCAL_RANK", "0"))
device = torch.device("cuda", local_rank) if cuda else torch.device("cpu")
device_ids = [local_rank] if cuda else None          # CPU DDP takes no device_ids
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.GELU(), torch.nn.Linear(64, 10))
model = model.to(device)
optimizer = torch.optim.AdamW(model.parameters(), lr=3e-4)

if "--ddp" in sys.argv:
    model = DDP(model, device_ids=device_ids)
else:
    model = usbyte_opt.DistributedDataParallel(model, device_ids=device_ids)  # the one line

scaler = torch.amp.GradScaler(device.type)
g = torch.Generator().manual_seed(rank)               # each rank its own data
data = [(torch.randn(16, 32, generator=g), torch.randint(0, 10, (16,), generator=g))
        for _ in range(24)]
accum = 2
for step, (x, y) in enumerate(data):
    x, y = x.to(device), y.to(device)
    model.require_backward_grad_sync = (step + 1) % accum == 0   # or: with model.no_sync():
    with torch.autocast(device.type, dtype=torch.bfloat16):
        loss = F.cross_entropy(model(x), y)
    scaler.scale(loss / accum).backward()
    if (step + 1) % accum == 0:
        scaler.unscale_(optimizer)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)   # sees the averaged gradients
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad(set_to_none=True)
path = os.environ.get("OWN_SCRIPT_OUT", "own_script.pt")
if rank == 0:
    torch.save({"model": model.module.state_dict(), "optimizer": optimizer.state_dict()}, path)
del model                                            # DDP holds the group: it goes first
dist.destroy_process_group()
