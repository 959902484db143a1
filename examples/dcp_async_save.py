"""PyTorch DCP's ``async_save`` and ``load`` with lazyckpt as the storage underneath.

A small model trains; every few steps ``dcp.async_save`` hands the state to lazyckpt, which
returns at once: the tensors are copied to host memory while the next forward and backward
run (the optimizer guard holds ``step()`` until the copy is done), then written to files
and committed. At the end a fresh model loads the last step with ``dcp.load`` and is
compared bit for bit. Runs in a few seconds on a CPU::

    python examples/dcp_async_save.py --steps 20 --every 5
"""

from __future__ import annotations

import argparse
import tempfile
import time
import warnings

import torch
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.checkpoint.state_dict_loader import load
from torch.distributed.checkpoint.state_dict_saver import AsyncSaveResponse, async_save

from lazyckpt import SyncCheckpointer
from lazyckpt.integrations.dcp import LazyStorageReader, LazyStorageWriter
from tiers import FileTier, HostMemoryTier

# DCP notes that it runs without a process group here (one process); that is intended.
warnings.filterwarnings("ignore", message="torch.distributed is disabled")


def build(seed: int, width: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(
        torch.nn.Linear(width, 4 * width), torch.nn.GELU(), torch.nn.Linear(4 * width, width)
    )
    return model, torch.optim.AdamW(model.parameters(), lr=1e-3)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--every", type=int, default=5)
    parser.add_argument("--width", type=int, default=256)
    args = parser.parse_args()

    model, opt = build(0, args.width)
    with tempfile.TemporaryDirectory() as root:
        tiers = [HostMemoryTier(256 << 20), FileTier(root)]
        with SyncCheckpointer(tiers) as ckpt:
            ckpt.guard(opt)  # optimizer.step() waits for a running capture, nothing else
            uploads = []
            for step in range(1, args.steps + 1):
                x = torch.randn(32, args.width)
                loss = (model(x) - x).square().mean()
                loss.backward()
                opt.step()
                opt.zero_grad()
                if step % args.every == 0:
                    model_sd, optim_sd = get_state_dict(model, opt)
                    t0 = time.perf_counter()
                    response = async_save(
                        {"model": model_sd, "optim": optim_sd},
                        checkpoint_id=str(step),  # the step (an int works too)
                        storage_writer=LazyStorageWriter(ckpt),
                    )
                    took = (time.perf_counter() - t0) * 1e3
                    print(f"step {step:3d}  loss {loss.item():.5f}  async_save {took:.2f} ms")
                    assert isinstance(response, AsyncSaveResponse)  # staging + upload futures
                    uploads.append(response)
            for response in uploads:
                response.upload_completion.result()  # committed on the file tier
            last = ckpt.steps()[-1]
            print(f"committed steps: {ckpt.steps()} -> file")

            fresh, fresh_opt = build(1, args.width)
            fresh(torch.randn(2, args.width)).sum().backward()
            fresh_opt.step()  # so the optimizer has state for dcp.load to fill
            model_sd, optim_sd = get_state_dict(fresh, fresh_opt)
            load(
                {"model": model_sd, "optim": optim_sd},
                checkpoint_id=str(last),
                storage_reader=LazyStorageReader(ckpt),
            )  # fills model_sd and optim_sd in place
            set_state_dict(fresh, fresh_opt, model_state_dict=model_sd, optim_state_dict=optim_sd)

    same = all(
        torch.equal(a, b)
        for a, b in zip(model.state_dict().values(), fresh.state_dict().values(), strict=True)
    ) and all(
        torch.equal(opt.state[p]["exp_avg"], fresh_opt.state[q]["exp_avg"])
        for p, q in zip(model.parameters(), fresh.parameters(), strict=True)
    )
    if not same:
        raise SystemExit(f"step {last} did not load back identically")
    print(f"step {last} loaded with dcp.load: model and optimizer bit for bit")


if __name__ == "__main__":
    main()
