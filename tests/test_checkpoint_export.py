"""The master weights of a checkpoint, read without an optimizer
(python/mlp_offload/checkpoint.py, the C++ ReadCheckpointRecord): as
tensors, into a model's parameters, and streamed to a safetensors file that
the safetensors library reads back; `mlp-offload export`."""

import contextlib
import io
import json
import os
import shutil

import pytest
import safetensors.torch
import torch
from conftest import tier_dirs

import mlp_offload
from mlp_offload import MLPOffloadOptimizer, cli, errors
from mlp_offload.errors import ConfigError, CorruptStateError, StateMismatchError

torch.set_num_threads(1)  # CI shares 2 cores between test processes


def _model(dtype):
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(24, 48), torch.nn.GELU(),
                               torch.nn.Linear(48, 40), torch.nn.GELU(),
                               torch.nn.Linear(40, 8)).to(dtype)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A bf16 model trained 3 steps; its checkpoint and fp32 master weights
    (read from the engine) and those of a torch AdamW on fp32 masters."""
    tmp = tmp_path_factory.mktemp("saved")
    model = _model(torch.bfloat16)
    master = [p.detach().float().clone().requires_grad_(True) for p in model.parameters()]
    ref = torch.optim.AdamW(master, lr=1e-2, weight_decay=0.1)
    opt = MLPOffloadOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1),
                              tiers=tier_dirs(tmp), subgroup_numel=1000, compute_threads=1)
    assert len(opt.subgroups) >= 4
    gen = torch.Generator().manual_seed(1)
    for _ in range(3):
        x = torch.randn(16, 24, generator=gen).to(torch.bfloat16)
        model(x).float().square().mean().backward()
        for m, p in zip(master, model.parameters()):
            m.grad = p.grad.float()
        opt.step()
        ref.step()
        opt.zero_grad(set_to_none=True)
    ckpt = str(tmp / "ckpt")
    opt.save_checkpoint(ckpt)
    engine = [None] * len(master)
    for sg in opt.subgroups:
        flat, _, _ = opt._read_subgroup(sg.index)
        for p, pid, off, n in sg.slices():
            engine[pid] = flat[off:off + n].view(p.shape).clone()
    names = [n for n, _ in model.named_parameters()]
    opt.close()
    return {"ckpt": ckpt, "engine": engine, "torch": [m.detach() for m in master],
            "names": names, "tmp": tmp}


def test_master_weights_are_the_engines_fp32_copy(saved):
    got = mlp_offload.master_weights(saved["ckpt"])
    assert len(got) == len(saved["engine"])
    for g, want, ref in zip(got, saved["engine"], saved["torch"]):
        assert g.dtype == torch.float32 and torch.equal(g, want)
        torch.testing.assert_close(g, ref, rtol=1e-5, atol=1e-6)  # and torch's AdamW


def test_load_master_weights_into_a_model_of_any_dtype(saved):
    fp32 = _model(torch.float32)
    mlp_offload.load_master_weights(saved["ckpt"], fp32.parameters())
    for p, want in zip(fp32.parameters(), saved["engine"]):
        assert torch.equal(p.detach(), want)
    bf16 = _model(torch.bfloat16)
    mlp_offload.load_master_weights(saved["ckpt"], bf16.parameters())
    for p, want in zip(bf16.parameters(), saved["engine"]):
        assert torch.equal(p.detach(), want.to(torch.bfloat16))
    with pytest.raises(StateMismatchError, match="has 6 parameters, 5 were given"):
        mlp_offload.load_master_weights(saved["ckpt"], list(fp32.parameters())[:5])
    other = torch.nn.Sequential(torch.nn.Linear(24, 48), torch.nn.GELU(),
                                torch.nn.Linear(48, 41), torch.nn.GELU(),
                                torch.nn.Linear(41, 8))
    with pytest.raises(StateMismatchError, match=r"parameter 2 has shape \(41, 48\)"):
        mlp_offload.load_master_weights(saved["ckpt"], other.parameters())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_export_is_a_safetensors_file(saved, dtype):
    out = str(saved["tmp"] / f"weights-{str(dtype)[6:]}.safetensors")
    assert mlp_offload.export_master_weights(saved["ckpt"], out, dtype=dtype,
                                             names=saved["names"]) == out
    got = safetensors.torch.load_file(out)
    assert sorted(got) == sorted(saved["names"])
    for name, want in zip(saved["names"], saved["engine"]):
        assert got[name].dtype == dtype and torch.equal(got[name], want.to(dtype)), name
    # Into a model as it names its parameters.
    model = _model(dtype)
    model.load_state_dict(got)
    assert not any(n.endswith(".tmp") or ".tmp-" in n for n in os.listdir(saved["tmp"]))


def test_export_default_names_and_bad_arguments(saved):
    out = str(saved["tmp"] / "default.safetensors")
    mlp_offload.export_master_weights(saved["ckpt"], out)
    got = safetensors.torch.load_file(out)
    assert sorted(got) == sorted(f"param.{i}" for i in range(len(saved["engine"])))
    assert torch.equal(got["param.3"], saved["engine"][3])
    with pytest.raises(ConfigError, match="2 names for the checkpoint's 6 parameters"):
        mlp_offload.export_master_weights(saved["ckpt"], out, names=["a", "b"])
    with pytest.raises(ConfigError, match="distinct"):
        mlp_offload.export_master_weights(saved["ckpt"], out, names=["a"] * 6)
    with pytest.raises(ConfigError, match="dtype"):
        mlp_offload.export_master_weights(saved["ckpt"], out, dtype=torch.int8)
    with pytest.raises(errors.TierNotFoundError,
                       match=f"checkpoint directory {saved['tmp'] / 'nothing'} does not exist"):
        mlp_offload.master_weights(str(saved["tmp"] / "nothing"))
    empty = saved["tmp"] / "empty"
    empty.mkdir()
    with pytest.raises(StateMismatchError, match="manifest.rank0.json is missing"):
        mlp_offload.master_weights(str(empty))


def copy_with_a_flipped_byte(saved, tmp_path, record, offset):
    """A copy of the saved checkpoint with one bit flipped in `record` at
    `offset` (from the end if negative); returns its directory."""
    ckpt = str(tmp_path / "ckpt")
    shutil.copytree(saved["ckpt"], ckpt)
    engine_dir = [d for d in os.listdir(ckpt) if d.startswith("engine-")][0]
    with open(os.path.join(ckpt, engine_dir, record), "r+b") as f:
        f.seek(offset, os.SEEK_END if offset < 0 else os.SEEK_SET)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0x40]))
    return ckpt


def test_a_damaged_record_is_refused_and_nothing_is_written(saved, tmp_path):
    ckpt = copy_with_a_flipped_byte(saved, tmp_path, "sg_1.ckpt", 4096 + 17)
    with pytest.raises(CorruptStateError, match="sg_1.ckpt: payload checksum mismatch"):
        mlp_offload.master_weights(ckpt)
    out = str(tmp_path / "w.safetensors")
    with pytest.raises(CorruptStateError):
        mlp_offload.export_master_weights(ckpt, out)
    assert os.listdir(tmp_path) == ["ckpt"]  # no partial file, no temporary one


def test_unverified_reads_take_the_weights_alone(saved, tmp_path):
    # A flipped byte in the last moment array: the checksum (over the whole
    # record) refuses it; unverified reads never read those bytes.
    ckpt = copy_with_a_flipped_byte(saved, tmp_path, "sg_0.ckpt", -3)
    with pytest.raises(CorruptStateError, match="sg_0.ckpt: payload checksum mismatch"):
        mlp_offload.master_weights(ckpt)
    got = mlp_offload.master_weights(ckpt, verify_checksums=False)
    assert all(torch.equal(g, w) for g, w in zip(got, saved["engine"]))
    model = _model(torch.float32)
    mlp_offload.load_master_weights(ckpt, model.parameters(), verify_checksums=False)
    assert all(torch.equal(p.detach(), w) for p, w in zip(model.parameters(), saved["engine"]))
    out = str(tmp_path / "w.safetensors")
    with contextlib.redirect_stdout(io.StringIO()):
        assert cli.main(["export", ckpt, out, "--no-verify"]) == 0
    got = safetensors.torch.load_file(out)
    assert all(torch.equal(got[f"param.{i}"], w) for i, w in enumerate(saved["engine"]))
    os.remove(out)
    with contextlib.redirect_stderr(io.StringIO()):
        assert cli.main(["export", ckpt, out]) == 1
    assert not os.path.exists(out)


def test_cli_export(saved, tmp_path):
    names = tmp_path / "names.txt"
    names.write_text("\n".join(saved["names"]) + "\n")
    out = str(tmp_path / "w.safetensors")
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        rc = cli.main(["export", saved["ckpt"], out, "--dtype", "bfloat16", "--names",
                       str(names), "--json"])
    assert rc == 0
    result = json.loads(buf.getvalue())
    assert result["out"] == out and result["dtype"] == "bfloat16"
    assert result["bytes"] == os.path.getsize(out)
    got = safetensors.torch.load_file(out)
    assert torch.equal(got[saved["names"][0]], saved["engine"][0].to(torch.bfloat16))
    # A checkpoint that is not there: one line, status 1.
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        rc = cli.main(["export", str(tmp_path / "missing"), out])
    assert rc == 1 and err.getvalue().startswith("mlp-offload export: error: ")
    # OUT inside the checkpoint (it could replace a manifest), names that
    # are not text: one line each, the checkpoint untouched.
    before = sorted(os.listdir(saved["ckpt"]))
    manifest = os.path.join(saved["ckpt"], "manifest.rank0.json")
    for argv, want in (
            ([manifest], "is inside the checkpoint directory"),
            ([out, "--names", str(tmp_path / "latin1.txt")], "is not UTF-8 text")):
        (tmp_path / "latin1.txt").write_bytes(b"caf\xe9\n")
        err = io.StringIO()
        with contextlib.redirect_stderr(err):
            rc = cli.main(["export", saved["ckpt"]] + argv)
        assert rc == 1 and want in err.getvalue(), err.getvalue()
        assert err.getvalue().count("\n") == 1
    assert sorted(os.listdir(saved["ckpt"])) == before
    json.loads(open(manifest).read())


def test_export_names_the_checkpoint_for_what_is_wrong_with_it(saved, tmp_path):
    # A checkpoint whose engine files are gone: the error is the read's,
    # naming the checkpoint, not a failure to write OUT; OUT is not made.
    ckpt = tmp_path / "damaged"
    shutil.copytree(saved["ckpt"], ckpt)
    (engine_dir,) = [d for d in os.listdir(ckpt) if d.startswith("engine-")]
    shutil.rmtree(ckpt / engine_dir)
    out = tmp_path / "w.safetensors"
    with pytest.raises(errors.TierNotFoundError) as e:
        mlp_offload.export_master_weights(ckpt, out)
    assert engine_dir in str(e.value) and "write the exported weights" not in str(e.value)
    assert not out.exists() and os.listdir(tmp_path) == ["damaged"]


def test_cli_export_missing_names_file_names_the_flag(tmp_path):
    names = tmp_path / "missing.txt"
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        rc = cli.main(["export", str(tmp_path / "ckpt"), str(tmp_path / "w.safetensors"),
                       "--names", str(names)])
    assert rc == 1
    assert err.getvalue() == (f"mlp-offload export: error: --names {names}: "
                              f"No such file or directory\n"), err.getvalue()
