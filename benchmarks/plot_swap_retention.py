"""The README's retention plot: task retention per distance bucket with its 95% paired-bootstrap interval,
one group of bars per mapper artifact (read from each artifact's recorded figures, `mapper.json`), and the
table the README shows.

Run: python -m benchmarks.plot_swap_retention DIR [DIR ...] --png PATH [--json PATH|-]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from benchmarks.report import add_json_flag, table_stream, write_json


def _rows(directory: Path) -> list[dict[str, object]]:
    doc = json.loads((directory / "mapper.json").read_text())
    q = doc["quality"]
    rows = []
    for bucket in ("8W", "32W"):
        if f"retention_{bucket}" not in q:
            continue
        rows.append({
            "mapper": directory.name,
            "sender": doc["sender"]["name"],
            "receiver": doc["receiver"]["name"],
            "kinds": "+".join(sorted({layer[p]["kind"] for layer in doc["layers"] for p in ("kv", "index")})),
            "bucket": bucket,
            "episodes": int(q[f"task_{bucket}_episodes"]),
            "task_seed": int(q.get("task_seed", -1)),
            "sender_acc": q[f"task_{bucket}_sender_acc"],
            "receiver_acc": q[f"task_{bucket}_receiver_acc"],
            "mapped_acc": q[f"task_{bucket}_mapped_acc"],
            "floor_acc": q[f"task_{bucket}_floor_acc"],
            "retention": q[f"retention_{bucket}"],
            "ci_lower": q[f"retention_{bucket}_ci_lower"],
            "ci_upper": q[f"retention_{bucket}_ci_upper"],
            "gap_recovered_vs_floor": q[f"task_{bucket}_gap_recovered_vs_floor"],
            "passed_gate": doc["passed_gate"],
        })
    return rows


def plot(rows: list[dict[str, object]], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = sorted({f"{r['sender']} -> {r['receiver']}" for r in rows}, key=str)
    buckets = ["8W", "32W"]
    fig, ax = plt.subplots(figsize=(7, 3.6))
    width = 0.8 / len(buckets)
    for j, b in enumerate(buckets):
        xs, ys, lo, hi = [], [], [], []
        for i, label in enumerate(labels):
            hit = [r for r in rows if f"{r['sender']} -> {r['receiver']}" == label and r["bucket"] == b]
            if hit:
                r = hit[0]
                xs.append(i + (j - 0.5) * width)
                ys.append(r["retention"])
                lo.append(float(r["retention"]) - float(r["ci_lower"]))
                hi.append(float(r["ci_upper"]) - float(r["retention"]))
        back = "8" if b == "8W" else "32"
        ax.bar(xs, ys, width, yerr=[lo, hi], capsize=3, label=f"{b} (evidence {back} windows back)")
    ax.axhline(0.8, color="red", linestyle="--", linewidth=1, label="gate: lower bound >= 0.80")
    ax.axhline(0.9, color="gray", linestyle=":", linewidth=1, label="target 0.90")
    ax.set_xticks(range(len(labels)), labels, fontsize=8)
    ax.set_ylabel("retention (mapped / receiver's own)")
    ax.set_ylim(0, 1.15)
    ax.set_title("MODEL_SWAP task retention, 95% paired-bootstrap intervals", fontsize=9)
    ax.legend(fontsize=7, loc="upper right")
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("dirs", nargs="+", type=Path, help="mapper artifact directories")
    parser.add_argument("--png", type=Path, required=True)
    add_json_flag(parser)
    args = parser.parse_args()
    rows = [r for d in args.dirs for r in _rows(d)]
    plot(rows, args.png)
    out = table_stream(args.json)
    print("| pair | parts | bucket | episodes | sender | receiver | mapped | floor | retention [95% CI] | "
          "gap recovered | gate |", file=out)
    print("|---|---|---|---|---|---|---|---|---|---|---|", file=out)
    for r in rows:
        verdict = "passed" if r["passed_gate"] else "refused"
        print(f"| {r['sender']} -> {r['receiver']} | {r['kinds']} | {r['bucket']} | {r['episodes']} | "
              f"{r['sender_acc']:.3f} | {r['receiver_acc']:.3f} | {r['mapped_acc']:.3f} | "
              f"{r['floor_acc']:.3f} | {r['retention']:.3f} [{r['ci_lower']:.3f}, {r['ci_upper']:.3f}] | "
              f"{r['gap_recovered_vs_floor']:.3f} | {verdict} |", file=out)
    write_json({"rows": rows, "png": str(args.png)}, args.json)


if __name__ == "__main__":
    main()
