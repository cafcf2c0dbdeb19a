"""The plan editor's widgets: the cluster diagram (a plotly ``FigureWidget``) and stock ipywidgets controls.

Every callback calls the same public :class:`~hspmd_sdk.viz.editor.PlanEditor` method a script would; this
module only draws the editor's state.
"""
from __future__ import annotations

import html
import threading
from typing import TYPE_CHECKING, Any, Callable

import ipywidgets as W
import plotly.graph_objects as go

from ._editor_view import general_problems, stage_messages, summary_html
from ._geometry import geometry
from ._style import ERROR, pipeline_colour, stage_colour
from .cluster_fig import LABELS, TILES, annotation_overlay, base_figure, tile_style
from .editor import training_runtime

if TYPE_CHECKING:
    from .editor import PlanEditor

__all__ = ["EditorUI"]

_SMALL = W.Layout(width="62px")


def _button(text: str, tip: str, fn: Callable[[], Any], width: str = "auto") -> W.Button:
    b = W.Button(description=text, tooltip=tip, layout=W.Layout(width=width))
    b.on_click(lambda _b: fn())
    return b


class EditorUI:
    """Widgets of one editor; :meth:`refresh` redraws them from the editor's state."""

    def __init__(self, editor: "PlanEditor") -> None:
        self.ed = editor
        self.geom = geometry(editor.cluster)
        self._syncing = False
        self._lock = threading.RLock()  # the background worker redraws too
        self._shape_key: tuple[int, ...] = ()
        self._tensor_drawn: tuple[Any, ...] | None = None
        base = base_figure(editor.cluster, self.geom, f"{editor.model.name} on {editor.cluster}")
        self.fig = go.FigureWidget(base)
        self._node_shapes = tuple(self.fig.layout.shapes)
        tiles = self.fig.data[TILES]
        tiles.on_click(self._on_click)
        tiles.on_selection(self._on_select)
        self.summary = W.HTML(layout=W.Layout(width="100%"))
        self.summary.add_class("hspmd-summary-widget")
        self.general = W.HTML()
        self.stages_box = W.VBox()
        self.schedule = W.Dropdown(options=["1f1b", "gpipe"], description="schedule", layout=W.Layout(width="170px"))
        self.zero1 = W.Checkbox(description="ZeRO-1", indent=False, layout=W.Layout(width="90px"))
        self.schedule.observe(lambda ch: self._guard(lambda: self.ed.set_schedule(ch["new"])), "value")
        self.zero1.observe(lambda ch: self._guard(lambda: self.ed.set_zero1(ch["new"])), "value")
        self.tensor = W.Combobox(placeholder="tensor, e.g. layers.0.attn.wq", ensure_option=False,
                                 layout=W.Layout(width="260px"))
        self.tensor.observe(self._on_tensor, "value")
        self.tensor_legend = W.HTML()
        self.path = W.Text(value="strategy.json", layout=W.Layout(width="200px"))
        ok, why = training_runtime(editor.cluster)
        self.launch = W.Button(description="Launch locally", disabled=not ok,
                               tooltip="hspmd_sdk.runtime.launch(program, cluster)" if ok else why,
                               icon="play", layout=W.Layout(width="160px"))
        self.launch.on_click(lambda _b: self._launch())
        toolbar = W.HBox([
            _button("+ pipeline", "add a pipeline (data parallel)", lambda: self.ed.add_pipeline()),
            _button("− pipeline", "remove the selected pipeline", lambda: self.ed.remove_pipeline()),
            _button("+ stage", "add a stage to the selected pipeline", lambda: self.ed.add_stage()),
            _button("− stage", "remove the selected stage", lambda: self.ed.remove_stage()),
            _button("Undo", "undo the last change", lambda: self.ed.undo()),
        ])
        files = W.VBox([
            W.HBox([self.path, _button("Save", "save the last valid strategy as JSON", lambda: self._file("save"),
                                       "72px"),
                    _button("Load", "load a strategy JSON", lambda: self._file("load"), "72px")]),
            W.HBox([_button("Timeline", "draw the simulated pipeline timeline of the last valid plan",
                            self._timeline, "100px"), self.launch])])
        self.timeline = W.Output()
        hint = W.HTML("<small>Select a stage, then click device tiles (or box-select) to move them into it; "
                      "click a device of the selected stage to take it out.</small>")
        right = W.VBox([toolbar, W.HBox([self.schedule, self.zero1]), hint, self.stages_box,
                        W.HBox([W.HTML("<b>annotation of</b>"), self.tensor]), self.tensor_legend, files],
                       layout=W.Layout(width="520px", padding="0 0 0 8px"))
        self.root = W.VBox([W.HBox([self.fig, right]), self.general, self.summary, self.timeline])
        self.root.add_class("hspmd-plan-editor")
        self.refresh()

    # ---- callbacks ---------------------------------------------------------------------------------------
    def _guard(self, fn: Callable[[], Any]) -> None:
        if not self._syncing:
            fn()

    def _on_click(self, trace: Any, points: Any, state: Any) -> None:
        for i in points.point_inds:
            self.ed.click_device(int(i))

    def _on_select(self, trace: Any, points: Any, selector: Any) -> None:
        if points.point_inds:
            self.ed.select_devices([int(i) for i in points.point_inds])

    def _on_tensor(self, change: dict[str, Any]) -> None:
        name = (change["new"] or "").strip()
        if self._syncing:
            return
        if not name:
            self.ed.pick_tensor(None)
        elif name in self.tensor.options:
            self.ed.pick_tensor(name)

    def _file(self, what: str) -> None:
        try:
            if what == "save":
                self.ed.save(self.path.value)
            else:
                self.ed.load(self.path.value)
        except Exception as e:  # noqa: BLE001 - shown in words, not as a traceback
            self.ed._message = f"{what} failed: {e}"
            self.refresh()

    def _timeline(self) -> None:
        from IPython.display import display

        self.timeline.clear_output()
        if self.ed._valid is None:
            return
        with self.timeline:
            display(self.ed.gantt())

    def _launch(self) -> None:
        try:
            job = self.ed.launch()
            self.ed._message = f"launched job {getattr(job, 'job_id', '')}"
        except Exception as e:  # noqa: BLE001
            self.ed._message = f"launch failed: {e}"
        self.refresh()

    # ---- drawing -----------------------------------------------------------------------------------------
    def refresh(self, from_worker: bool = False) -> None:
        """Redraw tiles, controls, the tensor overlay and the summary from the editor's state."""
        with self._lock:
            self._refresh()

    def _refresh(self) -> None:
        ed = self.ed
        self._syncing = True
        try:
            self._draw_tiles()
            self._draw_controls()
            self._draw_tensor()
            self.summary.value = summary_html(ed)
            gen = [p for p in general_problems(ed)]
            self.general.value = "".join(f"<div style='color:{ERROR}'><b>{html.escape(p.where)}</b>: "
                                         f"{html.escape(p.message)}</div>" for p in gen if not p.tensor)
        finally:
            self._syncing = False

    def _draw_tiles(self) -> None:
        ed = self.ed
        flagged = [r for p in ed._problems if p.stage is not None and p.level == "error"
                   for r in _stage_devices(ed, p.pipeline, p.stage)]
        sim = ed._sim if ed._sim is not None else (ed._valid.sim if ed._valid else None)
        style = tile_style(ed.cluster, ed._draft, memory=sim.peak_memory if sim else None,
                           selected=ed._selected, flagged=flagged)
        with self.fig.batch_update():
            t, lab = self.fig.data[TILES], self.fig.data[LABELS]
            t.marker.color, t.marker.line.color, t.marker.line.width = style.fill, style.line, style.width
            t.hovertext, lab.text = style.hover, style.label
            t.selectedpoints = None

    def _draw_controls(self) -> None:
        ed, d = self.ed, self.ed._draft
        key = tuple(len(p.stages) for p in d.pipelines)
        if key != self._shape_key:
            self._build_rows()
            self._shape_key = key
        self.schedule.value = d.schedule
        self.zero1.value = d.zero1
        for i, (p, row) in enumerate(zip(d.pipelines, self._rows)):
            head, mbs, nmb, msg, stage_rows = row
            mbs.value, nmb.value = p.micro_batch_size, p.num_micro_batches
            msg.value = _messages(stage_messages(ed, i, None))
            for j, (s, (btn, ranks, first, last, rc, smsg)) in enumerate(zip(p.stages, stage_rows)):
                sel = ed._selected == (i, j)
                btn.description = f"{'▶ ' if sel else ''}S{j}"
                btn.style.button_color = stage_colour(i, j, len(p.stages))
                btn.style.font_weight = "bold" if sel else "normal"
                ranks.value = f"<span title='TP group'>{_ranks(s.devices)}</span> <small>TP{len(s.devices)}</small>"
                first.value, last.value = s.layers
                rc.value = s.recompute
                smsg.value = _messages(stage_messages(ed, i, j))

    def _build_rows(self) -> None:
        ed, d = self.ed, self.ed._draft
        n = ed.model.num_layers
        self._rows: list[Any] = []
        boxes = []
        for i, p in enumerate(d.pipelines):
            head = W.HTML(f"<b style='color:{pipeline_colour(i)}'>Pipeline {i}</b>")
            mbs = W.BoundedIntText(min=1, max=4096, description="size", layout=W.Layout(width="110px"),
                                   style={"description_width": "32px"})
            nmb = W.BoundedIntText(min=1, max=4096, description="micro-batches", layout=W.Layout(width="175px"),
                                   style={"description_width": "95px"})
            mbs.tooltip = "micro-batch size"
            mbs.observe(lambda ch, i=i: self._guard(lambda: self.ed.set_micro_batches(i, micro_batch_size=ch["new"])),
                        "value")
            nmb.observe(lambda ch, i=i: self._guard(lambda: self.ed.set_micro_batches(i, ch["new"])), "value")
            msg = W.HTML()
            stage_rows = []
            widgets: list[Any] = [W.HBox([head, nmb, mbs]), msg]
            for j, _s in enumerate(p.stages):
                btn = W.Button(layout=W.Layout(width="72px"), tooltip=f"select pipeline {i} stage {j}")
                btn.on_click(lambda _b, i=i, j=j: self.ed.select_stage(i, j))
                ranks = W.HTML(layout=W.Layout(width="130px"))
                first = W.BoundedIntText(min=0, max=n - 1, layout=_SMALL, tooltip="first layer")
                last = W.BoundedIntText(min=0, max=n - 1, layout=_SMALL, tooltip="last layer")
                for w in (first, last):
                    w.observe(lambda ch, i=i, j=j, f=first, l=last: self._guard(
                        lambda: self.ed.set_layers(i, j, f.value, l.value)), "value")
                rc = W.Checkbox(description="recompute", indent=False, layout=W.Layout(width="95px"))
                rc.observe(lambda ch, i=i, j=j: self._guard(lambda: self.ed.set_recompute(i, j, ch["new"])), "value")
                smsg = W.HTML()
                stage_rows.append((btn, ranks, first, last, rc, smsg))
                widgets += [W.HBox([btn, ranks, W.HTML("layers"), first, W.HTML("–"), last, rc]), smsg]
            self._rows.append((head, mbs, nmb, msg, stage_rows))
            boxes.append(W.VBox(widgets, layout=W.Layout(border=f"1px solid {pipeline_colour(i)}",
                                                          padding="2px 4px", margin="2px 0")))
        self.stages_box.children = boxes

    def _draw_tensor(self) -> None:
        ed = self.ed
        plan = ed._valid.plan if ed._valid else None
        names = tuple(plan.annotations) if plan is not None else ()
        if names and tuple(self.tensor.options) != names:
            self.tensor.options = names
        key = (ed._tensor, id(plan))
        if key == self._tensor_drawn:
            return
        self._tensor_drawn = key
        shapes: tuple[Any, ...] = self._node_shapes
        legend = ""
        if ed._tensor and plan is not None and ed._tensor in plan.annotations:
            ann = plan.annotations[ed._tensor]
            shape = _tensor_shape(ed, ed._tensor)
            try:
                ov = annotation_overlay(self.geom, ann, shape, ed._tensor)
                shapes = shapes + tuple(ov.shapes)
                legend = (f"<div style='font-size:12px'>{html.escape(ov.header)}<br>" + "<br>".join(
                    f"<span style='color:{c}'>■</span> {html.escape(t)}" for t, c in ov.legend)
                    + _comm_note(ed, ed._tensor) + "</div>")
            except Exception as e:  # noqa: BLE001
                legend = f"<div style='color:{ERROR}'>tensor {html.escape(ed._tensor)}: {html.escape(str(e))}</div>"
        self.fig.layout.shapes = shapes
        self.tensor_legend.value = legend
        if self.tensor.value != (ed._tensor or ""):
            self.tensor.value = ed._tensor or ""


def _tensor_shape(ed: "PlanEditor", name: str) -> tuple[int, ...]:
    """The tensor's global shape as the core planned it: the CommPlan's shape when it is a Reshard, else the
    specialized graph's shapes at the program's representative bindings."""
    prog = ed._valid.program if ed._valid else None
    if prog is not None:
        for plans in (prog.comm_plans, prog.grad_sync_plans):
            if name in plans:
                return tuple(plans[name].shape)
        shapes = prog.graph.bind(prog.bindings)
        base = name.rsplit(".", 1)[0] if name not in shapes else name
        if base in shapes:
            return tuple(shapes[base])
    return tuple(ed.model.param_shapes()[name])


def _comm_note(ed: "PlanEditor", name: str) -> str:
    """For a Reshard: the operators the core resolved it to and the bytes sent, as one line."""
    prog = ed._valid.program if ed._valid else None
    plans = {} if prog is None else {**prog.grad_sync_plans, **prog.comm_plans}
    if name not in plans:
        return ""
    plan = plans[name]
    vol = plan.volume()
    intra = sum(v["intra"] for v in vol.values()) / 1e6
    inter = sum(v["inter"] for v in vol.values()) / 1e6
    return (f"<br><b>Reshard</b> from {html.escape(str(plan.src))}: {html.escape(' → '.join(plan.kinds))}; "
            f"{intra:.1f} MB intra-node, {inter:.1f} MB inter-node")


def _stage_devices(ed: "PlanEditor", p: int | None, s: int | None) -> list[int]:
    try:
        return list(ed._draft.stage(p, s).devices) if p is not None and s is not None else []
    except IndexError:
        return []


def _ranks(rs: list[int]) -> str:
    from ..core.annotation import format_ranks

    return format_ranks(rs) if rs else "<i>no devices</i>"


def _messages(problems: list[Any]) -> str:
    return "".join(f"<div style='color:{ERROR if p.level == 'error' else '#9a6700'};font-size:12px'>"
                   f"{'✗' if p.level == 'error' else '⚠'} {html.escape(p.message)}</div>" for p in problems)
