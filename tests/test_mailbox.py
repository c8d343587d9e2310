"""The node's mailbox: a stage's get waits for its own tensor, woken by that tensor's put,
by a drop (then it stops), or by its timeout."""
from __future__ import annotations

import threading

import pytest
import torch

from fedpipe.node.mailbox import Mailbox, Stopped
from fedpipe.spec import Kind

pytestmark = pytest.mark.timeout(60)


def taking(box: Mailbox, step: int, stopped=lambda: False, timeout=None):
    """A thread getting the activation of ``step``; what it got or raised, once joined."""
    out: list = []

    def run() -> None:
        try:
            out.append(box.get("s", Kind.ACTIVATION, step, 0, stopped, timeout))
        except (Stopped, TimeoutError) as e:
            out.append(e)
    th = threading.Thread(target=run, daemon=True)
    th.start()
    return th, out


def wait_waiting(box: Mailbox, count: int) -> None:
    """Until ``count`` gets wait in the mailbox (they registered for their tensor)."""
    for _ in range(2000):
        with box._lock:
            if sum(map(len, box._wanted.values())) == count:
                return
        threading.Event().wait(0.005)
    raise AssertionError(f"{count} gets never waited")


def test_a_get_is_given_its_own_tensor_and_others_wait_on():
    box = Mailbox(4, bounded=())
    first, got1 = taking(box, 1)
    second, got2 = taking(box, 2)
    wait_waiting(box, 2)
    t1, t2 = torch.ones(3), torch.zeros(3)
    box.put("s", Kind.GRADIENT, 1, 0, torch.full((1,), 9.0), 5)  # another kind's: no one's
    box.put("s", Kind.ACTIVATION, 2, 0, t2, 7)
    second.join(10)
    assert got2 and got2[0][0] is t2 and got2[0][1] == 7
    assert first.is_alive() and not got1  # step 1's get still waits for its own
    box.put("s", Kind.ACTIVATION, 1, 0, t1, 6)
    first.join(10)
    assert got1[0][0] is t1 and got1[0][1] == 6
    assert box._wanted == {} and box.waiting("s") == 1  # the gradient


def test_a_drop_wakes_a_waiting_get_which_stops_and_a_timeout_ends_one():
    box = Mailbox(4, bounded=())
    stop = threading.Event()
    th, got = taking(box, 0, stopped=stop.is_set)
    wait_waiting(box, 1)
    stop.set()
    box.drop(lambda slot: slot == "s")
    th.join(10)
    assert isinstance(got[0], Stopped) and box._wanted == {}
    th, got = taking(box, 3, timeout=0.2)
    th.join(10)
    assert isinstance(got[0], TimeoutError) and "step 3 microbatch 0" in str(got[0])
    assert box._wanted == {}


def test_an_input_sent_again_after_its_step_was_taken_is_a_duplicate_not_a_new_tensor():
    """A client resends an input whose link broke after it came (its acknowledgement lost):
    once the stage took that microbatch of that step, the resend is refused (ALREADY_EXISTS
    for the client, which counts it delivered), not kept for a get that will not come."""
    from fedpipe.node.mailbox import Duplicate

    box = Mailbox(2, (Kind.INPUT,))
    t = torch.zeros(2)
    box.put_all("s", Kind.INPUT, 0, 0, [t, t], 4)
    box.get("s", Kind.INPUT, 0, 0, lambda: False)  # microbatch 0 taken, 1 waits
    with pytest.raises(Duplicate, match="for step 0 microbatch 0: the stage already took"):
        box.put_all("s", Kind.INPUT, 0, 0, [t, t], 4)  # all or none
    box.get("s", Kind.INPUT, 0, 1, lambda: False)
    with pytest.raises(Duplicate, match="already took step 0"):
        box.put("s", Kind.INPUT, 0, 1, t, 4)
    box.put_all("s", Kind.INPUT, 1, 0, [t, t], 4)  # the next step is new
    assert box.waiting("s") == 2
    # a microbatch of the step being taken may still come after another was taken
    box.get("s", Kind.INPUT, 1, 0, lambda: False)
    box.put("s", Kind.INPUT, 2, 0, t, 4)
    box.drop(lambda slot: slot == "s")  # a new stage in the slot starts afresh
    box.put("s", Kind.INPUT, 0, 0, t, 4)


def test_a_duplicate_for_a_full_slot_is_refused_at_once_not_after_room():
    from fedpipe.node.mailbox import Duplicate

    box = Mailbox(1, (Kind.INPUT,))
    box.put("s", Kind.INPUT, 0, 0, torch.zeros(1), 1)
    with pytest.raises(Duplicate):  # was: waited for room first (for ever if alive)
        box.put("s", Kind.INPUT, 0, 0, torch.zeros(1), 1)


def test_a_put_may_leave_its_gets_wake_up_to_its_caller_and_runs_it_before_waiting_for_room():
    """A socket link's reader files the tensors that arrived together with ``defer`` and
    wakes the stage thread once for them all: the put returns the wake-up (None when no
    get waits), which wakes every get deferred so, once; a put that must wait for room
    runs them first (the stage thread that would make room may be one of them)."""
    box = Mailbox(1, (Kind.INPUT,))
    assert box.put("s", Kind.ACTIVATION, 0, 0, torch.zeros(1), 1, defer=True) is None
    th, got = taking(box, 1)
    wait_waiting(box, 1)
    wake = box.put("s", Kind.ACTIVATION, 1, 0, torch.ones(1), 1, defer=True)
    assert wake is not None and len(box._deferred) == 1 and box._wanted == {}
    wake()
    th.join(10)
    assert got[0][0].item() == 1 and box._deferred == []
    wake()  # again: nothing left to wake

    th, got = taking(box, 2)
    wait_waiting(box, 1)
    assert box.put("s", Kind.ACTIVATION, 2, 0, torch.ones(1), 1, defer=True) is not None
    box.put("s", Kind.INPUT, 0, 0, torch.zeros(1), 1)
    stop = threading.Event()
    errors: list = []

    def put_past_room() -> None:
        try:
            box.put("s", Kind.INPUT, 0, 1, torch.zeros(1), 1, alive=lambda: not stop.is_set())
        except Stopped as e:
            errors.append(e)
    putter = threading.Thread(target=put_past_room, daemon=True)
    putter.start()
    for _ in range(2000):  # the put waits for room: it woke the deferred get first
        with box._lock:
            if not box._deferred:
                break
        threading.Event().wait(0.005)
    assert box._deferred == []
    th.join(10)
    assert got[0][0].item() == 1
    stop.set()
    putter.join(10)
    assert errors and "was not taken" in str(errors[0])
