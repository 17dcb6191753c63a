"""PNG charts of the benchmark results: ``python -m benchmarks.plots [--quick] [--only w1,w3] [--markdown]``.

For every ``benchmarks/results/<workload>.jsonl`` (``.quick.jsonl`` with ``--quick``), one PNG beside it with a row per
timed metric: left, each contender's time over Conduit's time in the same run (and group), on a log scale (right of
the 1.0 line: Conduit is faster); right, the fraction of this machine's memcpy bandwidth each contender reached.
Titles carry the run's date, commit and load average. Needs matplotlib (the ``bench`` extra). ``--markdown`` prints
the README's tables from the same files instead (no matplotlib needed).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Optional

from benchmarks.common import RESULTS_DIR, is_baseline, read_jsonl

WORKLOADS = ("w1", "w2", "w3", "w4", "w5", "w6")
TICKS = (0.02, 0.05, 0.1, 0.2, 0.3, 0.5, 0.7, 1, 1.5, 2, 3, 5, 10, 20, 50, 100)


def _label(rec: dict) -> str:
    return rec["contender"] + (f"  [{rec['group']}]" if rec.get("group") else "")


def plot_file(path: Path, out: Optional[Path] = None) -> Optional[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FixedLocator, FuncFormatter, NullFormatter

    env, records = read_jsonl(path)
    timings = [r for r in records if r.get("record") == "timing"]
    if not timings:
        return None
    metrics = list(dict.fromkeys(r["metric"] for r in timings))
    heights = [max(1.6, 0.32 * sum(1 for r in timings if r["metric"] == m) + 0.9) for m in metrics]
    fig, axes = plt.subplots(len(metrics), 2, figsize=(13, sum(heights) + 0.8), squeeze=False,
                             gridspec_kw={"height_ratios": heights, "width_ratios": [3, 2]})
    for row, metric in enumerate(metrics):
        rows = [r for r in timings if r["metric"] == metric][::-1]  # matplotlib draws the first bar at the bottom
        labels = [_label(r) for r in rows]
        ratios = [r.get("x_over_conduit") or float("nan") for r in rows]
        colors = ["#2b6cb0" if is_baseline(r["contender"]) else ("#c05621" if (x or 0) < 1 else "#718096")
                  for r, x in zip(rows, ratios)]
        ax = axes[row][0]
        ax.barh(range(len(rows)), ratios, color=colors)
        ax.set_xscale("log")
        finite = [x for x in ratios if x == x and x > 0] or [1.0]
        lo, hi = min(finite + [1.0]), max(finite + [1.0])
        ax.set_xlim(lo / 1.4, hi * 2.2)  # room for the value labels
        ax.xaxis.set_major_locator(FixedLocator([t for t in TICKS if lo / 1.4 <= t <= hi * 2.2]))
        ax.xaxis.set_major_formatter(FuncFormatter(lambda x, _: f"{x:g}x"))
        ax.xaxis.set_minor_formatter(NullFormatter())
        ax.axvline(1.0, color="black", linewidth=0.8)
        ax.set_yticks(range(len(rows)), labels, fontsize=8)
        ax.set_title(f"{metric}: contender time / Conduit time (>1: Conduit faster)", fontsize=9)
        for i, (r, x) in enumerate(zip(rows, ratios)):
            ax.text(x, i, f" {x:.2f}x  ({r['median_s'] * 1e6:,.0f} us)", va="center", fontsize=7)
        ax = axes[row][1]
        frac = [100 * r["frac_memcpy"] for r in rows]
        ax.barh(range(len(rows)), frac, color=colors)
        ax.axvline(100.0, color="black", linewidth=0.8, linestyle=":")
        ax.set_yticks(range(len(rows)), [""] * len(rows))
        ax.set_title("% of memcpy bandwidth (same run)", fontsize=9)
        for i, f in enumerate(frac):
            ax.text(f, i, f" {f:.1f}%", va="center", fontsize=7)
    commit = (env.get("commit") or "?")[:8] + ("+dirty" if env.get("conduit_jax_dirty") else "")
    load = env.get("load_average") or [float("nan")]
    fig.suptitle(f"{env.get('workload', path.stem)}: {env.get('description', '')}\n{env.get('date', '')}, "
                 f"conduit_jax {commit}, load {load[0]:.1f}, memcpy "
                 f"{(env.get('memcpy') or {}).get('bytes_per_s', float('nan')) / 1e9:.1f} GB/s", fontsize=10)
    fig.tight_layout()
    out = out or path.with_suffix(".png")
    fig.savefig(out, dpi=90)
    plt.close(fig)
    return out


def _rate(x: float) -> str:
    for unit, scale in (("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if x >= scale:
            return f"{x / scale:.2f}{unit}"
    return f"{x:.0f}"


def markdown(path: Path) -> str:
    """The README section of one results file: per metric a table (median, p99, rate, % memcpy, ratio), then memory
    and goals, every number read from the file."""
    env, records = read_jsonl(path)
    timings = [r for r in records if r.get("record") == "timing"]
    grouped = any(r.get("group") for r in timings)
    commit = (env.get("commit") or "?")[:7] + (" (dirty)" if env.get("conduit_jax_dirty") else "")
    load = env.get("load_average") or [float("nan")]
    memcpy = (env.get("memcpy") or {}).get("bytes_per_s", float("nan")) / 1e9
    settings = env.get("settings") or {}
    out = [f"**{env.get('workload', path.stem).upper()}**: {env.get('description', '')} ({settings.get('rounds')} "
           f"rounds; {env.get('date', '')[:16]}, conduit_jax {commit}, load average {load[0]:.1f}, memcpy "
           f"{memcpy:.2f} GB/s)", ""]
    for metric in dict.fromkeys(r["metric"] for r in timings):
        rows = [r for r in timings if r["metric"] == metric]
        unit = rows[0].get("rate_unit") or ("items/s" if metric.startswith(("add", "store")) else
                                            "steps/s" if "x" in metric.split("_b")[-1] else "samples/s")
        out.append(f"`{metric}`" + (" (ratios within each group)" if grouped else "") + ":")
        out.append("")
        head = ("| group " if grouped else "") + f"| contender | median us | p99 us | {unit} | % memcpy | x/conduit |"
        out += [head, "|" + "---|" * (head.count("|") - 1)]
        for r in rows:
            ratio = "" if r.get("x_over_conduit") is None else f"{r['x_over_conduit']:.2f}"
            out.append(("| " + str(r.get("group", "")) + " " if grouped else "") +
                       f"| {r['contender']} | {r['median_s'] * 1e6:,.1f} | {r['p99_s'] * 1e6:,.0f} | "
                       f"{_rate(r['items_per_s'])} | {r['frac_memcpy'] * 100:.1f}% | {ratio} |")
        out.append("")
    mem = [r for r in records if r.get("record") == "memory"]
    if mem:
        seen, parts = set(), []
        for r in mem:
            if r["contender"] in seen:
                continue
            seen.add(r["contender"])
            parts.append(f"{r['contender']} {r['rss_over_raw']:.2f}")
        out += [f"Memory (RSS growth / raw {mem[0]['raw_bytes'] / 2**20:,.1f} MiB): " + ", ".join(parts) + ".", ""]
    packing = [r for r in records if r.get("record") == "packing"]  # W8: useful / computed tokens of the batches
    if packing:
        out += ["Packing efficiency (useful / computed tokens): " + ", ".join(
            f"{r['contender']} {r['efficiency']:.3f} ({r['batch_shape'][0]} x {r['batch_shape'][1]})"
            for r in packing) + ".", ""]
    for r in records:
        if r.get("record") == "unavailable":
            reason = r["reason"] if len(r["reason"]) <= 200 else r["reason"][:200].rsplit(" ", 1)[0] + " ..."
            out += [f"Unavailable: {r['contender']}: {reason}", ""]
    goals = [r for r in records if r.get("record") == "goal"]
    if goals:
        out.append("Goals:")
        for g in goals:
            if g["met"] is None:
                out.append(f"- {g['goal']}: not measured")
                continue
            kind, value = g["kind"], g["value"]
            shown = (f"{value:.2f}x" if kind == "ratio" else f"{value * 100:.1f}% of memcpy" if kind == "memcpy"
                     else f"{value:.2f}x raw" if kind == "memory" else f"{value:.3f}" if kind == "packing"
                     else f"{value:.0f}")
            miss = ""
            if not g["met"]:
                miss = (f", missed by {(g['target'] - value) * 100:.1f} points" if kind in ("memcpy", "packing") else
                        f", missed by {(g['by'] - 1) * 100:.0f}%" if g.get("by") else "")
            out.append(f"- {'met' if g['met'] else '**missed**'}: {g['goal']}: {shown}{miss}")
        out.append("")
    return "\n".join(out)


def make_plots(workloads=WORKLOADS, quick: bool = False, results: Path = RESULTS_DIR) -> list[Path]:
    written = []
    for name in workloads:
        path = results / (f"{name}.quick.jsonl" if quick else f"{name}.jsonl")
        if path.is_file():
            out = plot_file(path)
            if out is not None:
                written.append(out)
    return written


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="plot the .quick.jsonl results")
    parser.add_argument("--only", default=",".join(WORKLOADS))
    parser.add_argument("--markdown", action="store_true", help="print README tables instead of plotting")
    args = parser.parse_args(argv)
    if args.markdown:
        for name in [w.strip() for w in args.only.split(",") if w.strip()]:
            path = RESULTS_DIR / (f"{name}.quick.jsonl" if args.quick else f"{name}.jsonl")
            if path.is_file():
                print(markdown(path) + "\n")
        return 0
    written = make_plots([w.strip() for w in args.only.split(",") if w.strip()], quick=args.quick)
    for p in written:
        print(p)
    return 0 if written else 1


if __name__ == "__main__":
    sys.exit(main())
