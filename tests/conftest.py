import os
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

ROOT = Path(__file__).resolve().parents[1]
SHARED_DATA = ROOT.parent / "shared" / "data"
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))
# tests/ mirrors the code's folders; some tests reuse another's helpers by module name (test_* names are unique)
for folder in sorted(p for p in (ROOT / "tests").rglob("*") if p.is_dir() and p.name != "__pycache__"):
    sys.path.append(str(folder))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
if os.environ.get("PYTEST_XDIST_WORKER"):  # two workers on two cores: OpenMP pools of 2 threads each would spin
    torch.set_num_threads(1)


def shared_data(*parts) -> Path:
    """A file of ../shared/data, or skip the test with the reason."""
    path = SHARED_DATA.joinpath(*parts)
    if not path.exists():
        pytest.skip(f"shared data file {path} is absent (CI always has ../shared/data)")
    return path


_LAUNCHER_VARIABLES = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_SIZE", "MASTER_ADDR", "MASTER_PORT")


@pytest.fixture(autouse=True)
def _no_process_group_left_in_pytest():
    """A command run inside the pytest process must leave no process group and no launcher variables behind:
    every later subprocess test would inherit MASTER_PORT and fail with EADDRINUSE, far from the cause. The leak
    is undone here and fails the test that made it."""
    before = {name: os.environ.get(name) for name in _LAUNCHER_VARIABLES}
    yield
    leaked = [name for name, value in before.items() if os.environ.get(name) != value]
    for name, value in before.items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
        leaked.append("a torch.distributed process group")
    assert not leaked, f"the test left {', '.join(leaked)} in the pytest process; run the command in a rank of its own"
