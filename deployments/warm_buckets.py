"""A replica's warm view per batch bucket: which image counts of a warm key replay captured graphs, and
which will capture on first need (``cudagraph_capture_sizes``, `bcg.diffusers.step_batching.warmup`).

A warmup of key K runs one warmup per row bucket it captures (``K.b<bucket>``); a request of n images pads
to its bucket (3 to 4), so ``K.b<n>`` is warm where the bucket of n was captured, by the warmup or on need
later, and its graphs are live; ``K.b<n>`` *captures on need* where that bucket is one the batcher will
capture at its first use (honest: not warm yet, the first request pays the capture). The helpers turn
warmup reports into per-bucket facts for `deployments.engine.ReplicaEngine`. No torch, no Ray.
"""
from __future__ import annotations

from typing import Callable, Dict, Iterable, List

from bcg.diffusers.shape_key import ShapeKey

__all__ = ["batch_keys", "bucket_captures", "bucket_pool_bytes", "graphs_of", "merge_reports"]


def batch_keys(key: str, buckets: Iterable[int], bucket_for: Callable[[int], int]) -> List[str]:
    """``<key>.b<n>`` of every image count n whose row bucket is one of `buckets` (n up to the largest)."""
    buckets = set(buckets)
    if not buckets:
        return []
    parsed = ShapeKey.parse(key)
    return [parsed.with_batch(n).key for n in range(1, max(buckets) + 1) if bucket_for(n) in buckets]


def graphs_of(runner_stats: dict) -> Dict[tuple, dict]:
    """(component, signature key) -> the entry's record, for every live graph."""
    return {(name, e["key"]): e for name, st in runner_stats.items() for e in st.get("entries", ())}


def merge_reports(key: str, reports: List[dict]) -> dict:
    """One key's ``warmup_pipeline`` report from the reports of its bucket plan (``<key>.b<bucket>``)."""
    errors = [f"{r['key']}: {r['error']}" for r in reports if r["error"]]
    failed: Dict[str, list] = {}
    for r in reports:
        for component, reasons in r["failed"].items():
            failed.setdefault(component, []).extend(reasons)
    return {"key": key, "error": "; ".join(errors) or None, "failed": failed,
            "captured": {r["key"]: r["captured"] for r in reports}}


def bucket_pool_bytes(reports: List[dict], runner_stats: dict) -> Dict[int, int]:
    """Batch bucket -> pool bytes of the graphs its warmup run captured (0 for graphs it shared)."""
    graphs = graphs_of(runner_stats)
    return {ShapeKey.parse(r["key"]).batch_size: sum(int(graphs.get((name, sig), {}).get("pool_bytes", 0))
                                                 for name, sigs in r["captured"].items() for sig in sigs)
            for r in reports}


def bucket_captures(captured: Dict[str, dict], runner_stats: dict, new) -> Dict[str, dict]:
    """Bucket key -> the graphs its warmup run captured (new ones only) and their capture seconds (the
    runners' own ``capture_ms`` per graph: the recording, not the warm-up runs before it)."""
    graphs = graphs_of(runner_stats)
    out = {}
    for bucket, by_component in captured.items():
        mine = [(name, sig) for name, sigs in by_component.items() for sig in sigs
                if (name, sig) in new and (name, sig) in graphs]  # a dropped graph is gone
        out[bucket] = {"graphs": len(mine),
                       "graph_capture_s": round(sum(float(graphs[g].get("capture_ms") or 0) for g in mine) / 1e3, 3)}
    return out
