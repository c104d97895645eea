"""Where ``--pretrained`` weights come from, checked before any work starts: weights that are neither cached nor
reachable (the offline setting, or a hub that does not answer a short connection) are one line naming the
repository and file and the local-file way, where the hub client would retry for a minute."""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass
from urllib.parse import urlsplit

import torch
from huggingface_hub import constants as hub_constants
from huggingface_hub import try_to_load_from_cache
from timm.models import get_pretrained_cfg

from convbias.base.errors import ConfigError

HUB_CHECK_SECONDS = 3.0  # a connection the hub does not accept within this is taken as no network
HUB_PREFIX = "hf-hub:"  # timm's model names read from the Hub: hf-hub:REPO
HUB_WEIGHTS = (hub_constants.SAFETENSORS_SINGLE_FILE, hub_constants.PYTORCH_WEIGHTS_NAME)  # what timm tries, in order


@dataclass(frozen=True)
class WeightsSource:
    """Where timm's pretrained loading reads a model's weights: a file of a Hub repository, or a URL."""

    repo: str | None  # a Hugging Face Hub repository, or None for a URL
    file: str  # the repository's weights file (the first that timm tries), or the URL
    alternatives: tuple[str, ...] = ()  # the repository's other files that timm would read in its place

    def cached(self) -> bool:
        """Whether the weights are in the local cache (the Hub's, or torch.hub's for a URL)."""
        if self.repo is None:
            return os.path.isfile(os.path.join(torch.hub.get_dir(), "checkpoints", os.path.basename(self.file)))
        names = (self.file, *self.alternatives)
        return any(isinstance(try_to_load_from_cache(self.repo, name), str) for name in names)

    def unreachable(self, seconds: float = HUB_CHECK_SECONDS) -> str | None:
        """Why the weights' server cannot be reached (the Hub's offline setting, or a connection not accepted
        within ``seconds``), or None where it accepts one."""
        if self.repo is not None and hub_constants.HF_HUB_OFFLINE:
            return "offline (HF_HUB_OFFLINE=1)"
        parts = urlsplit(hub_constants.ENDPOINT if self.repo is not None else self.file)
        port = parts.port or (443 if parts.scheme == "https" else 80)
        try:
            socket.create_connection((parts.hostname or "", port), timeout=seconds).close()
        except OSError as e:
            reason = e.strerror or str(e) or type(e).__name__
            return f"unreachable ({parts.scheme}://{parts.netloc}: {reason}, within {seconds:g} s)"
        return None

    def failure(self, model: str, reason: str) -> ConfigError:
        """The one line for weights that cannot be had: what was wanted, from where, why not, and the local-file
        way."""
        if self.repo is not None:
            wanted = f"{self.file} of {self.repo} on the Hugging Face Hub"
            fetch = f" (`hf download {self.repo} {self.file}`)"
        else:
            wanted, fetch = self.file, ""
        return ConfigError(
            f"--pretrained: {model}'s weights are {wanted}, which is {reason}, and they are not in the local cache: "
            f"download the file where there is a network{fetch}, then pass --pretrained-file PATH (in Python: "
            f"pretrained=True, pretrained_cfg_overlay=dict(file=PATH))"
        )


def weights_source(model: str) -> WeightsSource | None:
    """Where timm reads ``model``'s pretrained weights (as timm's builder resolves its pretrained config: the
    Hub where the config names a repository, else its URL), or None where it names neither."""
    if model.startswith(HUB_PREFIX):
        return WeightsSource(model.removeprefix(HUB_PREFIX).split("@")[0], HUB_WEIGHTS[0], HUB_WEIGHTS[1:])
    config = get_pretrained_cfg(model)
    if config is None or config.file or config.state_dict:
        return None
    if config.hf_hub_id:
        repo = config.hf_hub_id.split("@")[0]
        if config.hf_hub_filename:
            return WeightsSource(repo, config.hf_hub_filename)
        return WeightsSource(repo, HUB_WEIGHTS[0], HUB_WEIGHTS[1:])
    return WeightsSource(None, config.url) if config.url else None


def check_pretrained_reachable(model: str) -> None:
    """ConfigError (hub_failure) when ``model``'s pretrained weights are neither cached nor reachable."""
    source = weights_source(model)
    if source is None or source.cached():
        return
    reason = source.unreachable()
    if reason:
        raise source.failure(model, reason)
