"""Counting the ATen operators a piece of code dispatches: what a GPU would launch, counted on any machine.

On CUDA nearly every ATen operator that computes is one kernel launch (or a few), so a loop that dispatches tens
of operators per caption is launch-bound there however small its arithmetic. :class:`OpCounter` counts them on
the CPU too, below autograd (a backward pass's operators count), with a ``TorchDispatchMode``; tests pin the
counts so a regression fails without a GPU, and ``bench/`` reports them beside the timings.

What is counted: every operator call that reaches the Python dispatch key, views included (they cost no kernel
but a host round trip each). ``launching`` leaves out the operators that never launch a kernel (views, shape
queries, ``detach``, empty allocations).

A recurrent layer is where a CPU and CUDA differ most: the CPU's ``aten::gru``/``lstm`` is a loop over time steps
of a dozen operators each (forward and backward), where CUDA makes one cuDNN call each way (``_cudnn_rnn``,
``_cudnn_rnn_backward``). ``OpCounter(rnn_as_library_call=True)`` counts an RNN as CUDA runs it: the layer's
operators are run uncounted and stand as one operator forward and one backward; everything around the layer
(its initial state, the packing) is counted as usual. Attention through PyTorch's ``scaled_dot_product_attention``
(BERT's, in VSE∞'s BERT text encoder) is the same: the CPU computes it from matrix products, softmax and masking
(about ten operators forward, more backward), where CUDA runs one fused kernel each way (the memory-efficient one,
which takes a boolean mask); ``attention_as_library_call=True`` counts it as those two
(``_efficient_attention``, ``_efficient_attention_backward``). See ``docs/benchmarks.md`` ("Operators
dispatched")."""
from __future__ import annotations

import contextlib
from collections import Counter

import torch
from torch.overrides import TorchFunctionMode
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

#: torch's recurrent layers (``nn.GRU``/``LSTM``/``RNN`` call these), each one cuDNN call each way on CUDA
RNN_FUNCTIONS = {torch._VF.gru: "gru", torch._VF.lstm: "lstm", torch._VF.rnn_tanh: "rnn_tanh",
                 torch._VF.rnn_relu: "rnn_relu"}
#: the names a library call counts under, forward and backward
RNN_CALL = ("_cudnn_rnn", "_cudnn_rnn_backward")
ATTENTION_CALL = ("_efficient_attention", "_efficient_attention_backward")


def _name(func) -> str:
    """``aten.mm.default`` → ``mm``."""
    return func.__name__.split(".")[0] if hasattr(func, "__name__") else str(func)


class OpCounter(TorchDispatchMode):
    """``with OpCounter() as ops: …`` then ``ops.total``, ``ops.launching`` and ``ops.by_name`` (a Counter).

    ``rnn_as_library_call``: each recurrent layer counts as the one library call CUDA makes each way (module
    docstring), named ``_cudnn_rnn`` and ``_cudnn_rnn_backward``; ``attention_as_library_call``: each
    ``scaled_dot_product_attention`` as CUDA's fused kernel each way (``_efficient_attention`` and its backward)."""

    def __init__(self, rnn_as_library_call: bool = False, attention_as_library_call: bool = False):
        super().__init__()
        self.by_name: Counter[str] = Counter()
        self.counting = True
        calls = {**({f: RNN_CALL for f in RNN_FUNCTIONS} if rnn_as_library_call else {}),
                 **({torch.nn.functional.scaled_dot_product_attention: ATTENTION_CALL}
                    if attention_as_library_call else {})}
        self._rnn_mode = _RNNAsOneCall(self, calls) if calls else None

    def __enter__(self):
        if self._rnn_mode is not None:
            self._rnn_mode.__enter__()
        return super().__enter__()

    def __exit__(self, *exc):
        try:
            return super().__exit__(*exc)
        finally:
            if self._rnn_mode is not None:
                self._rnn_mode.__exit__(*exc)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if self.counting:
            self.by_name[_name(func.overloadpacket)] += 1
        return func(*args, **(kwargs or {}))

    @contextlib.contextmanager
    def uncounted(self):
        """Operators dispatched inside are not counted."""
        before, self.counting = self.counting, False
        try:
            yield
        finally:
            self.counting = before

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


class _RNNAsOneCall(TorchFunctionMode):
    """Runs each call of a function of ``calls`` (``{function: (forward name, backward name)}``: the recurrent
    layers, attention) through :class:`_LibraryCall`."""

    def __init__(self, counter: OpCounter, calls: dict):
        super().__init__()
        self.counter, self.calls = counter, calls

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func not in self.calls or not self.counter.counting:
            return func(*args, **kwargs)
        leaves, rebuild = _flatten(args)
        is_tensor = [isinstance(x, torch.Tensor) for x in leaves]
        tensors = [x for x in leaves if isinstance(x, torch.Tensor)]
        others = [x for x in leaves if not isinstance(x, torch.Tensor)]

        def call(*inputs):
            it_t, it_o = iter(inputs), iter(others)
            out = func(*rebuild([next(it_t) if t else next(it_o) for t in is_tensor]), **kwargs)
            return out if isinstance(out, tuple) else (out,)

        outputs = _LibraryCall.apply(self.counter, self.calls[func], call, *tensors)
        return outputs if len(outputs) > 1 else outputs[0]          # (attention returns one tensor, a GRU two)


def _flatten(args) -> tuple[list, object]:
    """``args`` with lists and tuples of tensors spread out, and the function that puts them back."""
    leaves, shape = [], []
    for a in args:
        if isinstance(a, (list, tuple)) and a and all(isinstance(x, torch.Tensor) for x in a):
            shape.append((type(a), len(a)))
            leaves.extend(a)
        else:
            shape.append(None)
            leaves.append(a)

    def rebuild(flat):
        out, i = [], 0
        for kind in shape:
            if kind is None:
                out.append(flat[i])
                i += 1
            else:
                out.append(kind[0](flat[i:i + kind[1]]))
                i += kind[1]
        return out

    return leaves, rebuild


class _LibraryCall(torch.autograd.Function):
    """One counted operator forward (``names[0]``: ``_cudnn_rnn``) and one backward (``names[1]``) standing for the
    CPU's uncounted ones: the function runs on detached inputs with its own graph, which backward differentiates."""

    @staticmethod
    def forward(ctx, counter, names, call, *tensors):
        with counter.uncounted(), torch.enable_grad():
            inputs = [t.detach().requires_grad_(t.requires_grad and t.is_floating_point()) for t in tensors]
            outputs = call(*inputs)
        counter.by_name[names[0]] += 1
        ctx.counter, ctx.names, ctx.inputs, ctx.outputs = counter, names, inputs, outputs
        return tuple(o.detach() for o in outputs)

    @staticmethod
    def backward(ctx, *grads):
        wanted = [t for t in ctx.inputs if t.requires_grad]
        pairs = [(o, g) for o, g in zip(ctx.outputs, grads) if o.requires_grad]
        with ctx.counter.uncounted():
            found = iter(torch.autograd.grad([o for o, _ in pairs], wanted, [g for _, g in pairs],
                                             allow_unused=True) if wanted and pairs else [None] * len(wanted))
        ctx.counter.by_name[ctx.names[1]] += 1
        return (None, None, None, *(next(found) if t.requires_grad else None for t in ctx.inputs))


def count_ops(fn, *args, **kwargs) -> tuple[OpCounter, object]:
    """``(counter, fn(*args, **kwargs))``."""
    with OpCounter() as counter:
        result = fn(*args, **kwargs)
    return counter, result


__all__ = ["ATTENTION_CALL", "NON_LAUNCHING", "OpCounter", "RNN_CALL", "RNN_FUNCTIONS", "count_ops"]
