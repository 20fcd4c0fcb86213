"""Build stage: MODEL -> engine directory for a backend."""
from trtinfer.builder.backends import get_build_backend, register_build_backend
from trtinfer.builder.config import BuildConfig
from trtinfer.builder.engine_builder import build

__all__ = ["BuildConfig", "build", "get_build_backend", "register_build_backend"]
