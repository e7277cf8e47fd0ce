"""Memory nobody wrote, made visible: ``NaNForEmpty``.

A learner's buffer made with ``torch.empty`` / ``new_empty`` and only partly written reads
whatever the allocator hands back. That is often zeros -- fresh pages from the OS, or a freed
tensor that happened to hold zeros -- so such a bug passes a checker by luck and fails on the
next machine. Under ``NaNForEmpty`` every tensor made uninitialized starts as NaN (floats) or
as the dtype's largest value (integers, bools True), so an element nobody wrote differs from
the reference on every run, at the index the report names.
"""

import torch
from torch.utils._python_dispatch import TorchDispatchMode

_EMPTY = {torch.ops.aten.empty.memory_format, torch.ops.aten.empty_strided.default,
          torch.ops.aten.new_empty.default, torch.ops.aten.new_empty_strided.default,
          torch.ops.aten.empty_like.default}


class NaNForEmpty(TorchDispatchMode):
    """Fill every uninitialized allocation made inside the ``with`` block.

    Example:
        >>> with NaNForEmpty():
        ...     x = torch.empty(3)
        >>> x.isnan().all().item()
        True
    """

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func in _EMPTY and isinstance(out, torch.Tensor) and out.numel():
            if out.is_floating_point() or out.is_complex():
                out.fill_(float("nan"))
            elif out.dtype == torch.bool:
                out.fill_(True)
            else:
                out.fill_(torch.iinfo(out.dtype).max)
        return out
