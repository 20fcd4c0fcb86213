"""What one scheduler step prefills: how much of a prompt goes in a chunk, which fresh prompts go together in one
batched call, and which part of a prompt a reused prefix may cover. Pure functions of the requests (the
:class:`~trtinfer.runtime.scheduler.Scheduler` owns the rows and runs the calls).

One rule runs through them: a prompt's last token is always computed in a pass of at least two tokens, never a
one-token pass short of the prompt's end, because a graph's one-token pass may round differently from a chunk
(SmolLM2-135M int4: 0.30 on the logits, which changed greedy answers; chunks of 2+ tokens after a prefix equal the
one-shot prefill exactly). The exception is a ``decode_tail`` request (beam search's continuations): its last
token may follow a reused prefix alone, as one more row of the step's decode call.
"""
from __future__ import annotations

from trtinfer.runtime.request import Request


def head(req: Request) -> list[int]:
    """The part of the prompt a reused prefix may cover: its end is always prefilled (its logits choose the first
    new token), 2 tokens, 1 for a ``decode_tail`` request."""
    return req.prompt_ids[:-1 if req.decode_tail else -2]


def tail_due(req: Request) -> bool:
    """Whether only the last prompt token of a ``decode_tail`` request (a beam's continuation) is left after a reused
    prefix: it joins the decode step, as one more row of that call."""
    return req.decode_tail and req.num_computed > 0 and req.num_computed == len(req.prompt_ids) - 1


def chunk_size(req: Request, todo: int, budget: int, first: bool) -> int:
    """How many of ``req``'s ``todo`` prompt tokens to prefill now, at most ``budget``: never a one-token pass short
    of the prompt's end, nor a chunk that leaves one token (SmolLM2-135M int4 served with ``--prefill-chunk 12``
    answered 1 of 32 chat requests differently from the same request alone when a step's budget left one token for
    the next prompt). 0: the request waits for the next step; the step's first call (``first``) may go over a budget
    of 1-2 tokens instead."""
    n = min(todo, budget)
    if todo - n == 1 and n > 1 and not req.decode_tail:  # the last chunk keeps two tokens
        n -= 1
    if n == 1 and todo > 1:
        n = (3 if todo == 3 and not req.decode_tail else 2) if first else 0
    return n


def fresh_runs(fresh: list[Request], budget: int) -> list[list[Request]]:
    """Groups of >= 2 of the ``fresh`` requests (admitted, nothing in their rows yet) in neighbouring slots, whose
    whole prompts fit ``budget`` together (counted as the call computes them: rows x the longest prompt), each group
    one batched prefill call. Never a one-token prompt: alone it is a one-token pass (on the decoder graph), in such a
    call a row of a several-token one (on the prefill graph, where the engine has one: SmolLM2-135M int4's logits 6.4
    apart, and answers changed)."""
    ordered = sorted((r for r in fresh if r.slot is not None and len(r.prompt_ids) > 1), key=lambda r: r.slot or 0)
    runs: list[list[Request]] = []
    run: list[Request] = []

    def cost(group: list[Request]) -> int:
        return len(group) * max(len(r.prompt_ids) for r in group)

    for req in ordered:
        if run and run[-1].slot == (req.slot or 0) - 1 and cost([*run, req]) <= budget:
            run.append(req)
            continue
        if len(run) > 1:
            runs.append(run)
            budget -= cost(run)
        run = [req] if len(req.prompt_ids) <= budget else []
    if len(run) > 1:
        runs.append(run)
    return runs
