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


def test_probe_needs_a_path():
    with pytest.raises(SystemExit) as e:
        cli.main(["probe"])
    assert e.value.code == 2
