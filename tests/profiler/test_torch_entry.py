"""``ppipe profile --torch MODULE:FACTORY`` (issue 23): a PyTorch module exported to ONNX and profiled.

Skipped where torch is not installed (CI's ``.[test]`` does not pull it). The model is a
small torchvision-style ResNet (stem, max-pool, residual basic blocks with batch-norm,
global pooling, flatten, linear) written into the test's own package.
"""

from __future__ import annotations

import textwrap

import numpy as np
import pytest
from click.testing import CliRunner

from ppipe.cli import main

torch = pytest.importorskip("torch", reason="torch is not installed (pip install '.[torch]'); CI's .[test] does not pull it")
pytest.importorskip("onnxscript", reason="torch.onnx.export(dynamo=True) needs onnxscript (pip install '.[torch]')")

NETS = '''
import torch
from torch import nn


class BasicBlock(nn.Module):
    def __init__(self, cin, cout, stride=1):
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.down = None if stride == 1 and cin == cout else nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))

    def forward(self, x):
        idt = x if self.down is None else self.down(x)
        return torch.relu(self.bn2(self.conv2(torch.relu(self.bn1(self.conv1(x))))) + idt)


def tiny_resnet():
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(3, 8, 7, 2, 3, bias=False), nn.BatchNorm2d(8), nn.ReLU(), nn.MaxPool2d(3, 2, 1),
        BasicBlock(8, 8), BasicBlock(8, 16, 2), BasicBlock(16, 16),
        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(16, 10),
    )
'''


@pytest.fixture
def nets_module(tmp_path, monkeypatch):
    pkg = tmp_path / "src" / "mynets"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "models.py").write_text(textwrap.dedent(NETS))
    monkeypatch.syspath_prepend(str(tmp_path / "src"))
    return "mynets.models:tiny_resnet"


def test_a_torch_factory_is_exported_cut_and_profiled_and_its_blocks_answer_like_the_module(nets_module, tmp_path):
    out = tmp_path / "prof"
    res = CliRunner().invoke(
        main,
        ["profile", "--torch", nets_module, "--input-shape", "3,64,64", "-o", str(out), "--blocks", "3",
         "--batches", "1,2", "--cpu-levels", "1", "--reps", "2", "--no-progress"],
    )
    assert res.exit_code == 0, res.output
    assert (out / "tiny_resnet.onnx").is_file() and (out / "profile.csv").is_file()
    from ppipe.profiler.blocks import run_blocks
    from ppipe.spec.profile import load_profile

    profile = load_profile(out)
    assert profile.num_blocks == 3 and len(profile.table) == 3 * 2
    import onnx

    from mynets.models import tiny_resnet

    x = np.random.default_rng(0).standard_normal((2, 3, 64, 64)).astype(np.float32)
    with torch.no_grad():
        want = tiny_resnet().eval()(torch.from_numpy(x)).numpy()
    blocks = [onnx.load(str(p)) for p in sorted((out / "blocks").glob("block_*.onnx"))]
    got = next(iter(run_blocks(blocks, {profile.manifest.input.name: x}).values()))
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize(
    ("args", "match"),
    [
        (["--torch", "mynets.models:tiny_resnet"], "needs --input-shape"),
        (["--torch", "mynets.models", "--input-shape", "3,8,8"], "expected MODULE:FACTORY"),
        (["--torch", "mynets.models:nothing", "--input-shape", "3,8,8"], "is not a callable"),
        (["--torch", "mynets.models:tiny_resnet", "--builtin", "resnet50"], "give one model"),
    ],
)
def test_bad_torch_entry_points_are_user_errors(nets_module, tmp_path, args, match):
    res = CliRunner().invoke(main, ["profile", *args, "-o", str(tmp_path / "o")])
    assert res.exit_code == 2 and match in res.output, res.output
