"""Checks around every natsl custom op, for hunting non-finite values (`NATSL_CHECK_OPS=1`).

A NaN that appears in training reaches the gradient norm only as "non-finite", with no word of where
it came from; under torch.compile the model is one graph, so no Python hook sees the tensors between
layers. The fast kernels are the graph's opaque nodes (torch.library custom ops, natsl/fast/eager.py),
and their implementations still run as Python, compiled or not. `install` swaps each one for a
checked twin that, on every call, synchronises and then reports:

- `nonfinite_output`: an output with NaN or inf although every input was finite (the op made it),
  with its shape, the fraction and first positions of the bad values, the inputs' shapes, strides and
  dtypes, the non-tensor arguments, and which outputs were still bad on two reruns on copies of the
  inputs (the same every time: a wrong result; different: a race or a read of memory never written);
- `nonfinite_input`: a floating input with NaN or inf (it came from before the op);
- `wrote_into_input`: an input that changed during the call (custom ops here declare no mutation,
  so Inductor may reuse such a buffer);
- `output_aliases_input`: an output sharing an input's storage.

While a CUDA stream is being captured into a graph the calls run unchecked (a synchronisation there
would invalidate the capture, and a replay never calls Python again): the trainer turns its CUDA graphs
off while the checks are on.

Each event is one JSON line through `log` (the trainer's log: a run's output, a sweep worker's log.txt),
at most `limit` lines in all. Eager calls are routed through the custom ops while installed so that they
are checked too (the same implementations). A debugging aid: every call clones its inputs and waits for
the GPU, so steps are several times slower.
"""

from __future__ import annotations

import json
import os
from typing import Callable, Optional

import torch

ENV = "NATSL_CHECK_OPS"
_installed: Optional["OpCheck"] = None
_eager_compiling = None  # natsl.fast.eager's `_compiling` before install, put back by uninstall


def _custom_ops(namespace: str) -> list:
    from torch._library.custom_ops import OPDEFS

    import natsl.fast.block_sparse.function  # noqa: F401  (each module registers its ops on import)
    import natsl.fast.gated_delta.function  # noqa: F401
    import natsl.fast.gated_linear.function  # noqa: F401
    import natsl.fast.mix  # noqa: F401
    import natsl.fast.short_conv  # noqa: F401

    # torch's registry of the ops made with torch.library.custom_op, by "namespace::name"
    return [op for name, op in sorted(OPDEFS.items()) if name.split("::")[0] == namespace]


def _bad(t: torch.Tensor) -> bool:
    return t.is_floating_point() and t.numel() > 0 and not bool(torch.isfinite(t).all())


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.is_floating_point():  # NaN == NaN here: a NaN input that stayed NaN was not written
        return torch.equal(torch.nan_to_num(a, 0.5, 1.5, -1.5), torch.nan_to_num(b, 0.5, 1.5, -1.5))
    return torch.equal(a, b)


def _as_tuple(result) -> tuple:
    return tuple(result) if isinstance(result, (tuple, list)) else (result,)


def _bad_outputs(outs) -> list[int]:
    return [j for j, o in enumerate(outs) if isinstance(o, torch.Tensor) and _bad(o)]


def _sync(tensors) -> None:
    if any(t.is_cuda for t in tensors):
        torch.cuda.synchronize()


def _capturing(tensors) -> bool:
    """Whether these CUDA tensors' stream is being captured into a CUDA graph (no checks possible)."""
    return any(t.is_cuda for t in tensors) and torch.cuda.is_current_stream_capturing()


def _where(t: torch.Tensor) -> dict:
    idx = torch.nonzero(~torch.isfinite(t))
    return {"shape": list(t.shape), "fraction": round(idx.shape[0] / t.numel(), 6), "first": idx[:4].tolist(),
            "distinct_per_dim": [int(idx[:, d].unique().numel()) for d in range(idx.shape[1])]}


class OpCheck:
    """The checked twins of a namespace's custom ops; `remove()` puts the originals back."""

    def __init__(self, log: Callable[[str], None], limit: int = 20, namespace: str = "natsl",
                 devices: tuple[str, ...] = ("cpu", "cuda")):
        self.log, self.limit, self.lines = log, limit, 0
        self.events: list[dict] = []
        self.calls: dict[str, int] = {}  # checked calls per op, so that a quiet report is known to have looked
        self.captured: dict[str, int] = {}  # calls made while a CUDA graph was captured: run unchecked
        self._saved = []
        for op in _custom_ops(namespace):
            for device in devices:
                original = op._backend_fns.get(device) or op._backend_fns.get(None) or op._init_fn
                op.register_kernel(device, self._checked(f"{namespace}::{op._name}", original))
                self._saved.append((op, device, original))

    def report(self, event: str, op: str, **fields) -> None:
        record = {"event": event, "op": op, **fields}
        self.events.append(record)
        if self.lines < self.limit:
            self.lines += 1
            self.log("op check: " + json.dumps(record))

    def _checked(self, name: str, fn):
        def checked(*args, **kwargs):
            tensors = {i: a for i, a in enumerate(args) if isinstance(a, torch.Tensor)}
            if _capturing(tensors.values()):
                self.captured[name] = self.captured.get(name, 0) + 1
                return fn(*args, **kwargs)
            self.calls[name] = self.calls.get(name, 0) + 1
            _sync(tensors.values())
            bad_inputs = [i for i, a in tensors.items() if _bad(a)]
            if bad_inputs:
                self.report("nonfinite_input", name, args=bad_inputs)
            copies = {i: a.clone() for i, a in tensors.items()}
            result = fn(*args, **kwargs)
            outs = _as_tuple(result)
            _sync([o for o in outs if isinstance(o, torch.Tensor)] + list(tensors.values()))
            for i, a in tensors.items():
                if not _same(a, copies[i]):
                    self.report("wrote_into_input", name, arg=i)
                for j, o in enumerate(outs):
                    if isinstance(o, torch.Tensor) and o.numel() and a.numel() and \
                            o.untyped_storage().data_ptr() == a.untyped_storage().data_ptr():
                        self.report("output_aliases_input", name, out=j, arg=i)
            bad_outputs = _bad_outputs(outs)
            if bad_outputs and not bad_inputs:
                reruns = [_bad_outputs(_as_tuple(fn(*[copies[i].clone() if i in copies else a
                                                      for i, a in enumerate(args)], **kwargs)))
                          for _ in range(2)]
                self.report("nonfinite_output", name, outputs={j: _where(outs[j]) for j in bad_outputs},
                            reruns_bad_outputs=reruns,
                            inputs=[[i, list(a.shape), list(a.stride()), str(a.dtype).replace("torch.", "")]
                                    for i, a in tensors.items()],
                            other_args=[repr(a) for a in args if not isinstance(a, torch.Tensor)])
            return result

        checked.__name__ = f"checked_{name.split('::')[-1]}"
        return checked

    def remove(self) -> None:
        for op, device, original in reversed(self._saved):
            op._backend_fns[device] = original  # the dispatcher entry stays; it calls the original again
        self._saved.clear()


def installed() -> Optional[OpCheck]:
    """The checks in force, or None."""
    return _installed


def install(log: Callable[[str], None] = print, limit: int = 20) -> OpCheck:
    """Check every natsl custom op from now on (eager calls routed through them); idempotent."""
    global _installed, _eager_compiling
    if _installed is None:
        from natsl.fast import eager

        _installed = OpCheck(log, limit)
        _eager_compiling = eager._compiling
        eager._compiling = lambda: True  # eager calls take the custom ops, so that they are checked too
    return _installed


def uninstall() -> None:
    global _installed
    if _installed is not None:
        from natsl.fast import eager

        _installed.remove()
        eager._compiling = _eager_compiling
        _installed = None


def install_from_env(log: Callable[[str], None] = print) -> Optional[OpCheck]:
    """`install` when NATSL_CHECK_OPS is set to anything but 0 or empty (its value, if a number > 1, is
    the line limit)."""
    value = os.environ.get(ENV, "")
    if value in ("", "0"):
        return None
    return install(log, int(value) if value.isdigit() and int(value) > 1 else 20)
