"""Exact mode (``HFMoEModel(deterministic=True)``): a DBO step of Mixtral, Qwen3-MoE and
DeepSeek-V3 gives the serial step's logits and KV cache bit for bit.

Every combo runs three steps serially and with DBO on separate KV caches
(:mod:`_hf_exact_ranks`): a prefill whose long request the token split cuts inside (at another
token on every rank and ubatch count), a chunked prefill mixed with decode tokens, and a decode
step.  The combos cover the project's three tiny configs and three more that differ in routing and
RoPE, float32 and bfloat16, both MoE schedules, both stream policies, 2 to 4 ubatches, the token
and balanced split policies, 1, 2 and 4 gloo ranks and idle DP ranks; each rank checks every step
with ``torch.equal`` and both caches after the last one.  With the mode off the same steps differ
(the test would catch a mode that does nothing).
"""

from __future__ import annotations

import pytest

pytest.importorskip("transformers")

from _hf_exact_ranks import MODELS, Combo, exact_combos  # noqa: E402

from asyncdbo.testing import RankPool  # noqa: E402

#: (schedule, stream policy, ubatches, split policy), cycled over the models of a test.
VARIANTS = (("ht", "role", 2, "token"), ("ll", "ubatch", 3, "token"), ("ht", "ubatch", 4, "token"),
            ("ll", "role", 4, "balanced"), ("ht", "role", 3, "token"), ("ll", "ubatch", 2, "token"))


def combos(dtypes: tuple[str, str], shift: int, **kw: object) -> list[Combo]:
    """One combo per model; dtypes alternate and variants cycle, starting ``shift`` along."""
    out = []
    for i, name in enumerate(MODELS):
        schedule, stream_policy, n, policy = VARIANTS[(i + shift) % len(VARIANTS)]
        out.append(Combo(model=name, dtype=dtypes[i % 2], schedule=schedule, stream_policy=stream_policy,
                         num_ubatches=n, policy=policy, **kw))  # type: ignore[arg-type]
    return out


def assert_bitwise(results: dict[Combo, dict]) -> None:
    for combo, r in results.items():
        assert r["equal"] == [True] * 3, (combo, r)
        assert r["kv_equal"] and r["kv_nonzero"], (combo, r)
        assert all(r["microbatched"]), (combo, r)


@pytest.mark.timeout(300)
def test_one_rank_every_model_is_bitwise_in_exact_mode(one_thread: None) -> None:
    cases = combos(("float32", "bfloat16"), 0)
    results = exact_combos(0, 1, cases)
    assert_bitwise(results)
    # the token split cuts request 1 (tokens 9..105 of 111) inside it, and step 1's continuation
    cuts = {c.num_ubatches: results[c]["cuts"][:2] for c in cases if c.policy == "token"}
    assert cuts == {2: [(55, 56), (47, 48)], 3: [(37, 37, 37), (31, 31, 33)], 4: [(27, 27, 27, 30), (23, 23, 23, 26)]}


@pytest.mark.timeout(120)
def test_the_same_steps_differ_with_exact_mode_off(one_thread: None) -> None:
    case = Combo(model="mixtral-top1-linear-tied", num_ubatches=3)
    (r,) = exact_combos(0, 1, [case], False).values()
    assert r["equal"] == [False] * 3 and not r["kv_equal"] and r["max_abs_diff"] > 0, r


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_two_ranks_with_idle_ranks_are_bitwise_in_exact_mode(pool: RankPool) -> None:
    # the other dtype per model than on one rank; rank 0 idle in the prefill, rank 1 in the decode
    cases = combos(("bfloat16", "float32"), 3, idle=((0, 0), (2, 1)))
    for rank, results in enumerate(pool.run(exact_combos, cases, timeout_s=280.0)):
        assert_bitwise(results)
        for r in results.values():
            idle_step = 0 if rank == 0 else 2
            assert sum(r["cuts"][idle_step]) == 0, r["cuts"]


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_four_ranks_with_an_idle_rank_are_bitwise_in_exact_mode(pool4: RankPool) -> None:
    cases = [Combo(model=m, dtype=d, schedule=s, stream_policy=p, num_ubatches=n, idle=((1, 2),))
             for m, d, s, p, n in (("mixtral", "bfloat16", "ll", "ubatch", 2), ("qwen3-moe", "float32", "ht", "role", 3),
                                   ("deepseek-v3", "float32", "ll", "role", 4))]
    for results in pool4.run(exact_combos, cases, timeout_s=280.0):
        assert_bitwise(results)
