"""Export stage: HF model -> validated ONNX graph with KV-cache inputs and outputs."""
from trtinfer.export.architectures import ArchSpec, register, supported_model_types
from trtinfer.export.config import ExportConfig
from trtinfer.export.onnx_export import ExportResult, export, export_cached
from trtinfer.export.sources import ALIASES, ResolvedModel, resolve_model

__all__ = ["ALIASES", "ArchSpec", "ExportConfig", "ExportResult", "ResolvedModel", "export", "export_cached",
           "register", "resolve_model", "supported_model_types"]
