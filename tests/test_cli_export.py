"""`mlp-offload export`'s options (the export itself:
test_checkpoint_export.py)."""
import contextlib
import io

import pytest
import safetensors.torch
import torch
from conftest import tier_dirs

from mlp_offload import MLPOffloadOptimizer, cli

torch.set_num_threads(1)  # CI shares 2 cores between test processes


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    """A checkpoint of a model of 4 parameters (2 weights, 2 biases)."""
    tmp = tmp_path_factory.mktemp("ckpt")
    model = torch.nn.Sequential(torch.nn.Linear(6, 4), torch.nn.Linear(4, 2))
    opt = MLPOffloadOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-2),
                              tiers=tier_dirs(tmp), compute_threads=1)
    model(torch.randn(3, 6)).square().mean().backward()
    opt.step()
    opt.save_checkpoint(str(tmp / "ckpt"))
    opt.close()
    return str(tmp / "ckpt")


def _export(argv):
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        code = cli.main(["export"] + argv)
    return code, err.getvalue()


@pytest.mark.parametrize("text,want", [
    ("0.weight\n\n0.bias\n1.weight\n1.bias\n", "line 2 is blank"),
    ("0.weight\n0.bias\n  \n1.weight\n\n1.bias\n", "lines 3, 5 are blank"),
    ("0.weight\n0.bias\n1.weight\n1.bias\n\n", "line 5 is blank"),
])
def test_export_refuses_blank_names_naming_the_line(ckpt, tmp_path, text, want):
    # A blank line is an error naming it (before: dropped, and the names
    # after it shifted to the wrong parameters, or "3 names for the
    # checkpoint's 4 parameters").
    names = tmp_path / "names.txt"
    names.write_text(text)
    out = tmp_path / "w.safetensors"
    code, err = _export([ckpt, str(out), "--names", str(names)])
    assert code == 1 and err == (f"mlp-offload export: error: --names {names}: {want} (one "
                                 f"tensor name per line, no blank lines)\n"), err
    assert not out.exists()


def test_export_takes_one_name_per_line(ckpt, tmp_path):
    names = tmp_path / "names.txt"
    names.write_text("0.weight\n0.bias\n1.weight\n1.bias\n")
    out = tmp_path / "w.safetensors"
    assert _export([ckpt, str(out), "--names", str(names)]) == (0, "")
    got = safetensors.torch.load_file(str(out))
    assert sorted(got) == ["0.bias", "0.weight", "1.bias", "1.weight"]
    assert got["0.weight"].shape == (4, 6) and got["1.bias"].shape == (2,)


def test_export_to_a_directory_says_to_name_the_file(ckpt, tmp_path):
    # Before: "OUT/: Not a directory", from the write of a temporary file.
    out = tmp_path / "exports"
    out.mkdir()
    for given in (str(out), str(out) + "/"):
        code, err = _export([ckpt, given])
        assert code == 1 and err == (f"mlp-offload export: error: OUT {given} is a directory: "
                                     f"give the file to write, e.g. "
                                     f"{given.rstrip('/')}/model.safetensors\n"), err
    assert list(out.iterdir()) == []
