"""The life of one reservation on a decode worker, as an explicit state machine.

The decode worker owns this state; the others report events to it. The prefill worker reports
what it knows of its own writes (it wrote, committed, its pending writes landed, it gave up);
the router reports that it starts decoding or is done with the request; timers report a lease
or a fence running out. ``transition`` is the whole rule, a pure function, tested event by
event in every state.

    RESERVED ──write──▶ WRITING ──commit──▶ LANDED ──decode──▶ DECODING ──release──▶ RELEASED
       │ │ commit(pending)                     ▲                     ▲
       │ └──▶ COMMITTED_PENDING ──writes_landed──┘                     │
       └──────────────────────── prefill_here ─────────────────────────┘
    released while writes may still land ──▶ FENCED ──writes_landed / abandoned / timeout──▶ RELEASED

One-sided engines (cuda_ipc, nixl) write into the pool without passing through us, so a
reservation RESERVED on a worker that offers one may be being written to unseen: released, its
pages are FENCED, held back until the sender says its writes ended, or a lease later.

A prompt short enough to prefill on the decode worker itself (the router's
--local-prefill-max-tokens) goes from RESERVED straight to DECODING: the decode loop computes its
KV into the reserved pages, and no sender ever writes them.
"""
from __future__ import annotations

import enum


class State(enum.Enum):
    RESERVED = "reserved"                     # pages held, the KV target handed out
    WRITING = "writing"                       # KV arriving through us (two-sided engines)
    COMMITTED_PENDING = "committed_pending"   # committed; one-sided writes may still land
    LANDED = "landed"                         # the prompt's KV is whole in the pool
    DECODING = "decoding"                     # the decode loop owns the pages
    FENCED = "fenced"                         # released, but writes may land: pages held back
    RELEASED = "released"                     # pages back in the pool (final)


class Event(enum.Enum):
    WRITE = "write"                           # a chunk of KV arrived (two-sided engines)
    COMMIT = "commit"                         # the sender: the prompt's KV is all in place
    COMMIT_PENDING = "commit_pending"         # the sender: all enqueued, some still in flight
    WRITES_LANDED = "writes_landed"           # the sender: its pending writes have landed
    WRITES_ABANDONED = "writes_abandoned"     # the sender gives up and writes no more
    DECODE = "decode"                         # the router starts decoding
    PREFILL_HERE = "prefill_here"             # the router starts it here, prompt and all
    RELEASE = "release"                       # the router or the decode loop is done with it
    LEASE_EXPIRED = "lease_expired"           # not decoding a lease after the last renewal
    FENCE_EXPIRED = "fence_expired"           # a fence held a lease long: the sender is gone


class IllegalTransition(Exception):
    def __init__(self, state: State, event: Event) -> None:
        super().__init__(f"cannot {event.value} a reservation that is {state.value}")
        self.state, self.event = state, event


S, E = State, Event
# Releasing a reservation nobody has written to yet: FENCED where a one-sided engine may be
# writing it unseen, else RELEASED (resolved in ``transition``).
_RELEASE_UNSEEN = "release_unseen"

TRANSITIONS: dict[tuple[State, Event], State | str] = {
    (S.RESERVED, E.WRITE): S.WRITING,
    (S.RESERVED, E.COMMIT): S.LANDED,
    (S.RESERVED, E.COMMIT_PENDING): S.COMMITTED_PENDING,
    (S.RESERVED, E.WRITES_ABANDONED): S.RELEASED,
    (S.RESERVED, E.RELEASE): _RELEASE_UNSEEN,
    (S.RESERVED, E.LEASE_EXPIRED): _RELEASE_UNSEEN,
    (S.RESERVED, E.PREFILL_HERE): S.DECODING,

    # Two-sided writes pass through this process: once released, none can land.
    (S.WRITING, E.WRITE): S.WRITING,
    (S.WRITING, E.COMMIT): S.LANDED,
    (S.WRITING, E.WRITES_ABANDONED): S.RELEASED,
    (S.WRITING, E.RELEASE): S.RELEASED,
    (S.WRITING, E.LEASE_EXPIRED): S.RELEASED,

    (S.COMMITTED_PENDING, E.WRITES_LANDED): S.LANDED,
    (S.COMMITTED_PENDING, E.WRITES_ABANDONED): S.RELEASED,
    (S.COMMITTED_PENDING, E.RELEASE): S.FENCED,
    (S.COMMITTED_PENDING, E.LEASE_EXPIRED): S.FENCED,

    (S.LANDED, E.DECODE): S.DECODING,
    (S.LANDED, E.WRITES_ABANDONED): S.RELEASED,   # the prefill failed after landing: no Decode
    (S.LANDED, E.RELEASE): S.RELEASED,
    (S.LANDED, E.LEASE_EXPIRED): S.RELEASED,

    (S.DECODING, E.WRITES_ABANDONED): S.DECODING,  # its writes ended long ago
    (S.DECODING, E.RELEASE): S.RELEASED,

    (S.FENCED, E.WRITES_LANDED): S.RELEASED,
    (S.FENCED, E.WRITES_ABANDONED): S.RELEASED,
    (S.FENCED, E.FENCE_EXPIRED): S.RELEASED,
    (S.FENCED, E.RELEASE): S.FENCED,               # released twice: still fenced, once

    (S.RELEASED, E.WRITES_ABANDONED): S.RELEASED,  # Abandon and Release are idempotent
    (S.RELEASED, E.RELEASE): S.RELEASED,
}


def transition(state: State, event: Event, unseen_writes_possible: bool) -> State:
    """The state after ``event``; raises IllegalTransition for an event the protocol forbids
    in ``state``. ``unseen_writes_possible``: this worker offers a one-sided engine."""
    after = TRANSITIONS.get((state, event))
    if after is None:
        raise IllegalTransition(state, event)
    if after == _RELEASE_UNSEEN:
        return S.FENCED if unseen_writes_possible else S.RELEASED
    return after  # type: ignore[return-value]


# States a lease runs in: the request is not decoding yet, and its router or prefill may be gone.
LEASED = frozenset({S.RESERVED, S.WRITING, S.COMMITTED_PENDING, S.LANDED})
# States in which a prefill worker is still computing the prompt's KV (or copying it in).
PREFILLING = frozenset({S.RESERVED, S.WRITING, S.COMMITTED_PENDING})
