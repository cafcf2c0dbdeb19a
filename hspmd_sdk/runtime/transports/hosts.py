"""How to reach each host of a cluster over SSH, and how to run Python there.

A :class:`~hspmd_sdk.Cluster` names its hosts; :class:`SSHHost` says, per host name, where to connect (address,
port, user), which Python to run and in which directory, and a few environment variables for the workers (sshd
drops the client's environment, so they travel on the remote command line, quoted).  Hosts that a mapping does
not name use the defaults: the host name itself as the address, port 22, the login user, ``python3``.

:func:`remote_command` builds every command line that runs on a remote host; each argument is quoted with
:func:`shlex.quote`, so host names, paths and arguments can never inject shell syntax.
"""
from __future__ import annotations

import json
import re
import shlex
from pathlib import Path
from typing import Any, Mapping, Sequence

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from ...errors import HSPMDError, PlanValidationError


class SSHError(HSPMDError):
    """A host could not be reached, authenticated or verified, or its agent did not start."""


_ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


class SSHHost(BaseModel):
    """Connection and Python settings of one host.

    ``address``: where to connect *and* where the other hosts reach this one (rendezvous); default the cluster's
    host name.  ``python``: the remote interpreter, a path or a list of words (e.g. ``["conda", "run", "-n",
    "hspmd", "python"]``).  ``workdir``: directory the agent and workers run in (default: the login directory).
    ``env``: variables for the agent and its workers (e.g. ``{"NCCL_SOCKET_IFNAME": "eth0"}``).
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    address: str | None = Field(default=None, min_length=1)
    port: int = Field(default=22, ge=1, le=65535)
    user: str | None = Field(default=None, min_length=1)
    python: str | list[str] = "python3"
    workdir: str | None = Field(default=None, min_length=1)
    env: dict[str, str] = Field(default_factory=dict)

    @field_validator("env")
    @classmethod
    def _env_names(cls, env: dict[str, str]) -> dict[str, str]:
        for name in env:
            if not _ENV_NAME.match(name):
                raise ValueError(f"{name!r} is not a valid environment variable name")
        return env

    @field_validator("python")
    @classmethod
    def _python_words(cls, python: str | list[str]) -> str | list[str]:
        if isinstance(python, list) and not python:
            raise ValueError("needs at least one word (the interpreter)")
        return python

    def address_of(self, host: str) -> str:
        return self.address or host

    def python_argv(self) -> list[str]:
        return [self.python] if isinstance(self.python, str) else list(self.python)


HostsArg = Mapping[str, "SSHHost | Mapping[str, Any]"] | None


def load_hosts(hosts: HostsArg, *, default: SSHHost | Mapping[str, Any] | None = None) -> "HostTable":
    """A :class:`HostTable` from a mapping host name -> :class:`SSHHost` (or its dict form)."""
    try:
        base = default if isinstance(default, SSHHost) else SSHHost.model_validate(default or {})
        table = {h: s if isinstance(s, SSHHost) else base.model_copy(update=SSHHost.model_validate(s).model_dump(
            exclude_unset=True)) for h, s in (hosts or {}).items()}
    except ValidationError as e:
        raise PlanValidationError.from_pydantic(e, what="SSH hosts") from None
    return HostTable(table, base)


def read_hosts_file(path: str | Path) -> dict[str, dict[str, Any]]:
    """Read a JSON file ``{"host": {"address": ..., "port": ..., "python": ..., "workdir": ...}, ...}``."""
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, ValueError, RecursionError) as e:  # ValueError: not UTF-8, not JSON, a 5000-digit number
        why = "nested too deeply" if isinstance(e, RecursionError) else getattr(e, "strerror", None) or str(e)
        raise PlanValidationError([(str(path), f"cannot read SSH hosts file: {why}")], what="SSH hosts") from None
    if not isinstance(data, dict):
        raise PlanValidationError([(str(path), "expected a JSON object host -> settings")], what="SSH hosts")
    return data


class HostTable:
    """Host name -> :class:`SSHHost`, with a default for hosts not named."""

    def __init__(self, table: Mapping[str, SSHHost], default: SSHHost) -> None:
        self._table = dict(table)
        self.default = default

    def __getitem__(self, host: str) -> SSHHost:
        return self._table.get(host, self.default)

    def __repr__(self) -> str:
        return f"HostTable({self._table!r}, default={self.default!r})"


def remote_command(settings: SSHHost, argv: Sequence[str], *, setsid: bool = False) -> str:
    """The shell command line that runs ``argv`` (after the Python words) on a host, every word quoted.

    ``cd WORKDIR && exec env K=V ... [setsid -w] PYTHON ARGV...``.  ``setsid -w`` puts the process in a session
    (and process group) of its own, so that it can be killed as a group and outlives nothing it started.
    """
    words = ["env", *(f"{k}={v}" for k, v in settings.env.items())]
    if setsid:
        words += ["setsid", "-w"]
    words += [*settings.python_argv(), *argv]
    cmd = "exec " + " ".join(shlex.quote(str(w)) for w in words)
    if settings.workdir:
        cmd = f"cd {shlex.quote(settings.workdir)} && {cmd}"
    return cmd
