"""Write docs/reference.md from the code: every name in each documented module's ``__all__``, its
signature and the first paragraph of its docstring. Run ``python docs/make_reference.py``; the
test suite fails when the file is stale."""

from __future__ import annotations

import re
from typing import Any
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

MODULES: list[tuple[str, str]] = [
    ("asyncdbo", "The top-level API: entry points, the DBO primitives and extensions, options, errors."),
    ("asyncdbo.dbo", "The DBO layer."),
    ("asyncdbo.lowlevel", "The kernel, for tool and backend writers."),
    ("asyncdbo.backends", "Stream backends."),
    ("asyncdbo.backends.host", "The CPU backend."),
    ("asyncdbo.backends.accelerator", "CUDA / NPU / XPU backend."),
    ("asyncdbo.syncs", "Host syncs: the ops that would make the host wait for an accelerator."),
    ("asyncdbo.dist", "torch.distributed for DBO."),
    ("asyncdbo.dist.ep", "Expert-parallel all-to-all through the stream backend."),
    ("asyncdbo.dist.tp", "Tensor-parallel all-reduce, all-gather and reduce-scatter through the stream backend."),
    ("asyncdbo.plan", "Planning a step: thresholds, DP vote, splits, metadata, records."),
    ("asyncdbo.moe", "The MoE layer."),
    ("asyncdbo.moe.hf", "Hugging Face MoE blocks as asyncdbo layers."),
    ("asyncdbo.serving", "Plan, run, merge: the overlapped step runner."),
    ("asyncdbo.models", "The reference model."),
    ("asyncdbo.models.hf", "Hugging Face MoE architectures under DBO."),
    ("asyncdbo.models.hf.checkpoint", "Local checkpoint loading."),
    ("asyncdbo.models.hf.generate", "Greedy generation and parity with transformers."),
    ("asyncdbo.models.hf.real_dims", "The architectures at their released width, and random Hub-layout checkpoints."),
    ("asyncdbo.models.hf.memory", "A rank's memory, estimated from the config before loading."),
    ("asyncdbo.models.tp", "Dense Hugging Face architectures (Llama, Qwen3), tensor-parallel under DBO."),
    ("asyncdbo.observe", "Observing runs."),
    ("asyncdbo.sim", "The simulated device."),
    ("asyncdbo.sim.backend", "The simulated-device backend."),
    ("asyncdbo.sim.dense_tp", "A first analytical prediction of dense tensor-parallel DBO."),
    ("asyncdbo.testing", "Test helpers."),
]


def _first_para(obj: object) -> str:
    import inspect

    doc = inspect.getdoc(obj) or ""
    return " ".join(doc.split("\n\n")[0].split())


def _sig(name: str, obj: object) -> str:
    import inspect

    try:
        s = re.sub(r" at 0x[0-9a-f]+", "", str(inspect.signature(obj)))  # type: ignore[arg-type]
    except (TypeError, ValueError):
        return name
    return f"{name}{s}"


def _sig_lines(name: str, obj: object) -> list[str]:
    """The whole signature, one parameter a line (for those too long for one line)."""
    import inspect

    sig = inspect.signature(obj)  # type: ignore[arg-type]
    params, seen_kw = [], False
    for p in sig.parameters.values():
        if p.kind is p.KEYWORD_ONLY and not seen_kw:
            params.append("*")
        seen_kw = seen_kw or p.kind in (p.KEYWORD_ONLY, p.VAR_POSITIONAL)
        params.append(re.sub(r" at 0x[0-9a-f]+", "", str(p)))
    ret = "" if sig.return_annotation is sig.empty or inspect.isclass(obj) else " -> " + re.sub(
        r" at 0x[0-9a-f]+", "", inspect.formatannotation(sig.return_annotation))
    return [f"{name}(", *(f"    {p}," for p in params), f"){ret}"]


def generate_reference() -> str:
    """Every name in each module's ``__all__``: signature, first docstring paragraph, and for
    classes their public methods and properties."""
    import importlib
    import inspect

    out = [
        "# API reference",
        "",
        "Every public name, with its signature and the first paragraph of its docstring (generated from the",
        "code with `inspect` by `python docs/make_reference.py`; the docstrings hold the rest).",
        "`tests/docs/test_docs_examples.py` checks that it is up to date.",
        "",
        "Modules: " + ", ".join(f"[`{m}`](#{m.replace('.', '')})" for m, _ in MODULES) + ".",
        "",
    ]
    for modname, blurb in MODULES:
        mod = importlib.import_module(modname)
        out += [f"## {modname}", "", f"{blurb} {_first_para(mod)}", ""]
        for n in getattr(mod, "__all__", ()):
            obj = getattr(mod, n)
            if inspect.isclass(obj):
                kind, header = "class", _sig(n, obj)
            elif callable(obj):
                kind = "async function" if inspect.iscoroutinefunction(obj) else "function"
                header = _sig(n, obj)
            else:
                r = re.sub(r" at 0x[0-9a-f]+", "", repr(obj))  # no memory addresses in the docs
                kind, header = "constant", n + (" = " + r if len(r) < 80 else "")
            if len(header) > 100 and kind != "constant":
                out += [f"### `{modname}.{n}`", "", f"{kind}:", "", "```", *_sig_lines(n, obj), "```", ""]
            else:
                out += [f"### `{modname}.{n}`", "", f"{kind}: `{header}`", ""]
            para = _first_para(obj) if kind != "constant" else ""
            if para:
                out += [para, ""]
            if inspect.isclass(obj):
                members = []
                for mn, mv in _own_members(obj):
                    f = mv.fget if isinstance(mv, property) else getattr(mv, "__func__", mv)
                    d = _first_para(f)
                    label = mn if isinstance(mv, property) else _sig(mn, f)
                    members.append(f"- `{label}`" + (f": {d}" if d else ""))
                if members:
                    out += [*members, ""]
    return "\n".join(out) + "\n"


def _own_members(cls: type) -> list[tuple[str, Any]]:
    """The public methods and properties of ``cls``, with those it inherits from the kernel's
    private base classes (``DBORun`` is built from ``Parking`` and ``Endings``, which the reference
    does not list), in MRO order, each name once."""
    import asyncdbo._core as core

    seen: dict[str, Any] = {}
    for base in cls.__mro__:
        if base is not cls and (not base.__module__.startswith("asyncdbo._core.") or base.__name__ in core.__all__):
            continue
        for mn, mv in vars(base).items():
            if mn.startswith("_") or mn in seen:
                continue
            if callable(mv) or isinstance(mv, (property, classmethod, staticmethod)):
                seen[mn] = mv
    return list(seen.items())


if __name__ == "__main__":
    (ROOT / "docs" / "reference.md").write_text(generate_reference())
    print(f"wrote {ROOT / 'docs' / 'reference.md'}")
