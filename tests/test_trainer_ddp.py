"""A 2-process DDP step (gloo, CPU) equals the single-process step on the same global batch."""
from __future__ import annotations

import os
import socket

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from retr.trainers.training.distributed import DistInfo
from retr.trainers.training.loop import train_step
from retr.trainers.models import create_model


def _model():
    torch.manual_seed(0)
    return create_model("scan", vocab_size=20, img_dim=6, embed_size=8, word_dim=4, direction="i2t")


def _batch():
    g = torch.Generator().manual_seed(1)
    lengths = torch.tensor([5, 2, 4, 3, 1, 5])
    tokens = torch.randint(4, 20, (6, 5), generator=g)
    mask = torch.ones(6, 3, dtype=torch.bool)
    mask[1, 2:] = False
    return {"features": torch.randn(6, 3, 6, generator=g), "mask": mask, "tokens": tokens, "lengths": lengths}


def _part(batch, rank, world):
    per = batch["features"].shape[0] // world
    part = {k: v[rank * per:(rank + 1) * per] for k, v in batch.items()}
    part["tokens"] = part["tokens"][:, :int(part["lengths"].max())]     # each rank pads to its own length
    return part


def _worker(rank, world, port, out):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    model = _model()
    net = torch.nn.parallel.DistributedDataParallel(model)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    loss = train_step(net, _part(_batch(), rank, world), optimizer, None, 2.0, torch.device("cpu"),
                      DistInfo(rank, world, rank))
    if rank == 0:
        torch.save({"loss": loss, "state": model.state_dict()}, out)
    dist.barrier()                     # neither rank tears gloo down while the other still talks to it
    dist.destroy_process_group()


def test_two_process_step_equals_single_process(tmp_path):
    model = _model()
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    loss = train_step(model, _batch(), optimizer, None, 2.0, torch.device("cpu"))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = tmp_path / "rank0.pt"
    mp.spawn(_worker, args=(2, port, str(out)), nprocs=2, join=True)
    got = torch.load(out)
    assert abs(got["loss"] - loss) < 1e-5 * max(1.0, abs(loss))
    for name, value in model.state_dict().items():
        torch.testing.assert_close(got["state"][name], value, rtol=1e-5, atol=1e-6, msg=name)
