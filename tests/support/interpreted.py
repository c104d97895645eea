"""Checks that run under Triton's interpreter: TRITON_INTERPRET=1 must be set before triton is imported, so a
module's ``interpreted_checks()`` (a test module's, or a helper module importing only what the kernels need)
runs in a child process (one for all of its checks: its imports are a large part of its time) and returns its
measurements as JSON."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path


def interpreted_results(module: Path, timeout: int) -> dict:
    """``interpreted_checks()`` of the module file `module` (one of tests/) run in a child process under the
    interpreter."""
    path = [str(module.parent), str(Path(__file__).parents[1])]  # its folder, and tests/ for `support`
    code = f"import json, sys; sys.path[:0] = {path!r}; import {module.stem} as t; "
    code += "print(json.dumps(t.interpreted_checks()))"
    env = dict(os.environ, TRITON_INTERPRET="1")
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])
