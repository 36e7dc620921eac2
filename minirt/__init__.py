"""minirt: an embeddable, llama.cpp-style quantized LLM runtime.

``minirt.load(name_or_path)`` returns a :class:`Model`; ``minirt.gguf.open(path)`` reads a GGUF
file. Nothing heavy (numba compilation, CuPy, native code) is imported here: backends load on
first use.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from . import gguf
from .errors import (
    BackendError,
    CapacityError,
    ContextOverflowError,
    EmbeddingError,
    GGUFError,
    GrammarError,
    InvalidRequestError,
    MinirtError,
    ModelClosedError,
    ModelNotFoundError,
    RegistryError,
    StateError,
    TemplateError,
    TokenizerError,
    UnsupportedArchitectureError,
    UnsupportedQuantError,
)

__version__ = "0.1.0"

if TYPE_CHECKING:  # pragma: no cover
    from .runtime import Model


def load(model: str, **kwargs: Any) -> Model:
    """Load a model by registry name or GGUF path; see :class:`minirt.runtime.Model` for options."""
    from .runtime import Model

    return Model(model, **kwargs)


def __getattr__(name: str) -> Any:
    if name == "Model":
        from .runtime import Model

        return Model
    raise AttributeError(f"module 'minirt' has no attribute {name!r}")


__all__ = [
    "load",
    "Model",
    "gguf",
    "__version__",
    "MinirtError",
    "GGUFError",
    "EmbeddingError",
    "UnsupportedQuantError",
    "UnsupportedArchitectureError",
    "TokenizerError",
    "TemplateError",
    "InvalidRequestError",
    "GrammarError",
    "ContextOverflowError",
    "CapacityError",
    "ModelClosedError",
    "ModelNotFoundError",
    "RegistryError",
    "StateError",
    "BackendError",
]
