"""Child program for tests/test_distributed.py: one training run of a small model
wrapped in FSDP2 (`fully_shard` on blocks and root) or DDP, on 2 gloo processes on
CPU, eagerly and compiled with nnscaler; rank 0 writes losses, final parameters and
cache counters to a file.

    python tests/distributed_worker.py {fsdp2|ddp} PORT OUT_FILE
"""
import copy
import datetime
import faulthandler
import gc
import os
import sys

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn

STEPS = 5
WATCHDOG_S = int(os.environ.get("NNS_WORKER_WATCHDOG_S", "180"))

# A process that hangs anywhere (start-up, a collective, teardown, interpreter exit)
# prints every thread's stack and exits, so the test fails with the place it hung.
# Armed at import: in the launcher and, since spawn re-imports this file, in each
# rank from its start; never cancelled (a process that ends in time ends it). The
# launcher's fires later than the ranks', so theirs come first.
faulthandler.dump_traceback_later(WATCHDOG_S + (30 if __name__ == "__main__" else 0),
                                  exit=True)


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(16, 16)
        self.drop = nn.Dropout(0.1)

    def forward(self, x):
        return x + self.drop(torch.relu(self.fc(x)))


class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList([Block() for _ in range(2)])
        self.head = nn.Linear(16, 4)

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return self.head(x) * (2.0 if self.training else 1.0)


def wrap(model, kind):
    if kind == "fsdp2":
        from torch.distributed.fsdp import fully_shard
        for block in model.blocks:
            fully_shard(block)
        fully_shard(model)
        return model
    return nn.parallel.DistributedDataParallel(model)


def train(model, rank):
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    losses = []
    for step in range(STEPS):
        torch.manual_seed(100 + 10 * step + rank)
        loss = model(torch.randn(8, 16)).square().mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses


def full_state(model):
    state = {}
    for name, value in model.state_dict().items():
        full = getattr(value, "full_tensor", None)
        state[name] = (full() if full is not None else value).detach().clone()
    return state


def run(rank, world, kind, port, out):
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world, timeout=datetime.timedelta(seconds=WATCHDOG_S))
    import nnscaler
    torch.manual_seed(0)
    base = Model()
    results = {}
    for mode in ("eager", "compiled"):
        model = wrap(copy.deepcopy(base), kind)
        if mode == "compiled":
            model = nnscaler.compile(model)
        results[mode] = train(model, rank)
        results[mode + "_state"] = full_state(model)
        if mode == "compiled":
            results["cache_info"] = tuple(nnscaler.cache_info(model))
        # The wrapper (and the process group it holds) goes now, while every rank
        # is alive, not during interpreter shutdown.
        del model
        gc.collect()
    if rank == 0:
        torch.save(results, out)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    kind, port, out = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    mp.spawn(run, args=(2, kind, port, out), nprocs=2, join=True)
