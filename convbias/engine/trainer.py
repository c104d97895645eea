"""The training loop: one accelerate code path for CPU, one GPU, many GPUs and many nodes.

``Trainer(cfg)`` does every check that can fail on user input (data, model, checkpoints, output dir)
before it writes anything (engine.run_setup, engine.run_start); ``Trainer.fit()`` then trains, evaluates,
logs and checkpoints each epoch; ``Trainer.evaluate_only()`` prints top-1/top-5 of a checkpoint.

Distribution: the model and its optimizer go through ``accelerator.prepare`` together: DDP, or FSDP2
when the accelerate config asks for FSDP with ``fsdp_version: 2`` (FSDP1 is refused at set-up). Under
FSDP a resume point also holds every rank's shards of the weights and the optimizer state (engine.fsdp,
torch distributed checkpoint), from which ``--resume`` continues exactly; the EMA update and the
diagnostics read an ordinary copy of the model refreshed from the shards (``FullCopy``).
The train loader's sampler shards itself across
ranks (engine.run_setup); evaluation is exact across processes (engine.metrics). Gradient accumulation uses ``accelerator.accumulate``; each epoch runs a multiple of ``--grad-accum-steps``
batches (the few left over are skipped) so every optimizer step sees the same number of batches.
"""

from __future__ import annotations

import math
import shutil
import sys
import time
from pathlib import Path
from typing import Any

import torch
from accelerate.utils import broadcast_object_list, gather_object, set_seed
from torch.distributed.checkpoint.api import CheckpointException
from tqdm.auto import tqdm

from ..storage import storage_reason
from . import recipe
from .checkpoint import rng_state, set_rng_state
from .compile import compile_counters
from .config import write_config
from .data import epoch_batches
from .errors import NonFiniteLossError, StorageError
from .fsdp import save_sharded
from .metrics import evaluate
from .preemption import Preempted
from .run_log import RunLog, results_record
from .run_setup import RunSetup
from .run_start import EXACT_KEYS, kept

__all__ = ["NonFiniteLossError", "Trainer"]

LOSS_CHECK_INTERVAL = 10  # steps between cross-rank loss reductions (finiteness check, progress bar)


class Trainer(RunSetup):
    """One run: set-up checks on construction (nothing is written yet), then ``fit()`` or ``evaluate_only()``."""

    def kept(self) -> str:
        """What an interrupted run leaves behind, in one sentence."""
        return kept(self.cfg, self.output)

    # ------------------------------------------------------------------------------------- main entry
    def fit(self) -> dict[str, Any]:
        cfg, acc = self.cfg, self.accelerator
        for line in self._startup_block() + self.notes:
            acc.print(line)
        derived = dict(
            num_processes=acc.num_processes,
            global_batch=self.global_batch,
            lr=self.lr,
            epochs=self.epochs,
            warmup_epochs=self.warmup_epochs,
            steps_per_epoch=self.steps_per_epoch,
        )
        if acc.is_main_process:
            self.output.mkdir(parents=True, exist_ok=True)
            write_config(cfg, self.output / "config.yaml", derived)
        if cfg.log_wandb:
            acc.init_trackers(
                cfg.wandb_project,
                config={**cfg.to_dict(), **derived},
                init_kwargs={"wandb": {"name": self.output.name, "dir": str(self.output)}},
            )
        log = RunLog(self.output, acc.is_main_process, acc if cfg.log_wandb else None)
        for note in log.start(self.start_epoch):
            acc.print(note)
        # every diagnostic at initialization too, logged with the first epoch as init_<key> (a resume point
        # inside the first epoch carries them)
        self.initial = self.resume_state.get("initial_diagnostics", {}) if self.resume_state else {}
        if self.diagnostics is not None and not self.resume_state:
            self.initial = {f"init_{k}": v for k, v in self.diagnostics(self.whole_model()).items()}
        if self.resume_state:
            world = self.resume_state["rng"]
            if len(world) == acc.num_processes:
                set_rng_state(world[acc.process_index])
            else:  # a different world size cannot replay the same random streams; start fresh ones
                set_seed(cfg.seed + 1000 * self.start_epoch + acc.process_index)
            where = f" and {self.start_step} steps of epoch {self.start_epoch + 1}" if self.start_step else ""
            acc.print(f"resumed from {self.resume_point} after epoch {self.start_epoch}{where}")
        else:
            set_seed(cfg.seed + acc.process_index)  # per-rank augmentation and drop-path streams
            if 0 in cfg.save_epochs:
                self._save_snapshot(0)

        self.preemption.install()
        try:
            self._train_epochs(log)
        finally:
            self.preemption.restore()

        results = self._results()
        log.write_results(results)
        if cfg.log_wandb:
            acc.end_training()
        acc.print(self._summary_line(results))
        return results

    def _startup_block(self) -> list[str]:
        """What this launch will do, before its first step: where, on what, with which batch, lr and length."""
        cfg, acc = self.cfg, self.accelerator
        start = f"resuming from {self.resume_point}" if self.resume_point else "a new run"
        params = sum(p.numel() for p in acc.unwrap_model(self.model).parameters())
        try:
            sizes = f"{len(self.data.train):,} train / {len(self.data.val):,} val images"
        except TypeError:  # a stream without a known length
            sizes = "streamed"
        if cfg.lr is not None:
            rule = "--lr"
        else:
            rule = f"--lr-base {cfg.lr_base:g} x {self.global_batch} / --lr-base-size {cfg.lr_base_size}"
        precision = "fp32" if acc.mixed_precision == "no" else f"{acc.mixed_precision} mixed precision"
        return [
            f"output: {self.output} ({start})",
            f"processes: {acc.num_processes} ({plural(torch.get_num_threads(), 'thread')} each) on {acc.device.type}, "
            f"{precision}",
            f"model: {cfg.model}, {params / 1e6:.2f}M parameters",
            f"data: {cfg.dataset}, {sizes}, {self.data.num_classes} classes",
            f"batch: {self.global_batch} global = {cfg.batch_size} per process x {acc.num_processes} x "
            f"{cfg.grad_accum_steps} accumulation; lr {self.lr:.3g} ({rule})",
            f"schedule: {plural(self.epochs, 'epoch')}, {self.warmup_epochs} of warm-up, "
            f"{self.steps_per_epoch // cfg.grad_accum_steps} updates per epoch",
        ]

    def _summary_line(self, results: dict[str, Any]) -> str:
        """The last line of a run: its final and best top-1 and where its files are."""

        def top1(value: float | None) -> str:
            return "n/a" if value is None else f"{value:.2f}"

        return (
            f"done: final top-1 {top1(results['final_top1'])} (epoch {self.final.get('epoch')}), best top-1 "
            f"{top1(results['best_top1'])} (epoch {results['best_epoch']}); in {self.output}: results.json, "
            f"summary.csv, log.jsonl, config.yaml, checkpoints/last, checkpoints/best"
        )

    def _train_epochs(self, log: RunLog) -> None:
        cfg, acc = self.cfg, self.accelerator
        for epoch in range(self.start_epoch, self.epochs):
            started = time.perf_counter()
            if cfg.reparametrize_at_epoch == epoch and not self.reparametrized:
                self._reparametrize()
            train = self._train_one_epoch(epoch)
            record: dict[str, Any] = {"epoch": epoch + 1, **train, **(self.initial if epoch == 0 else {})}
            if epoch == self.start_epoch and self.accepted_changes:
                record["resume_changes_accepted"] = self.accepted_changes
            evaluated = (epoch + 1) % cfg.eval_interval == 0 or epoch + 1 == self.epochs
            if evaluated:
                metrics = self.evaluate(self.forward)
                record.update(metrics)
                self.final = {"epoch": epoch + 1, **metrics}
                if self.ema is not None:
                    record.update({f"ema_{k}": v for k, v in self.evaluate(self.ema_forward).items()})
                if self.diagnostics is not None:  # eagerly, on the module itself (never traced)
                    record.update(self.diagnostics(self.whole_model()))
            if cfg.compile:
                record.update(compile_counters())
            record["epoch_seconds"] = time.perf_counter() - started
            record["unreadable_images"] = len(self.data.unreadable_files())
            is_best = evaluated and metrics["eval_top1"] > self.best.get("eval_top1", -1.0)
            if is_best:
                self.best = dict(self.final)
            log.log_epoch(record)
            self._save(epoch + 1, is_best)
            if epoch + 1 in cfg.save_epochs:
                self._save_snapshot(epoch + 1)
            acc.print(
                f"epoch {epoch + 1}/{self.epochs}  train_loss {train['train_loss']:.4f}  "
                + (f"eval_top1 {metrics['eval_top1']:.2f}  eval_top5 {metrics['eval_top5']:.2f}" if evaluated else "")
            )

    def _results(self) -> dict[str, Any]:
        return results_record(self.cfg.to_dict(), self.epochs, self.final, self.best)

    def evaluate_only(self) -> dict[str, float]:
        metrics = self.evaluate(self.forward)
        self.accelerator.print(
            f"top1 {metrics['eval_top1']:.2f}  top5 {metrics['eval_top5']:.2f}  "
            f"loss {metrics['eval_loss']:.4f}  ({self.checkpoint_name})"
        )
        return metrics

    # ---------------------------------------------------------------------------------------- epochs
    def _train_one_epoch(self, epoch: int) -> dict[str, float]:
        """One epoch, or its remainder after a mid-epoch resume point; stops with Preempted on a signal."""
        cfg, acc = self.cfg, self.accelerator
        model, optimizer = self.model, self.optimizer
        model.train()
        first = self.start_step if epoch == self.start_epoch else 0

        loss_sum = torch.full((), self.start_loss_sum if first else 0.0, device=acc.device, dtype=torch.float64)
        progress = tqdm(
            total=self.steps_per_epoch,
            initial=first,
            desc=f"epoch {epoch + 1}/{self.epochs}",
            disable=not acc.is_main_process or not sys.stderr.isatty(),  # a job log gets the epoch line only
            leave=False,
            dynamic_ncols=True,
        )
        started = time.perf_counter()
        batches = epoch_batches(
            self.train_loader, epoch, first, self.steps_per_epoch - first, cfg.seed, acc.process_index
        )
        for step, (images, targets) in enumerate(batches, start=first):
            images = images.to(acc.device, non_blocking=True)
            targets = targets.to(acc.device, non_blocking=True)
            if self.mixup is not None:
                images, targets = self.mixup(images, targets)
            with acc.accumulate(model):
                outputs = self.forward(images)
                if self.teacher is not None:
                    with acc.autocast():
                        loss = self.train_loss(images, outputs, targets)
                else:
                    loss = self.train_loss(outputs, targets)
                acc.backward(loss)
                if cfg.clip_grad and acc.sync_gradients:
                    acc.clip_grad_norm_(model.parameters(), cfg.clip_grad)
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
            if acc.sync_gradients:
                self.num_updates += 1
                self.scheduler.step_update(self.num_updates)
                if self.ema is not None:
                    self.ema.update(self.whole_model(), step=self.num_updates)
            loss_sum += loss.detach().double()
            if (step + 1) % LOSS_CHECK_INTERVAL == 0 or step + 1 == self.steps_per_epoch:
                mean_loss = self._mean_loss(loss_sum, step + 1, epoch)
                progress.set_postfix(loss=f"{mean_loss:.4f}", lr=f"{self._lr():.2e}")
            progress.update(1)
            if acc.sync_gradients and step + 1 < self.steps_per_epoch:
                self._maybe_stop_mid_epoch(epoch, step + 1, loss_sum)
        progress.close()
        seconds = time.perf_counter() - started
        images_seen = (self.steps_per_epoch - first) * cfg.batch_size * acc.num_processes
        return {
            "train_loss": self._mean_loss(loss_sum, self.steps_per_epoch, epoch),
            "lr": self._lr(),
            "images_per_sec": images_seen / seconds,
        }

    def _maybe_stop_mid_epoch(self, epoch: int, steps: int, loss_sum: torch.Tensor) -> None:
        """After an optimizer update: a resume point every --checkpoint-interval updates, and on a
        preemption signal a resume point then Preempted (every rank decides together)."""
        interval = self.cfg.checkpoint_interval
        preempted = self.preemption.requested(self.accelerator) if self.preemption.signals else False
        if preempted or (interval and self.num_updates % interval == 0):
            point = self._save(epoch, is_best=False, step=steps, loss_sum=loss_sum)
            if preempted:
                raise Preempted(self.preemption.name, point, epoch, steps)

    def _mean_loss(self, loss_sum: torch.Tensor, steps: int, epoch: int) -> float:
        """Mean loss over ranks and steps so far; stops the run when it is not finite."""
        total = self.accelerator.reduce(loss_sum.clone(), reduction="sum").item()
        mean = total / (steps * self.accelerator.num_processes)
        if not math.isfinite(mean):
            points = self.checkpoints.points()
            kept = f"the last good checkpoint is {points[0]}" if points else "no checkpoint was written yet"
            raise NonFiniteLossError(
                f"non-finite training loss ({mean}) in epoch {epoch + 1} by step {steps}; "
                f"stopping; {kept} (try a lower --lr or --clip-grad)"
            )
        return mean

    def _lr(self) -> float:
        """The lr of the first group without a --param-group-lr override (the run's main lr)."""
        groups = self.optimizer.param_groups
        return next((g["lr"] for g in groups if g.get("lr_pattern") is None), groups[0]["lr"])

    def evaluate(self, model: torch.nn.Module) -> dict[str, float]:
        """Exact loss, top-1 and top-5 (in %) over the whole validation set, across all processes."""
        return evaluate(self.accelerator, model, self.eval_loader, self.streamed)

    # ---------------------------------------------------------------------------------- checkpoints
    def _save(self, epoch: int, is_best: bool, step: int = 0, loss_sum: torch.Tensor | None = None) -> Path | None:
        """A resume point after ``epoch`` epochs, or ``step`` steps into the next one (with every rank's
        loss accumulator); returns its directory on the main process."""
        acc = self.accelerator
        weights = acc.get_state_dict(self.model)  # collective under FSDP: every rank calls it
        rng = gather_object([rng_state()])
        loss_sums = gather_object([loss_sum.item() if loss_sum is not None else 0.0])
        staging = self.checkpoints.stage(epoch, step) if acc.is_main_process else None
        if self.sharded:  # every rank writes its shards into the staged directory (on a shared file system)
            try:
                save_sharded(broadcast_object_list([staging])[0], self.model, self.optimizer.optimizer)
            except (OSError, RuntimeError, CheckpointException) as e:  # DCP reports every rank's failure
                if staging is not None:
                    shutil.rmtree(staging, ignore_errors=True)
                raise StorageError(
                    f"writing the shards of {staging} failed ({storage_reason(e, self.output)})"
                ) from None
            acc.wait_for_everyone()
        point = None
        if acc.is_main_process:
            state = {
                "model": self.cfg.model,
                "options": {key: getattr(self.cfg, key) for key in EXACT_KEYS},  # what exact continuation needs
                "epoch": epoch,
                "step": step,
                "loss_sums": loss_sums,
                "initial_diagnostics": self.initial if epoch == 0 and step else {},
                "num_updates": self.num_updates,
                "best": self.best,
                "final": self.final,
                "reparametrized": self.reparametrized,
                # under FSDP the optimizer state is in the shards only
                "sharded": self.sharded,
                "optimizer": None if self.sharded else self.optimizer.state_dict(),
                "scheduler": self.scheduler.state_dict(),
                "scaler": acc.scaler.state_dict() if acc.scaler is not None else None,
                "rng": rng,
            }
            ema = self.ema.module.state_dict() if self.ema is not None else None
            point = self.checkpoints.save(epoch, weights, state, ema, self._metadata(epoch), is_best, step)
        acc.wait_for_everyone()
        return point

    def _save_snapshot(self, epoch: int) -> None:
        weights = self.accelerator.get_state_dict(self.model)
        if self.accelerator.is_main_process:
            self.checkpoints.save_snapshot(epoch, weights, self._metadata(epoch))
        self.accelerator.wait_for_everyone()

    def _metadata(self, epoch: int) -> dict[str, str]:
        return {
            "model": self.cfg.model,
            "epoch": str(epoch),
            "reparametrized": str(self.reparametrized),
            "num_classes": str(self.data.num_classes),
            "in_chans": str(self.data.in_chans),
            "reparametrization": self.cfg.reparametrize or "",
            "output_scale": str(self.cfg.output_scale or ""),
        }

    # ------------------------------------------------------------------------------ reparametrization
    def _reparametrize(self) -> None:
        """Change the model's architecture mid-run, keep the optimizer state of surviving parameters, re-prepare."""
        cfg, acc = self.cfg, self.accelerator
        new_model = self._reparametrized(acc.unwrap_model(self.model)).to(acc.device)
        optimizer = recipe.rebuild_optimizer(cfg, new_model, self.lr, self.optimizer.optimizer)
        if self.ema is not None:
            self.ema.module = self._reparametrized(self.ema.module).to(acc.device)
        acc.free_memory()  # drop accelerate's references to the old model and optimizer
        self.model, self.optimizer = acc.prepare(new_model, optimizer)  # the eval loader stays prepared
        self.scheduler = recipe.create_scheduler(
            cfg, self.optimizer, self.epochs, self.warmup_epochs, self.steps_per_epoch // cfg.grad_accum_steps
        )
        self.scheduler.step_update(self.num_updates)
        self._compile()
        self.reparametrized = True
        acc.print(f"reparametrized the model with {cfg.reparametrize}({cfg.reparametrize_kwargs})")


def plural(count: int, noun: str) -> str:
    return f"{count} {noun}{'' if count == 1 else 's'}"
