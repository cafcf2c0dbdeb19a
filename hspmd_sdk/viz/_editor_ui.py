"""The plan editor's widgets: the cluster canvas (:class:`._canvas.PlanCanvas`), the timeline and communication
figures below it (plotly, in ipywidgets ``Output``s) and, for an attached job, its dashboard.

Every message from the canvas calls the same public :class:`~hspmd_sdk.viz.editor.PlanEditor` method a script
would; this module only routes them and draws the editor's state.
"""
from __future__ import annotations

import threading
from typing import Any, Callable

import ipywidgets as W

from ._canvas import PlanCanvas
from ._canvas_view import canvas_view, cluster_view
from .comm_fig import comm_figure, volume_table_html
from .dashboard import JobDashboard

__all__ = ["EditorUI"]


def _figure_output(fig: Any) -> dict[str, Any]:
    """A plotly figure as an ``Output`` entry (the plotly mime bundle JupyterLab renders), built without a
    kernel's display formatter."""
    import json

    return {"output_type": "display_data", "metadata": {},
            "data": {"application/vnd.plotly.v1+json": {**json.loads(fig.to_json()), "config": {}},
                     "text/plain": f"<plotly figure: {fig.layout.title.text or ''}>"}}


def _html_output(text: str) -> dict[str, Any]:
    return {"output_type": "display_data", "metadata": {}, "data": {"text/html": text, "text/plain": text}}


class EditorUI:
    """Widgets of one editor; :meth:`refresh` redraws them from the editor's state."""

    def __init__(self, editor: Any) -> None:  # the PlanEditor (which imports this module)
        self.ed = editor
        self._lock = threading.RLock()  # the background worker and the job watcher redraw too
        self.canvas = PlanCanvas(cluster=cluster_view(editor))
        self.canvas.on_msg(self._on_msg)
        self.timeline_note = W.HTML()
        self.timeline = W.Output()
        self.comm_note = W.HTML()
        self.comm_out = W.Output()
        self._comm_key: str | None = None
        self.job_box = W.VBox()
        self.dashboard: Any = None
        self._timeline_key: str | None = None
        self._version = 0
        self._tensor_groups: Any = None
        self.root = W.VBox([self.canvas, self.comm_note, self.comm_out, self.timeline_note, self.timeline, self.job_box],
                           layout=W.Layout(width="100%"))
        self.root.add_class("hspmd-plan-editor")
        self._ops: dict[str, Callable[[dict[str, Any]], Any]] = {
            "toggle": lambda m: editor.click_device(int(m["rank"])),  # Alt+click, or Enter on a tile
            "click": lambda m: editor.click_device(int(m["rank"])),  # the same (older front ends)
            "move": lambda m: editor.move_devices(m["ranks"], int(m["p"]), int(m["s"])),
            "unassign": lambda m: editor.unassign_devices(m["ranks"]),
            "select": lambda m: editor.select_stage(int(m["p"]), int(m["s"])),
            "layers": lambda m: editor.set_layers(int(m["p"]), int(m["s"]), int(m["first"]), int(m["last"])),
            "recompute": lambda m: editor.set_recompute(int(m["p"]), int(m["s"]), bool(m["on"])),
            "ratios": lambda m: editor.set_ratios(int(m["p"]), int(m["s"]), m.get("value") or None),
            "cp": lambda m: editor.set_cp(int(m["p"]), int(m["s"]), m["value"]),
            "micro": lambda m: editor.set_micro_batches(int(m["p"]), m.get("nmb"), m.get("mbs")),
            "batch": lambda m: editor.set_global_batch(int(m["value"])),
            "schedule": lambda m: editor.set_schedule(str(m["value"])),
            "zero1": lambda m: editor.set_zero1(bool(m["on"])),  # (older front ends)
            "zero": lambda m: editor.set_zero(int(m["level"])),
            "add_pipeline": lambda m: editor.add_pipeline(),
            "remove_pipeline": lambda m: editor.remove_pipeline(int(m["p"])),
            "add_stage": lambda m: editor.add_stage(int(m["p"])),
            "remove_stage": lambda m: editor.remove_stage(int(m["p"]), int(m["s"])),
            "undo": lambda m: editor.undo(),
            "redo": lambda m: editor.redo(),
            "tensor": lambda m: editor.pick_tensor(m.get("name") or None),
            "save": lambda m: editor.save(m.get("path") or "strategy.json"),
            "load": lambda m: editor.load(m.get("path") or "strategy.json"),
            "launch": lambda m: editor.launch(),
            "apply": lambda m: editor.apply_to_job(),
            "timeline": lambda m: self.show_timeline(),
            "comm": lambda m: self.show_comm(str(m["reshard"])),
            "fix": lambda m: self.show_fix(str(m["reshard"])),
        }
        self.refresh()
        if editor.job is not None:
            self.watch_job()

    # ---- messages from the canvas ------------------------------------------------------------------------
    def _on_msg(self, _widget: Any, content: dict[str, Any], _buffers: Any) -> None:
        op = content.get("op") if isinstance(content, dict) else None
        fn = self._ops.get(op)  # type: ignore[arg-type]
        if fn is None:
            self.ed._message = f"the canvas sent an unknown action {op!r}"
            self.refresh()
            return
        try:
            fn(content)
        except Exception as e:  # noqa: BLE001 - shown in words at the canvas, never as a traceback
            if not self.ed._message.startswith("not saved"):
                self.ed._message = f"{op} failed: {e}"
            self.refresh()

    # ---- figures below the canvas --------------------------------------------------------------------------
    def show_timeline(self) -> None:
        """The simulated timeline of the draft shown (it must simulate)."""
        fig = self.ed.gantt()
        self._timeline_key = self.ed._current.model_dump_json()
        self.timeline.outputs = (_figure_output(fig),)
        self.refresh()

    def show_comm(self, reshard: str) -> None:
        """``comm_figure`` and the bytes table of one Reshard of the program."""
        fig = self.ed.comm_figure(reshard)
        self._comm_key = self.ed._valid.strategy.model_dump_json()
        self.comm_out.outputs = (_figure_output(fig),
                                 _html_output(volume_table_html(self.ed.comm_plan(reshard), self.ed.cluster)))

    def show_fix(self, reshard: str) -> None:
        """The cheaper resolution of a redundant boundary, as the resolver plans it: its two Reshards drawn."""
        import html

        comm = self.ed.comm
        self._comm_key = self.ed._valid.strategy.model_dump_json() if self.ed._valid else None
        arrow = next((a for a in comm.arrows if a.reshard == reshard and a.fix is not None), None) if comm else None
        if arrow is None:
            self.comm_out.outputs = (_html_output(f"<p>no cheaper resolution of {html.escape(reshard)} is known</p>"),)
            return
        self.comm_out.outputs = (
            _html_output(f"<p><b>{html.escape(reshard)}</b>: {html.escape(arrow.fix.describe())}</p>"),
            *(_figure_output(comm_figure(plan, self.ed.cluster, strategy=self.ed.strategy,
                                         title=f"{reshard} sent split: {' → '.join(plan.kinds)}"))
              for plan in arrow.fix.plans))

    # ---- jobs ----------------------------------------------------------------------------------------------
    def watch_job(self) -> None:
        """Show the editor's job below the canvas and follow it."""
        if self.dashboard is not None:
            self.dashboard.close()
        self.dashboard = JobDashboard(self.ed.job, on_update=self.ed._on_job)
        self.job_box.children = [self.dashboard]

    def close(self) -> None:
        if self.dashboard is not None:
            self.dashboard.close()

    # ---- drawing -------------------------------------------------------------------------------------------
    def refresh(self) -> None:
        """Redraw the canvas (and the stale markers) from the editor's state."""
        with self._lock:
            groups = [[g, names] for g, names in self.ed.tensor_groups()]
            if groups != self._tensor_groups:
                self._tensor_groups = groups
                self.canvas.tensors = groups
            self._version += 1
            view = canvas_view(self.ed, timeline_key=self._timeline_key, version=self._version)
            self.canvas.view = view
            current = self.ed._current.model_dump_json() if self.ed._current is not None else None
            self.comm_note.value = (
                "<div style='color:#7d4e00;border:1px dashed #d4a72c;padding:2px 6px'>⚠ stale: this communication "
                "figure is of an earlier plan; click an arrow on the canvas to redraw it</div>"
                if self._comm_key is not None and self._comm_key != current else "")
            self.timeline_note.value = (
                "<div style='color:#7d4e00;border:1px dashed #d4a72c;padding:2px 6px'>⚠ stale: this timeline is "
                "of an earlier plan; press Timeline on the canvas to redraw it</div>" if view["timeline_stale"]
                else "")
