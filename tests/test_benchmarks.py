"""`benchmarks/run_all.py` (`make bench`) end to end on tiny data, in a subprocess: what
docs/benchmarks.md says it produces (results.json, .md and .png; `--quick`, `--only`,
`--shapes`, `--pipelines`, `--rounds`; rates, ratios to keras-tfr, CPU-seconds per GB and
peak memory per row), checked for structure and consistency, never for speed.

The runner has no option for the number of samples: the driver is imported and its
``SHAPES["small"]`` made tiny before `main` runs (its workers take the sample count and
shape from the driver). Each worker that imports TensorFlow costs seconds, so the run
reads with the two pipelines that do not (`raw-read` and `memmap-threads`), beside the
write group (the keras-tfr writer and the tutorial's, both TensorFlow).
"""

from __future__ import annotations

import ctypes
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"
SAMPLES = 1200  # `--quick`: 300 samples, a batch of 256 and one of 44
SHAPE = (8, 8, 1)
SAMPLE_BYTES = 4 * 8 * 8 * 1 + 4  # float32 x, int32 y
READ = {"raw-read", "memmap-threads"}
WRITE = {"keras-tfr", "np.save", "np.save-fsync", "tutorial"}
ROUNDS = 3

# The driver, its "small" shape made tiny (the name kept: the chart and the rss group use it).
DRIVER = textwrap.dedent(
    f"""
    import sys
    sys.path.insert(0, sys.argv[1])
    import run_all
    assert "small" in run_all.SHAPES, sorted(run_all.SHAPES)
    run_all.SHAPES["small"] = {{"samples": {SAMPLES}, "shape": {SHAPE!r}}}
    sys.exit(run_all.main(sys.argv[2:]))
    """
)


def _run(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3", "PYTHONDONTWRITEBYTECODE": "1"}
    return subprocess.run(
        [sys.executable, "-c", DRIVER, str(BENCHMARKS), *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


@pytest.fixture(scope="module")
def bench(tmp_path_factory):
    """One run (`make test` runs a file's tests in one worker: `--dist loadfile`)."""
    tmp = tmp_path_factory.mktemp("bench")
    out, data = tmp / "results", tmp / "data"
    proc = _run(
        "--quick",
        "--only", "read,write",
        "--shapes", "small",
        "--pipelines", ",".join(sorted(READ)),
        "--rounds", str(ROUNDS),
        "--out", str(out),
        "--data-dir", str(data),
        "--keep-data",
    )  # fmt: skip
    assert proc.returncode == 0, (proc.stdout[-2000:], proc.stderr[-3000:])
    results = json.loads((out / "results.json").read_text())
    return {"proc": proc, "out": out, "data": data, "results": results}


def _rows(results, group=None):
    return [r for r in results["rows"] if group is None or r["group"] == group]


def _row(results, group, pipeline):
    """The row of `pipeline` in `group`, or None."""
    found = [r for r in _rows(results, group) if r["pipeline"] == pipeline]
    assert len(found) <= 1, found
    return found[0] if found else None


def _rate(results, group, pipeline):
    row = _row(results, group, pipeline)
    return row and row.get("examples_per_s")


@pytest.mark.slow
@pytest.mark.subprocess
def test_writes_json_markdown_and_png_into_out(bench):
    out, proc = bench["out"], bench["proc"]
    assert sorted(p.name for p in out.iterdir()) == ["results.json", "results.md", "results.png"]
    assert (out / "results.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    md = (out / "results.md").read_text()
    header = (
        "bench | shape | pipeline | examples/s | MB/s | peak RSS MB | CPU s/GB | keras-tfr ÷ this"
    )
    assert md.splitlines()[0] == f"| {header} |"
    assert "| target | measured | met |" in md
    assert "Machine: " in md and "(--quick)" in md
    # The same table on stdout, then where the files went.
    assert "keras-tfr ÷ this" in proc.stdout
    assert f"done; results in {out}" in proc.stdout
    results = bench["results"]
    assert results["batch_size"] == 256
    assert results["total_seconds"] > 0
    assert {"cpu", "cores", "python", "versions"} <= set(results["machine"])


@pytest.mark.slow
@pytest.mark.subprocess
def test_quick_reads_a_quarter_of_the_samples_of_the_shapes_asked(bench):
    results = bench["results"]
    assert results["quick"] is True
    assert set(results["shapes"]) == {"small"}
    small = results["shapes"]["small"]
    assert small["samples"] == SAMPLES // 4
    assert small["shape"] == list(SHAPE)
    assert small["sample_bytes"] == SAMPLE_BYTES
    assert small["data_mb"] == pytest.approx(SAMPLES // 4 * SAMPLE_BYTES / 1e6)
    assert {r["shape"] for r in results["rows"]} == {"small"}


@pytest.mark.slow
@pytest.mark.subprocess
def test_only_and_pipelines_choose_the_rows_and_the_formats_written(bench):
    results = bench["results"]
    assert {r["group"] for r in results["rows"]} == {"read", "write"}  # no fit, no rss
    for group, wanted in (("read", READ), ("write", WRITE)):
        pipelines = [r["pipeline"] for r in _rows(results, group)]
        assert sorted(pipelines) == sorted(wanted)
    # No chosen pipeline reads the per-sample raw TFRecords, ArrayRecord or tf.data's
    # save: none was written (`--keep-data` would have kept them).
    written = {p.name for p in bench["data"].rglob("*") if p.is_dir()}
    assert "ktfr" in written
    assert not written & {"raw", "arrayrecord", "tfsave"}, written


@pytest.mark.slow
@pytest.mark.subprocess
def test_every_row_gives_consistent_rates_and_memory(bench):
    results = bench["results"]
    n = SAMPLES // 4
    heap = hasattr(ctypes.CDLL(None), "mallinfo2")  # glibc 2.33 and later
    for r in results["rows"]:
        assert "error" not in r, r
        assert r["examples"] == n, r  # an epoch (or a write) is every sample
        assert r["seconds"] > 0 and r["scale"] == 1, r
        assert r["examples_per_s"] == pytest.approx(n / r["seconds"], rel=1e-9), r
        assert r["mb_per_s"] == pytest.approx(r["examples_per_s"] * SAMPLE_BYTES / 1e6), r
        # docs/benchmarks.md: every read and fit row gives CPU-seconds per GB.
        assert ("cpu_seconds" in r) == (r["group"] in ("read", "fit")), r
        if "cpu_seconds" in r:
            gb = n * SAMPLE_BYTES / 1e9
            assert r["cpu_s_per_gb"] == pytest.approx(r["cpu_seconds"] / gb, rel=1e-9), r
        # Peak RSS (`ru_maxrss`), peak private memory (`RssAnon`, sampled every 20 ms,
        # never above RSS) and peak heap in use (`mallinfo2`).
        assert 0 < r["peak_private_mb"] <= r["peak_rss_mb"], r
        assert ("peak_heap_mb" in r) == heap, r
        if heap:
            assert r["peak_heap_mb"] > 0, r
    memmap, raw = _row(results, "read", "memmap-threads"), _row(results, "read", "raw-read")
    tutorial = _row(results, "write", "tutorial")
    assert memmap and raw and tutorial, results["rows"]
    assert memmap.get("cpu_seconds", 0) > 0 and memmap.get("cpu_s_per_gb", 0) > 0, memmap
    assert raw.get("file_bytes", 0) > 0, raw
    # Each measurement in its own process: the peer, which never imports TensorFlow, peaks
    # far below the tutorial's writer, which does (`ru_maxrss` only grows in a process).
    assert memmap["peak_rss_mb"] < tutorial["peak_rss_mb"] / 2, (memmap, tutorial)


@pytest.mark.slow
@pytest.mark.subprocess
def test_rounds_keep_each_pipelines_median_round(bench):
    for r in _rows(bench["results"], "read"):
        rounds = r.get("round_seconds", [])
        assert len(rounds) == ROUNDS and all(s > 0 for s in rounds), r
        assert r["seconds"] == sorted(rounds)[(ROUNDS - 1) // 2], r


@pytest.mark.slow
@pytest.mark.subprocess
def test_ratios_are_keras_tfr_rate_over_the_peer_rate(bench):
    results = bench["results"]
    # The targets of results.json: a ratio where both pipelines ran, else none.
    measured = set()
    for t in results["targets"]:
        if t["minimum"] is None:  # the rss group's (not run)
            continue
        desc = t["target"]
        group, shape = desc.split()[0], desc.split()[1].rstrip(",")
        if shape != "small":
            assert t["ratio"] is None and t["met"] is None, t
            continue
        pairs = {
            "write small >= 75% of np.save": ("keras-tfr", "np.save"),
            "write small >= 75% of np.save + fsync": ("keras-tfr", "np.save-fsync"),
            "write small >= 20x tutorial writer": ("keras-tfr", "tutorial"),
        }
        if desc in pairs:
            a, b = (_rate(results, group, p) for p in pairs[desc])
            assert a and b, (desc, results["rows"])
            assert t["ratio"] == pytest.approx(a / b, rel=1e-9), t
            assert t["met"] == (t["ratio"] >= t["minimum"]), t
            measured.add(desc)
        else:  # keras-tfr's read and fit were not chosen
            assert t["ratio"] is None and t["met"] is None, t
    assert len(measured) == 3, measured
    assert not [t for t in results["targets"] if t["minimum"] is None]  # no rss group
    # The table's last column: keras-tfr's rate in the same group ÷ this row's, "-" where
    # keras-tfr did not run in that group (read here); the rss group is not in the table.
    lines = (bench["out"] / "results.md").read_text().splitlines()
    table = [line.split(" | ") for line in lines[2 : 2 + len(results["rows"])]]
    assert len(table) == len(results["rows"]) and lines[2 + len(table)] == ""
    for cells, r in zip(table, results["rows"]):
        assert cells[0] == "| " + r["group"] and cells[1] == r["shape"], (cells, r)
        assert cells[3] == f"{r['examples_per_s']:,.0f}", (cells, r)
        kt = _rate(results, r["group"], "keras-tfr")
        want = f"{kt / r['examples_per_s']:.2f}x" if kt else "-"
        assert cells[-1] == want + " |", (cells, r)
    assert [c[-1] for c in table if c[0] == "| write" and c[2] == "keras-tfr"] == ["1.00x |"]


@pytest.mark.slow
@pytest.mark.subprocess
def test_without_the_write_group_only_the_data_read_is_written(tmp_path):
    """``--only read``: no write rows, and only the data its pipelines read (the memmap
    peer reads the generated `.npy`: no keras-tfr or tutorial data)."""
    out, data = tmp_path / "results", tmp_path / "data"
    proc = _run(
        "--quick", "--only", "read", "--shapes", "small", "--pipelines", "memmap-threads",
        "--out", str(out), "--data-dir", str(data), "--keep-data",
    )  # fmt: skip
    assert proc.returncode == 0, (proc.stdout[-2000:], proc.stderr[-3000:])
    results = json.loads((out / "results.json").read_text())
    assert [(r["group"], r["pipeline"]) for r in results["rows"]] == [("read", "memmap-threads")]
    written = {p.name for p in data.rglob("*") if p.is_dir()}
    assert not written & {"ktfr", "tutorial", "npsave"}, written
    assert (out / "results.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.subprocess
def test_unknown_pipelines_are_refused_before_any_work(tmp_path):
    out = tmp_path / "results"
    proc = _run(
        "--pipelines", "memmap-threads,nope", "--out", str(out), "--data-dir", str(tmp_path / "d")
    )
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "unknown pipelines ['nope']" in proc.stderr
    assert not out.exists() and not (tmp_path / "d").exists()


@pytest.mark.slow
@pytest.mark.subprocess
def test_paired_group_gives_each_rounds_ratio_and_an_interval(tmp_path):
    """``--only paired``: one process fits keras-tfr, in-memory NumPy and memmap +
    PyDataset an epoch each per round (``paired``), another reads keras-tfr in a loop and
    through `as_numpy_iterator()` and memmap + threads (``paired-read``); each keras-tfr
    row holds, per pipeline it is compared with, each round's ratio (the other's epoch
    time over keras-tfr's), their median and an interval around it, and the targets say
    whether the median reaches 1.0."""
    out, data = tmp_path / "results", tmp_path / "data"
    proc = _run(
        "--quick", "--only", "paired", "--shapes", "small", "--paired-rounds", "3",
        "--out", str(out), "--data-dir", str(data),
    )  # fmt: skip
    assert proc.returncode == 0, (proc.stdout[-2000:], proc.stderr[-3000:])
    results = json.loads((out / "results.json").read_text())
    assert {r["group"] for r in results["rows"]} == {"paired", "paired-read"}
    compared = {
        "paired": {"keras-tfr": ["memmap-pydataset", "numpy"]},
        "paired-read": {
            "keras-tfr": ["memmap-threads"],
            "keras-tfr-numpy": ["memmap-threads"],
        },
    }
    for group, ours in compared.items():
        rows = {r["pipeline"]: r for r in _rows(results, group)}
        assert sorted(rows) == sorted({*ours, *(p for ps in ours.values() for p in ps)})
        for r in rows.values():
            assert len(r["round_seconds"]) == 3
            assert r["seconds"] == pytest.approx(float(np.median(r["round_seconds"])))
            assert r["examples"] == SAMPLES // 4
            assert r["examples_per_s"] == pytest.approx(r["examples"] / r["seconds"])
        for mine, others in ours.items():
            assert sorted(rows[mine]["vs"]) == others
            for other, vs in rows[mine]["vs"].items():
                walls = zip(rows[mine]["round_seconds"], rows[other]["round_seconds"])
                expected = [t / m for m, t in walls]
                assert vs["ratios"] == pytest.approx(expected)
                assert vs["median"] == pytest.approx(float(np.median(expected)))
                lo, hi = vs["interval"]
                assert min(expected) <= lo <= vs["median"] <= hi <= max(expected)
    paired = [t for t in results["targets"] if "epochs alternated" in t["target"]]
    assert [t["target"].split(" >= ")[0] for t in paired] == [
        "fit small",
        "fit small",
        "read small",
        "read small, keras-tfr as_numpy_iterator(),",
    ]
    for t in paired:
        assert t["met"] == (t["ratio"] >= 1.0)
    assert "epochs alternated in one process" in (out / "results.md").read_text()


@pytest.mark.subprocess
def test_paired_rounds_below_one_are_refused_before_any_work(tmp_path):
    out = tmp_path / "results"
    proc = _run("--paired-rounds", "0", "--out", str(out), "--data-dir", str(tmp_path / "d"))
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "--paired-rounds must be at least 1, got 0" in proc.stderr
    assert not out.exists() and not (tmp_path / "d").exists()


def _fit_paired():
    sys.path.insert(0, str(BENCHMARKS))
    try:
        import fit_paired
    finally:
        sys.path.remove(str(BENCHMARKS))
    return fit_paired


def test_fit_paired_interval_brackets_the_median_and_narrows_with_rounds():
    fit_paired = _fit_paired()
    rng = np.random.default_rng(1)
    few = list(1.0 + 0.08 * rng.standard_normal(10))
    many = list(1.0 + 0.08 * rng.standard_normal(160))
    lo_few, hi_few = fit_paired.median_interval(few)
    lo_many, hi_many = fit_paired.median_interval(many)
    assert lo_few <= float(np.median(few)) <= hi_few
    assert lo_many <= float(np.median(many)) <= hi_many
    assert hi_many - lo_many < (hi_few - lo_few) / 2  # 16x the rounds: about a quarter
    assert fit_paired.median_interval(few) == (lo_few, hi_few)  # seeded
    # Rounds all 3 % above parity: the interval leaves 1.0 out.
    assert fit_paired.median_interval([1.03] * 5 + [1.02, 1.04] * 5)[0] > 1.0
    with pytest.raises(ValueError, match="at least one ratio"):
        fit_paired.median_interval([])
