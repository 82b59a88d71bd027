"""`mlp-offload bench`: every configuration runs, the numbers add up, the PNG
is written."""
import json
import os
import re
import subprocess
import tempfile

import pytest

from mlp_offload import bench, cli, recovery, units
from mlp_offload.errors import ConfigError
from mlp_offload.whatif import CONFIGS

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
# 2M params in 100K subgroups: 24 MB of fp32 state, 6 MB of it cached.
TINY = ["--params", "2e6", "--subgroup-numel", "1e5", "--fast-mbps", "400",
        "--budget-fraction", "0.5", "--steps", "2", "--threads", "2"]


def test_bench_json_and_plot(tmp_path, capsys):
    png = tmp_path / "bench.png"
    tiers = [tmp_path / "fast", tmp_path / "slow"]
    # What a benchmark killed mid-run left (its process is gone), and a
    # live one's run directory (pid 1 is alive): the first goes, not the
    # second.
    gone = subprocess.Popen(["true"])
    gone.wait()
    boot = recovery.boot_tag()
    live = f"bench_baseline_1_k{boot}"
    for t in tiers:
        for name in (f"bench_mlp_{gone.pid}_k{boot}", live):
            (t / name).mkdir(parents=True)
            (t / name / "LOCK").write_text("0")
            os.utime(t / name / "LOCK", (1e9, 1e9))  # made long ago
            (t / name / "sg_000000.state").write_bytes(b"x" * 4096)
    code = cli.main(["bench", "--json", "--out", str(png), "--tiers", *map(str, tiers)] + TINY)
    out = capsys.readouterr().out
    assert code == 0
    doc = json.loads(out)
    results = {r["config"]: r for r in doc["results"]}
    assert list(results) == list(CONFIGS)
    state = 2_000_000 * 12
    for r in results.values():
        assert r["subgroups"] == 20 and r["steps"] == 2 and len(r["step_seconds"]) == 2
        assert r["step_seconds_median"] > 0
        assert r["fast_cap_bytes_per_sec"] == 400e6 and r["slow_cap_bytes_per_sec"] == 200e6
        parts = r["read_wait_seconds"] + r["compute_seconds"] + r["write_wait_seconds"]
        assert parts <= r["step_seconds_median"] * 1.5 + 0.05
    base, mlp = results["baseline"], results["mlp"]
    # The baseline reads every record and its fp32 gradient each step.
    assert base["bytes_read"] >= state + 2_000_000 * 4
    assert base["cache_hits"] == 0 and base["num_cached"] == 0
    # MLP-Offload keeps records cached across steps: fewer bytes move.
    assert mlp["num_cached"] > 0 and mlp["cache_hits"] > 0
    assert mlp["bytes_read"] < state and mlp["bytes_written"] < state
    assert mlp["predicted_seconds"] < base["predicted_seconds"]
    assert doc["plot"] == str(png)
    data = png.read_bytes()
    assert data.startswith(PNG_MAGIC) and len(data) > 10_000
    # The run directories are gone from the tiers (the tier locks' files are
    # not on them).
    left = [p.name for t in tiers for p in t.iterdir()]
    assert left == [live] * 2, left


def test_bench_table(tmp_path, capsys):
    (tmp_path / "sub").mkdir()
    png = tmp_path / "sub" / "b.png"
    code = cli.main(["bench", "--quiet", "--configs", "baseline,mlp", "--out", str(png)] + TINY)
    out = capsys.readouterr().out
    assert code == 0
    rows = {}
    for line in out.splitlines():
        m = re.match(r"(baseline|mlp)\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)(\s+[\d.]+){4}"
                     r"\s+(\d+)\s+(\d+)\s+(\d+)\s+([\d.]+)x$", line)
        if m:
            rows[m.group(1)] = m
    assert set(rows) == {"baseline", "mlp"}
    assert float(rows["baseline"].group(9)) == 1.0
    assert int(rows["baseline"].group(6)) >= 24  # MB read per step
    assert int(rows["mlp"].group(8)) > 0  # cache hits
    assert f"plot: {png}" in out and png.read_bytes().startswith(PNG_MAGIC)


def test_bench_budget_too_small_is_one_line_error(capsys):
    code = cli.main(["bench", "--quiet", "--out", "", "--params", "2e6",
                     "--subgroup-numel", "1e6", "--budget-fraction", "0.1"])
    err = capsys.readouterr().err
    assert code == 1
    assert err.count("\n") == 1 and "host budget" in err


def test_bench_refuses_a_configuration_the_budget_cannot_run_before_running_any(capsys):
    # mlp fits; multipath's double buffering does not: refused before the
    # header, naming it and the flag (before: after mlp had run, naming
    # neither).
    code = cli.main(["bench", "--out", "", "--params", "100K", "--subgroup-numel", "10K",
                     "--steps", "1", "--configs", "mlp,multipath,baseline"])
    out, err = capsys.readouterr()
    assert code == 1 and out == "", out
    assert err.count("\n") == 1 and "in configuration multipath;" in err \
        and "give --budget-fraction 0.28 or more" in err, err


def test_bench_budget_fraction_zero_is_one_consistent_error(capsys):
    # One budget, said once (before: "a host budget of 0 bytes", then the
    # planner's "host budget 1.0 B is too small").
    code = cli.main(["bench", "--quiet", "--out", "", "--params", "1M",
                     "--budget-fraction", "0"])
    out, err = capsys.readouterr()
    assert code == 1 and out == "", out
    assert err == ("mlp-offload bench: error: the host budget, --budget-fraction 0 of the "
                   "12.0 MB state, is 0 bytes: too small to double-buffer the largest "
                   "subgroup (250000 params), which needs at least 8019968 bytes (8.0 MB) in "
                   "configuration baseline; give --budget-fraction 0.67 or more\n"), err


@pytest.mark.parametrize("params,budget,need", [("1K", 3000, 40960),
                                                ("100K", 300000, 3211264)])
def test_bench_default_fraction_too_small_says_what_would_run(capsys, params, budget, need):
    # The default --budget-fraction 0.25 of a small model is below double
    # buffering: the error names the budget, the minimum and settings that
    # run (before: the planner's message alone), each checked here.
    code = cli.main(["bench", "--quiet", "--out", "", "--params", params])
    out, err = capsys.readouterr()
    assert code == 1 and out == "" and err.count("\n") == 1, err
    assert f"is {budget} bytes" in err and "double-buffer the largest subgroup" in err \
        and f"needs at least {need} bytes" in err, err
    n = units.parse_count(params)
    fraction = float(re.search(r"--budget-fraction (\S+) or more", err).group(1))
    more = units.parse_count(re.search(r"--params (\S+) or more", err).group(1))
    bench.check_plans(n, 250_000, fraction, CONFIGS)
    bench.check_plans(more, 250_000, 0.25, CONFIGS)
    smaller = re.search(r"--subgroup-numel (\S+) or less", err)
    if smaller:
        bench.check_plans(n, units.parse_count(smaller.group(1)), 0.25, CONFIGS)
    # Each the least of its kind, to two digits.
    for args in ((n, 250_000, fraction * 0.9), (int(more * 0.9), 250_000, 0.25)):
        with pytest.raises(ConfigError, match="too small to double-buffer"):
            bench.check_plans(*args, CONFIGS)


def test_bench_missing_plot_directory_is_refused_before_the_header(tmp_path, capsys):
    png = tmp_path / "missing" / "b.png"
    code = cli.main(["bench", "--quiet"] + TINY + ["--out", str(png)])
    out, err = capsys.readouterr()
    assert code == 1 and out == "", out
    assert err == (f"mlp-offload bench: error: --out {png}: directory {png.parent} does "
                   f"not exist (make it first)\n"), err
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("bad", [["--threads", "1e12"], ["--threads", "1025"],
                                 ["--threads", "0"],
                                 ["--seed", "99999999999999999999999"], ["--seed", "-1"],
                                 ["--seed", "4294967296"]])
def test_bench_out_of_range_arguments_exit_2(tmp_path, monkeypatch, capsys, bad):
    # Refused by argparse: no header printed, no temporary tier made.
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    with pytest.raises(SystemExit) as e:
        cli.main(["bench", "--out", ""] + TINY + bad)
    assert e.value.code == 2
    out, err = capsys.readouterr()
    assert out == "" and f"argument {bad[0]}: " in err, err
    assert not list(tmp_path.iterdir())


@pytest.mark.parametrize("argv,want", [
    (["--params", "2e6", "--subgroup-numel", "1"],
     "2000000 subgroups (2000000 params in subgroups of 1): the benchmark takes at most "
     "1000000"),
    (["--out", "b.txt"], ".txt is not an image format matplotlib writes"),
])
def test_bench_setups_refused_before_the_header(capsys, argv, want):
    code = cli.main(["bench", "--quiet", "--out", ""] + TINY + argv)
    out, err = capsys.readouterr()
    assert code == 1 and out == "", out
    assert err.count("\n") == 1 and want in err, err


def test_bench_budget_beyond_an_int_is_one_line_error_before_the_header(capsys):
    code = cli.main(["bench", "--quiet", "--out", ""] + TINY + ["--budget-fraction", "1e300"])
    out, err = capsys.readouterr()
    assert code == 1 and out == "", out
    assert err.count("\n") == 1 and "budget_fraction 1e+300" in err and "host budget" in err, err


def test_bench_tier_that_takes_no_directories_is_refused_before_the_header(tmp_path, capsys):
    # /proc: a directory, and access() says yes to root, but nothing can be
    # made in it (before: the header printed, then the engine's error).
    code = cli.main(["bench", "--out", "", "--tiers", str(tmp_path), "/proc"] + TINY)
    out, err = capsys.readouterr()
    assert code == 1 and out == "", out
    assert err.startswith("mlp-offload bench: error: tier directory /proc takes no new "
                          "directories ("), err
    assert err.count("\n") == 1, err
    assert list(tmp_path.iterdir()) == []


def test_bench_tier_that_is_a_file_is_one_line_error_without_a_bar(tmp_path, capsys):
    (tmp_path / "file").write_text("")
    (tmp_path / "slow").mkdir()
    # No --quiet: a progress bar made before the check would be drawn.
    code = cli.main(["bench", "--out", "", "--tiers", str(tmp_path / "file"),
                     str(tmp_path / "slow")] + TINY)
    err = capsys.readouterr().err
    assert code == 1
    assert err == f"mlp-offload bench: error: tier directory {tmp_path / 'file'} is not a " \
        f"directory\n", err


def test_bench_half_duplex_caps_make_reads_and_writes_take_turns(tmp_path, capsys):
    # --half-duplex: one clock per tier for reads and writes (a device that
    # does one at a time), and the I/O bound is their sum at the cap.
    code = cli.main(["bench", "--json", "--out", "", "--half-duplex", "--configs",
                     "baseline,mlp"] + TINY)
    assert code == 0
    results = json.loads(capsys.readouterr().out)["results"]
    caps = (400e6, 200e6)
    for r in results:
        assert r["half_duplex"] is True
        moved = r["bytes_read"] + r["bytes_written"]
        # The tiers' bound: (reads + writes) / cap on the slowest tier; all
        # bytes on the fast tier at most, so at least moved / (fast + slow).
        assert r["io_lower_bound_seconds"] >= moved / sum(caps) * 0.999
        assert r["step_seconds_median"] >= r["io_lower_bound_seconds"] * 0.95
