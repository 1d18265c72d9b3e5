"""Draw one step of a merged hpf trace (``hpf train --trace``'s trace.json) as a PNG timeline:
a row per rank and thread, hpf's ranges coloured by kind, nested ranges drawn thinner on top.

For the picture on the docs' topology page; open the JSON in https://ui.perfetto.dev to explore.
Usage: python benchmarks/draw_trace.py RUN/trace/trace.json docs/trace_2x2.png [--step 1]
"""
from __future__ import annotations

import argparse
import json
from collections import Counter, defaultdict

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.patches import Patch  # noqa: E402

# (name prefix, legend label, colour), first match wins
KINDS = [("hpf/forward", "forward (unit)", "#4c72b0"), ("hpf/backward", "backward (unit)", "#55a868"),
         ("hpf/wait", "wait", "#c44e52"), ("hpf/all-reduce loss", "wait", "#c44e52"),
         ("hpf/optimizer", "optimizer", "#dd8452"), ("hpf/grad norm", "optimizer", "#dd8452"),
         ("hpf/all-gather", "all-gather stage", "#8172b3"), ("hpf/reduce-scatter ", "reduce-scatter stage", "#937860"),
         ("hpf/shm barrier", "shm barrier", "#da8bc3"), ("hpf/copy", "copies", "#ccb974"),
         ("hpf/gather", "issue gather / reduction", "#8c8c8c"), ("hpf/reduce-scatter bucket", "issue gather / reduction", "#8c8c8c"),
         ("hpf/step", "step", "#e8e8e8")]


def kind(name: str) -> tuple[str, str]:
    for prefix, label, colour in sorted(KINDS, key=lambda k: -len(k[0])):  # longest prefix first
        if name.startswith(prefix):
            return label, colour
    return "other", "#bbbbbb"


def thread_label(names: Counter) -> str:
    if "hpf/step" in names:
        return "main"
    own = Counter({n: c for n, c in names.items() if n != "hpf/shm barrier"}) or names  # barriers sit in stages
    top = own.most_common(1)[0][0]
    return " ".join(top.replace("hpf/", "").split(",")[0].split()[:3]) + " worker"


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("trace")
    ap.add_argument("out")
    ap.add_argument("--step", type=int, default=1, help="which traced step of rank 0 (0-based; default 1)")
    args = ap.parse_args()
    events = [e for e in json.load(open(args.trace))["traceEvents"] if e.get("cat") == "hpf" and e.get("ph") == "X"]
    steps = sorted((e for e in events if e["name"] == "hpf/step" and e["pid"] == 0), key=lambda e: e["ts"])
    s = steps[min(args.step, len(steps) - 1)]
    lo, hi = s["ts"], s["ts"] + s["dur"]
    shown = [e for e in events if e["ts"] < hi and e["ts"] + e["dur"] > lo]
    threads = defaultdict(Counter)
    for e in shown:
        threads[e["pid"], e["tid"]][e["name"].split(" bucket")[0]] += 1
    rows = sorted(threads, key=lambda k: (k[0], "hpf/step" not in threads[k], k[1]))
    fig, ax = plt.subplots(figsize=(14, 0.5 * len(rows) + 1.5))
    for y, key in enumerate(rows):
        spans = sorted((e for e in shown if (e["pid"], e["tid"]) == key), key=lambda e: (e["ts"], -e["dur"]))
        stack: list[float] = []  # end times of the open ranges: the depth of each new one
        for e in spans:
            while stack and stack[-1] <= e["ts"]:
                stack.pop()
            depth = len(stack)
            stack.append(e["ts"] + e["dur"])
            h = 0.8 * 0.75 ** depth
            ax.broken_barh([((e["ts"] - lo) / 1e3, e["dur"] / 1e3)], (y - h / 2, h), color=kind(e["name"])[1],
                           edgecolor="white", linewidth=0.4)
    ax.set_yticks(range(len(rows)))
    ax.set_yticklabels([f"rank {p} {thread_label(threads[p, t])}" for p, t in rows])
    ax.invert_yaxis()
    ax.set_xlim(0, (hi - lo) / 1e3)
    ax.set_xlabel("ms from the start of rank 0's step")
    legend = {label: colour for _, label, colour in KINDS}
    ax.legend(handles=[Patch(color=c, label=l) for l, c in legend.items()], ncol=6, fontsize=8,
              loc="upper center", bbox_to_anchor=(0.5, -1.3 / len(rows)))
    ax.set_title("one training step: hpf's ranges per rank and thread", fontsize=10)
    fig.tight_layout()
    fig.savefig(args.out, dpi=110)
    print(f"wrote {args.out}: {len(rows)} rows, step {s['dur'] / 1e3:.1f} ms")


if __name__ == "__main__":
    main()
