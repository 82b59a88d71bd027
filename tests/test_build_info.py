"""The extension imports next to torch and reports how it was built."""
import json
import os
import re

import pytest
import torch

import mlp_offload
from mlp_offload import _C


def test_imports_next_to_torch():
    assert torch.__version__.startswith("2.")
    assert mlp_offload.__version__ == mlp_offload.build_info()["version"]


def test_build_info_fields():
    info = mlp_offload.build_info()
    assert re.fullmatch(r"\d+\.\d+\.\d+", info["version"])
    assert info["compiler"].split()[0] in ("gcc", "clang")
    supported = info["simd_targets_supported"]
    assert supported, "no SIMD target compiled in"
    # Dynamic dispatch picks the best target this CPU supports.
    assert info["simd_target"] == supported[0]
    assert isinstance(info["cuda"], bool)


def test_extension_does_not_link_libtorch():
    # One wheel must fit any torch: the extension may not depend on libtorch.
    with open(_C.__file__, "rb") as f:
        blob = f.read()
    assert b"libtorch" not in blob and b"libc10" not in blob


def test_the_command_line_module_imports_without_torch():
    # `mlp-offload` imports torch inside main(), where Ctrl-C during the
    # import is "interrupted" and not a traceback; the API is still there.
    import subprocess
    import sys
    code = ("import sys, mlp_offload.cli; assert 'torch' not in sys.modules, 'torch'; "
            "from mlp_offload import MLPOffloadOptimizer; assert 'torch' in sys.modules; "
            "import mlp_offload; assert 'master_weights' in dir(mlp_offload)")
    subprocess.run([sys.executable, "-c", code], check=True, env=dict(os.environ),
                   cwd=os.getcwd())


def test_info_takes_json_like_the_other_commands_and_help_says_no_verify_is_off(capsys):
    from mlp_offload import cli
    assert cli.main(["info", "--json"]) == 0
    assert "version" in json.loads(capsys.readouterr().out)
    with pytest.raises(SystemExit):
        cli.main(["export", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    verify = text[text.index("--no-verify"):]
    assert "(default: True)" not in verify[:400], verify[:400]
