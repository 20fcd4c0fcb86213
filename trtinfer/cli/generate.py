"""``trtinfer generate DIR --prompt TEXT``: generate with an engine; ``--stream`` prints tokens as they come."""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import sys
from pathlib import Path
from typing import Any

from trtinfer.cli._flags import add_cpu_runtime_flags, add_provider_flag, path_arg

#: fields whose checks depend on fields the engine's generation_config.json may set (num_beams, do_sample)
_COMBINED = frozenset({"num_return_sequences"})


def add_parser(sub: Any) -> None:
    """Register the verb."""
    p = sub.add_parser("generate", help="generate text with an engine directory")
    p.add_argument("engine", type=path_arg, help="engine directory from `trtinfer build`")
    p.add_argument("-p", "--prompt", action="append", required=True, help="prompt text; repeat for a batch")
    # generation flags default to None: the engine's generation_config.json (then transformers' defaults) decide
    p.add_argument("-n", "--max-new-tokens", type=int, default=None, help="default 64")
    p.add_argument("--min-new-tokens", type=int, default=None)
    p.add_argument("--sample", action="store_true", default=None,
                   help="sample instead of greedy (implied by temperature/top-k/top-p/min-p)")
    p.add_argument("--greedy", action="store_true",
                   help="greedy decoding even where the model's generation_config.json says to sample")
    p.add_argument("--temperature", type=float, default=None)
    p.add_argument("--top-k", type=int, default=None, help="default 50 (transformers')")
    p.add_argument("--top-p", type=float, default=None)
    p.add_argument("--min-p", type=float, default=None,
                   help="drop tokens less likely than MIN_P times the most likely one (after top-p)")
    p.add_argument("--repetition-penalty", type=float, default=None)
    p.add_argument("--presence-penalty", type=float, default=None,
                   help="lower the logit of every token generated so far by this much (-2..2)")
    p.add_argument("--frequency-penalty", type=float, default=None,
                   help="lower each token's logit by this much per time it was generated (-2..2)")
    p.add_argument("--no-repeat-ngram-size", type=int, default=None, help="never repeat an n-gram of this size")
    p.add_argument("--num-beams", type=int, default=None, help="beam search with this many beams")
    p.add_argument("--length-penalty", type=float, default=None,
                   help="beam scores are divided by length ** this (default 1; > 0 favours longer outputs)")
    p.add_argument("--early-stopping", choices=("true", "false", "never"), default=None,
                   help="beam search stopping rule, as transformers' early_stopping")
    p.add_argument("--num-return-sequences", type=int, default=None,
                   help="results per prompt (best beams, or independent samples)")
    p.add_argument("--prompt-lookup-num-tokens", type=int, default=None,
                   help="speculative decoding: draft up to this many tokens from earlier text and verify them at once")
    p.add_argument("--assistant", metavar="ENGINE_DIR", default=None,
                   help="speculative decoding with a draft engine of the same tokenizer (e.g. an int4 build of the "
                        "same model): it drafts, this engine verifies; greedy output stays this engine's")
    p.add_argument("--num-assistant-tokens", type=int, default=None,
                   help="tokens the assistant drafts per step to start with (default 20; adapted as transformers')")
    p.add_argument("--logprobs", action="store_true", default=None,
                   help="per-token log-probabilities in --json output")
    p.add_argument("--top-logprobs", type=int, default=None, help="with --logprobs: this many alternatives per token")
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--stop", action="append", default=None, help="stop string; repeatable")
    p.add_argument("--chat", action="store_true", help="wrap each prompt in the model's chat template")
    p.add_argument("--stream", action="store_true", help="print text as it is generated (one prompt)")
    p.add_argument("--json", action="store_true", help="print results as JSON")
    add_provider_flag(p)
    add_cpu_runtime_flags(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Run the verb."""
    import trtinfer
    from trtinfer.artifact import read_manifest
    from trtinfer.cli._flags import GENERATION_FLAGS, RUNTIME_FLAGS, check_text_flag, config_from_flags
    from trtinfer.errors import ConfigError, InputError
    from trtinfer.runtime.config import GenerationConfig, RuntimeConfig

    # every flag is checked before the engine loads, and reported under its own name
    check_text_flag("--prompt", args.prompt)
    check_text_flag("--stop", args.stop)
    if args.stream and len(args.prompt) != 1:
        raise InputError(f"--stream takes exactly one --prompt, got {len(args.prompt)}")
    chosen = {field: getattr(args, flag[2:].replace("-", "_")) for field, flag in GENERATION_FLAGS.items()
              if field != "do_sample"}
    chosen = {k: v for k, v in chosen.items() if v is not None}
    if "stop" in chosen:
        chosen["stop"] = tuple(chosen["stop"])
    if "early_stopping" in chosen:
        chosen["early_stopping"] = {"true": True, "false": False}.get(chosen["early_stopping"], "never")
    if args.sample and args.greedy:
        raise InputError("--sample and --greedy contradict each other; give one")
    if args.sample or any(k in chosen for k in ("temperature", "top_k", "top_p", "min_p")):
        chosen["do_sample"] = True
    elif args.greedy:
        chosen["do_sample"] = False
    try:  # the flags alone, before anything loads: value errors are reported at once
        config_from_flags(GenerationConfig, GENERATION_FLAGS, **chosen)
    except ConfigError as e:
        if e.field not in _COMBINED:  # a rule that involves the engine's defaults is checked once they are known
            raise
    runtime = config_from_flags(RuntimeConfig, RUNTIME_FLAGS, provider=args.provider,
                                prefill_graph=args.prefill_graph, huge_pages=args.huge_pages,
                                spinning=args.spinning)
    if args.assistant is None and "num_assistant_tokens" in chosen:
        raise InputError("--num-assistant-tokens needs --assistant ENGINE_DIR")
    for flag, folder in (("ENGINE", args.engine), ("--assistant", args.assistant)):
        if folder is not None and read_manifest(Path(folder)).kind == "encoder":  # before loading it
            raise InputError(f"{folder} ({flag}) is an encoder engine; `trtinfer generate` needs a decoder engine "
                             "(`trtinfer embed` runs encoders)")
    with contextlib.ExitStack() as stack:
        engine = stack.enter_context(trtinfer.load(args.engine, config=runtime))
        extra = {} if args.assistant is None else {
            "assistant": stack.enter_context(trtinfer.load(args.assistant, config=runtime))}
        # the flags over the engine's defaults (its generation_config.json), checked together (after loading: which
        # flags combine depends on those defaults, e.g. --num-return-sequences with the file's num_beams)
        cfg = config_from_flags(lambda **kw: dataclasses.replace(engine.generation_defaults, **kw), GENERATION_FLAGS,
                                **chosen)
        if args.stream:
            for delta in engine.stream(args.prompt[0], chat=args.chat, config=cfg, **extra):
                sys.stdout.write(delta)
                sys.stdout.flush()
            sys.stdout.write("\n")
            return 0
        results = engine.generate(args.prompt, chat=args.chat, config=cfg, **extra)
    per_prompt = len(results) // len(args.prompt)  # num_return_sequences results per prompt, prompt by prompt
    if args.json:
        print(json.dumps([_as_json(args.prompt[i // per_prompt], r) for i, r in enumerate(results)], indent=2))
        return 0
    for i, r in enumerate(results):
        if len(results) > 1:
            print(f"--- [{i // per_prompt}{'.' + str(i % per_prompt) if per_prompt > 1 else ''}] {r.finish_reason}")
        print(r.text)
    t = results[0].timings
    print(f"prompt eval: {t.prefill_ms:.1f} ms / {t.prompt_tokens} tokens (batch {t.batch_size}); "
          f"eval: {t.decode_tokens_per_s:.1f} tokens/s per sequence over {len(t.decode_ms)} steps", file=sys.stderr)
    return 0


def _as_json(prompt: str, r: Any) -> dict[str, Any]:
    """One result as --json prints it (logprobs as OpenAI's ``logprobs.content`` items, score for beams)."""
    out: dict[str, Any] = {"prompt": prompt, "text": r.text, "token_ids": r.token_ids,
                           "finish_reason": r.finish_reason, "timings": r.timings.to_dict()}
    if r.score is not None:
        out["score"] = r.score
    if r.logprobs is not None:
        out["logprobs"] = [{"token_id": lp.token_id, "logprob": lp.logprob,
                            "top_logprobs": [{"token_id": t, "logprob": v} for t, v in lp.top]} for lp in r.logprobs]
    return out
