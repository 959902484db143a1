"""The optimizers a guard watches: finding the torch optimizer behind a wrapper, moving the
wait behind a step's closure, and telling whether an optimizer's shape changed. And the
optimizers a restore loads into: checking, before anything is read, that a snapshot's
optimizer state fits the target optimizer (:func:`check_optimizer_state`)."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from .._errors import ConfigurationError, StateMismatchError

__all__ = [
    "check_optimizer_state",
    "hook_installed",
    "optimizer_shape",
    "unwrap_optimizer",
    "wrap_closure",
]

# torch's optimizers whose per-parameter state tensors all have their parameter's shape,
# but for 0-d ones (step counts, ASGD's eta and mu). Only the exact classes: a subclass, or
# an optimizer not listed (Adafactor's factored row and column statistics, LBFGS's flat
# history), may keep state of other shapes.
_SAME_SHAPE_STATE: tuple[type[torch.optim.Optimizer], ...] = tuple(
    cls
    for cls in (
        getattr(torch.optim, name, None)
        for name in (
            "SGD", "Adam", "AdamW", "Adamax", "NAdam", "RAdam", "Adagrad", "Adadelta",
            "RMSprop", "Rprop", "ASGD", "SparseAdam",
        )
    )
    if isinstance(cls, type)
)


def optimizer_shape(opt: torch.optim.Optimizer) -> tuple[int, ...]:
    state = opt.state
    return (
        id(opt),
        id(state),
        id(opt.param_groups),
        sum(len(g["params"]) for g in opt.param_groups),
        len(state),
        sum(len(v) for v in state.values()),
    )


def hook_installed(opt: torch.optim.Optimizer, handle: Any) -> bool:
    """Is the guard's hook still on ``opt`` (the user may have removed it)?"""
    return handle.id in getattr(opt, "_optimizer_step_pre_hooks", {})


def unwrap_optimizer(obj: Any) -> torch.optim.Optimizer:
    """The torch optimizer behind ``obj``: itself, or at the end of its ``.optimizer``
    chain (accelerate's ``AcceleratedOptimizer``, Lightning's ``LightningOptimizer``,
    DeepSpeed's and similar wrappers, which all call the inner optimizer's ``step()``)."""
    found = obj
    for _ in range(16):
        inner = getattr(found, "optimizer", None)
        if inner is None or inner is found:
            break
        found = inner
    if isinstance(found, torch.optim.Optimizer) and hasattr(found, "register_step_pre_hook"):
        return found
    what = type(obj).__qualname__
    hint = (
        " For a GradScaler, pass the optimizer you give to scaler.step(optimizer)."
        if "Scaler" in what
        else ""
    )
    raise ConfigurationError(
        f"guard() needs the torch.optim.Optimizer whose step() updates the state, or a "
        f"wrapper with an .optimizer attribute leading to one (accelerate's "
        f"AcceleratedOptimizer, Lightning's LightningOptimizer); got {what}.{hint}"
    )


def wrap_closure(
    args: tuple[Any, ...], kwargs: dict[str, Any], wait: Callable[[], None]
) -> tuple[tuple[Any, ...], dict[str, Any]] | None:
    """With a closure (LBFGS; Lightning runs forward and backward in one), the step pre-hook
    fires before the forward pass: waiting there would end the lazy window before it began.
    The closure is wrapped instead, so the wait happens after it returns, before the
    optimizer changes anything (every torch optimizer calls its closure first)."""
    # the hook sees step()'s arguments with the optimizer itself first
    first = 1 if args and isinstance(args[0], torch.optim.Optimizer) else 0
    if len(args) > first and callable(args[first]):
        fn, where = args[first], "args"
    elif callable(kwargs.get("closure")):
        fn, where = kwargs["closure"], "kwargs"
    else:
        return None

    def closure() -> Any:
        loss = fn()
        wait()
        return loss

    if where == "args":
        return (*args[:first], closure, *args[first + 1 :]), kwargs
    return args, {**kwargs, "closure": closure}


def check_optimizer_state(opt: torch.optim.Optimizer, saved: Any, key: str) -> None:
    """Raise :class:`StateMismatchError` where the snapshot's state ``saved`` of the
    optimizer at ``key`` (its state dict, tensors standing in as anything with a
    ``.shape``, such as their manifest entries) does not fit ``opt``: not an optimizer's
    state dict, another number of parameter groups or of parameters in a group (which
    torch's ``load_state_dict`` refuses only after the rest of ``into=`` was loaded), or,
    for torch's own optimizers, a state tensor whose shape is not its parameter's (which
    ``load_state_dict`` accepts and the next ``step()`` fails on, or silently broadcasts).
    The snapshot's state is matched to ``opt``'s parameters as ``load_state_dict`` matches
    it: through the ids the snapshot's ``param_groups`` list, group by group and in order,
    whatever those ids are (indices from torch's ``state_dict``, parameter names from
    ``get_optimizer_state_dict``).

    Only an optimizer that keeps torch's own ``state_dict``/``load_state_dict`` is
    checked: one that overrides them (torchtitan's ``OptimizersContainer``, wrappers that
    delegate to an inner optimizer) has a format of its own, which its ``load_state_dict``
    checks. Called before anything is read, so a mismatch loads nothing."""
    if not has_torch_state_dict(opt):
        return
    what = f"optimizer {type(opt).__qualname__} at {key!r}"
    fix = (
        "Build the optimizer over the same parameters, in the same parameter groups, as when "
        "the snapshot was taken, or restore without into= and load what matches."
    )
    if not isinstance(saved, Mapping) or not {"state", "param_groups"} <= saved.keys():
        have = list(saved) if isinstance(saved, Mapping) else []
        raise StateMismatchError(
            f"restore(into=...): the snapshot's entry for the {what} is not an optimizer's "
            f"state dict (it has keys {have!r}, an optimizer's has 'state' and "
            f"'param_groups'). {fix}",
            key=key,
            missing=[k for k in ("state", "param_groups") if k not in have],
            unexpected=[k for k in have if k not in ("state", "param_groups")],
        )
    groups, state = saved["param_groups"], saved["state"]
    sizes = _group_sizes(groups)
    if sizes is None or not isinstance(state, Mapping):
        raise StateMismatchError(
            f"restore(into=...): the snapshot's state of the {what} is not a torch optimizer "
            f"state dict ('param_groups' must be a list of groups with 'params', 'state' a "
            f"mapping). {fix}",
            key=key,
            missing=[],
            unexpected=[],
        )
    want = [len(g["params"]) for g in opt.param_groups]
    if sizes != want:
        saved_n, want_n = sum(sizes), sum(want)
        saved_ids = [i for g in groups for i in g["params"]]
        raise StateMismatchError(
            f"restore(into=...): the {what} has {want_n} parameters in {len(want)} "
            f"group(s) of sizes {want}, the snapshot's {saved_n} in {len(sizes)} of sizes "
            f"{sizes}; nothing was loaded. {fix}",
            key=key,
            # the target's parameters by their position, as torch numbers them; the
            # snapshot's by the ids its param_groups give them
            missing=list(range(saved_n, want_n)),
            unexpected=saved_ids[want_n:],
        )
    if type(opt) not in _SAME_SHAPE_STATE:
        return
    # as torch's load_state_dict maps them: the j-th id in the snapshot's group i is the
    # j-th parameter of the target's group i, whatever the ids are (indices as torch's
    # state_dict gives them, parameter names as get_optimizer_state_dict gives them)
    by_id: dict[Any, torch.Tensor] = {}
    for saved_group, group in zip(groups, opt.param_groups, strict=True):
        for saved_id, param in zip(saved_group["params"], group["params"], strict=True):
            try:
                by_id[saved_id] = param
            except TypeError:  # an id torch could not map either: left to load_state_dict
                return
    for saved_id, entry in state.items():
        param = by_id.get(saved_id)
        if param is None:
            raise StateMismatchError(
                f"restore(into=...): the snapshot's state of the {what} is for parameter "
                f"{saved_id!r}, which the snapshot's param_groups do not list (they list "
                f"{_abbrev(list(by_id))}); nothing was loaded. {fix}",
                key=key,
                missing=[],
                unexpected=[saved_id],
            )
        if not isinstance(entry, Mapping):
            continue
        param_shape = tuple(param.shape)
        for name, value in entry.items():
            shape = _shape_of(value)
            if shape is not None and shape and shape != param_shape:
                raise StateMismatchError(
                    f"restore(into=...): the snapshot's {name!r} of parameter {saved_id!r} "
                    f"of the {what} has shape {list(shape)}, the parameter "
                    f"{list(param_shape)}; nothing was loaded. {fix}",
                    key=f"{key}/state/{saved_id}/{name}",
                    missing=[],
                    unexpected=[],
                )


def has_torch_state_dict(opt: torch.optim.Optimizer) -> bool:
    """Does ``opt`` save and load torch's optimizer state dict format (``state`` by
    parameter index, ``param_groups``), not one of its own?"""
    cls, base = type(opt), torch.optim.Optimizer
    return cls.state_dict is base.state_dict and cls.load_state_dict is base.load_state_dict


def _group_sizes(groups: Any) -> list[int] | None:
    if not isinstance(groups, Sequence) or isinstance(groups, str | bytes):
        return None
    sizes = []
    for group in groups:
        params = group.get("params") if isinstance(group, Mapping) else None
        if not isinstance(params, Sequence) or isinstance(params, str | bytes):
            return None
        sizes.append(len(params))
    return sizes


def _shape_of(value: Any) -> tuple[int, ...] | None:
    """The (global: a DTensor's, not its chunk's) shape a snapshot's tensor stands for."""
    shape = getattr(value, "global_shape", None) or getattr(value, "shape", None)
    if shape is None:
        return None
    return tuple(int(n) for n in shape)


def _abbrev(ids: list[Any]) -> str:
    """``ids`` for a message: the first few and how many more."""
    shown = ", ".join(repr(i) for i in ids[:6])
    return f"[{shown}, ... {len(ids) - 6} more]" if len(ids) > 6 else f"[{shown}]"
