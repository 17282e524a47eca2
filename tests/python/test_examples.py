"""The transformers examples stay importable and runnable without transformers (it is imported
inside main(), so CI, which has no transformers, can at least parse their flags)."""
import os
import subprocess
import sys

import pytest

from conftest import REPO

EXAMPLES = os.path.join(REPO, "client", "python", "examples")


@pytest.mark.parametrize("script", ["llama_transformers.py", "deepseek_mla_transformers.py"])
def test_example_help_needs_no_transformers(script):
    result = subprocess.run([sys.executable, os.path.join(EXAMPLES, script), "--help"],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    for flag in ("--target", "--transport", "cuda_ipc", "--dtype", "--decode-steps"):
        assert flag in result.stdout
