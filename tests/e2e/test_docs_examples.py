"""The runtime example of docs/concepts/runtime.md runs as written (it spawns a child process, so it runs as
a script)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_runtime_page_example_runs(tmp_path):
    text = (ROOT / "docs" / "concepts" / "runtime.md").read_text()
    blocks = re.findall(r"```python\n(.*?)```", text, flags=re.DOTALL)
    example = next(b for b in blocks if "ActorSystem" in b)
    script = tmp_path / "example.py"
    script.write_text(example)
    done = subprocess.run([sys.executable, str(script)], cwd=tmp_path, capture_output=True, text=True,
                          timeout=120, check=False)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "2"
