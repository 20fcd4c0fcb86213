"""Concurrent generations on one engine: each thread must get the tokens it gets alone."""
from __future__ import annotations

import threading
from typing import Any


def assert_concurrent_equals_sequential(eng: Any, jobs: dict[int, list], rounds: int, max_new_tokens: int) -> None:
    """Generate each job alone, then all jobs in threads started together (``rounds`` times each); same tokens."""
    def tokens(prompts: list) -> list:
        return [r.token_ids for r in eng.generate(prompts, max_new_tokens=max_new_tokens, ignore_eos=True)]

    want = {k: tokens(p) for k, p in jobs.items()}
    got: dict[int, list] = {k: [] for k in jobs}
    errors: list[BaseException] = []
    start = threading.Barrier(len(jobs))

    def work(k: int) -> None:
        try:
            start.wait()
            for _ in range(rounds):
                got[k].append(tokens(jobs[k]))
        except BaseException as e:  # noqa: BLE001 - reported by the main thread
            errors.append(e)

    threads = [threading.Thread(target=work, args=(k,)) for k in jobs]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    assert not errors, errors
    assert got == {k: [want[k]] * rounds for k in jobs}
