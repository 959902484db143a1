"""restore(into=...) with optimizers that do not fit the snapshot's: refused with a
StateMismatchError before anything is read, so nothing is loaded; and what a Stateful
object's own load_state_dict still refuses is a StateMismatchError with its error as the
cause."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import lazyckpt
from lazyckpt import StateMismatchError
from tiers import FileTier


def net() -> nn.Sequential:
    return nn.Sequential(nn.Linear(4, 16), nn.BatchNorm1d(16), nn.Linear(16, 2))


def trained(
    opt_cls: Callable[..., torch.optim.Optimizer] = torch.optim.Adam,
) -> tuple[nn.Module, Any]:
    torch.manual_seed(0)
    model = net()
    opt = opt_cls(model.parameters(), lr=0.01)
    model(torch.randn(8, 4)).sum().backward()
    opt.step()
    return model, opt


def save(root: Path, state: dict[str, Any]) -> None:
    with lazyckpt.SyncCheckpointer([FileTier(root)]) as ckpt:
        ckpt.snapshot(state, step=0).wait()


def restore(root: Path, into: Any, **kwargs: Any) -> Any:
    with lazyckpt.SyncCheckpointer([FileTier(root, readonly=True)]) as ckpt:
        return ckpt.restore(step=0, into=into, **kwargs)


def tensors(obj: Any) -> dict[str, torch.Tensor]:
    if isinstance(obj, nn.Module):
        return {k: v.clone() for k, v in obj.state_dict().items()}
    out = {}
    for i, entry in obj.state_dict()["state"].items():
        out.update({f"{i}/{k}": v.clone() for k, v in entry.items()})
    return out


def unchanged(before: dict[str, torch.Tensor], obj: Any) -> bool:
    after = tensors(obj)
    return before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)


@pytest.mark.parametrize("nested", [False, True])
def test_an_optimizer_over_fewer_parameters_is_refused_before_anything_loads(
    tmp_path: Path, nested: bool
) -> None:
    model, opt = trained()
    state = {"model": model, "optim": opt}
    save(tmp_path, {"train": state} if nested else state)
    torch.manual_seed(1)
    target = net()
    fewer = torch.optim.Adam(list(target.parameters())[:2], lr=0.01)
    before = tensors(target)
    into = {"model": target, "optim": fewer}
    with pytest.raises(StateMismatchError, match=r"2 parameters in 1 group.*snapshot's 6") as info:
        restore(tmp_path, {"train": into} if nested else into)
    assert info.value.key == ("train/optim" if nested else "optim")
    assert info.value.unexpected == [2, 3, 4, 5] and info.value.missing == []
    assert unchanged(before, target)  # the model in the same into= was not overwritten
    assert fewer.state_dict()["state"] == {}


def test_parameter_groups_of_other_sizes_are_refused(tmp_path: Path) -> None:
    model, opt = trained()
    save(tmp_path, {"model": model, "optim": opt})
    target = net()
    params = list(target.parameters())
    split = torch.optim.Adam([{"params": params[:3]}, {"params": params[3:]}], lr=0.01)
    before = tensors(target)
    with pytest.raises(StateMismatchError, match=r"sizes \[3, 3\].*sizes \[6\]") as info:
        restore(tmp_path, {"model": target, "optim": split})
    assert info.value.missing == [] and info.value.unexpected == []  # same count, other groups
    assert unchanged(before, target)


def test_state_of_another_shape_is_refused(tmp_path: Path) -> None:
    # as many parameters, other shapes: torch's load_state_dict would accept the state,
    # and the next step() would fail on it
    model, opt = trained()
    save(tmp_path, {"model": model, "optim": opt})
    other = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.Linear(8, 2))
    fresh = torch.optim.Adam(other.parameters(), lr=0.01)
    shapes = r"'exp_avg' of parameter 0.*\[16, 4\].*\[8, 4\]"
    with pytest.raises(StateMismatchError, match=shapes) as info:
        restore(tmp_path, {"optim": fresh})
    assert info.value.key == "optim/state/0/exp_avg"
    assert fresh.state_dict()["state"] == {}


def test_a_plain_mapping_saved_where_an_optimizer_is_restored_is_refused(tmp_path: Path) -> None:
    save(tmp_path, {"optim": {"lr": 0.1, "w": torch.ones(3)}})
    opt = torch.optim.SGD(net().parameters(), lr=0.5)
    with pytest.raises(StateMismatchError, match="not an optimizer's state dict") as info:
        restore(tmp_path, {"optim": opt})
    assert info.value.missing == ["state", "param_groups"]
    assert opt.param_groups[0]["lr"] == 0.5


def test_a_lazy_restore_refuses_the_guarded_optimizer_before_anything_loads(
    tmp_path: Path,
) -> None:
    model, opt = trained()
    save(tmp_path, {"model": model, "optim": opt})
    target = net()
    fewer = torch.optim.Adam(list(target.parameters())[:4], lr=0.01)
    before = tensors(target)
    with lazyckpt.SyncCheckpointer([FileTier(tmp_path, readonly=True)]) as ckpt:
        ckpt.guard(fewer)
        with pytest.raises(StateMismatchError, match="4 parameters"):
            ckpt.restore(step=0, into={"model": target, "optim": fewer}, lazy=True)
    assert unchanged(before, target)


@pytest.mark.parametrize("opt_cls", [torch.optim.SGD, torch.optim.AdamW, torch.optim.Adafactor])
def test_a_fitting_optimizer_still_restores_bit_for_bit(
    tmp_path: Path, opt_cls: Callable[..., torch.optim.Optimizer]
) -> None:
    # Adafactor's factored statistics have other shapes than their parameters: not refused
    model, opt = trained(opt_cls)
    save(tmp_path, {"model": model, "optim": opt})
    target = net()
    fresh = opt_cls(target.parameters(), lr=0.01)
    restore(tmp_path, {"model": target, "optim": fresh})
    assert unchanged(tensors(opt), fresh) and unchanged(tensors(model), target)


class Refuses:
    """A Stateful object whose load_state_dict raises, as a library's may."""

    def __init__(self) -> None:
        self.loaded: dict[str, Any] | None = None

    def state_dict(self) -> dict[str, Any]:
        return {"version": 2}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        raise RuntimeError(f"unsupported version {state['version']}")


class Loads:
    def __init__(self) -> None:
        self.loaded: dict[str, Any] | None = None

    def state_dict(self) -> dict[str, Any]:
        return {"n": 7}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.loaded = dict(state)


def test_a_stateful_that_refuses_its_state_raises_a_typed_error_with_the_cause(
    tmp_path: Path,
) -> None:
    save(tmp_path, {"first": Loads(), "sched": Refuses(), "w": torch.ones(3)})
    first, w = Loads(), torch.zeros(3)
    refused = r"Refuses\.load_state_dict refused.*'sched'"
    with pytest.raises(StateMismatchError, match=refused) as info:
        restore(tmp_path, {"first": first, "sched": Refuses(), "w": w})
    assert isinstance(info.value.__cause__, RuntimeError)
    assert "unsupported version 2" in str(info.value)
    assert info.value.key == "sched"
    # what the docs say of a failure this late: the tensors were filled, the entries
    # before it (in the snapshot's order) loaded
    assert torch.equal(w, torch.ones(3)) and first.loaded == {"n": 7}


class OwnFormat(torch.optim.SGD):
    """An optimizer with a state dict format of its own, as torchtitan's container has."""

    def state_dict(self) -> dict[str, Any]:
        return {"flat.lr": self.param_groups[0]["lr"]}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.param_groups[0]["lr"] = state_dict["flat.lr"]


def test_an_optimizer_with_its_own_state_dict_format_is_left_to_its_load_state_dict(
    tmp_path: Path,
) -> None:
    save(tmp_path, {"optim": OwnFormat(net().parameters(), lr=0.25)})
    target = OwnFormat(list(net().parameters())[:1], lr=0.5)  # fewer parameters: its business
    restore(tmp_path, {"optim": target})
    assert target.param_groups[0]["lr"] == 0.25
