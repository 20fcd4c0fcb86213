"""One exception hierarchy for trtinfer.

Every error says what was expected, what was found and what to do. The CLI prints ``str(err)`` as one line and
exits non-zero; ``--debug`` shows the traceback.
"""
from __future__ import annotations


class TrtInferError(Exception):
    """Base class of every error trtinfer raises on purpose."""

    exit_code = 1


class ConfigError(TrtInferError, ValueError):
    """A configuration value is out of range or inconsistent; ``field`` names the config field when one is at fault.

    The CLI uses ``field`` to report the error under the flag that set it (``--temperature`` for ``temperature``).
    """

    exit_code = 2

    def __init__(self, message: str = "", *, field: str | None = None) -> None:
        super().__init__(message)
        self.field = field


class ModelSourceError(TrtInferError):
    """A MODEL argument could not be resolved to a loadable model."""

    exit_code = 2


class UnsupportedArchitectureError(TrtInferError):
    """The model's architecture has no registered export spec."""

    exit_code = 2


class ExportError(TrtInferError):
    """Tracing or writing the ONNX graph failed."""


class ValidationError(ExportError):
    """The exported graph's outputs differ from PyTorch eager beyond tolerance."""


class OutputError(TrtInferError):
    """An output location cannot be written (read-only, full, no permission); ``path`` is the final path meant."""

    exit_code = 2
    path: str | None = None


class OutputExistsError(OutputError):
    """The output directory exists and replacing it was not asked for."""



class BuildError(TrtInferError):
    """Building an engine directory failed."""


class EngineLoadError(TrtInferError):
    """An engine directory is missing, incomplete or from an incompatible version."""

    exit_code = 2


class InputError(TrtInferError, ValueError):
    """Inputs to the runtime break the engine's limits or contract."""

    exit_code = 2


class GrammarError(InputError):
    """A structured-output format (``response_format``, a guided-decoding spec) that does not compile to a grammar;
    ``reason`` is the grammar compiler's."""

    def __init__(self, message: str, reason: str) -> None:
        super().__init__(message)
        self.reason = reason


class CalibrationError(InputError):
    """Calibration data is missing, empty, unreadable or too short, or a saved calibration does not fit the graph."""

    exit_code = 2


class BackendUnavailableError(TrtInferError):
    """The requested backend or execution provider is not installed on this machine."""

    exit_code = 3


class ServingError(TrtInferError):
    """A serving request cannot be taken (the server answers it with a 4xx/5xx and keeps serving)."""

    exit_code = 2
    status = 400


class QueueFullError(ServingError):
    """Every batch slot is busy and the waiting queue is full: try again later (HTTP 429)."""

    status = 429
