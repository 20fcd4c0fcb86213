"""TensorRT build and run planning in plain Python: optimization profiles, buffer sizes, engine compatibility.

Nothing here imports TensorRT or CUDA, so every rule is unit-tested on a CPU. The builder
(:mod:`trtinfer.builder.trt_backend`) turns a :class:`ProfilePlan` into ``IOptimizationProfile.set_shape`` calls; the
runtime (:mod:`trtinfer.runtime.trt_session`) picks a profile for each step with :func:`select_profile`.

Two profiles, because prefill and decode want different kernels (TensorRT tunes each profile at its ``opt`` shape)::

    profile 0 "prefill": batch 1..opt..max   sequence 1..opt..max_seq   positions 1..1..max_seq
    profile 1 "decode":  batch 1..opt..max   sequence 1                 positions 1

``positions`` counts the rows of logits asked for (1 in generation, a whole chunk when scoring). The KV buffers'
slot count is not planned: TensorRT's KV-cache update layer (what the ONNX ``TensorScatter`` of the ``scatter_buffer``
layout becomes, TensorRT >= 10.15) needs the cache input's sequence length static, so the graph fixes it at the
engine's max sequence length. Each profile gets its own execution context (NVIDIA: "each execution context in
concurrent use must use a separate optimization profile").
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import astuple, dataclass
from typing import Any

from trtinfer.errors import ConfigError, EngineLoadError

#: Symbolic dimension names of the ``tensorrt`` pass target's graph (``scatter_buffer`` KV layout).
BATCH, SEQUENCE, POSITIONS = "batch", "sequence", "positions"
KNOWN_DIMS = (BATCH, SEQUENCE, POSITIONS)

Shape = tuple[int, ...]


@dataclass(frozen=True)
class DimRange:
    """``min <= opt <= max`` for one symbolic dimension."""

    min: int
    opt: int
    max: int

    def __post_init__(self) -> None:
        if not 1 <= self.min <= self.opt <= self.max:
            raise ConfigError(f"a shape range needs 1 <= min <= opt <= max, got {self.min}, {self.opt}, {self.max}")


@dataclass(frozen=True)
class Profile:
    """One optimization profile: a name and ``{input: (min, opt, max)}`` concrete shapes."""

    name: str
    dims: Mapping[str, DimRange]
    shapes: Mapping[str, tuple[Shape, Shape, Shape]]

    def accepts(self, shapes: Mapping[str, Shape]) -> bool:
        """Whether every given input shape lies inside this profile's min..max box."""
        boxes = ((shape, *self.shapes[name]) for name, shape in shapes.items())
        return all(len(shape) == len(lo) and all(a <= s <= b for s, a, b in zip(shape, lo, hi))
                   for shape, lo, _, hi in boxes)

    def to_dict(self) -> dict[str, Any]:
        """For the engine's ``tensorrt.json`` and ``inspect``."""
        return {"name": self.name, "dims": {k: [r.min, r.opt, r.max] for k, r in self.dims.items()},
                "shapes": {k: [list(s) for s in v] for k, v in self.shapes.items()}}


@dataclass(frozen=True)
class ProfilePlan:
    """The profiles of an engine, in the order they are added to the builder config (index = profile index)."""

    profiles: tuple[Profile, ...]

    def index(self, name: str) -> int:
        for i, p in enumerate(self.profiles):
            if p.name == name:
                return i
        raise KeyError(name)

    def to_list(self) -> list[dict[str, Any]]:  # JSON form
        return [p.to_dict() for p in self.profiles]

    @classmethod
    def from_list(cls, data: Sequence[Mapping[str, Any]]) -> ProfilePlan:
        """Read :meth:`to_list`'s form back (from an engine's ``tensorrt.json``)."""
        return cls(tuple(Profile(str(p["name"]), {k: DimRange(*map(int, v)) for k, v in p["dims"].items()},
                                 {k: tuple(tuple(int(d) for d in s) for s in v)  # type: ignore[misc]
                                  for k, v in p["shapes"].items()}) for p in data))


def dim_ranges(max_batch: int, max_seq: int, opt_batch: int | None = None,
               opt_seq: int | None = None) -> dict[str, dict[str, DimRange]]:
    """The symbolic dimension ranges of the prefill and decode profiles.

    ``opt_batch`` defaults to ``max_batch`` capped at 8 and ``opt_seq`` to ``max_seq`` capped at 512 (typical chat
    prompts).
    """
    if max_batch < 1 or max_seq < 2:
        raise ConfigError(f"max batch must be >= 1 and max sequence >= 2, got {max_batch}, {max_seq}")
    ob = min(max_batch, 8) if opt_batch is None else opt_batch
    os_ = min(max_seq, 512) if opt_seq is None else opt_seq
    if not 1 <= ob <= max_batch:
        raise ConfigError(f"--opt-batch-size must be within 1..{max_batch} (the max batch size), got {ob}",
                          field="opt_batch_size")
    if not 1 <= os_ <= max_seq:
        raise ConfigError(f"--opt-seq-len must be within 1..{max_seq} (the max sequence length), got {os_}",
                          field="opt_seq_len")
    batch = DimRange(1, ob, max_batch)
    return {
        "prefill": {BATCH: batch, SEQUENCE: DimRange(1, os_, max_seq), POSITIONS: DimRange(1, 1, max_seq)},
        "decode": {BATCH: batch, SEQUENCE: DimRange(1, 1, 1), POSITIONS: DimRange(1, 1, 1)},
    }


def plan_profiles(inputs: Sequence[Mapping[str, Any]], max_batch: int, max_seq: int, opt_batch: int | None = None,
                  opt_seq: int | None = None) -> ProfilePlan:
    """Concrete min/opt/max shapes for every graph input (``graph_io(...)["inputs"]`` entries), per profile.

    Fixed dimensions (ints) stay as they are; symbolic ones must be among :data:`KNOWN_DIMS`, else the graph is not
    the ``tensorrt`` target's (an onnxruntime-target graph has ``total_sequence`` and friends): a ConfigError says so.
    """
    ranges = dim_ranges(max_batch, max_seq, opt_batch, opt_seq)
    profiles = []
    for name, dims in ranges.items():
        shapes: dict[str, tuple[Shape, Shape, Shape]] = {}
        for t in inputs:
            if unknown := [d for d in t["shape"] if not isinstance(d, int) and d not in dims]:
                raise ConfigError(f"input {t['name']} has dimension '{unknown[0]}', which no TensorRT profile plans "
                                  f"(known: {', '.join(KNOWN_DIMS)}); build from a graph optimized for the "
                                  "tensorrt target (trtinfer optimize --target tensorrt)")
            triples = [(d, d, d) if isinstance(d, int) else astuple(dims[d]) for d in t["shape"]]
            lo, opt, hi = (tuple(x[i] for x in triples) for i in range(3))
            shapes[t["name"]] = (lo, opt, hi)
        profiles.append(Profile(name, dims, shapes))
    return ProfilePlan(tuple(profiles))


def select_profile(plan: ProfilePlan, shapes: Mapping[str, Shape]) -> int:
    """The profile a step runs with: decode for one-token steps, else prefill. ValueError names the shapes when no
    profile accepts them (the runtime checks the engine's limits before it gets here)."""
    order = ["decode", "prefill"] if all(s[1] == 1 for n, s in shapes.items() if n == "input_ids") else ["prefill"]
    for name in order:
        i = plan.index(name)
        if plan.profiles[i].accepts(shapes):
            return i
    raise ValueError(f"no optimization profile accepts shapes {dict(shapes)}")


def compatibility_problem(built: Mapping[str, Any], here: Mapping[str, Any]) -> str | None:
    """Why an engine built as ``built`` cannot run ``here`` (both: ``{"tensorrt_version", "gpu", "compute_capability"}``).

    A TensorRT plan is tied to the TensorRT version that built it and to the GPU's compute capability (NVIDIA: "engines
    are specific to the exact GPU model and TensorRT version they were built on"); a different GPU name of the same
    capability runs but may not be tuned, which the runtime logs instead. Returns None when it can run.
    """
    if built.get("tensorrt_version") != here.get("tensorrt_version"):
        return (f"the engine was built with TensorRT {built.get('tensorrt_version')}, this is TensorRT "
                f"{here.get('tensorrt_version')}")
    if built.get("compute_capability") != here.get("compute_capability"):
        return (f"the engine was built for {built.get('gpu')} (compute capability {built.get('compute_capability')}), "
                f"this GPU is {here.get('gpu')} ({here.get('compute_capability')})")
    return None


def check_compatible(built: Mapping[str, Any], here: Mapping[str, Any], engine_dir: str) -> None:
    """Raise EngineLoadError telling the user to rebuild when :func:`compatibility_problem` finds one."""
    problem = compatibility_problem(built, here)
    if problem:
        raise EngineLoadError(f"{engine_dir}: {problem}; rebuild it here with `trtinfer build ... --backend tensorrt`")
