"""How much memory there is now for a computation to take: the host's available RAM, a GPU's free memory.

Read when asked (never cached): what is free changes as a run goes on and other processes start."""
from __future__ import annotations

import os

import torch

#: where Linux says how much memory can be given to a process without swapping (``MemAvailable``, kB)
MEMINFO = "/proc/meminfo"


def available_host_bytes(meminfo: str = MEMINFO) -> int:
    """Bytes of RAM a process can take now without swapping: Linux's ``MemAvailable`` (free memory plus the page
    cache and other memory the kernel can reclaim); elsewhere the free pages ``sysconf`` reports."""
    try:
        with open(meminfo, encoding="ascii") as handle:
            for line in handle:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        return int(os.sysconf("SC_AVPHYS_PAGES")) * int(os.sysconf("SC_PAGE_SIZE"))
    except (ValueError, OSError, AttributeError):
        return 0


def available_bytes(device: torch.device | str) -> int:
    """Bytes free where ``device`` computes: a CUDA device's free memory, else the host's available RAM."""
    device = torch.device(device)
    if device.type == "cuda":
        return int(torch.cuda.mem_get_info(device)[0])
    return available_host_bytes()


def format_bytes(count: float) -> str:
    """``count`` bytes in GiB or MiB with one decimal (``4.3 GiB``, ``512.0 MiB``)."""
    return f"{count / 2**30:.1f} GiB" if count >= 2**30 else f"{count / 2**20:.1f} MiB"
