"""Tests of ps_server.core.modes.rounds: the deterministic sync bookkeeping, exhaustively.

    python -m pytest tests/core/test_rounds.py -q

``RoundBook`` has no threads and no clock, so every rule of its docstring is
checked directly, and one test replays every sequence of operations up to a
fixed length against a model written from the docstring.
"""

import itertools

import pytest

from ps_server.core.errors import DuplicatePush, FutureRound, InvalidArgument, StaleRound
from ps_server.core.modes.rounds import RoundBook


def state(book):
    """Everything observable about a book, to show that a refusal changed nothing."""
    return (book.round, book.generation, book.pushed(), book.missing(), tuple(book.peek()))


def test_round_fills_when_every_worker_has_pushed():
    book = RoundBook(num_workers=3)
    assert book.add(worker_id=0, step=0, item="g0") is False
    assert book.add(worker_id=2, step=0, item="g2") is False
    assert book.missing() == (1,)
    assert book.add(worker_id=1, step=0, item="g1") is True
    assert book.missing() == ()
    assert book.pushed() == (0, 1, 2)


def test_take_hands_out_items_in_worker_id_order_not_arrival_order():
    book = RoundBook(num_workers=4)
    for w in (3, 1, 0, 2):
        book.add(w, 0, f"g{w}")
    assert book.take() == ["g0", "g1", "g2", "g3"]


def test_take_starts_the_next_round_and_a_new_generation():
    book = RoundBook(num_workers=2)
    book.add(0, 0, "a")
    book.add(1, 0, "b")
    book.take()
    assert (book.round, book.generation) == (1, 1)
    assert book.pushed() == ()
    assert book.missing() == (0, 1)
    # The new round accepts pushes for step 1 from the same workers.
    assert book.add(0, 1, "c") is False


def test_take_of_a_round_that_is_not_full_raises_and_changes_nothing():
    book = RoundBook(num_workers=3)
    book.add(1, 0, "g1")
    before = state(book)
    with pytest.raises(RuntimeError, match=r"round 0 is not full: missing \(0, 2\)"):
        book.take()
    assert state(book) == before


def test_push_for_a_completed_round_is_refused_and_changes_nothing():
    book = RoundBook(num_workers=2)
    book.add(0, 0, "a")
    book.add(1, 0, "b")
    book.take()
    book.add(1, 1, "c")
    before = state(book)
    with pytest.raises(StaleRound, match="worker 0 for step 0 is late: round 0 already completed"):
        book.add(0, 0, "late")
    assert state(book) == before


def test_push_for_a_future_round_is_refused_and_changes_nothing():
    book = RoundBook(num_workers=2)
    book.add(0, 0, "a")
    before = state(book)
    with pytest.raises(FutureRound, match="worker 1 for step 1 is early: round 0 has not completed"):
        book.add(1, 1, "early")
    assert state(book) == before


def test_second_push_of_a_worker_in_a_round_is_refused_and_keeps_the_first():
    book = RoundBook(num_workers=2)
    book.add(0, 0, "first")
    before = state(book)
    with pytest.raises(DuplicatePush, match="worker 0 already pushed for round 0"):
        book.add(0, 0, "second")
    assert state(book) == before
    book.add(1, 0, "other")
    assert book.take() == ["first", "other"]


@pytest.mark.parametrize("worker_id", [-1, 3, 100])
def test_worker_id_outside_the_cluster_is_refused_and_changes_nothing(worker_id):
    book = RoundBook(num_workers=3)
    book.add(0, 0, "a")
    before = state(book)
    with pytest.raises(InvalidArgument, match=rf"worker id {worker_id} is outside 0\.\.2"):
        book.add(worker_id, 0, "x")
    assert state(book) == before


def test_check_classifies_or_raises_what_add_would_and_never_records():
    book = RoundBook(num_workers=2, start_round=5)
    assert book.check(0, 5) == "new"  # acceptable, and still not recorded
    assert book.pushed() == ()
    book.add(0, 5, "a")
    assert book.check(0, 5) == "join"  # a retry waits for the first push's outcome
    with pytest.raises(DuplicatePush):
        book.add(0, 5, "again")
    for args, error in [((1, 4), StaleRound), ((1, 6), FutureRound), ((2, 5), InvalidArgument)]:
        with pytest.raises(error):
            book.check(*args)
        with pytest.raises(error):
            book.add(*args, "x")
    assert book.pushed() == (0,)


def test_abort_drops_the_pushes_keeps_the_round_number_and_starts_a_new_generation():
    book = RoundBook(num_workers=3)
    book.add(0, 0, "a")
    book.add(2, 0, "c")
    assert book.abort() == (1,)
    assert (book.round, book.generation) == (0, 1)
    assert book.pushed() == ()
    assert book.peek() == []


def test_after_abort_every_worker_may_push_the_same_step_again():
    book = RoundBook(num_workers=2)
    book.add(0, 0, "old")
    book.abort()
    assert book.add(0, 0, "new0") is False
    assert book.add(1, 0, "new1") is True
    assert book.take() == ["new0", "new1"]
    assert (book.round, book.generation) == (1, 2)


def test_abort_of_an_empty_round_reports_every_worker_missing():
    book = RoundBook(num_workers=3)
    assert book.abort() == (0, 1, 2)
    assert (book.round, book.generation) == (0, 1)


def test_peek_shows_items_in_worker_id_order_and_leaves_the_round_as_it_is():
    book = RoundBook(num_workers=3)
    book.add(2, 0, "c")
    book.add(0, 0, "a")
    before = state(book)
    assert book.peek() == ["a", "c"]
    assert state(book) == before
    book.add(1, 0, "b")
    assert book.peek() == ["a", "b", "c"]
    assert book.take() == ["a", "b", "c"]  # peek did not consume the round


def test_start_round_sets_the_first_round_and_generation_starts_at_zero():
    book = RoundBook(num_workers=1, start_round=7)
    assert (book.round, book.generation) == (7, 0)
    with pytest.raises(StaleRound):
        book.add(0, 6, "x")
    assert book.add(0, 7, "x") is True
    assert book.take() == ["x"]
    assert book.round == 8


@pytest.mark.parametrize("n", [0, -1])
def test_a_book_needs_at_least_one_worker(n):
    with pytest.raises(InvalidArgument, match=f"num_workers must be >= 1, got {n}"):
        RoundBook(num_workers=n)


# -- every sequence of operations, against a model of the docstring -------------

N = 2
OPS = [("add", w, d) for w in range(N) for d in (-1, 0, 1)] + [("take",), ("abort",)]
MAX_LEN = 5


class Model:
    """The RoundBook docstring, restated as plainly as possible."""

    def __init__(self):
        self.round, self.generation, self.pending = 0, 0, {}

    def run(self, op):
        """Return (expected exception class or None, expected return value)."""
        if op[0] == "add":
            _, w, d = op
            step = self.round + d
            if step < self.round:
                return StaleRound, None
            if step > self.round:
                return FutureRound, None
            if w in self.pending:
                return DuplicatePush, None
            self.pending[w] = (self.generation, w)
            return None, len(self.pending) == N
        if op[0] == "take":
            if len(self.pending) != N:
                return RuntimeError, None
            items = [self.pending[w] for w in sorted(self.pending)]
            self.pending, self.round, self.generation = {}, self.round + 1, self.generation + 1
            return None, items
        missing = tuple(w for w in range(N) if w not in self.pending)
        self.pending, self.generation = {}, self.generation + 1
        return None, missing


def test_every_sequence_of_pushes_takes_and_aborts_matches_the_docstring():
    checked = 0
    for length in range(1, MAX_LEN + 1):
        for ops in itertools.product(OPS, repeat=length):
            book, model = RoundBook(num_workers=N), Model()
            for op in ops:
                before = state(book)
                error, expected = model.run(op)
                try:
                    if op[0] == "add":
                        _, w, d = op
                        got = book.add(w, book.round + d, (book.generation, w))
                    elif op[0] == "take":
                        got = book.take()
                    else:
                        got = book.abort()
                except Exception as e:  # noqa: BLE001 - compared with the model below
                    assert type(e) is error, (ops, op, e)
                    assert state(book) == before, (ops, op)  # a refusal changes nothing
                    continue
                assert error is None, (ops, op, "was accepted")
                assert got == expected, (ops, op)
                assert (book.round, book.generation) == (model.round, model.generation), (ops, op)
                assert book.pushed() == tuple(sorted(model.pending)), (ops, op)
                checked += 1
    assert checked > 10_000


def test_a_restored_book_takes_its_first_push_for_a_later_round_and_collects_that_round():
    book = RoundBook(num_workers=2, start_round=3, restored=True)
    with pytest.raises(StaleRound):
        book.check(0, 2)
    assert book.check(1, 9) == "new" and book.restored  # check records nothing
    assert book.add(1, 9, "g1") is False
    assert book.round == 9 and not book.restored
    with pytest.raises(FutureRound):  # only the first push sets the round
        book.check(0, 10)
    assert book.add(0, 9, "g0") is True and book.take() == ["g0", "g1"] and book.round == 10


def test_a_book_not_restored_refuses_a_later_round_even_when_empty():
    book = RoundBook(num_workers=2, start_round=3)
    with pytest.raises(FutureRound):
        book.check(0, 4)
