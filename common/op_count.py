"""Counting the ATen operators a piece of code dispatches: what a GPU would launch, counted on any machine.

On CUDA nearly every ATen operator that computes is one kernel launch (or a few), so a loop that dispatches tens
of operators per caption is launch-bound there however small its arithmetic. :class:`OpCounter` counts them on
the CPU too, below autograd (a backward pass's operators count), with a ``TorchDispatchMode``; tests pin the
counts so a regression fails without a GPU, and ``bench/`` reports them beside the timings.

What is counted: every operator call that reaches the Python dispatch key, views included (they cost no kernel
but a host round trip each). ``launching`` leaves out the operators that never launch a kernel (views, shape
queries, ``detach``, empty allocations). Operators that CPU kernels decompose but CUDA runs as one library call
(an RNN's ``aten::gru``/``lstm`` become cuDNN's ``_cudnn_rnn``) are counted as their CPU decomposition; see
``docs/benchmarks.md`` ("Operators dispatched")."""
from __future__ import annotations

from collections import Counter

from torch.utils._python_dispatch import TorchDispatchMode

#: operators that launch no kernel: views and aliases, metadata, allocation without filling
NON_LAUNCHING = frozenset({
    "view", "_unsafe_view", "reshape", "expand", "permute", "transpose", "t", "unsqueeze", "squeeze", "select",
    "slice", "as_strided", "alias", "detach", "unbind", "split", "split_with_sizes", "chunk", "narrow",
    "_reshape_alias", "view_as", "expand_as", "diagonal", "unfold", "empty", "empty_like", "empty_strided",
    "new_empty", "new_empty_strided", "lift_fresh", "sym_size", "sym_stride", "sym_numel", "sym_storage_offset",
    "is_same_size", "_has_compatible_shallow_copy_type", "result_type", "dim", "size", "stride", "numel", "set_",
    "resize_",
})


def _name(func) -> str:
    """``aten.mm.default`` → ``mm``."""
    return func.__name__.split(".")[0] if hasattr(func, "__name__") else str(func)


class OpCounter(TorchDispatchMode):
    """``with OpCounter() as ops: …`` then ``ops.total``, ``ops.launching`` and ``ops.by_name`` (a Counter)."""

    def __init__(self):
        super().__init__()
        self.by_name: Counter[str] = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.by_name[_name(func.overloadpacket)] += 1
        return func(*args, **(kwargs or {}))

    @property
    def total(self) -> int:
        """Every operator dispatched."""
        return sum(self.by_name.values())

    @property
    def launching(self) -> int:
        """The operators that compute or copy (each a kernel launch or more on CUDA)."""
        return sum(n for name, n in self.by_name.items() if name not in NON_LAUNCHING)

    @property
    def host_syncs(self) -> int:
        """Operators that read a device value back to the host (``.item()``, ``bool(t)``, ``nonzero``): each one
        stalls the CPU until the GPU has caught up."""
        return sum(self.by_name[name] for name in ("_local_scalar_dense", "nonzero", "unique", "_unique2",
                                                   "masked_select", "is_nonzero"))

    def most_common(self, n: int = 10) -> list[tuple[str, int]]:
        return self.by_name.most_common(n)


def count_ops(fn, *args, **kwargs) -> tuple[OpCounter, object]:
    """``(counter, fn(*args, **kwargs))``."""
    with OpCounter() as counter:
        result = fn(*args, **kwargs)
    return counter, result


__all__ = ["NON_LAUNCHING", "OpCounter", "count_ops"]
