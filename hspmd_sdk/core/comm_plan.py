"""``CommPlan``: the resolved communication of one Reshard (what :func:`resolve` returns).

Volumes and times are computed from each operator's transfers (``(sender, receiver, bytes, steps)``, ring
algorithms for collectives, see :mod:`.comm_ops`):

* ``volume()``: bytes each rank sends, split by the class of the link to the receiver: ``"intra"`` (same node)
  or ``"inter"``.  Without a cluster every rank counts as on one node (all ``"intra"``).
* ``estimated_time(cluster)``: operators run one after another; an operator lasts as long as its slowest
  sender, whose time is the sum over its transfers of ``bytes / link bandwidth + steps * link latency``.
"""
from __future__ import annotations

import html
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Iterable, Mapping

from .annotation import Annotation
from .comm_ops import CommOp, OpKind, Transfer

if TYPE_CHECKING:
    from .cluster import Cluster

__all__ = ["CommPlan", "volume_by_rank", "time_of", "volume_table", "pick_unit"]


def _link_class(cluster: "Cluster | None", src: int, dst: int) -> str:
    if cluster is None:
        return "intra"
    return "intra" if cluster.link(src, dst).cls != "inter" else "inter"


def volume_by_rank(transfers: Iterable[Transfer], cluster: "Cluster | None",
                   ranks: Iterable[int] = ()) -> dict[int, dict[str, int]]:
    """``{rank: {"intra": bytes, "inter": bytes}}`` sent, for ``ranks`` and every sender."""
    out: dict[int, dict[str, int]] = {r: {"intra": 0, "inter": 0} for r in ranks}
    for src, dst, nbytes, _ in transfers:
        if src == dst:
            continue
        out.setdefault(src, {"intra": 0, "inter": 0})[_link_class(cluster, src, dst)] += nbytes
    return dict(sorted(out.items()))


def time_of(steps: Iterable[Iterable[Transfer]], cluster: "Cluster") -> float:
    """Seconds for operators run in sequence, each lasting as long as its slowest sender."""
    total = 0.0
    for transfers in steps:
        per_rank: dict[int, float] = {}
        for src, dst, nbytes, n in transfers:
            if src == dst or nbytes == 0:
                continue
            link = cluster.link(src, dst)
            per_rank[src] = per_rank.get(src, 0.0) + nbytes / link.bandwidth + n * link.latency
        total += max(per_rank.values(), default=0.0)
    return total


def pick_unit(volume: Mapping[int, Mapping[str, int]]) -> tuple[str, float]:
    """``("MB", 1e6)`` when some rank sends a megabyte or more, else ``("B", 1)``."""
    big = max((max(v.values(), default=0) for v in volume.values()), default=0)
    return ("MB", 1e6) if big >= 1e6 else ("B", 1.0)


def volume_table(volume: Mapping[int, Mapping[str, int]], *, per_line: int = 4, unit: float | None = None,
                 only_senders: bool = True) -> str:
    """Rows of ``R<rank>: <intra> | <inter>``, like the paper's Table 4; ``unit`` bytes (default: MB = 1e6
    bytes, or bytes when every rank sends less than a megabyte)."""
    unit = unit if unit is not None else pick_unit(volume)[1]
    cells = [f"R{r}: {v['intra'] / unit:.0f} | {v['inter'] / unit:.0f}" for r, v in volume.items()
             if not only_senders or v["intra"] or v["inter"]]
    if not cells:
        return "(no rank sends anything)"
    width = max(len(c) for c in cells)
    return "\n".join("   ".join(c.ljust(width) for c in cells[i:i + per_line]) for i in range(0, len(cells),
                                                                                              per_line))


@dataclass(frozen=True)
class CommPlan:
    """The operators of one Reshard, in execution order, ready for the runtime.

    ``ops`` are :mod:`.comm_ops` operators; ``kinds`` their SPEC names.  Nothing here needs re-deriving: groups,
    boxes (global coordinates), messages and local copies are explicit.
    """

    src: Annotation
    dst: Annotation
    shape: tuple[int, ...]
    dtype: str
    itemsize: int
    ops: tuple[CommOp, ...]
    cluster: "Cluster | None" = None

    @property
    def kinds(self) -> list[OpKind]:
        """Operator names in execution order (``Identity``, ``AllReduce``, ..., ``SplitAllGather``, ``BSR``)."""
        return [op.kind for op in self.ops]

    def transfers(self) -> list[list[Transfer]]:
        """Per operator, the ``(sender, receiver, bytes, steps)`` it implies."""
        return [op.transfers() for op in self.ops]

    def simulate(self, inputs: Mapping[int, Any]) -> dict[int, Any]:
        """Run the plan in one process, operator by operator, on per-rank local tensors (numpy or torch).

        ``inputs``: every source rank's local tensor (its summand for a Partial source).  Returns every destination
        rank's local tensor.  Each operator reads the tensors as they were before it, as the runtime does.
        """
        missing = sorted(set(self.src.ranks) - set(inputs))
        if missing:
            raise ValueError(f"simulate: no input for source rank(s) {missing} of {self.src}")
        state: dict[int, Any] = dict(inputs)
        for op in self.ops:
            state.update(op.apply(state))
        return {r: state[r] for r in self.dst.ranks}

    def volume(self, cluster: "Cluster | None" = None) -> dict[int, dict[str, int]]:
        """Bytes each rank sends, ``{"intra": ..., "inter": ...}``, by the plan's (or the given) cluster."""
        ranks = sorted(set(self.src.ranks) | set(self.dst.ranks))
        return volume_by_rank((t for op in self.ops for t in op.transfers()), cluster or self.cluster, ranks)

    def estimated_time(self, cluster: "Cluster | None" = None) -> float:
        """Seconds on ``cluster`` (or the plan's): see the module docstring."""
        cluster = cluster or self.cluster
        if cluster is None:
            raise ValueError("estimated_time needs a cluster: pass one, or resolve(..., cluster=...)")
        return time_of(self.transfers(), cluster)

    def render(self) -> str:
        """Text rendering: the Reshard, its operators and groups, bytes each rank sends by link class."""
        lines = [f"Reshard {self.src}  ->  {self.dst}", f"  shape {self.shape} {self.dtype};  kinds: "
                 + " -> ".join(self.kinds)]
        for i, op in enumerate(self.ops):
            desc = op.describe()
            lines.append(f"  [{i}] {desc[0]}")
            lines.extend("  " + d for d in desc[1:])
        vol = self.volume()
        if any(v["intra"] or v["inter"] for v in vol.values()):
            label, unit = pick_unit(vol)
            lines.append(f"  sent per rank, {label} (intra-node | inter-node):")
            lines.extend("    " + ln for ln in volume_table(vol, unit=unit).splitlines())
        else:
            lines.append("  no bytes sent")
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.render()

    def _repr_html_(self) -> str:
        return f"<pre>{html.escape(self.render())}</pre>"
