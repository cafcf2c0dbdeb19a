"""``PlanEditor``: build and edit a strategy on the cluster diagram, validated live by the core.

Every edit -- from a widget or from Python (``select_stage``, ``click_device``, ``set_layers``, ...) -- goes
through one method, is validated at once, and redraws:

1. the draft becomes a :class:`~hspmd_sdk.core.strategy.Strategy` with the core's checks against the model, the
   cluster and the global batch (:func:`.draft.check_draft`); problems are shown at the stage or pipeline they
   concern, in plain words;
2. a valid strategy is simulated (:func:`hspmd_sdk.planner.simulate`): step time, memory per rank vs capacity;
3. communication is resolved by the core -- ``AnnotationPlan.from_strategy`` then ``specialize`` -- on a
   background thread (it is the slow part), and the operators each stage-boundary Reshard resolved to are
   shown from the resulting ``Program``.  Results are cached per strategy, so undo is instant.

The last fully valid plan is kept (``editor.strategy``, ``editor.plan``, ``editor.program``) whatever the
draft looks like.  Reading them waits for pending background work.
"""
from __future__ import annotations

import threading
import time
from collections import Counter, OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterable

from ..errors import HSPMDError
from .draft import Draft, PipelineDraft, Problem, StageDraft, check_draft, locate

if TYPE_CHECKING:
    from ..core.cluster import Cluster
    from ..core.model_spec import ModelSpec
    from ..core.plan import AnnotationPlan
    from ..core.strategy import Strategy
    from ..planner.simulator import SimResult

__all__ = ["PlanEditor", "training_runtime"]

_HISTORY = 200
_CACHE = 16


def training_runtime(cluster: "Cluster | None" = None) -> tuple[bool, str]:
    """Whether ``hspmd_sdk.runtime.launch`` can train a ``Program`` here (on ``cluster``, if given), and why not.

    Needs the runtime's training entry (``hspmd_sdk.runtime.train.ENTRY``) and, for a local launch, every host of
    the cluster to be this machine."""
    try:
        from ..runtime import launcher, train
    except Exception as e:  # noqa: BLE001 - any import failure means "not available"
        return False, (f"the training runtime is not available in this install ({type(e).__name__}: {e})")
    if not getattr(train, "ENTRY", None):
        return False, "the training runtime has no training entry yet"
    if cluster is not None:
        remote = sorted({n.host for n in cluster.nodes if not launcher.is_local_host(n.host)})
        if remote:
            return False, (f"the cluster's hosts ({', '.join(remote[:4])}{' ...' if len(remote) > 4 else ''}) are "
                           "not this machine: launch from a script with an SSH transport")
    return True, ""


@dataclass(frozen=True)
class _Resolved:
    """The core's communication resolution of one strategy: its annotation plan and specialized program."""

    plan: Any = None
    program: Any = None
    problem: Problem | None = None
    seconds: float = 0.0


@dataclass(frozen=True)
class _Valid:
    strategy: "Strategy"
    sim: "SimResult"
    plan: Any
    program: Any


class PlanEditor:
    """An interactive editor of a :class:`Strategy` on a cluster diagram (display it in a notebook).

    ``model``: a model config (:class:`~hspmd_sdk.models.ModelSpec`: ``LlamaConfig``, ``GPTConfig``, ...) or preset name.  ``global_batch``: samples per step the strategy must add
    up to (default: the initial strategy's).  ``seq_len``: for the simulator (default ``model.max_seq_len``).
    ``background``: resolve communication on a background thread (``False``: inline, for scripts and tests).
    """

    def __init__(self, cluster: "Cluster", model: "ModelSpec | str", strategy: "Strategy | Any | None" = None,
                 *, global_batch: int | None = None, seq_len: int | None = None, cost: Any = None,
                 background: bool = True) -> None:
        from ..models.registry import load_model_spec
        from ..core.strategy import Strategy

        self.cluster = cluster
        self.model = load_model_spec(model)
        start = Strategy.load(strategy) if strategy is not None else None
        self.global_batch = global_batch if global_batch is not None else (start.global_batch if start else None)
        self.seq_len = seq_len or self.model.max_seq_len
        self.cost = cost
        self.background = background
        self._draft = Draft.from_strategy(start) if start else self._empty_draft()
        self._selected: tuple[int, int] | None = (0, 0)
        self._history: list[tuple[Draft, tuple[int, int] | None]] = []
        self._problems: list[Problem] = []
        self._current: "Strategy | None" = None
        self._sim: "SimResult | None" = None
        self._valid: _Valid | None = None
        self._cache: OrderedDict[str, _Resolved] = OrderedDict()
        self._lock = threading.RLock()
        self._executor: ThreadPoolExecutor | None = None
        self._pending: Future | None = None
        self._wanted: str | None = None
        self._resolving = False
        self._tensor: str | None = None
        self._message = ""
        self._ui: Any = None
        self.last_change_seconds = 0.0
        self._revalidate()

    # ---- public state ------------------------------------------------------------------------------------
    @property
    def strategy(self) -> "Strategy | None":
        """The last fully valid strategy (waits for pending communication resolution)."""
        self.wait()
        return self._valid.strategy if self._valid else None

    @property
    def plan(self) -> "AnnotationPlan | None":
        """The annotation plan of :attr:`strategy` (``AnnotationPlan.from_strategy``)."""
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
        return [p for p in self.problems if p.level == "error"]

    @property
    def is_valid(self) -> bool:
        """Whether the current draft is a valid plan (it is then :attr:`strategy`)."""
        self.wait()
        return not any(p.level == "error" for p in self._problems) and self._current is not None

    @property
    def selected(self) -> tuple[int, int] | None:
        """The selected ``(pipeline, stage)`` that clicked devices join."""
        return self._selected

    @property
    def tensor(self) -> str | None:
        return self._tensor

    @property
    def message(self) -> str:
        """The last message about an edit that could not be made (empty when the last edit worked)."""
        return self._message

    def wait(self, timeout: float | None = 60.0) -> None:
        """Block until background communication resolution (if any) has finished."""
        fut = self._pending
        if fut is not None:
            fut.result(timeout=timeout)

    # ---- edits -------------------------------------------------------------------------------------------
    def select_stage(self, pipeline: int, stage: int) -> None:
        """Select the stage that clicked devices join (no change to the strategy)."""
        self._draft.stage(pipeline, stage)
        self._selected = (pipeline, stage)
        self._message = ""
        self._redraw()

    def click_device(self, rank: int) -> None:
        """A click on a device tile: a device of the selected stage leaves it; any other device moves into it."""
        self.cluster.check_rank(rank)

        def edit(d: Draft) -> None:
            sel = self._need_selection()
            stage = d.stage(*sel)
            if rank in stage.devices:
                stage.devices.remove(rank)
                return
            owner = d.owner(rank)
            if owner is not None:
                d.stage(*owner).devices.remove(rank)
            stage.devices.append(rank)
        self._edit(edit)

    def select_devices(self, ranks: Iterable[int]) -> None:
        """Box-select: move every device of ``ranks`` into the selected stage (in rank order)."""
        ranks = [int(r) for r in ranks]
        for r in ranks:
            self.cluster.check_rank(r)

        def edit(d: Draft) -> None:
            stage = d.stage(*self._need_selection())
            for r in sorted(ranks):
                owner = d.owner(r)
                if owner is not None and d.stage(*owner) is not stage:
                    d.stage(*owner).devices.remove(r)
                if r not in stage.devices:
                    stage.devices.append(r)
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
        self._edit(edit)
        self._selected = (pipeline, stage)

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

    def set_micro_batches(self, pipeline: int, num_micro_batches: int | None = None,
                          micro_batch_size: int | None = None) -> None:
        """Set a pipeline's number of micro-batches and/or micro-batch size."""
        def edit(d: Draft) -> None:
            p = d.pipelines[self._check_pipeline(pipeline)]
            if num_micro_batches is not None:
                p.num_micro_batches = int(num_micro_batches)
            if micro_batch_size is not None:
                p.micro_batch_size = int(micro_batch_size)
        self._edit(edit)

    def set_schedule(self, schedule: str) -> None:
        """``"1f1b"`` or ``"gpipe"`` for every pipeline."""
        def edit(d: Draft) -> None:
            d.schedule = schedule
        self._edit(edit)

    def set_zero1(self, on: bool = True) -> None:
        """ZeRO-1 (fp32 master weights and Adam states sharded over the pipelines)."""
        def edit(d: Draft) -> None:
            d.zero1 = bool(on)
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
            p = self._check_pipeline(self._selected[0] if pipeline is None and self._selected else pipeline)
            del d.pipelines[p]
        self._edit(edit, select=lambda d: (0, 0) if d.pipelines and d.pipelines[0].stages else None)

    def add_stage(self, pipeline: int | None = None) -> int:
        """Append a stage to a pipeline (default: the selected one).  It takes the second half of the last
        stage's layers; it has no devices yet.  Selects it and returns its index."""
        def edit(d: Draft) -> None:
            p = d.pipelines[self._check_pipeline(self._selected[0] if pipeline is None and self._selected
                                                 else pipeline)]
            last = p.stages[-1] if p.stages else None
            if last is None:
                p.stages.append(StageDraft([], [0, self.model.num_layers - 1]))
                return
            a, b = last.layers
            if b <= a:
                raise ValueError(f"the last stage holds only layer {a}; give it more layers before adding a stage")
            mid = (a + b + 1) // 2
            last.layers = [a, mid - 1]
            p.stages.append(StageDraft([], [mid, b]))
        target = pipeline if pipeline is not None else (self._selected[0] if self._selected else 0)
        self._edit(edit, select=lambda d: (target, len(d.pipelines[target].stages) - 1))
        return len(self._draft.pipelines[target].stages) - 1

    def remove_stage(self, pipeline: int | None = None, stage: int | None = None) -> None:
        """Remove a stage (default: the selected one); its layers go to the previous stage (or the next one for
        the first stage) and its devices become unused."""
        sel = self._selected or (0, 0)
        pi = sel[0] if pipeline is None else pipeline
        si = sel[1] if stage is None else stage

        def edit(d: Draft) -> None:
            p = d.pipelines[self._check_pipeline(pi)]
            s = d.stage(pi, si)
            if len(p.stages) > 1:
                neighbour = p.stages[si - 1] if si > 0 else p.stages[1]
                neighbour.layers = [min(neighbour.layers[0], s.layers[0]), max(neighbour.layers[1], s.layers[1])]
            del p.stages[si]
        self._edit(edit, select=lambda d: (pi, max(0, si - 1)) if d.pipelines[pi].stages else None)

    def load(self, source: "Strategy | str | Path | dict[str, Any]") -> None:
        """Replace the draft by a strategy (object, JSON text, path or dict); undoable."""
        from ..core.strategy import Strategy

        strategy = Strategy.load(source)

        def edit(d: Draft) -> None:
            new = Draft.from_strategy(strategy)
            d.pipelines, d.schedule, d.zero1, d.name = new.pipelines, new.schedule, new.zero1, new.name
        self._edit(edit, select=lambda d: (0, 0))

    def undo(self) -> bool:
        """Undo the last change; returns ``False`` when there is nothing to undo."""
        if not self._history:
            self._message = "nothing to undo"
            self._redraw()
            return False
        self._draft, self._selected = self._history.pop()
        self._message = ""
        self._revalidate()
        return True

    def pick_tensor(self, name: str | None) -> None:
        """Show ``name``'s annotation (from :attr:`plan`) on the diagram; ``None`` clears it."""
        if name:
            plan = self.plan
            if plan is not None and name not in plan.annotations:
                self._message = f"tensor {name!r} is not in the annotation plan (e.g. layers.0.attn.wq)"
                self._redraw()
                return
        self._tensor = name or None
        self._message = ""
        self._redraw()

    # ---- files and launch --------------------------------------------------------------------------------
    def to_json(self) -> str:
        """The last valid strategy as JSON."""
        s = self.strategy
        if s is None:
            raise HSPMDError("there is no valid strategy yet: fix the problems shown first")
        return s.to_json()

    def save(self, path: str | Path) -> Path:
        """Write the last valid strategy to ``path`` (JSON) and return the path."""
        path = Path(path)
        path.write_text(self.to_json())
        self._message = f"saved {path}"
        self._redraw()
        return path

    def launch(self, *, steps: int = 10, **kw: Any) -> Any:
        """``hspmd_sdk.runtime.launch(program, cluster, steps=..., entry=<training entry>)`` of the last valid
        plan, if the training runtime is available and the cluster is this machine (see
        :func:`training_runtime`)."""
        ok, why = training_runtime(self.cluster)
        if not ok:
            raise HSPMDError(f"cannot launch: {why}")
        from ..runtime import launch, train

        if self.program is None:
            raise HSPMDError("there is no valid plan to launch yet")
        kw.setdefault("entry", train.ENTRY)
        return launch(self.program, self.cluster, steps=steps, **kw)

    # ---- figures -------------------------------------------------------------------------------------------
    def figure(self, tensor: str | None = None) -> Any:
        """A standalone :func:`~hspmd_sdk.viz.cluster_figure` of :attr:`strategy` (with ``tensor``'s
        annotation, or the picked tensor's)."""
        from .cluster_fig import cluster_figure

        name = tensor or self._tensor
        strategy, plan, sim = self.strategy, self.plan, self.sim
        if name and plan is not None:
            return cluster_figure(self.cluster, strategy, annotation=plan[name], shape=self.tensor_shape(name),
                                  tensor=name, memory=sim.peak_memory if sim else None)
        return cluster_figure(self.cluster, strategy, memory=sim.peak_memory if sim else None)

    def comm_figure(self, reshard: str) -> Any:
        """:func:`~hspmd_sdk.viz.comm_figure` of the ``CommPlan`` the core resolved for ``reshard`` (a Reshard
        or a gradient synchronisation of :attr:`program`)."""
        from .comm_fig import comm_figure

        return comm_figure(self.comm_plan(reshard), self.cluster, strategy=self.strategy)

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
        """The global shape of a tensor of :attr:`plan` as the core planned it (a Reshard's CommPlan shape, else
        the specialized graph's shape at the program's representative bindings, else the parameter shape)."""
        from ._editor_ui import _tensor_shape

        self.wait()
        return _tensor_shape(self, name)

    def gantt(self, devices: Iterable[int] | None = None) -> Any:
        """:func:`~hspmd_sdk.viz.gantt_figure` of :attr:`sim` (one row per device, or per ``devices``)."""
        from .gantt import gantt_figure

        sim = self.sim
        if sim is None:
            raise HSPMDError("there is no valid plan yet: fix the problems shown first")
        return gantt_figure(sim, devices=list(devices) if devices is not None else None, cluster=self.cluster)

    # ---- summary -------------------------------------------------------------------------------------------
    def boundary_reshards(self) -> list[tuple[str, list[str]]]:
        """``(Reshard name, operator kinds)`` of every stage-boundary Reshard of :attr:`program`: the
        ``layers.{i}.in`` Reshards where some pipeline changes stage, as the core resolved them."""
        valid = self._valid
        if valid is None or valid.program is None:
            return []
        firsts = sorted({s.layers[0] for p in valid.strategy.pipelines for s in p.stages[1:]})
        plans = valid.program.comm_plans
        return [(f"layers.{i}.in", list(plans[f"layers.{i}.in"].kinds)) for i in firsts
                if f"layers.{i}.in" in plans]

    def summary(self) -> str:
        """The validation summary as plain text (what the summary panel shows)."""
        from ._editor_view import summary_lines

        self.wait()
        return "\n".join(summary_lines(self))

    # ---- display -------------------------------------------------------------------------------------------
    @property
    def widget(self) -> Any:
        """The ipywidgets container (built on first use)."""
        if self._ui is None:
            from ._editor_ui import EditorUI

            self._ui = EditorUI(self)
        return self._ui.root

    def _ipython_display_(self) -> None:
        from IPython.display import display

        display(self.widget)

    def close(self) -> None:
        """Stop the background worker."""
        if self._executor is not None:
            self._executor.shutdown(wait=False, cancel_futures=True)
            self._executor = None

    # ---- internals -----------------------------------------------------------------------------------------
    def _empty_draft(self) -> Draft:
        return Draft([PipelineDraft([StageDraft([], [0, self.model.num_layers - 1])], 1,
                                    self.global_batch or 1)])

    def _need_selection(self) -> tuple[int, int]:
        if self._selected is None:
            raise ValueError("no stage is selected: select a stage first")
        return self._selected

    def _check_pipeline(self, p: int | None) -> int:
        if p is None or not 0 <= p < len(self._draft.pipelines):
            raise IndexError(f"there is no pipeline {p} (pipelines 0..{len(self._draft.pipelines) - 1})")
        return p

    def _edit(self, fn: Callable[[Draft], None],
              select: Callable[[Draft], tuple[int, int] | None] | None = None) -> None:
        """Apply one edit to a copy of the draft; on success keep it (undoable) and revalidate."""
        new = self._draft.copy()
        try:
            fn(new)
        except (ValueError, IndexError, KeyError) as e:
            self._message = str(e).strip("'\"")
            self._redraw()
            return
        self._history.append((self._draft, self._selected))
        del self._history[:-_HISTORY]
        self._draft = new
        if select is not None:
            self._selected = select(new)
        if self._selected is not None:
            try:
                new.stage(*self._selected)
            except IndexError:
                self._selected = (0, 0) if new.pipelines and new.pipelines[0].stages else None
        self._message = ""
        self._revalidate()

    def _revalidate(self) -> None:
        """Validate the draft, simulate it, start (or reuse) communication resolution, redraw."""
        t0 = time.perf_counter()
        strategy, problems = check_draft(self._draft, self.model, self.cluster, self.global_batch)
        sim = None
        if strategy is not None:
            sim, sim_problems = self._simulate(strategy)
            problems += sim_problems
            if sim is None:
                strategy = None
        with self._lock:
            self._current, self._sim, self._problems = strategy, sim, problems
            self._wanted = strategy.model_dump_json() if strategy is not None else None
            self._resolving = False
        if strategy is not None and sim is not None:
            self._resolve(strategy, sim)
        self._redraw()
        self.last_change_seconds = time.perf_counter() - t0

    def _simulate(self, strategy: "Strategy") -> tuple["SimResult | None", list[Problem]]:
        from ..planner.simulator import simulate

        try:
            sim = simulate(self.model, strategy, self.cluster, global_batch=self.global_batch, seq_len=self.seq_len,
                           cost=self.cost)
        except HSPMDError as e:
            problems = getattr(e, "problems", None)
            if problems:
                return None, [locate(p, r) for p, r in problems]
            return None, [Problem("simulation", str(e))]
        out = []
        for i, p in enumerate(strategy.pipelines):
            for j, s in enumerate(p.stages):
                over = [r for r in s.devices if r in sim.oom]
                if over:
                    r = max(over, key=lambda d: sim.peak_memory[d] / sim.capacity[d])
                    out.append(Problem(f"pipelines[{i}].stages[{j}]",
                                       f"out of memory: rank {r} needs ~{sim.peak_memory[r] / 2**30:.1f} GiB of "
                                       f"{sim.capacity[r] / 2**30:.1f} GiB (more TP, fewer layers, smaller "
                                       "micro-batches, recompute or ZeRO-1 would help)", i, j, level="warning"))
        return sim, out

    def _resolve(self, strategy: "Strategy", sim: "SimResult") -> None:
        key = strategy.model_dump_json()
        cached = self._cache.get(key)
        if cached is not None:
            self._accept(key, strategy, sim, cached)
            return
        if not self.background:
            self._accept(key, strategy, sim, self._compute(key, strategy))
            return
        if self._executor is None:
            self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="hspmd-editor")

        def job() -> None:
            if self._wanted != key:  # a newer edit superseded this one before it started
                return
            try:
                res = self._compute(key, strategy)
                self._accept(key, strategy, sim, res)
            finally:
                if self._wanted == key:
                    self._resolving = False
            self._redraw(from_worker=True)
        self._resolving = True
        self._pending = self._executor.submit(job)

    def _compute(self, key: str, strategy: "Strategy") -> _Resolved:
        from ..core.plan import AnnotationPlan
        from ..core.specialize import specialize

        t0 = time.perf_counter()
        try:
            plan = AnnotationPlan.from_strategy(self.model, strategy, self.cluster)
            program = specialize(self.model, plan, self.cluster)
            res = _Resolved(plan, program, None, time.perf_counter() - t0)
        except HSPMDError as e:
            problems = getattr(e, "problems", None)
            prob = locate(*problems[0]) if problems else locate("", str(e))
            if prob.tensor is None and prob.pipeline is None:
                prob = Problem(prob.path or "communication", f"communication resolution failed: {prob.message}")
            res = _Resolved(None, None, prob, time.perf_counter() - t0)
        except Exception as e:  # noqa: BLE001 - shown in plain words, never as a traceback
            res = _Resolved(None, None, Problem("communication", f"communication resolution failed "
                                                                 f"({type(e).__name__}): {e}"),
                            time.perf_counter() - t0)
        with self._lock:
            self._cache[key] = res
            while len(self._cache) > _CACHE:
                self._cache.popitem(last=False)
        return res

    def _accept(self, key: str, strategy: "Strategy", sim: "SimResult", res: _Resolved) -> None:
        with self._lock:
            if self._wanted != key:
                return
            if res.problem is not None:
                self._problems = self._problems + [res.problem]
            else:
                self._valid = _Valid(strategy, sim, res.plan, res.program)

    def _redraw(self, from_worker: bool = False) -> None:
        if self._ui is not None:
            self._ui.refresh(from_worker=from_worker)

    def grad_sync_kinds(self) -> Counter:
        """How the gradient synchronisation Reshards of :attr:`program` resolved: operator kinds -> count."""
        valid = self._valid
        if valid is None or valid.program is None:
            return Counter()
        return Counter(" + ".join(p.kinds) for p in valid.program.grad_sync_plans.values())

    def __repr__(self) -> str:
        d = self._draft
        state = "valid" if self._current is not None else f"{len(self._problems)} problem(s)"
        return (f"PlanEditor({self.cluster}, {self.model.name}, {len(d.pipelines)} pipeline(s), {state}, "
                f"selected {self._selected})")

