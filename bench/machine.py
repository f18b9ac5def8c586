"""One line that says which machine a benchmark ran on (CPU model, usable CPUs, GPU)."""

from __future__ import annotations

import os
import platform
from pathlib import Path


def describe_machine(use_gpu: bool | None = None) -> str:
    """"AMD EPYC, 2 CPUs usable, torch threads 2, no GPU": the CPU's model name, the CPUs this
    process may run on, torch's thread count, and the first GPU's name when one is used
    (None: when one is available)."""
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    try:
        import torch
    except ImportError:
        return f"{cpu}, {len(os.sched_getaffinity(0))} CPUs usable, no torch"
    available = torch.cuda.is_available()
    gpu = torch.cuda.get_device_name(0) if (available if use_gpu is None else use_gpu) else "no GPU used"
    return f"{cpu}, {len(os.sched_getaffinity(0))} CPUs usable, torch threads {torch.get_num_threads()}, {gpu}"
