"""vLLM's sampling parameters read as :class:`~trtinfer.runtime.config.GenerationConfig` fields, one reading for the
OpenAI server's requests and Triton's (``sampling_parameters`` and the single tensors)."""
from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from trtinfer.errors import InputError
from trtinfer.runtime.config import GREEDY_BELOW, is_int, is_number

#: vLLM's ``SamplingParams`` name -> GenerationConfig field
VLLM_FIELDS = {"max_tokens": "max_new_tokens", "min_tokens": "min_new_tokens", **{k: k for k in (
    "temperature", "top_p", "top_k", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty", "seed",
    "stop", "ignore_eos")}}


def sampling_fields(params: Mapping[str, Any]) -> dict[str, Any]:
    """The GenerationConfig fields of vLLM's sampling parameters (a None value is left out), read as vLLM reads them:
    ``temperature`` 0 is greedy and above it samples at it (anything but a finite number >= 0 is an InputError);
    ``top_p``, ``top_k`` or ``min_p`` without a temperature sample at the default one; ``top_k`` -1 is no top-k."""
    fields = {VLLM_FIELDS[k]: v for k, v in params.items() if v is not None}
    if "temperature" in fields:
        temperature = fields.pop("temperature")
        if not (is_number(temperature) and temperature >= 0):  # NaN or -1 would otherwise pass as greedy
            raise InputError(f"temperature must be a finite number >= 0 (0: greedy), got {temperature!r}")
        fields["do_sample"] = temperature >= GREEDY_BELOW
        if fields["do_sample"]:
            fields["temperature"] = float(temperature)
    elif any(k in fields for k in ("top_p", "top_k", "min_p")):
        fields["do_sample"] = True
    if is_int(fields.get("top_k")) and fields["top_k"] == -1:  # an int: -1.0 stays GenerationConfig's type error
        fields["top_k"] = 0
    return fields
