"""The supported architectures by name, and building a model from an in-memory transformers one."""

from __future__ import annotations

from typing import Any

from .deepseek_v3 import DeepseekV3
from .mixtral import Mixtral
from .model import Architecture, HFMoEModel, hub_layout
from .qwen3_moe import Qwen3Moe

__all__ = ["ARCHITECTURES", "architecture", "architecture_for", "from_hf_model"]

#: CLI name -> architecture class.
ARCHITECTURES: dict[str, type[Architecture]] = {cls.name: cls for cls in (Mixtral, Qwen3Moe, DeepseekV3)}


def architecture(name: str) -> type[Architecture]:
    """The architecture class of a CLI name (``mixtral``, ``qwen3-moe``, ``deepseek-v3``)."""
    try:
        return ARCHITECTURES[name]
    except KeyError:
        raise ValueError(f"unknown model {name!r}; use one of {', '.join(ARCHITECTURES)}") from None


def architecture_for(hf_config: Any) -> Architecture:
    """The :class:`Architecture` for a transformers config, chosen by its ``model_type``."""
    model_type = getattr(hf_config, "model_type", None)
    for cls in ARCHITECTURES.values():
        if cls.model_type == model_type:
            return cls(hf_config)
    raise ValueError(
        f"model_type {model_type!r} is not supported; supported: "
        + ", ".join(f"{c.model_type} ({c.hf_class})" for c in ARCHITECTURES.values())
    )


def from_hf_model(hf_model: Any, **kwargs: Any) -> HFMoEModel:
    """This rank's :class:`HFMoEModel` with the weights of an in-memory transformers causal LM of
    a supported architecture (each rank keeps its own experts).  ``kwargs`` go to
    :class:`HFMoEModel`; with EP size > 1 every rank calls it at the same time."""
    arch = architecture_for(hf_model.config)
    model = HFMoEModel(arch, **kwargs)
    where = f"the state dict of {type(hf_model).__name__}"
    model.slots.fill_all(hub_layout(arch, hf_model.state_dict()), origin=where)
    model.check_loaded(where)
    return model
