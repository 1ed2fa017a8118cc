"""What a prediction models: the model (:class:`ModelShape`, from a real architecture's published
config) and where it runs (:class:`Deployment`). See :mod:`asyncdbo.sim.predict`."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from collections.abc import Mapping
from typing import Any, Literal, Union

from ..backends import LinkSpec, link_spec
from .comm import CommSpec, comm_spec
from .devices import DeviceSpec, device_spec
from .host import HostSpec, host_spec
from .models import architecture_config

#: The MoEConfig fields a Deployment may set on every MoE layer (``Deployment.moe``).
MOE_OPTIONS = ("deterministic", "sync_free", "yield_after_route")
#: ``Deployment.moe``: a mapping, or (name, value) pairs (what it keeps: sorted pairs, hashable).
MoEOptions = Union[Mapping[str, Any], tuple[tuple[str, Any], ...]]

__all__ = ["WEIGHT_BYTES", "Deployment", "ModelShape", "Request", "Shape"]

Shape = Literal["decode", "prefill"]
Request = tuple[int, int]  # (new tokens this step, tokens already in the KV cache)
WEIGHT_BYTES = {"bf16": 2, "fp8": 1, "int8": 1}


@dataclass(frozen=True, kw_only=True)
class ModelShape:
    """The modeled model: its MoE layer, its attention and its weight format. Build one from a
    real architecture with :meth:`of` (``deepseek-v3``, ``mixtral``, ``qwen3-moe``)."""

    name: str
    hidden: int
    intermediate: int  # per expert
    experts: int
    top_k: int
    shared_experts: int = 0
    attention: Literal["mla", "gqa"] = "gqa"
    heads: int = 16
    kv_heads: int = 16
    head_dim: int = 128  # GQA; MLA: qk_nope_head_dim
    v_head_dim: int = 128
    q_lora_rank: int = 0
    kv_lora_rank: int = 0
    rope_dim: int = 0
    weights: str = "bf16"
    layers: int = 3
    routing: dict[str, Any] = field(default_factory=dict, compare=False)  # MoEConfig routing fields

    def __post_init__(self) -> None:
        for f in ("hidden", "intermediate", "experts", "top_k", "heads", "kv_heads", "head_dim", "layers"):
            v = getattr(self, f)
            if not isinstance(v, int) or v < 1:
                raise ValueError(f"ModelShape.{f} must be an integer >= 1 (got {v!r})")
        if self.weights not in WEIGHT_BYTES:
            raise ValueError(f"ModelShape.weights must be one of {sorted(WEIGHT_BYTES)} (got {self.weights!r})")
        if self.heads % self.kv_heads:
            raise ValueError(f"ModelShape: heads ({self.heads}) must be a multiple of kv_heads ({self.kv_heads})")

    @classmethod
    def of(cls, name: str, **overrides: Any) -> ModelShape:
        """The shape of a real architecture (its published config), with fields overridden."""
        arch, hf = architecture_config(name)
        moe = arch.moe_config("ht")
        routing = dict(scoring=moe.scoring, norm_topk_prob=moe.norm_topk_prob, n_group=moe.n_group,
                       topk_group=moe.topk_group, routed_scaling_factor=moe.routed_scaling_factor)
        common = dict(name=name, hidden=moe.hidden_size, intermediate=moe.intermediate_size, experts=moe.num_experts,
                      top_k=moe.top_k, shared_experts=moe.num_shared_experts, heads=hf.num_attention_heads,
                      weights=hf.weights, routing=routing)
        if name == "deepseek-v3":
            shape = cls(attention="mla", kv_heads=1, head_dim=hf.qk_nope_head_dim, v_head_dim=hf.v_head_dim,
                        q_lora_rank=hf.q_lora_rank, kv_lora_rank=hf.kv_lora_rank, rope_dim=hf.qk_rope_head_dim,
                        **common)
        else:
            shape = cls(attention="gqa", kv_heads=hf.num_key_value_heads, head_dim=hf.head_dim,
                        v_head_dim=hf.head_dim, **common)
        return shape.with_overrides(**overrides)

    def with_overrides(self, **kw: Any) -> ModelShape:
        """This shape with the fields in ``kw`` that are not None replaced; routing fields that no
        longer fit (groups that do not divide the experts) fall back to plain top-k."""
        new = replace(self, **{k: v for k, v in kw.items() if v is not None})
        r = dict(new.routing)
        if r.get("n_group", 1) > 1 and (new.experts % r["n_group"] or new.top_k > r["topk_group"] * (new.experts // r["n_group"])
                                        or new.experts // r["n_group"] < 2):
            r.update(n_group=1, topk_group=1)
        return replace(new, routing=r)

    def moe_config(self, schedule: str, options: MoEOptions = ()) -> Any:
        """The MoEConfig of one layer of this shape, with ``options`` (``Deployment.moe``) set."""
        from ..moe import MoEConfig

        return MoEConfig(hidden_size=self.hidden, intermediate_size=self.intermediate, num_experts=self.experts,
                         top_k=self.top_k, num_shared_experts=self.shared_experts, schedule=schedule,  # type: ignore[arg-type]
                         **self.routing, **dict(options))

    def describe(self) -> str:
        att = (f"MLA {self.heads} heads (latent {self.kv_lora_rank}+{self.rope_dim})" if self.attention == "mla"
               else f"GQA {self.heads}/{self.kv_heads} heads of {self.head_dim}")
        return (f"{self.name}: hidden {self.hidden}, {self.experts} experts of {self.intermediate} (top-{self.top_k}, "
                f"{self.shared_experts} shared), {att}, {self.weights} weights, {self.layers} MoE layers simulated")


@dataclass(frozen=True, kw_only=True)
class Deployment:
    """Where the model runs. ``schedule``/``host`` None: what deployments use for the shape
    (decode: ``ll`` with CUDA-graph replay; prefill: ``ht``, eager). ``comm``: ``deepep`` (the
    kernels the published numbers used) or ``a2a`` (plain collectives, what the library issues).
    ``imbalance``: the busiest EP rank's expert work over the mean (1.0: balanced). ``moe``:
    options of every MoE layer (:class:`~asyncdbo.moe.MoEConfig` fields other than its shape,
    routing and schedule, e.g. ``{"yield_after_route": True}``), so a schedule step added as a
    layer option is race-checked as it is (``asyncdbo check --moe NAME=VALUE``)."""

    device: str | DeviceSpec = "h200"
    link: str | LinkSpec = "ib400"
    comm: str | CommSpec = "deepep"
    host: str | HostSpec | None = None
    ep: int = 32
    gpus_per_node: int = 8
    schedule: str | None = None
    imbalance: float = 1.0
    contention: bool = True
    moe: MoEOptions = ()


    def __post_init__(self) -> None:
        if self.ep < 1 or self.gpus_per_node < 1:
            raise ValueError(f"Deployment: ep ({self.ep}) and gpus_per_node ({self.gpus_per_node}) must be >= 1")
        if self.schedule not in (None, "ht", "ll"):
            raise ValueError(f"Deployment.schedule must be 'ht' or 'll' (got {self.schedule!r})")
        options = dict(self.moe)  # a mapping or (name, value) pairs; kept as sorted pairs (hashable)
        unknown = sorted(set(options) - set(MOE_OPTIONS))
        if unknown:
            raise ValueError(f"Deployment.moe: {unknown[0]!r} is not a MoE layer option; choose from {MOE_OPTIONS} "
                             "(the shape and routing come from the model, the schedule from Deployment.schedule)")
        object.__setattr__(self, "moe", tuple(sorted(options.items())))

    def resolved(self, shape: Shape) -> Deployment:
        return replace(
            self, device=device_spec(self.device), link=link_spec(self.link), comm=comm_spec(self.comm),
            host=host_spec(self.host if self.host is not None else ("graph" if shape == "decode" else "eager")),
            schedule=self.schedule or ("ll" if shape == "decode" else "ht"),
        )
