"""`mlp-offload train`: a tiny GPT trains with its state offloaded; the
baseline and plain-torch runs follow the same loss curve; the PNG is written."""
import errno
import io
import json
import os
import re
import shutil
import stat

import pytest

from mlp_offload import cli, corpus, gpt

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
TINY = ["--steps", "6", "--batch-size", "4", "--seq-len", "16", "--model-dim", "32",
        "--layers", "2", "--heads", "2", "--subgroup-numel", "3000", "--host-cache", "16KiB",
        "--corpus-chars", "5000", "--quiet"]


def test_train_json_fp32_matches_torch(tmp_path, capsys):
    png = tmp_path / "train.png"
    tiers = [tmp_path / "t0", tmp_path / "t1"]
    for t in tiers:
        t.mkdir()
    code = cli.main(["train", "--json", "--out", str(png), "--tiers", *map(str, tiers)] + TINY)
    assert code == 0
    doc = json.loads(capsys.readouterr().out)
    runs = doc["runs"]
    assert set(runs) == {"mlp", "baseline", "torch"}
    for run in runs.values():
        assert len(run["loss"]) == 6 and len(run["step_seconds"]) == 6
        assert all(s > 0 for s in run["step_seconds"])
        assert run["loss"][0] == pytest.approx(runs["torch"]["loss"][0], abs=1e-6)
    # The state really went through the tiers: several subgroups, some on
    # each tier for mlp, all on the first for the baseline.
    assert runs["mlp"]["plan"]["num_subgroups"] > 4
    assert all(k > 0 for k in runs["mlp"]["plan"]["subgroups_per_tier"])
    assert runs["baseline"]["plan"]["subgroups_per_tier"][1] == 0
    # Offloaded AdamW == torch AdamW, step for step.
    for mode in ("mlp", "baseline"):
        c = doc["comparison"][mode]
        assert c["first_update_rel_param_diff"] < 1e-5
        assert c["max_abs_loss_diff"] < 1e-4
        assert c["max_rel_param_diff"] < 1e-4
        assert c["match"] is True
    data = png.read_bytes()
    assert data.startswith(PNG_MAGIC) and len(data) > 10_000


def test_baseline_split_takes_only_its_hooks_time_out_of_forward_backward(tmp_path):
    # The baseline's gradient offload happens in backward's hooks, then in
    # step() as the wait for its writes to land (slow here: a 3 MB/s tier).
    # Only the hooks' part comes out of forward+backward, and the wait is
    # counted once, as gradient offload, not as "other" too. Before, the
    # whole of it came out of forward+backward, which read as 0.
    from mlp_offload import train
    text = corpus.generate(5000, seed=0)
    tok = corpus.CharTokenizer(text)
    data = corpus.Batches(tok.encode(text), batch_size=4, seq_len=16)
    (tmp_path / "t").mkdir()
    tiers = [{"path": str(tmp_path / "t"), "throttle_write_bytes_per_sec": 3e6,
              "throttle_read_bytes_per_sec": 1e9}]
    run = train.train_run("baseline", data=data, vocab_size=tok.vocab_size, steps=3,
                          seq_len=16, dim=32, layers=2, heads=2, tiers=tiers,
                          host_cache_bytes=16 << 10, subgroup_numel=3000, warmup=0)
    for step, (parts, total) in enumerate(zip(run["split"], run["step_seconds"])):
        assert parts["forward_backward"] > 0, (step, parts)
        assert parts["grad_offload"] > 0, (step, parts)
        # The parts add up to the step (each second counted once).
        assert sum(parts.values()) == pytest.approx(total, rel=1e-6, abs=1e-6), (step, parts)


def test_baseline_offload_times_are_each_steps_own_whatever_the_step_did(tmp_path):
    # A step that skipped (non-finite gradients) or raised still ends the
    # count of its backward's offload time: the next step reports its own
    # hooks' time, which lies inside its own backward.
    import time
    import torch
    from mlp_offload import MLPOffloadOptimizer, errors
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Linear(32, 8))
    for nonfinite in ("skip", "raise"):
        d = tmp_path / nonfinite
        d.mkdir()
        opt = MLPOffloadOptimizer(torch.optim.AdamW(model.parameters()), tiers=[str(d)],
                                  subgroup_numel=300, mode="baseline", compute_threads=1,
                                  nonfinite=nonfinite)
        offload = opt._offload_grads

        def slow(g):  # hooks that take a visible time
            time.sleep(0.03)
            offload(g)
        opt._offload_grads = slow
        for step, bad in enumerate([False, False, True, False]):
            opt.zero_grad()
            start = time.perf_counter()
            loss = model(torch.randn(4, 16)).sum() * (float("nan") if bad else 1.0)
            loss.backward()
            backward = time.perf_counter() - start
            if bad and nonfinite == "raise":
                with pytest.raises(errors.NonFiniteGradientError):
                    opt.step()
                continue
            opt.step()
            if bad:
                assert opt.last_step_stats.get("skipped"), opt.last_step_stats
                continue
            if step > 0:
                hooks = opt.last_step_stats["grad_offload_backward_seconds"]
                assert 0.03 <= hooks <= backward, (nonfinite, step, hooks, backward)
        opt.close()


def test_train_table_bf16(tmp_path, capsys):
    # An --out without an extension is a PNG, and the path printed is the
    # file's (matplotlib adds the ".png").
    png = tmp_path / "t.png"
    code = cli.main(["train", "--dtype", "bfloat16", "--out", str(tmp_path / "t")] + TINY)
    out = capsys.readouterr().out
    assert code == 0
    rows = {}
    for line in out.splitlines():
        m = re.match(r"(mlp|baseline|torch)\s+([\d.]+)((\s+[\d.]+){8})$", line)
        if m:
            rows[m.group(1)] = [float(m.group(2))] + [float(x) for x in m.group(3).split()]
    assert set(rows) == {"mlp", "baseline", "torch"}
    for vals in rows.values():
        loss, step, fwd_bwd = vals[0], vals[1], vals[2]
        assert 0 < loss < 5 and step > 0 and fwd_bwd > 0
    verdicts = re.findall(r"(mlp|baseline): first update max rel param diff (\S+); loss "
                          r"curve max \|diff\| (\S+) \(([\d.]+)%\) -> (match|DIFFER)", out)
    assert {v[0] for v in verdicts} == {"mlp", "baseline"}, out
    for mode, first, diff, pct, verdict in verdicts:
        assert verdict == "match" and float(first) < 1e-2 and float(pct) < 5, out
    assert f"plot: {png}" in out and png.read_bytes().startswith(PNG_MAGIC)


def test_train_generic_optimizer_no_compare(tmp_path, capsys):
    code = cli.main(["train", "--json", "--optimizer", "rmsprop", "--no-compare",
                     "--out", ""] + TINY)
    assert code == 0
    doc = json.loads(capsys.readouterr().out)
    assert list(doc["runs"]) == ["mlp"] and doc["plot"] is None and doc["comparison"] == {}
    loss = doc["runs"]["mlp"]["loss"]
    assert len(loss) == 6 and loss[-1] < loss[0]


def test_train_bad_heads_is_one_line_error(capsys):
    code = cli.main(["train", "--model-dim", "30", "--heads", "4", "--out", ""] + TINY[:2])
    err = capsys.readouterr().err
    assert code == 1 and "multiple of heads" in err and err.count("\n") == 1


def test_a_diverging_run_says_where_and_which_flags_to_change(capsys):
    # lr 1e300: the gradients become NaN. The library's advice (a GradScaler,
    # nonfinite='skip') named options the CLI does not have, and no step.
    code = cli.main(["train", "--no-compare", "--out", "", "--lr", "1e300", "--warmup", "0"]
                    + TINY)
    err = capsys.readouterr().err
    assert code == 1 and err.count("\n") == 1, err
    assert re.search(r"error: the mlp run diverged at step \d+ of 6 \(loss \S+\): its gradients "
                     r"are not finite; try a smaller learning rate \(--lr, now 1e\+300\) or a "
                     r"longer warm-up \(--warmup, now 0\)$", err.strip()), err
    # The flag's value, not the warm-up's scaled one (a review: 1e-05 for
    # --lr 1e-3 --warmup 100, and a user would raise it).
    code = cli.main(["train", "--no-compare", "--out", "", "--lr", "1e300", "--warmup", "100"]
                    + TINY)
    err = capsys.readouterr().err
    assert code == 1 and "(--lr, now 1e+300) or a longer warm-up (--warmup, now 100)" in err, err


def test_train_largest_seed_runs(capsys):
    code = cli.main(["train", "--json", "--no-compare", "--out", "", "--seed", "4294967295"]
                    + TINY)
    assert code == 0 and len(json.loads(capsys.readouterr().out)["runs"]["mlp"]["loss"]) == 6


def test_train_one_step_summary_says_what_it_averages(capsys):
    tiny = TINY[2:] + ["--steps", "1"]
    assert cli.main(["train", "--out", "", "--no-compare"] + tiny) == 0
    out = capsys.readouterr().out
    # One step, one layer, one head: singular (before: "1 steps").
    assert "summary (1 step; times are of step 1, seconds)" in out, out


def test_train_header_counts_are_singular_for_one(capsys):
    tiny = TINY[2:] + ["--steps", "1", "--layers", "1", "--heads", "1"]
    assert cli.main(["train", "--out", "", "--no-compare"] + tiny) == 0
    out = capsys.readouterr().out
    assert "(1 layer, dim 32, 1 head, vocab" in out and "; 1 step of 4 x 16 tokens" in out, out


def test_help_shows_defaults_of_zero(capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(["train", "--help"])
    assert e.value.code == 0
    help_text = " ".join(capsys.readouterr().out.split())
    assert re.search(r"--seed \S+ .*?\(default: 0\)", help_text), help_text


@pytest.mark.parametrize("argv,want", [
    (["--corpus-chars", "10", "--seq-len", "16"], "must be more than --seq-len + 1"),
    # A plot format matplotlib does not write: refused before the run, not
    # after it.
    (["--out", "{tmp}/x.txt"], ".txt is not an image format matplotlib writes"),
    # Its first linear layer alone would take 192 TB (more than any address
    # space): torch's allocation error becomes a ConfigError.
    pytest.param(
        ["--model-dim", "4000000", "--layers", "1"], "cannot build the model: its 192,",
        marks=pytest.mark.skipif(
            os.environ.get("MLP_OFFLOAD_SANITIZER") == "asan",
            reason="ASan's allocator aborts on a request above its maximum instead of "
                   "failing it (allocator_may_return_null=0)")),
    (["--tiers", "{tmp}/file", "{tmp}"], "tier directory {tmp}/file is not a directory"),
    (["--out", "{tmp}/file/sub/x.png"], "/file is not a directory"),
    # A directory, with or without its slash (before: "{tmp}/.png" was
    # reported and "{tmp}/.png.png" written).
    (["--out", "{tmp}/"], "--out {tmp}/ is a directory"),
    (["--out", "{tmp}"], "--out {tmp} is a directory"),
    # A format matplotlib lists but cannot write here: found out before
    # the run (before: after it).
    pytest.param(["--out", "{tmp}/x.pgf"], "matplotlib cannot write .pgf here",
                 marks=pytest.mark.skipif(shutil.which("xelatex") is not None,
                                          reason="this machine writes pgf")),
])
def test_train_bad_setups_are_one_line_errors_before_training(tmp_path, capsys, argv, want):
    (tmp_path / "file").write_text("")
    code = cli.main(["train"] + TINY + [a.format(tmp=tmp_path) for a in argv])
    err = capsys.readouterr().err
    assert code == 1 and want.format(tmp=tmp_path) in err and err.count("\n") == 1, err


def test_a_missing_plot_directory_is_refused_before_training(tmp_path, capsys):
    # As export's OUT: the directory is not made (before: the run trained,
    # then made it, at the file system's root too).
    png = tmp_path / "missing" / "sub" / "x.png"
    code = cli.main(["train", "--no-compare"] + TINY + ["--out", str(png)])
    out, err = capsys.readouterr()
    assert code == 1 and out == "", out  # nothing printed: no training
    assert err == (f"mlp-offload train: error: --out {png}: directory {png.parent} does "
                   f"not exist (make it first)\n"), err
    assert list(tmp_path.iterdir()) == []


def test_a_plot_directory_that_takes_no_files_is_refused_before_training(capsys):
    # /proc takes no new files, though access() says yes to root (before:
    # root's run trained and failed at the plot).
    code = cli.main(["train"] + TINY + ["--out", "/proc/mlp_offload_plot.png"])
    err = capsys.readouterr().err
    assert code == 1 and err.count("\n") == 1, err
    assert ("cannot write a file in /proc" in err or "directory /proc is not writable" in err), err


def test_a_plot_that_cannot_be_written_leaves_the_one_there_and_names_the_file(
        tmp_path, capsys, monkeypatch):
    # The plot goes to a new file renamed over the old one: a full disk
    # part-way through leaves the old plot and no partial file, and the
    # error names the plot (before: a truncated plot, and no name).
    import matplotlib.figure

    png = tmp_path / "plot.png"
    png.write_bytes(b"the old plot")
    real = matplotlib.figure.Figure.savefig

    def full_disk(self, fname, *args, **kwargs):
        if isinstance(fname, io.BytesIO):  # the format's check, in memory
            return real(self, fname, *args, **kwargs)
        fname.write(b"\x89PNG part of it")
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(matplotlib.figure.Figure, "savefig", full_disk)
    code = cli.main(["train", "--no-compare", "--quiet", "--out", str(png)] + TINY)
    err = capsys.readouterr().err
    assert code == 1 and "No space left on device" in err and str(png) in err, err
    assert png.read_bytes() == b"the old plot"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["plot.png"]
    monkeypatch.setattr(matplotlib.figure.Figure, "savefig", real)
    # Written, it replaces the old plot, keeping its permissions; through a
    # symlink, the link's target (the link stays).
    os.chmod(png, 0o640)
    link = tmp_path / "latest.png"
    link.symlink_to(png.name)
    assert cli.main(["train", "--no-compare", "--quiet", "--out", str(link)] + TINY) == 0
    assert png.read_bytes().startswith(b"\x89PNG\r\n\x1a\n")
    assert stat.S_IMODE(png.stat().st_mode) == 0o640 and link.is_symlink()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest.png", "plot.png"]


@pytest.mark.parametrize("bad", [["--lr", "nan"], ["--lr", "-1"], ["--lr", "0"],
                                 ["--warmup", "-1"],
                                 # The batches' seeds, seed * 1_000_003 + step,
                                 # must stay below 2**64.
                                 ["--seed", "100000000000000"], ["--seed", "4294967296"],
                                 ["--seed", "99999999999999999999999"], ["--seed", "-1"],
                                 # Counts are whole (before: rounded).
                                 ["--steps", "1.5"], ["--batch-size", "2.5"]])
def test_train_bad_numbers_exit_2(bad):
    with pytest.raises(SystemExit) as e:
        cli.main(["train"] + TINY + bad)
    assert e.value.code == 2


def test_corpus_and_model_are_deterministic():
    a, b = corpus.generate(2000, seed=3), corpus.generate(2000, seed=3)
    assert a == b and a != corpus.generate(2000, seed=4)
    tok = corpus.CharTokenizer(a)
    assert tok.decode(tok.encode(a[:50])) == a[:50]
    batches = corpus.Batches(tok.encode(a), 2, 8, seed=1)
    x, y = batches.batch(5)
    assert x.shape == (2, 8) and (x[:, 1:] == y[:, :-1]).all()
    model = gpt.GPT(gpt.GPTConfig(tok.vocab_size, seq_len=8, dim=16, layers=1, heads=2))
    assert model(x).shape == (2, 8, tok.vocab_size)


def test_sigterm_cleans_up_and_exits_143(tmp_path):
    # A job scheduler's SIGTERM mid-training: the temporary tier
    # directories go, one line says why, status 128 + 15.
    import os
    import signal
    import subprocess
    import sys
    env = dict(os.environ, TMPDIR=str(tmp_path))
    argv = [sys.executable, "-m", "mlp_offload.cli", "train", "--out", ""] + \
        [a if a != "6" else "100000" for a in TINY]
    proc = subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    try:
        for line in proc.stdout:
            if line.startswith("offload: tiers"):
                break
        assert any(n.startswith("mlp_offload_train_tier") for n in os.listdir(tmp_path))
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=120)
    finally:
        proc.kill()
    assert proc.returncode == 143, err
    assert err.strip().endswith("mlp-offload: terminated"), err
    assert not [n for n in os.listdir(tmp_path) if n.startswith("mlp_offload_train_tier")]
