"""Serving: continuous batching over the runtime (``scheduler``), an OpenAI-compatible HTTP server (``app``), scale-out
on Ray Serve and a Triton model repository. Everything here runs without torch, transformers or onnx."""
