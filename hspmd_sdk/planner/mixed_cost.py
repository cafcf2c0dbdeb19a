"""Costs of padded (or packed) micro-batches of any shape, for mixed-length planning and dispatch (scenario (c)).

A micro-batch of ``rows`` sequences padded to ``length`` tokens costs, on one pipeline stage, what the step
simulator's stage cost (:func:`hspmd_sdk.planner.simulator._stage_cost`, i.e. the cost model's
:func:`~hspmd_sdk.planner.cost.layer_cost`, embedding and head) gives for micro-batch size ``rows`` at sequence length
``length``.  That cost is affine in ``tokens = rows * length`` (matmuls, TP all-reduces, activations) and in
``rows * length**2`` (attention scores), plus fixed latencies, so :class:`StageCost` samples it at three shapes,
solves for the three coefficients of each quantity (forward and backward seconds, kept activation bytes, transient
bytes) and checks the fit at two more shapes (a row packing documents is the same line with the sum of their
squared lengths as the attention term: attention runs per document); when a cost model or model is not of that
form the check fails and every shape is evaluated directly (cached).  Dispatching a step then costs a few
multiplications per sequence.

:class:`PipelineCost` estimates a pipeline's 1F1B time for a list of micro-batch shapes:
``sum over micro-batches of the bottleneck stage time`` plus one fill and drain (every other stage once, and the
point-to-point transfers) of the micro-batch for which that is largest -- for equal shapes exactly
:meth:`~hspmd_sdk.planner.hetero.PipelinePlan.time`.  :func:`switch_estimate` prices a graph switch between two
strategies by the BF16 parameter bytes each device lacks (the paper switches only BF16 parameters).
"""
from __future__ import annotations

import heapq
from typing import TYPE_CHECKING, Sequence

from .cost import BF16, CostModel, static_memory
from .simulator import _ring_link, _stage_cost

if TYPE_CHECKING:  # pragma: no cover
    import numpy as np

    from ..core.cluster import Cluster
    from ..core.model_spec import ModelSpec
    from ..core.strategy import Stage, Strategy

__all__ = ["StageCost", "PipelineCost", "split_layers", "switch_estimate"]

#: shapes ``(rows, length)`` the lines are fitted at, and checked at.
_FIT = ((1, 512), (1, 2048), (4, 512))
_CHECK = ((3, 1536), (2, 4096))


def _features(rows: int, length: int) -> tuple[float, float, float]:
    return 1.0, float(rows * length), float(rows) * length * length


class StageCost:
    """One pipeline stage's costs as functions of the micro-batch shape ``(rows, length)``.

    :meth:`times` -> (forward s, backward s); :meth:`memory` -> (bytes kept per in-flight micro-batch, transient
    bytes); ``params``: parameters held per device.  ``exact``: the affine fit reproduced the cost model at the
    check shapes (relative 1e-6); otherwise each shape is evaluated by the cost model itself.
    """

    def __init__(self, model: "ModelSpec", stage: "Stage", first: bool, last: bool, cluster: "Cluster",
                 cost: CostModel, *, balanced: bool = False) -> None:
        self._args = (model, stage, first, last, cluster)
        self._balanced = balanced  # a CP stage of a pipeline laid out in the balanced order
        self._recompute = bool(stage.recompute)
        self._cost = cost
        self._cache: dict[tuple[int, int], tuple[float, ...]] = {}
        pts = [self._direct(r, s) for r, s in _FIT]
        self.params = float(sum(p for _, p in self._eval(1, _FIT[0][1]).units))
        self._coef = [_solve([_features(*x) for x in _FIT], [p[q] for p in pts]) for q in range(8)]
        self._gaps = any(abs(c) > 0 for q in (4, 5) for c in self._coef[q])  # a CP ring: not one line
        self.exact = all(_close(self._line(r, s)[:6], self._direct(r, s)[:6]) for r, s in _CHECK)
        # a CP ring's collectives are not one line: then they are evaluated per shape
        self._comm_exact = self.exact and all(_close(self._line(r, s)[6:], self._direct(r, s)[6:])
                                              for r, s in _CHECK)

    def _eval(self, rows: int, length: int):  # the simulator's stage cost: the one source of these figures
        model, stage, first, last, cluster = self._args
        return _stage_cost(model, stage, first, last, cluster, rows, length, self._cost, balanced=self._balanced)

    def _direct(self, rows: int, length: int) -> tuple[float, ...]:
        """The eight quantities the lines model: forward and backward seconds without the CP ring's exposed part,
        kept and transient bytes, the ring's forward and backward gaps (``LayerCost.ring_gap_*``: a stage pays
        ``max(0, gap)``, so its cost is affine in the shape's features plus those maxima), and the in-stage
        collectives' forward and backward seconds (the part of the times that shared cores do not slow)."""
        hit = self._cache.get((rows, length))
        if hit is None:
            sc = self._eval(rows, length)
            ef, eb = max(0.0, sc.ring_gap_fwd), max(0.0, sc.ring_gap_bwd)
            hit = self._cache[(rows, length)] = (
                sc.fwd - ef, sc.bwd - eb - (ef if sc.recompute else 0.0), sc.act_per_mb, sc.transient,
                sc.ring_gap_fwd, sc.ring_gap_bwd, sc.fwd_comm, sc.bwd_comm)
        return hit

    def _line(self, rows: int, length: int, sq: float | None = None) -> tuple[float, ...]:
        x1 = float(rows * length)
        x2 = float(rows) * length * length if sq is None else float(sq)
        return tuple(c0 + c1 * x1 + c2 * x2 for c0, c1, c2 in self._coef)

    def _combine(self, q: Sequence[float]) -> tuple[float, float, float, float]:
        ef, eb = max(0.0, q[4]), max(0.0, q[5])
        return q[0] + ef, q[1] + eb + (ef if self._recompute else 0.0), q[2], q[3]

    def _all(self, rows: int, length: int, sq: float | None = None) -> tuple[float, float, float, float]:
        # not exact: the padded shape's own cost (an upper bound for a packed row: attention over the whole row)
        return self._combine(self._line(rows, length, sq) if self.exact else self._direct(rows, length))

    def times(self, rows: int, length: int, sq: float | None = None) -> tuple[float, float]:
        """(forward, backward) seconds of one micro-batch of ``rows`` x ``length`` tokens; ``sq``: its attention
        term when not ``rows * length**2`` (a row packing documents: the sum of their squared lengths)."""
        f, b, _, _ = self._all(rows, length, sq)
        return f, b

    def comm(self, rows: int, length: int, sq: float | None = None) -> tuple[float, float]:
        """The in-stage (TP) collectives' part of :meth:`times`: (forward, backward) seconds that processor sharing
        does not stretch."""
        q = self._line(rows, length, sq) if self._comm_exact else self._direct(rows, length)
        return q[6], q[7]

    def time(self, rows: int, length: int, sq: float | None = None) -> float:
        """Forward + backward seconds of one micro-batch (``sq`` as in :meth:`times`)."""
        f, b, _, _ = self._all(rows, length, sq)
        return f + b

    def time_line(self) -> tuple[float, float, float] | None:
        """Forward + backward seconds as ``c0 + c1 * tokens + c2 * rows * length**2``, or ``None`` (not exact, or a
        CP stage whose ring makes it a line plus maxima: :meth:`time_vec`)."""
        if not self.exact or self._gaps:
            return None
        (f0, f1, f2), (b0, b1, b2) = self._coef[0], self._coef[1]
        return f0 + b0, f1 + b1, f2 + b2

    def time_vec(self, tokens: "np.ndarray", attention: "np.ndarray") -> "np.ndarray | None":
        """Forward + backward seconds of micro-batches of ``tokens`` (``rows * length``) and ``attention``
        (``rows * length**2``, or a packed row's sum of squared lengths) terms, vectorised; ``None`` when the
        lines are not exact."""
        import numpy as np

        if not self.exact:
            return None
        c = np.asarray(self._coef)
        v = c[:, :1] + c[:, 1:2] * tokens + c[:, 2:3] * attention
        ef, eb = np.maximum(v[4], 0.0), np.maximum(v[5], 0.0)
        return v[0] + v[1] + ef + eb + (ef if self._recompute else 0.0)

    def memory(self, rows: int, length: int, sq: float | None = None) -> tuple[float, float]:
        """(activation bytes kept per in-flight micro-batch, transient bytes) of one micro-batch."""
        _, _, a, t = self._all(rows, length, sq)
        return a, t

    def fits(self, tokens: int, held: int, zero_shards: int, capacity: float) -> bool:
        """Whether ``held`` in-flight micro-batches of at most ``tokens`` tokens (one row of ``tokens``: the most
        activation and attention a token budget allows) fit in ``capacity`` bytes with the static state."""
        act, transient = self.memory(1, tokens)
        static = sum(static_memory(self.params, zero_shards).values())
        return static + act * held + transient <= capacity


def _solve(a: list[tuple[float, float, float]], y: list[float]) -> tuple[float, float, float]:
    import numpy as np

    return tuple(float(v) for v in np.linalg.solve(np.array(a), np.array(y)))  # type: ignore[return-value]


def _close(a: Sequence[float], b: Sequence[float]) -> bool:
    return all(abs(x - y) <= 1e-6 * max(abs(y), 1e-12) + 1e-15 for x, y in zip(a, b))


class PipelineCost:
    """Estimated time of one pipeline (its :class:`StageCost` per stage and its boundary links) for a list of
    micro-batch shapes."""

    def __init__(self, stages: Sequence[StageCost], boundaries: Sequence[object], hidden: int,
                 cost: CostModel) -> None:
        self.stages, self._links, self._hidden, self._cost = list(stages), list(boundaries), hidden, cost
        self._lines: object = None  # the stages' time lines as one array, once

    def parts(self, rows: int, length: int, sq: float | None = None) -> tuple[float, float]:
        """(bottleneck stage seconds, fill-and-drain seconds) of one micro-batch: the bottleneck repeats once per
        micro-batch, the rest of the stages and the transfers (both directions) once per step.  ``sq``: the
        attention term of a packed row (:meth:`StageCost.times`)."""
        ts = [s.time(rows, length, sq) for s in self.stages]
        b = max(ts)
        nbytes = rows * length * self._hidden * BF16
        p2p = 2 * sum(self._cost.p2p_time(nbytes, link) for link in self._links)  # type: ignore[arg-type]
        return b, sum(ts) - b + p2p

    def time(self, shapes: Sequence[tuple[int, ...]]) -> float:
        """Estimated seconds of the pipeline's forward and backward work for micro-batches of ``shapes``
        (``(rows, length)``, or ``(1, tokens, sq)`` for a packed row)."""
        if not shapes:
            return 0.0
        total, fill = 0.0, 0.0
        for shape in shapes:
            b, f = self.parts(*shape)
            total += b
            fill = max(fill, f)
        return total + fill

    def totals(self, rows: Sequence[int], lengths: Sequence[int],
               sq: Sequence[float] | None = None) -> tuple[float, float, float]:
        """For micro-batches of ``rows[i]`` x ``lengths[i]`` (vectorised; ``sq[i]``: the attention term of a packed
        row, ``rows[i] = 1``): (sum of bottleneck seconds, largest bottleneck seconds, the fill and drain of
        :meth:`time`)."""
        import numpy as np

        r, s = np.asarray(rows, dtype=float), np.asarray(lengths, dtype=float)
        if r.size == 0:
            return 0.0, 0.0, 0.0
        q = r * s * s if sq is None else np.asarray(sq, dtype=float)
        if self._lines is None:
            lines = [st.time_line() for st in self.stages]
            self._lines = np.array(lines) if all(line is not None for line in lines) else False
        vec = None if self._lines is not False else [getattr(st, "time_vec", lambda *_: None)(r * s, q)
                                                      for st in self.stages]
        if self._lines is not False:
            c = self._lines  # (stages, 3)
            ts = c[:, :1] + c[:, 1:2] * (r * s) + c[:, 2:3] * q
        elif vec is not None and all(v is not None for v in vec):  # CP stages: lines plus the ring's maxima
            ts = np.stack(vec)
        else:
            ts = np.array([[st.time(int(a), int(b), None if sq is None else float(x))
                            for a, b, x in zip(rows, lengths, q)] for st in self.stages])
        b = ts.max(axis=0)
        k = int(np.argmax(r * s))
        _, fill_k = self.parts(int(rows[k]), int(lengths[k]), None if sq is None else float(q[k]))
        return float(b.sum()), float(b.max()), max(float((ts.sum(axis=0) - b).max()), fill_k)

    @classmethod
    def of(cls, model: "ModelSpec", pipeline: object, cluster: "Cluster", cost: CostModel,
           cache: dict | None = None) -> "PipelineCost":
        """The cost of a :class:`~hspmd_sdk.core.strategy.Pipeline` (stage costs shared through ``cache`` by
        device kind, TP degree, TP link, layer count, first/last, recompute and node occupancy)."""
        stages = pipeline.stages  # type: ignore[attr-defined]
        balanced = pipeline.cp_balance > 1  # type: ignore[attr-defined]
        out = []
        for j, st in enumerate(stages):
            key = _stage_key(st, j == 0, j == len(stages) - 1, cluster) + (balanced,)
            hit = cache.get(key) if cache is not None else None
            if hit is None:
                hit = StageCost(model, st, j == 0, j == len(stages) - 1, cluster, cost, balanced=balanced)
                if cache is not None:
                    cache[key] = hit
            out.append(hit)
        links = [min((cluster.link(a, b) for a, b in zip(x.devices, y.devices)), key=lambda l: l.bandwidth)
                 for x, y in zip(stages, stages[1:])]
        return cls(out, links, model.hidden_size, cost)


def _stage_key(stage: "Stage", first: bool, last: bool, cluster: "Cluster") -> tuple:
    kinds = tuple(sorted({cluster.kind(d) for d in stage.devices}))
    link = _ring_link(cluster, list(stage.devices))
    nodes = tuple(sorted({len(cluster.nodes[cluster.node_index(d)].ranks) for d in stage.devices}))
    return (kinds, stage.tp_degree, stage.cp, link.cls, link.bandwidth, stage.num_layers, first, last,
            stage.recompute, nodes)


def split_layers(num_layers: int, stage_time: Sequence[float], fixed: Sequence[float]) -> list[int]:
    """Layers per stage (each at least one) minimising the slowest stage ``fixed[s] + n_s * stage_time[s]``:
    one layer at a time to the stage whose time grows least (optimal for this separable objective)."""
    S = len(stage_time)
    counts = [1] * S
    heap = [(fixed[s] + 2 * stage_time[s], s) for s in range(S)]
    heapq.heapify(heap)
    for _ in range(num_layers - S):
        _, s = heapq.heappop(heap)
        counts[s] += 1
        heapq.heappush(heap, (fixed[s] + (counts[s] + 1) * stage_time[s], s))
    return counts


# ---- switching ---------------------------------------------------------------------------------------------------
def _holdings(model: "ModelSpec", strategy: "Strategy") -> dict[int, dict[object, tuple[float, float, float]]]:
    """Per device: model unit -> (parameters, shard start, shard end) as fractions of the unit's TP split."""
    out: dict[int, dict[object, tuple[float, float, float]]] = {}
    for p in strategy.pipelines:
        for j, st in enumerate(p.stages):
            units: list[tuple[object, float]] = [(("layer", i), model.layer_param_count())
                                                 for i in range(st.layers[0], st.layers[1] + 1)]
            if j == 0:
                units.append((("embedding",), model.embedding_param_count()))
            if j == p.num_stages - 1:
                units.append((("head",), model.head_param_count()))
            t = st.tp_degree
            for k, d in enumerate(st.devices):
                held = out.setdefault(d, {})
                for u, n in units:
                    held[u] = (float(n), k / t, (k + 1) / t)
    return out


def switch_estimate(model: "ModelSpec", cluster: "Cluster", src: "Strategy", dst: "Strategy",
                    cost: CostModel | None = None) -> float:
    """Estimated seconds of a graph switch from ``src`` to ``dst`` that moves only BF16 parameters (as the paper's
    mixed-length switching, Table 5): each device receives the parameter bytes of ``dst`` it does not hold under
    ``src`` (its TP shard of each unit minus the overlap with what it holds), over the inter-node network; the
    switch lasts as long as the device that receives most.  An estimate for planning and for the baselines; the
    runtime's fused BSR (:func:`hspmd_sdk.core.switch.plan_switch`) is what a job runs."""
    if src == dst:
        return 0.0
    cost = cost or CostModel()
    before, after = _holdings(model, src), _holdings(model, dst)
    worst = 0.0
    for d, units in after.items():
        have = before.get(d, {})
        need = 0.0
        for u, (n, lo, hi) in units.items():
            kept = 0.0
            if u in have:
                _, a, b = have[u]
                kept = max(0.0, min(hi, b) - max(lo, a))
            need += n * (hi - lo - kept)
        worst = max(worst, need)
    if worst <= 0 or cluster.num_ranks < 2:
        return 0.0
    return cost.p2p_time(worst * BF16, cluster.link(0, cluster.num_ranks - 1))  # inter-node, or NVLink on one node
