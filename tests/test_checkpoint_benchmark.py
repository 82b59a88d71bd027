"""//mlp_offload:checkpoint_benchmark at a tiny size: it runs, reports what
it measured and its bounds, and leaves nothing behind. Not how fast."""
import json
import os
import subprocess

from conftest import built_path


def test_reports_save_and_load_against_their_bounds(request, tmp_path):
    bench = built_path(request, "checkpoint_benchmark")
    tiers, ckpt = tmp_path / "tiers", tmp_path / "ckpt"
    tiers.mkdir()
    ckpt.mkdir()
    out = subprocess.run(
        [bench, "--params=4e6", "--subgroup=500000", "--cap=2e9", "--rounds=2",
         f"--dir={tiers}", f"--checkpoint-dir={ckpt}"],
        check=True, capture_output=True, text=True, timeout=300).stdout
    rows = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    rounds, result = rows[:-1], rows[-1]
    assert [r["round"] for r in rounds] == [0, 1]
    assert all(r["save_seconds"] > 0 and r["load_seconds"] > 0
               and r["load_restore_params_seconds"] > 0 and r["repacked_load_seconds"] > 0
               for r in rounds)
    assert result["subgroups"] == 8 and result["params"] == 4_000_000
    # 12 B/param of AdamW state (master, m, v) plus a 4 KiB header per record.
    assert result["state_bytes"] == 4_000_000 * 12 + 8 * 4096
    assert result["tier_bound_seconds"] == round(result["state_bytes"] / 4e9, 3)
    assert result["checkpoint_write_probe_seconds"] > 0
    assert "bounds: tiers" in out
    assert os.listdir(tiers) == [] and os.listdir(ckpt) == []
