"""A real JupyterLab on loopback and headless Chromium (Playwright), shared by the browser tests and the editor
benchmark: start the server on a temp root, open a notebook, run all cells, wait for the kernel; collect console
errors.  Not a test module (no ``test_`` prefix)."""
from __future__ import annotations

import json
import os
import secrets
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

CHROMIUM = "/usr/bin/chromium"
CHROME_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
               "--disable-component-update", "--disable-sync", "--no-first-run", "--disable-quic"]
#: Console messages that are the browser's, not the page's (headless Chromium without fonts, favicons).
BENIGN = ("favicon", "Download the React DevTools")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def notebook(cells: list[str], path: Path) -> Path:
    """Write a notebook of code cells (python3 kernel)."""
    nb = {"cells": [{"cell_type": "code", "execution_count": None, "metadata": {}, "outputs": [],
                     "source": c} for c in cells],
          "metadata": {"kernelspec": {"display_name": "Python 3", "language": "python", "name": "python3"},
                       "language_info": {"name": "python"}},
          "nbformat": 4, "nbformat_minor": 5}
    path.write_text(json.dumps(nb, indent=1))
    return path


class Lab:
    """A running JupyterLab: ``url(name)`` opens a notebook of its root."""

    def __init__(self, root: Path, port: int, token: str, proc: subprocess.Popen, runtime: Path) -> None:
        self.root, self.port, self.token, self.proc, self.runtime = root, port, token, proc, runtime

    def url(self, name: str, workspace: str | None = None) -> str:
        """The notebook ``name`` in JupyterLab (in a fresh ``workspace`` of its own, if named)."""
        where = f"workspaces/{workspace}/tree" if workspace else "tree"
        return f"http://127.0.0.1:{self.port}/lab/{where}/{name}?token={self.token}" + ("&reset" if workspace else "")

    def api(self, path: str, method: str = "GET", body: Any = None) -> Any:
        req = urllib.request.Request(f"http://127.0.0.1:{self.port}{path}", method=method,
                                     data=None if body is None else json.dumps(body).encode(),
                                     headers={"Authorization": f"token {self.token}",
                                              "Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=10) as r:
            body = r.read()
        return json.loads(body) if body else None

    def shutdown_kernels(self) -> None:
        for s in self.api("/api/sessions"):
            self.api(f"/api/sessions/{s['id']}", "DELETE")

    def start_kernel(self, name: str, timeout_s: float = 60) -> None:
        """Start the notebook ``name``'s session (a fresh python3 kernel) and wait until the kernel is idle, as
        JupyterLab's own "open" would start it; the notebook opened next attaches to it."""
        s = self.api("/api/sessions", "POST", {"path": name, "name": name, "type": "notebook",
                                                "kernel": {"name": "python3"}})
        end = time.monotonic() + timeout_s
        conn = self.runtime / f"kernel-{s['kernel']['id']}.json"
        while not conn.exists():
            if time.monotonic() > end:
                raise TimeoutError(f"no connection file {conn} for the kernel of {name} after {timeout_s:.0f} s")
            time.sleep(0.2)
        from jupyter_client import BlockingKernelClient
        client = BlockingKernelClient(connection_file=str(conn))
        client.load_connection_file()
        client.start_channels()
        try:
            client.wait_for_ready(timeout=max(1.0, end - time.monotonic()))  # kernel_info answered
        finally:
            client.stop_channels()


@contextmanager
def jupyter_lab(tmp: Path, *, save_widget_state: bool = True) -> Iterator[Lab]:
    """JupyterLab serving ``tmp/root`` on loopback, with its own config, runtime and settings dirs (widget state
    saved with the notebook when ``save_widget_state``); killed (its process group) at the end."""
    root = tmp / "root"
    root.mkdir(parents=True, exist_ok=True)
    settings = tmp / "settings"
    plugin = settings / "@jupyter-widgets" / "jupyterlab-manager"
    plugin.mkdir(parents=True, exist_ok=True)
    (plugin / "plugin.jupyterlab-settings").write_text(json.dumps({"saveState": save_widget_state}))
    news = settings / "@jupyterlab" / "apputils-extension"
    news.mkdir(parents=True, exist_ok=True)
    (news / "notification.jupyterlab-settings").write_text(json.dumps({"fetchNews": "false"}))
    port, token = free_port(), secrets.token_hex(16)
    env = dict(os.environ, JUPYTER_CONFIG_DIR=str(tmp / "config"), JUPYTER_RUNTIME_DIR=str(tmp / "rt"),
               IPYTHONDIR=str(tmp / "ipython"), JUPYTER_PLATFORM_DIRS="1", JUPYTERLAB_SETTINGS_DIR=str(settings),
               JUPYTERLAB_WORKSPACES_DIR=str(tmp / "workspaces"))
    cmd = [sys.executable, "-m", "jupyterlab", "--no-browser", "--allow-root", f"--port={port}",
           "--ServerApp.ip=127.0.0.1", f"--IdentityProvider.token={token}", f"--ServerApp.root_dir={root}",
           "--ServerApp.port_retries=0", "--LabApp.news_url=None",
           "--LabApp.check_for_updates_class=jupyterlab.NeverCheckForUpdate", "--LabApp.expose_app_in_browser=True"]
    log = open(tmp / "jupyter.log", "w")
    proc = subprocess.Popen(cmd, cwd=root, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        _wait_ready(f"http://127.0.0.1:{port}/api/status?token={token}", proc, 90)
        yield Lab(root, port, token, proc, tmp / "rt")
    finally:
        try:
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(timeout=15)
        except (ProcessLookupError, subprocess.TimeoutExpired):
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        log.close()


def _wait_ready(url: str, proc: subprocess.Popen, timeout: float) -> None:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if proc.poll() is not None:
            raise RuntimeError(f"jupyter lab exited with {proc.returncode}")
        try:
            with urllib.request.urlopen(url, timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            time.sleep(0.3)
    raise TimeoutError(f"jupyter lab did not answer {url} within {timeout} s")


def watch_console(page: Any, errors: list[str]) -> None:
    """Append every console error and uncaught page error of ``page`` to ``errors``."""
    def on_console(m: Any) -> None:
        if m.type == "error" and not any(b in m.text for b in BENIGN):
            errors.append(f"console: {m.text}")
    page.on("console", on_console)
    page.on("pageerror", lambda e: errors.append(f"pageerror: {e}"))


def open_notebook(page: Any, url: str, timeout_s: float = 90) -> None:
    """Open a notebook and wait until its kernel is idle."""
    page.goto(url)
    page.wait_for_selector(".jp-NotebookPanel .jp-Notebook .jp-Cell", timeout=timeout_s * 1000)
    page.wait_for_function(
        "() => { const w = window.jupyterapp && window.jupyterapp.shell.currentWidget;"
        " const k = w && w.sessionContext && w.sessionContext.session && w.sessionContext.session.kernel;"
        " return k && k.status === 'idle'; }", timeout=timeout_s * 1000)


def run_all(page: Any, timeout_s: float = 150) -> None:
    """Run > Run All Cells (the menu, or the same command), then wait until every code cell has run."""
    try:
        page.click(".lm-MenuBar-item:has(.lm-MenuBar-itemLabel:text-is('Run'))", timeout=5_000)
        page.click(".lm-Menu-item:has(.lm-Menu-itemLabel:text-is('Run All Cells'))", timeout=5_000)
    except Exception:  # noqa: BLE001 - menu markup differs between JupyterLab versions
        page.keyboard.press("Escape")
        page.evaluate("() => window.jupyterapp.commands.execute('notebook:run-all-cells')")
    end = time.monotonic() + timeout_s
    prompts: list[str] = []
    while time.monotonic() < end:
        prompts = page.eval_on_selector_all(
            ".jp-Notebook .jp-CodeCell .jp-InputPrompt", "els => els.map(e => e.textContent.trim())")
        if prompts and all(p.startswith("[") and p[1:-2].strip().isdigit() for p in prompts):
            return
        failed = page.locator(".jp-OutputArea-output[data-mime-type='application/vnd.jupyter.error']")
        if failed.count():
            raise RuntimeError(f"a cell failed: {failed.first.inner_text()[-2000:]}")
        page.wait_for_timeout(300)
    raise TimeoutError(f"cells did not all run within {timeout_s} s: prompts {prompts}")


def page_problems(page: Any) -> list[str]:
    """Widget errors, tracebacks and stderr outputs shown in the notebook."""
    text = page.locator(".jp-Notebook").inner_text()
    out = [bad for bad in ("Error displaying widget", "Traceback", "Model not found") if bad in text]
    if page.locator(".jp-OutputArea-output[data-mime-type='application/vnd.jupyter.stderr']").count():
        out.append("stderr output")
    return out
