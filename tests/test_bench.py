"""`rollq bench` plumbing: the quick benchmarks run, write their JSON and render into the doc
with their targets. No speed is asserted here (numbers belong in docs/benchmarks.md)."""

import subprocess
import sys

from rollq.harness import bench

ROOT = bench.ROOT


def test_quick_benchmarks_run_and_render_with_targets(tmp_path, monkeypatch):
    monkeypatch.setenv("ROLLQ_BENCH_RESULTS", str(tmp_path / "results"))
    for args in (["wire.py"], ["scale.py", "--depths", "100,1000", "--groups", "300", "--seen", "1,30"]):
        subprocess.run([sys.executable, str(ROOT / "bench" / args[0]), *args[1:]], check=True,
                       cwd=ROOT, timeout=300, capture_output=True)
    assert {p.name for p in (tmp_path / "results").iterdir()} == {"wire.json", "scale.json"}

    doc = tmp_path / "benchmarks.md"
    doc.write_text(f"# Benchmarks\n\nkept\n\n{bench.BEGIN}\nold table\n\n### swap\n\nswap numbers of an "
                   f"earlier run\n\n### wire\n\nold wire numbers\n{bench.END}\n\nkept too\n")
    bench.update_doc(doc)
    text = doc.read_text()
    assert "old table" not in text and "kept" in text and text.rstrip().endswith("kept too")
    tables = text[text.index(bench.BEGIN):text.index(bench.END)]
    assert "### wire" in tables and "### scale" in tables and "old wire numbers" not in tables
    # A benchmark not run this time keeps its earlier section (a one-benchmark run erased them).
    assert "### swap\n\nswap numbers of an earlier run" in tables
    assert "### passthrough" not in tables
    assert "Target: rollq >= 3x faster than json" in tables
    assert "| 1,000 |" in tables and "claim + finish" in tables  # the depth rows
    assert tables.count("target") + tables.count("Target") >= 3


def test_scoring_benchmark_runs_and_renders(tmp_path, monkeypatch):
    """`rollq bench scoring`: listed, and bench/scoring.py (tiny: a real worker, scorer and Redis)
    writes the JSON its table is rendered from."""
    assert "scoring" in bench.BENCHES
    monkeypatch.setenv("ROLLQ_BENCH_RESULTS", str(tmp_path / "results"))
    subprocess.run([sys.executable, str(ROOT / "bench" / "scoring.py"), "--groups", "40", "--n", "2",
                    "--processes", "1"], check=True, cwd=ROOT, timeout=180, capture_output=True)
    doc = tmp_path / "benchmarks.md"
    doc.write_text(f"# Benchmarks\n\n{bench.BEGIN}\n{bench.END}\n")
    bench.update_doc(doc)
    tables = doc.read_text()
    assert "### scoring" in tables and "| sync no-op (child process) |" in tables
    assert "| async no-op (scorer's loop) |" in tables and "40 groups (n=2)" in tables
