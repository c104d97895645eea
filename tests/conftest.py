"""Shared pytest fixtures."""
import pytest
import torch


@pytest.fixture(scope="module")
def single_thread():
    """For modules of tiny models: a second thread costs more than it saves (far more on a busy machine).

    Use with `pytestmark = pytest.mark.usefixtures("single_thread")`."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)
