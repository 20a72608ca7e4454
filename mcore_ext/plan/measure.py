"""Peak memory of torch's allocations while a function runs, on a CPU or a GPU.

    CPU  torch's CPU allocator reports every allocation and free made while the profiler records
         memory (``profile_memory=True``: c10's ProfiledCPUMemoryReporter). The running sum of
         those events, in time order, is the bytes allocated inside the function and still live;
         its maximum is the peak. Exact and independent of glibc (no resident-set noise), but it
         sees torch tensors only: not the interpreter, not gloo's or a library's own buffers.
         Memory allocated before the call and freed inside it is not subtracted, so a function
         that frees older tensors reads high.
         Allocation events carry their pointer: a free counts only when its block was allocated
         inside the call (the reporter's size table can hold stale sizes of older blocks).
    GPU  ``torch.cuda.max_memory_allocated`` after ``reset_peak_memory_stats``, minus what was
         allocated before: the same quantity from the caching allocator.
"""

import os
from typing import Callable

import torch
from torch._C._profiler import _EventType

os.environ.setdefault("KINETO_LOG_LEVEL", "5")  # the profiler's start / stop lines


def allocation_peak(fn: Callable[[], object], device: torch.device | str | None = None) -> dict:
    """Run ``fn()``; {"peak": bytes, "end": bytes still allocated by it at its end} over what was
    allocated before. ``device`` (default: CUDA when available) picks the allocator."""
    device = torch.device(device) if device is not None else (
        torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available()
        else torch.device("cpu"))
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        before = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        fn()
        torch.cuda.synchronize(device)
        return {"peak": torch.cuda.max_memory_allocated(device) - before,
                "end": torch.cuda.memory_allocated(device) - before}
    activities = [torch.profiler.ProfilerActivity.CPU]
    with torch.profiler.profile(activities=activities, profile_memory=True) as prof:
        fn()
    events = sorted(
        (e for e in _walk(prof.profiler.kineto_results.experimental_event_tree())
         if e.tag == _EventType.Allocation and e.extra_fields.device.type == "cpu"),
        key=lambda e: e.start_time_ns)
    inside = {}  # pointer -> bytes, for blocks allocated inside fn
    live = peak = 0
    for event in events:
        ptr, size = event.extra_fields.ptr, event.extra_fields.alloc_size
        if size > 0:
            inside[ptr] = size
            live += size
            peak = max(peak, live)
        elif ptr in inside:  # a free of an older block (or of a stale size) is not counted
            live -= inside.pop(ptr)
    return {"peak": peak, "end": live}


def _walk(events):
    for event in events:
        yield event
        yield from _walk(event.children)
