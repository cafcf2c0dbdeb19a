"""The job's rendezvous store, authenticated by a secret per job.

Rank 0 of a world hosts the store the ranks meet at (the process group's rendezvous, the grow and recovery
rendezvous, the checkpoint writers' announcements).  torch's ``TCPStore`` answers anyone who reaches its port; on
a shared cluster that is every other user's process on the nodes.  This store answers only a peer that proves it
holds the job's secret:

* **handshake**: the server sends a fresh 32-byte challenge; the client answers ``HMAC-SHA256(secret, "client" +
  challenge)`` and a challenge of its own; the server checks the answer (``hmac.compare_digest``) and either
  closes the connection (*refused*: one status byte ``0``, then nothing) or proves itself in turn with
  ``HMAC-SHA256(secret, "server" + the client's challenge)``, so a client never talks to an impostor either.  The
  secret itself never crosses the connection; it reaches the workers inside their launch spec, over the
  launcher's own authenticated channel (a pipe, SSH, Slurm's step I/O).
* **requests**: frames of byte strings (an operation code, then length-prefixed keys and values).  Values are
  bytes, counters decimal text; nothing is unpickled or evaluated, so a peer can send nothing executable.

:class:`RendezvousStore` is a :class:`torch.distributed.Store`: ``init_process_group(store=...)`` and
``new_group`` use it as they use a ``TCPStore`` (``set``, ``get``, ``add``, ``compare_set``, ``wait``, ``check``,
``delete_key``, ``num_keys``, ``append``, ``multi_get``, ``multi_set``, ``clone``).  ``RendezvousStore.host``
starts the server in the calling process (rank 0) and connects to it; ``RendezvousStore.connect`` reaches it from
another rank, retrying until the server listens.

Not covered: the gloo/NCCL connections between workers, which those libraries open and accept themselves, and
the confidentiality of the traffic (it is authenticated at connection time, not encrypted).
"""
from __future__ import annotations

import hashlib
import hmac
import secrets
import socket
import struct
import threading
import time
from datetime import timedelta
from typing import Callable, Sequence

import torch.distributed as dist

MAGIC = b"HSPMD-STORE-1"
_NONCE = 32
_MAC = 32
_HANDSHAKE_S = 10.0  #: a connection that does not finish the handshake within this is closed

# operation codes
SET, GET, ADD, CAS, WAIT, CHECK, DELETE, NUM_KEYS, APPEND, MULTI_GET, MULTI_SET = range(1, 12)
# answer statuses
OK, TIMEOUT, BAD_REQUEST = 0, 1, 2


class StoreAuthError(ConnectionError):
    """The other end of a rendezvous-store connection did not prove it holds the job's secret."""


def new_secret() -> str:
    """A fresh secret for one job (64 hex digits)."""
    return secrets.token_hex(32)


def _mac(secret: str, role: bytes, nonce: bytes) -> bytes:
    return hmac.new(bytes.fromhex(secret), role + nonce, hashlib.sha256).digest()


# ---- framing ----------------------------------------------------------------------------------------------------
def _recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        chunk = sock.recv(n - len(buf))
        if not chunk:
            raise ConnectionError("rendezvous store: connection closed by peer")
        buf += chunk
    return bytes(buf)


def _send_frame(sock: socket.socket, head: int, items: Sequence[bytes]) -> None:
    parts = [struct.pack("!BI", head, len(items))]
    for item in items:
        parts += [struct.pack("!I", len(item)), item]
    sock.sendall(b"".join(parts))


def _recv_frame(sock: socket.socket) -> tuple[int, list[bytes]]:
    head, count = struct.unpack("!BI", _recv_exact(sock, 5))
    items = []
    for _ in range(count):
        (size,) = struct.unpack("!I", _recv_exact(sock, 4))
        items.append(_recv_exact(sock, size))
    return head, items


def _b(x: str | bytes) -> bytes:
    return x if isinstance(x, bytes) else str(x).encode()


# ---- the server (rank 0) ----------------------------------------------------------------------------------------
class StoreServer:
    """The store's data and the thread that accepts connections at ``port`` (all interfaces, as ``TCPStore``);
    one thread per authenticated connection.  :meth:`close` stops it and ends every connection."""

    def __init__(self, port: int, secret: str) -> None:
        self.secret = secret
        self._data: dict[bytes, bytes] = {}
        self._changed = threading.Condition()
        self._conns: set[socket.socket] = set()
        self._closed = False
        self.refused = 0  #: connections refused (a wrong or missing secret)
        self._listener = socket.create_server(("", port), family=socket.AF_INET6, dualstack_ipv6=True, backlog=256) \
            if socket.has_dualstack_ipv6() else socket.create_server(("", port), backlog=256)
        self.port = self._listener.getsockname()[1]
        threading.Thread(target=self._accept_loop, name=f"hspmd-store:{self.port}", daemon=True).start()

    def close(self) -> None:
        with self._changed:
            if self._closed:
                return
            self._closed = True
            conns = list(self._conns)
            self._changed.notify_all()
        for s in [self._listener, *conns]:
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            s.close()

    def _accept_loop(self) -> None:
        while True:
            try:
                conn, _ = self._listener.accept()
            except OSError:
                return  # closed
            with self._changed:
                if self._closed:
                    conn.close()
                    return
                self._conns.add(conn)
            threading.Thread(target=self._serve, args=(conn,), name="hspmd-store-conn", daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        try:
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            if self._handshake(conn):
                while True:
                    op, items = _recv_frame(conn)
                    status, answer = self._answer(op, items)
                    _send_frame(conn, status, answer)
        except (OSError, ConnectionError, struct.error):
            pass
        finally:
            with self._changed:
                self._conns.discard(conn)
            conn.close()

    def _handshake(self, conn: socket.socket) -> bool:
        conn.settimeout(_HANDSHAKE_S)
        challenge = secrets.token_bytes(_NONCE)
        conn.sendall(MAGIC + challenge)
        answer = _recv_exact(conn, _MAC + _NONCE)
        if not hmac.compare_digest(answer[:_MAC], _mac(self.secret, b"client", challenge)):
            self.refused += 1
            conn.sendall(b"\x00")
            return False
        conn.sendall(b"\x01" + _mac(self.secret, b"server", answer[_MAC:]))
        conn.settimeout(None)
        return True

    def _wait_for(self, keys: Sequence[bytes], timeout_ms: int) -> bool:
        """Wait (holding ``_changed``) until every key is set; False on timeout or when the server closes."""
        deadline = time.monotonic() + timeout_ms / 1000
        while not all(k in self._data for k in keys):
            left = deadline - time.monotonic()
            if left <= 0 or self._closed:
                return False
            self._changed.wait(left)
        return True

    def _answer(self, op: int, items: list[bytes]) -> tuple[int, list[bytes]]:
        d = self._data
        with self._changed:
            if op == SET:
                d[items[0]] = items[1]
            elif op == MULTI_SET:
                d.update(zip(items[0::2], items[1::2]))
            elif op == APPEND:
                d[items[0]] = d.get(items[0], b"") + items[1]
            elif op in (GET, MULTI_GET, WAIT):
                keys = items[1:]
                if not self._wait_for(keys, int(items[0])):
                    return TIMEOUT, [k for k in keys if k not in d]
                return OK, [] if op == WAIT else [d[k] for k in keys]
            elif op == ADD:
                value = int(d.get(items[0], b"0")) + int(items[1])
                d[items[0]] = str(value).encode()
                self._changed.notify_all()
                return OK, [d[items[0]]]
            elif op == CAS:
                key, expected, desired = items
                current = d.get(key)
                if (current is None and expected == b"") or current == expected:
                    d[key] = desired
                    current = desired
                self._changed.notify_all()
                return OK, [expected if current is None else current]
            elif op == CHECK:
                return OK, [b"1" if all(k in d for k in items) else b"0"]
            elif op == DELETE:
                return OK, [b"1" if d.pop(items[0], None) is not None else b"0"]
            elif op == NUM_KEYS:
                return OK, [str(len(d)).encode()]
            else:
                return BAD_REQUEST, [f"unknown operation {op}".encode()]
            self._changed.notify_all()
            return OK, []


# ---- the client: a torch.distributed Store ----------------------------------------------------------------------
class RendezvousStore(dist.Store):
    """A connection to a job's :class:`StoreServer`, usable wherever torch takes a ``Store``.

    ``host``/``port``: where the server listens.  ``timeout``: how long ``get``/``wait`` wait for a key, and
    :meth:`connect` for the server to listen.  ``server``: the server this process hosts (rank 0), closed with
    :meth:`close`.  A server that refuses the secret raises :class:`StoreAuthError`.

    ``interrupted``: when set (a worker sets its ``WorkerState.peer_failed``), ``get``/``wait``/``multi_get`` wait
    in slices of :data:`WAIT_SLICE_S` and give up with ``DistNetworkError`` once it returns true -- a peer of this
    world died -- instead of waiting out ``timeout`` for a key that the dead rank would have set (``new_group``
    meeting a rank killed during a switch waited so for 60 s, and the recovery with it)."""

    #: what the launcher's halt interrupts: a ``get``/``wait`` polls it this often (seconds)
    WAIT_SLICE_S = 0.25

    def __init__(self, host: str, port: int, secret: str, timeout: timedelta,
                 server: StoreServer | None = None) -> None:
        super().__init__()
        self.host, self.port, self._secret, self._timeout = host, int(port), secret, timeout
        self.server = server
        self.interrupted: Callable[[], bool] | None = None
        dist.Store.set_timeout(self, timeout)
        self._lock = threading.Lock()
        self._sock = self._open()

    @classmethod
    def host_at(cls, addr: str, port: int, secret: str, timeout: timedelta) -> "RendezvousStore":
        """Start the store's server in this process (rank 0) at ``port`` and connect to it."""
        server = StoreServer(port, secret)
        return cls(addr, server.port, secret, timeout, server=server)

    @classmethod
    def connect(cls, addr: str, port: int, secret: str, timeout: timedelta) -> "RendezvousStore":
        """Connect to the store at ``addr:port``, retrying until it listens (within ``timeout``)."""
        return cls(addr, port, secret, timeout)

    # -- connection
    def _open(self) -> socket.socket:
        where = f"the job's rendezvous store at {self.host}:{self.port}"
        deadline = time.monotonic() + self._timeout.total_seconds()
        while True:
            try:
                sock = socket.create_connection((self.host, self.port), timeout=_HANDSHAKE_S)
                break
            except OSError as e:
                if time.monotonic() > deadline:
                    raise dist.DistStoreError(f"{where}: not reachable within {self._timeout.total_seconds():g} s "
                                              f"({e})") from None
                time.sleep(0.02)
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            hello = _recv_exact(sock, len(MAGIC) + _NONCE)
            if not hello.startswith(MAGIC):
                raise StoreAuthError(f"{where}: not an hspmd rendezvous store (it greeted with {hello[:16]!r})")
            challenge = secrets.token_bytes(_NONCE)
            sock.sendall(_mac(self._secret, b"client", hello[len(MAGIC):]) + challenge)
            status = _recv_exact(sock, 1)
            if status != b"\x01":
                raise StoreAuthError(f"{where}: refused this process's secret (not a worker of this job)")
            if not hmac.compare_digest(_recv_exact(sock, _MAC), _mac(self._secret, b"server", challenge)):
                raise StoreAuthError(f"{where}: the server did not prove it holds the job's secret")
        except (OSError, ConnectionError) as e:
            sock.close()
            if isinstance(e, StoreAuthError):
                raise
            raise StoreAuthError(f"{where}: the handshake failed ({e})") from None
        sock.settimeout(None)
        return sock

    def close(self) -> None:
        """Close this connection, and the server when this process hosts it."""
        try:
            self._sock.close()
        finally:
            if self.server is not None:
                self.server.close()

    def _request(self, op: int, items: Sequence[bytes], what: str) -> tuple[int, list[bytes]]:
        with self._lock:
            try:
                _send_frame(self._sock, op, items)
                return _recv_frame(self._sock)
            except OSError as e:  # the host (rank 0) is gone: what torch's TCPStore raises then, so that a
                # survivor of an elastic job reads it as a peer's death and recovers (it once exited instead)
                raise dist.DistNetworkError(f"{what}: rendezvous store at {self.host}:{self.port}: {e}") from e

    def _call(self, op: int, items: Sequence[bytes], what: str) -> list[bytes]:
        status, answer = self._request(op, items, what)
        if status != OK:
            raise dist.DistStoreError(f"{what}: {b''.join(answer).decode(errors='replace')}")
        return answer

    def _waiting(self, op: int, keys: Sequence[bytes], timeout: timedelta | None, what: str) -> list[bytes]:
        """``op`` (``GET``, ``WAIT``, ``MULTI_GET``), whose server side waits up to ``timeout`` for ``keys``: in
        slices when :attr:`interrupted` is set, so that a halt ends the wait."""
        total = (self._timeout if timeout is None or timeout == timedelta(0) else timeout).total_seconds()
        deadline = time.monotonic() + total
        while True:
            left = deadline - time.monotonic()
            wait = max(0.001, min(left, self.WAIT_SLICE_S) if self.interrupted is not None else left)
            asked = time.monotonic()
            status, answer = self._request(op, [str(int(wait * 1000)).encode(), *keys], what)
            if status == OK:
                return answer
            if status != TIMEOUT:
                raise dist.DistStoreError(f"{what}: {b''.join(answer).decode(errors='replace')}")
            names = [k.decode(errors="replace") for k in answer]  # the keys still missing
            if time.monotonic() - asked < 0.9 * wait:  # answered before its time: the server is closing
                raise dist.DistStoreError(f"{what}: the rendezvous store at {self.host}:{self.port} closed while "
                                          f"waiting for key(s) {names}")
            if self.interrupted is not None and self.interrupted():
                raise dist.DistNetworkError(f"{what}: given up waiting for key(s) {names} at {self.host}:"
                                            f"{self.port}: the launcher said a peer of this world died")
            if time.monotonic() >= deadline:
                raise dist.DistStoreError(f"{what}: timed out after {total:g} s waiting for key(s) {names} at "
                                          f"{self.host}:{self.port}")

    # -- the Store interface
    def set_timeout(self, timeout: timedelta) -> None:
        self._timeout = timeout
        dist.Store.set_timeout(self, timeout)

    def set(self, key: str, value: str | bytes) -> None:
        self._call(SET, [_b(key), _b(value)], "set")

    def get(self, key: str) -> bytes:
        return self._waiting(GET, [_b(key)], None, "get")[0]

    def add(self, key: str, value: int) -> int:
        return int(self._call(ADD, [_b(key), str(int(value)).encode()], "add")[0])

    def compare_set(self, key: str, expected_value: str | bytes, desired_value: str | bytes) -> bytes:
        return self._call(CAS, [_b(key), _b(expected_value), _b(desired_value)], "compare_set")[0]

    def wait(self, keys: list[str], timeout: timedelta | None = None) -> None:
        self._waiting(WAIT, list(map(_b, keys)), timeout, "wait")

    def check(self, keys: list[str]) -> bool:
        return self._call(CHECK, list(map(_b, keys)), "check")[0] == b"1"

    def delete_key(self, key: str) -> bool:
        return self._call(DELETE, [_b(key)], "delete_key")[0] == b"1"

    def num_keys(self) -> int:
        return int(self._call(NUM_KEYS, [], "num_keys")[0])

    def append(self, key: str, value: str | bytes) -> None:
        self._call(APPEND, [_b(key), _b(value)], "append")

    def multi_get(self, keys: list[str]) -> list[bytes]:
        return self._waiting(MULTI_GET, list(map(_b, keys)), None, "multi_get")

    def multi_set(self, keys: list[str], values: list[str | bytes]) -> None:
        self._call(MULTI_SET, [x for k, v in zip(keys, values) for x in (_b(k), _b(v))], "multi_set")

    def clone(self) -> "RendezvousStore":
        other = RendezvousStore(self.host, self.port, self._secret, self._timeout)
        other.interrupted = self.interrupted
        return other
