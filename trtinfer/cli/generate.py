"""``trtinfer generate DIR --prompt TEXT``: generate with an engine; ``--stream`` prints tokens as they come."""
from __future__ import annotations

import argparse
import json
import sys
from typing import Any

# config field -> flag for the fields GENERATION_FLAGS (cli/_flags.py) does not list yet
_SAMPLING_FLAGS = {"min_p": "--min-p", "presence_penalty": "--presence-penalty",
                   "frequency_penalty": "--frequency-penalty", "no_repeat_ngram_size": "--no-repeat-ngram-size"}


def add_parser(sub: Any) -> None:
    """Register the verb."""
    p = sub.add_parser("generate", help="generate text with an engine directory")
    p.add_argument("engine", help="engine directory from `trtinfer build`")
    p.add_argument("-p", "--prompt", action="append", required=True, help="prompt text; repeat for a batch")
    p.add_argument("-n", "--max-new-tokens", type=int, default=64)
    p.add_argument("--min-new-tokens", type=int, default=0)
    p.add_argument("--sample", action="store_true",
                   help="sample instead of greedy (implied by temperature/top-k/top-p/min-p)")
    p.add_argument("--temperature", type=float, default=None)
    p.add_argument("--top-k", type=int, default=None)
    p.add_argument("--top-p", type=float, default=None)
    p.add_argument("--min-p", type=float, default=None,
                   help="drop tokens less likely than MIN_P times the most likely one (after top-p)")
    p.add_argument("--repetition-penalty", type=float, default=1.0)
    p.add_argument("--presence-penalty", type=float, default=0.0,
                   help="lower the logit of every token generated so far by this much (-2..2)")
    p.add_argument("--frequency-penalty", type=float, default=0.0,
                   help="lower each token's logit by this much per time it was generated (-2..2)")
    p.add_argument("--no-repeat-ngram-size", type=int, default=0, help="never repeat an n-gram of this size")
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--stop", action="append", default=None, help="stop string; repeatable")
    p.add_argument("--chat", action="store_true", help="wrap each prompt in the model's chat template")
    p.add_argument("--stream", action="store_true", help="print text as it is generated (one prompt)")
    p.add_argument("--json", action="store_true", help="print results as JSON")
    p.add_argument("--provider", choices=("cpu", "cuda", "tensorrt"), default="cpu")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Run the verb."""
    import trtinfer
    from trtinfer.cli._flags import GENERATION_FLAGS, RUNTIME_FLAGS, check_text_flag, config_from_flags
    from trtinfer.errors import InputError
    from trtinfer.runtime.config import GenerationConfig, RuntimeConfig

    # every flag is checked before the engine loads, and reported under its own name
    check_text_flag("--prompt", args.prompt)
    check_text_flag("--stop", args.stop)
    if args.stream and len(args.prompt) != 1:
        raise InputError(f"--stream takes exactly one --prompt, got {len(args.prompt)}")
    sample = args.sample or any(v is not None for v in (args.temperature, args.top_k, args.top_p, args.min_p))
    cfg = config_from_flags(
        GenerationConfig, {**GENERATION_FLAGS, **_SAMPLING_FLAGS},
        max_new_tokens=args.max_new_tokens, min_new_tokens=args.min_new_tokens, do_sample=sample,
        temperature=1.0 if args.temperature is None else args.temperature,
        top_k=0 if args.top_k is None else args.top_k, top_p=1.0 if args.top_p is None else args.top_p,
        min_p=0.0 if args.min_p is None else args.min_p, repetition_penalty=args.repetition_penalty,
        presence_penalty=args.presence_penalty, frequency_penalty=args.frequency_penalty,
        no_repeat_ngram_size=args.no_repeat_ngram_size, seed=args.seed, stop=tuple(args.stop or ()),
    )
    runtime = config_from_flags(RuntimeConfig, RUNTIME_FLAGS, provider=args.provider)
    with trtinfer.load(args.engine, config=runtime) as engine:
        if args.stream:
            for delta in engine.stream(args.prompt[0], chat=args.chat, config=cfg):
                sys.stdout.write(delta)
                sys.stdout.flush()
            sys.stdout.write("\n")
            return 0
        results = engine.generate(args.prompt, chat=args.chat, config=cfg)
    if args.json:
        print(json.dumps([{"prompt": p, "text": r.text, "token_ids": r.token_ids, "finish_reason": r.finish_reason,
                           "timings": r.timings.to_dict()} for p, r in zip(args.prompt, results)], indent=2))
        return 0
    for i, r in enumerate(results):
        if len(results) > 1:
            print(f"--- [{i}] {r.finish_reason}")
        print(r.text)
    t = results[0].timings
    print(f"prompt eval: {t.prefill_ms:.1f} ms / {t.prompt_tokens} tokens (batch {t.batch_size}); "
          f"eval: {t.decode_tokens_per_s:.1f} tokens/s per sequence over {len(t.decode_ms)} steps", file=sys.stderr)
    return 0
