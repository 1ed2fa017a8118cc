"""The dense architectures a tensor-parallel model is built from: Llama (``LlamaForCausalLM``,
Llama-3's rope scaling included) and Qwen3 (``Qwen3ForCausalLM``: per-head RMSNorm on queries and
keys before RoPE, an explicit ``head_dim``).  Both are RMSNorm -> GQA -> residual -> RMSNorm ->
SwiGLU MLP -> residual; what differs is the q/k norms and the checkpoint's defaults.
"""

from __future__ import annotations

from typing import Any, ClassVar

from ..hf.common import Rope, rope_from_hf

__all__ = ["DENSE_ARCHITECTURES", "DenseArchitecture", "Llama", "Qwen3", "dense_architecture",
           "dense_architecture_for"]


class DenseArchitecture:
    """How one transformers dense architecture maps onto :class:`~asyncdbo.models.tp.TPDenseModel`;
    built from its config, refusing (ValueError naming the setting) what the model does not run."""

    name: ClassVar[str]  # the CLI name
    model_type: ClassVar[str]  # transformers' config.model_type
    hf_class: ClassVar[str]
    qk_norm: ClassVar[bool] = False

    def __init__(self, hf_config: Any) -> None:
        if getattr(hf_config, "model_type", None) != self.model_type:
            raise ValueError(f"{self.name} needs a {self.model_type!r} config, got model_type "
                             f"{getattr(hf_config, 'model_type', None)!r}; pick the architecture the checkpoint was "
                             "saved as")
        self.hf = hf_config
        self.check()

    def check(self) -> None:
        hf = self.hf
        if getattr(hf, "hidden_act", "silu") != "silu":
            raise ValueError(f"{self.name}: hidden_act={hf.hidden_act!r} is not supported (SwiGLU MLPs only)")
        if getattr(hf, "mlp_bias", False):
            raise ValueError(f"{self.name}: mlp_bias=True is not supported (bias-free MLPs only)")
        if getattr(hf, "use_sliding_window", False) or (getattr(hf, "sliding_window", None) is not None
                                                         and self.model_type == "llama"):
            raise ValueError(f"{self.name}: sliding-window attention is not supported (full causal attention only)")
        if getattr(hf, "quantization_config", None):
            raise ValueError(f"{self.name}: quantized checkpoints are not supported; use a bf16/fp32 one")

    @property
    def head_dim(self) -> int:
        return int(getattr(self.hf, "head_dim", None) or self.hf.hidden_size // self.hf.num_attention_heads)

    def rope(self) -> Rope:
        return rope_from_hf(self.hf, self.head_dim)

    @classmethod
    def tiny_config(cls, **overrides: Any) -> Any:
        """A tiny transformers config of this architecture (tests, the demo without weights)."""
        raise NotImplementedError


#: The tiny configs' shared sizes: 8 query heads and 4 KV heads divide over 1, 2 and 4 ranks (and
#: 8 ranks share the KV heads); vocab 96 and intermediate 64 divide too.
TINY: dict[str, Any] = dict(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                            num_attention_heads=8, num_key_value_heads=4, head_dim=8, max_position_embeddings=4096)


class Llama(DenseArchitecture):
    name = "llama"
    model_type = "llama"
    hf_class = "LlamaForCausalLM"

    @classmethod
    def tiny_config(cls, **overrides: Any) -> Any:
        from transformers import LlamaConfig

        # Llama-3's rope scaling, over a short original context so that it changes the tables
        kw: dict[str, Any] = dict(TINY, rope_parameters={
            "rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 64})
        return LlamaConfig(**{**kw, **overrides})


class Qwen3(DenseArchitecture):
    name = "qwen3"
    model_type = "qwen3"
    hf_class = "Qwen3ForCausalLM"
    qk_norm = True

    @classmethod
    def tiny_config(cls, **overrides: Any) -> Any:
        from transformers import Qwen3Config

        # head_dim 16 with hidden 32 / 8 heads: the explicit head_dim is what counts
        kw: dict[str, Any] = dict(TINY, head_dim=16, rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
        return Qwen3Config(**{**kw, **overrides})


#: CLI name -> dense architecture class.
DENSE_ARCHITECTURES: dict[str, type[DenseArchitecture]] = {cls.name: cls for cls in (Llama, Qwen3)}


def dense_architecture(name: str) -> type[DenseArchitecture]:
    try:
        return DENSE_ARCHITECTURES[name]
    except KeyError:
        raise ValueError(f"unknown dense model {name!r}; use one of {', '.join(DENSE_ARCHITECTURES)}") from None


def dense_architecture_for(hf_config: Any) -> DenseArchitecture:
    model_type = getattr(hf_config, "model_type", None)
    for cls in DENSE_ARCHITECTURES.values():
        if cls.model_type == model_type:
            return cls(hf_config)
    raise ValueError(f"model_type {model_type!r} is not a supported dense architecture; supported: "
                     + ", ".join(f"{c.model_type} ({c.hf_class})" for c in DENSE_ARCHITECTURES.values()))
