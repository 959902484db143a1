"""The shard state machine: property tests over every chain of tiers."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from lazyckpt import ConfigurationError, InvalidTransitionError, ShardState, TierLevel
from lazyckpt._tiering.states import (
    RESTORE_TABLE,
    Event,
    RestoreEvent,
    RestoreState,
    advance,
    advance_restore,
    build_table,
)

# where a shard is once durable on a tier of each level: the oracle, written out
DURABLE = {
    TierLevel.LOCAL: ShardState.ON_LOCAL,
    TierLevel.PEER: ShardState.ON_PEER,
    TierLevel.PFS: ShardState.ON_PFS,
}

CHAINS = [
    [],
    [TierLevel.LOCAL],
    [TierLevel.PFS],
    [TierLevel.LOCAL, TierLevel.PFS],
    [TierLevel.LOCAL, TierLevel.PEER, TierLevel.PFS],
    [TierLevel.PEER, TierLevel.PFS],
    [TierLevel.LOCAL, TierLevel.PEER],
]


@pytest.mark.parametrize("levels", CHAINS)
def test_happy_path_reaches_the_terminal_state(levels: list[TierLevel]) -> None:
    table = build_table(levels)
    state = advance(table, ShardState.CAPTURED, Event.CAPTURE_DONE)
    assert state is ShardState.COPIED
    state = advance(table, state, Event.CHECKSUM_DONE)
    assert state is ShardState.ON_HOST
    for level in levels:
        state = advance(table, state, Event.PERSISTED)
        assert state is DURABLE[level]
    assert state is table.terminal
    with pytest.raises(InvalidTransitionError):
        advance(table, state, Event.PERSISTED)


@pytest.mark.parametrize("levels", CHAINS)
def test_no_tier_takes_a_shard_before_its_checksum(levels: list[TierLevel]) -> None:
    """A copied shard has no checksum yet: it can be checksummed or fail, nothing else; the
    checksum comes only after the copy, and only once."""
    table = build_table(levels)
    assert {e for (s, e) in table.transitions if s is ShardState.COPIED} == {
        Event.CHECKSUM_DONE,
        Event.FAIL,
    }
    assert advance(table, ShardState.COPIED, Event.FAIL) is ShardState.FAILED
    for event in (Event.PERSISTED, Event.CAPTURE_DONE):
        with pytest.raises(InvalidTransitionError):
            advance(table, ShardState.COPIED, event)
    with pytest.raises(InvalidTransitionError):
        advance(table, ShardState.CAPTURED, Event.CHECKSUM_DONE)
    with pytest.raises(InvalidTransitionError):
        advance(table, ShardState.ON_HOST, Event.CHECKSUM_DONE)
    # every edge into a durable state starts from a state the checksum was computed in
    durable = {DURABLE[lv] for lv in levels}
    for (source, _event), target in table.transitions.items():
        if target in durable:
            assert source not in (ShardState.CAPTURED, ShardState.COPIED)


def test_host_to_pfs_skips_local() -> None:
    table = build_table([TierLevel.PFS])
    assert advance(table, ShardState.ON_HOST, Event.PERSISTED) is ShardState.ON_PFS
    assert (ShardState.ON_LOCAL, Event.PERSISTED) not in table.transitions


@pytest.mark.parametrize(
    "levels",
    [
        [TierLevel.PFS, TierLevel.LOCAL],
        [TierLevel.LOCAL, TierLevel.LOCAL],
        [TierLevel.HOST],
        [TierLevel.PFS, TierLevel.PEER],
        [TierLevel.PEER, TierLevel.LOCAL],
    ],
)
def test_bad_chains_are_refused(levels: list[TierLevel]) -> None:
    with pytest.raises(ConfigurationError):
        build_table(levels)


@given(
    levels=st.sampled_from(CHAINS),
    events=st.lists(st.sampled_from(list(Event)), max_size=12),
)
def test_random_event_sequences_respect_the_table(
    levels: list[TierLevel], events: list[Event]
) -> None:
    """Whatever happens, a shard only moves along table edges, FAILED and the terminal
    state are absorbing, and states only move forward along the chain."""
    table = build_table(levels)
    order = [ShardState.CAPTURED, ShardState.COPIED, ShardState.ON_HOST] + [DURABLE[lv] for lv in levels]
    state = ShardState.CAPTURED
    for event in events:
        try:
            new = advance(table, state, event)
        except InvalidTransitionError:
            assert (state, event) not in table.transitions
            assert state in (ShardState.FAILED, table.terminal) or event is not Event.FAIL
            continue
        assert table.transitions[(state, event)] is new
        if new is not ShardState.FAILED:
            assert order.index(new) == order.index(state) + 1
        state = new
    assert state in order or state is ShardState.FAILED


@given(st.lists(st.sampled_from(list(RestoreEvent)), max_size=10))
def test_restore_table(events: list[RestoreEvent]) -> None:
    state = RestoreState.PENDING
    for event in events:
        try:
            state = advance_restore(state, event)
        except InvalidTransitionError:
            assert (state, event) not in RESTORE_TABLE
    assert state in RestoreState


def test_state_module_does_no_io() -> None:
    import ast
    import inspect

    import lazyckpt._tiering.states as mod

    tree = ast.parse(inspect.getsource(mod))
    imported = {
        alias.name.split(".")[0]
        for node in ast.walk(tree)
        if isinstance(node, ast.Import | ast.ImportFrom)
        for alias in node.names
    }
    imported |= {
        (node.module or "").split(".")[0]
        for node in ast.walk(tree)
        if isinstance(node, ast.ImportFrom)
    }
    assert not imported & {"os", "asyncio", "io", "socket", "pathlib", "torch"}
    assert not any(isinstance(n, ast.Await | ast.AsyncFunctionDef) for n in ast.walk(tree))
