"""Resident memory of this process from /proc/self/status, with the peak reset (clear_refs 5), so a phase's peak
can be measured on its own: what a rank holds while it loads, not what it held before; and the peaks a rank
reports at the end of a run."""

from __future__ import annotations

from pathlib import Path


def status_mb(key: str) -> float:
    """VmRSS, VmHWM, ... of this process in MB."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) / 1024
    raise KeyError(key)


def reset_peak() -> None:
    """VmHWM := VmRSS from now on (Linux >= 4.0; absent under gVisor and WSL1: see peak_reset_unavailable)."""
    Path("/proc/self/clear_refs").write_text("5")


def peak_reset_unavailable() -> str | None:
    """Why this kernel cannot reset a process's peak (None: it can; this process's peak is reset by the probe)."""
    try:
        reset_peak()
    except OSError as e:
        return (
            f"this kernel cannot reset a process's peak memory: writing 5 to /proc/self/clear_refs failed "
            f"({e.strerror or e}); it needs Linux >= 4.0 (gVisor and WSL1 lack the file)"
        )
    return None


def peaks_gb() -> dict[str, float]:
    """This process's peak host memory and (on CUDA) peak GPU memory allocated by torch, in GB."""
    import torch

    out = {"host_hwm_gb": round(status_mb("VmHWM") / 1024, 2)}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        out["gpu_max_allocated_gb"] = round(torch.cuda.max_memory_allocated() / 1e9, 2)
        out["gpu_max_reserved_gb"] = round(torch.cuda.max_memory_reserved() / 1e9, 2)
    return out
