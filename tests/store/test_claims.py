"""Claims in the store (artifact_store/claims.py) on a folder, in memory and on a real S3
API server: one winner of a race, waits that end with the artifact or at a deadline,
takeover of a claim nobody renews, renewal that notices a takeover, and claims that
step aside on a read-only or unreachable store."""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest
from store_helpers import free_port, make_artifact, s3_options, store_warnings

from kiln.artifact_store import open_store
from kiln.artifact_store.claims import (
    ATOMIC,
    CONDITIONAL,
    MAX_POLL_S,
    PROCESS_LOCAL,
    Claim,
    Claims,
)
from kiln.artifact_store.store import Store

KEY = "c" * 64
TTL = 0.6


def claims_of(store: Store, **options: Any) -> Claims:
    """Claims of ``store`` with a short TTL and wait (the store's own counters)."""
    claims = store.claims
    claims.ttl_s = options.get("ttl_s", TTL)
    claims.wait_s = options.get("wait_s", 10.0)
    return claims


def open_backend(backend: tuple[str, dict[str, Any]], **kwargs: Any) -> Store:
    """A process's store; signed, as a shared store (the bucket) must be for a reader to
    take what another process published (artifact_store/trust.py)."""
    url, options = backend
    kwargs.setdefault("signing_key", "hmac:claims-test")
    return open_store(url=url, storage_options=options, local_cache=False, stats_file=False,
                      **kwargs)


def test_guarantee_per_backend(backend: tuple[str, dict[str, Any]]) -> None:
    store = open_backend(backend)
    expected = {"file": ATOMIC, "memory": PROCESS_LOCAL, "s3": CONDITIONAL}
    assert store.claims.guarantee == expected[backend[0].split(":")[0]]


def test_one_winner_of_a_race(backend: tuple[str, dict[str, Any]]) -> None:
    """Threads with a store each (as processes have) race for a key: exactly one holds it
    and the others see that one as the holder."""
    stores = [open_backend(backend) for _ in range(6)]
    barrier = threading.Barrier(len(stores))
    won: list[Claim] = []
    holders: list[dict[str, Any]] = []

    def race(i: int) -> None:
        claims = claims_of(stores[i])
        barrier.wait()
        claim, holder, _ = claims._attempt(KEY, {"host": "h", "pid": i}, None)
        if claim is not None:
            won.append(claim)
        else:
            holders.append(holder.owner if holder is not None else {})

    threads = [threading.Thread(target=race, args=(i,)) for i in range(len(stores))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(won) == 1, won
    assert len(holders) == len(stores) - 1
    assert all(h == won[0].owner for h in holders)
    won[0].release()
    assert claims_of(stores[0])._current(KEY) is None


def test_wait_ends_with_the_artifact(backend: tuple[str, dict[str, Any]]) -> None:
    holder_store, waiter_store = open_backend(backend), open_backend(backend)
    claim = claims_of(holder_store).try_acquire(KEY, {"host": "builder", "pid": 1})
    assert claim is not None

    def publish_later() -> None:
        time.sleep(0.5)
        assert holder_store.publish(make_artifact(KEY))
        claim.release()

    threading.Thread(target=publish_later).start()
    waiter = claims_of(waiter_store)
    seen: list[dict[str, Any]] = []
    outcome = waiter.acquire_or_wait(KEY, lambda: waiter_store.get(KEY), on_wait=seen.append)
    assert outcome.claim is None and outcome.found is not None
    assert outcome.found.blobs == make_artifact(KEY).blobs
    assert seen == [{"host": "builder", "pid": 1}] and outcome.holder == seen[0]
    assert 0.3 < outcome.waited_s < 5
    stats = waiter_store.stats()
    assert stats["claim_waits"] == 1 and stats["claim_wait_seconds"] > 0.3
    assert stats.get("claims", 0) == 0


def test_dead_claim_is_taken_over(backend: tuple[str, dict[str, Any]]) -> None:
    """A holder that stops renewing (killed) is taken over after one TTL of this
    process's clock; its own late renewal then finds the claim lost."""
    dead_store, store = open_backend(backend), open_backend(backend)
    dead = claims_of(dead_store).try_acquire(KEY, {"host": "gone", "pid": 2})
    assert dead is not None
    dead._stop.set()  # as if killed: no more renewals
    claims = claims_of(store)
    start = time.monotonic()
    outcome = claims.acquire_or_wait(KEY, lambda: None)
    took = time.monotonic() - start
    assert outcome.claim is not None and outcome.took_over and outcome.reason == "took over"
    assert TTL * 0.9 < took < TTL * 2 + 3, took
    assert outcome.holder == {"host": "gone", "pid": 2}
    assert not dead.renew() and dead.lost
    assert claims._current(KEY).token == outcome.claim.token  # type: ignore[union-attr]
    dead.release()  # not its claim any more: the new holder keeps it
    assert claims._current(KEY).token == outcome.claim.token  # type: ignore[union-attr]
    outcome.claim.release()
    assert store.stats()["claim_takeovers"] == 1 and store.stats()["claims"] == 1


def test_live_claim_waits_until_the_deadline(backend: tuple[str, dict[str, Any]]) -> None:
    holder = claims_of(open_backend(backend)).try_acquire(KEY)
    assert holder is not None  # renewed every TTL/3 by its thread
    store = open_backend(backend)
    wait_s = 1.5
    outcome = claims_of(store, wait_s=wait_s).acquire_or_wait(KEY, lambda: None)
    holder.release()
    assert outcome.claim is None and outcome.found is None and outcome.reason == "deadline"
    # gave up at its deadline: not before it, and within one poll (and a slow store look)
    assert wait_s <= outcome.waited_s < wait_s + MAX_POLL_S + 2.5, outcome.waited_s
    assert store.stats()["claim_deadlines"] == 1


def test_takeover_race_has_one_winner(tmp_path: Any) -> None:
    stores = [open_backend((f"file://{tmp_path}/store", {})) for _ in range(5)]
    dead = claims_of(stores[0]).try_acquire(KEY)
    assert dead is not None
    dead._stop.set()
    time.sleep(TTL * 2 + 0.2)  # expired by the holder's clock, with a TTL of slack
    barrier = threading.Barrier(4)
    won: list[tuple[Claim, bool]] = []

    def take(store: Store) -> None:
        barrier.wait()
        claim, _, took_over = claims_of(store)._attempt(KEY, {"pid": id(store)}, None)
        if claim is not None:
            won.append((claim, took_over))

    threads = [threading.Thread(target=take, args=(s,)) for s in stores[1:]]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(won) == 1 and won[0][1]  # one winner, and it took the dead claim over
    assert won[0][0].generation == 2
    assert not dead.renew()


def test_garbled_claim_reads_as_expired(tmp_path: Any) -> None:
    store = open_backend((f"file://{tmp_path}/store", {}))
    folder = tmp_path / "store" / "claims" / KEY[:2]
    folder.mkdir(parents=True)
    (folder / f"{KEY}.00000001").write_bytes(b"\x00not json")
    claim = claims_of(store).try_acquire(KEY)
    assert claim is not None and claim.generation == 2
    assert not (folder / f"{KEY}.00000001").exists()
    claim.release()


def test_read_only_store_claims_nothing(tmp_path: Any) -> None:
    store = open_backend((f"file://{tmp_path}/store", {}), read_only=True)
    outcome = store.claims.acquire_or_wait(KEY, lambda: None)
    assert outcome.claim is None and outcome.found is None
    assert "read-only" in outcome.reason
    assert not (tmp_path / "store" / "claims").exists()


def test_unreachable_store_warns_once(caplog: pytest.LogCaptureFixture) -> None:
    """An S3 endpoint nothing listens on: no claim, no wait, one warning (the store's,
    for the outage), and the lookup after it adds none."""
    options = s3_options(f"http://127.0.0.1:{free_port()}")
    options["config_kwargs"] = {"connect_timeout": 0.2, "retries": {"max_attempts": 0}}
    store = open_store(url="s3://kiln-test/down", storage_options=options, local_cache=False,
                       stats_file=False, timeout=2.0)
    claims = claims_of(store)
    for _ in range(3):
        outcome = claims.acquire_or_wait(KEY, lambda: None)
        assert outcome.claim is None and outcome.reason.startswith("no claim")
    assert len(store_warnings(caplog)) == 1, store_warnings(caplog)
    # the store's circuit breaker is open: later claims skip it without a call
    assert store.stats()["claim_errors"] == 1
    assert store.get(KEY) is None and len(store_warnings(caplog)) == 1


def test_gc_deletes_claims_left_by_dead_holders_and_keeps_live_ones(tmp_path: Any) -> None:
    """A process killed while holding a claim leaves its object behind (a takeover only
    replaces it when the key is missed again): the store's gc deletes claims older than its
    grace period, and keeps one still being renewed."""
    import os

    store = open_backend((f"file://{tmp_path}/store", {}))
    live = claims_of(store).try_acquire(KEY)
    assert live is not None
    folder = tmp_path / "store" / "claims" / ("b" * 2)
    folder.mkdir(parents=True)
    dead = folder / f"{'b' * 64}.00000001"
    dead.write_bytes(b'{"key": "left by a killed process"}')
    hour_ago = time.time() - 7200
    os.utime(dead, (hour_ago, hour_ago))
    report = store.gc()["local"]
    assert report["claims_deleted"] == 1, report
    assert not dead.exists()
    assert live.renew()  # the live claim is still there, still its holder's
    live.release()
