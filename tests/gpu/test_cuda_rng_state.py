"""CUDA RNG state beside the tensors: ``torch.cuda.get_rng_state_all()`` and CUDA
``torch.Generator`` objects round-trip without pickle, and load into live generators.

Every test here needs a GPU and a CUDA build of torch; without them the module is skipped.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import lazyckpt
from tiers import FileTier, HostMemoryTier

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not torch.cuda.is_available(), reason="needs CUDA (a GPU and a CUDA build of torch)"
    ),
]


async def test_cuda_rng_states_and_generators_continue_where_they_were(tmp_path: Path) -> None:
    torch.cuda.manual_seed_all(3)
    gen = torch.Generator(device="cuda").manual_seed(4)
    state = {"cuda_rng": torch.cuda.get_rng_state_all(), "gen": gen}
    async with lazyckpt.Checkpointer([HostMemoryTier(8 << 20), FileTier(tmp_path)]) as ckpt:
        await (await ckpt.snapshot(state, step=1)).committed()
        # what the saved states draw next
        from_gen = torch.rand(5, device="cuda", generator=gen)
        from_global = torch.rand(5, device="cuda")
        back = await ckpt.restore(1)
        live = torch.Generator(device="cuda").manual_seed(99)
        await ckpt.restore(1, into={"cuda_rng": [], "gen": live})
    assert isinstance(back["gen"], torch.Generator) and back["gen"].device.type == "cuda"
    assert torch.equal(torch.rand(5, device="cuda", generator=back["gen"]), from_gen)
    assert torch.equal(torch.rand(5, device="cuda", generator=live), from_gen)
    torch.cuda.set_rng_state_all(back["cuda_rng"])
    assert torch.equal(torch.rand(5, device="cuda"), from_global)
