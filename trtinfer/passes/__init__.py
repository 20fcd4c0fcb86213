"""Graph passes: cleanup, target-aware fusions, KV layout and precision, run as named pipelines per target.

``optimize(IN.onnx, OUT.onnx, PassConfig(target=...))`` runs one pipeline and returns a :class:`FusionReport`;
``trtinfer build`` runs the pipeline of its backend/target before packaging the engine.
"""
from trtinfer.passes.config import TARGETS, PassConfig
from trtinfer.passes.optimize import optimize, optimize_model
from trtinfer.passes.registry import PIPELINES, PassContext, get_pipeline, register_pass
from trtinfer.passes.report import FusionReport

__all__ = ["PIPELINES", "TARGETS", "FusionReport", "PassConfig", "PassContext", "get_pipeline", "optimize",
           "optimize_model", "register_pass"]
