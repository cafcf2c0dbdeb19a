"""``PlanEditor``: build and edit a strategy on the cluster canvas, validated live by the core.

Every edit -- a drag on the canvas, a key, a button, or a call from Python (``move_devices``, ``click_device``,
``set_layers``, ...) -- goes through one method, is validated at once and redraws:

1. the draft becomes a :class:`~hspmd_sdk.core.strategy.Strategy` with the core's checks against the model, the
   cluster and the pinned global batch (:func:`.draft.check_draft`); problems are shown at the stage or pipeline
   they concern.  **Errors** (layers not covered, a rank in two stages, out of memory, ...) block Save, Launch and
   Apply; **warnings** (a TP group across nodes, redundant boundary traffic) are named as such;
2. a valid strategy is simulated (:func:`hspmd_sdk.planner.simulate`): step time, memory per rank vs capacity;
   memory of an invalid draft is the core's estimate (:meth:`Strategy.device_memory`, the one the simulator
   counts too: tensors plus each device's runtime), marked as such;
3. communication is resolved by the core -- ``plan_from_strategy`` then ``specialize`` -- on a
   background thread; the canvas then draws every stage boundary as arrows with operators and bytes per step.
   Simulations and resolutions are cached per strategy, so undo, redo and a return to an earlier plan are instant.

The last fully valid plan is kept (``editor.strategy``, ``editor.plan``, ``editor.program``) whatever the
draft looks like; Save, Launch and Apply act only on the draft shown, and only when it is valid.  Before the first
valid plan ``editor.strategy`` is a falsy :class:`NoPlan` that says "no plan yet" and why.

On the canvas, exploring never changes the plan and moving a device takes an explicit gesture:

* **click** a device tile: pick it and inspect it (its stage, layers, memory, problems) -- nothing moves;
  Shift/Ctrl+click picks more; a drag on the empty canvas picks a box (or a lasso);
* **move**: drag a tile (or the picked tiles) onto a stage (one of its tiles, its chip, "+ stage", "+ pipeline");
  **Alt+click** a tile: it joins the selected stage, or leaves it if it is in it (:meth:`click_device`); Enter
  moves the picked tiles into the selected stage, Delete takes them out; the inspect card has the same buttons;
* **"+ stage"** / **"+ pipeline"**: a click adds an empty one, a drop adds one with the devices dropped;
* a stage's row has fields for its layers, recompute, its uneven TP **ratios** (:meth:`set_ratios`, HAP: each
  tile shows its share, e.g. 3/4) and its context-parallel groups **cp** (:meth:`set_cp`: each tile shows its
  ``cp·tp`` coordinates, each CP group is outlined inside the stage);
* Ctrl+Z / Ctrl+Shift+Z undo and redo; [ and ] select the previous / next stage.

With ``job=`` (or :meth:`attach`) the editor shows a running job's progress; "Apply to running job" calls
``job.switch(editor.program)`` when the job can switch, and a job that reconfigured itself (an event with a new
strategy) updates the canvas.
"""
from __future__ import annotations

import difflib
import functools
import operator
import re
import threading
import time
from collections import OrderedDict
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterable, Sequence

from ..core.strategy import Strategy
from ..errors import HSPMDError
from ._checks import comm_warnings, draft_memory, estimated_memory_errors, layout_warnings, memory_errors
from ._editor_view import summary_lines
from ._job import SWITCH_NEEDS, can_switch, snapshot
from ._model import default_seq_len, load_model, model_name, param_shapes
from ._resolver import Resolved, Resolver
from .draft import Draft, PipelineDraft, Problem, StageDraft, check_draft, locate

if TYPE_CHECKING:
    from ..core.cluster import Cluster
    from ..core.plan import AnnotationPlan
    from ..planner.simulator import SimResult

__all__ = ["PlanEditor", "NoPlan", "training_runtime"]

_HISTORY = 500
_SIMS = 32  # simulations kept, by strategy (a click out of a stage and back again is a cached plan)


def training_runtime(cluster: "Cluster | None" = None) -> tuple[bool, str]:
    """Whether ``hspmd_sdk.runtime.launch`` can train a ``Program`` here (on ``cluster``, if given), and why not.

    Needs the runtime's training entry (``hspmd_sdk.runtime.control.runs.ENTRY``) and, for a local launch, every host of
    the cluster to be this machine."""
    try:
        from ..runtime.control import launcher, runs  # lazy: the runtime loads only to launch; import failure = absent
    except Exception as e:  # noqa: BLE001 - any import failure means "not available"
        return False, (f"the training runtime is not available in this install ({type(e).__name__}: {e})")
    if not getattr(runs, "ENTRY", None):
        return False, "the training runtime has no training entry yet"
    if cluster is not None:
        remote = sorted({n.host for n in cluster.nodes if not launcher.is_local_host(n.host)})
        if remote:
            return False, (f"the cluster's hosts ({', '.join(remote[:4])}{' ...' if len(remote) > 4 else ''}) are "
                           "not this machine: launch from a script with an SSH transport, or edit a "
                           "Cluster.local(n) plan to train here")
    return True, ""


class NoPlan:
    """What :attr:`PlanEditor.strategy` is before the editor has seen a valid plan: falsy, and it says so (and
    why) when displayed, where ``None`` would show nothing."""

    __slots__ = ("reasons",)

    def __init__(self, reasons: Iterable[str] = ()) -> None:
        self.reasons = tuple(reasons)

    def __bool__(self) -> bool:
        return False

    def _text(self) -> list[str]:
        head = "no plan yet: the editor has not seen a valid plan"
        if not self.reasons:
            return [head]
        more = len(self.reasons) - 3
        return [f"{head}; fix {'this' if len(self.reasons) == 1 else 'these'} first (editor.problems):",
                *(f"  ✗ {r}" for r in self.reasons[:3]), *([f"  … and {more} more"] if more > 0 else [])]

    def __repr__(self) -> str:
        return "\n".join(self._text())

    def _repr_html_(self) -> str:
        import html

        head, *rest = self._text()
        items = "".join(f"<li>{html.escape(r.strip())}</li>" for r in rest)
        return (f"<div style='color:#a40e26'><b>{html.escape(head)}</b>"
                + (f"<ul style='margin:2px 0'>{items}</ul>" if items else "") + "</div>")


class _Valid:
    """The last fully valid plan: strategy, simulation and the core's resolution."""

    __slots__ = ("strategy", "sim", "plan", "program", "comm")

    def __init__(self, strategy: "Strategy", sim: "SimResult", res: Resolved) -> None:
        self.strategy, self.sim = strategy, sim
        self.plan, self.program, self.comm = res.plan, res.program, res.comm


class PlanEditor:
    """An interactive editor of a :class:`Strategy` on the cluster canvas (display it in a notebook).

    ``model``: a model config (any model the SDK can plan) or a preset name.  ``global_batch``: samples per step
    the strategy must add up to; it is pinned -- edits never change it, :meth:`set_global_batch` does (default:
    the initial strategy's, else the first valid plan's; an editor started without a strategy drafts one sample
    per device of the cluster, which any number of equal pipelines filling the cluster can share).  ``seq_len``:
    for the simulator (default ``model.max_seq_len``).  ``background``: resolve communication on a background
    thread (``False``: inline, for scripts and tests).  ``job``: a running job to show and drive (see :meth:`attach`).

    On the canvas a plain click on a device inspects it; dragging it onto a stage, or Alt+click (into the selected
    stage), moves it (see the module's docstring).
    """

    def __init__(self, cluster: "Cluster", model: Any, strategy: "Strategy | Any | None" = None,
                 *, global_batch: int | None = None, seq_len: int | None = None, cost: Any = None,
                 background: bool = True, job: Any = None) -> None:
        self.cluster = cluster
        self.model = load_model(model)
        start = Strategy.load(strategy) if strategy is not None else None
        self.global_batch = global_batch if global_batch is not None else (start.global_batch if start else None)
        self.batch_source = ("given" if global_batch is not None else "the initial strategy" if start else "")
        self.seq_len = seq_len or default_seq_len(self.model)
        self.cost = cost
        self.launch_steps = 10
        self._resolver = Resolver(self.model, cluster, background)
        self._sims: OrderedDict[tuple[str, ...], tuple["SimResult | None", list[Problem]]] = OrderedDict()
        self._draft = Draft.from_strategy(start) if start else self._empty_draft()
        self._selected: tuple[int, int] | None = (0, 0)
        self._history: list[tuple[Draft, tuple[int, int] | None, int | None, str]] = []
        self._future: list[tuple[Draft, tuple[int, int] | None, int | None, str]] = []
        self._problems: list[Problem] = []
        self._draft_problems: list[Problem] = []  # the draft's own, before communication resolution adds its
        self._current: "Strategy | None" = None
        self._sim: "SimResult | None" = None
        self._memory: dict[int, float] = {}
        self._memory_kind = ""
        self._valid: _Valid | None = None
        self._previous_step: float | None = None
        self._lock = threading.RLock()
        self._tensor: str | None = None
        self._message = ""
        self._launching = False
        self._ui: Any = None
        self._job: Any = None
        self._job_snapshot: Any = None
        self._job_events = 0
        self._failed: set[int] = set()
        self._groups: tuple[Any, tuple[str, ...], list[tuple[str, list[str]]]] = (None, (), [])
        self.last_change_seconds = 0.0
        self._revalidate()
        if job is not None:
            self.attach(job)

    # ---- public state ------------------------------------------------------------------------------------
    @property
    def background(self) -> bool:
        """Whether communication is resolved on a background thread."""
        return self._resolver.background

    @background.setter
    def background(self, on: bool) -> None:
        self._resolver.background = bool(on)

    @property
    def strategy(self) -> "Strategy | NoPlan":
        """The last fully valid strategy (waits for pending communication resolution); before the first valid
        plan a falsy :class:`NoPlan` that says so, and why, when displayed."""
        self.wait()
        if self._valid:
            return self._valid.strategy
        return NoPlan(str(p) for p in self._problems if p.level == "error")

    @property
    def plan(self) -> "AnnotationPlan | None":
        """The annotation plan of :attr:`strategy` (``plan_from_strategy``)."""
        self.wait()
        return self._valid.plan if self._valid else None

    @property
    def program(self) -> Any:
        """The specialized ``Program`` of :attr:`plan`."""
        self.wait()
        return self._valid.program if self._valid else None

    @property
    def sim(self) -> "SimResult | None":
        """The simulator's estimate for :attr:`strategy`."""
        self.wait()
        return self._valid.sim if self._valid else None

    @property
    def comm(self) -> Any:
        """What the canvas draws of :attr:`program`'s communication (:class:`._comm_view.CommView`: stage-boundary
        arrows with bytes per step, the busiest link)."""
        self.wait()
        return self._valid.comm if self._valid else None

    @property
    def draft(self) -> Draft:
        """A copy of the strategy being edited (possibly invalid)."""
        return self._draft.copy()

    @property
    def problems(self) -> list[Problem]:
        """Problems of the current draft (errors and warnings), after pending work finished."""
        self.wait()
        return list(self._problems)

    @property
    def errors(self) -> list[Problem]:
        """The problems that block Save, Launch and Apply."""
        return [p for p in self.problems if p.level == "error"]

    @property
    def warnings(self) -> list[Problem]:
        """The problems that cost but do not block."""
        return [p for p in self.problems if p.level == "warning"]

    @property
    def is_valid(self) -> bool:
        """Whether the current draft is a valid plan (it is then :attr:`strategy`)."""
        self.wait()
        return not any(p.level == "error" for p in self._problems) and self._current is not None

    @property
    def selected(self) -> tuple[int, int] | None:
        """The selected ``(pipeline, stage)`` that :meth:`click_device` (Alt+click) and Enter move devices into."""
        return self._selected

    @property
    def tensor(self) -> str | None:
        """The tensor whose annotation the canvas shows."""
        return self._tensor

    @property
    def message(self) -> str:
        """The last message about an edit that could not be made (empty when the last edit worked)."""
        return self._message

    @property
    def job(self) -> Any:
        """The attached job, if any."""
        return self._job

    @property
    def failed_ranks(self) -> list[int]:
        """Ranks the attached job reported as failed."""
        return sorted(self._failed)

    @property
    def resolving(self) -> bool:
        """Whether the draft's communication is still being resolved on the background thread."""
        return self._resolver.busy

    def wait(self, timeout: float | None = 60.0) -> None:
        """Block until background communication resolution (if any) has finished."""
        self._resolver.wait(timeout)

    # ---- edits -------------------------------------------------------------------------------------------
    def select_stage(self, pipeline: int, stage: int) -> None:
        """Select the stage that :meth:`click_device` moves devices into (no change to the strategy)."""
        self._draft.stage(pipeline, stage)
        self._selected = (pipeline, stage)
        self._message = ""
        self._redraw()

    def click_device(self, rank: int) -> None:
        """Toggle a device in the selected stage: a device of the selected stage leaves it; any other device moves
        into it (from any stage), at its place in rank order when the stage's devices are in rank order (so a
        device taken out and put back gives the same plan, TP ranks included), else after them.  On the canvas
        this is Alt+click (or Enter on a focused tile); a plain click only inspects."""
        self.cluster.check_rank(rank)

        def edit(d: Draft) -> None:
            stage = d.stage(*self._need_selection())
            if rank in stage.devices:
                stage.devices.remove(rank)
                return
            ordered = stage.devices == sorted(stage.devices)
            _take(d, [rank], stage)
            if ordered:
                stage.devices.sort()
        self._edit(edit)

    def select_devices(self, ranks: Iterable[int]) -> None:
        """Box-select: move every device of ``ranks`` into the selected stage (in rank order)."""
        sel = self._need_selection_or_message()
        if sel is not None:
            self.move_devices(ranks, *sel)

    def move_devices(self, ranks: Iterable[int], pipeline: int, stage: int) -> None:
        """Drag-and-drop: move ``ranks`` into stage ``stage`` of pipeline ``pipeline`` (in rank order, after its
        devices), taking them from any other stage; select that stage.  ``stage == len(stages)`` appends a new
        stage (it takes the second half of the last stage's layers); ``pipeline == len(pipelines)`` appends a new
        pipeline holding every layer."""
        ranks = sorted({int(r) for r in ranks})
        for r in ranks:
            self.cluster.check_rank(r)
        pipeline, stage = int(pipeline), int(stage)

        def edit(d: Draft) -> None:
            if pipeline == len(d.pipelines):
                d.pipelines.append(PipelineDraft([StageDraft([], [0, self.model.num_layers - 1])], 1, 1))
            p = d.pipelines[self._check_pipeline(pipeline, d)]
            if stage == len(p.stages):
                _split_last(p, self.model.num_layers)
            _take(d, ranks, d.stage(pipeline, stage))
        self._edit(edit, select=lambda d: (pipeline, stage))

    def unassign_devices(self, ranks: Iterable[int]) -> None:
        """Take ``ranks`` out of their stages (they become unused)."""
        ranks = [int(r) for r in ranks]

        def edit(d: Draft) -> None:
            for r in ranks:
                owner = d.owner(r)
                if owner is not None:
                    d.stage(*owner).devices.remove(r)
        self._edit(edit)

    def set_devices(self, pipeline: int, stage: int, ranks: Iterable[int]) -> None:
        """Make ``ranks`` (in this order: the TP group's order) the devices of a stage, taking them from any
        other stage."""
        ranks = [int(r) for r in ranks]

        def edit(d: Draft) -> None:
            target = d.stage(pipeline, stage)
            for r in ranks:
                owner = d.owner(r)
                if owner is not None and d.stage(*owner) is not target:
                    d.stage(*owner).devices.remove(r)
            target.devices[:] = ranks
        self._edit(edit, select=lambda d: (pipeline, stage))

    def set_layers(self, pipeline: int, stage: int, first: int, last: int) -> None:
        """Set a stage's inclusive layer range ``[first, last]``."""
        def edit(d: Draft) -> None:
            d.stage(pipeline, stage).layers = [int(first), int(last)]
        self._edit(edit)

    def set_recompute(self, pipeline: int, stage: int, on: bool = True) -> None:
        """Turn activation recomputation of a stage on or off."""
        def edit(d: Draft) -> None:
            d.stage(pipeline, stage).recompute = bool(on)
        self._edit(edit)

    def set_ratios(self, pipeline: int, stage: int, ratios: "Sequence[int] | str | None") -> None:
        """Uneven TP sharding (HAP, SPEC §12) of a stage: one positive integer per device, in the order of its
        devices.  ``[3, 1]`` gives its first device 3/4 of every TP-split tensor (3 of 4 heads) and the second
        1/4; the plan's annotations carry them as HDim ratios.  Text works too (``"3:1"``, ``"3, 1"``: what the
        stage card's field sends).  ``None``, ``""`` or equal ratios: the even split (the stage drops them).

        Ratios the core refuses -- not one per device, a share below 1, a split that cuts a head or a row
        (:func:`~hspmd_sdk.core.tp_ratios.ratio_problem`, which names the nearest feasible ratios), uneven ratios
        with context parallelism -- stay in the draft as an error at the stage, shown live; :attr:`strategy` keeps
        the last valid plan.  Text that is not whole numbers changes nothing and says why in :attr:`message`."""
        def edit(d: Draft) -> None:
            st = d.stage(pipeline, stage)
            parsed = _parse_ratios(ratios, f"pipeline {pipeline} · stage {stage}")
            even = (parsed is not None and len(parsed) == len(st.devices) and min(parsed) >= 1
                    and len(set(parsed)) == 1)
            st.ratios = None if parsed is None or even else parsed
        self._edit(edit)

    def set_cp(self, pipeline: int, stage: int, cp: int) -> None:
        """Context parallelism (SPEC §11) of a stage: its devices form ``cp`` groups of ``len(devices) // cp``
        tensor-parallel ranks, a cp × tp grid with TP fastest (devices ``[0, 1, 2, 3]`` with ``cp=2`` are CP2×TP2:
        TP groups ``[0, 1]`` and ``[2, 3]``).  Every activation's sequence is split over the groups, parameters
        are duplicated across them.  ``1``: no context parallelism.

        A cp that is below 1 or does not divide the stage's device count stays in the draft as an error at the
        stage (naming the values it can take), shown live; :attr:`strategy` keeps the last valid plan."""
        def edit(d: Draft) -> None:
            st = d.stage(pipeline, stage)
            st.cp = _whole(cp, f"pipeline {pipeline} · stage {stage}: cp {cp!r} is not a whole number; give the "
                               "number of context-parallel groups its devices form (1: none)")
        self._edit(edit)

    def set_micro_batches(self, pipeline: int, num_micro_batches: int | None = None,
                          micro_batch_size: int | None = None) -> None:
        """Set a pipeline's number of micro-batches and/or micro-batch size (the global batch stays pinned: a
        pipeline that now carries more samples is an error until another carries fewer)."""
        def edit(d: Draft) -> None:
            p = d.pipelines[self._check_pipeline(pipeline, d)]
            if num_micro_batches is not None:
                p.num_micro_batches = int(num_micro_batches)
            if micro_batch_size is not None:
                p.micro_batch_size = int(micro_batch_size)
        self._edit(edit)

    def set_global_batch(self, samples: int) -> None:
        """Change the pinned global batch (samples per step the pipelines must add up to)."""
        samples = int(samples)
        if samples < 1:
            self._message = f"the global batch must be at least 1 sample, not {samples}"
            self._redraw()
            return
        self._edit(lambda d: None, batch=(samples, "set by you"))

    def set_schedule(self, schedule: str) -> None:
        """``"1f1b"`` or ``"gpipe"`` for every pipeline."""
        def edit(d: Draft) -> None:
            d.schedule = schedule
        self._edit(edit)

    def set_zero1(self, on: bool = True) -> None:
        """ZeRO-1 (fp32 master weights and Adam states sharded over the pipelines); off turns every level off."""
        self.set_zero(max(self._draft.zero, 1) if on else 0)

    def set_zero(self, level: int) -> None:
        """The ZeRO level (SPEC §15): 0 none, 1 optimizer states, 2 also gradients, 3 also parameters (gathered
        around each use), sharded over the pipelines."""
        def edit(d: Draft) -> None:
            d.zero, d.zero1 = int(level), int(level) >= 1
        self._edit(edit)

    def set_name(self, name: str | None) -> None:
        def edit(d: Draft) -> None:
            d.name = name
        self._edit(edit)

    def add_pipeline(self, micro_batch_size: int = 1, num_micro_batches: int = 1) -> int:
        """Append a pipeline with one stage holding every layer and no devices yet; select it.  Returns its
        index."""
        def edit(d: Draft) -> None:
            d.pipelines.append(PipelineDraft([StageDraft([], [0, self.model.num_layers - 1])],
                                             int(micro_batch_size), int(num_micro_batches)))
        self._edit(edit, select=lambda d: (len(d.pipelines) - 1, 0))
        return len(self._draft.pipelines) - 1

    def remove_pipeline(self, pipeline: int | None = None) -> None:
        """Remove a pipeline (default: the selected one); its devices become unused."""
        def edit(d: Draft) -> None:
            p = self._check_pipeline(self._selected[0] if pipeline is None and self._selected else pipeline, d)
            del d.pipelines[p]
        self._edit(edit, select=lambda d: (0, 0) if d.pipelines and d.pipelines[0].stages else None)

    def add_stage(self, pipeline: int | None = None) -> int:
        """Append a stage to a pipeline (default: the selected one).  It takes the second half of the last
        stage's layers; it has no devices yet.  Selects it and returns its index."""
        target = pipeline if pipeline is not None else (self._selected[0] if self._selected else 0)

        def edit(d: Draft) -> None:
            _split_last(d.pipelines[self._check_pipeline(target, d)], self.model.num_layers)
        self._edit(edit, select=lambda d: (target, len(d.pipelines[target].stages) - 1))
        return len(self._draft.pipelines[target].stages) - 1 if target < len(self._draft.pipelines) else -1

    def remove_stage(self, pipeline: int | None = None, stage: int | None = None) -> None:
        """Remove a stage (default: the selected one); its layers go to the previous stage (or the next one for
        the first stage) and its devices become unused."""
        sel = self._selected or (0, 0)
        pi = sel[0] if pipeline is None else pipeline
        si = sel[1] if stage is None else stage

        def edit(d: Draft) -> None:
            p = d.pipelines[self._check_pipeline(pi, d)]
            s = d.stage(pi, si)
            if len(p.stages) > 1:
                neighbour = p.stages[si - 1] if si > 0 else p.stages[1]
                neighbour.layers = [min(neighbour.layers[0], s.layers[0]), max(neighbour.layers[1], s.layers[1])]
            del p.stages[si]
        self._edit(edit, select=lambda d: (pi, max(0, si - 1)) if d.pipelines[pi].stages else None)

    def load(self, source: "Strategy | str | Path | dict[str, Any]", *, note: str = "") -> None:
        """Replace the draft by a strategy (object, JSON text, path or dict); undoable."""
        strategy = Strategy.load(source)

        def edit(d: Draft) -> None:
            new = Draft.from_strategy(strategy)
            d.pipelines, d.schedule, d.zero1, d.zero, d.name = (new.pipelines, new.schedule, new.zero1, new.zero,
                                                                new.name)
        self._edit(edit, select=lambda d: (0, 0))
        self._message = note

    def undo(self) -> bool:
        """Undo the last change; returns ``False`` when there is nothing to undo."""
        return self._step(self._history, self._future, "undo")

    def redo(self) -> bool:
        """Redo the last undone change; returns ``False`` when there is nothing to redo."""
        return self._step(self._future, self._history, "redo")

    @property
    def can_undo(self) -> bool:
        return bool(self._history)

    @property
    def can_redo(self) -> bool:
        return bool(self._future)

    def pick_tensor(self, name: str | None) -> None:
        """Show ``name``'s annotation (from :attr:`plan`) on the canvas; ``None`` clears it.  An unknown name
        leaves the picture as it is and says which names are close."""
        name = (name or "").strip() or None
        if name:
            plan = self.plan
            if plan is not None and name not in plan.annotations:
                self._message = f"tensor {name!r} is not in the annotation plan; {_suggest(name, plan.annotations)}"
                self._redraw()
                return
        self._tensor = name
        self._message = ""
        self._redraw()

    # ---- files, launch, jobs -----------------------------------------------------------------------------
    def blocked(self, action: str = "save") -> str:
        """Why ``action`` (``"save"``, ``"launch"``, ``"apply"``) cannot act on the draft shown, or ``""`` (after
        pending communication resolution finished)."""
        self.wait()
        return self._blocked_now(action)

    def _blocked_now(self, action: str) -> str:
        errors = [p for p in self._problems if p.level == "error"]
        if errors:
            first = errors[0]
            more = f" (and {len(errors) - 1} more)" if len(errors) > 1 else ""
            return f"the plan shown has {len(errors)} error(s): {first}{more}"
        if self._current is None:
            return "there is no plan yet"
        if action == "launch" and self._launching:
            return "a launch is starting"
        if action in ("launch", "apply"):
            if self._valid is None or self._valid.strategy != self._current or self._valid.program is None:
                return ("its communication is being resolved" if self.resolving
                        else "its communication is not resolved")
            if action == "launch":
                ok, why = training_runtime(self.cluster)
                if not ok:
                    return why
            if action == "apply":
                return self._apply_blocked()
        return ""

    def to_json(self) -> str:
        """The draft shown as strategy JSON (it must be valid)."""
        why = self.blocked("save")
        if why:
            raise HSPMDError(f"nothing to write: {why}; fix the problems shown first")
        return self._current.to_json()

    def save(self, path: str | Path) -> Path:
        """Write the draft shown to ``path`` (strategy JSON) and return the path; refused (``HSPMDError``,
        nothing written) while the draft has errors."""
        path = Path(path)
        try:
            text = self.to_json()
        except HSPMDError as e:
            self._message = f"not saved: {e}"
            self._redraw()
            raise
        path.write_text(text)
        self._message = f"saved {path}"
        self._redraw()
        return path

    def launch(self, *, steps: int | None = None, **kw: Any) -> Any:
        """Train the draft shown with ``hspmd_sdk.runtime.launch(program, cluster, steps=...)`` (its ``seq_len``
        is the editor's unless given) and attach the job; refused while the draft has errors, its communication
        is unresolved, or the cluster is not this machine (:func:`training_runtime`).

        Until the workers are started (the first launch loads PyTorch too: seconds) the canvas says "starting
        workers…" and its Launch button is disabled (:attr:`launching`)."""
        why = self.blocked("launch")
        if why:
            raise HSPMDError(f"cannot launch: {why}")
        from ..runtime.control.progress import TICK_S, Ticker

        self._launching, before = True, self._message
        clock = _LaunchClock(self, f"starting {self.cluster.num_ranks} workers…")
        ticker = Ticker(clock, TICK_S)
        ticker.start()
        try:
            from ..runtime import launch  # lazy: the runtime (PyTorch: seconds, the first time) loads only here

            kw.setdefault("seq_len", self.seq_len)
            job = launch(self.program, self.cluster, steps=steps or self.launch_steps, **kw)
        except BaseException:
            self._message = before
            raise
        finally:
            clock.stop()
            ticker.stop()
            self._launching = False
        self.attach(job)
        self._message = f"launched job {getattr(job, 'job_id', '')}"
        self._redraw()
        return job

    @property
    def launching(self) -> bool:
        """Whether :meth:`launch` is starting a job now (the canvas's Launch button is disabled meanwhile)."""
        return self._launching

    def attach(self, job: Any) -> None:
        """Show ``job`` (a running :class:`~hspmd_sdk.runtime.Job`) with the plan: its step, loss curve,
        per-rank step times and events; when it reconfigures itself (an event with a new strategy) the canvas
        shows the new plan and its failed ranks.  :meth:`apply_to_job` switches it to the draft."""
        self._job = job
        self._job_events = 0
        self._failed = set()
        self.poll_job()
        if self._ui is not None:
            self._ui.watch_job()

    def poll_job(self) -> Any:
        """Read the attached job now (the canvas does this on a timer) and apply its new events; returns its
        :class:`._job.JobSnapshot`."""
        if self._job is None:
            return None
        snap = snapshot(self._job)
        self._on_job(snap)
        return snap

    def apply_to_job(self) -> Any:
        """``job.switch(editor.program)`` for the draft shown: refused while it has errors, its communication is
        unresolved, no job is attached, the job has stopped or cannot switch (a job launched by an SDK version
        without ``Job.switch``).  Returns what ``switch`` returns."""
        why = self.blocked("apply")
        if why:
            raise HSPMDError(f"cannot apply to the running job: {why}")
        result = self._job.switch(self.program)
        self._message = (f"asked job {getattr(self._job, 'job_id', '')} to switch to this plan at its next step "
                         "boundary")
        self._redraw()
        return result

    # ---- figures -------------------------------------------------------------------------------------------
    def figure(self, tensor: str | None = None) -> Any:
        """A standalone :func:`~hspmd_sdk.viz.cluster_figure` of :attr:`strategy` (with ``tensor``'s
        annotation, or the picked tensor's)."""
        from .cluster_fig import cluster_figure  # lazy: plotly

        name = tensor or self._tensor
        strategy, plan, sim = self.strategy or None, self.plan, self.sim
        if name and plan is not None:
            return cluster_figure(self.cluster, strategy, annotation=plan[name], shape=self.tensor_shape(name),
                                  tensor=name, memory=sim.peak_memory if sim else None)
        return cluster_figure(self.cluster, strategy, memory=sim.peak_memory if sim else None)

    def comm_figure(self, reshard: str) -> Any:
        """:func:`~hspmd_sdk.viz.comm_figure` of the ``CommPlan`` the core resolved for ``reshard`` (a Reshard
        or a gradient synchronisation of :attr:`program`)."""
        from .comm_fig import comm_figure  # lazy: plotly

        return comm_figure(self.comm_plan(reshard), self.cluster, strategy=self.strategy or None,
                           title=f"{reshard}: {' → '.join(self.comm_plan(reshard).kinds)}")

    def comm_plan(self, reshard: str) -> Any:
        """The ``CommPlan`` of a Reshard (or ``<param>.grad_sync``) in :attr:`program`."""
        program = self.program
        if program is None:
            raise HSPMDError("there is no valid plan yet: fix the problems shown first")
        for plans in (program.comm_plans, program.grad_sync_plans):
            if reshard in plans:
                return plans[reshard]
        raise KeyError(f"no Reshard {reshard!r} in the program (stage boundaries: "
                       f"{', '.join(n for n, _ in self.boundary_reshards()) or 'none'})")

    def tensor_shape(self, name: str) -> tuple[int, ...]:
        """The global shape of a tensor of :attr:`plan` as the core planned it: a Reshard's CommPlan shape, else
        the specialized graph's shape at the program's representative bindings, else the parameter shape."""
        self.wait()
        prog = self._valid.program if self._valid else None
        if prog is not None:
            for plans in (prog.comm_plans, prog.grad_sync_plans):
                if name in plans:
                    return tuple(plans[name].shape)
            shapes = prog.graph.bind(prog.bindings)
            base = name if name in shapes else name.rsplit(".", 1)[0]
            if base in shapes:
                return tuple(shapes[base])
        return param_shapes(self.model)[name]

    def gantt(self, devices: Iterable[int] | None = None) -> Any:
        """:func:`~hspmd_sdk.viz.gantt_figure` of the draft shown (it must simulate), one row per device (or per
        ``devices``)."""
        from .gantt import gantt_figure  # lazy: plotly

        sim = self._sim if self._sim is not None and self._current is not None else None
        if sim is None:
            raise HSPMDError(f"no timeline: {self.blocked('save') or 'the plan does not simulate'}")
        return gantt_figure(sim, devices=list(devices) if devices is not None else None, cluster=self.cluster)

    # ---- summary -------------------------------------------------------------------------------------------
    def boundary_reshards(self) -> list[tuple[str, list[str]]]:
        """``(Reshard name, operator kinds)`` of every stage-boundary Reshard of :attr:`program` (a Reshard whose
        subgroups move to other devices), in order of first use."""
        comm = self._valid.comm if self._valid else None
        seen: dict[str, list[str]] = {}
        for a in comm.arrows if comm is not None else ():
            seen.setdefault(a.reshard, list(a.kinds))
        return sorted(seen.items(), key=lambda kv: _natural(kv[0]))

    def grad_sync_kinds(self) -> dict[str, int]:
        """How the gradient synchronisation Reshards of :attr:`program` resolved: operator kinds -> count."""
        comm = self._valid.comm if self._valid else None
        return dict(comm.grad_sync) if comm is not None else {}

    def tensor_groups(self) -> list[tuple[str, list[str]]]:
        """The annotation plan's tensor names grouped for the picker: by the first numbered part of the name
        (``layers.7``), then everything else."""
        plan = self._valid.plan if self._valid else None
        if plan is None:
            return []
        if self._groups[0] is not plan:  # a new plan mostly names the same tensors: regrouped only if they differ
            names = tuple(plan.annotations)
            self._groups = (plan, names, self._groups[2] if names == self._groups[1] else _group_names(names))
        return self._groups[2]

    def summary(self) -> str:
        """The validation summary as plain text (what the canvas's verdict and stage list say)."""
        self.wait()
        return "\n".join(summary_lines(self))

    # ---- display -------------------------------------------------------------------------------------------
    @property
    def widget(self) -> Any:
        """The widget (built on first use): the canvas, with the timeline, communication and job views."""
        if self._ui is None:
            from ._editor_ui import EditorUI  # lazy: ipywidgets, plotly

            self._ui = EditorUI(self)
        return self._ui.root

    def _ipython_display_(self) -> None:
        from IPython.display import display

        display(self.widget)

    def close(self) -> None:
        """Stop the background worker and the job watcher."""
        self._resolver.close()
        if self._ui is not None:
            self._ui.close()

    # ---- internals -----------------------------------------------------------------------------------------
    def _empty_draft(self) -> Draft:
        """One pipeline, one stage with every layer and no devices, carrying the global batch: the one given, else
        one sample per device of the cluster, so that pipelines added later can share it (the first valid plan
        pins it; a batch of 1 could never be split)."""
        return Draft([PipelineDraft([StageDraft([], [0, self.model.num_layers - 1])], 1,
                                    self.global_batch or self.cluster.num_ranks)])

    def _need_selection(self) -> tuple[int, int]:
        if self._selected is None:
            raise ValueError("no stage is selected: select a stage first")
        return self._selected

    def _need_selection_or_message(self) -> tuple[int, int] | None:
        if self._selected is None:
            self._message = "no stage is selected: select a stage first"
            self._redraw()
        return self._selected

    def _check_pipeline(self, p: int | None, d: Draft | None = None) -> int:
        d = d or self._draft
        if p is None or not 0 <= p < len(d.pipelines):
            raise IndexError(f"there is no pipeline {p} (pipelines 0..{len(d.pipelines) - 1})")
        return p

    def _snapshot(self) -> tuple[Draft, tuple[int, int] | None, int | None, str]:
        return (self._draft, self._selected, self.global_batch, self.batch_source)

    def _edit(self, fn: Callable[[Draft], None], select: Callable[[Draft], tuple[int, int] | None] | None = None,
              batch: tuple[int, str] | None = None) -> None:
        """Apply one edit to a copy of the draft; on success keep it (undoable) and revalidate."""
        with self._lock:
            new = self._draft.copy()
            try:
                fn(new)
            except (ValueError, IndexError, KeyError) as e:
                self._message = str(e).strip("'\"")
                self._redraw()
                return
            self._history.append(self._snapshot())
            del self._history[:-_HISTORY]
            self._future.clear()
            self._draft = new
            if batch is not None:
                self.global_batch, self.batch_source = batch
            if select is not None:
                self._selected = select(new)
            self._fix_selection()
            self._message = ""
            self._revalidate()

    def _step(self, src: list, dst: list, what: str) -> bool:
        with self._lock:
            if not src:
                self._message = f"nothing to {what}"
                self._redraw()
                return False
            dst.append(self._snapshot())
            self._draft, self._selected, self.global_batch, self.batch_source = src.pop()
            self._fix_selection()
            self._message = ""
            self._revalidate()
            return True

    def _fix_selection(self) -> None:
        if self._selected is not None:
            try:
                self._draft.stage(*self._selected)
            except IndexError:
                d = self._draft
                self._selected = (0, 0) if d.pipelines and d.pipelines[0].stages else None

    def _revalidate(self) -> None:
        """Validate the draft, simulate it, start (or reuse) communication resolution, redraw."""
        t0 = time.perf_counter()
        strategy, problems = check_draft(self._draft, self.model, self.cluster, self.global_batch)
        problems += layout_warnings(self._draft, self.cluster)
        sim = None
        key = strategy.model_dump_json() if strategy is not None else None
        if strategy is not None:
            sim, sim_problems = self._simulate(strategy, key)
            problems += sim_problems
            if sim is None or any(p.level == "error" for p in sim_problems):
                strategy = None
        if strategy is not None and self.global_batch is None:
            self.global_batch, self.batch_source = strategy.global_batch, "the first valid plan"
        memory, kind = (dict(sim.peak_memory), "simulated") if sim is not None else (
            draft_memory(self._draft, self.model, self.seq_len, self.cost, self.cluster), "estimated")
        if sim is None:  # out of memory is an error beside the others, not hidden behind them
            problems += estimated_memory_errors(self._draft, memory, self.model, self.seq_len, self.cluster)
        with self._lock:
            if self._current is not None and self._sim is not None:
                self._previous_step = self._sim.step_time
            self._current, self._sim, self._problems = strategy, sim, problems
            self._draft_problems = list(problems)
            self._memory, self._memory_kind = memory, kind if memory else ""
        start = None
        if strategy is not None and key is not None:
            start = self._resolver.request(key, strategy, functools.partial(self._accept, key, strategy, sim))
        else:
            self._resolver.cancel()
        self._redraw()
        self.last_change_seconds = time.perf_counter() - t0
        if start is not None:  # a new plan's communication, resolved on the background thread after the redraw
            start()

    def _simulate(self, strategy: "Strategy", key: str) -> tuple["SimResult | None", list[Problem]]:
        """The simulation of ``strategy`` (JSON ``key``) and its memory errors, cached by everything it depends on:
        the strategy, the pinned batch, the sequence length and the cost model."""
        whole = (key, str(self.global_batch), str(self.seq_len),
                 self.cost.model_dump_json() if hasattr(self.cost, "model_dump_json") else repr(self.cost))
        got = self._sims.get(whole)
        if got is None:
            got = self._simulate_now(strategy)
            self._sims[whole] = got
            while len(self._sims) > _SIMS:
                self._sims.popitem(last=False)
        else:
            self._sims.move_to_end(whole)
        return got[0], list(got[1])

    def _simulate_now(self, strategy: "Strategy") -> tuple["SimResult | None", list[Problem]]:
        from ..planner.simulator import simulate  # lazy: tests patch planner.simulator.simulate at call time

        try:
            sim = simulate(self.model, strategy, self.cluster, global_batch=self.global_batch, seq_len=self.seq_len,
                           cost=self.cost)
        except HSPMDError as e:
            problems = getattr(e, "problems", None)
            if problems:
                return None, [locate(p, r) for p, r in problems]
            return None, [Problem("simulation", str(e))]
        return sim, memory_errors(strategy, sim, self.model, self.seq_len, self.cluster)

    def _accept(self, key: str, strategy: "Strategy", sim: "SimResult", res: Resolved, later: bool) -> None:
        """The resolution of ``key``'s plan arrived: keep it if that plan is still the draft's.  ``later``: it came
        from the background thread after the edit's redraw, so redraw (inline or cached, the edit's own redraw
        follows; widget messages run on a subshell thread in recent kernels, so the thread does not tell)."""
        with self._lock:
            if self._current is None or self._current.model_dump_json() != key:
                return
            if res.problem is not None:
                self._problems = self._draft_problems + [res.problem]
            else:
                self._valid = _Valid(strategy, sim, res)
                self._problems = self._draft_problems + comm_warnings(res.comm)
        if later:
            self._redraw()

    def _apply_blocked(self) -> str:
        if self._job is None:
            return "no job is attached (PlanEditor(..., job=job) or editor.attach(job))"
        if not can_switch(self._job):
            return SWITCH_NEEDS
        snap = self._job_snapshot
        if snap is not None and not snap.running:
            return f"job {snap.job_id} is {snap.status_text or snap.status}"
        return ""

    def _on_job(self, snap: Any) -> None:
        """A new job snapshot: remember it; a new event with a strategy becomes the draft (undoable)."""
        self._job_snapshot = snap
        fresh = snap.events[self._job_events:]
        self._job_events = len(snap.events)
        for ev in fresh:
            self._failed.update(ev.failed_ranks)
            if ev.strategy is not None:
                new = Strategy.load(ev.strategy)
                if Draft.from_strategy(new) != self._draft:
                    self.load(new, note=f"the job reconfigured itself: {ev.describe()}; the canvas shows its plan")
        self._redraw()

    def _redraw(self) -> None:
        if self._ui is not None:
            self._ui.refresh()

    def __repr__(self) -> str:
        d = self._draft
        state = "valid" if self._current is not None else f"{len(self._problems)} problem(s)"
        return (f"PlanEditor({self.cluster}, {model_name(self.model)}, {len(d.pipelines)} pipeline(s), {state}, "
                f"selected {self._selected})")


# ---- helpers -----------------------------------------------------------------------------------------------
class _LaunchClock:
    """The editor's message while :meth:`PlanEditor.launch` starts a job: ``text`` at once, then with the
    seconds it has taken (``starting 4 workers… 3 s``), redrawn by a :class:`~..runtime.control.progress.Ticker`
    while the launch loads the runtime and starts the processes."""

    def __init__(self, editor: PlanEditor, text: str) -> None:
        self.editor, self.text, self.t0 = editor, text, time.monotonic()
        self._lock, self._running = threading.Lock(), True
        editor._message = f"{text} (the first launch also loads PyTorch: a few seconds)"
        editor._redraw()

    def tick(self) -> None:
        with self._lock:
            took = int(time.monotonic() - self.t0)
            message = f"{self.text} {took} s (the first launch also loads PyTorch)"
            if took >= 1 and self._running and self.editor._message != message:
                self.editor._message = message
                self.editor._redraw()

    def stop(self) -> None:
        """No tick changes the message after this returns."""
        with self._lock:
            self._running = False


def _take(d: Draft, ranks: Iterable[int], target: StageDraft) -> None:
    """Move ``ranks`` into ``target`` (appended in the order given), out of any other stage."""
    for r in ranks:
        owner = d.owner(r)
        if owner is not None and d.stage(*owner) is not target:
            d.stage(*owner).devices.remove(r)
        if r not in target.devices:
            target.devices.append(r)


def _whole(value: Any, message: str) -> int:
    """``value`` as an int (an integral float or numeric text too); ``ValueError(message)`` otherwise."""
    if isinstance(value, bool):
        raise ValueError(message)
    if isinstance(value, str):
        value = value.strip()
        if not re.fullmatch(r"[+-]?\d+", value):
            raise ValueError(message)
        return int(value)
    if isinstance(value, float):
        if value.is_integer():
            return int(value)
        raise ValueError(message)
    try:
        return operator.index(value)  # int, numpy integers
    except TypeError:
        raise ValueError(message) from None


def _parse_ratios(ratios: "Sequence[int] | str | None", where: str) -> list[int] | None:
    """TP ratios from a list or from text (``"3:1"``, ``"3, 1"``, ``"3 1"``; ``""`` or ``"even"``: ``None``)."""
    if ratios is None:
        return None
    message = (f"{where}: ratios {ratios!r} are not whole numbers; give one positive integer per device, e.g. 3:1 "
               "(empty: the even split)")
    if isinstance(ratios, str):
        text = ratios.strip()
        if text.lower() in ("", "even", "none"):
            return None
        items: list[Any] = [t for t in re.split(r"[\s:,;]+", text) if t]
    else:
        try:
            items = list(ratios)
        except TypeError:
            raise ValueError(message) from None
    return [_whole(x, message) for x in items] or None


def _split_last(p: PipelineDraft, num_layers: int) -> None:
    """Append a stage taking the second half of the last stage's layers (every layer if there is none)."""
    if not p.stages:
        p.stages.append(StageDraft([], [0, num_layers - 1]))
        return
    last = p.stages[-1]
    a, b = last.layers
    if b <= a:
        raise ValueError(f"the last stage holds only layer {a}; give it more layers before adding a stage")
    mid = (a + b + 1) // 2
    last.layers = [a, mid - 1]
    p.stages.append(StageDraft([], [mid, b]))


_NUMBERED = re.compile(r"^(.*?\.\d+)\.")


def _natural(name: str) -> list[Any]:
    return [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", name)]


def _group_names(names: Iterable[str]) -> list[tuple[str, list[str]]]:
    groups: dict[str, list[str]] = {}
    other: list[str] = []
    for n in names:
        m = _NUMBERED.match(n)
        (groups.setdefault(m[1], []) if m else other).append(n)
    out = [(g, sorted(v, key=_natural)) for g, v in sorted(groups.items(), key=lambda kv: _natural(kv[0]))]
    return out + ([("other", sorted(other, key=_natural))] if other else [])


def _suggest(name: str, names: Iterable[str]) -> str:
    names = list(names)
    starts = [n for n in names if n.startswith(name)]
    close = difflib.get_close_matches(name, names, n=5, cutoff=0.6)
    picks = list(dict.fromkeys(starts[:5] + close))[:6]
    if picks:
        return "did you mean " + ", ".join(picks) + "?"
    return f"it has {len(names)} tensors, e.g. {', '.join(sorted(names, key=_natural)[:3])}"
