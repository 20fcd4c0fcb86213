"""What moving an engine's packed weights onto 2 MiB pages buys (``RuntimeConfig.huge_pages``,
:mod:`trtinfer.runtime.huge_pages`): decode tok/s, TTFT and load time with the packed weights on huge pages vs left
on the 4 KiB pages ONNX Runtime allocates, per engine and batch size, in one run.

usage: python -m benchmarks.huge_pages ENGINE_DIR [ENGINE_DIR ...] [--batch-sizes 1 8] [--prompt-len 128]
                                       [--new-tokens 64] [--rounds 2] [--out PREFIX]

Each measurement is ``trtinfer.bench.measure_engine`` (the engine in its own process, greedy, best of 3 decode
rates), the two settings alternating ``--rounds`` times (off, on, off, on...: a shared VM's bandwidth drifts), the
best of each kept. Beside them, the int4 kernel's own ceiling both ways (``roofline.int4_probes``) and the kernel's
transparent-huge-page mode. Prints one table; writes PREFIX.json (figures, machine, commit) and PREFIX.png; PREFIX
defaults to benchmarks/results/huge_pages_<machine kind>_<date>.
"""
from __future__ import annotations

import argparse
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from benchmarks.machine import git_commit, machine_info, result_path
from benchmarks.roofline import int4_ceilings, int4_probes


def measure(engines: Sequence[Path], batch_sizes: Sequence[int], prompt_len: int, new_tokens: int,
            rounds: int) -> list[dict[str, Any]]:
    """One row per engine, batch size and setting: the best decode tok/s, TTFT and load time over ``rounds``."""
    from trtinfer.bench import measure_engine

    rows = []
    for engine in engines:
        for bs in batch_sizes:
            runs: dict[bool, list[Any]] = {False: [], True: []}
            for _ in range(rounds):
                for huge in (False, True):
                    runs[huge].append(measure_engine(engine, bs, prompt_len, new_tokens, huge_pages=huge))
            for huge, got in runs.items():
                rows.append({"engine": engine.name, "batch_size": bs, "huge_pages": huge,
                             "decode_tok_s": max(r.decode_tok_s for r in got), "ttft_ms": min(r.ttft_ms for r in got),
                             "load_s": min(r.load_s for r in got), "peak_rss_mib": max(r.peak_rss_mib for r in got),
                             "all_decode_tok_s": [round(r.decode_tok_s, 2) for r in got],
                             "first_tokens": got[0].first_tokens})
            off, on = rows[-2], rows[-1]
            # a trained model's greedy tokens are the same both ways; a random-weight checkpoint's logits are nearly
            # flat, and its tokens differ between two processes of one setting (the 1B shape's int4 engine: four
            # runs, four sequences from the first token): recorded, not required
            on["same_tokens"] = off["first_tokens"] == on["first_tokens"]
            on["speedup"] = on["decode_tok_s"] / off["decode_tok_s"]
    return rows


def format_table(report: dict[str, Any]) -> str:
    c = report["int4_kernel_gb_s"]
    head = (f"THP mode: {report['thp_mode']}; int4 kernel (MatMulNBits, batch 1): {c.get('int4_4k', 0):.1f} GB/s on "
            f"4 KiB pages, {c.get('int4', 0):.1f} on huge pages")
    lines = [head, "",
             "| engine | bs | huge pages | decode tok/s | vs 4 KiB | TTFT ms | load s | peak RSS MiB |",
             "|---|---|---|---|---|---|---|---|"]
    for r in report["rows"]:
        lines.append(f"| {r['engine']} | {r['batch_size']} | {'yes' if r['huge_pages'] else 'no'} | "
                     f"{r['decode_tok_s']:.2f} | {r.get('speedup', 1.0):.2f}x | {r['ttft_ms']:.0f} | {r['load_s']:.1f} "
                     f"| {r['peak_rss_mib']:.0f} |")
    return "\n".join(lines)


def chart(report: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    pairs = [r for r in report["rows"] if r["huge_pages"]]
    off = [r for r in report["rows"] if not r["huge_pages"]]
    fig, ax = plt.subplots(figsize=(max(6.0, 1.2 * len(pairs) + 2), 4.2))
    x = range(len(pairs))
    ax.bar([i - 0.2 for i in x], [r["decode_tok_s"] for r in off], 0.4, label="4 KiB pages", color="tab:gray")
    bars = ax.bar([i + 0.2 for i in x], [r["decode_tok_s"] for r in pairs], 0.4, label="2 MiB pages",
                  color="tab:blue")
    ax.bar_label(bars, labels=[f"{r['speedup']:.2f}x" for r in pairs], fontsize=7)
    ax.set_xticks(list(x), [f"{r['engine']}\nbs{r['batch_size']}" for r in pairs], fontsize=7)
    ax.set_ylabel("decode tok/s")
    ax.set_title(f"packed weights on huge pages ({report['machine']['cpu']})", fontsize=9)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    from trtinfer.runtime.huge_pages import thp_mode

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("engines", nargs="+", type=Path, help="engine directories")
    ap.add_argument("--batch-sizes", nargs="+", type=int, default=[1, 8])
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--out", default=None, help="PREFIX of the .json and .png")
    args = ap.parse_args(argv)
    probes = int4_probes()
    rows = measure(args.engines, args.batch_sizes, args.prompt_len, args.new_tokens, args.rounds)
    probes += int4_probes()
    report = {"machine": machine_info(), "git_commit": git_commit(), "thp_mode": thp_mode(),
              "prompt_len": args.prompt_len, "new_tokens": args.new_tokens, "rounds": args.rounds,
              "int4_kernel_gb_s": int4_ceilings(probes), "int4_kernel_probes": probes, "rows": rows}
    print(format_table(report))
    prefix = Path(args.out) if args.out else result_path("huge_pages")
    prefix.parent.mkdir(parents=True, exist_ok=True)
    prefix.with_suffix(".json").write_text(json.dumps(report, indent=2))
    chart(report, prefix.with_suffix(".png"))
    print(f"\nwrote {prefix.with_suffix('.json')} and {prefix.with_suffix('.png')}")
    return report


if __name__ == "__main__":
    main()
