"""``trtinfer triton DIR -o REPO``: a Triton Inference Server model repository serving an engine."""
from __future__ import annotations

import argparse
from typing import Any

from trtinfer.cli._flags import add_provider_flag, path_arg

TRITON_FLAGS = {"model_name": "--name", "version": "--version", "link": "--link", "instances": "--instances",
                "provider": "--provider", "max_queue_delay_us": "--max-queue-delay-us"}


def add_parser(sub: Any) -> None:
    """Register the verb."""
    p = sub.add_parser("triton", help="write a Triton model repository for an engine (generated and checked here, "
                                      "served by tritonserver elsewhere)")
    p.add_argument("engine", type=path_arg, help="engine directory (from `trtinfer build`)")
    p.add_argument("-o", "--output", type=path_arg, required=True, help="model repository to write (tritonserver --model-repository)")
    p.add_argument("--name", default=None, help="model name in Triton (default: the engine directory's name)")
    p.add_argument("--version", type=int, default=1, help="version folder (default 1)")
    p.add_argument("--link", action="store_true", help="symlink the engine files instead of copying them")
    p.add_argument("--instances", type=int, default=1, help="Triton model instances (each loads the engine)")
    add_provider_flag(p, default=None,
                      help="decoders: execution provider inside Triton (default: cuda for CUDA engines, else cpu)")
    p.add_argument("--max-queue-delay-us", type=int, default=100,
                   help="encoders: how long the dynamic batcher waits to fill a batch")
    p.add_argument("--force", action="store_true", help="replace an existing output directory")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Run the verb."""
    from trtinfer.cli._flags import config_from_flags
    from trtinfer.serving.triton import CONFIG_NAME, TritonConfig, write_repository

    config = config_from_flags(TritonConfig, TRITON_FLAGS, model_name=args.name, version=args.version,
                               link=args.link, instances=args.instances, provider=args.provider,
                               max_queue_delay_us=args.max_queue_delay_us)
    model = write_repository(args.engine, args.output, config, overwrite=args.force)
    print(f"wrote {model / CONFIG_NAME} (serve with: tritonserver --model-repository {args.output})")
    return 0
