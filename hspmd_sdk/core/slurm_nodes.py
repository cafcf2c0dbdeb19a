"""A cluster read from the Slurm scheduler: one :class:`~.cluster.Node` per Slurm node (SPEC §10).

:func:`parse_scontrol_nodes` turns the text of ``scontrol show node -o`` (one node a line, ``Key=Value`` fields)
into :class:`SlurmNodeInfo` records; :func:`read_slurm_nodes` asks the scheduler (``scontrol``, which finds its
cluster through ``SLURM_CONF`` or ``/etc/slurm/slurm.conf``) and filters by partition and node names;
:func:`slurm_cluster_nodes` gives the nodes of ``Cluster.from_slurm``.

The rules, per node:

- **device kind**: the type of its GPU GRES (``gpu:h800:8`` -> ``H800``, matched case-insensitively against the
  device presets and the ``devices=`` given; an unknown type is kept as written and needs its spec in
  ``devices=``); a node whose GPU GRES has no type, or that has none, takes its first feature that names a known
  device kind (features such as ``ib`` or ``avx512`` name none and are skipped); otherwise ``cpu``.  A node with
  GPUs of two types is an error (a Node holds devices of one kind): name the nodes to use with ``nodes=``.
- **device count** (its ranks): the number of GPUs in its GRES; a node without GPU GRES runs **one** worker
  (a ``cpu`` node: one process; a node whose kind comes from a feature: one device, since Slurm does not say how
  many it has).
- **cores and memory**: ``CPUTot`` and ``RealMemory`` (MiB), kept on the records (``read_slurm_nodes``) for the
  resource preflight of :class:`~hspmd_sdk.runtime.transports.slurm.SlurmTransport`.

Nodes that cannot run a job now (``DOWN``, ``DRAIN``, ``FAIL``, ``NOT_RESPONDING``, ``FUTURE``) are left out
unless named in ``nodes=``, where they are an error naming their state and reason.
"""
from __future__ import annotations

import re
import shutil
import subprocess
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

from ..errors import HSPMDError, PlanValidationError

#: Node state words (``State=IDLE+DRAIN``, ``DOWN*``) under which a node runs no new job.
UNUSABLE_STATES = ("DOWN", "DRAIN", "FAIL", "NOT_RESPONDING", "FUTURE", "POWERED_DOWN", "POWER_DOWN", "INVAL")

_KEY = re.compile(r"^[A-Za-z][\w:/.]*=")


class SlurmError(HSPMDError):
    """Slurm could not be asked (no ``scontrol``/``srun``, no controller) or refused (names the command and what
    Slurm said)."""


@dataclass(frozen=True)
class SlurmNodeInfo:
    """One Slurm node as the scheduler declares it."""

    name: str
    address: str
    cpus: int
    memory_mb: int
    state: str
    partitions: tuple[str, ...] = ()
    features: tuple[str, ...] = ()
    gres: tuple[tuple[str, str | None, int], ...] = ()  #: ``(name, type or None, count)`` per GRES
    reason: str = ""

    @property
    def gpus(self) -> int:
        """GPUs in its GRES (every type)."""
        return sum(c for name, _, c in self.gres if name == "gpu")

    @property
    def gpu_types(self) -> list[str]:
        """The types of its GPU GRES, in order, once each (``[]``: none or untyped)."""
        out: list[str] = []
        for name, typ, _ in self.gres:
            if name == "gpu" and typ and typ not in out:
                out.append(typ)
        return out

    @property
    def usable(self) -> bool:
        """Whether the node can run a job now (up, not drained, responding)."""
        words = set(re.split(r"[+*~#!%$@^-]", self.state.upper()))
        return bool(self.state) and "*" not in self.state and not words & set(UNUSABLE_STATES)


def split_fields(line: str) -> dict[str, str]:
    """The ``Key=Value`` fields of one ``scontrol -o`` line; a value with spaces (``OS=Linux 6.1 #1 SMP``,
    ``Reason=Not responding [root@...]``) keeps the words up to the next ``Key=``."""
    out: dict[str, str] = {}
    key: str | None = None
    for word in line.split(" "):
        if _KEY.match(word):
            key, _, value = word.partition("=")
            out[key] = value
        elif key is not None and word:
            out[key] += " " + word
    return out


def parse_gres(text: str) -> tuple[tuple[str, str | None, int], ...]:
    """``gpu:h800:8(S:0-1),nic:2`` -> ``(("gpu", "h800", 8), ("nic", None, 2))``; ``(null)`` -> ``()``."""
    out = []
    for item in re.split(r",(?![^(]*\))", text.strip()):
        item = re.sub(r"\(.*\)$", "", item.strip())  # bindings; "(null)" becomes "" here
        if not item or item == "N/A":
            continue
        parts = item.split(":")
        count = 1
        if len(parts) > 1 and re.fullmatch(r"\d+[KMG]?", parts[-1]):
            count = _count(parts.pop())
        out.append((parts[0], parts[1] if len(parts) > 1 else None, count))
    return tuple(out)


def _count(text: str) -> int:
    scale = {"K": 1024, "M": 1024**2, "G": 1024**3}.get(text[-1], 1)
    return int(text.rstrip("KMG")) * scale


def _csv(text: str | None) -> tuple[str, ...]:
    return tuple(x for x in (text or "").split(",") if x and x != "(null)")


def _int(fields: Mapping[str, str], key: str, where: str) -> int:
    text = fields.get(key, "")
    try:
        return int(text)
    except ValueError:
        raise PlanValidationError([(f"{where}.{key}", f"{text[:40]!r} is not a whole number")],
                                  what="scontrol output") from None


def parse_scontrol_nodes(text: str) -> list[SlurmNodeInfo]:
    """The nodes in the text of ``scontrol show node -o`` (one node a line), in its order."""
    nodes = []
    for lineno, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        f = split_fields(line.strip())
        if "NodeName" not in f:
            raise PlanValidationError([(f"line {lineno}", f"no NodeName= in {line[:80]!r}")], what="scontrol output")
        where = f"line {lineno} ({f['NodeName']})"
        nodes.append(SlurmNodeInfo(
            name=f["NodeName"], address=f.get("NodeAddr") or f["NodeName"], cpus=_int(f, "CPUTot", where),
            memory_mb=_int(f, "RealMemory", where), state=f.get("State", ""), partitions=_csv(f.get("Partitions")),
            features=_csv(f.get("AvailableFeatures")), gres=parse_gres(f.get("Gres", "")), reason=f.get("Reason", "")))
    return nodes


def device_kind(node: SlurmNodeInfo, known: Sequence[str]) -> str:
    """The device kind of ``node`` (module docstring); ``known``: device kinds with a spec (presets, given)."""
    by_lower = {k.lower(): k for k in known}
    types = node.gpu_types
    if len(types) > 1:
        raise PlanValidationError([(f"nodes.{node.name}.gres", f"GPUs of {len(types)} types ({', '.join(types)}) "
                                    "on one node; a node holds devices of one kind: leave it out with nodes=")],
                                  what="cluster from Slurm")
    if types:
        return by_lower.get(types[0].lower(), types[0])
    for feat in node.features:
        if feat.lower() in by_lower and by_lower[feat.lower()] != "cpu":
            return by_lower[feat.lower()]
    return "cpu"


#: What Slurm's clients print when they find no controller: no configuration (no ``SLURM_CONF``, no
#: ``/etc/slurm/slurm.conf``: they fall back to DNS SRV records, which find none), or one that does not answer.
NO_CONTROLLER = ("Could not establish a configuration source", "DNS SRV lookup failed",
                 "Unable to contact slurm controller")


def scontrol(*args: str, timeout_s: float = 30.0) -> str:
    """Run ``scontrol ARGS``; its stdout, or :class:`SlurmError` with what it said."""
    exe = shutil.which("scontrol")
    if exe is None:
        raise SlurmError("Slurm's scontrol is not on PATH: install Slurm's clients (Debian: slurm-client) or run "
                         "where Slurm is")
    try:
        r = subprocess.run([exe, *args], capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        raise SlurmError(f"scontrol {' '.join(args)}: no answer from slurmctld in {timeout_s:g} s") from None
    if r.returncode != 0:
        said = (r.stderr or r.stdout).strip()
        if any(sign in said for sign in NO_CONTROLLER):
            last = said.splitlines()[-1].strip()[:200]  # said holds a sign: not empty
            raise SlurmError(f"no Slurm controller found (is SLURM_CONF set / is slurmctld running?): "
                             f"scontrol {' '.join(args)} said {last!r}")
        raise SlurmError(f"scontrol {' '.join(args)} failed (exit status {r.returncode}): {said[:500]}")
    return r.stdout


def read_slurm_nodes(partition: str | None = None, nodes: str | Sequence[str] | None = None) -> list[SlurmNodeInfo]:
    """The scheduler's nodes of ``partition`` (default: every partition), or those named in ``nodes`` (names or
    a Slurm host list such as ``"n[1-4]"``); unusable nodes left out unless named (then an error)."""
    named: list[str] | None = None
    if nodes is not None:
        expr = nodes if isinstance(nodes, str) else ",".join(nodes)
        named = scontrol("show", "hostnames", expr).split()
        if not named:
            raise PlanValidationError([("nodes", f"{expr!r} names no node")], what="cluster from Slurm")
    found = parse_scontrol_nodes(scontrol("show", "node", "-o"))  # all: a list naming an unknown node fails whole
    by_name = {n.name: n for n in found}
    if named is not None:
        missing = [n for n in named if n not in by_name]
        if missing:
            raise PlanValidationError([("nodes", f"Slurm has no node {', '.join(missing)}")], what="cluster from Slurm")
        found = [by_name[n] for n in named]
    if partition is not None:
        outside = [n.name for n in found if partition not in n.partitions]
        if named is not None and outside:
            raise PlanValidationError([("nodes", f"{', '.join(outside)} not in partition {partition!r}")],
                                      what="cluster from Slurm")
        found = [n for n in found if partition in n.partitions]
    if named is not None:
        bad = [n for n in found if not n.usable]
        if bad:
            raise PlanValidationError([(f"nodes.{n.name}", f"cannot run a job now: state {n.state}"
                                        + (f" ({n.reason})" if n.reason else "")) for n in bad],
                                      what="cluster from Slurm")
    found = [n for n in found if n.usable]
    if not found:
        where = f"partition {partition!r}" if partition else "the cluster"
        raise PlanValidationError([("partition" if partition else "nodes", f"no usable Slurm node in {where}")],
                                  what="cluster from Slurm")
    return found


def slurm_cluster_nodes(partition: str | None = None, nodes: str | Sequence[str] | None = None, *,
                        known: Sequence[str] = ("cpu",)) -> list[dict[str, Any]]:
    """The ``nodes`` of ``Cluster.from_slurm``: one ``{"host", "kind", "ranks", "cpus", "memory_mb"}`` per usable
    Slurm node (host = its Slurm name), ranks in node order; ``known``: the device kinds with a spec (presets and
    those given)."""
    out, rank = [], 0
    for info in read_slurm_nodes(partition, nodes):
        count = info.gpus or 1
        out.append({"host": info.name, "kind": device_kind(info, known), "ranks": list(range(rank, rank + count)),
                    "cpus": info.cpus if info.cpus > 0 else None,
                    "memory_mb": info.memory_mb if info.memory_mb > 0 else None})
        rank += count
    return out
