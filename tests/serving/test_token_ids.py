"""Token ids are checked before the embedding: an integer dtype, and ids inside the vocabulary.

Unchecked, ``-1`` read the embedding's last row (Python indexing from the end) and a float id
was truncated by the batch builder; both gave plausible logits for the wrong token. The models
check the tensors they are given (the range on the host; see check_token_ids), the batch
checks its dtype, and the builder checks the ids it is given, as Python values, before any
tensor exists.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

import asyncdbo
from asyncdbo.models import KVCacheConfig, MiniConfig, MiniModel
from asyncdbo.serving import Batch, BatchBuilder, check_token_ids

CFG = MiniConfig(vocab_size=64, hidden_size=16, num_layers=1, num_heads=2, head_dim=8, num_experts=4, top_k=2,
                 moe_intermediate_size=16, num_kv_blocks=8, block_size=4)
CACHE = KVCacheConfig(num_layers=1, num_blocks=8, block_size=4, num_heads=2, head_dim=8)


def _out_of_vocab(where: str, token: int) -> str:
    return (f"{where} is {token}, not a token id of a vocabulary of 64 (0 .. 63); "
            "map padding and unknown tokens to a real id (the runner pads with 0)")


@pytest.mark.parametrize(("tokens", "message"), [
    ([1, 2.0, 3], "request 7: token 1 is 2.0, not an integer token id; pass ints (a float id would be truncated)"),
    ([1, 2.7], "request 7: token 1 is 2.7, not an integer token id; pass ints (a float id would be truncated)"),
    ([True], "request 7: token 0 is True, not an integer token id; pass ints (a float id would be truncated)"),
    ([5, -1], _out_of_vocab("request 7: token 1", -1)),
    ([64], _out_of_vocab("request 7: token 0", 64)),
], ids=["float", "fractional", "bool", "-1", "vocab size"])
def test_the_builder_refuses_ids_that_are_not_in_the_vocabulary(tokens: list[Any], message: str) -> None:
    builder = BatchBuilder(CACHE, vocab_size=64)
    with pytest.raises(ValueError) as info:
        builder.build([(3, [1, 2]), (7, tokens)])
    assert str(info.value) == message
    assert builder.build([(3, [1, 2])]).positions_T.tolist() == [0, 1]  # the refused batch changed nothing


def test_the_builder_takes_numpy_and_tensor_integers_and_a_vocabulary_is_optional() -> None:
    import numpy as np

    batch = BatchBuilder(CACHE).build([(0, [np.int64(3), torch.tensor(5), 1000])])
    assert batch.input_ids_T.tolist() == [3, 5, 1000]  # no vocab_size: the model checks the range
    with pytest.raises(ValueError, match=r"^vocab_size must be a number of tokens >= 1 or None \(got 0\)$"):
        BatchBuilder(CACHE, vocab_size=0)


def test_a_batch_needs_integer_ids() -> None:
    good = BatchBuilder(CACHE).build([(0, [1, 2])])
    with pytest.raises(ValueError) as info:
        Batch(input_ids_T=good.input_ids_T.float(), positions_T=good.positions_T, attn=good.attn)
    assert str(info.value) == ("input_ids must hold token ids as torch.int64 (or torch.int32), got torch.float32; "
                               "build it with torch.tensor(ids, dtype=torch.int64)")


@pytest.mark.parametrize(("ids", "message"), [
    (torch.tensor([3, -1, 5]), _out_of_vocab("input_ids[1]", -1)),
    (torch.tensor([3, 64, 5]), _out_of_vocab("input_ids[1]", 64)),
    (torch.tensor([3.0, 1.0, 5.0]), "input_ids must hold token ids as torch.int64 (or torch.int32), got torch.float32; "
                                    "build it with torch.tensor(ids, dtype=torch.int64)"),
    (torch.tensor([True, False, True]), "input_ids must hold token ids as torch.int64 (or torch.int32), got torch.bool; "
                                        "build it with torch.tensor(ids, dtype=torch.int64)"),
], ids=["-1", "vocab size", "float", "bool"])
def test_the_mini_model_refuses_ids_outside_its_vocabulary(ids: torch.Tensor, message: str) -> None:
    model = MiniModel(CFG)
    batch = BatchBuilder(CFG.kv_cache_config).build([(0, [1, 2, 3])])
    with pytest.raises(ValueError) as info:
        asyncdbo.run(model.forward, ids, batch.positions_T, batch.attn)
    assert str(info.value) == message
    assert asyncdbo.run(model.forward, batch.input_ids_T, batch.positions_T, batch.attn).shape == (3, 64)


def test_the_hf_model_refuses_ids_outside_its_vocabulary() -> None:
    pytest.importorskip("transformers")
    from asyncdbo.models.hf import from_hf_model
    from asyncdbo.models.hf.reference import tiny_hf_model

    hf = tiny_hf_model("mixtral")
    model = from_hf_model(hf)
    V = hf.config.vocab_size
    batch = BatchBuilder(model.kv_cache_config).build([(0, [1, 2])])
    with pytest.raises(ValueError) as info:
        asyncdbo.run(model.forward, torch.tensor([1, -1]), batch.positions_T, batch.attn)
    assert str(info.value) == (f"input_ids[1] is -1, not a token id of a vocabulary of {V} (0 .. {V - 1}); "
                               "map padding and unknown tokens to a real id (the runner pads with 0)")
    with pytest.raises(ValueError, match=r"^input_ids must hold token ids as torch.int64 \(or torch.int32\), got torch.float64"):
        asyncdbo.run(model.forward, torch.tensor([1.0, 2.0], dtype=torch.float64), batch.positions_T, batch.attn)


def test_check_token_ids_leaves_an_accelerator_tensors_range_to_the_builder() -> None:
    """A meta tensor stands for a device tensor here: its dtype is checked, its values are not
    read (that would make every step wait for the device)."""
    check_token_ids(torch.empty(3, dtype=torch.int64, device="meta"), 64)
    with pytest.raises(ValueError, match=r"got torch.float16"):
        check_token_ids(torch.empty(3, dtype=torch.float16, device="meta"), 64)
