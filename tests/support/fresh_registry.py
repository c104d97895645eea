"""What importing the model families does to a fresh timm registry, seen from a child process: the test process
has imported them all already. Importing timm in a new interpreter is most of the child's time, so one child
serves every family's registration test (`fresh_registry()`, once per test process): it imports the families of
`convbias.families.FAMILIES` one after the other with every warning an error, and reports the registry after
each import."""

from __future__ import annotations

import functools
import json
import subprocess
import sys

from convbias.families import FAMILIES

PROBE = f"""
import json, timm
from timm.models import model_entrypoint

def registry():
    return {{name: model_entrypoint(name) for name in timm.list_models()}}

before = registry()
probe = {{
    "resnets": timm.list_models(module="resnet"),
    "timm_convits": timm.list_models("convit_*"),
    "added": {{}},
    "models": {{}},
}}
for family in {FAMILIES!r}:
    __import__(family)
    after = registry()
    probe["added"][family] = sorted(n for n, entry in after.items() if before.get(n) is not entry)
    probe["models"][family] = sorted(after)
    before = after
probe["entry_modules"] = {{n: model_entrypoint(n).__module__ for n in timm.list_models(["convit_*", "deit_*"])}}
probe["built_convit_module"] = type(timm.create_model("convit_tiny", img_size=32, patch_size=8)).__module__
probe["pretrained_convits"] = sorted(timm.list_models("convit_*", pretrained=True))
print(json.dumps(probe))
"""


@functools.cache
def fresh_registry() -> dict:
    """The child's report: `added[family]` the names whose entry the family's import added or replaced,
    `models[family]` every registered name after it (families imported in FAMILIES' order), `resnets` and
    `timm_convits` timm's own before any, then `entry_modules` (the module of each convit_*/deit_* entry),
    `built_convit_module` (of a model built from convit_tiny) and `pretrained_convits`; `stderr` the child's.
    The child runs under `-W error`: a warning from any import, or from building the model, fails it."""
    done = subprocess.run([sys.executable, "-W", "error", "-c", PROBE], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return {**json.loads(done.stdout), "stderr": done.stderr}
