"""One progress display for a job made of stages: each stage is a step; a stage reused from the cache says so."""
from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

from trtinfer.runtime.memory import children_peak_rss_mib, peak_rss_mib


class StageProgress:
    """``with progress.stage("export") as rec: ...`` advances one step per stage and records its time.

    ``rec["cached"] = True`` inside the block marks the stage as reused; :attr:`records` keeps, per stage, its
    seconds, whether it came from the cache and, on Linux, the process's peak resident memory so far when it ends
    (``peak_rss_mib``: the first stage that raises it is the one that needed it; the peak is never reset, so
    ``/usr/bin/time`` and other watchers still see the true one), and the largest peak of its finished child
    processes so far (``children_peak_rss_mib``, where any ran), as the manifest stores them.
    """

    def __init__(self, names: Sequence[str], enabled: bool = True) -> None:
        from tqdm.auto import tqdm

        self.names = list(names)
        self.records: dict[str, dict[str, Any]] = {}
        # disable=None: tqdm draws only on a terminal
        self._bar = tqdm(total=len(self.names), disable=None if enabled else True, unit="stage", leave=False,
                         bar_format="{desc:<28} {bar:20} {n_fmt}/{total_fmt} stages [{elapsed}]")

    @contextmanager
    def stage(self, name: str) -> Iterator[dict[str, Any]]:
        """Run one stage of the job (``name`` must be one of the stages given at construction)."""
        if name not in self.names:
            raise ValueError(f"stage {name!r} was not announced; stages: {self.names}")
        self._bar.set_description_str(name)
        rec: dict[str, Any] = {"cached": False}
        t0 = time.perf_counter()
        try:
            yield rec
        finally:
            rec["seconds"] = round(time.perf_counter() - t0, 2)
            rec["peak_rss_mib"] = round(peak_rss_mib(), 1)
            if children := children_peak_rss_mib():  # the export's child interpreters (trtinfer.export.isolated)
                rec["children_peak_rss_mib"] = round(children, 1)
            self.records[name] = rec
            self._bar.update()

    def close(self) -> None:
        """Remove the display."""
        self._bar.close()

    def __enter__(self) -> StageProgress:  # noqa: PYI034
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
