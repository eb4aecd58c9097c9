"""PNG of a bench_serve JSON: warm-hit rate and p50/p99 latency per router.

    python benchmarks/plot_serve.py benchmarks/results/bench_serve.json   # writes bench_serve.png beside it
"""
import json
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def main(path):
    data = json.loads(Path(path).read_text())
    routers = list(data["results"])
    res = [data["results"][r] for r in routers]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(9, 3.6))
    ax1.bar(routers, [100 * r["warm_hit_rate"] for r in res], color=["tab:green", "tab:gray"][: len(res)])
    ax1.set_ylabel("warm-hit rate (%)")
    ax1.set_ylim(0, 105)
    for i, r in enumerate(res):
        ax1.text(i, 100 * r["warm_hit_rate"] + 1, f"{100 * r['warm_hit_rate']:.0f}%", ha="center")
    width = 0.38
    xs = range(len(res))
    ax2.bar([x - width / 2 for x in xs], [r["p50_ms"] for r in res], width, label="p50")
    ax2.bar([x + width / 2 for x in xs], [r["p99_ms"] for r in res], width, label="p99")
    ax2.set_xticks(list(xs), routers)
    ax2.set_ylabel("latency (ms)")
    ax2.legend()
    a = data["args"]
    fig.suptitle(f"{a['model']}: {a['replicas']} replicas x {a['gpus_per_replica']} GPU, {a['requests']} requests, "
                 f"{a['placement']} warmup", fontsize=10)
    fig.tight_layout()
    out = Path(path).with_suffix(".png")
    fig.savefig(out, dpi=110)
    print("wrote", out)


if __name__ == "__main__":
    main(sys.argv[1])
