"""What a framework integration deletes when a run saves a step that another run left in the
store (a resume from an earlier checkpoint, a new run on the same tiers): the rule the
Hugging Face and Lightning integrations share (docs/integrations.md, "Resume from an
earlier step")."""

from __future__ import annotations

from collections.abc import Collection, Sequence

from .._errors import ConfigurationError

__all__ = ["abandoned_steps"]


def abandoned_steps(
    step: int, stored: Sequence[int], written: Collection[int], resumed: int | None
) -> list[int]:
    """The stored steps that a save of ``step`` replaces: none if ``step`` is newer than all
    of ``stored`` (sorted); else the steps of the other timeline from ``step`` on, and from
    the step this run ``resumed`` from onwards when it resumed through lazyckpt (a
    rollback's whole abandoned future). ``written``: the steps this run saved.

    Raises:
        ConfigurationError: this run already saved a step after ``step`` (the global step
            went back within one run).
    """
    later = sorted(s for s in written if s > step)
    if later:
        raise ConfigurationError(
            f"global step {step} comes after step {later[-1]}, which this run already "
            "saved; lazyckpt steps only increase within a run"
        )
    if not stored or step > stored[-1]:
        return []
    floor = step
    if resumed is not None and resumed < step:
        floor = resumed + 1
    return [s for s in stored if s >= floor]
