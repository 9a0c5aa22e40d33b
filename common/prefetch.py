"""Moving the next batch onto the device while the current one is in the network (:class:`DevicePrefetcher`).

On CUDA, ``move(item)`` — the host-to-device copy of a pinned batch (``non_blocking``), or the batched JPEG
decode of ``--decode device`` — is issued on a side CUDA stream one item ahead: while the consumer runs item
``k`` on the current stream, the copy/decode of item ``k+1`` is already queued on the side stream. Before item
``k`` is handed out, the current stream waits for the side stream's work on it (an event), and every tensor in
it is marked as used on the current stream (``Tensor.record_stream``), so the caching allocator does not give
its memory to the side stream while the network still reads it.

On CPU (or any non-CUDA device) there is no stream: ``move`` runs in order, one item ahead, and the items come
out the same, in the same order.
"""
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
    """Iterate ``move(item)`` for each item of ``items``, the move of the next item overlapping the consumer's
    work on the current one (module docstring).

    Args:
        items: the host-side items (e.g. a DataLoader's batches).
        move: item → the item on ``device`` (any structure of tensors; ``tensors_in`` finds them).
        device: where ``move`` puts them; a side stream is used only when it is a CUDA device.
    """

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

