import os

import pytest
import torch

# Tests never touch the user's caches.
os.environ.setdefault("CONVLOWER_CACHE_DIR", os.path.join(os.path.dirname(__file__), "..", ".pytest_cache", "convlower"))


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    import convlower

    # A graph served from Inductor's cache runs no pass and adds no report entry; tests that
    # inspect the report need real compiles (cache behaviour is tested in subprocesses).
    torch._inductor.config.force_disable_caches = True

    torch._dynamo.reset()
    convlower.reset_report()
    yield
    torch._dynamo.reset()


@pytest.fixture
def cache(tmp_path):
    """A cold, private decision cache for measured selection, and the default timer back after
    the test (which may install a stub with ``measure.set_timer``)."""
    from convlower import selection

    selection.set_cache_dir(tmp_path)
    selection.clear_memory()
    prev = selection.set_timer(None)
    yield tmp_path
    selection.set_timer(prev)
    selection.set_cache_dir(None)
    selection.clear_memory()
