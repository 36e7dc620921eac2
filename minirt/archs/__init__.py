"""Model architectures: one file each on the shared layers of :mod:`minirt.archs.base`."""

from .base import ARCHITECTURES, Config, Segment, Transformer, build, read_config

__all__ = ["ARCHITECTURES", "Config", "Segment", "Transformer", "build", "read_config"]
