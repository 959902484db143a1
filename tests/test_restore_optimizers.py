"""restore(into=...) with optimizers that do not fit the snapshot's: refused with a
StateMismatchError before anything is read, so nothing is loaded, on the same world size
or another; state keyed by other ids than torch's indices (parameter names) mapped to the
parameters as torch's load_state_dict maps it; and what a Stateful object's own
load_state_dict still refuses is a StateMismatchError with its error as the cause."""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import lazyckpt
from lazyckpt import StateMismatchError
from tiers import FileTier

sys.path.insert(0, str(Path(__file__).parent))
from helpers.ranks import launch_ranks


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


# State keyed by other ids than torch's 0..n-1: torch's load_state_dict maps the snapshot's
# state to the parameters through the ids its param_groups list, group by group, in order.


def by_name(model: nn.Module, opt: torch.optim.Optimizer) -> dict[str, Any]:
    """``opt``'s state dict keyed by parameter names, as get_optimizer_state_dict keys it."""
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    state = get_optimizer_state_dict(model, opt)
    assert set(state["state"]) == {n for n, _ in model.named_parameters()}
    return dict(state)


def test_state_keyed_by_parameter_name_restores_bit_for_bit(tmp_path: Path) -> None:
    model, opt = trained()
    save(tmp_path, {"model": model, "optim": by_name(model, opt)})
    target = net()
    fresh = torch.optim.Adam(target.parameters(), lr=0.01)
    restore(tmp_path, {"model": target, "optim": fresh})
    assert unchanged(tensors(opt), fresh) and unchanged(tensors(model), target)


def test_hand_built_ids_map_through_the_groups_by_position(tmp_path: Path) -> None:
    # two groups, ids that are neither 0..n-1 nor in order, the state listed backwards
    model, opt = trained()
    params = list(model.parameters())
    saved = opt.state_dict()
    ids = [f"p{9 - i}" for i in range(len(params))]
    state = {ids[i]: saved["state"][i] for i in reversed(range(len(params)))}
    groups = [
        {**saved["param_groups"][0], "params": ids[:2]},
        {**saved["param_groups"][0], "params": ids[2:]},
    ]
    save(tmp_path, {"optim": {"state": state, "param_groups": groups}})
    target = net()
    tparams = list(target.parameters())
    fresh = torch.optim.Adam([{"params": tparams[:2]}, {"params": tparams[2:]}], lr=0.5)
    restore(tmp_path, {"optim": fresh})
    assert unchanged(tensors(opt), fresh)
    assert [g["lr"] for g in fresh.param_groups] == [0.01, 0.01]


def test_name_keyed_state_for_fewer_parameters_is_refused_naming_them(tmp_path: Path) -> None:
    model, opt = trained()
    save(tmp_path, {"model": model, "optim": by_name(model, opt)})
    target = net()
    fewer = torch.optim.Adam(list(target.parameters())[:4], lr=0.01)
    before = tensors(target)
    with pytest.raises(StateMismatchError, match="4 parameters in 1 group") as info:
        restore(tmp_path, {"model": target, "optim": fewer})
    assert info.value.unexpected == ["2.weight", "2.bias"] and info.value.missing == []
    assert unchanged(before, target) and fewer.state_dict()["state"] == {}


def test_name_keyed_state_of_another_shape_is_refused(tmp_path: Path) -> None:
    model, opt = trained()
    save(tmp_path, {"optim": by_name(model, opt)})
    other = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.Linear(8, 2))
    fresh = torch.optim.Adam(other.parameters(), lr=0.01)
    with pytest.raises(StateMismatchError, match=r"'0\.weight'.*\[16, 4\].*\[8, 4\]") as info:
        restore(tmp_path, {"optim": fresh})
    assert info.value.key == "optim/state/0.weight/exp_avg"
    assert fresh.state_dict()["state"] == {}


def test_state_for_an_id_the_groups_do_not_list_is_refused(tmp_path: Path) -> None:
    model, opt = trained()
    saved = by_name(model, opt)
    saved["state"]["extra"] = saved["state"].pop("2.bias")
    save(tmp_path, {"optim": saved})
    fresh = torch.optim.Adam(net().parameters(), lr=0.01)
    with pytest.raises(StateMismatchError, match="'extra', which the snapshot's param_groups"):
        restore(tmp_path, {"optim": fresh})
    assert fresh.state_dict()["state"] == {}


# A restore onto another world size (here: one process, a step two ranks saved) checks the
# optimizers too, before anything is read, against the saved tensors' global shapes.


def two_layers() -> nn.Sequential:
    """The model the DTensor worker saves (sharded with FSDP2), unsharded."""
    return nn.Sequential(nn.Linear(12, 40), nn.ReLU(), nn.Linear(40, 5))


@pytest.fixture(scope="module")
def saved_on_two(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Any]]:
    base = tmp_path_factory.mktemp("two-ranks")
    root, out = base / "ckpt", base / "out"
    out.mkdir()
    worker = Path(__file__).parent / "helpers" / "dtensor_worker.py"
    launch_ranks(worker, ["save", str(root), str(out)], 2, timeout=120)
    return root, torch.load(out / "expected.pt")


def restore_step_one(root: Path, into: Any) -> None:
    with lazyckpt.SyncCheckpointer([FileTier(root, readonly=True)]) as ckpt:
        ckpt.restore(1, into=into)


@pytest.mark.slow
def test_resharding_restores_a_fitting_optimizer(saved_on_two: Any) -> None:
    root, expected = saved_on_two
    model = two_layers()
    opt = torch.optim.Adam(model.parameters(), lr=0.1)
    restore_step_one(root, {"model": model, "optim": opt})
    got = {
        f"optim/{i}/{name}": v
        for i, s in opt.state_dict()["state"].items()
        for name, v in s.items()
    }
    assert got.keys() == {k for k in expected if k.startswith("optim/")}
    assert all(torch.equal(v, expected[k]) for k, v in got.items())


@pytest.mark.slow
def test_resharding_refuses_an_optimizer_over_fewer_parameters_before_reading(
    saved_on_two: Any,
) -> None:
    root, _ = saved_on_two
    model = two_layers()
    fewer = torch.optim.Adam(list(model.parameters())[:2], lr=0.1)
    before = tensors(model)
    with pytest.raises(StateMismatchError, match=r"2 parameters in 1 group.*snapshot's 4") as info:
        restore_step_one(root, {"model": model, "optim": fewer})
    assert info.value.key == "optim" and info.value.unexpected == [2, 3]
    assert unchanged(before, model) and fewer.state_dict()["state"] == {}


@pytest.mark.slow
def test_resharding_refuses_optimizer_state_of_another_global_shape(saved_on_two: Any) -> None:
    root, _ = saved_on_two
    other = nn.Sequential(nn.Linear(12, 20), nn.ReLU(), nn.Linear(20, 5))
    fresh = torch.optim.Adam(other.parameters(), lr=0.1)
    with pytest.raises(StateMismatchError, match=r"\[40, 12\].*\[20, 12\]") as info:
        restore_step_one(root, {"optim": fresh})
    assert info.value.key == "optim/state/0/exp_avg"
    assert fresh.state_dict()["state"] == {}
