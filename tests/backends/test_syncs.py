"""HostSyncs: every op that would make the host wait for an accelerator is recorded on CPU
tensors too, with the caller's file:line; ``forbid`` refuses it before it runs; ops that stay on
the device are not counted."""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import pytest
import torch

import asyncdbo
from asyncdbo.syncs import HostSyncError, HostSyncs, SyncRecord

X = torch.tensor([1, 0, 2, 2])
M = X > 0

# (what the user wrote, the op the record names)
SYNCING: dict[str, tuple[Callable[[], Any], str]] = {
    "item": (lambda: X[0].item(), "aten._local_scalar_dense"),
    "int": (lambda: int(X.sum()), "aten._local_scalar_dense"),
    "float": (lambda: float(X[0]), "aten._local_scalar_dense"),
    "bool": (lambda: bool(M.any()), "aten._local_scalar_dense"),
    "index": (lambda: [0, 1, 2][X[0]], "aten._local_scalar_dense"),
    "format": (lambda: f"{X[0]}", "aten._local_scalar_dense"),
    "tolist": (lambda: X.tolist(), "Tensor.tolist"),
    "cpu": (lambda: X.cpu(), "Tensor.cpu"),
    "numpy": (lambda: X.numpy(), "Tensor.numpy"),
    "to_cpu": (lambda: X.to("cpu"), "Tensor.to"),
    "nonzero": (lambda: X.nonzero(), "aten.nonzero"),
    "where1": (lambda: torch.where(M), "aten.nonzero"),
    "argwhere": (lambda: torch.argwhere(X), "aten.nonzero"),
    "masked_select": (lambda: X.masked_select(M), "aten.masked_select"),
    "mask_index": (lambda: X[M], "aten.index"),
    "mask_put_tensor": (lambda: X.clone().index_put_((M,), torch.tensor([7, 8, 9])), "aten.index_put_"),
    "unique": (lambda: torch.unique(X), "aten._unique2"),
    "unique_consecutive": (lambda: torch.unique_consecutive(X), "aten.unique_consecutive"),
    "unique_dim": (lambda: torch.unique(X.view(2, 2), dim=0), "aten.unique_dim"),
    "bincount": (lambda: torch.bincount(X, minlength=4), "aten.bincount"),
    "histc_auto_range": (lambda: torch.histc(X.float(), bins=3), "aten.histc"),
    "repeat_interleave": (lambda: torch.repeat_interleave(torch.arange(4), X), "aten.repeat_interleave"),
    "repeat_interleave_counts": (lambda: torch.repeat_interleave(X), "aten.repeat_interleave"),
    "equal": (lambda: torch.equal(X, X), "aten.equal"),
    "allclose": (lambda: torch.allclose(X.float(), X.float()), "aten.allclose"),
}

DEVICE_ONLY: dict[str, Callable[[], Any]] = {
    "nonzero_static": lambda: torch.nonzero_static(X, size=4),
    "repeat_interleave_output_size": lambda: torch.repeat_interleave(torch.arange(4), X, output_size=5),
    "masked_fill_by_index": lambda: X.clone().__setitem__(M, 5),  # torch turns it into masked_fill_
    "masked_fill": lambda: X.masked_fill(M, 0),
    "scatter_add": lambda: torch.zeros(4, dtype=torch.long).scatter_add_(0, X, torch.ones_like(X)),
    "histc_fixed_range": lambda: torch.histc(X.float(), bins=3, min=0, max=3),
    "sort_topk_cumsum": lambda: (X.sort(stable=True), X.topk(2), X.cumsum(0)),
    "long_index": lambda: X[torch.tensor([0, 2])],
    "shape": lambda: (len(X), X.shape[0], X.numel()),
}


@pytest.mark.parametrize("name", sorted(SYNCING))
def test_each_syncing_op_is_recorded_once_with_the_callers_line(name: str) -> None:
    fn, op = SYNCING[name]
    line = inspect.getsourcelines(fn)[1]
    with HostSyncs() as syncs:
        fn()
    assert [(r.op, r.where) for r in syncs.records] == [(op, f"{__file__}:{line}")]
    assert syncs.records[0].ubatch is None and syncs.records[0].device == "cpu"


@pytest.mark.parametrize("name", sorted(DEVICE_ONLY))
def test_ops_that_stay_on_the_device_are_not_counted(name: str) -> None:
    with HostSyncs(forbid=True) as syncs:
        DEVICE_ONLY[name]()
    assert syncs.count == 0


def test_forbid_refuses_before_the_op_runs_naming_op_and_line() -> None:
    y = X.clone()
    with HostSyncs(forbid=True) as syncs, pytest.raises(HostSyncError) as info:
        y.index_put_((M,), torch.tensor([7, 8, 9]))
    line = inspect.currentframe().f_lineno - 1  # type: ignore[union-attr]
    assert str(info.value) == (
        f"host sync forbidden here: aten.index_put_ at {__file__}:{line}: a masked index_put_ expands the mask "
        "with nonzero"
    )
    assert info.value.record.op == "aten.index_put_"
    assert torch.equal(y, X)  # refused before it ran
    assert syncs.count == 0


def test_allowed_lets_a_known_sync_through_and_records_it() -> None:
    with HostSyncs(forbid=True) as syncs:
        with syncs.allowed():
            assert X.tolist() == [1, 0, 2, 2]
        with pytest.raises(HostSyncError):
            X.tolist()
    assert syncs.by_op() == {"Tensor.tolist": 1}


def test_counts_only_inside_the_block_and_is_not_reentrant() -> None:
    syncs = HostSyncs()
    with syncs:
        X.tolist()
        with pytest.raises(RuntimeError, match="not reentrant"):
            syncs.__enter__()
    X.tolist()
    int(X[0])
    assert syncs.count == 1
    assert syncs.report() == str(syncs.records[0])
    assert HostSyncs().report() == "no host syncs"


def test_device_only_skips_cpu_tensors() -> None:
    with HostSyncs(device_only=True, forbid=True) as syncs:
        X.tolist()
        X.nonzero()
        int(X[0])
    assert syncs.count == 0


def test_on_sync_sees_each_record_after_the_op_with_its_arguments() -> None:
    seen: list[tuple[SyncRecord, tuple[Any, ...]]] = []
    with HostSyncs(on_sync=lambda rec, args: seen.append((rec, args))):
        X.nonzero()
    assert [(r.op, a[0] is X) for r, a in seen] == [("aten.nonzero", True)]


def test_by_op_counts_most_frequent_first() -> None:
    with HostSyncs() as syncs:
        for _ in range(3):
            int(X[0])
        X.nonzero()
    assert syncs.by_op() == {"aten._local_scalar_dense": 3, "aten.nonzero": 1}


@pytest.mark.asyncio
async def test_records_name_the_ubatch_that_synced() -> None:
    async def fwd(x: torch.Tensor) -> torch.Tensor:
        await asyncdbo.dbo_yield()
        return x.nonzero()

    with HostSyncs() as syncs:
        await asyncdbo.run_ubatches(fwd, [(X,), (M,)], backend="host")
    assert [(r.op, r.ubatch) for r in syncs.records] == [("aten.nonzero", 0), ("aten.nonzero", 1)]
