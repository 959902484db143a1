"""The optimizers a guard watches: finding the torch optimizer behind a wrapper, moving the
wait behind a step's closure, and telling whether an optimizer's shape changed."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from ._errors import ConfigurationError

__all__ = ["hook_installed", "optimizer_shape", "unwrap_optimizer", "wrap_closure"]


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
