"""Tests of ps_server.core.broadcast: the chief posts, the others wait (bounded).

    python -m pytest tests/core/test_broadcast.py -q

Each test checks one sentence of the module docstring; a wait is a ticket, its timeout
moved by a fake clock (one test, the real one) and ended by ``expire_overdue``.
"""

import pytest

from ps_server.core.broadcast import Board, BroadcastConflict, Broadcasts, BroadcastTimeout, KEYS_KEPT
from ps_server.core.errors import InvalidArgument, UnknownWorker
from ps_server.core.parameter_server import ParameterServer
from tests.core.threads import FakeClock, ticking


# -- the board: plain and deterministic ----------------------------------------------------


def test_posting_a_key_again_with_the_same_value_is_harmless_with_another_refused():
    board = Board()
    assert board.post("epoch-1", b"stop") is True
    assert board.post("epoch-1", b"stop") is False
    with pytest.raises(BroadcastConflict, match="'epoch-1' was already posted with another value"):
        board.post("epoch-1", b"go on")
    assert board.get("epoch-1") == b"stop"


def test_the_board_keeps_the_last_keys_and_drops_the_oldest_posted():
    board = Board(keep=3)
    for i in range(5):
        board.post(f"k{i}", bytes([i]))
    assert [board.get(f"k{i}") for i in range(5)] == [None, None, b"\x02", b"\x03", b"\x04"]
    assert len(board) == 3
    assert Board().keep == KEYS_KEPT == 1000


def test_a_board_of_the_default_size_holds_exactly_a_thousand_keys():
    board = Board()
    for i in range(KEYS_KEPT + 1):
        board.post(str(i), b"x")
    assert len(board) == KEYS_KEPT and board.get("0") is None and board.get("1") == b"x"


@pytest.mark.parametrize("key, says", [("", "non-empty"), ("k" * 257, "at most 256 characters")])
def test_a_bad_key_is_refused(key, says):
    with pytest.raises(InvalidArgument, match=says):
        Board().post(key, b"")


# -- waiting: a ticket, settled by the post or, past its timeout, by the ticker ---------------


def test_a_waiter_gets_the_chief_s_value_once_it_is_posted():
    board = Broadcasts(timeout_limit=30.0)
    waiting = board.submit_wait("epoch-2", 30.0)
    assert not waiting.done()  # nothing posted yet
    board.post("epoch-2", b"\x00lr=0.01")
    assert waiting.result() == b"\x00lr=0.01"


def test_a_value_posted_before_the_wait_is_answered_at_once():
    board = Broadcasts(timeout_limit=30.0)
    board.post("k", b"v")
    assert board.submit_wait("k", 0.0).result() == b"v"


def test_a_wait_ends_after_its_timeout_naming_the_key():
    clock = FakeClock()
    board = Broadcasts(timeout_limit=30.0, clock=clock)
    waiting = board.submit_wait("epoch-9", 0.2)
    clock.now = 0.19
    board.expire_overdue()
    assert not waiting.done()
    clock.now = 0.2
    board.expire_overdue()
    with pytest.raises(BroadcastTimeout, match="'epoch-9' was not posted by the chief .* within 0.2 s"):
        waiting.result()


def test_a_wait_is_never_longer_than_the_limit():
    clock = FakeClock()
    board = Broadcasts(timeout_limit=0.2, clock=clock)
    waiting = board.submit_wait("k", 3600.0)
    clock.now = 0.2
    board.expire_overdue()
    with pytest.raises(BroadcastTimeout, match="at most its barrier timeout, 0.2 s"):
        waiting.result()


def test_a_wait_of_zero_seconds_for_a_key_not_posted_times_out_at_once():
    with pytest.raises(BroadcastTimeout, match="'k' was not posted"):
        Broadcasts(timeout_limit=30.0).submit_wait("k", 0.0).result()


@pytest.mark.parametrize("timeout", [-1.0, float("nan")])
def test_a_bad_timeout_is_refused(timeout):
    with pytest.raises(InvalidArgument, match="timeout"):
        Broadcasts(timeout_limit=1.0).submit_wait("k", timeout).result()


def test_many_waiters_are_all_released_by_one_post():
    board = Broadcasts(timeout_limit=30.0)
    waiting = [board.submit_wait("k", 30.0) for _ in range(8)]
    board.post("k", b"v")
    assert [w.result() for w in waiting] == [b"v"] * 8


def test_a_waiter_on_the_real_clock_is_settled_by_the_ticker():
    board = Broadcasts(timeout_limit=30.0)
    with pytest.raises(BroadcastTimeout, match="within 0.05 s"):
        ticking(board.submit_wait("k", 0.05), board.expire_overdue)


# -- through the parameter server -------------------------------------------------------------


def test_worker_zero_posts_and_the_others_wait_for_its_value_ignoring_their_own():
    ps = ParameterServer("sync", 3, barrier_timeout=30.0)
    for w in range(3):
        ps.register(w, 3)
    other = ps.submit_broadcast(2, "stop", b"mine", 30.0)
    assert not other.done()
    assert ps.submit_broadcast(0, "stop", b"yes", 0.0).result() == b"yes"
    assert other.result() == b"yes"
    assert ps.submit_broadcast(1, "stop", None, 0.0).result() == b"yes"


def test_a_key_naming_a_worker_is_that_worker_s_to_post_a_vote_of_each():
    """``<key>@w<i>``: worker i posts, the chief and the rest wait for it (``broadcast_poster``);
    so each worker posts its vote under its own key and reads the others'."""
    from ps_common.names import broadcast_poster

    assert [broadcast_poster(k) for k in ("stop", "skip@w2", "a@wx", "x@w1@w0", "@w12")] == [0, 2, 0, 0, 12]
    ps = ParameterServer("sync", 3, barrier_timeout=30.0)
    for w in range(3):
        ps.register(w, 3)
    chief = ps.submit_broadcast(0, "skip@w2", b"0", 30.0)
    assert not chief.done()
    assert ps.submit_broadcast(2, "skip@w2", b"1", 0.0).result() == b"1" and chief.result() == b"1"
    assert ps.submit_broadcast(1, "skip@w1", b"0", 0.0).result() == b"0"


def test_an_unregistered_worker_cannot_broadcast():
    ps = ParameterServer("async", 2)
    ps.register(0, 2)
    with pytest.raises(UnknownWorker):
        ps.submit_broadcast(1, "k", None, 1.0).result()
    with pytest.raises(UnknownWorker):
        ps.submit_broadcast(5, "k", b"v", 1.0).result()
    assert len(ps.broadcasts) == 0
