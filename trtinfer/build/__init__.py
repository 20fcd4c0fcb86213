"""Build stage: MODEL -> engine directory for a backend."""
from trtinfer.build.backends import get_build_backend, register_build_backend
from trtinfer.build.config import BuildConfig
from trtinfer.build.engine_builder import build

__all__ = ["BuildConfig", "build", "get_build_backend", "register_build_backend"]
