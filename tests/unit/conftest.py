"""What every unit test leaves as it found: no default process group (the planner's fake world, a Trainer on one
device and a library that starts one on its own — accelerate — would leave the next test a world it did not ask
for; the planner then refuses to plan)."""

from __future__ import annotations

import pytest
import torch.distributed as dist


@pytest.fixture(autouse=True)
def no_process_group_left_behind(request):
    before = dist.is_available() and dist.is_initialized()
    yield
    if not before and dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
        pytest.fail(f"{request.node.nodeid} left a default process group initialized; destroy it in the test")
