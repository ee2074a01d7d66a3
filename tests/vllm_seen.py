"""Notes when a process imports vLLM or builds a vLLM engine, for the `vllm` marker's check
(tests/vllm_selection.py). Imported by tests/conftest.py in each pytest process and preloaded by
tests/rank_launcher.py's fork server, whose forked ranks inherit it: an import hook that, while
VERL_HPC_TEST_VLLM_SEEN names a file (the running test's, set by tests/vllm_selection.py and passed
to the ranks it starts), appends a line there on every `vllm.LLM(...)` and, in a rank, on its first
`import vllm`. It imports nothing of vLLM or the project; without the variable it writes nothing.
"""
import importlib.abc
import importlib.machinery
import os
import sys

ENV = "VERL_HPC_TEST_VLLM_SEEN"
# whether the first `import vllm` is noted: in a rank, yes (every forked rank starts without vLLM);
# not in a pytest process, where whichever test comes first would be named (its engines are noted)
NOTE_IMPORTS = True


def note(what: str) -> None:
    path = os.environ.get(ENV)
    if not path:
        return
    try:
        with open(path, "a") as f:
            f.write(f"{os.getpid()} {what}\n")
    except OSError:  # the test's folder is gone (a process outliving its test): nothing to tell
        pass


def _wrap_llm(module) -> None:
    llm = getattr(module, "LLM", None)
    init = getattr(llm, "__init__", None)
    if init is None or getattr(init, "_verl_hpc_seen", False):
        return

    def __init__(self, *args, **kwargs):
        note("built a vllm.LLM engine")
        return init(self, *args, **kwargs)

    __init__._verl_hpc_seen = True
    __init__.__wrapped__ = init
    llm.__init__ = __init__


class _Finder(importlib.abc.MetaPathFinder):
    """Answers no import itself: notes `vllm`'s first import, and wraps `vllm.LLM.__init__` once its
    module has run (its loader's exec_module, on that one spec)."""

    def find_spec(self, name, path=None, target=None):
        if name == "vllm":
            if NOTE_IMPORTS:
                note("imported vllm")
            return None
        if name != "vllm.entrypoints.llm":
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        real = spec.loader.exec_module

        def exec_module(module):
            real(module)
            _wrap_llm(module)

        spec.loader.exec_module = exec_module
        return spec


def install() -> None:
    """Idempotent; where vLLM's engine module was imported already, its class is wrapped now."""
    if not any(isinstance(f, _Finder) for f in sys.meta_path):
        sys.meta_path.insert(0, _Finder())
    if "vllm.entrypoints.llm" in sys.modules:
        _wrap_llm(sys.modules["vllm.entrypoints.llm"])


install()
