"""Peak CPU memory torch allocates while a function runs.

The scratch measurement behind the kernel tests, docs/comparison.md and the benchmarks:
the torch profiler records every CPU allocation and free; the peak of their running sum
is the answer. Inputs allocated before the call are not counted; the result is. Only the
calling thread is seen, so measure the plugin's kernel with ``torch.set_num_threads(1)``
(each further worker thread holds one more scratch of the same size).
"""

from __future__ import annotations

from typing import Callable, TypeVar

from torch.profiler import ProfilerActivity, profile

T = TypeVar("T")


def peak_allocated_bytes(function: Callable[[], T]) -> tuple[int, T]:
    """The peak bytes torch held while ``function`` ran, and what it returned."""
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        result = function()
    events = sorted(
        (event.time_range.start, event.cpu_memory_usage if event.name == "[memory]" else event.self_cpu_memory_usage)
        for event in prof.events()
    )
    current = peak = 0
    for _, delta in events:
        current += delta
        peak = max(peak, current)
    return peak, result
