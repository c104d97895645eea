"""--pretrained without a network: one line within seconds (no minute of the hub client's retries), naming the
repository and file it wanted and the local-file way; weights in the local cache still load offline. No test
here touches the network: the hub is switched off (HF_HUB_OFFLINE=1) or moved to a closed local port."""

import json
import os
import subprocess
import sys

import pytest
import timm
from huggingface_hub import constants as hub_constants
from timm.models import get_pretrained_cfg
from timm.models._builder import _resolve_pretrained_source
from timm.models._hub import HF_WEIGHTS_NAME, _get_safe_alternatives

import convit  # noqa: F401  (registers the project's models)
import transformed_cnn  # noqa: F401
from convbias.base.errors import EXIT_USAGE, ConfigError
from convbias.engine.model.pretrained import HUB_CHECK_SECONDS, check_pretrained_reachable, weights_source

CLOSED_PORT = "http://127.0.0.1:9"  # the discard port: nothing listens there
# what huggingface_hub reads when imported to pick the Hub and its offline mode: a test sets its own, whatever the
# caller's environment holds
HUB_VARIABLES = ("HF_ENDPOINT", "HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")


@pytest.mark.parametrize("model", ["convit_tiny", "tcnn_resnet18", "resnet18", "convit_small.fb_in1k"])
def test_the_weights_named_are_those_timms_builder_loads(model):
    """timm's builder resolves the pretrained config to a Hub repository and tries the safetensors file first."""
    where, repo = _resolve_pretrained_source(get_pretrained_cfg(model).to_dict())
    source = weights_source(model)
    assert where == "hf-hub" and (source.repo, source.file) == (
        repo,
        next(iter(_get_safe_alternatives(HF_WEIGHTS_NAME))),
    )
    assert source.alternatives == (HF_WEIGHTS_NAME,)
    assert weights_source("deit_tiny_plus") is None  # no pretrained weights: timm's own message stands


def test_cached_weights_are_taken_offline_and_missing_ones_refused(tmp_path, monkeypatch):
    monkeypatch.setattr(hub_constants, "HF_HUB_CACHE", str(tmp_path))
    monkeypatch.setattr(hub_constants, "HF_HUB_OFFLINE", True)
    with pytest.raises(ConfigError, match=r"model\.safetensors of timm/convit_tiny\.fb_in1k .* offline"):
        check_pretrained_reachable("convit_tiny")
    repo = tmp_path / "models--timm--convit_tiny.fb_in1k"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text("0" * 40)
    (repo / "snapshots" / ("0" * 40)).mkdir(parents=True)
    (repo / "snapshots" / ("0" * 40) / "model.safetensors").write_bytes(b"")
    check_pretrained_reachable("convit_tiny")  # timm's hub loading reads the cache offline


RUN = """
import json, sys, time
import convbias.engine.loop.trainer, convbias.families
from convbias.cli import train
started = time.perf_counter()
code = train.main(sys.argv[1:])
print(json.dumps([code, time.perf_counter() - started]))
"""


@pytest.mark.integration
@pytest.mark.slow
@pytest.mark.parametrize(
    "hub, reason",
    [
        (dict(HF_HUB_OFFLINE="1"), "offline (HF_HUB_OFFLINE=1)"),
        (dict(HF_ENDPOINT=CLOSED_PORT), f"unreachable ({CLOSED_PORT}: Connection refused, within 3 s)"),
    ],
)
def test_pretrained_without_a_network_is_one_line_within_seconds(tmp_path, hub, reason):
    """The time is the command's own, from the call to its exit code (the interpreter's imports left out)."""
    caller = {name: value for name, value in os.environ.items() if name not in HUB_VARIABLES}
    env = {**caller, "HF_HOME": str(tmp_path / "hf"), "OMP_NUM_THREADS": "1", **hub}
    output = tmp_path / "run"
    args = ["--model", "convit_tiny", "--pretrained", "--dataset", "digits", "--img-size", "32", "--output", output]
    done = subprocess.run(
        [sys.executable, "-c", RUN, *map(str, args)], capture_output=True, text=True, env=env, timeout=300
    )
    code, seconds = json.loads(done.stdout.splitlines()[-1])
    assert code == EXIT_USAGE and seconds < HUB_CHECK_SECONDS + 2, (code, seconds)
    errors = [line for line in done.stderr.splitlines() if line.startswith("error: ")]
    assert errors == [
        f"error: --pretrained: convit_tiny's weights are model.safetensors of timm/convit_tiny.fb_in1k on the Hugging "
        f"Face Hub, which is {reason}, and they are not in the local cache: download the file where there is a "
        f"network (`hf download timm/convit_tiny.fb_in1k model.safetensors`), then pass --pretrained-file PATH (in "
        f"Python: pretrained=True, pretrained_cfg_overlay=dict(file=PATH))"
    ]
    assert not output.exists()
    assert timm.is_model("convit_tiny")
