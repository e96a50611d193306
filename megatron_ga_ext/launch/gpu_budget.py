"""``--gpu-memory``: the memory of one GPU, as bytes ("80GiB", "80GB", "96 GiB") or a GPU's name.
Pure Python.

A name stands for the memory ``nvidia-smi`` reports as memory.total on that GPU (a little under
the capacity sold: the driver keeps some); the CUDA context and the allocator's fragmentation
still come off it at run time.
"""

from __future__ import annotations

import re

from megatron_ga_ext.errors import UsageError

__all__ = ["GPUS", "gpu_memory"]

MiB = 1024**2
#: memory.total of each GPU, in MiB, as nvidia-smi reports it.
GPUS = {
    "A100-40GB": 40_960,
    "A100-80GB": 81_920,
    "H100": 81_559,
    "H100-80GB": 81_559,
    "H100-NVL": 95_830,
    "H200": 143_771,
    "GH200": 97_871,
    "B200": 183_359,
    "L40S": 46_068,
}
_UNITS = {"GIB": 1024**3, "GB": 10**9, "MIB": MiB, "MB": 10**6, "TIB": 1024**4, "TB": 10**12}
_SIZE = re.compile(r"^\s*(?P<number>\d+(?:\.\d+)?)\s*(?P<unit>[GMT]i?B)\s*$", re.IGNORECASE)


def gpu_memory(text: str) -> tuple[float, str]:
    """(bytes, how to name it) of ``text``; UsageError naming the forms it takes."""
    match = _SIZE.match(text)
    if match is not None:
        size = float(match.group("number")) * _UNITS[match.group("unit").upper()]
        if size <= 0:
            raise UsageError(f"--gpu-memory {text} is no memory; give e.g. 80GiB.")
        return size, text.strip()
    name = text.strip().upper().replace("_", "-").replace(" ", "-")
    if name in GPUS:
        return GPUS[name] * MiB, f"{name}, {GPUS[name] * MiB / 1024**3:.1f} GiB"
    if name == "A100":
        raise UsageError("--gpu-memory A100 is ambiguous: give A100-40GB or A100-80GB.")
    names = ", ".join(GPUS)
    raise UsageError(
        f"--gpu-memory {text} is neither a size (80GiB, 80GB) nor a GPU this knows ({names})."
    )
