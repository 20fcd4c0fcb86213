"""Triton Python-backend model written by ``trtinfer triton``: a trtinfer engine, its text streamed per delta.

Copied as ``model.py`` into the version folder, next to ``engine/`` (the engine directory). Decoupled: a request
gets one response per text delta (``stream`` true, the default) or one with the whole text (``stream`` false), then
an empty response flagged ``TRITONSERVER_RESPONSE_COMPLETE_FINAL``; a bad request gets one error response.
Requests run one after another within an instance; ``instance_group.count`` instances run side by side, each with
its own copy of the engine. Triton's Python environment needs the trtinfer runtime (``pip install trtinfer``): no
torch, no transformers. The request logic is :mod:`trtinfer.serving.triton`'s ``parse_request`` and
``response_texts``; this file only moves tensors between Triton and them.
"""
import json
from pathlib import Path

import triton_python_backend_utils as pb_utils

import trtinfer
from trtinfer.serving.triton import ENGINE_FOLDER, INPUT_NAMES, parse_request, response_texts, text_tensor


class TritonPythonModel:
    """Loads the engine once per instance; answers each request with a stream of ``text_output`` responses."""

    def initialize(self, args):
        """Load ``<version folder>/engine`` with the provider named in config.pbtxt's parameters."""
        config = json.loads(args["model_config"])
        params = {k: v.get("string_value", "") for k, v in config.get("parameters", {}).items()}
        folder = Path(args["model_repository"]) / args["model_version"] / ENGINE_FOLDER
        device = int(args.get("model_instance_device_id") or 0)
        self.engine = trtinfer.load(folder, provider=params.get("provider", "cpu"), device_id=device)

    def execute(self, requests):
        """Generate for each request in turn, sending its responses as the text arrives; returns None (decoupled)."""
        final = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL
        for request in requests:
            sender = request.get_response_sender()
            try:
                inputs = {}
                for name in INPUT_NAMES:
                    tensor = pb_utils.get_input_tensor_by_name(request, name)
                    if tensor is not None:
                        inputs[name] = tensor.as_numpy()
                parsed = parse_request(inputs, self.engine.generation_defaults,
                                       self.engine.generation_defaults_set)
                for text in response_texts(self.engine, parsed):
                    out = pb_utils.Tensor("text_output", text_tensor(text))
                    sender.send(pb_utils.InferenceResponse(output_tensors=[out]))
            except Exception as e:  # noqa: BLE001 - the client gets the error; the instance keeps serving
                sender.send(pb_utils.InferenceResponse(error=pb_utils.TritonError(f"{type(e).__name__}: {e}")),
                            flags=final)
                continue
            sender.send(flags=final)

    def finalize(self):
        """Release the engine's sessions."""
        self.engine.close()
