"""Graph switching between two Programs (paper §7, §9 (b)): which state moves where, as one fused BSR.

A running job's training state — every parameter and its Adam moments (:meth:`Program.state_layouts`) — sits in
the layouts of the Program it runs.  Moving to another Program (a user's new plan, a replan after a failure or
for a straggler, the plan for a batch of other lengths) is one :func:`~.switch.plan_switch` from the first
Program's state layouts to the second's.

Rank numbers: a Program is specialized on a cluster numbered ``0..n-1``.  After failures the survivors form a
smaller world and the new Program is specialized on the survivors renumbered ``0..m-1``; the switch is planned in
the *old* numbering (where the state is), with the new Program's annotations mapped back (``new_to_old``), and
executed with the map old rank -> new process rank.  :func:`plan_program_switch` does both and reports state that
no survivor holds as :class:`LostStateError` (naming the tensors and the dead ranks), the cue to reload a
checkpoint.  Pure Python.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Iterable, Mapping

from ..errors import ResolutionError
from .annotation import Annotation, local_views
from .switch import plan_switch

if TYPE_CHECKING:
    from .cluster import Cluster
    from .specialize import Program
    from .switch import SwitchPlan

__all__ = ["LostStateError", "remap_annotation", "state_table", "plan_program_switch"]


class LostStateError(ResolutionError):
    """Some training state has no surviving copy: ``tensors`` (state names) were held only by ``ranks``
    (``what``: that sentence, without the advice)."""

    def __init__(self, tensors: list[str], ranks: list[int]) -> None:
        self.tensors, self.ranks = tensors, ranks
        shown = ", ".join(tensors[:8]) + (f" ... ({len(tensors)} in all)" if len(tensors) > 8 else "")
        self.what = f"no surviving copy of {shown}: held only by the failed rank(s) {ranks}"
        super().__init__(f"{self.what}. Without a checkpoint this state is lost (run with checkpoint_dir=..., or "
                         "keep a data-parallel replica of every parameter: two pipelines and ZeRO-1 off, as the paper "
                         "does)")


def remap_annotation(ann: Annotation, mapping: Mapping[int, int]) -> Annotation:
    """``ann`` with every rank ``r`` of its DG Union replaced by ``mapping[r]`` (the same layout)."""
    return Annotation([[mapping[r] for r in g] for g in ann.dg_union], list(ann.ds_union), ann.hdim,
                      ann.hratios)


def state_table(program: "Program", mapping: Mapping[int, int] | None = None
                ) -> dict[str, tuple[Annotation, tuple[int, ...]]]:
    """The program's training state as ``plan_switch`` takes it: state name -> (annotation, shape), ranks mapped
    by ``mapping`` (program rank -> the numbering of the switch) when given."""
    out = {}
    memo: dict[int, Annotation] = {}
    for name, lay in program.state_layouts().items():
        ann = lay.annotation
        if mapping is not None:
            got = memo.get(id(ann))
            if got is None:
                got = memo[id(ann)] = remap_annotation(ann, mapping)
            ann = got
        out[name] = (ann, lay.shape)
    return out


def plan_program_switch(src: "Program", dst: "Program", cluster: "Cluster | None" = None, *,
                        dst_to_src: Mapping[int, int] | None = None, failed: Iterable[int] = (),
                        empty: Iterable[int] = (), fused: bool = True, heuristics: bool = True) -> "SwitchPlan":
    """The fused BSR moving every parameter and Adam moment from ``src``'s layouts to ``dst``'s, in ``src``'s
    rank numbering (``dst_to_src`` maps ``dst``'s ranks into it; default: the same numbering).  ``failed``: ranks
    of ``src`` whose state is lost; they never send.  ``empty``: ranks that take part holding nothing of ``src``'s state
(a newcomer whose grow did not complete): they only receive.  Raises :class:`LostStateError` when some state is held only
    by failed ranks, and :class:`ResolutionError` when the two Programs do not train the same model."""
    a = state_table(src)
    b = state_table(dst, dst_to_src)
    if set(a) != set(b):
        only = sorted(set(a) ^ set(b))[:5]
        raise ResolutionError(f"the two programs do not hold the same training state (e.g. {only}): a switch needs "
                              "the same model")
    dtypes = {n: lay.dtype for n, lay in src.state_layouts().items()}
    dead = sorted(set(failed))
    lost = _lost(a, sorted({*dead, *empty}))
    if lost:
        raise LostStateError(lost, dead)
    return plan_switch(a, b, cluster if cluster is not None else src.cluster, dtype=dtypes, fused=fused,
                       heuristics=heuristics, failed=dead, empty=empty)


def _lost(table: Mapping[str, tuple[Annotation, tuple[int, ...]]], dead: list[int]) -> list[str]:
    """State names some element of which only dead ranks hold."""
    if not dead:
        return []

    gone = set(dead)
    out = []
    checked: dict[tuple[int, tuple[int, ...]], bool] = {}
    for name, (ann, shape) in table.items():
        if not gone & set(ann.ranks):
            continue
        key = (id(ann), shape)
        if key not in checked:
            views = list(local_views(ann, shape))
            alive = {v.box for v in views if v.rank not in gone}
            checked[key] = any(v.box not in alive and not _covered(v.box, alive) for v in views if v.rank in gone)
        if checked[key]:
            out.append(name)
    return out


def _covered(box: tuple[tuple[int, int], ...], others: set) -> bool:
    """Whether the union of the boxes ``others`` covers ``box``: every cell of the grid their edges cut ``box``
    into lies inside one of them."""
    import itertools

    near = [o for o in others if all(o[i][0] < box[i][1] and box[i][0] < o[i][1] for i in range(len(box)))]
    cuts = [sorted({lo, hi} | {min(max(x, lo), hi) for o in near for x in o[i]}) for i, (lo, hi) in enumerate(box)]
    for cell in itertools.product(*[list(zip(c, c[1:])) for c in cuts]):
        if not any(all(o[i][0] <= cell[i][0] and cell[i][1] <= o[i][1] for i in range(len(box))) for o in near):
            return False
    return True
