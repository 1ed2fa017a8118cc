"""ShapePlanner and the split's template, as specifications: a kept shape plans exactly what
``plan_step`` plans, and the split equals the split rules written out in plain Python (the rules
of asyncdbo.plan.metadata's docstring, one request at a time), on random ragged batches, each
shape planned twice (the second time from the kept template, with the next step's tensors)."""

from __future__ import annotations

import dataclasses
import random
from typing import Any, ClassVar

import pytest
import torch

from asyncdbo.plan import AttentionMetadata, ShapePlanner, SplitKind, ThresholdConfig, plan_step, split_attn_metadata
from asyncdbo.plan.slices import SPLIT_POLICIES, UBatchSlice

LOW = ThresholdConfig(decode_threshold=1, prefill_threshold=1)


def _batch(rng: random.Random, query_lens: list[int], *, on_device_copies: bool = False,
           cls: type[AttentionMetadata] = AttentionMetadata, **extra: Any) -> AttentionMetadata:
    """Metadata of requests with these query lengths over random prefixes, random block ids and slots."""
    seq_lens = [q + rng.randrange(0, 40) for q in query_lens]
    block_table_RB = torch.randint(0, 1000, (len(query_lens), 4), dtype=torch.int32)
    slot_mapping_T = torch.randint(0, 10_000, (sum(query_lens),), dtype=torch.int64)
    meta = cls.from_lengths(query_lens, seq_lens, block_table_RB, slot_mapping_T, **extra)
    if on_device_copies:  # device tensors distinct from their CPU mirrors (what a GPU batch has)
        meta = dataclasses.replace(meta, query_start_loc=meta.query_start_loc_cpu.clone(),
                                   seq_lens=meta.seq_lens_cpu.clone())
    return meta


def _query_lens(rng: random.Random) -> list[int]:
    """A ragged batch: decodes, prefill chunks and the odd request without query tokens."""
    kind = rng.choice(["decode", "mixed", "prefill"])
    n = rng.randrange(1, 24)
    if kind == "decode":
        return [1] * n
    return [rng.choice([0, 1, 1, 2, 5, 13, 40]) if kind == "mixed" else rng.randrange(1, 60) for _ in range(n)] or [1]


def _split_by_the_rules(meta: AttentionMetadata, s: UBatchSlice, batch_max: int | None) -> dict[str, Any]:
    """One ubatch's metadata, request by request, as the rules say."""
    qsl = meta.query_start_loc_cpu.tolist()
    t0, t1 = s.token_slice.start, s.token_slice.stop
    r0, r1 = s.request_slice.start, s.request_slice.stop
    starts, seqs = [], []
    for r in range(r0, r1):
        q0, q1 = max(qsl[r], t0), min(qsl[r + 1], t1)  # this request's tokens inside the ubatch
        starts.append(q0 - t0)
        not_here = max(qsl[r + 1] - t1, 0)  # a truncated head sees only what is written so far
        seqs.append(int(meta.seq_lens_cpu[r]) - not_here)
    ends = [*starts[1:], min(qsl[r1], t1) - t0] if r1 > r0 else []
    qsl_here = [*starts, ends[-1]] if r1 > r0 else [0]
    return {
        "query_start_loc_cpu": qsl_here,
        "seq_lens_cpu": seqs,
        "block_table": meta.block_table[r0:r1].tolist(),
        "slot_mapping": meta.slot_mapping[t0:t1].tolist(),
        "max_query_len": max((e - b for b, e in zip(starts, ends)), default=0),
        "max_seq_len": max(seqs, default=0) if batch_max is None else batch_max,
        "num_actual_tokens": t1 - t0,
    }


def _assert_split_follows_the_rules(meta: AttentionMetadata, plan_slices: Any, metas: Any, max_seq_len: str) -> None:
    batch_max = meta.max_seq_len if max_seq_len == "batch" else None
    for s, part in zip(plan_slices, metas):
        want = _split_by_the_rules(meta, s, batch_max)
        got = {name: (v.tolist() if isinstance(v, torch.Tensor) else v) for name, v in
               ((n, getattr(part, n)) for n in want)}
        assert got == want, (s, got, want)
        assert torch.equal(part.query_start_loc.cpu(), part.query_start_loc_cpu)
        assert torch.equal(part.seq_lens.cpu(), part.seq_lens_cpu)
        assert part.query_start_loc_cpu.dtype == meta.query_start_loc_cpu.dtype
        assert type(part) is type(meta)


def _assert_same_plan(a: Any, b: Any) -> None:
    assert (a.microbatched, a.slices, a.num_tokens_padded, a.record, a.decision) == \
        (b.microbatched, b.slices, b.num_tokens_padded, b.record, b.decision)
    assert len(a.attn_metadata) == len(b.attn_metadata)
    for x, y in zip(a.attn_metadata, b.attn_metadata):
        assert type(x) is type(y)
        for f in dataclasses.fields(x):
            u, v = getattr(x, f.name), getattr(y, f.name)
            assert (torch.equal(u, v) and u.dtype == v.dtype) if isinstance(u, torch.Tensor) else u == v, f.name


@pytest.mark.parametrize("seed", range(6))
def test_a_kept_shape_plans_what_plan_step_plans_and_splits_by_the_rules(seed: int) -> None:
    rng = random.Random(seed)
    for _ in range(25):
        query_lens = _query_lens(rng)
        policy = rng.choice(SPLIT_POLICIES)
        n = rng.randrange(1, 5)
        max_seq_len = rng.choice(["ubatch", "batch"])
        enabled = rng.random() < 0.85
        planner = ShapePlanner(num_ubatches=n, policy=policy, thresholds=LOW, max_seq_len=max_seq_len)
        for step in range(2):  # a new shape, then the same offsets with the next step's tensors
            meta = _batch(rng, query_lens, on_device_copies=rng.random() < 0.3)
            got, uniform = planner.plan(meta, enabled=enabled, step=step, config="cfg")
            want = plan_step(meta.query_start_loc_cpu, num_ubatches=n, policy=policy, thresholds=LOW,
                             enabled=enabled, attn_metadata=meta, step=step, config="cfg",
                             max_seq_len=max_seq_len, is_idle=sum(query_lens) == 0)
            _assert_same_plan(got, want)
            assert uniform == all(q == 1 for q in query_lens)
            if got.microbatched:
                _assert_split_follows_the_rules(meta, got.slices, got.attn_metadata, max_seq_len)
                _assert_split_follows_the_rules(meta, got.slices, split_attn_metadata(meta, got.slices,
                                                                                      max_seq_len=max_seq_len),
                                                max_seq_len)
            else:
                assert got.attn_metadata == (meta,)


def test_a_subclass_splits_its_declared_fields_through_a_kept_shape() -> None:
    @dataclasses.dataclass(frozen=True, kw_only=True)
    class WithExtras(AttentionMetadata):
        split_rules: ClassVar = {"token_scale": SplitKind.PER_TOKEN, "temperature": SplitKind.PER_REQUEST,
                                 "cache": SplitKind.SHARED}
        token_scale: torch.Tensor
        temperature: torch.Tensor
        cache: object

    rng = random.Random(7)
    planner = ShapePlanner(num_ubatches=2, thresholds=LOW)
    cache = object()
    for step in range(2):
        meta = _batch(rng, [3, 5, 1, 7], cls=WithExtras, token_scale=torch.arange(16.0) + step,
                      temperature=torch.tensor([0.5, 0.7, 0.9, 1.1]) * (step + 1), cache=cache)
        plan, _ = planner.plan(meta, step=step)
        assert [m.token_scale.tolist() for m in plan.attn_metadata] == [
            (torch.arange(8.0) + step).tolist(), (torch.arange(8.0, 16.0) + step).tolist()]
        assert [m.temperature.tolist() for m in plan.attn_metadata] == [
            meta.temperature[s.request_slice].tolist() for s in plan.slices]
        assert all(m.cache is cache for m in plan.attn_metadata)
        _assert_split_follows_the_rules(meta, plan.slices, plan.attn_metadata, "ubatch")


def test_a_ubatchs_offsets_written_by_a_model_do_not_reach_the_next_step() -> None:
    rng = random.Random(3)
    planner = ShapePlanner(num_ubatches=2, thresholds=LOW)
    first, _ = planner.plan(_batch(rng, [1] * 8))
    first.attn_metadata[1].query_start_loc_cpu.fill_(99)  # a model that writes its metadata in place
    second, _ = planner.plan(_batch(rng, [1] * 8), step=1)
    assert second.attn_metadata[1].query_start_loc_cpu.tolist() == [0, 1, 2, 3, 4]


def test_shapes_past_the_capacity_are_planned_again_alike() -> None:
    rng = random.Random(5)
    planner = ShapePlanner(num_ubatches=2, thresholds=LOW, capacity=2)
    shapes = [[1] * n for n in (4, 5, 6)] + [[3, 2, 7]]
    for step, query_lens in enumerate(shapes * 2):
        meta = _batch(rng, query_lens)
        got, _ = planner.plan(meta, step=step)
        _assert_same_plan(got, plan_step(meta.query_start_loc_cpu, thresholds=LOW, attn_metadata=meta, step=step))


@pytest.mark.parametrize("kwargs, message", [
    ({"num_ubatches": 0}, "num_ubatches (0) must be at least 1"),
    ({"num_ubatches": 3, "max_ubatches": 2}, "num_ubatches (3) exceeds max_ubatches (2)"),
    ({"policy": "halves"}, "unknown split policy 'halves'; use one of"),
    ({"min_share": 0.7}, "min_share (0.7) must lie in [0, 0.5]"),
    ({"max_seq_len": "step"}, "ShapePlanner max_seq_len='step': use 'ubatch'"),
    ({"capacity": 0}, "capacity (0) must be at least 1"),
])
def test_bad_settings_are_refused_when_the_planner_is_made(kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError) as err:
        ShapePlanner(**kwargs)
    assert message in str(err.value)


def test_enabled_must_be_a_bool() -> None:
    planner = ShapePlanner(thresholds=LOW)
    with pytest.raises(TypeError, match="enabled"):
        planner.plan(_batch(random.Random(0), [1, 1]), enabled="no")  # type: ignore[arg-type]


def test_planners_of_other_configurations_share_offsets_but_not_their_cuts() -> None:
    """An "auto" runner reads a step's offsets once and hands them to the planner of the
    configuration it chose: each planner cuts them its own way."""
    meta = _batch(random.Random(11), [1] * 12)
    two, three = ShapePlanner(num_ubatches=2, thresholds=LOW), ShapePlanner(num_ubatches=3, thresholds=LOW)
    offsets = two.offsets(meta)
    for _ in range(2):
        for planner, n in ((two, 2), (three, 3), (two, 2)):
            plan, _ = planner.plan(meta, offsets=offsets)
            _assert_same_plan(plan, plan_step(meta.query_start_loc_cpu, num_ubatches=n, thresholds=LOW,
                                              attn_metadata=meta))


def test_a_planner_and_its_kept_shapes_are_freed_without_the_cycle_collector() -> None:
    import gc
    import weakref

    gc.disable()
    try:
        planner = ShapePlanner(num_ubatches=2, thresholds=LOW)
        planner.plan(_batch(random.Random(1), [1] * 6))
        gone = weakref.ref(planner)
        del planner
        assert gone() is None
    finally:
        gc.enable()


def test_a_subclass_with_its_own_post_init_gets_it_run_for_each_ubatch() -> None:
    """Such a class is built by ``dataclasses.replace`` (its own checks run), not by a copy of the
    instance dict; the base class's O(requests) checks are skipped as for every ubatch."""
    made: list[int] = []

    @dataclasses.dataclass(frozen=True, kw_only=True)
    class Checked(AttentionMetadata):
        def __post_init__(self) -> None:
            super().__post_init__()
            made.append(self.num_actual_tokens)

    rng = random.Random(9)
    planner = ShapePlanner(num_ubatches=2, thresholds=LOW)
    for step in range(2):
        meta = _batch(rng, [3, 5, 1, 7], cls=Checked)
        made.clear()
        plan, _ = planner.plan(meta, step=step)
        assert made == [8, 8] and all(type(m) is Checked for m in plan.attn_metadata)
        _assert_split_follows_the_rules(meta, plan.slices, plan.attn_metadata, "ubatch")
