"""Reading a dispatched torch op for the race checker: its tensors, whether it is a view, and the
storage key an access is tracked under."""

from __future__ import annotations

import re
from typing import Any

import torch

__all__ = ["FACTORY", "is_view", "storage_key", "tensor_items"]

FACTORY = re.compile(r"(new_.*|.*_like)")
"""Schema names of ops whose tensor arguments are only templates (nothing is read from them)."""


def tensor_items(value: Any) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (list, tuple)):
        return [t for v in value for t in tensor_items(v)]
    return []


def is_view(func: Any) -> bool:
    rets = func._schema.returns
    return bool(rets) and all(r.alias_info is not None and not r.alias_info.is_write for r in rets)


def storage_key(t: torch.Tensor) -> int | None:
    """What an access is tracked under: the storage's data pointer, or for a meta tensor (no
    data) the address of its storage object; views share their base's key."""
    if t.numel() == 0:
        return None
    if t.device.type == "meta":
        return int(t.untyped_storage()._cdata)
    return t.untyped_storage().data_ptr()
