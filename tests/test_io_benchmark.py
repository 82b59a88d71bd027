"""//io:io_benchmark's JSON rows and tools/io_vs_fio.py, on tiny files, and
//io:tier_lock_benchmark's table.

These check what the benchmark reports (fields, file states, the fio
comparison's table), not how fast anything is.
"""
import json
import os
import shutil
import subprocess
import sys

import pytest
from conftest import built_path

MIB = 1 << 20


@pytest.fixture
def io_benchmark(request):
    return built_path(request, "io_benchmark")


def run_rows(cmd):
    out = subprocess.run(cmd, check=True, capture_output=True, text=True)
    return [json.loads(line) for line in out.stdout.splitlines() if line]


def test_rows_name_the_file_state(io_benchmark, tmp_path):
    cmd = [io_benchmark, f"--paths={tmp_path}", "--size=8M",
           "--block_size=1M", "--queue_depth=4", "--ops=write,read,write",
           "--json"]
    fresh = run_rows(cmd)
    assert [r["op"] for r in fresh] == ["write", "read", "write"]
    for row in fresh:
        for key in ("op", "engine", "paths", "block_size", "queue_depth",
                    "bytes", "gb_per_s", "file_state"):
            assert key in row, key
        assert row["engine"] == "io_uring" or row["engine"] == "threadpool"
        assert row["paths"] == [str(tmp_path)]
        assert row["block_size"] == MIB and row["queue_depth"] == 4
        assert row["bytes"] == 8 * MIB and row["gb_per_s"] > 0
    # The first write lands in fallocated extents, what follows on written
    # blocks.
    assert [r["file_state"] for r in fresh] == [
        "fallocated", "written", "written"]
    prefilled = run_rows(cmd[:-2] + ["--ops=write", "--prefill", "--json"])
    assert [r["file_state"] for r in prefilled] == ["written"]
    assert not os.listdir(tmp_path), "the benchmark leaves no files"


def test_bad_flags_are_named(io_benchmark, tmp_path):
    proc = subprocess.run(
        [io_benchmark, f"--paths={tmp_path}", "--size=8M", "--ops=wirte"],
        capture_output=True, text=True)
    assert proc.returncode != 0
    assert "wirte" in proc.stderr


def test_io_vs_fio_table(io_benchmark, request, tmp_path):
    script = request.config.getoption("--io_vs_fio")
    if not script:
        pytest.skip("run through bazel: needs --io_vs_fio")
    if shutil.which("fio") is None:
        pytest.skip("fio is not installed (tools/setup.sh installs it)")
    out = subprocess.run(
        [sys.executable, script, "--dir", str(tmp_path), "--rounds", "2",
         "--size", "8M", "--bs", "1M", "--qd", "4", "--caps", "20M,10M",
         "--io_benchmark", io_benchmark, "--json"],
        check=True, capture_output=True, text=True).stdout
    rows = [json.loads(line) for line in out.splitlines() if line]
    table = [r for r in rows if "tool" in r]
    keys = {(r["op"], r["file_state"], r["tool"]) for r in table}
    assert keys == {(op, state, tool)
                    for op, state in [("write", "fallocated"),
                                      ("write", "written"),
                                      ("read", "written")]
                    for tool in ["fio", "uring", "threadpool"]}
    for r in table:
        assert r["n"] == 2 and r["min"] <= r["median_gb_per_s"] <= r["max"]
        assert r["median_gb_per_s"] > 0
        if r["tool"] == "fio":
            assert r["vs_fio"] == pytest.approx(1.0)
        if r["tool"] == "uring":
            assert r["vs_uring"] == pytest.approx(1.0)
    (throttle,) = [r["throttled_two_paths"] for r in rows
                   if "throttled_two_paths" in r]
    assert set(throttle) == {"write", "read"}
    for op in throttle.values():
        assert op["cap_sum"] == pytest.approx(0.03)
        assert len(op["per_path"]) == 2
        assert op["gb_per_s"] == pytest.approx(sum(op["per_path"]))
    assert not any(p.name.endswith(".dat") for p in tmp_path.iterdir())


def test_tier_lock_benchmark_reports_each_kind_of_wait(request, tmp_path):
    bench = built_path(request, "tier_lock_benchmark")
    out = subprocess.run([bench, "--handovers=3", "--hold_ms=5", f"--dir={tmp_path}"],
                         check=True, capture_output=True, text=True).stdout
    rows = {}
    for line in out.splitlines():
        parts = line.split()
        if len(parts) == 4 and parts[0] in ("kernel", "kernel+helper", "polled"):
            rows[parts[0]] = [float(x) for x in parts[1:]]
    assert sorted(rows) == ["kernel", "kernel+helper", "polled"], out
    for kind, (median, p90, most) in rows.items():
        assert 0 < median <= p90 <= most, (kind, out)
    assert "polled / kernel+helper (medians):" in out
    assert list(tmp_path.iterdir()) == []  # its lock files are gone
    missing = tmp_path / "missing"
    bad = subprocess.run([bench, "--handovers=1", f"--dir={missing}"],
                         capture_output=True, text=True)
    assert bad.returncode == 1 and str(missing) in bad.stderr, bad.stderr
