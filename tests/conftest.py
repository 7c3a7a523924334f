import atexit
import os
import shutil
import tempfile

# Scalar C++ kernels in tests (and in the processes they start): Inductor's vectorised CPU
# codegen costs seconds per graph and is not what these tests are about (convlower's pass runs
# before it); it roughly halves the suite's compile time.  Tests marked ``vectorized`` (and
# the benchmarks) run Inductor's default codegen.
os.environ.setdefault("TORCHINDUCTOR_VEC_ISA_OK", "0")
# Tests never touch the user's caches; the compiled-kernel cache is a fresh directory per run,
# removed when the run ends.
if "TORCHINDUCTOR_CACHE_DIR" not in os.environ:
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = tempfile.mkdtemp(prefix="convlower-tests-inductor-")
    atexit.register(shutil.rmtree, os.environ["TORCHINDUCTOR_CACHE_DIR"], ignore_errors=True)
# Decisions do not depend on which machine runs the tests: no shipped seeds (test_close_calls
# reads the shipped table and its own).
os.environ.setdefault("CONVLOWER_SEED_FILE", os.path.join(os.path.dirname(__file__), "no-seeds.json"))
os.environ.setdefault("CONVLOWER_CACHE_DIR", os.path.join(os.path.dirname(__file__), "..", ".pytest_cache", "convlower"))

import pytest  # noqa: E402
import torch  # noqa: E402


@pytest.fixture(autouse=True)
def _fresh_dynamo(request):
    import convlower
    from convlower.selection import close_calls

    # A graph served from Inductor's FX graph or AOTAutograd cache runs no pass and adds no
    # report entry; tests that inspect the report need real compiles (cache behaviour is
    # tested in subprocesses).  Only those two caches are off: the compiled-kernel cache stays.
    torch._inductor.config.fx_graph_cache = False
    torch._functorch.config.enable_autograd_cache = False
    vectorized = request.node.get_closest_marker("vectorized") is not None
    torch._inductor.config.cpp.vec_isa_ok = None if vectorized else False

    torch._dynamo.reset()
    convlower.reset_report()
    close_calls.forget()  # a warm-up settles every open close call: none from other tests
    yield
    torch._dynamo.reset()


@pytest.fixture
def fresh_regions():
    """No region part compiled by another test is reused, before or after this one."""
    from convlower import regions

    regions.clear()
    yield
    regions.clear()


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


@pytest.fixture
def figures(cache):
    """Screen figures injected per test (``figures({"aten": ..., rule: ...})``); the eager
    screen back afterwards."""
    from convlower.selection import screen

    def install(times):
        screen.set_screen(lambda site, cands, dt: dict(times))
    yield install
    screen.set_screen(None)
