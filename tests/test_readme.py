"""README.md runs as written (issue 18): every ```python block is executed in a fresh Python
process from an empty folder, so it cannot drift from the code. Blocks that mention "cuda" are
GPU tests (skipped without CUDA); the others run in CI. The CPU block switches the Triton
interpreter on itself: the subprocess starts without TRITON_INTERPRET, as a newcomer's shell
would."""

import os
import pathlib
import re
import subprocess
import sys

import pytest
import torch

ROOT = pathlib.Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
PYTHON_BLOCK = re.compile(r"^```python[ \t]*\n(.*?)^```", re.M | re.S)


def python_blocks() -> list[tuple[int, str]]:
    """(line number of the opening fence, code) for every ```python block."""
    text = README.read_text(encoding="utf-8")
    return [(text.count("\n", 0, m.start()) + 1, m.group(1)) for m in PYTHON_BLOCK.finditer(text)]


def needs_cuda(code: str) -> bool:
    return "cuda" in code


def block_params():
    return [
        pytest.param(code, id=f"line{line}-{'cuda' if needs_cuda(code) else 'cpu'}",
                     marks=[pytest.mark.gpu] if needs_cuda(code) else [])
        for line, code in python_blocks()
    ]


def test_readme_has_a_cpu_and_a_cuda_block():
    """Also parses every block, so a GPU block's syntax is checked in CI too."""
    blocks = python_blocks()
    assert {needs_cuda(code) for _, code in blocks} == {True, False}, "README.md must keep a CUDA quick start and a CPU one"
    for line, code in blocks:
        compile(code, f"README.md:{line}", "exec")


@pytest.mark.parametrize("code", block_params())
def test_readme_block_runs(code, tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    if needs_cuda(code) and not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    result = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 0, f"README block failed:\n{code}\n--- stderr ---\n{result.stderr[-4000:]}"
