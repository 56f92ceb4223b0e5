"""One verdict on a load, on every rank (`verdict.py`), with fake ranks as threads of one process.

A load that fails on some ranks only (a damaged shard, a refused layout, a codec one node lacks)
must fail on every rank with the same error type, naming the rank and the file at fault, and a
rank that never comes must be named, not waited for. The DeepSpeed end of it (the steps of
`load_checkpoint` that agree) is tests/test_reliability_ds.py's `verdict` tests.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import pytest

from nvcomp_ckpt_engine import verdict
from nvcomp_ckpt_engine.collectives import MemoryStore, StoreCollective
from nvcomp_ckpt_engine.errors import (
    CheckpointError,
    CommitError,
    CorruptCheckpointError,
    IncompleteCheckpointError,
    UnsupportedCheckpointError,
)

WHAT = "load_checkpoint('/ckpt', tag='global_step4')"


def run_ranks(outcomes: list[Callable[[StoreCollective], Any]], *,
              timeout_s: float = 30.0) -> list[BaseException | Any]:
    """Run `outcomes[r](collective of rank r)` as one thread per rank; each rank's result or
    the exception it raised."""
    store = MemoryStore(timeout_s=timeout_s)
    results: list[Any] = [None] * len(outcomes)

    def rank(r: int) -> None:
        collective = StoreCollective(store, rank=r, world_size=len(outcomes), timeout_s=timeout_s)
        try:
            results[r] = outcomes[r](collective)
        except BaseException as exc:  # the outcome under test
            results[r] = exc

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(len(outcomes))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert not any(thread.is_alive() for thread in threads), "a rank hung"
    return results


def agreeing(error: BaseException | None, path: str | None = None,
             timeout_s: float = 30.0) -> Callable[[StoreCollective], Any]:
    def outcome(collective: StoreCollective) -> str:
        verdict.agree(collective, error, what=WHAT, step="load-end", timeout_s=timeout_s, path=path)
        return "returned"

    return outcome


def test_a_fault_on_one_rank_is_raised_on_every_rank_naming_the_rank_and_file() -> None:
    shard = "/ckpt/global_step4/bf16_zero_pp_rank_1_mp_rank_00_optim_states.pt"
    original = CorruptCheckpointError(f"{shard}: chunk 3 of storage 0: checksum mismatch")
    results = run_ranks([agreeing(None), agreeing(original, shard)])
    for rank, raised in enumerate(results):
        assert type(raised) is CorruptCheckpointError, (rank, raised)
        assert str(raised).startswith(f"{WHAT} failed on rank 1: CorruptCheckpointError: {shard}")
        assert raised.fault == verdict.Fault(1, "CorruptCheckpointError", str(original), shard)
    assert results[1].__cause__ is original


def test_the_file_is_named_even_when_the_error_does_not_name_it() -> None:
    results = run_ranks([agreeing(None), agreeing(KeyError("optimizer_state_dict"), "/ckpt/x.pt")])
    for raised in results:
        assert type(raised) is CheckpointError
        assert "failed on rank 1 reading /ckpt/x.pt: KeyError: 'optimizer_state_dict'" in str(raised)


def test_the_lowest_failing_rank_decides_the_type_and_the_others_are_listed() -> None:
    results = run_ranks([
        agreeing(None),
        agreeing(UnsupportedCheckpointError("a.pt: codec 'ans' needs nvCOMP")),
        agreeing(CorruptCheckpointError("b.pt: truncated")),
    ])
    for raised in results:
        assert type(raised) is UnsupportedCheckpointError, raised
        text = str(raised)
        assert "failed on rank 1: UnsupportedCheckpointError: a.pt" in text, text
        assert "1 more rank(s) too: rank 2: CorruptCheckpointError: b.pt: truncated" in text, text


def test_ranks_failing_alike_are_named_once() -> None:
    """A refusal every rank meets (a layout, a missing file) is told once, with its remedy."""
    message = "/ckpt/global_step4: saved with dp 4, now 2: `nvcomp-ckpt to-universal ...`"
    results = run_ranks([agreeing(UnsupportedCheckpointError(message), "/ckpt/m.pt")] * 3)
    for raised in results:
        assert type(raised) is UnsupportedCheckpointError
        assert str(raised).count("nvcomp-ckpt to-universal") == 1, raised
        assert str(raised).endswith("(the same on rank(s) [1, 2])"), raised


def test_no_failure_returns_on_every_rank() -> None:
    assert run_ranks([agreeing(None)] * 3) == ["returned"] * 3


def test_another_librarys_error_the_same_on_every_rank_is_raised_as_it_is() -> None:
    errors = [ValueError("Invalid for universal checkpoint: latest_universal does not exist")
              for _ in range(2)]
    results = run_ranks([agreeing(error) for error in errors])
    assert results == errors


def test_an_error_a_verdict_raised_is_raised_again_as_it_is() -> None:
    """A later agreement (the end of the load after one of its steps) keeps the first verdict:
    the fault it names is the failed rank's, not the rank that raises it again."""
    first = run_ranks([agreeing(None), agreeing(IncompleteCheckpointError("c.pt is missing"))])
    again = run_ranks([agreeing(first[0]), agreeing(first[1])])
    assert again == first
    assert all(raised.fault.rank == 1 for raised in again)


def test_a_rank_that_never_arrives_is_named_within_the_timeout() -> None:
    never = threading.Event()
    results = run_ranks([agreeing(CorruptCheckpointError("d.pt: bad"), timeout_s=0.5),
                         lambda collective: never.wait(1)], timeout_s=0.5)
    raised = results[0]
    assert isinstance(raised, CommitError), raised
    assert "rank(s) [1] did not arrive" in str(raised) and WHAT in str(raised), raised


def test_a_malformed_outcome_is_the_senders_fault() -> None:
    fault = verdict.Fault.from_json({"rank": "one"}, 3)
    assert fault.rank == 3 and "not a load outcome" in fault.message


@pytest.mark.parametrize("kind, damage", [
    ("CorruptCheckpointError", True), ("IncompleteCheckpointError", True), ("CodecError", True),
    ("UnsupportedCheckpointError", False), ("UnsafeObjectError", False), ("KeyError", False)])
def test_only_damage_is_a_reason_to_fall_back(kind: str, damage: bool) -> None:
    assert verdict.Fault(0, kind, "").damage is damage
    assert issubclass(verdict.error_type(kind), CheckpointError)
