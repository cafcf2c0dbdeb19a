"""The SSH preflight: what a host must have before any worker starts there, and the report of it.

A probe is one short Python script run on each host over its SSH connection (:data:`PROBE_SCRIPT`): the host's
Python, torch and hspmd_sdk versions, cores, available memory, a free port and, for hosts of GPU ranks, CUDA
devices.  :func:`check_cluster` probes every host of a cluster in parallel and names, per host, what is wrong
(:class:`PreflightReport`, printed as a table; :class:`PreflightError` when it failed).  It runs through any
transport that can run a command on a host (:class:`SSHCommands`: the :class:`~.ssh.SSHTransport`).
"""
from __future__ import annotations

import json
import os
import threading
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Mapping, Protocol

import hspmd_sdk

from .hosts import SSHError, SSHHost, remote_command

if TYPE_CHECKING:
    from ...core.cluster import Cluster

__all__ = ["PROBE_SCRIPT", "HostReport", "PreflightReport", "PreflightError", "SSHCommands", "check_cluster",
           "probe_into", "merge_nodes", "threads_per_worker"]


class SSHCommands(Protocol):
    """What the preflight needs of a transport: each host's settings, a name for messages, a command run, and
    a place for each host's probe facts."""

    probes: dict[str, dict[str, Any]]

    def settings(self, host: str) -> SSHHost: ...

    def where(self, host: str) -> str: ...

    def run_command(self, host: str, command: str, timeout_s: float = 60.0) -> tuple[int | None, str, str]: ...


class PreflightError(SSHError):
    """The hosts' preflight check failed; ``report`` says, per host, what is wrong."""

    def __init__(self, report: "PreflightReport") -> None:
        self.report = report
        super().__init__("preflight check failed, nothing was started:\n" + report.problems_text()
                         + "\n\n" + str(report))


#: The probe run on each host (``python -c PROBE_SCRIPT cuda|cpu``); it prints one ``@probe {json}`` line.
PROBE_SCRIPT = r"""
import json, os, platform, shutil, socket, sys
from importlib import metadata, util
out = {"python": platform.python_version(), "executable": sys.executable, "hostname": socket.gethostname(),
       "cpus": os.cpu_count(), "setsid": bool(shutil.which("setsid")), "cwd": os.getcwd()}
try:
    import hspmd_sdk
    out["hspmd_sdk"] = hspmd_sdk.__version__
except Exception as e:
    out["hspmd_sdk_error"] = "%s: %s" % (type(e).__name__, e)
try:
    if util.find_spec("torch") is None:
        raise ImportError("No module named 'torch'")
    out["torch"] = metadata.version("torch")
    if sys.argv[1:] == ["cuda"]:  # importing torch takes seconds: only when the host must have GPUs
        import torch
        n = torch.cuda.device_count() if torch.cuda.is_available() else 0
        out["cuda_devices"] = n
        out["device_names"] = [torch.cuda.get_device_name(i) for i in range(n)]
except Exception as e:
    out["torch_error"] = "%s: %s" % (type(e).__name__, e)
try:
    with open("/proc/meminfo") as f:
        out["mem_available"] = [int(l.split()[1]) * 1024 for l in f if l.startswith("MemAvailable:")][0]
except Exception:
    pass
s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
s.bind(("", 0))
out["free_port"] = s.getsockname()[1]
s.close()
print("@probe " + json.dumps(out))
"""


@dataclass
class HostReport:
    """What the preflight found on one host."""

    host: str
    address: str
    port: int
    ranks: list[int]
    kind: str
    reachable: bool = False
    error: str | None = None
    python: str | None = None
    torch: str | None = None
    hspmd_sdk: str | None = None
    cuda_devices: int = 0
    device_names: list[str] = field(default_factory=list)
    cpus: int | None = None
    free_port: int | None = None
    problems: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return self.reachable and not self.problems

    def devices_text(self) -> str:
        if self.cuda_devices:
            names = sorted(set(self.device_names))
            return f"{self.cuda_devices} x {', '.join(names)}"
        return f"cpu ({self.cpus} cores)" if self.cpus else "-"


@dataclass
class PreflightReport:
    """Per-host preflight results; ``ok`` when every host passed."""

    hosts: list[HostReport]
    local_version: str

    @property
    def ok(self) -> bool:
        return all(h.ok for h in self.hosts)

    def __getitem__(self, host: str) -> HostReport:
        for h in self.hosts:
            if h.host == host:
                return h
        raise KeyError(host)

    def problems_text(self) -> str:
        return "\n".join(f"  {h.host} ({h.address}:{h.port}): {p}" for h in self.hosts for p in
                         ([h.error] if h.error else h.problems))

    def raise_if_failed(self) -> "PreflightReport":
        if not self.ok:
            raise PreflightError(self)
        return self

    def rows(self) -> list[list[str]]:
        return [[h.host, f"{h.address}:{h.port}", "yes" if h.reachable else "NO", h.python or "-", h.torch or "-",
                 h.hspmd_sdk or "-", h.devices_text(), f"{len(h.ranks)} x {h.kind}",
                 "ok" if h.ok else "; ".join([h.error] if h.error else h.problems)] for h in self.hosts]

    _HEAD = ["host", "ssh", "reachable", "python", "torch", "hspmd_sdk", "devices", "ranks", "status"]

    def __str__(self) -> str:
        rows = [self._HEAD, *self.rows()]
        widths = [max(len(r[i]) for r in rows) for i in range(len(self._HEAD))]
        return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows)

    def _repr_html_(self) -> str:
        import html

        cells = lambda row, tag: "".join(f"<{tag}>{html.escape(c)}</{tag}>" for c in row)  # noqa: E731
        body = "".join(f"<tr style='color:{'inherit' if h.ok else '#b00'}'>{cells(r, 'td')}</tr>"
                       for h, r in zip(self.hosts, self.rows()))
        return f"<table><tr>{cells(self._HEAD, 'th')}</tr>{body}</table>"



def check_cluster(transport: SSHCommands, cluster: "Cluster", timeout_s: float = 60.0) -> PreflightReport:
    """Probe every host of ``cluster`` (in parallel): reachable, Python, torch, hspmd_sdk, devices."""
    reports = [HostReport(host=n.host, address=transport.settings(n.host).address_of(n.host),
                          port=transport.settings(n.host).port, ranks=list(n.ranks), kind=n.kind)
               for n in cluster.nodes]
    per_host: dict[str, list[HostReport]] = {}
    for rep in reports:
        per_host.setdefault(rep.host, []).append(rep)
    threads = [threading.Thread(target=probe_into, args=(transport, host, reps, timeout_s), daemon=True)
               for host, reps in per_host.items()]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout_s + 30)
    report = PreflightReport(merge_nodes(reports), hspmd_sdk.__version__)
    torches = {h.torch for h in report.hosts if h.torch}
    for h in report.hosts:
        if h.reachable and h.hspmd_sdk and h.hspmd_sdk != report.local_version:
            h.problems.append(f"hspmd_sdk {h.hspmd_sdk} differs from this kernel's {report.local_version}: "
                              "install the same version on every host")
        if h.reachable and len(torches) > 1:
            h.problems.append(f"torch versions differ between hosts ({', '.join(sorted(torches))})")
    return report


def probe_into(transport: SSHCommands, host: str, reps: list[HostReport], timeout_s: float) -> None:
    s = transport.settings(host)
    gpu = any(rep.kind.lower() != "cpu" for rep in reps)
    try:
        rc, out, err = transport.run_command(host, remote_command(s, ["-c", PROBE_SCRIPT, "cuda" if gpu else "cpu"]),
                                        timeout_s)
    except SSHError as e:
        for rep in reps:
            rep.error = str(e).removeprefix(transport.where(host) + ": ")
        return
    except BaseException as e:  # noqa: BLE001 - a timeout or a dropped connection: report it per host
        for rep in reps:
            rep.error = f"probe failed: {type(e).__name__}: {e}"
        return
    info: dict[str, Any] | None = None
    for line in out.splitlines():
        if line.startswith("@probe "):
            info = json.loads(line[len("@probe "):])
    for rep in reps:
        rep.reachable = True
        if info is None:
            tail = (err.strip().splitlines() or ["no output"])[-1]
            rep.problems.append(f"cannot run Python {' '.join(s.python_argv())!r}"
                                + (f" in {s.workdir!r}" if s.workdir else "") + f" (exit status {rc}): {tail}")
            continue
        transport.probes[host] = info
        rep.python, rep.torch, rep.hspmd_sdk = info.get("python"), info.get("torch"), info.get("hspmd_sdk")
        rep.cuda_devices, rep.device_names = int(info.get("cuda_devices") or 0), info.get("device_names") or []
        rep.cpus, rep.free_port = info.get("cpus"), info.get("free_port")
        if "hspmd_sdk_error" in info:
            rep.problems.append(f"hspmd_sdk is not importable by {info['executable']}: {info['hspmd_sdk_error']}")
        if "torch_error" in info:
            rep.problems.append(f"torch is not importable by {info['executable']}: {info['torch_error']}")
        if not info.get("setsid"):
            rep.problems.append("the 'setsid' command (util-linux) is missing")
        if rep.kind.lower() != "cpu" and rep.cuda_devices < len(rep.ranks):
            rep.problems.append(f"the cluster puts {len(rep.ranks)} {rep.kind} ranks on this host but it has "
                                f"{rep.cuda_devices} CUDA devices")


def merge_nodes(reports: list[HostReport]) -> list[HostReport]:
    """One report per host (a host named by several nodes gets all their ranks)."""
    out: dict[str, HostReport] = {}
    for r in reports:
        if r.host in out:
            out[r.host].ranks += r.ranks
        else:
            out[r.host] = r
    return list(out.values())


def threads_per_worker(probes: Mapping[str, Mapping[str, Any]], cluster: "Cluster") -> int:
    """Threads per worker: the fewest cores per rank over the cluster's hosts (from their probes)."""
    counts: dict[str, int] = {}
    for n in cluster.nodes:
        counts[n.host] = counts.get(n.host, 0) + len(n.ranks)
    per = [max(1, int(probes.get(h, {}).get("cpus") or os.cpu_count() or 1) // c)
           for h, c in counts.items()]
    return max(1, min(per))
