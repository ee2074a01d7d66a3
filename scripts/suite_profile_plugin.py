"""The pytest half of scripts/suite_profile.py: each test's CPU in its worker, and its wall time,
to $SUITE_PROFILE_LOG/tests_<worker>.jsonl (`-p suite_profile_plugin`; the .pth file that
`suite_profile.py install` writes puts this folder on the path)."""
import json
import os
import time

import pytest


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    t0, w0 = os.times(), time.time()
    yield
    folder = os.environ.get("SUITE_PROFILE_LOG")
    if folder:
        t1 = os.times()
        worker = os.environ.get("PYTEST_XDIST_WORKER", "main")
        with open(os.path.join(folder, f"tests_{worker}.jsonl"), "a") as f:
            f.write(json.dumps(dict(test=item.nodeid, wall=time.time() - w0,
                                    cpu=(t1.user + t1.system) - (t0.user + t0.system))) + "\n")
