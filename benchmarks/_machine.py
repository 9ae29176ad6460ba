"""What the benchmarks ran on, printed with every result."""

from __future__ import annotations

import json
import os
import platform

from st_extensions.atomic import atomic_write


def describe() -> dict:
    import torch

    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    return {
        "cpu": cpu,
        "cores": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "cuda": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
        "python": platform.python_version(),
    }


def write_result(path: str, result: dict, indent: int = 2) -> None:
    """Write a benchmark's ``result`` as JSON to ``path``, creating its folder."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    atomic_write(path, json.dumps(result, indent=indent))  # complete or absent, even if the benchmark is killed
