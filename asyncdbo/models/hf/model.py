"""One ``async def`` decoder for every supported Hugging Face MoE architecture, under DP + EP.

Embedding -> L x [RMSNorm -> attention (paged KV cache) -> residual -> RMSNorm -> MoE (or a dense
MLP) -> residual] -> RMSNorm -> LM head.  What differs between architectures is the attention
(GQA with or without q/k norms, MLA), which layers are dense, the routing rule and the checkpoint
names, all given by an :class:`Architecture`; how DBO runs does not differ: the MoE layers are
the library's :class:`~asyncdbo.moe.MoELayer`, with its yields where its comm is.

Parallelism is the reference model's: every rank of the EP group is also a DP rank, holds the
embedding, attention, norms, dense MLPs, routers and shared experts in full, its own paged KV
cache and its own requests, and ``num_experts / EP size`` routed experts of each MoE layer.

Weights: the model allocates every tensor it needs on this rank (uninitialised) and registers it
under its checkpoint name in :class:`~asyncdbo.models.hf.common.WeightSlots`; a loader fills the
slots (:func:`~asyncdbo.models.hf.registry.from_hf_model` from an in-memory transformers model,
:func:`asyncdbo.models.hf.checkpoint.load_checkpoint` from safetensors files).  Checkpoint names
are the Hub layout (one tensor per expert, e.g. ``...experts.3.w1.weight`` for Mixtral), which
is what checkpoint files hold; transformers 5 keeps experts fused in memory
(``experts.gate_up_proj``), and :func:`hub_layout` splits those.
"""

# Shape legend: T = tokens, D = hidden, V = vocab, I = dense MLP intermediate, E = experts,
# F = expert intermediate.

from __future__ import annotations

import copy
import dataclasses
import re
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from ...dist.ep import EPComm, ep_comm
from ...moe import MoEConfig, MoELayer
from ...moe.batch_invariant import ROW_TILE
from ...moe.config import Schedule
from ...moe.experts import swiglu
from ...plan.metadata import AttentionMetadata
from ...serving import check_token_ids, exact_tap
from ..attention import KVCacheConfig, PagedKVCache, check_logits, lm_head
from .common import (
    Rope,
    WeightSlots,
    apply_rope,
    attend,
    linear,
    residual_norm,
    rms_norm,
)
from .gqa import gqa_qkv
from .mla import mla_expand, mla_project

__all__ = ["Architecture", "HFMoEModel", "Segments", "hub_layout"]


@dataclass(frozen=True)
class Segments:
    """The synchronous pieces the forward runs between its awaits (see
    :mod:`asyncdbo.models.hf.common`); :meth:`compiled` gives their ``torch.compile``\\ d twins."""

    rms_norm: Callable[..., Any] = rms_norm
    residual_norm: Callable[..., Any] = residual_norm
    linear: Callable[..., Any] = linear
    apply_rope: Callable[..., Any] = apply_rope
    attend: Callable[..., Any] = attend
    mlp: Callable[..., Any] = swiglu
    gqa_qkv: Callable[..., Any] = gqa_qkv
    mla_project: Callable[..., Any] = mla_project
    mla_expand: Callable[..., Any] = mla_expand

    def compiled(self, **compile_kwargs: Any) -> Segments:
        """The same pieces through ``torch.compile(fn, **compile_kwargs)``."""
        return dataclasses.replace(self, **{
            f.name: torch.compile(getattr(self, f.name), **compile_kwargs) for f in dataclasses.fields(self)
        })


class Architecture:
    """How one transformers architecture maps onto :class:`HFMoEModel`; built from its config.

    Subclasses set the class attributes and implement the methods; ``check`` refuses config
    features the model does not implement with a ValueError naming the setting."""

    name: ClassVar[str]  # the CLI name, e.g. "qwen3-moe"
    model_type: ClassVar[str]  # transformers' config.model_type
    hf_class: ClassVar[str]  # the transformers causal-LM class
    moe_module: ClassVar[str] = "mlp"  # checkpoint name of a layer's MoE block
    expert_names: ClassVar[tuple[str, str, str]] = ("gate_proj", "up_proj", "down_proj")

    def __init__(self, hf_config: Any) -> None:
        if getattr(hf_config, "model_type", None) != self.model_type:
            raise ValueError(
                f"{self.name} needs a {self.model_type!r} config, got model_type "
                f"{getattr(hf_config, 'model_type', None)!r}; pick the architecture the checkpoint was saved as"
            )
        self.hf = hf_config
        self.check()

    def check(self) -> None:
        """Refuse what the model does not implement (ValueError naming the setting)."""
        hf = self.hf
        if getattr(hf, "hidden_act", "silu") != "silu":
            raise ValueError(f"{self.name}: hidden_act={hf.hidden_act!r} is not supported (SwiGLU experts only)")
        if getattr(hf, "sliding_window", None) is not None:
            raise ValueError(f"{self.name}: sliding_window={hf.sliding_window} is not supported (full causal attention only)")
        if getattr(hf, "quantization_config", None):
            raise ValueError(f"{self.name}: quantized checkpoints ({hf.quantization_config}) are not supported; use a bf16/fp32 one")

    def is_moe_layer(self, layer: int) -> bool:
        """Whether decoder layer ``layer`` has a MoE block (else a dense MLP)."""
        raise NotImplementedError

    def moe_config(self, schedule: Schedule) -> MoEConfig:
        """The routing rule and sizes of this architecture's MoE layers."""
        raise NotImplementedError

    def make_attention(self, prefix: str, slots: WeightSlots, *, dtype: torch.dtype, device: Any) -> Any:
        """One layer's attention, its weights registered in ``slots`` under ``prefix``."""
        raise NotImplementedError

    def rope(self) -> Rope:
        """The rotary tables of the model."""
        raise NotImplementedError

    @property
    def dense_intermediate_size(self) -> int:
        """Intermediate size of the dense MLP layers."""
        return int(self.hf.intermediate_size)

    def hub_name(self, name: str) -> str:
        """The checkpoint name of an in-memory transformers parameter name (fused experts aside)."""
        return name

    @classmethod
    def tiny_config(cls, **overrides: Any) -> Any:
        """A tiny transformers config of this architecture (tests, the demo without weights)."""
        raise NotImplementedError


@dataclass(eq=False)
class DecoderLayer:
    attn_norm_D: torch.Tensor
    attention: Any
    ffn_norm_D: torch.Tensor
    moe: MoELayer | None
    mlp: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None  # dense (gate_ID, up_ID, down_DI)


class HFMoEModel:
    """The model on one rank (module docstring).  ``schedule``: the MoE layers' DBO schedule;
    ``max_ubatches`` bounds a DBO run's ubatches; ``block_size``/``num_kv_blocks`` size this
    rank's KV cache.  Building it with EP size > 1 is collective (the MoE layers make per-ubatch
    process groups): every rank builds it at the same time.  Its weights are uninitialised until
    a loader fills :attr:`slots`.

    ``deterministic`` is exact mode: True makes every piece batch-invariant (the projections, the
    LM head and the dense and expert MLPs in fixed row tiles, attention tiled by position, the MoE
    layers' own deterministic mode), so a DBO step gives the serial step's logits and KV cache bit
    for bit; False turns the MoE layers' mode off too; None (the default) leaves the MoE layers at
    their own default (on for CPU inputs) and the rest on its fast path.

    ``mla_absorb`` (DeepSeek-V3): decode requests attend in the latent space (DeepSeek's and
    vLLM's absorbed form, :func:`asyncdbo.models.hf.mla.mla_absorbed_decode`), far cheaper at real
    ranks (benchmarks/batched_attention.py) but not transformers' rounding: off by default, so
    bf16 logits keep transformers' bits; exact mode always takes the tiled path.

    ``logits``: ``"all"`` (the default) runs the LM head on every token; ``"last"`` only on each
    request's last new token of the step (:func:`~asyncdbo.models.attention.last_token_rows`, what
    a sampler reads), the other rows of the ``[T, V]`` logits being zeros: a prefill of ``T``
    tokens in ``R`` requests runs the ``V x D`` GEMM on ``R`` rows instead of ``T``."""

    def __init__(self, arch: Architecture, *, ep_group: Any = None, schedule: Schedule = "ht", max_ubatches: int = 4,
                 block_size: int = 16, num_kv_blocks: int = 256, dtype: torch.dtype = torch.float32,
                 device: torch.device | str = "cpu", deterministic: bool | None = None,
                 mla_absorb: bool = False, logits: str = "all") -> None:
        if not (deterministic is None or isinstance(deterministic, bool)):
            raise ValueError(f"HFMoEModel deterministic must be True, False or None (got {deterministic!r})")
        if not isinstance(mla_absorb, bool):
            raise ValueError(f"HFMoEModel mla_absorb must be True or False (got {mla_absorb!r})")
        check_logits("HFMoEModel", logits)
        self.logits = logits
        #: The most ubatches a run may cut a step into (its MoE layers' process-group clones): a
        #: DBORunner refuses at construction a configuration that could choose more.
        self.max_ubatches = max_ubatches
        hf = self.hf = arch.hf
        self.deterministic = deterministic
        self.mla_absorb = mla_absorb
        #: Rows per GEMM call in exact mode (None: the fast path).
        self.tile: int | None = ROW_TILE if deterministic else None
        self.arch, self.slots, self.segments = arch, WeightSlots(), Segments()
        self.eps = float(hf.rms_norm_eps)
        D, V = hf.hidden_size, hf.vocab_size
        new = self.slots.new
        self.embed_VD = new("model.embed_tokens.weight", V, D, dtype=dtype, device=device)
        self.layers: list[DecoderLayer] = []
        for i in range(hf.num_hidden_layers):
            p = f"model.layers.{i}"
            moe, mlp = None, None
            if arch.is_moe_layer(i):
                moe = self._moe(arch, f"{p}.{arch.moe_module}", ep_group=ep_group, schedule=schedule,
                                max_ubatches=max_ubatches, dtype=dtype, device=device)
            else:
                size = arch.dense_intermediate_size
                mlp = (new(f"{p}.mlp.gate_proj.weight", size, D, dtype=dtype, device=device),
                       new(f"{p}.mlp.up_proj.weight", size, D, dtype=dtype, device=device),
                       new(f"{p}.mlp.down_proj.weight", D, size, dtype=dtype, device=device))
            self.layers.append(DecoderLayer(
                attn_norm_D=new(f"{p}.input_layernorm.weight", D, dtype=dtype, device=device),
                attention=arch.make_attention(f"{p}.self_attn", self.slots, dtype=dtype, device=device),
                ffn_norm_D=new(f"{p}.post_attention_layernorm.weight", D, dtype=dtype, device=device),
                moe=moe, mlp=mlp,
            ))
        #: The EP group its MoE layers all-to-all on (a tuning="auto" DBORunner checks that its
        #: DP vote holds every rank of it); the layers' own, cached.
        self.ep_comm: EPComm = ep_comm(ep_group, max_ubatches=max_ubatches)
        self.final_norm_D = new("model.norm.weight", D, dtype=dtype, device=device)
        tied = bool(getattr(hf, "tie_word_embeddings", False))
        self.lm_head_VD = self.embed_VD if tied else new("lm_head.weight", V, D, dtype=dtype, device=device)
        self.rope = arch.rope()
        heads, head_dim, v_head_dim = self.layers[0].attention.kv_cache_dims
        self.kv_cache_config = KVCacheConfig(num_layers=len(self.layers), num_blocks=num_kv_blocks,
                                             block_size=block_size, num_heads=heads, head_dim=head_dim,
                                             v_head_dim=v_head_dim)
        self.kv_cache = PagedKVCache(self.kv_cache_config, dtype=dtype, device=device)

    def _moe(self, arch: Architecture, prefix: str, *, ep_group: Any, schedule: Schedule, max_ubatches: int,
             dtype: torch.dtype, device: Any) -> MoELayer:
        """A MoE layer with slots for the router, the correction bias, the shared experts and this
        rank's experts only."""
        cfg = arch.moe_config(schedule)
        if self.deterministic is not None:
            cfg = dataclasses.replace(cfg, deterministic=self.deterministic)
        layer = MoELayer(cfg, ep_group=ep_group, dtype=dtype, max_ubatches=max_ubatches,
                         name=prefix, init_weights=False).to(device)
        add_moe_slots(self.slots, prefix, layer, arch.expert_names)
        return layer

    # -- weights ---------------------------------------------------------------------------------

    def check_loaded(self, where: str) -> None:
        """Raise a ValueError naming the first tensors this rank needs that no loader filled."""
        missing = self.slots.missing()
        if missing:
            shown = ", ".join(repr(n) for n in missing[:3]) + (", ..." if len(missing) > 3 else "")
            raise ValueError(
                f"{where}: no tensor {missing[0]!r} ({len(missing)} of the {len(self.slots.names())} tensors "
                f"this rank needs are missing: {shown}); the checkpoint does not match its config.json"
            )

    # -- running ---------------------------------------------------------------------------------

    def with_fresh_cache(self) -> HFMoEModel:
        """The same weights (shared, not copied) with a new, empty KV cache: a second model for a
        second run over the same requests (serial vs DBO)."""
        twin = copy.copy(self)
        twin.kv_cache = PagedKVCache(self.kv_cache_config, dtype=self.kv_cache.k_cache_LNZHK[0].dtype,
                                     device=self.kv_cache.k_cache_LNZHK[0].device)
        return twin

    def compile_segments(self, **compile_kwargs: Any) -> None:
        """``torch.compile`` every synchronous piece between the forward's awaits, the MoE layers'
        included (router and expert MLPs); the awaits, the comm and the attention's gathers (slot
        tables built from host-side lengths) stay eager.  Shared with twins from :meth:`with_fresh_cache`."""
        self.segments = self.segments.compiled(**compile_kwargs)
        for layer in self.layers:
            if layer.moe is not None:
                layer.moe.compile_segments(**compile_kwargs)

    async def forward(self, input_ids_T: torch.Tensor, positions_T: torch.Tensor,
                      attn: AttentionMetadata) -> torch.Tensor:
        """Logits ``[T, V]`` of a (u)batch; rows past ``attn.num_actual_tokens`` are padding
        (they join the MoE collectives, write no K/V, and their logits are meaningless)."""
        if input_ids_T.shape[0] != positions_T.shape[0]:
            raise ValueError(
                f"input_ids has {input_ids_T.shape[0]} tokens but positions has {positions_T.shape[0]}; "
                f"pass one position per token"
            )
        if input_ids_T.shape[0] < attn.num_actual_tokens:
            raise ValueError(
                f"the attention metadata covers {attn.num_actual_tokens} tokens but only "
                f"{input_ids_T.shape[0]} were given"
            )
        check_token_ids(input_ids_T, self.embed_VD.shape[0])
        seg, eps, layers, tile = self.segments, self.eps, self.layers, self.tile
        x_TD = self.embed_VD[input_ids_T]
        rope_TK = self.rope.tables(positions_T, x_TD.dtype)
        h_TD = seg.rms_norm(x_TD, layers[0].attn_norm_D, eps)
        for i, layer in enumerate(layers):
            # exact_tap: named tensors an exact check compares (a no-op outside one)
            a_TD = exact_tap("attn", await layer.attention.forward(self, i, h_TD, positions_T, rope_TK, attn), layer=i)
            x_TD, h_TD = seg.residual_norm(x_TD, a_TD, layer.ffn_norm_D, eps)
            exact_tap("attn_residual", x_TD, layer=i)
            if layer.moe is not None:
                f_TD = exact_tap("moe", await layer.moe.forward(h_TD), layer=i)
            else:
                assert layer.mlp is not None
                f_TD = exact_tap("mlp", seg.mlp(h_TD, *layer.mlp, tile), layer=i)
            next_norm_D = layers[i + 1].attn_norm_D if i + 1 < len(layers) else self.final_norm_D
            x_TD, h_TD = seg.residual_norm(x_TD, f_TD, next_norm_D, eps)
            exact_tap("residual", x_TD, layer=i)
        return lm_head(h_TD, attn, self.logits, self.lm_head_VD.shape[0],
                       lambda h: seg.linear(h, self.lm_head_VD, None, tile))


#: A fused expert tensor's name (transformers 5's in-memory layout).
FUSED_EXPERTS = re.compile(r"^(?P<prefix>.*\.experts)\.(?P<which>gate_up_proj|down_proj)$")


def add_moe_slots(slots: WeightSlots, prefix: str, layer: MoELayer, expert_names: tuple[str, str, str]) -> None:
    """Slots for a MoE layer's checkpoint tensors under ``prefix``: the router, its correction
    bias, this rank's experts only (``expert_names``: the gate, up and down projections' names)
    and the shared experts."""
    add = slots.add
    add(f"{prefix}.gate.weight", layer.router_ED.data)
    if layer.bias_E is not None:
        add(f"{prefix}.gate.e_score_correction_bias", layer.bias_E)
    g, u, d = expert_names
    for local, expert in enumerate(range(layer.first_expert, layer.first_expert + layer.experts_per_rank)):
        add(f"{prefix}.experts.{expert}.{g}.weight", layer.gate_LFD.data[local])
        add(f"{prefix}.experts.{expert}.{u}.weight", layer.up_LFD.data[local])
        add(f"{prefix}.experts.{expert}.{d}.weight", layer.down_LDF.data[local])
    if layer.shared_gate_SD is not None:
        assert layer.shared_up_SD is not None and layer.shared_down_DS is not None
        add(f"{prefix}.shared_experts.gate_proj.weight", layer.shared_gate_SD.data)
        add(f"{prefix}.shared_experts.up_proj.weight", layer.shared_up_SD.data)
        add(f"{prefix}.shared_experts.down_proj.weight", layer.shared_down_DS.data)


def hub_layout(arch: Architecture, state_dict: Mapping[str, torch.Tensor]) -> Iterator[tuple[str, torch.Tensor]]:
    """``(checkpoint name, tensor)`` of a transformers 5 in-memory state dict: fused experts
    (``gate_up_proj`` E x 2F x D, gate rows first; ``down_proj`` E x D x F) split per expert,
    names mapped to the checkpoint's (:meth:`Architecture.hub_name`).  Already split names pass."""
    g, u, d = arch.expert_names
    for name, tensor in state_dict.items():
        name = arch.hub_name(name)
        m = FUSED_EXPERTS.match(name)
        if m is None:
            yield name, tensor
            continue
        prefix = m["prefix"]
        for expert in range(tensor.shape[0]):
            if m["which"] == "down_proj":
                yield f"{prefix}.{expert}.{d}.weight", tensor[expert]
            else:
                half = tensor.shape[1] // 2
                yield f"{prefix}.{expert}.{g}.weight", tensor[expert, :half]
                yield f"{prefix}.{expert}.{u}.weight", tensor[expert, half:]
