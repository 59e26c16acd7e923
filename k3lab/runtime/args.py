"""The one rule for integer arguments: lengths, counts and indices, alone (`int_arg`) or one per
request (`int_list`). Every room checks its integers with these (the ops re-export them as
`k3lab.ops.int_arg` / `int_list`, the references in k3lab.nn use them directly), so a bool is never
read as 1 and a float never truncated anywhere.

Imports only torch and the standard library, as the rest of runtime/ does, so every room may import it.
"""

from __future__ import annotations

import operator
from collections.abc import Mapping

import torch


def int_arg(name: str, value, *, low: int = 0, high: int | None = None, what: str = "an integer") -> int:
    """`value` as a Python int; ValueError naming `name` unless it is an integer (a Python or numpy
    integer, or a 0-d integer tensor) in [low, high]. Never a bool (True would count as 1) nor a float
    (2.7 would be truncated to 2): the one rule for the lengths, counts and indices the ops take."""
    bad = (type(value).__name__ in ("bool", "bool_")  # Python's and numpy's
           or (isinstance(value, torch.Tensor) and (value.dim() != 0 or value.dtype == torch.bool)))
    try:
        v = None if bad else operator.index(value)
    except TypeError:
        v = None
    span = f">= {low}" if high is None else f"in [{low}, {high}]"
    if v is None or v < low or (high is not None and v > high):
        raise ValueError(f"{name} must be {what} {span} (not a bool or a float), got {value!r}")
    return v


def int_list(name: str, values, *, size: int | None = None, low: int = 0,
             high: int | None = None) -> list[int]:
    """`values` (a list or tuple of integers, or a 1-D integer tensor: one host read) as a list of Python
    ints, each by `int_arg`'s rule, so a bool inside a list is refused as a lone one is (torch.as_tensor
    would turn [True, 12] into int64 [1, 12]); `size`: the number of entries required. ValueError naming
    `name` (and the entry) otherwise: the one rule for per-request lengths."""
    what = "a list of integers" if size is None else f"a list of {size} integers"
    if isinstance(values, torch.Tensor):
        if values.dim() != 1 or values.dtype.is_floating_point or values.dtype.is_complex \
                or values.dtype == torch.bool:
            raise ValueError(f"{name} must be {what} or a 1-D integer tensor (not bool or floating "
                             f"point), got {values.dtype} {tuple(values.shape)}")
        values = values.tolist()
    elif isinstance(values, (str, bytes, Mapping)) or not hasattr(values, "__iter__"):
        raise ValueError(f"{name} must be {what} or a 1-D integer tensor, got {values!r}"[:200])
    values = list(values)
    if size is not None and len(values) != size:
        raise ValueError(f"{name} must be {what} (one per request), got {len(values)} entries")
    return [int_arg(f"{name}[{i}]", x, low=low, high=high) for i, x in enumerate(values)]
