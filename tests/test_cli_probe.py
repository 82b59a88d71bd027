"""`mlp-offload probe`: bandwidth of each path alone and together."""
import json
import re

import pytest

from mlp_offload import cli


def test_probe_json(tmp_path, capsys):
    dirs = [tmp_path / "a", tmp_path / "b"]
    for d in dirs:
        d.mkdir()
    code = cli.main(["probe", "--json", "--bytes", "4MiB", "--block-size", "256KiB",
                     "--queue-depth", "4", *map(str, dirs)])
    out = capsys.readouterr().out
    assert code == 0
    rows = json.loads(out)
    assert [r["dir"] for r in rows] == [str(d) for d in dirs]
    for r in rows:
        for key in ("write_alone", "read_alone", "write_together", "read_together"):
            assert r[key] > 0
        # Two directories of one file system share its device.
        assert r["shares_device_with"]
    assert rows[0]["device"] == rows[1]["device"]
    # The probe's files are removed.
    assert all(not any(d.iterdir()) for d in dirs)


def test_probe_table(tmp_path, capsys):
    code = cli.main(["probe", "--bytes", "4MiB", str(tmp_path)])
    out = capsys.readouterr().out
    assert code == 0
    line = next(l for l in out.splitlines() if l.startswith(str(tmp_path)))
    numbers = re.findall(r"\s(\d+)(?=\s)", line + " ")
    assert len(numbers) >= 5 and all(int(n) >= 0 for n in numbers[1:5])
    m = re.search(r"--tier tier0:(\S+):([\d.e+-]+):([\d.e+-]+)", out)
    assert m and m.group(1) == str(tmp_path) and float(m.group(2)) > 0


def test_probe_missing_path_exit_1(tmp_path, capsys):
    code = cli.main(["probe", str(tmp_path / "nope")])
    err = capsys.readouterr().err
    assert code == 1 and "nope" in err and err.count("\n") == 1


@pytest.mark.parametrize("bad", [["--queue-depth", "32768"], ["--queue-depth", "0"],
                                 ["--ranks", "1000"], ["--bytes", "1e400"],
                                 # O_DIRECT sizes, checked by the usage (before:
                                 # by the engine, exit 1, without the usage).
                                 ["--bytes", "0"], ["--bytes", "1000"],
                                 ["--block-size", "1000"], ["--block-size", "2GiB"]])
def test_probe_bad_arguments_exit_2(tmp_path, bad):
    with pytest.raises(SystemExit) as e:
        cli.main(["probe", str(tmp_path)] + bad)
    assert e.value.code == 2


def test_probe_names_the_block_size_limit_in_its_own_units(tmp_path, capsys):
    # (before: "at most 1.1 GB" for the 1 GiB the help text gives)
    with pytest.raises(SystemExit):
        cli.main(["probe", str(tmp_path), "--block-size", "2GiB"])
    assert "--block-size: must be at most 1 GiB, got 2GiB" in capsys.readouterr().err


def test_probe_refuses_a_path_given_twice(tmp_path, capsys):
    (tmp_path / "d").mkdir()
    code = cli.main(["probe", str(tmp_path / "d"), str(tmp_path / "." / "d")])
    err = capsys.readouterr().err
    assert code == 1 and "is given twice" in err and err.count("\n") == 1, err


def test_probe_needs_a_path():
    with pytest.raises(SystemExit) as e:
        cli.main(["probe"])
    assert e.value.code == 2


def test_probe_ranks_measures_concurrency_and_suggests_a_tier_lock(tmp_path, capsys):
    code = cli.main(["probe", "--json", "--bytes", "4MiB", "--block-size", "256KiB",
                     "--queue-depth", "4", "--ranks", "3", str(tmp_path)])
    out = capsys.readouterr().out
    assert code == 0
    (row,) = json.loads(out)
    c = row["concurrency"]
    assert c["dir"] == str(tmp_path) and c["streams"] == 3
    assert c["one"] > 0 and c["many"] > 0 and c["contention"] >= 0
    assert c["suggested"] == cli.suggest_tier_lock(c)
    assert not any(tmp_path.iterdir())
    code = cli.main(["probe", "--bytes", "4MiB", "--ranks", "2", str(tmp_path)])
    out = capsys.readouterr().out
    assert code == 0 and "2 at once" in out and "tier_lock" in out, out


@pytest.mark.parametrize("one,many,contention,want", [
    (100, 150, 0.0, {"tier_lock": False}),  # more streams, more bandwidth
    (100, 100, 0.0, {"tier_lock": True, "tier_lock_mode": "per_direction"}),
    (100, 50, 0.3, {"tier_lock": True, "tier_lock_mode": "per_direction"}),
    (100, 40, 0.5, {"tier_lock": True, "tier_lock_mode": "exclusive"}),
])
def test_tier_lock_suggestion(one, many, contention, want):
    assert cli.suggest_tier_lock({"one": one, "many": many, "contention": contention}) == want
