"""Suite-wide pytest setup: the `cpp_raises` marker.

A test marked `cpp_raises` makes the C++ extension throw (a bad input expected to raise, through
the dispatcher or pybind11). Where C++ exceptions cannot cross the extension boundary
(specdec_inductor.cpp_exceptions_work() is False -- seen with Ubuntu g++ 13.3 and torch
2.11.0+cu130, where any throw aborts the process), such a test would kill the whole run, so it is
skipped there with the probe's cause. The marker is applied:
  - explicitly: @pytest.mark.cpp_raises on a test, or `pytestmark` in a module;
  - by module: every test in a file listed in CPP_RAISES_MODULES (the bad-input suites);
  - by name: a test whose name contains one of CPP_RAISES_NAME_PARTS;
  - by body: a test function whose source calls pytest.raises (its expected error usually comes
    from C++; one raised in Python is skipped too there, which costs only coverage).
Everywhere else the marker changes nothing."""
import inspect

import pytest

CPP_RAISES_MODULES = {"test_bad_inputs.py"}
CPP_RAISES_NAME_PARTS = ("bad_input", "raises", "rejects")


def pytest_configure(config):
    config.addinivalue_line(
        "markers", "cpp_raises: the test makes the C++ extension throw; skipped where C++ "
                   "exceptions abort the process (specdec_inductor.cpp_exceptions_work())")


def _raises_in_cpp(item) -> bool:
    if item.get_closest_marker("cpp_raises") is not None:
        return True
    if item.path.name in CPP_RAISES_MODULES:
        return True
    name = getattr(item, "originalname", item.name)
    if any(part in name for part in CPP_RAISES_NAME_PARTS):
        return True
    function = getattr(item, "function", None)
    try:
        return function is not None and "pytest.raises(" in inspect.getsource(function)
    except (OSError, TypeError):
        return False


def pytest_collection_modifyitems(config, items):
    import specdec_inductor
    for item in items:
        if _raises_in_cpp(item):
            item.add_marker(pytest.mark.cpp_raises)
    if specdec_inductor.cpp_exceptions_work():
        return
    skip = pytest.mark.skip(reason="C++ exceptions abort the process with this build of the "
                                   f"extension ({specdec_inductor.cpp_exceptions_cause()})")
    for item in items:
        if item.get_closest_marker("cpp_raises") is not None:
            item.add_marker(skip)
