"""The cluster model: device kinds, nodes (hosts), links between ranks.

Ranks are numbered by the order of ``nodes`` and, inside a node, by ``Node.ranks``.  Two ranks on one node talk
over the node's intra-node link (NVLink figures from the device preset); ranks on different nodes over the
inter-node network (``inter_bandwidth_gbs``, ``inter_latency_us``).  A host may hold several nodes (a box of mixed
GPU kinds: one ``Node`` per kind, the same ``host``); its devices of different nodes talk over
``host_bandwidth_gbs`` where it is given (PCIe, or NVLink between the kinds), an intra-host link, else over the
inter-node network.  Bandwidths are GB/s (1e9 bytes/s) per direction per device, as vendors and the paper's
Table 7 quote them.
"""
from __future__ import annotations

import math
from functools import cached_property
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, Mapping

from pydantic import BaseModel, ConfigDict, Field, model_validator

from ..errors import PlanValidationError
from .annotation import MAX_RANK
from .loading import load_model
from .slurm_nodes import slurm_cluster_nodes

#: The most ranks a cluster may have (far above the largest training clusters; a typo such as 100000000 would
#: otherwise build for minutes).
MAX_RANKS = MAX_RANK + 1


class DeviceSpec(BaseModel):
    """One device kind: memory, peak bf16 throughput, intra-node (NVLink-class) bandwidth."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    kind: str = Field(min_length=1)
    memory_mb: int = Field(gt=0, description="device memory in MiB, as nvidia-smi reports it (81559 MiB = 79.6 GiB)")
    bf16_tflops: float = Field(gt=0, description="peak dense bf16 TFLOPS")
    intra_bandwidth_gbs: float = Field(gt=0, description="intra-node bandwidth per device, GB/s")

    @property
    def memory_bytes(self) -> int:
        """Device memory in bytes (``memory_mb`` MiB)."""
        return self.memory_mb * 2**20

    def describe(self) -> str:
        """``79.6 GiB, 990 TFLOPS bf16, NVLink 400 GB/s``; a ``cpu`` device (a local worker process) is described
        by what it is, with its nominal figures, and not as having NVLink."""
        if self.kind == LOCAL_KIND:
            return (f"local worker process, nominal {format_memory(self.memory_bytes)}, "
                    f"{self.bf16_tflops:g} TFLOPS bf16, {self.intra_bandwidth_gbs:g} GB/s between processes")
        return (f"{format_memory(self.memory_bytes)}, {self.bf16_tflops:g} TFLOPS bf16, "
                f"NVLink {self.intra_bandwidth_gbs:g} GB/s")


#: The device kind of a local worker process (tests, demos, ``hspmd run --local``).
LOCAL_KIND = "cpu"


def format_memory(nbytes: float) -> str:
    """Memory, the one convention of every display (CLI, ``Strategy.summary``, the editor): binary units,
    ``79.6 GiB``; below a tenth of a GiB ``12.3 MiB``.  Bandwidths and traffic stay decimal (GB/s, as vendors
    quote them)."""
    if nbytes >= 0.1 * 2**30:
        return f"{nbytes / 2**30:.1f} GiB"
    return f"{nbytes / 2**20:.1f} MiB"


def format_count(n: float) -> str:
    """A count such as a number of parameters: ``197.2K``, ``6.74B``, ``1.2M``, ``512``."""
    for unit, scale in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if abs(n) >= scale:
            v = n / scale
            return f"{v:.2f}{unit}" if v < 10 else f"{v:.1f}{unit}" if v < 100 else f"{v:.0f}{unit}"
    return f"{n:.0f}"


#: Device presets.  H800 and H20 are the paper's Table 7; the others are vendor figures (SXM parts).
#: ``cpu`` is a local process used for tests and demos (its figures are nominal; profile for real ones).
DEVICE_PRESETS: dict[str, DeviceSpec] = {
    s.kind: s
    for s in (
        DeviceSpec(kind="H800", memory_mb=81559, bf16_tflops=990, intra_bandwidth_gbs=400),
        DeviceSpec(kind="H20", memory_mb=97871, bf16_tflops=148, intra_bandwidth_gbs=900),
        DeviceSpec(kind="A100", memory_mb=81920, bf16_tflops=312, intra_bandwidth_gbs=600),
        DeviceSpec(kind="H100", memory_mb=81559, bf16_tflops=989, intra_bandwidth_gbs=900),
        DeviceSpec(kind="H200", memory_mb=143771, bf16_tflops=989, intra_bandwidth_gbs=900),
        DeviceSpec(kind="cpu", memory_mb=8192, bf16_tflops=0.5, intra_bandwidth_gbs=5),
    )
}


class Node(BaseModel):
    """A host and the ranks of its devices (all of one kind); ``cpus`` and ``memory_mb``: the host's cores and RAM
    where known (``Cluster.from_slurm`` reads them from the scheduler; ``None``: not said)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    host: str = Field(min_length=1)
    kind: str = Field(min_length=1)
    ranks: list[int] = Field(min_length=1)
    cpus: int | None = Field(default=None, ge=1, exclude_if=lambda v: v is None)  # (JSON unchanged when unknown)
    memory_mb: int | None = Field(default=None, ge=1, exclude_if=lambda v: v is None)


@dataclass(frozen=True)
class Link:
    """The link between two ranks: class (``self``/``intra``/``inter``), bandwidth in bytes/s, latency in s."""

    cls: Literal["self", "intra", "inter"]
    bandwidth: float
    latency: float

    def time(self, nbytes: int) -> float:
        """Seconds to move ``nbytes`` over this link (latency + bytes / bandwidth); 0 for ``self``."""
        return 0.0 if self.cls == "self" or nbytes == 0 else self.latency + nbytes / self.bandwidth


class Cluster(BaseModel):
    """Devices grouped into nodes, with the links between them.

    >>> Cluster.mixed({"H800": 16, "H20": 32}).num_ranks
    48
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    nodes: list[Node] = Field(min_length=1)
    devices: dict[str, DeviceSpec] = Field(default_factory=dict,
                                           description="specs of the kinds used; presets fill in missing ones")
    inter_bandwidth_gbs: float = Field(default=25.0, gt=0, description="inter-node bandwidth per device, GB/s")
    inter_latency_us: float = Field(default=5.0, ge=0)
    intra_latency_us: float = Field(default=1.0, ge=0)
    host_bandwidth_gbs: float | None = Field(
        default=None, gt=0, description="bandwidth per device between nodes of one host (a box of mixed kinds: "
                                        "PCIe ~64), GB/s; None: such devices talk over the inter-node network")

    @model_validator(mode="before")
    @classmethod
    def _fill_presets(cls, data: Any) -> Any:
        if isinstance(data, dict) and isinstance(data.get("nodes"), list):
            devices = data.get("devices") or {}
            if not isinstance(devices, dict):
                return data  # pydantic reports the wrong type at 'devices'
            devices = dict(devices)
            for node in data["nodes"]:
                kind = node.get("kind") if isinstance(node, dict) else getattr(node, "kind", None)
                if isinstance(kind, str) and kind not in devices and kind in DEVICE_PRESETS:
                    devices[kind] = DEVICE_PRESETS[kind]
            data = {**data, "devices": devices}
        return data

    @model_validator(mode="after")
    def _check(self) -> "Cluster":
        for i, node in enumerate(self.nodes):
            if node.kind not in self.devices:
                raise ValueError(f"nodes[{i}].kind: unknown device kind {node.kind!r}; give its spec in "
                                 f"'devices' or use a preset ({', '.join(DEVICE_PRESETS)})")
        for kind, spec in self.devices.items():
            if spec.kind != kind:
                raise ValueError(f"devices[{kind!r}].kind is {spec.kind!r}; it must equal its key")
        ranks = [r for n in self.nodes for r in n.ranks]
        if len(ranks) > MAX_RANKS:
            raise ValueError(f"nodes: {len(ranks)} ranks is more than the {MAX_RANKS} a cluster may have")
        if sorted(ranks) != list(range(len(ranks))):
            dup = sorted({r for r in ranks if ranks.count(r) > 1})
            missing = sorted(set(range(len(ranks))) - set(ranks))
            raise ValueError(f"nodes: ranks must be 0..{len(ranks) - 1}, each once"
                             + (f"; repeated: {dup}" if dup else "") + (f"; missing: {missing}" if missing else ""))
        return self

    @cached_property
    def _rank_node(self) -> tuple[int, ...]:
        """Node index of every rank (a plain cached tuple: link queries are on the planners' hot path)."""
        rank_node = [0] * sum(len(n.ranks) for n in self.nodes)
        for i, n in enumerate(self.nodes):
            for r in n.ranks:
                rank_node[r] = i
        return tuple(rank_node)

    # ---- constructors --------------------------------------------------------------------------------------
    @classmethod
    def homogeneous(cls, kind: str, n: int, *, per_node: int = 8, **kw: Any) -> "Cluster":
        """``n`` devices of one kind, ``per_node`` to a node."""
        return cls.mixed({kind: n}, per_node=per_node, **kw)

    @classmethod
    def mixed(cls, counts: Mapping[str, int], *, per_node: int = 8, **kw: Any) -> "Cluster":
        """Devices of several kinds, ``per_node`` to a node, ranks in the order given.

        ``Cluster.mixed({"H800": 16, "H20": 32})`` is the paper's cluster: ranks 0-15 H800, 16-47 H20.
        """
        _check_counts({k: c for k, c in counts.items()}, per_node)
        nodes, rank = [], 0
        for kind, count in counts.items():
            left = count
            while left > 0:
                take = min(per_node, left)
                nodes.append({"host": f"node{len(nodes)}", "kind": kind, "ranks": list(range(rank, rank + take))})
                rank += take
                left -= take
        return cls.load({"nodes": nodes, **kw})

    @classmethod
    def local(cls, n: int, kind: str = "cpu") -> "Cluster":
        """``n`` worker processes on this machine (one node, ``localhost``)."""
        _check_counts({kind: n}, 1)
        return cls.load({"nodes": [{"host": "localhost", "kind": kind, "ranks": list(range(n))}]})

    @classmethod
    def from_hostfile(cls, path: str | Path, *, default_kind: str = "cpu", **kw: Any) -> "Cluster":
        """Read a DeepSpeed-style hostfile: ``host slots=N [kind=H20]`` a line, ``#`` comments."""
        nodes, rank = [], 0
        for lineno, raw in enumerate(_read_hostfile(path).splitlines(), 1):
            line = raw.split("#", 1)[0].strip()
            if not line:
                continue
            where = f"{path}:{lineno}"
            host, *opts = line.split()
            fields: dict[str, str] = {}
            for opt in opts:
                k, sep, v = opt.partition("=")
                if not sep or k not in ("slots", "kind"):
                    raise PlanValidationError([(where, f"cannot read {opt[:60]!r}; expected slots=N or kind=NAME")],
                                              what="hostfile")
                if k in fields:
                    raise PlanValidationError([(where, f"{k} is given twice ({k}={fields[k]} and {opt[:60]})")],
                                              what="hostfile")
                fields[k] = v
            text = fields.get("slots", "1")
            try:
                slots = int(text) if len(text) <= 20 else None
            except ValueError:
                slots = None
            if slots is None:
                raise PlanValidationError([(where, f"slots={text[:60]!r} is not an integer")], what="hostfile")
            if slots < 1:
                raise PlanValidationError([(where, f"slots={slots} must be >= 1")], what="hostfile")
            if slots > MAX_RANKS - rank:
                raise PlanValidationError([(where, f"slots={slots} is too many: a cluster has at most {MAX_RANKS} "
                                                   "ranks")], what="hostfile")
            nodes.append({"host": host, "kind": fields.get("kind", default_kind),
                          "ranks": list(range(rank, rank + slots))})
            rank += slots
        if not nodes:
            raise PlanValidationError([(str(path), "no hosts in hostfile")], what="hostfile")
        return cls.load({"nodes": nodes, **kw})

    @classmethod
    def from_slurm(cls, partition: str | None = None, nodes: str | list[str] | None = None,
                   **kw: Any) -> "Cluster":
        """Read the cluster from the Slurm scheduler: one node per usable Slurm node of ``partition`` (or those
        named in ``nodes``, e.g. ``"gpu[01-04]"``), its kind from its GPU GRES type (else a feature naming a
        device kind, else ``cpu``), one rank per GPU (one for a node without GPU GRES), its cores and memory.  ``kw``: further fields
        (``devices`` for kinds that are no preset).  Rules: :mod:`hspmd_sdk.core.slurm_nodes`."""
        known = [*DEVICE_PRESETS, *(kw.get("devices") or {})]
        return cls.load({"nodes": slurm_cluster_nodes(partition, nodes, known=known), **kw})

    @classmethod
    def load(cls, data: Any) -> "Cluster":
        """Validate a dict, a JSON string or a path; raises ``PlanValidationError`` with field paths."""
        return load_model(cls, data, what="cluster")

    # ---- queries -------------------------------------------------------------------------------------------
    @property
    def num_ranks(self) -> int:
        return len(self._rank_node)

    @property
    def ranks(self) -> list[int]:
        return list(range(self.num_ranks))

    def check_rank(self, rank: int) -> None:
        if not 0 <= rank < self.num_ranks:
            raise IndexError(f"rank {rank} is not in the cluster ({self.num_ranks} ranks: 0..{self.num_ranks - 1})")

    def node_index(self, rank: int) -> int:
        """Index into ``nodes`` of the node holding ``rank``."""
        if rank < 0:
            self.check_rank(rank)
        try:
            return self._rank_node[rank]
        except IndexError:
            self.check_rank(rank)
            raise

    def node_of(self, rank: int) -> Node:
        return self.nodes[self.node_index(rank)]

    def spec(self, rank: int) -> DeviceSpec:
        """The device spec of ``rank``."""
        return self.devices[self.node_of(rank).kind]

    def kind(self, rank: int) -> str:
        return self.node_of(rank).kind

    def link(self, a: int, b: int) -> Link:
        """The link between ranks ``a`` and ``b``: class, bandwidth (bytes/s), latency (s)."""
        if a == b:
            self.check_rank(a)
            return Link("self", math.inf, 0.0)
        na, nb = self.node_index(a), self.node_index(b)
        if na == nb:  # one node: one kind, its own bandwidth
            bw = self.devices[self.nodes[na].kind].intra_bandwidth_gbs
            return Link("intra", bw * 1e9, self.intra_latency_us * 1e-6)
        if self.host_bandwidth_gbs is not None and self.nodes[na].host == self.nodes[nb].host:
            return Link("intra", self.host_bandwidth_gbs * 1e9, self.intra_latency_us * 1e-6)
        return Link("inter", self.inter_bandwidth_gbs * 1e9, self.inter_latency_us * 1e-6)

    def kinds(self) -> dict[str, int]:
        """Device kind -> count, in rank order of first appearance."""
        out: dict[str, int] = {}
        for n in self.nodes:
            out[n.kind] = out.get(n.kind, 0) + len(n.ranks)
        return out

    def __str__(self) -> str:
        kinds = ", ".join(f"{c} {k}" for k, c in self.kinds().items())
        return f"Cluster({self.num_ranks} ranks on {len(self.nodes)} nodes: {kinds})"


def _check_counts(counts: Mapping[str, Any], per_node: Any) -> None:
    """Device counts (and devices per node) of a constructor: integers, >= 1, at most :data:`MAX_RANKS` in all."""
    problems = [(f"counts[{k!r}]", f"{c!r} is not a whole number >= 1") for k, c in counts.items()
                if isinstance(c, bool) or not isinstance(c, int) or c < 1]
    if isinstance(per_node, bool) or not isinstance(per_node, int) or per_node < 1:
        problems.append(("per_node", f"{per_node!r} is not a whole number >= 1"))
    if not problems and sum(counts.values()) > MAX_RANKS:
        problems.append(("counts", f"{sum(counts.values())} ranks is more than the {MAX_RANKS} a cluster may have"))
    if problems:
        raise PlanValidationError(problems, what="cluster")


def _read_hostfile(path: str | Path) -> str:
    try:
        return Path(path).read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise PlanValidationError([(str(path), f"not UTF-8 text (byte {e.start}): a binary file?")],
                                  what="hostfile") from None
    except (OSError, ValueError) as e:
        why = getattr(e, "strerror", None) or e
        reason = "no such file" if isinstance(e, FileNotFoundError) else f"cannot read: {why}"
        raise PlanValidationError([(str(path), reason)], what="hostfile") from None
