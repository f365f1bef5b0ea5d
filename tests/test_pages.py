import threading

import pytest

from fcp_compiler import compile_plan
from fcp_compiler.algorithms import pages
from fcp_compiler.algorithms.pages import base_pages, huge_pages_advised
from fcp_compiler.format.validate import validate_plan

pytestmark = pytest.mark.skipif(huge_pages_advised() is None, reason="this NumPy has no huge-page switch")


@pytest.fixture(params=[True, False])
def advised(request):
    """Each test runs with NumPy's huge-page advice on, then off, and leaves it as it found it."""
    found = pages._SWITCH(request.param)
    yield request.param
    pages._SWITCH(found)


def test_base_pages_turns_the_advice_off_and_gives_back_what_it_found(advised):
    with base_pages():
        assert huge_pages_advised() is False
        with base_pages():
            assert huge_pages_advised() is False
        assert huge_pages_advised() is False  # an inner caller leaving does not turn it back on
    assert huge_pages_advised() is advised


def test_base_pages_gives_the_setting_back_when_the_block_raises(advised):
    with pytest.raises(RuntimeError), base_pages():
        raise RuntimeError("a pass failed")
    assert huge_pages_advised() is advised


def test_overlapping_callers_on_threads_restore_the_setting_only_when_the_last_leaves(advised):
    entered, release, seen = threading.Barrier(2), threading.Event(), []

    def first():
        with base_pages():
            entered.wait()
            release.wait()

    worker = threading.Thread(target=first)
    worker.start()
    with base_pages():
        entered.wait()
    seen.append(huge_pages_advised())  # this thread has left; the worker is still inside
    release.set()
    worker.join()
    assert seen == [False]
    assert huge_pages_advised() is advised


def test_compile_and_validate_allocate_in_base_pages(advised):
    during = []
    plan = compile_plan([3000, 900, 5000], 4, block_size=512, gpus_per_node=2,
                        progress=lambda record: during.append(huge_pages_advised()))
    assert during and set(during) == {False}
    assert huge_pages_advised() is advised
    validate_plan(plan.to_bytes())
    assert huge_pages_advised() is advised
