"""Loading a model from command-line style options: shared by the CLI, the server and the GUI
entry points, so that none of them imports another's private helpers."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from . import registry

if TYPE_CHECKING:  # pragma: no cover
    from .runtime import Model

# option name on the namespace -> keyword of minirt.load
_OPTIONS = {"ctx": "n_ctx", "threads": "threads", "device": "device", "backend": "backend",
            "cache_type_k": "cache_type_k", "cache_type_v": "cache_type_v"}


def load_options(args: Any, progress: Callable[[int, int], None] | None = None, **overrides: Any) -> dict[str, Any]:
    """Keyword arguments of :func:`minirt.load` from a namespace with optional ``ctx``,
    ``threads``, ``device``, ``backend``, cache types, ``lora`` and ``lora_scaled`` attributes
    (unset or None: the library's default); ``progress`` reports a pull, ``overrides`` win over
    everything."""
    opts: dict[str, Any] = {} if progress is None else {"progress": progress}
    for attr, kw in _OPTIONS.items():
        v = getattr(args, attr, None)
        if v:
            opts[kw] = v
    lora = [(f, 1.0) for f in getattr(args, "lora", None) or []]
    for f, scale in getattr(args, "lora_scaled", None) or []:
        try:
            lora.append((f, float(scale)))
        except ValueError:
            from .errors import InvalidRequestError

            raise InvalidRequestError(f"--lora-scaled {f}: the scale must be a number, got {scale!r}") from None
    if lora:
        opts["lora"] = lora
    opts.update(overrides)
    return opts


def model_name(args: Any) -> str:
    """The registry name or GGUF path of ``args.model``, or the registry's default model."""
    return getattr(args, "model", None) or registry.DEFAULT_MODEL


def load_from_args(args: Any, progress: Callable[[int, int], None] | None = None, **overrides: Any) -> Model:
    """``minirt.load`` of the model and options a namespace names (see :func:`load_options`)."""
    import minirt

    return minirt.load(model_name(args), **load_options(args, progress, **overrides))


__all__ = ["load_from_args", "load_options", "model_name"]
