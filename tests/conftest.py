"""Fixtures shared by the test modules."""

import pytest
import torch.distributed as dist


@pytest.fixture
def pg(tmp_path):
    """A world-size-1 gloo group for the test (one left by an earlier test is reused)."""
    if dist.is_initialized():
        if dist.get_world_size() != 1:
            pytest.skip("a process group of another size is already initialized")
        yield
        return
    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0,
                            world_size=1)
    yield
    dist.destroy_process_group()
