"""The measured peak of CPU memory a piece of work allocates, for checking the memory model (`train.memory`,
`features.footprint`) against what really happens.

    with AllocationTrace() as trace:
        work()
    trace.peak()                  # the most bytes live at once, counted from the start of the trace
    trace.peak(after=t_ns)        # … over the allocations made after t_ns (time.time_ns())

It reads PyTorch's own allocator through the profiler (`profile_memory=True`): every allocation of c10's CPU
allocator reports the total it holds at that moment, counting only what was allocated while profiling (tensors
that existed before the trace are neither counted nor subtracted). Memory a tensor does not own through the
allocator — safetensors' memory-mapped weights — is invisible to it: `own_parameters(model)` copies a module's
tensors into allocator memory inside the trace, so they count as a real run's weights do.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.profiler import ProfilerActivity, profile


class AllocationTrace:
    def __enter__(self) -> AllocationTrace:
        self._prof = profile(activities=[ProfilerActivity.CPU], profile_memory=True)
        self._prof.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._prof.__exit__(*exc)
        from torch._C._profiler import _EventType

        events: list[tuple[int, int, int]] = []  # (time, bytes: > 0 allocated, < 0 freed, address)
        stack = list(self._prof.profiler.kineto_results.experimental_event_tree())
        while stack:
            event = stack.pop()
            if event.tag == _EventType.Allocation:
                events.append((event.start_time_ns, event.extra_fields.alloc_size, event.extra_fields.ptr))
            stack.extend(event.children)
        # The reporter's own running total (`total_allocated`) is not reset between traces: blocks allocated in an
        # earlier trace of this process and still alive count in it, and their frees lower it. So the total is kept
        # here, over the blocks this trace allocated.
        live: dict[int, int] = {}
        total, self.points = 0, []
        for t, size, ptr in sorted(events):
            if size > 0:
                live[ptr] = size
                total += size
            elif ptr in live:
                total -= live.pop(ptr)
            self.points.append((t, total))

    def peak(self, *, after: int = 0, before: int | None = None) -> int:
        """The most bytes live at once among the allocation events in [after, before)."""
        return max((b for t, b in self.points if t >= after and (before is None or t < before)), default=0)

    def live_at(self, t_ns: int) -> int:
        """Bytes live at the last allocation event before t_ns."""
        before = [b for t, b in self.points if t < t_ns]
        return before[-1] if before else 0


@torch.no_grad()
def own_parameters(module: torch.nn.Module) -> None:
    """Copy every parameter and buffer of `module` into memory of PyTorch's allocator (see the module docstring)."""
    for t in list(module.parameters()) + list(module.buffers()):
        t.data = t.data.clone()
