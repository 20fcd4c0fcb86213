"""How much prompt a scheduler step may prefill while other requests are decoding.

A step runs its prefill calls, then one batched decode call, and every decoding request waits for the whole step:
a step whose prefill takes as long as the decode call doubles their inter-token gap. vLLM bounds a step by a fixed
token count (``max_num_batched_tokens``), which fits one machine and model only. Here the bound is time, measured on
the running engine: while requests are decoding, a step's prefill calls may take about one decode call
(:attr:`StepBudget.share` of it); with nobody decoding, a step prefills up to ``cap`` tokens (nobody waits).

A call's cost is fitted as ``fixed + per_token * tokens`` (exponentially weighted least squares over recent prefill
calls). The fixed part matters: on a CPU a prefill call reads every weight once, as a decode step does, so a
batch-1 chunk of 10 tokens costs most of a decode step (SmolLM2-135M fp32 on 2 cores: ~35 ms fixed, ~0.7 ms a
token, decode at batch 8 ~45 ms). Chunks into rows that already hold a prefix cannot share a call (ONNX Runtime's CPU
GroupQueryAttention takes several new tokens with past context at batch 1 only), so the budget counts calls, not
only tokens: the first call of a step always runs, later ones only if they fit the time left. The first call takes
at least :data:`MIN_TOKENS` tokens, and at least as many as cost its fixed part (``fixed / per_token``: a prompt's
prefill never spends more time on calls' fixed costs than on its tokens; SmolLM2 fp32 on 2 cores: 50 tokens, a step
then ~2.4x a decode call). Until costs are known the bound is ``cap`` tokens.
"""
from __future__ import annotations

MIN_TOKENS = 16  # the smallest first chunk of a step while others decode: a long prompt still advances every step
DECAY = 0.9  # weight an earlier call keeps at each new one (about the last ten calls count)


class StepBudget:
    """Prefill and decode call costs, measured; :meth:`plan` starts a step's budget."""

    def __init__(self, cap: int, share: float = 1.0) -> None:
        self.cap = cap
        self.share = share  # prefill time per step, as a fraction of a decode call's, while others decode
        self._sums = [0.0] * 5  # weighted sums of 1, n, t, n*n, n*t over prefill calls
        self.decode_s = 0.0  # weighted mean decode-call time (s); 0 until one was seen

    def prefill_took(self, tokens: int, seconds: float) -> None:
        """A prefill call computed ``tokens`` positions (rows x width for a batched call) in ``seconds``."""
        n, t = float(tokens), seconds
        self._sums = [DECAY * s + x for s, x in zip(self._sums, (1.0, n, t, n * n, n * t))]

    def decode_took(self, seconds: float) -> None:
        """A decode call took ``seconds``."""
        self.decode_s = seconds if self.decode_s == 0.0 else DECAY * self.decode_s + (1 - DECAY) * seconds

    def cost(self) -> tuple[float, float] | None:
        """``(fixed, per_token)`` seconds of a prefill call, or None before two calls of different sizes."""
        w, n, t, nn, nt = self._sums
        spread = w * nn - n * n
        if w == 0.0 or spread <= 1e-9 * max(w * nn, 1.0):  # no calls, or all of one size: no line to fit
            return None
        per_token = (w * nt - n * t) / spread
        if per_token <= 0:
            return None
        return max(0.0, (t - per_token * n) / w), per_token

    def plan(self, decoding: bool) -> StepPlan:
        """The budget of one step: bounded in time while others are ``decoding`` (and costs are known)."""
        cost = self.cost() if decoding and self.decode_s > 0.0 else None
        return StepPlan(self.cap, cost, self.share * self.decode_s)


class StepPlan:
    """One step's prefill budget: :meth:`room` before a call, :meth:`spend` after it."""

    def __init__(self, cap: int, cost: tuple[float, float] | None, seconds: float) -> None:
        self.tokens_left = cap
        self.cost = cost  # None: bounded by tokens only
        self.seconds_left = seconds
        self.calls = 0

    def room(self, want: int) -> int:
        """How many of ``want`` tokens the next call may take (0: no more calls this step)."""
        fit = self.tokens_left
        if self.cost is not None:
            fixed, per_token = self.cost
            in_time = int((self.seconds_left - fixed) / per_token)
            if self.calls == 0:  # the step's first call runs, and spends at least as long on tokens as its fixed cost
                in_time = max(in_time, MIN_TOKENS, int(fixed / per_token))
            elif in_time < min(want, MIN_TOKENS):  # a sliver is not worth a call's fixed cost
                in_time = 0
            fit = min(fit, in_time)
        return max(0, min(want, fit))

    def spend(self, tokens: int) -> None:
        """A call of ``tokens`` tokens was made."""
        self.calls += 1
        self.tokens_left -= tokens
        if self.cost is not None:
            self.seconds_left -= self.cost[0] + self.cost[1] * tokens
