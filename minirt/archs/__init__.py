"""Model architectures: one file each, turning a GGUF's metadata and tensors into a
:class:`minirt.blocks.ModelDesc` with the helpers of :mod:`minirt.archs.base`."""

from .base import (
    ARCHITECTURES,
    Segment,
    Transformer,
    build,
    describe,
    read_config,
    supported,
)

__all__ = ["ARCHITECTURES", "Segment", "Transformer", "build", "describe", "read_config", "supported"]
