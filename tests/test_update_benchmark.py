"""//mlp_offload:update_benchmark with --ranks: forked ranks in lockstep over
two tiers that are shared devices (io/shared_throttle.h). Tiny sizes: this
checks what the benchmark reports, not how fast anything is."""
import json
import os
import subprocess

import pytest
from conftest import built_path


@pytest.fixture
def bench(request):
    return built_path(request, "update_benchmark")


def rows(bench, tmp_path, *extra):
    tiers = [tmp_path / "fast", tmp_path / "slow"]
    for t in tiers:
        t.mkdir(exist_ok=True)
    out = subprocess.run(
        [bench, "--params=4e6", "--subgroup=5e5", "--budget_fraction=0.75",
         "--fast_mbps=400", "--steps=2", "--json",
         f"--tiers={tiers[0]},{tiers[1]}", *extra],
        check=True, capture_output=True, text=True).stdout
    return [json.loads(line) for line in out.splitlines() if line]


def test_ranks_share_the_tiers(bench, tmp_path):
    with_lock, without = None, None
    (tmp_path / "locks").mkdir()
    got = rows(bench, tmp_path, "--ranks=2", "--contention=0.5",
               "--configs=mlp,mlp-tier_lock", f"--tier_lock_dir={tmp_path / 'locks'}")
    assert [r["config"] for r in got] == ["mlp", "mlp-tier_lock"]
    with_lock, without = got
    for r in got:
        assert r["ranks"] == 2 and r["contention"] == pytest.approx(0.5)
        assert r["bytes_read"] > 0 and r["bytes_written"] > 0
        # The ranks' times are averaged, the checksums' too (it was 0).
        assert r["compute_seconds"] > 0 and r["checksum_seconds"] > 0
        # The tiers' caps hold for both ranks together: a step cannot beat
        # the slowest tier moving both ranks' bytes at its cap (less one
        # 1 MiB piece of pacing slack each way).
        assert r["step_seconds_median"] >= 0.8 * r["io_lower_bound_seconds"]
    # The lock changes who moves bytes when, not how many.
    assert with_lock["bytes_read"] == without["bytes_read"]
    assert with_lock["bytes_written"] == without["bytes_written"]
    # The tier locks' files were in the lock directory (none on the tiers)
    # and went with their last user; the benchmark removed its run
    # directories (gigabytes at real sizes) when done.
    assert os.listdir(tmp_path / "locks") == []
    for tier in ("fast", "slow"):
        names = os.listdir(tmp_path / tier)
        assert not [n for n in names if "tier_lock" in n or n.startswith("bench_")], names


def test_one_rank_reports_the_same_fields(bench, tmp_path):
    (row,) = rows(bench, tmp_path, "--configs=baseline")
    assert row["ranks"] == 1 and row["config"] == "baseline"
    assert row["step_seconds_median"] >= 0.8 * row["io_lower_bound_seconds"]


def test_uncapped_tiers_give_valid_json_and_the_checksums_time(bench, tmp_path):
    # --fast_mbps=0 (no caps): the I/O bound is unknown, and the line said
    # "inf", which is no JSON (json.loads took it; other readers do not).
    tiers = [tmp_path / "fast", tmp_path / "slow"]
    for t in tiers:
        t.mkdir()
    out = subprocess.run(
        [bench, "--params=4e6", "--subgroup=5e5", "--budget_fraction=0.5", "--fast_mbps=0",
         "--steps=2", "--json", "--configs=baseline", f"--tiers={tiers[0]},{tiers[1]}"],
        check=True, capture_output=True, text=True).stdout
    assert "inf" not in out and "nan" not in out.lower(), out
    (row,) = [json.loads(line, parse_constant=pytest.fail) for line in out.splitlines() if line]
    assert row["io_lower_bound_seconds"] is None
    # Every record written is hashed for its header (and each read is
    # verified): time of its own, not hidden in the waits.
    assert row["checksum_seconds"] > 0


@pytest.mark.parametrize("args,message", [
    (["--ranks=2", "--contention=-1"], "--contention must be >= 0"),
    (["--ranks=2", "--configs=mlp-tier_lok"], "unknown technique 'tier_lok'"),
    (["--ranks=100"], "at least one subgroup per rank"),
])
def test_bad_flags_are_named(bench, tmp_path, args, message):
    proc = subprocess.run(
        [bench, "--params=4e6", "--subgroup=5e5", f"--tiers={tmp_path},{tmp_path}/b",
         *args], capture_output=True, text=True)
    assert proc.returncode != 0
    assert message in proc.stderr
