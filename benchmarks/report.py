"""Turns the rows of `run_all.py` into one table (text and Markdown), JSON, a PNG and targets."""

from __future__ import annotations

import json
import os
from typing import Any

# (description, group, shape, numerator pipeline, denominator pipeline, minimum ratio)
TARGETS = [
    ("read small >= memmap + threads", "read", "small", "keras-tfr", "memmap-threads", 1.0),
    ("read large >= memmap + threads", "read", "large", "keras-tfr", "memmap-threads", 1.0),
    (
        "read small, as_numpy_iterator >= memmap + threads",
        "read",
        "small",
        "keras-tfr-numpy",
        "memmap-threads",
        1.0,
    ),
    (
        "read large, as_numpy_iterator >= memmap + threads",
        "read",
        "large",
        "keras-tfr-numpy",
        "memmap-threads",
        1.0,
    ),
    (
        "read small, tf.data's iterator >= Keras' tf.data for in-memory arrays",
        "read",
        "small",
        "keras-tfr-tfdata",
        "keras-arrays",
        1.0,
    ),
    (
        "read large, tf.data's iterator >= Keras' tf.data for in-memory arrays",
        "read",
        "large",
        "keras-tfr-tfdata",
        "keras-arrays",
        1.0,
    ),
    ("fit small >= memmap + PyDataset", "fit", "small", "keras-tfr", "memmap-pydataset", 1.0),
    ("fit large >= memmap + PyDataset", "fit", "large", "keras-tfr", "memmap-pydataset", 1.0),
    ("read large2g >= memmap + threads", "read", "large2g", "keras-tfr", "memmap-threads", 1.0),
    (
        "fit large2g >= memmap + PyDataset",
        "fit",
        "large2g",
        "keras-tfr",
        "memmap-pydataset",
        1.0,
    ),
    ("read small >= 7x tutorial", "read", "small", "keras-tfr", "tutorial", 7.0),
    (
        "read small >= 2x from_tensor_slices",
        "read",
        "small",
        "keras-tfr",
        "from_tensor_slices",
        2.0,
    ),
    ("read large >= 2x tutorial", "read", "large", "keras-tfr", "tutorial", 2.0),
    ("read large >= 25% of raw page-cache read", "read", "large", "keras-tfr", "raw-read", 0.25),
    ("fit small >= in-memory NumPy fit", "fit", "small", "keras-tfr", "numpy", 1.0),
    ("fit large >= in-memory NumPy fit", "fit", "large", "keras-tfr", "numpy", 1.0),
    ("write small >= 75% of np.save", "write", "small", "keras-tfr", "np.save", 0.75),
    ("write large >= 75% of np.save", "write", "large", "keras-tfr", "np.save", 0.75),
    (
        "write small >= 75% of np.save + fsync",
        "write",
        "small",
        "keras-tfr",
        "np.save-fsync",
        0.75,
    ),
    (
        "write large >= 75% of np.save + fsync",
        "write",
        "large",
        "keras-tfr",
        "np.save-fsync",
        0.75,
    ),
    ("write small >= 20x tutorial writer", "write", "small", "keras-tfr", "tutorial", 20.0),
]


def _label(pipeline: str) -> str:
    from run_all import LABELS

    return LABELS.get(pipeline, pipeline)


def _rate(rows: list[dict], group: str, shape: str, pipeline: str, scale: int = 1):
    for r in rows:
        if (r["group"], r["shape"], r["pipeline"], r.get("scale", 1)) == (
            group,
            shape,
            pipeline,
            scale,
        ):
            return r.get("examples_per_s")
    return None


def targets(results: dict[str, Any]) -> list[dict[str, Any]]:
    rows = results["rows"]
    out = []
    for desc, group, shape, num, den, minimum in TARGETS:
        a, b = _rate(rows, group, shape, num), _rate(rows, group, shape, den)
        ratio = a / b if a and b else None
        out.append(
            {
                "target": desc,
                "ratio": ratio,
                "minimum": minimum,
                "met": None if ratio is None else ratio >= minimum,
            }
        )
    for r in rows:  # the paired groups: per-round ratios in one process (run_all.paired_rows)
        what = {"paired": "fit", "paired-read": "read"}.get(r["group"])
        if what is None:
            continue
        name = "" if r["pipeline"] == "keras-tfr" else f", {_label(r['pipeline'])},"
        for den, vs in r.get("vs", {}).items():
            lo, hi = vs["interval"]
            out.append(
                {
                    "target": (
                        f"{what} {r['shape']}{name} >= {_label(den)}, epochs alternated in "
                        f"one process (median of {len(vs['ratios'])} rounds' ratios; 95 % "
                        f"interval {lo:.3f}x-{hi:.3f}x)"
                    ),
                    "ratio": vs["median"],
                    "minimum": 1.0,
                    "met": vs["median"] >= 1.0,
                }
            )
    for op in (
        "write keras-tfr",
        "read keras-tfr",
        "read keras-tfr-windows",
        "read memmap-threads",
    ):
        peer = "keras-tfr" not in op  # shown beside ours, not a target of ours
        one = [r for r in rows if r["group"] == "rss" and r["pipeline"] == op and r["scale"] == 1]
        four = [r for r in rows if r["group"] == "rss" and r["pipeline"] == op and r["scale"] == 4]
        for key, what in (
            ("peak_rss_mb", "peak RSS"),
            ("peak_private_mb", "peak private memory"),
            ("peak_heap_mb", "peak heap in use"),
        ):
            if one and four and key in one[0] and key in four[0]:
                ratio = four[0][key] / one[0][key]
                out.append(
                    {
                        "target": (
                            f"{what}, {op} (peer): 4x data vs 1x"
                            if peer
                            else f"{what}, {op.replace(' keras-tfr', '')}: 4x data within 10% of 1x"
                        ),
                        "ratio": ratio,
                        "minimum": None,
                        "met": None if peer else ratio <= 1.10,
                    }
                )
    return out


def table_rows(results: dict[str, Any]) -> list[list[str]]:
    rows = results["rows"]
    out = []
    for r in rows:
        if r["group"] == "rss":
            continue
        kt = _rate(rows, r["group"], r["shape"], "keras-tfr")
        eps = r.get("examples_per_s")
        if eps:
            ratio = f"{kt / eps:.2f}x" if kt else "-"
            out.append(
                [
                    r["group"],
                    r["shape"],
                    _label(r["pipeline"]),
                    f"{eps:,.0f}",
                    f"{r['mb_per_s']:,.0f}",
                    f"{r['peak_rss_mb']:,.0f}" if "peak_rss_mb" in r else "-",
                    f"{r['cpu_s_per_gb']:.2f}" if "cpu_s_per_gb" in r else "-",
                    ratio,
                ]
            )
        else:
            err = str(r.get("error", "no result")).strip().splitlines()
            out.append(
                [r["group"], r["shape"], _label(r["pipeline"]), "-", "-", "-", "-", err[-1][:60]]
            )
    for r in rows:
        if r["group"] == "rss":
            eps = r.get("examples_per_s")
            out.append(
                [
                    "rss",
                    f"{r['shape']} x{r['scale']}",
                    r["pipeline"],
                    f"{eps:,.0f}" if eps else "-",
                    f"{r['mb_per_s']:,.0f}" if eps else "-",
                    f"{r.get('peak_rss_mb', 0):,.0f}",
                    "-",
                    f"private {r.get('peak_private_mb', 0):,.0f} MB"
                    + (f", heap in use {r['peak_heap_mb']:,.0f} MB" if "peak_heap_mb" in r else ""),
                ]
            )
    return out


HEADER = [
    "bench",
    "shape",
    "pipeline",
    "examples/s",
    "MB/s",
    "peak RSS MB",
    "CPU s/GB",
    "keras-tfr ÷ this",
]


def text_table(rows: list[list[str]]) -> str:
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(HEADER)]
    lines = ["  ".join(h.ljust(w) for h, w in zip(HEADER, widths))]
    lines.append("  ".join("-" * w for w in widths))
    for r in rows:
        lines.append("  ".join(c.ljust(w) for c, w in zip(r, widths)))
    return "\n".join(lines)


def markdown_table(rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(HEADER) + " |", "|" + "---|" * len(HEADER)]
    for r in rows:
        lines.append("| " + " | ".join(r) + " |")
    return "\n".join(lines)


def targets_text(tg: list[dict[str, Any]], markdown: bool = False) -> str:
    lines = []
    if markdown:
        lines += ["| target | measured | met |", "|---|---|---|"]
    for t in tg:
        ratio = "-" if t["ratio"] is None else f"{t['ratio']:.2f}x"
        met = {True: "yes", False: "NO", None: "n/a"}[t["met"]]
        if markdown:
            lines.append(f"| {t['target']} | {ratio} | {met} |")
        else:
            lines.append(f"  [{met:3s}] {t['target']}: {ratio}")
    return "\n".join(lines)


def machine_text(results: dict[str, Any]) -> str:
    m = results["machine"]
    v = ", ".join(f"{k} {val}" for k, val in m["versions"].items() if val)
    shapes = "; ".join(
        f"{k}: {s['samples']:,} x {tuple(s['shape'])} ({s.get('data_mb', 0):,.0f} MB)"
        for k, s in results["shapes"].items()
    )
    return (
        f"{m['cpu']}, {m['cores']} cores, {m['memory_gb']} GB RAM, Python {m['python']}; {v}. "
        f"Load average at start {results['load_avg_start']}, at end {results['load_avg_end']}; "
        f"total {results['total_seconds']:.0f} s{' (--quick)' if results['quick'] else ''}. "
        f"Data: {shapes}; batch {results['batch_size']}."
    )


def chart(results: dict[str, Any], path: str) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    panels = [
        (g, s)
        for g in ("read", "fit", "write")
        for s in results["shapes"]
        if any(r["group"] == g and r["shape"] == s for r in results["rows"])
    ]
    if not panels:
        return False
    fig, axes = plt.subplots(len(panels), 1, figsize=(9, 2.0 + 1.1 * len(panels) * 2))
    axes = axes if len(panels) > 1 else [axes]
    for ax, (g, s) in zip(axes, panels):
        rows = [r for r in results["rows"] if r["group"] == g and r["shape"] == s]
        names = [_label(r["pipeline"]) for r in rows]
        vals = [r.get("examples_per_s") or 0 for r in rows]
        colors = ["tab:green" if r["pipeline"] == "keras-tfr" else "tab:gray" for r in rows]
        ax.barh(names, vals, color=colors)
        ax.invert_yaxis()
        ax.set_title(f"{g}, {s} samples (examples/s)", fontsize=9)
        ax.tick_params(labelsize=7)
        ax.set_xscale("log")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def render(results: dict[str, Any], out: str) -> str:
    rows = table_rows(results)
    tg = targets(results)
    results["targets"] = tg
    with open(os.path.join(out, "results.json"), "w") as f:
        json.dump(results, f, indent=1)
    chart(results, os.path.join(out, "results.png"))
    md = "\n\n".join(
        [
            markdown_table(rows),
            targets_text(tg, markdown=True),
            "Machine: " + machine_text(results),
        ]
    )
    with open(os.path.join(out, "results.md"), "w") as f:
        f.write(md + "\n")
    return "\n".join(
        [
            text_table(rows),
            "",
            "Targets (ratios from this run):",
            targets_text(tg),
            "",
            "Machine: " + machine_text(results),
        ]
    )
