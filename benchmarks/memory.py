"""Peak CPU memory torch allocates while a function runs.

Test and benchmark instrumentation, not part of the package (the wheel does not ship it): the
scratch measurement behind the kernel tests, docs/method.md and the benchmarks. The torch
profiler records every CPU allocation and free; the peak of their running sum is the answer.
Inputs allocated before the call are not counted; the result is. Only the calling thread's
allocations are seen: the plugin's kernel makes all of them there (torch's intra-op threads
share its buffers).
"""

from __future__ import annotations

from typing import Callable, Optional, TypeVar

import torch
from torch.profiler import ProfilerActivity, profile

T = TypeVar("T")


def peak_allocated_bytes(function: Callable[[], T], threads: Optional[int] = None) -> tuple[int, T]:
    """The peak bytes torch held while ``function`` ran (with ``threads`` torch threads), and its result."""
    saved = torch.get_num_threads()
    if threads is not None:
        torch.set_num_threads(threads)
    try:
        with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            result = function()
    finally:
        torch.set_num_threads(saved)
    events = sorted(
        (event.time_range.start, event.cpu_memory_usage if event.name == "[memory]" else event.self_cpu_memory_usage)
        for event in prof.events()
    )
    current = peak = 0
    for _, delta in events:
        current += delta
        peak = max(peak, current)
    return peak, result
