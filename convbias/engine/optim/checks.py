"""The optimization package's checks of a run's options, before any work starts: timm's optimizer names and
their betas, and the epochs that --save-epochs and --reparametrize-at-epoch name within the run's schedule."""

from __future__ import annotations

from timm.optim import get_optimizer_info, list_optimizers

from ..config.options import Config
from ..config.parsing import require
from .factory import trained_epochs


def check(cfg: Config) -> None:
    """ConfigError naming the option: --opt-betas of the wrong count for --opt, an epoch outside the run's
    schedule (timm's count, with cooldown and cycles), the plateau schedule with a mid-run reparametrization, an
    --opt timm does not have."""
    if cfg.opt_betas is not None:
        name = cfg.opt.lower().split("_")[-1]  # as timm's factory reads 'lookahead_adamw'
        if name in list_optimizers():  # an unknown --opt is named below
            info = get_optimizer_info(name)
            takes = info.num_betas if info.has_betas else 0
            require(
                len(cfg.opt_betas) == takes,
                f"--opt-betas: --opt {cfg.opt} takes {takes or 'no'} betas, got {len(cfg.opt_betas)}",
            )
    epochs = trained_epochs(cfg)
    for epoch in cfg.save_epochs:
        require(0 <= epoch <= epochs, f"--save-epochs {epoch} is outside 0..{epochs}")
    if cfg.reparametrize_at_epoch is not None:
        require(
            0 <= cfg.reparametrize_at_epoch < epochs,
            f"--reparametrize-at-epoch must be in 0..{epochs - 1}, got {cfg.reparametrize_at_epoch}",
        )
        require(
            cfg.sched != "plateau",
            "--sched plateau cannot be combined with --reparametrize-at-epoch (the plateau's decayed lr lives in "
            "the optimizer that the change of architecture rebuilds)",
        )
    require(  # timm's factory reads the name after the last '_' (lookahead_adamw: adamw inside Lookahead)
        cfg.opt.lower().split("_")[-1] in list_optimizers(),
        f"unknown --opt '{cfg.opt}'; see timm.optim.list_optimizers() (or lookahead_NAME)",
    )
