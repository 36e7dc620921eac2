"""Typed errors raised by minirt.

Every failure a caller can cause (a bad file, a bad argument, a full cache) raises a subclass of
:class:`MinirtError` whose message names the problem. Subclasses also derive from the matching
builtin (``ValueError``, ``RuntimeError`` ...) so generic handlers keep working.
"""

from __future__ import annotations


class MinirtError(Exception):
    """Base class of every error minirt raises on purpose."""


class GGUFError(MinirtError, ValueError):
    """A GGUF file is malformed, truncated or inconsistent (the message names field and byte offset)."""


class UnsupportedQuantError(MinirtError, NotImplementedError):
    """A tensor uses a quantization type minirt cannot compute with (the message names it)."""


class UnsupportedArchitectureError(MinirtError, ValueError):
    """The GGUF's ``general.architecture`` has no implementation here."""


class TokenizerError(MinirtError, ValueError):
    """Tokenizer metadata is missing or inconsistent, or a token id is out of range."""


class TemplateError(MinirtError, ValueError):
    """A chat template failed to render, was unsafe, or took too long."""


class InvalidRequestError(MinirtError, ValueError):
    """A request argument is invalid (bad sampling value, empty prompt, max_tokens <= 0 ...)."""


class GrammarError(InvalidRequestError):
    """A grammar, JSON schema, regex or ``response_format`` is invalid, or the grammar engine
    cannot constrain this request (the message names the problem)."""


class EmbeddingError(InvalidRequestError):
    """An embedding or rerank request the model cannot serve: no pooling in the file (a generative
    model), embed() on a reranker, rerank() on an embedding model, generation on an encoder."""


class ContextOverflowError(MinirtError, ValueError):
    """A prompt does not fit in the context window."""


class CapacityError(MinirtError, RuntimeError):
    """The KV-cache budget and the waiting queue are full: the request is refused.

    ``retryable`` is True when waiting may help (busy) and False when the request can never fit
    the budget (lower max_tokens or raise the budget).
    """

    def __init__(self, message: str, retryable: bool = True) -> None:
        super().__init__(message)
        self.retryable = retryable


class ModelNotFoundError(MinirtError, LookupError):
    """A request names a model the server does not serve (several-model server)."""


class ModelClosedError(MinirtError, RuntimeError):
    """The model was closed; load it again to use it."""


class RegistryError(MinirtError, RuntimeError):
    """A model name is unknown, or pulling / verifying its file failed."""


class StateError(MinirtError, ValueError):
    """A saved state file does not belong to this model or this version of minirt."""


class BackendError(MinirtError, RuntimeError):
    """A compute backend (native, numba, cuda) is unavailable or failed."""


__all__ = [
    "MinirtError",
    "GGUFError",
    "UnsupportedQuantError",
    "UnsupportedArchitectureError",
    "TokenizerError",
    "TemplateError",
    "InvalidRequestError",
    "GrammarError",
    "ContextOverflowError",
    "CapacityError",
    "ModelNotFoundError",
    "ModelClosedError",
    "RegistryError",
    "StateError",
    "BackendError",
]
