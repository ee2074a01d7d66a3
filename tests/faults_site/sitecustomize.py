"""Test faults in a job's processes (tests/faults.py says what and why): this folder is first on
PYTHONPATH only in the environment tests/faults.py's env() builds, so Python runs this file at the
start of each process of such a job, before its own code. With VERL_HPC_TEST_FAULTS set it loads
tests/faults.py and installs its import hook; it imports nothing of the project and not torch.
Then it runs the sitecustomize this one hides, if the interpreter has one (Debian's, for example)."""
import importlib.machinery
import importlib.util
import os
import sys

_HERE = os.path.dirname(os.path.abspath(__file__))


def _load(name, spec):
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


if os.environ.get("VERL_HPC_TEST_FAULTS"):
    try:
        _faults = os.path.join(os.path.dirname(_HERE), "faults.py")
        _load("_verl_hpc_test_faults", importlib.util.spec_from_file_location("_verl_hpc_test_faults", _faults))
        sys.modules["_verl_hpc_test_faults"].install_from_env()
    except BaseException:  # site.py would print one line and run the job without its faults
        import traceback

        traceback.print_exc()
        sys.stderr.write("tests/faults_site/sitecustomize.py: the test faults could not be installed\n")
        sys.stderr.flush()
        os._exit(70)

_next = importlib.machinery.PathFinder.find_spec(
    "sitecustomize", [p for p in sys.path if os.path.abspath(p or os.curdir) != _HERE])
if _next is not None:
    _load("sitecustomize", _next)  # it replaces this module under the name, as if it had been found first
