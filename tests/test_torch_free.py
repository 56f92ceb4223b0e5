"""`nvcomp-ckpt inspect` and `verify` run where torch cannot be imported (manifest.py's promise).

The checkpoint is written here, with torch: a DeepSpeed-style tag (the golden ZeRO-1/2 files, a
module derived from the optimizer shard beside it, and a shard `nce.save` writes now) with its
manifest and `latest`. Each command then runs in a child Python whose `sitecustomize` makes
`import torch` raise ImportError, and the child checks that no torch module was loaded.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import nvcomp_ckpt_engine as nce
from conftest import commit_single_rank_tag
from nvcomp_ckpt_engine import container, formats

REPO = Path(__file__).resolve().parents[1]
GOLDEN = Path(__file__).parent / "golden" / "v2_derived"
TAG = "global_step1"
SOURCE, MODULE, EXTRA = "optim_states.nvckpt", "model_states.nvckpt", "extra_states.nvckpt"

BLOCKER = """\
import sys


class _NoTorch:
    def find_spec(self, name, path=None, target=None):
        if name == "torch" or name.startswith("torch."):
            raise ImportError(f"No module named {name!r} (blocked by the test)")
        return None


sys.meta_path.insert(0, _NoTorch())
"""

#: The child: run the CLI, then fail (status 99) if any torch module was loaded.
CHILD = """\
import sys
from nvcomp_ckpt_engine.cli import main
status = main(sys.argv[1:])
loaded = sorted(m for m in sys.modules if m == "torch" or m.startswith("torch."))
if loaded:
    print(f"torch was imported: {loaded[:5]}", file=sys.stderr)
    sys.exit(99)
try:
    import torch
except ImportError:
    sys.exit(status)
print("the torch blocker is not installed", file=sys.stderr)
sys.exit(98)
"""


@pytest.fixture(scope="module")
def blocker(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("notorch")
    (folder / "sitecustomize.py").write_text(BLOCKER)
    return folder


@pytest.fixture
def save_dir(tmp_path: Path) -> Path:
    """A committed tag (manifest, `latest`) in a save directory."""
    folder = tmp_path / "ckpt" / TAG
    folder.mkdir(parents=True)
    for source in sorted(GOLDEN.iterdir()):
        shutil.copy(source, folder / source.name)
    nce.save({"w": torch.randn(64, 32), "h": torch.randn(100).to(torch.bfloat16),
              "step": torch.tensor(7), "meta": {"lr": 0.1}}, folder / EXTRA, chunk_mb=1 / 1024)
    commit_single_rank_tag(folder, TAG)
    return folder.parent


def run_without_torch(blocker: Path, *argv: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["PYTHONPATH"] = os.pathsep.join([str(blocker), str(REPO)])
    done = subprocess.run([sys.executable, "-c", CHILD, *argv], env=env, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode not in (98, 99), done.stderr
    return done


def test_inspect_runs_without_torch(blocker, save_dir):
    done = run_without_torch(blocker, "inspect", str(save_dir))
    assert done.returncode == 0, done.stderr
    for name in (SOURCE, MODULE, EXTRA):
        assert name in done.stdout
    assert "derived from 1 other file(s)" in done.stdout and "total: 3 files" in done.stdout
    done = run_without_torch(blocker, "inspect", "--json", str(save_dir / TAG / EXTRA))
    assert done.returncode == 0, done.stderr
    assert {t["key"] for f in json.loads(done.stdout)["files"] for t in f["tensors"]} >= {"w", "h"}


@pytest.mark.parametrize("where", ["save_dir", "tag_dir", "file", "derived_file"])
def test_verify_runs_without_torch(blocker, save_dir, where):
    target = {"save_dir": save_dir, "tag_dir": save_dir / TAG, "file": save_dir / TAG / EXTRA,
              "derived_file": save_dir / TAG / MODULE}[where]
    done = run_without_torch(blocker, "verify", "-q", str(target))
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.strip().endswith(": OK")


def test_verify_without_torch_names_a_damaged_shard(blocker, save_dir):
    path = save_dir / TAG / EXTRA
    offset = max(container.read_index(path).storages, key=lambda s: s.nbytes).chunks[0].offset
    data = bytearray(path.read_bytes())
    data[offset + 3] ^= 0x10
    path.write_bytes(bytes(data))
    for target in (save_dir, path):
        done = run_without_torch(blocker, "verify", "-q", str(target))
        assert done.returncode == 1, done.stdout + done.stderr
        faults = [line for line in done.stdout.splitlines() if line.startswith("FAULT: ")]
        assert len(faults) == 1 and EXTRA in faults[0] and "checksum mismatch" in faults[0]


def test_verify_without_torch_checks_derived_sources(blocker, save_dir):
    """The derived ranges' sources are checked from their indexes, which needs no torch."""
    (save_dir / TAG / SOURCE).unlink()
    done = run_without_torch(blocker, "verify", "-q", str(save_dir / TAG / MODULE))
    assert done.returncode == 1, done.stdout + done.stderr
    assert MODULE in done.stdout and SOURCE in done.stdout and "derived" in done.stdout


def test_a_dcp_folder_without_torch_is_refused_naming_torch(blocker, tmp_path):
    folder = tmp_path / "dcp"
    folder.mkdir()
    (folder / ".metadata").write_bytes(b"")
    for command in ("inspect", "verify"):
        done = run_without_torch(blocker, command, str(folder))
        assert done.returncode == 1, done.stdout + done.stderr
        (line,) = done.stderr.strip().splitlines()
        assert "torch.distributed.checkpoint" in line and "needs torch" in line


def test_the_format_facts_agree_with_torch():
    """formats' dtype tables say what torch says of the same dtypes."""
    assert list(formats.ITEMSIZES) == list(container.DTYPES)
    for name, dtype in container.DTYPES.items():
        assert dtype == getattr(torch, name) and dtype.itemsize == formats.ITEMSIZES[name], name
        assert dtype.is_floating_point == (name in formats.FLOAT_DTYPES), name
    assert {dtype: name for name, dtype in container.DTYPES.items()} == container.DTYPE_NAMES


def test_the_package_imports_without_torch_and_its_names_load_it_on_use(blocker):
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["PYTHONPATH"] = os.pathsep.join([str(blocker), str(REPO)])
    code = ("import nvcomp_ckpt_engine as nce, nvcomp_ckpt_engine.manifest, sys\n"
            "import nvcomp_ckpt_engine.manifest_files, nvcomp_ckpt_engine.opened\n"
            "assert nce.CheckpointError and nce.__version__ and nce.is_shard_file\n"
            "assert 'torch' not in sys.modules\n"
            "try:\n    nce.save\nexcept ImportError as exc:\n    print(exc)\n")
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0 and "torch" in done.stdout, done.stderr
    from nvcomp_ckpt_engine import api, pipeline, state

    assert (nce.save, nce.load, nce.save_async, nce.PendingSave) == (
        api.save, api.load, api.save_async, api.PendingSave)
    assert nce.ShardInfo is pipeline.ShardInfo and nce.add_safe_classes is state.add_safe_classes
    assert nce.is_shard_file is container.is_shard_file
    with pytest.raises(AttributeError):
        nce.no_such_name
