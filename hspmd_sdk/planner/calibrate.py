"""This machine's device figures, fitted from phases a job measured (``job.timeline()``'s planned side).

The simulator prices a step with device figures.  Nominal ones (a device kind's peak FLOPS times an MFU, a link's
bandwidth) are 100-1000x too fast for ranks emulated on a CPU, whose operators cost milliseconds of Python,
scheduling and gloo rather than FLOPs.  :func:`calibrate` fits the figures of a :class:`~.cost.CostModel` so that
the simulator's per-rank phase totals (seconds of ``F``, ``B``, ``comm``, ``sync`` and ``optim`` in one step,
counted as the executor records them: :func:`as_recorded`) match the ones measured:

* per device kind, an :class:`~.cost.OperatorProfile`: forward seconds per FLOP and per operator (the decoder
  layers' and the head's lines alike), backward seconds per FLOP and per operator (the embedding counts as one
  backward operator), and Adam's seconds per parameter;
* per link class the strategy's ranks use (``intra``, ``inter``), a :class:`~.cost.LinkOverride`: seconds per
  collective call (``call_latency``), per byte (``1 / collective_bandwidth``, and ``1 / bandwidth`` of a
  point-to-point transfer, whose fixed ``latency`` no phase total measures: 0) and per send posted
  (``send_overhead``: the sender's own time, :meth:`~.cost.CostModel.send_time`).

With the processor sharing off (``cores=None``: the measured seconds already include the sharing of the cores
under the job's own load) every phase total is linear in these figures, so the columns of the fit are the
simulator's own phase totals under unit cost models (one figure 1, the others 0): nothing of the pricing is
re-derived here.  The fit is non-negative least squares, each row divided by its phase's mean over the devices
(so a 1 ms optimizer step weighs as much as a 50 ms forward, and the devices of one phase weigh by their
seconds).  A measured ``sync`` or ``comm`` also holds the waits for a peer (a collective's last holder, a
receive's data), which the simulator plans as idle time: the figures are fitted to the measured seconds less the
waits the fitted figures plan, a fixed point of a few rounds.  A figure the strategy never exercises (no
collective: no link figures) keeps the base model's.  The figures are effective ones, for this job's shapes and
load: at one micro-batch shape the per-FLOP and per-operator parts are barely separable, so other shapes are
extrapolations.  A context-parallel stage's ring overlap (``max(0, gap)``) is not linear: its fit is approximate.
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import TYPE_CHECKING, Mapping, Sequence

from .cost import ComputeFit, CostModel, LinkOverride, OperatorProfile
from .simulator import simulate

if TYPE_CHECKING:  # pragma: no cover
    from ..core.cluster import Cluster
    from ..core.model_spec import ModelSpec
    from ..core.strategy import Strategy
    from .simulator import Event, SimResult

__all__ = ["calibrate", "Calibrated", "as_recorded", "describe_figures", "FITTED_PHASES"]

#: the phases whose measured totals the fit matches (the simulator's event kinds but ``idle``)
FITTED_PHASES = ("F", "B", "comm", "sync", "optim")
_HUGE = 1e30  # a bandwidth that makes bytes free
_ZERO = ComputeFit(a=0.0, b=0.0)
_ZERO_LINK = LinkOverride(latency=0.0, bandwidth=_HUGE, collective_latency=0.0, collective_bandwidth=_HUGE)


@dataclass(frozen=True)
class Calibrated:
    """The outcome of :func:`calibrate`: ``cost`` (the calibrated :class:`~.cost.CostModel`), ``figures`` (name ->
    fitted value, e.g. ``"cpu forward s/operator"``) and ``rows`` (``(device, phase) -> (measured s, fitted s)``,
    the rows the fit matched)."""

    cost: CostModel
    figures: dict[str, float]
    rows: dict[tuple[int, str], tuple[float, float]]

    def describe(self) -> str:
        """The fitted figures in a few words (:func:`describe_figures`)."""
        return describe_figures(self.figures)


def describe_figures(figures: Mapping[str, float]) -> str:
    """Fitted figures (name -> value) in a few words: ms per operator and per call, ps per FLOP, ns per parameter
    and per byte."""
    unit = {"s/operator": (1e3, "ms/operator"), "s/call": (1e3, "ms/call"), "s/send": (1e3, "ms/send"),
            "s/param": (1e9, "ns/param"),
            "s/FLOP": (1e12, "ps/FLOP"), "s/byte": (1e9, "ns/byte")}
    out = []
    for name, v in figures.items():
        what, _, u = name.rpartition(" ")
        k, shown = unit.get(u, (1.0, u))
        out.append(f"{what} {v * k:.3g} {shown}")
    return ", ".join(out)


def _unit_models(base: CostModel, kinds: list[str], classes: list[str]) -> dict[str, CostModel]:
    """Figure name -> the cost model in which that figure is 1 and every other fitted one 0 (``""``: all 0)."""
    zero_prof = OperatorProfile(layer_fwd=_ZERO, layer_bwd=_ZERO, head_fwd=_ZERO, head_bwd=_ZERO, embed=_ZERO)
    zero = base.model_copy(update={"profiles": {**base.profiles, **{k: zero_prof for k in kinds}},
                                   "link_overrides": {**base.link_overrides, **{c: _ZERO_LINK for c in classes}},
                                   "cores": None, "comm_scale": 1.0,
                                   # Adam falls back to the memory-bound price at 0 s/param: make that free too
                                   "hbm_gbs": {**base.hbm_gbs, **{k: _HUGE for k in kinds}}})
    per_flop, per_op = ComputeFit(a=1.0, b=0.0), ComputeFit(a=0.0, b=1.0)
    out: dict[str, CostModel] = {"": zero}
    for k in kinds:
        for name, upd in ((f"{k} forward s/FLOP", {"layer_fwd": per_flop, "head_fwd": per_flop}),
                          (f"{k} forward s/operator", {"layer_fwd": per_op, "head_fwd": per_op}),
                          (f"{k} backward s/FLOP", {"layer_bwd": per_flop, "head_bwd": per_flop}),
                          (f"{k} backward s/operator", {"layer_bwd": per_op, "head_bwd": per_op, "embed": per_op}),
                          (f"{k} Adam s/param", {"optimizer_s_per_param": 1.0})):
            out[name] = zero.model_copy(update={"profiles": {**zero.profiles,
                                                             k: zero_prof.model_copy(update=upd)}})
    for c in classes:
        for name, link in ((f"{c} collective s/call", _ZERO_LINK.model_copy(update={"call_latency": 1.0})),
                           (f"{c} s/byte", LinkOverride(latency=0.0, bandwidth=1.0, collective_latency=0.0,
                                                        collective_bandwidth=1.0)),
                           (f"{c} send s/send", _ZERO_LINK.model_copy(update={"send_overhead": 1.0}))):
            out[name] = zero.model_copy(update={"link_overrides": {**zero.link_overrides, c: link}})
    return out


#: what a rank does while the simulator shows it idle before an event of each kind (the executor's span that waits)
_WAITED_IN = {"F": "comm", "B": "comm", "comm": "comm", "sync": "sync", "optim": "optim"}


def as_recorded(events: "Sequence[Event]") -> list[tuple[str, float, float, str]]:
    """A simulated rank's events as the executor's spans record them: ``(phase, start s, end s, label)``.  The
    simulator's ranks never block on a receive or a collective, they sit ``idle`` until the data or the last holder
    arrives; the executor's ``RECV_*`` and ``sync`` spans hold that wait.  So an ``idle`` stretch counts as the
    phase of the event after it (``comm`` before a forward, a backward or a send, ``sync`` before a gradient
    synchronisation), labelled ``"... waits ..."``; the idle after the rank's last event is not part of its step."""
    out: list[tuple[str, float, float, str]] = []
    events = sorted(events, key=lambda e: e.start)
    for i, e in enumerate(events):
        if e.kind == "idle":
            nxt = next((n for n in events[i + 1:] if n.kind != "idle"), None)
            if nxt is not None and e.end > e.start:
                phase = _WAITED_IN.get(nxt.kind, "comm")
                out.append((phase, e.start, e.end, f"{phase} (waits for {'data' if phase == 'comm' else 'peers'})"))
        elif e.kind in FITTED_PHASES:
            out.append((e.kind, e.start, e.end, e.kind + ("" if e.micro_batch is None else f" mb{e.micro_batch}")))
    return out


def _phase_totals(result: "SimResult", *, waits: bool = False) -> dict[int, dict[str, float]]:
    """Per device, seconds per phase of its events (``waits``: of its idle stretches, by :func:`as_recorded`)."""
    out: dict[int, dict[str, float]] = {}
    for d, events in result.timeline.items():
        tot = out[d] = dict.fromkeys(FITTED_PHASES, 0.0)
        for phase, start, end, label in as_recorded(events):
            if ("waits" in label) == waits:
                tot[phase] += end - start
    return out


def _clean(v: float) -> float:
    """A column entry: a count of operators, calls, FLOPs or bytes, or 0 (below 1e-9: rounding)."""
    return v if abs(v) > 1e-9 else 0.0


def _link_classes(strategy: "Strategy", cluster: "Cluster") -> list[str]:
    """The link classes between the strategy's devices (``intra`` within a node, ``inter`` across nodes)."""
    by_node: dict[int, list[int]] = {}
    for d in sorted({d for p in strategy.pipelines for st in p.stages for d in st.devices}):
        by_node.setdefault(cluster.node_index(d), []).append(d)
    classes = {cluster.link(ds[0], ds[1]).cls for ds in by_node.values() if len(ds) > 1}
    classes |= {cluster.link(a[0], b[0]).cls for a, b in itertools.combinations(list(by_node.values()), 2)}
    return sorted(classes - {"self"})


def calibrate(model: "ModelSpec | str", strategy: "Strategy | str | dict", cluster: "Cluster",
              measured: Mapping[int, Mapping[str, float]], *, seq_len: int, global_batch: int | None = None,
              base: CostModel | None = None) -> Calibrated:
    """Fit the device figures (see the module) that make :func:`~.simulator.simulate` of ``strategy`` reproduce
    ``measured``: device (program rank) -> phase (:data:`FITTED_PHASES`; a missing one counts 0) -> measured
    seconds of that phase in one step (e.g. the median over steps), as the executor records them (waits
    included).  ``base`` (default: the analytic :class:`CostModel`) gives every figure that is not fitted.
    Raises ``ValueError`` when no measured phase can be matched."""
    from ..core.strategy import Strategy
    from ..models.registry import load_model_spec

    model = load_model_spec(model)
    strategy = Strategy.load(strategy, model=model, cluster=cluster, global_batch=global_batch)
    base = base or CostModel()
    kinds = sorted({cluster.kind(d) for p in strategy.pipelines for st in p.stages for d in st.devices})
    units = _unit_models(base, kinds, _link_classes(strategy, cluster))
    names = [n for n in units if n != ""]

    def totals(cost: CostModel) -> dict[int, dict[str, float]]:
        return _phase_totals(simulate(model, strategy, cluster, seq_len=seq_len, cost=cost))

    zero = totals(units[""])  # what no fitted figure prices (a "free" link's bytes: 1e-26 s): taken off each column
    columns = [{d: {p: _clean(v - zero[d][p]) for p, v in per.items()} for d, per in totals(units[n]).items()}
               for n in names]
    measured = {d: {p: float(v.get(p, 0.0)) for p in FITTED_PHASES} for d, v in measured.items()}
    target = {d: dict(v) for d, v in measured.items()}
    figures: dict[str, float] = {}
    for _ in range(_WAIT_ROUNDS):
        new, rows = _fit(names, columns, target)
        cost = _calibrated_model(base, kinds, new, model)
        waits = _phase_totals(simulate(model, strategy, cluster, seq_len=seq_len, cost=cost), waits=True)
        settled = figures.keys() == new.keys() and all(abs(new[n] - figures[n]) <= 1e-3 * max(new[n], 1e-30)
                                                       for n in new)
        figures = new
        if settled:
            break
        # a measured sync or comm holds waits for peers, which the simulator plans as idle: fit the collectives
        # and the sends to what is left of it (at least a tenth of it)
        for d in target:
            for p in ("comm", "sync"):
                target[d][p] = max(measured[d][p] - waits.get(d, {}).get(p, 0.0), 0.1 * measured[d][p])
    return Calibrated(cost, figures, {k: (measured[k[0]][k[1]], f + waits.get(k[0], {}).get(k[1], 0.0))
                                      for k, f in rows.items()})


#: rounds of the waits' fixed point (the waits depend on the figures, the figures on the waits)
_WAIT_ROUNDS = 6


def _fit(names: list[str], columns: list[dict[int, dict[str, float]]],
         measured: Mapping[int, Mapping[str, float]]) -> tuple[dict[str, float], dict[tuple[int, str], float]]:
    """The figures (name -> value, those some row exercises) fitted to ``measured`` by non-negative least
    squares, each row divided by its phase's mean; and each row's fitted seconds."""
    import numpy as np

    keys, rows, targets, scales = [], [], [], []
    for phase in FITTED_PHASES:
        got = {d: float(measured[d].get(phase, 0.0)) for d in sorted(measured)}
        xs = {d: [col.get(d, {}).get(phase, 0.0) for col in columns] for d in got}
        keep = [d for d in got if got[d] > 0 and any(v > 0 for v in xs[d])]
        if not keep:
            continue
        scale = sum(got[d] for d in keep) / len(keep)  # the phase's mean: every phase weighs alike
        for d in keep:
            keys.append((d, phase))
            rows.append([v / scale for v in xs[d]])
            targets.append(got[d] / scale)
            scales.append(scale)
    if not rows:
        raise ValueError("calibrate: no measured phase the simulator prices (measured: "
                         f"{ {d: dict(v) for d, v in measured.items()} })")
    A, y = np.asarray(rows, float), np.asarray(targets, float)
    used = A.any(axis=0)
    theta = np.zeros(len(names))
    theta[used] = _nnls(A[:, used], y)
    return ({n: float(t) for n, t, u in zip(names, theta, used) if u},
            {k: float(f) * sc for k, f, sc in zip(keys, A @ theta, scales)})


def _calibrated_model(base: CostModel, kinds: list[str], figures: dict[str, float], model: "ModelSpec") -> CostModel:
    """``base`` with the fitted figures: an OperatorProfile per kind, a LinkOverride per fitted link class."""
    profiles, links = dict(base.profiles), dict(base.link_overrides)
    for k in kinds:
        if not any(n.startswith(f"{k} ") for n in figures):
            continue
        g = {n[len(k) + 1:]: v for n, v in figures.items() if n.startswith(f"{k} ")}
        fwd = ComputeFit(a=g.get("forward s/FLOP", 0.0), b=g.get("forward s/operator", 0.0), device=k,
                         dtype="calibrated")
        bwd = ComputeFit(a=g.get("backward s/FLOP", 0.0), b=g.get("backward s/operator", 0.0), device=k,
                         dtype="calibrated")
        # 0 s/param would fall back to the memory-bound nominal price: keep the fit's "next to nothing"
        adam = max(g.get("Adam s/param", 0.0), 1e-18)
        profiles[k] = OperatorProfile(layer_fwd=fwd, head_fwd=fwd, layer_bwd=bwd, head_bwd=bwd,
                                      embed=ComputeFit(a=0.0, b=bwd.b), optimizer_s_per_param=adam,
                                      model=getattr(model, "name", "") or "")
    for c in {n.split(" ", 1)[0] for n in figures} - set(kinds):
        call, per_byte = figures.get(f"{c} collective s/call", 0.0), figures.get(f"{c} s/byte", 0.0)
        bw = 1.0 / per_byte if per_byte > 0 else _HUGE
        links[c] = LinkOverride(latency=0.0, bandwidth=bw, collective_latency=0.0, collective_bandwidth=bw,
                                call_latency=call, send_overhead=figures.get(f"{c} send s/send", 0.0),
                                backend="calibrated")
    return base.model_copy(update={"profiles": profiles, "link_overrides": links, "cores": None, "comm_scale": 1.0})


def _nnls(A: "object", b: "object") -> "object":
    """Non-negative least squares ``min |A x - b|, x >= 0`` (Lawson and Hanson's active set), on columns scaled
    to unit norm."""
    import numpy as np

    A, b = np.asarray(A, float), np.asarray(b, float)
    scale = np.linalg.norm(A, axis=0)
    scale[scale == 0] = 1.0
    As = A / scale
    n = As.shape[1]
    x, passive = np.zeros(n), np.zeros(n, bool)
    tol = 1e-12 * max(1.0, float(np.abs(As).sum()))
    for _ in range(3 * n + 3):
        w = As.T @ (b - As @ x)
        if passive.all() or w[~passive].max() <= tol:
            break
        passive[int(np.argmax(np.where(passive, -np.inf, w)))] = True
        while True:
            z = np.zeros(n)
            z[passive] = np.linalg.lstsq(As[:, passive], b, rcond=None)[0]
            if (z[passive] > tol).all():
                x = z
                break
            bad = passive & (z <= tol)
            den = x[bad] - z[bad]
            alpha = float(np.min(np.where(den > 0, x[bad] / np.where(den > 0, den, 1.0), 0.0)))
            x = x + alpha * (z - x)
            passive &= x > tol
            x[~passive] = 0.0
            if not passive.any():
                break
    return x / scale
