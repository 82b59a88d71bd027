"""`mlp-offload plan`: the what-if planner's numbers, checked by hand."""
import json
import re

import pytest

from mlp_offload import cli, units, whatif
from mlp_offload.errors import ConfigError

GB = 1e9
# One record of 1e8 AdamW params: 1.2e9 B; its host buffer adds a 4 KiB header
# and rounds the record up to 4 KiB.
BUFFER = 4096 + (1_200_000_000 + 4095) // 4096 * 4096


def run(capsys, *argv):
    code = cli.main(list(argv))
    out = capsys.readouterr()
    return code, out.out, out.err


def plan_json(capsys, *argv):
    code, out, _ = run(capsys, "plan", "--json", *argv)
    assert code == 0
    doc = json.loads(out)
    return doc, {c["config"]: c for c in doc["configs"]}


def test_baseline_one_tier_by_hand(capsys):
    # 8 subgroups of 1e8 on one 2 GB/s tier (reads and writes share it).
    # Per step: read 8 records + 8 fp32 grads (12.8 GB), write 8 records
    # (9.6 GB): 11.2 s; the grads written in backward 3.2 GB: 1.6 s; fill
    # and drain one record each way: 1.2 s. Total 14.0 s.
    doc, c = plan_json(capsys, "--params", "8e8", "--ranks", "1", "--subgroup-numel", "1e8",
                       "--tier", "a:/x:2:2", "--host-cache", "0", "--configs", "baseline")
    assert doc["num_subgroups"] == 8 and doc["arrays_per_param"] == 3
    b = c["baseline"]
    assert b["subgroups_per_tier"] == [8]
    assert b["num_cached"] == 0
    assert b["traffic"][0]["bytes_read"] == pytest.approx(12.8 * GB)
    assert b["traffic"][0]["bytes_written"] == pytest.approx(12.8 * GB)
    assert b["predicted_io_seconds"] == pytest.approx(12.8)
    assert b["predicted_seconds"] == pytest.approx(14.0)


def test_mlp_two_tiers_four_ranks_by_hand(capsys):
    # 4e9 params over 4 ranks: 1e9 per rank, 10 subgroups. Two 8 GB/s tiers
    # shared by 4 ranks: 2 GB/s each per rank. Host cache 4 x 2 buffers:
    # 2 cached per rank (beside the 5 streaming buffers of two tiers).
    # MLP: subgroups alternate a, b; per step each tier reads 4 and writes 4
    # records (2 hits, 2 kept of 10): 4.8 GB / 2 GB/s * 2 = 4.8 s, plus the
    # drain of one record over both tiers 0.3 s = 5.1 s.
    # Baseline (tier a only): reads 10 records + 10 grads (16 GB), writes
    # 10 records (12 GB): 14 s; grads 2 s; fill + drain 1.2 s = 17.2 s.
    doc, c = plan_json(capsys, "--params", "4e9", "--ranks", "4", "--subgroup-numel", "100M",
                       "--tier", "a:/x:8:8", "--tier", "b:/y:8GB/s:8000MB/s",
                       "--host-cache", str(4 * 2 * BUFFER))
    assert doc["shard_params"] == 10 ** 9 and doc["num_subgroups"] == 10
    mlp, base = c["mlp"], c["baseline"]
    assert mlp["subgroups_per_tier"] == [5, 5]
    assert mlp["num_cached"] == 2 and mlp["num_buffers"] == 5
    for t in mlp["traffic"]:
        assert t["bytes_read"] == pytest.approx(4.8 * GB)
        assert t["bytes_written"] == pytest.approx(4.8 * GB)
    assert mlp["predicted_seconds"] == pytest.approx(5.1)
    assert base["subgroups_per_tier"] == [10, 0]
    assert base["predicted_seconds"] == pytest.approx(17.2)
    assert mlp["speedup_vs_baseline"] == pytest.approx(17.2 / 5.1)


def test_one_tier_mlp_cache_only_by_hand(capsys):
    # One 2 GB/s tier, 10 subgroups, 2 cached: 8 reads + 8 writes of 1.2 GB
    # = 9.6 s, plus the drain 0.6 s.
    _, c = plan_json(capsys, "--params", "1e9", "--ranks", "1", "--tier", "a:/x:2:2",
                     "--host-cache", str(2 * BUFFER), "--configs", "mlp,cache_reuse")
    assert c["mlp"]["num_cached"] == 2
    assert c["mlp"]["predicted_seconds"] == pytest.approx(10.2)
    # cache_reuse alone: no delayed conversion, so the grads cost as in the baseline.
    assert c["cache_reuse"]["predicted_seconds"] > c["mlp"]["predicted_seconds"]


def test_table_output_70b(capsys):
    code, out, _ = run(capsys, "plan", "--params", "70B", "--ranks", "4",
                       "--tier", "nvme:/local/nvme:6.5:3.2:3.5TB", "--tier", "pfs:/lustre:3:1.5",
                       "--host-cache", "200GiB")
    assert code == 0
    assert "175 subgroups of 100M" in out
    rows = {}
    for line in out.splitlines():
        m = re.match(r"(baseline|mlp)\s+(.*?)\s+(\d+)\s+[\d.]+ [KMGT]?B\s+.*\s([\d.]+)\s+([\d.]+)x$",
                     line)
        if m:
            rows[m.group(1)] = (m.group(2), int(m.group(3)), float(m.group(4)),
                                float(m.group(5)))
    assert set(rows) == {"baseline", "mlp"}
    assert rows["baseline"][0] == "nvme 175" and rows["baseline"][1] == 0
    assert rows["mlp"][1] > 0 and "pfs" in rows["mlp"][0]
    m = re.search(r"baseline ([\d.]+) s, mlp ([\d.]+) s \(MLP-Offload ([\d.]+)x", out)
    assert m
    assert float(m.group(1)) == pytest.approx(rows["baseline"][2], abs=0.01)
    assert float(m.group(3)) > 1.5


def test_capacity_too_small_is_one_line_error(capsys):
    code, out, err = run(capsys, "plan", "--params", "70B", "--tier", "n:/n:6:3:1TB")
    assert code == 1
    assert err.count("\n") == 1 and "error:" in err and "state needs" in err


def test_a_capacity_below_a_byte_per_rank_is_not_unlimited(capsys):
    # 3 bytes over the 4 ranks: each rank's share is rounded up to a byte
    # (before: down to 0, which reads as unlimited, and the plan put the
    # whole state there).
    code, out, err = run(capsys, "plan", "--params", "70B", "--tier", "n:/n:6:3:3B")
    assert code == 1 and "state needs" in err and err.count("\n") == 1, err


def test_a_configuration_that_does_not_fit_is_named_and_the_others_planned(capsys):
    # 140B on the default tiers: the baseline (one path) does not fit the
    # node-local tier; MLP-Offload spills to the second.
    code, out, err = run(capsys, "plan", "--params", "140B", "--host-cache", "0")
    assert code == 0 and err == "", err
    assert re.search(r"^baseline\s+does not fit \(below\)", out, re.M), out
    assert re.search(r"^  baseline: plan: the tiers hold .* but the state needs", out, re.M)
    assert re.search(r"^mlp\s+nvme \d+ \| pfs \d+", out, re.M), out
    assert re.search(r"predicted update phase per step: mlp [\d.]+ s$", out, re.M), out
    _, rows = plan_json(capsys, "--params", "140B", "--host-cache", "0")
    assert "state needs" in rows["baseline"]["error"]
    assert rows["mlp"]["predicted_seconds"] > 0 and rows["mlp"]["speedup_vs_baseline"] is None


@pytest.mark.parametrize("bad", [["--params", "70X"], ["--host-cache", "lots"],
                                 ["--tier", "nvme:/x:6"], ["--configs", "fast"],
                                 ["--params", "1e400"], ["--host-cache", "1e30TB"],
                                 ["--compute-rate", "nan"], ["--compute-rate", "-1"],
                                 ["--compute-rate", "inf"], ["--tier", "n:/x:6:3:0.1"],
                                 # The bindings take a C int.
                                 ["--ranks", "3e9"], ["--ranks", "0"]])
def test_bad_arguments_exit_2(capsys, bad):
    with pytest.raises(SystemExit) as e:
        cli.main(["plan"] + bad)
    assert e.value.code == 2


def test_a_capacity_without_a_unit_is_refused(capsys):
    # A bare READ or WRITE is GB/s: a bare CAPACITY was bytes, and "3.5"
    # planned a tier of 3 bytes (the baseline "does not fit", mlp moved
    # everything elsewhere) with exit status 0.
    for capacity in ("3.5", "4096", "1e12"):
        with pytest.raises(SystemExit) as e:
            cli.main(["plan", "--tier", f"n:/x:6:3:{capacity}"])
        assert e.value.code == 2
        err = capsys.readouterr().err
        assert err.splitlines()[-1].endswith(
            f"argument --tier: tier n: capacity '{capacity}' has no unit: give one "
            f"(3.5TB, 800GiB, 4096B)"), err
    assert whatif.parse_tier("n:/x:6:3:4096B")["capacity_bytes"] == 4096
    assert whatif.parse_tier("n:/x:6:3:1e12B")["capacity_bytes"] == 10 ** 12


@pytest.mark.parametrize("capacity", ["0", "0B", "0.0TB", "0.1"])
def test_capacity_under_a_byte_is_refused(capsys, capacity):
    # 0 is a typo, not "unlimited" (that is no capacity, or '-'): refused
    # like any capacity under a byte, with the usage's one error line.
    with pytest.raises(SystemExit) as e:
        cli.main(["plan", "--tier", f"n:/x:6:3:{capacity}"])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert err.splitlines()[-1].endswith(
        f"argument --tier: tier n: capacity '{capacity}' is less than a byte "
        f"(leave it out or give '-' for unlimited)"), err
    for unlimited in ("n:/x:6:3", "n:/x:6:3:-", "n:/x:6:3:"):
        assert whatif.parse_tier(unlimited)["capacity_bytes"] == 0
    code, out, _ = run(capsys, "plan", "--params", "1B", "--tier", "n:/x:6:3:-")
    assert code == 0 and "capacity unlimited" in out


@pytest.mark.parametrize("argv,want", [
    (["--tier", "a:/x:6:3", "--tier", "b:/x/:3:1"], "two tiers have the path '/x'"),
    (["--tier", "a:/x:6:3", "--tier", "a:/y:3:1"],
     "two tiers have the name 'a': give each tier its own name"),
    (["--params", "1e15", "--subgroup-numel", "1", "--ranks", "1"],
     "the planner takes at most 1000000"),
])
def test_bad_plans_are_one_line_errors(capsys, argv, want):
    code, out, err = run(capsys, "plan", *argv)
    assert code == 1 and want in err and err.count("\n") == 1, err


def test_unforeseen_error_is_one_line_with_the_traceback_logged(capsys, caplog, monkeypatch):
    # A bug (or a case no check foresaw) still ends in one line, exit 1; the
    # traceback goes to the log at debug level.
    def boom(args, out):
        raise RuntimeError("boom\nsecond line")
    monkeypatch.setattr(cli, "_cmd_plan", boom)
    caplog.set_level("DEBUG", logger="mlp_offload")
    code, out, err = run(capsys, "plan", "--log-level", "debug")
    assert code == 1 and out == ""
    assert err == ("mlp-offload plan: error: RuntimeError: boom [...] (run with "
                   "--log-level debug for the traceback)\n"), err
    logged = [r for r in caplog.records if r.exc_info]
    assert logged and logged[0].levelname == "DEBUG"
    assert "second line" in str(logged[0].exc_info[1])


def test_log_level_after_the_command(capsys):
    code, out, _ = run(capsys, "plan", "--json", "--log-level", "error")
    assert code == 0 and json.loads(out)["configs"]


def test_units():
    assert units.parse_size("200GiB") == 200 * 2 ** 30
    assert units.parse_size("1.5TB") == 1_500_000_000_000
    assert units.parse_size("4096") == 4096
    assert units.parse_count("70e9") == units.parse_count("70B") == 70_000_000_000
    assert units.parse_count("2.5M") == 2_500_000
    assert units.parse_count("1.1B") == 1_100_000_000  # the float's error is no fraction
    assert units.parse_count("1e3") == 1000 and units.parse_count("0.000001T") == 1_000_000
    for fraction in ("1.5", "600000000.5", "1000000000.5", "1.0000000001", "1.5e-3K"):
        with pytest.raises(ConfigError, match="not a whole number"):
            units.parse_count(fraction)  # before: rounded, silently
    assert units.parse_rate("6.5") == 6.5e9 and units.parse_rate("800MB/s") == 8e8
    assert whatif.shard_subgroups(250, 2, 100) == [100, 25]
    # Exact for counts beyond float precision; too large or not finite: refused.
    assert whatif.shard_subgroups(2 ** 60 + 1, 1, 2 ** 59) == [2 ** 59, 2 ** 59, 1]
    for bad in ("1e400", "1e19", "nan", "inf"):
        with pytest.raises(ConfigError):
            units.parse_count(bad)
    with pytest.raises(ConfigError, match="too large"):
        units.parse_size("1e7TB")
    # "Gb" is how bits are written (a network link's 10Gb/s is 1.25 GB/s):
    # refused, where it was read as GB (case is free otherwise).
    for parse, text in ((units.parse_size, "10Gb"), (units.parse_rate, "10Gb/s"),
                        (units.parse_rate, "800Mb"), (units.parse_size, "4Tib")):
        unit = re.match(r"[\d.]+([A-Za-z]+)", text).group(1)
        with pytest.raises(ConfigError, match=rf"'{unit}' reads as bits; give bytes "
                                              rf"\({unit[0]}B or {unit[0]}iB\)"):
            parse(text)
    assert units.parse_size("10gb") == units.parse_size("10GB") == 10 ** 10
    assert units.parse_rate("2gib/s") == 2 * 2 ** 30
    assert units.parse_count("70B") == 70 * 10 ** 9  # a count's B is billions


@pytest.mark.parametrize("unbuffered", [False, True])
@pytest.mark.parametrize("argv", [["plan"], ["plan", "--json"], ["plan", "--help"]])
def test_a_reader_that_leaves_the_pipe_gets_no_error(argv, unbuffered):
    # `mlp-offload plan | head`: the reader is gone before anything was
    # written. Before, "error: [Errno 32] Broken pipe" (or Python's
    # "Exception ignored" at exit) went to stderr.
    import os
    import subprocess
    import sys
    # Buffered (the default into a pipe), the write fails when Python
    # flushes, at the end; unbuffered, at the first write.
    env = {k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"}
    if unbuffered:
        env["PYTHONUNBUFFERED"] = "1"
    read, write = os.pipe()
    os.close(read)  # no reader at all: the first write fails
    try:
        proc = subprocess.run([sys.executable, "-m", "mlp_offload.cli"] + argv, stdout=write,
                              stderr=subprocess.PIPE, text=True, timeout=300, env=env)
    finally:
        os.close(write)
    assert proc.stderr == ""
    assert proc.returncode == 141, proc.returncode  # 128 + SIGPIPE, as a shell says
