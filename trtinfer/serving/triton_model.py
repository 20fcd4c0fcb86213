"""Triton Python-backend model written by ``trtinfer triton``: a trtinfer engine, its text streamed per delta.

Copied as ``model.py`` into the version folder, next to ``engine/`` (the engine directory). Decoupled: a request
gets one response per text delta (``stream`` true, the default) or one with the whole text (``stream`` false), then
an empty response flagged ``TRITONSERVER_RESPONSE_COMPLETE_FINAL``; a bad request gets one error response.
Each instance runs the server's continuous batching (:class:`~trtinfer.runtime.scheduler.Scheduler`, with prefix
caching): ``execute`` queues its requests and returns; the scheduler decodes every running request in one batched
step, and one thread per request sends its responses as the text arrives. ``instance_group.count`` instances run
side by side, each with its own engine. Triton's Python environment needs the trtinfer runtime (``pip install
trtinfer``): no torch, no transformers. The request logic is :mod:`trtinfer.serving.triton`'s ``parse_request``,
``submit`` and ``response_texts``; this file only moves tensors between Triton and them.
"""
import json
import threading
from pathlib import Path

import triton_python_backend_utils as pb_utils

import trtinfer
from trtinfer.serving.config import ServeConfig
from trtinfer.serving.triton import ENGINE_FOLDER, INPUT_NAMES, parse_request, response_texts, submit, text_tensor


class TritonPythonModel:
    """Loads the engine once per instance; answers each request with a stream of ``text_output`` responses."""

    def initialize(self, args):
        """Load ``<version folder>/engine`` with the provider named in config.pbtxt's parameters; start its batcher."""
        config = json.loads(args["model_config"])
        params = {k: v.get("string_value", "") for k, v in config.get("parameters", {}).items()}
        folder = Path(args["model_repository"]) / args["model_version"] / ENGINE_FOLDER
        device = int(args.get("model_instance_device_id") or 0)
        self.engine = trtinfer.load(folder, provider=params.get("provider", "cpu"), device_id=device)
        # the KV cache `trtinfer serve` reserves by default (its rows and positions per row)
        self.scheduler = ServeConfig().scheduler(self.engine).start()

    def execute(self, requests):
        """Queue every request on the batcher and return None (decoupled): each request's responses are sent by its
        own thread as the text arrives; a request that cannot be queued gets one error response at once."""
        for request in requests:
            sender = request.get_response_sender()
            try:
                inputs = {name: t.as_numpy() for name in INPUT_NAMES
                          if (t := pb_utils.get_input_tensor_by_name(request, name)) is not None}
                parsed = parse_request(inputs, self.engine.generation_defaults, self.engine.generation_defaults_set)
                queued = submit(self.scheduler, parsed)
            except Exception as e:  # noqa: BLE001 - the client gets the error; the instance keeps serving
                _fail(sender, e)
                continue
            threading.Thread(target=_respond, args=(sender, queued, parsed.stream), daemon=True).start()

    def finalize(self):
        """Stop the batcher (requests still running end with an error) and release the engine's sessions."""
        self.scheduler.close()
        self.engine.close()


def _respond(sender, queued, stream):
    """Send a queued request's text responses, then the final flag (or its error)."""
    try:
        # a client that went away (Triton >= 23.10 says so) stops its request instead of decoding to max_tokens
        for text in response_texts(queued, stream, getattr(sender, "is_cancelled", None)):
            sender.send(pb_utils.InferenceResponse(output_tensors=[pb_utils.Tensor("text_output", text_tensor(text))]))
    except Exception as e:  # noqa: BLE001
        _fail(sender, e)
        return
    sender.send(flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)


def _fail(sender, error):
    sender.send(pb_utils.InferenceResponse(error=pb_utils.TritonError(f"{type(error).__name__}: {error}")),
                flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
