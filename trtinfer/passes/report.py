"""What a pipeline did: per pass, how often it fired and how often it should have."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class PassRecord:
    """One pass of a pipeline run. ``expected`` is None where the graph gives no way to know."""

    name: str
    kind: str  # "cleanup" | "fusion" | "layout" | "precision"
    fired: int
    expected: int | None
    seconds: float

    @property
    def missed(self) -> int:
        """How many expected matches did not fire (0 when unknown)."""
        return max(0, self.expected - self.fired) if self.expected is not None else 0


@dataclass
class FusionReport:
    """Pipeline result; ``to_dict()`` is what manifests and ``trtinfer inspect --json`` show."""

    target: str
    nodes_before: int = 0
    nodes_after: int = 0
    passes: list[PassRecord] = field(default_factory=list)

    def add(self, record: PassRecord) -> None:
        """Append one pass's record."""
        self.passes.append(record)

    def fired(self, name: str) -> int:
        """Times the pass ``name`` fired (0 if it did not run)."""
        return sum(r.fired for r in self.passes if r.name == name)

    @property
    def warnings(self) -> list[str]:
        """One line per fusion that fired fewer times than expected."""
        return [f"fusion '{r.name}' fired {r.fired} of {r.expected} expected times" for r in self.passes
                if r.missed]

    def to_dict(self, timings: bool = True) -> dict[str, Any]:
        """JSON-friendly form; without ``timings``, what the passes did only (the same for the same input)."""
        return {
            "target": self.target,
            "nodes_before": self.nodes_before,
            "nodes_after": self.nodes_after,
            "fusions": {r.name: {"kind": r.kind, "fired": r.fired, "expected": r.expected,
                                 **({"seconds": round(r.seconds, 3)} if timings else {})} for r in self.passes},
            "warnings": self.warnings,
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> FusionReport:
        """Inverse of :meth:`to_dict`."""
        rep = cls(d["target"], d.get("nodes_before", 0), d.get("nodes_after", 0))
        for name, r in d.get("fusions", {}).items():
            rep.add(PassRecord(name, r["kind"], r["fired"], r["expected"], r.get("seconds", 0.0)))
        return rep

    def table(self) -> str:
        """Human-readable lines: ``name  fired/expected``, misses flagged."""
        lines = [f"{'pass':<24}{'kind':<11}{'fired':>6}{'expected':>10}"]
        for r in self.passes:
            exp = "-" if r.expected is None else str(r.expected)
            flag = "  << missed" if r.missed else ""
            lines.append(f"{r.name:<24}{r.kind:<11}{r.fired:>6}{exp:>10}{flag}")
        lines.append(f"nodes {self.nodes_before} -> {self.nodes_after}")
        return "\n".join(lines)
