"""DESIGN.md's rules of the house that a machine can check."""
import ast
from pathlib import Path


PACKAGE = Path(__file__).resolve().parents[2] / "verl_hpc"
# runtime/ decides CPU or CUDA; cpu_compat stands in for torch.cuda inside megatron on CPU
CUDA_ALLOWED = ("runtime/", "parallel/cpu_compat.py")


def _cuda_uses(path: Path):
    tree = ast.parse(path.read_text(), str(path))
    for node in ast.walk(tree):
        if (isinstance(node, ast.Attribute) and node.attr == "cuda"
                and isinstance(node.value, ast.Name) and node.value.id == "torch"):
            yield node.lineno


def test_only_runtime_reaches_torch_cuda():
    found = [f"{p.relative_to(PACKAGE)}:{line}" for p in sorted(PACKAGE.rglob("*.py"))
             if not str(p.relative_to(PACKAGE)).startswith(CUDA_ALLOWED) for line in _cuda_uses(p)]
    assert not found, f"torch.cuda outside runtime/ (go through verl_hpc.runtime.device): {found}"


def test_the_check_sees_a_use(tmp_path):
    f = tmp_path / "m.py"
    f.write_text("import torch\n# torch.cuda in a comment\nx = torch.cuda.is_available()\n")
    assert list(_cuda_uses(f)) == [3]
