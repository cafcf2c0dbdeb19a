"""Human units for every display: traffic in decimal bytes (like bandwidths in GB/s), memory in binary GiB/MiB,
times in s/ms/µs."""
from __future__ import annotations

from typing import Any

from ..core.cluster import LOCAL_KIND, format_memory

__all__ = ["fmt_bytes", "fmt_seconds", "fmt_memory", "fmt_bandwidth", "fmt_node_devices"]


def fmt_bytes(n: float) -> str:
    """``1.7 GB``, ``268 MB``, ``12 kB`` (decimal, as link bandwidths are quoted)."""
    for unit, scale in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= scale:
            v = n / scale
            return f"{v:.1f} {unit}" if v < 100 else f"{v:.0f} {unit}"
    return f"{n:.0f} B"


def fmt_seconds(s: float) -> str:
    """``12.95 s``, ``20.7 ms``, ``4.5 µs``."""
    if s >= 1:
        return f"{s:.2f} s"
    if s >= 1e-3:
        return f"{s * 1e3:.1f} ms"
    return f"{s * 1e6:.1f} µs"


def fmt_memory(n: float) -> str:
    """Device memory: ``43.9 GiB``, below a tenth of a GiB ``12.3 MiB`` (the CLI's and ``Strategy.summary``'s
    convention: :func:`hspmd_sdk.core.cluster.format_memory`)."""
    return format_memory(n)


def fmt_bandwidth(bytes_per_s: float) -> str:
    """``400 GB/s``, ``25 GB/s``, ``5 MB/s``."""
    return f"{bytes_per_s / 1e9:g} GB/s" if bytes_per_s >= 1e9 else f"{bytes_per_s / 1e6:g} MB/s"


def fmt_node_devices(spec: Any) -> str:
    """A node's devices in a line: ``79.6 GiB each · NVLink 400 GB/s``; local worker processes (kind ``cpu``)
    are not described as NVLinked: ``local processes · nominal 8.0 GiB each``."""
    if spec.kind == LOCAL_KIND:
        return f"local processes · nominal {fmt_memory(spec.memory_bytes)} each"
    return f"{fmt_memory(spec.memory_bytes)} each · NVLink {spec.intra_bandwidth_gbs:g} GB/s"
