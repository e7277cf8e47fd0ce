"""Compare the reader's run with the oracle, find the first divergence, and say it plainly.

Inside each worker a ``Trace`` receives every value the lab checks, in the order the run
produces it (``trace.expect("loss", got, expected, step=0, phase="forward")``), compares it at
once -- shape, dtype, then bits -- and keeps the first mismatch with what matched before it.
Every rank runs every case to the end whatever it finds, so no rank leaves a collective its
peers are in. The launcher reads back each rank's trace; ``Report`` picks the earliest mismatch
over ranks and prints one verdict line, then the details::

    ✗ lab 00 · ring all-reduce from send/recv: first divergence at N = 3, rank 1, case
      "all-reduce, 7 elements (uneven)", result
      (7,) float32: 2 of 7 elements differ
        first at [6]: yours 0.0 (0x00000000), expected 21.0 (0x41a80000)
      ...
      matched before this: N = 2 (14 checks); N = 3: 3 checks

A ``Report`` is a value (``.ok``, ``.status``, ``.divergence``): tests assert on its fields,
learners read ``str(report)``. It holds no timings or machine paths, so a notebook's stored
output of a check stays the same on every machine.
"""

from __future__ import annotations

import linecache
import math
import re
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch

from minifsdp import parity
from minifsdp.labs import heartbeat, seams
from minifsdp.launch import split_stack_dump
from minifsdp.parity import bits

# ---- inside a worker: the trace ---------------------------------------------------------------


class Trace:
    """One rank's record of a lab run: the first mismatch and how many checks matched."""

    def __init__(self, rank: int, world_size: int, hint: Callable[..., str | None] | None = None):
        self.rank, self.world_size, self.hint = rank, world_size, hint
        self.first: dict[str, Any] | None = None
        self.matched = 0
        self.case_name: str | None = None
        self.seq = 0

    @contextmanager
    def case(self, name: str, seams_used: tuple[str, ...] = ()) -> Iterator[None]:
        """A named case; on exit, every seam in ``seams_used`` must have been called in it."""
        before = {s: seams.CALLS.get(s, 0) for s in seams_used}
        self.case_name = name
        yield
        for s in seams_used:
            if seams.CALLS.get(s, 0) == before[s]:
                self._record(dict(name=f"seam {s}", detail=[
                    f"the seam {s!r} was never called in this case: the checker cannot judge it "
                    "(a bug in the lab's harness, not in your code)"]), internal=True)
        self.case_name = None

    def expect(self, name: str, got: Any, expected: Any, *, step: int | None = None,
               phase: str | None = None) -> bool:
        """Compare ``got`` with ``expected`` bit for bit; record the first mismatch. Tensors are
        compared by shape, dtype, then bits; anything else with ``==`` (lists element by
        element). Returns whether they match."""
        self.seq += 1
        heartbeat.beat()
        detail = compare(got, expected, self.world_size, name, self.hint)
        if detail is None:
            if self.first is None:
                self.matched += 1
            return True
        self._record(dict(name=name, step=step, phase=phase, detail=detail))
        return False

    def _record(self, d: dict[str, Any], internal: bool = False) -> None:
        if self.first is None:
            self.first = dict(d, case=self.case_name, rank=self.rank, seq=self.seq,
                              matched=self.matched, internal=internal)

    def results(self) -> dict[str, Any]:
        return {"first": self.first, "matched": self.matched, "checks": self.seq,
                "calls": dict(seams.CALLS)}


def _num(x: float) -> str:
    if isinstance(x, float) and not math.isfinite(x):
        return str(x)
    return f"{x:.6g}" if isinstance(x, float) else str(x)


def compare(got: Any, expected: Any, world_size: int, name: str = "",
            hint: Callable[..., str | None] | None = None) -> list[str] | None:
    """``None`` when ``got`` equals ``expected`` bit for bit, else lines that say how not."""
    if isinstance(expected, torch.Tensor):
        return _compare_tensor(got, expected, world_size, name, hint)
    if isinstance(expected, (list, tuple)) and isinstance(got, (list, tuple)):
        for i, (g, e) in enumerate(zip(got, expected)):
            if g != e:
                lines = [f"item {i}: yours {g!r}, expected {e!r}"]
                break
        else:
            if len(got) == len(expected):
                return None
            lines = [f"yours has {len(got)} items, expected {len(expected)}"]
        extra = hint(name, got, expected, world_size) if hint else None
        return lines + ([extra] if extra else [])
    if got == expected:
        return None
    extra = hint(name, got, expected, world_size) if hint else None
    return [f"yours {got!r}, expected {expected!r}"] + ([extra] if extra else [])


def _compare_tensor(got: Any, expected: torch.Tensor, n: int, name: str,
                    hint: Callable[..., str | None] | None) -> list[str] | None:
    if not isinstance(got, torch.Tensor):
        return [f"yours is a {type(got).__name__}, expected a tensor {_desc(expected)}"]
    if got.shape != expected.shape or got.dtype != expected.dtype:
        lines = [f"yours is {_desc(got)}, expected {_desc(expected)}"]
        try:  # a lab's hint may compare elements, which these shapes cannot
            said = hint(name, got, expected, n) if hint else None
        except (RuntimeError, ValueError, TypeError, IndexError):
            said = None
        return lines + ([f"  {said}"] if said else [])
    g, e = got.detach().cpu(), expected.detach().cpu()
    # bit for bit; a NaN matches a NaN of the same bits (Note [parity] in minifsdp/parity.py)
    d = parity.first_divergence(g, e, names=("yours", "expected"), equal_nan=True)
    if d is None:
        return None
    idx = "[" + ", ".join(str(i) for i in d.index) + "]"
    lines = [f"{_desc(g)}: {d.count:,} of {d.numel:,} elements differ",
             f"  first at {idx}: yours {_num(d.ours)} ({bits(d.ours, g.dtype)}), "
             f"expected {_num(d.theirs)} ({bits(d.theirs, g.dtype)})"]
    said = hint(name, g, e, n) if hint else None
    said = said or _generic_hint(g, e, n)
    if said:
        lines.append(f"  {said}")
    return lines


def _desc(t: torch.Tensor) -> str:
    dtype = str(t.dtype).replace("torch.", "")
    dtype = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}.get(dtype, dtype)
    return f"{tuple(t.shape)} {dtype}"


def _generic_hint(g: torch.Tensor, e: torch.Tensor, n: int) -> str | None:
    """Signatures a learner's bug leaves in the numbers: a factor N, zeros, rank blocks."""
    if not g.dtype.is_floating_point:
        return None
    g64, e64 = g.double(), e.double()
    if torch.count_nonzero(g64) == 0 and torch.count_nonzero(e64) > 0:
        return "yours is all zeros: was the result ever written into this tensor?"
    if torch.isnan(g64).any() and not torch.isnan(e64).any():
        return "yours has NaN: uninitialised memory (torch.empty) read before it was written?"
    for k, what in ((n, f"{n} (the world size): a sum where a mean is expected?"),
                    (1 / n, f"1/{n}: divided by the world size once too often?")):
        if torch.allclose(g64, e64 * k, rtol=1e-5, atol=1e-7) and torch.count_nonzero(e64) > 0:
            return f"yours = expected × {what}"
    if g.numel() % n == 0 and n > 1:  # the same blocks in another order
        gb, eb = g64.reshape(n, -1), e64.reshape(n, -1)
        order = [next((j for j in range(n) if torch.equal(gb[i], eb[j])), None) for i in range(n)]
        if None not in order and order != list(range(n)) and len(set(order)) == n:
            return (f"yours = expected with its {n} rank blocks permuted (block i holds expected "
                    f"block {order}): which rank's chunk goes where?")
    if torch.allclose(g64, e64, rtol=1e-2, atol=1e-5):
        return ("yours is close but not equal: the same numbers added in another order? The "
                "bar is bit for bit, so the order of floating-point operations must match")
    return None


# ---- in the launcher: the report ---------------------------------------------------------------


@dataclass
class Divergence:
    world_size: int
    rank: int
    case: str | None
    name: str
    step: int | None
    phase: str | None
    detail: list[str]
    internal: bool = False


@dataclass
class Report:
    """The verdict of one ``labs.check``. ``status`` is one of ``pass``, ``not started``,
    ``diverged``, ``crash``, ``hang``, ``bad file``, ``harness error`` (every check matched but
    some seam was never called); ``str(report)`` is what the reader sees."""

    lab: str
    title: str
    status: str
    lines: list[str] = field(default_factory=list)
    divergence: Divergence | None = None
    where: str | None = None  # "file:line" of a crash or of the NotImplementedError
    calls: dict[str, int] = field(default_factory=dict)  # seam -> calls on rank 0, all jobs
    traceback: str = ""  # a crash's whole traceback (the report shows the reader's frames)

    @property
    def ok(self) -> bool:
        return self.status == "pass"

    def __str__(self) -> str:
        return "\n".join(self.lines)

    def _repr_pretty_(self, p: Any, cycle: bool) -> None:  # IPython shows the text
        p.text(str(self))


def diverged(lab: Any, world_size: int, first: dict[str, Any], before: str) -> Report:
    d = Divergence(world_size, first["rank"], first["case"], first["name"], first.get("step"),
                   first.get("phase"), first["detail"], first.get("internal", False))
    at = [f"N = {world_size}", f"rank {d.rank}"]
    if d.step is not None:
        at.append(f"step {d.step}")
    if d.phase:
        at.append(d.phase)
    lines = [f"✗ lab {lab.id} · {lab.title}: first divergence at {', '.join(at)}",
             f"  case {d.case!r}: {d.name}"]
    lines += [f"    {line}" for line in d.detail]
    lines.append(f"  read: {', '.join(f'Note [{n}]' for n in lab.notes)}")
    lines.append(f"  matched before this: {before}")
    return Report(lab.id, lab.title, "diverged", lines, d)


def frames_in(text: str, file_name: str) -> list[tuple[str, int, str]]:
    """``(file, line, code)`` of the traceback frames in ``file_name``, outermost first."""
    out = []
    for m in re.finditer(r'File "([^"]+)", line (\d+), in \S+\n\s+(.+)', text):
        if m.group(1).endswith(file_name):
            out.append((m.group(1), int(m.group(2)), m.group(3).strip()))
    if not out:  # a faulthandler dump: most recent call first, no source lines
        for m in re.finditer(r'File "([^"]+)", line (\d+) in (\S+)', text):
            if m.group(1).endswith(file_name):
                code = linecache.getline(m.group(1), int(m.group(2))).strip()
                out.insert(0, (m.group(1), int(m.group(2)), code or f"in {m.group(3)}()"))
    return out


def last_exception(text: str) -> str:
    """The last ``SomeError: message`` line of a traceback; without one (a native abort, e.g.
    gloo's "Received data size doesn't match"), the last line the process printed before
    faulthandler's dump (``minifsdp.launch.split_stack_dump``: "Fatal Python error: ..." and
    the stacks after it)."""
    lines = [ln.strip() for ln in text.splitlines()
             if re.match(r"^\s*[\w.]+(Error|Exception|Interrupt|Timeout)\b.*", ln)]
    if lines:
        return lines[-1]
    own = split_stack_dump(text)[0]
    return (own.strip().splitlines() or text.strip().splitlines() or ["(no message)"])[-1]


