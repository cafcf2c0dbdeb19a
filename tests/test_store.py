"""The job's rendezvous store (``hspmd_sdk.runtime.workers.store``): it keeps a ``TCPStore``'s semantics, checked against
torch's own ``TCPStore`` as the reference, and it lets in only a process that holds the job's secret: a stranger,
a wrong secret and torch's own client are refused, a server that cannot prove the secret is refused by the client,
and a running job's store refuses a connection without its secret while the secret stays out of its logs."""
from __future__ import annotations

import socket
import threading
import time
from datetime import timedelta

import pytest
import torch.distributed as dist

from _procs import assert_no_workers_left, wait_for
from hspmd_sdk.core.cluster import Cluster
from hspmd_sdk.runtime import build_spec, launch
from hspmd_sdk.runtime.protocol import is_collateral
from hspmd_sdk.runtime.workers.session import _is_comm_failure
from hspmd_sdk.runtime.workers.store import MAGIC, RendezvousStore, StoreAuthError, new_secret
from hspmd_sdk.runtime.transports.transport import free_port

T = timedelta(seconds=20)


@pytest.fixture
def hosted():
    store = RendezvousStore.host_at("127.0.0.1", 0, new_secret(), T)
    yield store
    store.close()


def _script(s: dist.Store) -> list[object]:
    """One sequence of operations; what each returns (the reference is a TCPStore running the same)."""
    out: list[object] = []
    s.set("a", "x")
    s.set("b", b"\x00\xffbytes")
    out += [s.get("a"), s.get("b"), s.add("n", 2), s.add("n", 5), s.add("n", -1), s.get("n"), s.add("fresh", 0)]
    out += [s.compare_set("c", "", "first"), s.compare_set("c", "wrong", "second"), s.get("c"),
            s.compare_set("c", "first", "third"), s.get("c"), s.compare_set("missing", "exp", "des"),
            s.check(["missing"])]
    out += [s.check(["a", "b"]), s.check(["a", "nope"]), s.delete_key("a"), s.delete_key("a"), s.check(["a"])]
    s.append("ap", "12")
    s.append("ap", b"34")
    out += [s.get("ap")]
    s.multi_set(["m1", "m2"], ["v1", b"v2"])
    out += [s.multi_get(["m1", "m2", "b"])]
    s.wait(["m1", "b"])
    s.wait(["m2"], timedelta(seconds=1))
    return out


def test_it_answers_as_torchs_tcpstore_does(hosted: RendezvousStore) -> None:
    reference = dist.TCPStore("127.0.0.1", free_port(), 1, is_master=True, timeout=T, wait_for_workers=False)
    expected = _script(reference)
    assert _script(hosted) == expected
    assert hosted.num_keys() == len({"b", "n", "fresh", "c", "ap", "m1", "m2"})  # "missing" was never set


def test_a_get_waits_for_another_clients_set_and_times_out_naming_the_key(hosted: RendezvousStore) -> None:
    other = hosted.clone()
    threading.Timer(0.3, lambda: other.set("late", "here")).start()
    t0 = time.monotonic()
    assert hosted.get("late") == b"here"
    assert time.monotonic() - t0 >= 0.25
    hosted.set_timeout(timedelta(seconds=0.3))
    assert hosted.timeout == timedelta(seconds=0.3)
    with pytest.raises(dist.DistStoreError, match=r"get: timed out after 0.3 s waiting for key\(s\) \['never'\]"):
        hosted.get("never")
    with pytest.raises(dist.DistStoreError, match=r"wait: .*\['never'\]"):
        hosted.wait(["late", "never"])
    other.close()


def test_a_connection_without_the_secret_is_refused(hosted: RendezvousStore) -> None:
    port = hosted.port
    hosted.set("k", "v")
    # a stranger who speaks the protocol but guesses the answer: one status byte 0, then the connection ends
    with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
        hello = s.recv(len(MAGIC) + 32, socket.MSG_WAITALL)
        assert hello.startswith(MAGIC)
        s.sendall(b"\x00" * 64)
        assert s.recv(16) == b"\x00"
        assert s.recv(16) == b""
    # a stranger who skips the handshake and asks for a key: the frame is taken for an answer, and refused
    with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
        s.recv(len(MAGIC) + 32, socket.MSG_WAITALL)
        s.sendall(b"\x02\x00\x00\x00\x02" + b"\x00\x00\x00\x04" + b"9999" + b"\x00\x00\x00\x01k" + b"\x00" * 50)
        assert s.recv(16) == b"\x00"
    # a client with another job's secret
    with pytest.raises(StoreAuthError, match=rf"127.0.0.1:{port}: refused this process's secret"):
        RendezvousStore.connect("127.0.0.1", port, new_secret(), T)
    # torch's own client does not get in either
    with pytest.raises((RuntimeError, dist.DistStoreError)):
        dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=2)).get("k")
    assert hosted.server.refused >= 3
    assert hosted.get("k") == b"v" and hosted.clone().get("k") == b"v"  # the job's own clients are unharmed


def test_a_server_without_the_secret_is_refused_by_the_client() -> None:
    """An impostor at the rendezvous address (it accepts any answer) cannot prove the secret: the client stops."""
    listener = socket.create_server(("127.0.0.1", 0))

    def impostor() -> None:
        conn, _ = listener.accept()
        conn.sendall(MAGIC + b"\x01" * 32)
        conn.recv(64, socket.MSG_WAITALL)
        conn.sendall(b"\x01" + b"\x02" * 32)
        time.sleep(1)
        conn.close()

    threading.Thread(target=impostor, daemon=True).start()
    with pytest.raises(StoreAuthError, match="did not prove it holds the job's secret"):
        RendezvousStore.connect("127.0.0.1", listener.getsockname()[1], new_secret(), T)
    listener.close()


def test_close_ends_the_server_and_waiting_clients(hosted: RendezvousStore) -> None:
    other = hosted.clone()
    errors: list[BaseException] = []
    waiter = threading.Thread(target=lambda: _catch(errors, lambda: other.get("never")))
    waiter.start()
    time.sleep(0.2)
    hosted.close()
    waiter.join(5)
    assert not waiter.is_alive() and errors  # the wait ended with an error, not a hang
    with pytest.raises(dist.DistStoreError, match="not reachable"):
        RendezvousStore.connect("127.0.0.1", hosted.port, new_secret(), timedelta(seconds=0.3))


def _host_until_killed(secret: str, port, ready) -> None:  # a child process: rank 0 hosting the store
    store = RendezvousStore.host_at("127.0.0.1", 0, secret, T)
    port.value = store.port
    ready.set()
    time.sleep(60)


def test_a_killed_host_gives_its_clients_the_error_of_a_peers_death() -> None:
    """Rank 0 hosts the store; SIGKILLed, its clients' calls raise what torch's ``TCPStore`` raises then
    (``DistNetworkError``), which an elastic survivor reads as a peer's death and recovers from, and which the
    launcher reads as collateral.  A plain ``ConnectionError`` made the survivors exit instead: every rank-0 kill of
    the random reconfiguration sweep failed the job (stop 39)."""
    import multiprocessing as mp
    import os
    import signal

    ctx = mp.get_context("fork")
    secret, port, ready = new_secret(), ctx.Value("i", 0), ctx.Event()
    host = ctx.Process(target=_host_until_killed, args=(secret, port, ready), daemon=True)
    host.start()
    try:
        assert ready.wait(20)
        client = RendezvousStore.connect("127.0.0.1", port.value, secret, T)
        client.set("k", "v")
        errors: list[BaseException] = []
        waiter = threading.Thread(target=lambda: _catch(errors, lambda: client.get("never")))
        waiter.start()
        time.sleep(0.2)
        os.kill(host.pid, signal.SIGKILL)
        waiter.join(10)
        assert not waiter.is_alive() and errors, errors  # the wait ended at once, not after its 20 s
        assert isinstance(errors[0], dist.DistNetworkError), repr(errors[0])
        assert "rendezvous store at 127.0.0.1" in str(errors[0])
        assert _is_comm_failure(errors[0]) and is_collateral(str(errors[0]))
        with pytest.raises(dist.DistNetworkError):
            client.set("late", "x")
    finally:
        host.kill()
        host.join(5)


def test_a_wait_gives_up_when_a_peer_of_the_world_died(hosted: RendezvousStore) -> None:
    """``interrupted`` (a worker's ``peer_failed``): a ``wait``/``get`` for a key a dead rank would have set ends
    within a slice of the launcher's halt, as a peer's death, not after the store's timeout (20 s here); the
    survivors of a rank killed during a switch's ``new_group`` waited 60 s so, and the recovery with them."""
    client = hosted.clone()
    halted = threading.Event()
    client.interrupted = halted.is_set
    assert client.clone().interrupted is client.interrupted  # torch clones stores for its groups
    client.set("here", "1")
    client.wait(["here"])  # present keys: answered at once, sliced or not
    for call in (lambda: client.wait(["never"]), lambda: client.get("never"), lambda: client.multi_get(["never"])):
        errors: list[BaseException] = []
        waiter = threading.Thread(target=lambda: _catch(errors, call))
        waiter.start()
        time.sleep(0.6)
        assert waiter.is_alive()  # still waiting across slices
        t0 = time.monotonic()
        halted.set()
        waiter.join(5)
        assert not waiter.is_alive() and time.monotonic() - t0 < 2 * RendezvousStore.WAIT_SLICE_S + 0.5
        assert isinstance(errors[0], dist.DistNetworkError) and "a peer of this world died" in str(errors[0])
        assert "'never'" in str(errors[0]) and _is_comm_failure(errors[0])
        halted.clear()
    with pytest.raises(dist.DistStoreError, match=r"timed out after 0.6 s waiting for key\(s\) \['never'\]"):
        client.wait(["never"], timedelta(seconds=0.6))  # no halt: the timeout, naming the key


def _catch(errors: list[BaseException], fn) -> None:
    try:
        fn()
    except BaseException as e:  # noqa: BLE001
        errors.append(e)


def test_a_running_jobs_store_refuses_a_connection_without_its_secret() -> None:
    job = launch(cluster=Cluster.local(2), entry="hspmd_sdk.testing.entries:sleep_forever", steps=1)
    pgids = list(job.pids().values())
    try:
        wait_for(lambda: job.metrics.last_step() >= 0)
        addr, port, secret = job.spec.master_addr, job.spec.master_port, job.spec.secret
        with pytest.raises(StoreAuthError, match="refused"):
            RendezvousStore.connect(addr, port, new_secret(), T)
        member = RendezvousStore.connect(addr, port, secret, T)  # the job's secret is the key
        assert member.num_keys() > 0
        member.close()
        assert len(secret) == 64 and secret not in repr(job.spec)
        assert all(secret not in job.logs(r) for r in range(2))
        assert build_spec(Cluster.local(2), entry="m:f").secret != secret  # a secret per job
    finally:
        job.cancel()
    assert_no_workers_left(pgids)
