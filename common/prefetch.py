"""Moving the next batch onto the device while the current one is in the network (:class:`DevicePrefetcher`).

On CUDA a side stream, an event and ``record_stream`` (docs/extraction.md, "On the GPU"); elsewhere in order."""
from __future__ import annotations

import dataclasses
from typing import Any, Callable, Generic, Iterable, Iterator, TypeVar

import torch

In = TypeVar("In")
Out = TypeVar("Out")


def tensors_in(value: Any) -> Iterator[torch.Tensor]:
    """Every tensor in ``value``: a tensor, or one inside lists, tuples, dicts and dataclasses (recursively)."""
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, (list, tuple)):
        for item in value:
            yield from tensors_in(item)
    elif isinstance(value, dict):
        for item in value.values():
            yield from tensors_in(item)
    elif dataclasses.is_dataclass(value) and not isinstance(value, type):
        for f in dataclasses.fields(value):
            yield from tensors_in(getattr(value, f.name))


class DevicePrefetcher(Generic[In, Out]):
    """Iterate ``move(item)`` over ``items``, the next item's move overlapping the consumer's work (CUDA only)."""

    def __init__(self, items: Iterable[In], move: Callable[[In], Out], device: torch.device | str):
        self.items, self.move = items, move
        self.device = torch.device(device)
        self.stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None

    def _issue(self, item: In) -> tuple[Out, Any]:
        """Start moving ``item`` (on the side stream on CUDA); returns ``(moved, event or None)``."""
        if self.stream is None:
            return self.move(item), None
        with torch.cuda.stream(self.stream):
            moved = self.move(item)
            event = torch.cuda.Event()
            event.record(self.stream)
        return moved, event

    def _ready(self, moved: Out, event: Any) -> Out:
        """Make the current stream wait for ``moved`` (CUDA); a no-op on other devices."""
        if event is not None:
            current = torch.cuda.current_stream(self.device)
            current.wait_event(event)
            for tensor in tensors_in(moved):
                if tensor.is_cuda:
                    tensor.record_stream(current)
        return moved

    def __iter__(self) -> Iterator[Out]:
        iterator = iter(self.items)
        try:
            pending = self._issue(next(iterator))
        except StopIteration:
            return
        for item in iterator:
            current = self._ready(*pending)
            pending = self._issue(item)   # queued behind nothing the consumer waits for: overlaps its work
            yield current
        yield self._ready(*pending)

