"""``trtinfer cache info|clean|verify``: what the cache holds, remove leftovers, re-hash every entry."""
from __future__ import annotations

import argparse
import json
from typing import Any

from trtinfer._cache import CACHE_KINDS


def add_parser(sub: Any) -> None:
    """Register the verb."""
    p = sub.add_parser("cache", help="show, clean or verify the export cache (TRTINFER_CACHE)")
    actions = p.add_subparsers(dest="action", metavar="{info,clean,verify}", required=True)
    info = actions.add_parser("info", help="list entries with size, age and status")
    info.add_argument("--kind", choices=CACHE_KINDS, help="only this kind folder")
    info.add_argument("--json", action="store_true", help="print the listing as JSON")
    clean = actions.add_parser("clean", help="remove stale temp dirs and incomplete or damaged entries")
    clean.add_argument("--all", action="store_true", help="remove every entry too (live builds are left alone)")
    clean.add_argument("--kind", choices=CACHE_KINDS, help="only this kind folder")
    verify = actions.add_parser("verify", help="hash every entry against its record; remove the bad ones")
    verify.add_argument("--kind", choices=CACHE_KINDS, help="only this kind folder")
    p.set_defaults(func=run)


def _age(seconds: float) -> str:
    for unit, size in (("d", 86400), ("h", 3600), ("min", 60)):
        if seconds >= size:
            return f"{seconds / size:.0f} {unit}"
    return f"{max(seconds, 0):.0f} s"


def _mb(n: int) -> str:
    return f"{n / 1e6:.1f} MB"


def run(args: argparse.Namespace) -> int:
    """Run the verb."""
    from trtinfer._cache import cache_root, clean_cache, list_entries, verify_cache

    root = cache_root()
    if args.action == "info":
        entries = list_entries(args.kind)
        total = sum(e.bytes for e in entries)
        if args.json:
            print(json.dumps({"root": str(root), "entries": [e.to_dict() for e in entries], "total_bytes": total},
                             indent=2))
            return 0
        print(f"cache  {root}")
        width = max([len(f"{e.kind}/{e.key}") for e in entries] + [8])
        if entries:
            print(f"  {'KIND/KEY':<{width}}  {'SIZE':>10}  {'AGE':>7}  STATUS")
        for e in entries:
            status = e.status + (f" ({e.detail})" if e.detail and e.status != "incomplete" else "")
            print(f"  {e.kind + '/' + e.key:<{width}}  {_mb(e.bytes):>10}  {_age(e.age_s):>7}  {status}")
        counts = {s: sum(e.status == s for e in entries) for s in ("ok", "incomplete", "damaged", "stale temp dir",
                                                                    "building")}
        parts = [f"{n} {s}" for s, n in counts.items() if n]
        print(f"total  {len(entries)} dirs ({', '.join(parts) or 'empty'}), {_mb(total)}")
        return 0
    if args.action == "clean":
        removed = clean_cache(everything=args.all, kind=args.kind)
        for e in removed:
            print(f"removed {e.kind}/{e.key} ({e.status}, {_mb(e.bytes)})")
        print(f"freed {_mb(sum(e.bytes for e in removed))} in {len(removed)} dirs")
        return 0
    bad = 0

    def show(e: Any, problem: str | None) -> None:
        nonlocal bad
        bad += problem is not None
        print(f"{e.kind}/{e.key}  " + ("ok" if problem is None else f"removed: {problem}"), flush=True)

    results = verify_cache(args.kind, on_result=show)
    print(f"verified {len(results)} entries: {len(results) - bad} ok, {bad} removed")
    return 0
