"""The process's resident memory (RSS) and its high-water mark, from /proc/self (Linux only).

Linux keeps a process's RSS in per-CPU counters that reach the total read here in batches (since 6.2), and
Python's own reads allocate, so two reads a moment apart can disagree by a few hundred KiB (more on a host
with many CPUs). A high-water mark read at the end can then fall below the resident size read at the start
when what was measured added less than that; `peak_since` keeps the peak at least the start, as the true
peak is. No torch here: checkpoint_load_memory keeps torch out of its module's imports.
"""

from __future__ import annotations

from pathlib import Path


def status_bytes(field: str) -> int:
    """A size field of /proc/self/status (VmRSS, VmHWM), in bytes."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {field} in /proc/self/status")


def reset_peak() -> int:
    """Reset the kernel's RSS high-water mark; the resident size at the reset."""
    Path("/proc/self/clear_refs").write_text("5")
    # The reset mark, not a VmRSS read after it: pages touched between the two reads would put the start
    # above a peak that never rises past it.
    return status_bytes("VmHWM")


def peak_since(start: int) -> int:
    """The highest resident size since the `reset_peak()` that returned `start`."""
    return max(status_bytes("VmHWM"), start)
