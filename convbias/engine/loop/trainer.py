"""The training loop: one accelerate code path for CPU, one GPU, many GPUs and many nodes.

``build_trainer(start)`` composes a ``Trainer`` from each package's builder (engine.data.build, engine.model.build,
engine.optim.build) once ``start_run`` has done every check that can fail on user input, before anything is
written; it hands the checkpoint manager (engine.checkpoint.manager) the run's folder, options, resume parts and
models. ``Trainer.fit()`` begins with the manager's one ``load`` of what the run resumes, then trains, evaluates,
logs and checkpoints each epoch (``save()`` after every epoch and optimizer update).

Distribution: the trainer hands the model and its optimizer to ``accelerator.prepare`` together: DDP, or FSDP2
when the accelerate config asks for FSDP with ``fsdp_version: 2`` (FSDP1 is refused at set-up). Under
FSDP a resume point also holds every rank's shards of the weights and the optimizer state (engine.checkpoint.shards,
torch distributed checkpoint), from which ``--resume`` continues exactly; the EMA update and the
diagnostics read an ordinary copy of the model refreshed from the shards (``FullCopy``).
The train loader's sampler shards itself across ranks (engine.data.loaders); evaluation is exact across
processes (engine.loop.metrics). Gradient accumulation is timm's train.py's: every batch of the epoch is trained on,
an update every ``--grad-accum-steps`` batches, each batch's loss divided by that count, and the last update of the
epoch made from the batches that remain, their loss divided by their own count (timm's ``last_accum_steps``); the
batches before an update skip the gradients' reduction across ranks (``accelerator.no_sync``).
"""

from __future__ import annotations

import math
import sys
import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager, nullcontext
from typing import Any

import torch
from accelerate.utils import set_seed
from timm.utils import distribute_bn
from torch.profiler import record_function
from tqdm.auto import tqdm

from convbias.base.errors import Interrupted, NonFiniteLossError, Preempted
from convbias.base.run_layout import CONFIG_FILE, TIMM_ARGS_FILE

from ..checkpoint.manager import CheckpointManager
from ..checkpoint.parts import SchedulerState, TrainingProgress, continuation_options, resume_parts
from ..checkpoint.points import CheckpointDir
from ..checkpoint.resume import check_exact_continuation
from ..config.derived import ema_is_the_metric
from ..data.build import TrainingData
from ..data.device_augment import DeviceBatches
from ..data.loaders import epoch_batches, first_images
from ..model.build import Models, StartingModel, build_model, build_models
from ..model.compile import compile_counters
from ..model.factory import reparametrize
from ..model.output_scale import ScaledLoss
from ..optim import factory as optim
from ..optim.build import Optimization, build_optimization
from .diagnostics import ModelDiagnostics
from .metrics import evaluate
from .preemption import PreemptionSignals
from .records import (
    RunLog,
    images_per_second,
    pace,
    results_record,
    seconds_left,
    startup_block,
    summary_line,
    write_config,
    write_timm_args,
)
from .setup import build_data, build_preemption, training_warnings
from .start import RunStart, kept

__all__ = ["NonFiniteLossError", "Trainer", "build_trainer", "watching_batches"]

LOSS_CHECK_INTERVAL = 10  # steps between cross-rank loss reductions (finiteness check, progress bar)
# The torch.profiler ranges of a training step (benchmarks/train_loop.py sums them): the loader's and the
# device augmentation's in engine.data.device_augment.DeviceBatches, the others around the step's parts here.
STEP_RANGES = ("loader_wait", "device_augment", "mixup", "forward_backward", "optimizer", "ema", "bookkeeping")

Batches = Iterable[Any]
_watch: Callable[[Batches], Batches] | None = None  # watching_batches'


@contextmanager
def watching_batches(watch: Callable[[Batches], Batches]) -> Iterator[None]:
    """While the block runs, each epoch trains on ``watch(batches)`` of its loader's batches: where a test meets a
    run at a given step (the signal a closed terminal sends after N batches) without reaching into the loop."""
    global _watch
    previous, _watch = _watch, watch
    try:
        yield
    finally:
        _watch = previous


def build_trainer(start: RunStart) -> Trainer:
    """The Trainer of a run that has epochs left: its parts built whole, the model and its optimizer prepared by
    accelerate together, a mid-epoch resume point checked against the options its parts need."""
    cfg, acc, values = start.cfg, start.accelerator, start.values
    preemption = build_preemption(cfg)
    data = build_data(start, preemption, train=True)
    bundle = data.bundle
    built = build_model(start, bundle.in_chans, bundle.num_classes, f"--dataset {cfg.dataset}")
    models = build_models(cfg, acc, built.module, bundle.in_chans)
    before = cfg.reparametrize_at_epoch is not None and not built.reparametrized
    optimizer = optim.create_optimizer(cfg, models.model, values.lr, require_all_patterns=not before)
    if acc.is_fsdp2:  # every rank has built the whole model; accelerate's rank-0 loading (on by default)
        acc.state.fsdp_plugin.cpu_ram_efficient_loading = False  # serves transformers models only
    models.model, optimizer = acc.prepare(models.model, optimizer)
    optimization = build_optimization(cfg, optimizer, values, data.updates_per_epoch, models.num_classes, acc.device)
    if models.teacher is not None:
        optimization.train_loss = optim.HardDistillationLoss(optimization.train_loss, models.teacher)
    if cfg.output_scale:
        optimization.train_loss = ScaledLoss(optimization.train_loss, cfg.output_scale)
    models.compile(cfg)
    diagnostics = None
    if cfg.diagnostics:
        count = min(cfg.diagnostics_images, len(bundle.val))
        images = first_images(bundle.val, count).to(acc.device)
        diagnostics = ModelDiagnostics(images, start.extensions.diagnostics)
    trainer = Trainer(start, data, built, models, optimization, preemption, diagnostics)
    if start.point is not None:
        point = start.point
        accepted = check_exact_continuation(cfg, point, continuation_options())
        if accepted:
            trainer.notes.append(f"--accept-resume-changes: continuing {point} with {accepted}")
        trainer.accepted_changes = accepted
    trainer.warnings = training_warnings(start, data, models)
    return trainer


def accumulation(step: int, steps: int, accum_steps: int) -> tuple[bool, int]:
    """(whether an optimizer update follows batch ``step`` of an epoch of ``steps`` batches, the number of batches
    that update averages), as timm's train.py counts them: an update every ``accum_steps`` batches and after the
    epoch's last, the last ``steps % accum_steps`` batches forming an update of their own."""
    remainder = steps % accum_steps
    group = remainder if step >= steps - remainder else accum_steps
    return (step + 1) % accum_steps == 0 or step + 1 == steps, group


class Trainer:
    """One run's training, composed of its built parts; ``fit()`` trains, evaluates, logs and checkpoints."""

    def __init__(
        self,
        start: RunStart,
        data: TrainingData,
        built: StartingModel,
        models: Models,
        optimization: Optimization,
        preemption: PreemptionSignals,
        diagnostics: ModelDiagnostics | None,
    ):
        self.start, self.cfg, self.accelerator, self.output = start, start.cfg, start.accelerator, start.output
        self.data, self.built, self.models, self.optimization = data, built, models, optimization
        self.preemption, self.diagnostics = preemption, diagnostics
        self.progress = TrainingProgress(reparametrized=built.reparametrized)
        values = start.values
        self.schedule = SchedulerState(
            optimization,
            self.progress,
            lambda: optim.create_scheduler(
                self.cfg, optimization.optimizer, values.schedule_epochs, values.warmup_epochs, data.updates_per_epoch
            ),
            data.updates_per_epoch,
            values.lr,
        )
        parts = resume_parts(self.cfg, self.accelerator, self.progress, optimization, self.schedule, data.augment)
        folder = CheckpointDir(self.output, self.cfg.keep_checkpoints)
        self.checkpointer = CheckpointManager(folder, self.cfg, parts, models)
        self.notes = list(start.notes)  # said when training starts
        self.accepted_changes: str | None = None  # --accept-resume-changes: what differs from the point
        self.warnings: list[str] = []  # likely unintended settings, said before anything runs
        self.launch_started, self.launch_first_step = 0.0, 0  # this launch's training: for the time left
        self.epoch_started, self.epoch_first_step = 0.0, 0  # the epoch's training: for its images per second

    def kept(self) -> str:
        """What an interrupted run leaves behind, in one sentence."""
        return kept(self.cfg, self.output)

    # ------------------------------------------------------------------------------------- main entry
    def fit(self) -> dict[str, Any]:
        cfg, acc, progress = self.cfg, self.accelerator, self.progress
        resumed_from = self.checkpointer.load(self.start.resume)  # what the run resumes, restored in one call
        model = self.accelerator.unwrap_model(self.models.model)
        for line in startup_block(self.start, self.data, model, self.built.weights) + self.notes:
            acc.print(line)
        derived = dict(
            num_processes=acc.num_processes,
            global_batch=self.start.values.global_batch,
            lr=self.start.values.lr,
            epochs=self.start.values.epochs,
            warmup_epochs=self.start.values.warmup_epochs,
            steps_per_epoch=self.data.steps_per_epoch,
        )
        if acc.is_main_process:
            self.output.mkdir(parents=True, exist_ok=True)
            write_config(cfg, self.output / CONFIG_FILE, derived)
            write_timm_args(cfg, self.output / TIMM_ARGS_FILE, self.built.checkpoint.weights)
        if cfg.log_wandb:
            resumed = {"id": cfg.wandb_resume_id, "resume": "must"} if cfg.wandb_resume_id else {}
            acc.init_trackers(
                cfg.wandb_project,
                config={**cfg.to_dict(), **derived},
                init_kwargs={
                    "wandb": {"name": self.output.name, "dir": str(self.output), "tags": cfg.wandb_tags, **resumed}
                },
            )
        log = RunLog(self.output, acc.is_main_process, acc if cfg.log_wandb else None)
        for note in log.start(progress.epoch):
            acc.print(note)
        if resumed_from is not None:
            acc.print(resumed_from)
        else:
            self._start_fresh()
        self.preemption.install()
        try:
            self._train_epochs(log)
        finally:
            self.preemption.restore()

        results = results_record(cfg.to_dict(), self.start.values.epochs, self.progress.final, self.progress.best)
        log.write_results(results)
        if cfg.log_wandb:
            acc.end_training()
        final_epoch = self.progress.final.get("epoch")
        acc.print(summary_line(results, final_epoch, self.output, cfg.eval_metric, self.progress.best))
        return results

    def _start_fresh(self) -> None:
        """Every diagnostic at initialization (logged with the first epoch as init_<key>; a resume point inside
        the first epoch carries them), per-rank random streams, the --save-epochs 0 snapshot."""
        if self.diagnostics is not None:
            initial = self.diagnostics(self.models.whole_model())
            self.progress.initial_diagnostics = {f"init_{k}": v for k, v in initial.items()}
        set_seed(self.cfg.seed + self.accelerator.process_index)  # augmentation and drop-path streams
        self.checkpointer.save_initial()

    def _train_epochs(self, log: RunLog) -> None:
        cfg, acc, progress = self.cfg, self.accelerator, self.progress
        first_epoch, initial = progress.epoch, progress.initial_diagnostics
        self.launch_started = time.perf_counter()
        self.launch_first_step = first_epoch * self.data.steps_per_epoch + progress.step
        for epoch in range(first_epoch, self.start.values.epochs):
            started = time.perf_counter()
            if cfg.reparametrize_at_epoch == epoch and not progress.reparametrized:
                self._reparametrize()
            if cfg.mixup_off_epoch and epoch >= cfg.mixup_off_epoch and self.optimization.mixup is not None:
                self.optimization.mixup.mixup_enabled = False  # as timm's train.py: smoothed one-hot targets stay
            train = self.train_one_epoch(epoch, progress.step if epoch == first_epoch else 0)
            record: dict[str, Any] = {"epoch": epoch + 1, **train, **(initial if epoch == 0 else {})}
            if epoch == first_epoch and self.accepted_changes:
                record["resume_changes_accepted"] = self.accepted_changes
            evaluated = (epoch + 1) % cfg.eval_interval == 0 or epoch + 1 == self.start.values.epochs
            if evaluated:
                self.distribute_batchnorm()
                metrics = self._epoch_metrics()
                progress.final = {"epoch": epoch + 1, **metrics}
                record.update(metrics)
                if self.diagnostics is not None:
                    record.update(self.diagnostics(self.models.whole_model()))
            if cfg.compile:
                record.update(compile_counters())
            record["epoch_seconds"] = time.perf_counter() - started
            record["unreadable_images"] = len(self.data.bundle.unreadable_files())
            is_best = evaluated and self._better(progress.final, progress.best)
            if is_best:
                progress.best = dict(progress.final)
            if evaluated:
                progress.ranked = self._ranked([*(progress.ranked or [progress.best]), progress.final])
            self._step_epoch_schedule(epoch, progress.final if evaluated else None)
            log.log_epoch(record)
            self.checkpointer.save(epoch + 1, is_best=is_best)
            acc.print(
                f"epoch {epoch + 1}/{self.start.values.epochs}  train_loss {train['train_loss']:.4f}  "
                + (f"eval_top1 {record['eval_top1']:.2f}  eval_top5 {record['eval_top5']:.2f}  " if evaluated else "")
                + pace(record["epoch_seconds"], train["images_per_sec"], self._seconds_left(epoch + 1, 0))
            )

    def _seconds_left(self, epoch: int, step: int) -> float:
        """The time the run needs after ``step`` steps of epoch ``epoch`` (0-based), at this launch's pace."""
        steps = self.data.steps_per_epoch
        done = epoch * steps + step
        left = self.start.values.epochs * steps - done
        return seconds_left(time.perf_counter() - self.launch_started, done - self.launch_first_step, left)

    def _better(self, evaluation: dict[str, float], best: dict[str, float]) -> bool:
        """Whether ``evaluation`` beats the best so far by --eval-metric (lower loss, higher accuracy)."""
        key = f"eval_{self.cfg.eval_metric}"
        if key not in best:
            return True
        return evaluation[key] < best[key] if self.cfg.eval_metric == "loss" else evaluation[key] > best[key]

    def _ranked(self, evaluations: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """The --checkpoint-hist best of ``evaluations`` by --eval-metric, best first (the earlier on a tie, as
        ``_better`` keeps it), one per epoch: their resume points are kept."""
        key, sign = f"eval_{self.cfg.eval_metric}", 1 if self.cfg.eval_metric == "loss" else -1
        by_epoch = {e["epoch"]: e for e in evaluations if key in e}
        ranked = sorted(by_epoch.values(), key=lambda e: (sign * e[key], e["epoch"]))
        return ranked[: self.cfg.checkpoint_hist]

    def _step_epoch_schedule(self, epoch: int, evaluation: dict[str, Any] | None) -> None:
        """A per-epoch schedule's step after epoch ``epoch`` (0-based), as timm's train.py steps it: the plateau
        schedule's with --eval-metric's value when the epoch was evaluated (a per-update schedule has moved on
        with every update)."""
        scheduler = self.optimization.scheduler
        if scheduler.t_in_epochs:
            scheduler.step(epoch + 1, evaluation[f"eval_{self.cfg.eval_metric}"] if evaluation else None)

    def distribute_batchnorm(self) -> None:
        """--dist-bn: every process evaluates with the same BatchNorm statistics (averaged, or rank 0's), as
        timm's train.py does before evaluating; the EMA's too."""
        acc, models = self.accelerator, self.models
        if acc.num_processes == 1 or not self.cfg.dist_bn:
            return
        reduce = self.cfg.dist_bn == "reduce"
        distribute_bn(models.model, acc.num_processes, reduce=reduce)
        if models.ema is not None:
            distribute_bn(models.ema.module, acc.num_processes, reduce=reduce)

    def _epoch_metrics(self) -> dict[str, float]:
        """The epoch's evaluation: eval_* are the epoch's metric (best, the plateau schedule, the end line), the
        EMA's when it is evaluated as timm's train.py decides (--model-ema, --model-ema-metric), with the model's
        as model_eval_*; the EMA's are ema_eval_* in either case."""
        models = self.models
        metrics = self.evaluate(models.forward)
        if models.ema is None:
            return metrics
        ema = self.evaluate(models.ema_forward)
        if not ema_is_the_metric(self.cfg):
            return {**metrics, **{f"ema_{k}": v for k, v in ema.items()}}
        return {**ema, **{f"model_{k}": v for k, v in metrics.items()}, **{f"ema_{k}": v for k, v in ema.items()}}

    # ---------------------------------------------------------------------------------------- epochs
    def train_one_epoch(self, epoch: int, first: int) -> dict[str, float]:
        """One epoch from step ``first`` (the remainder after a mid-epoch resume point); stops with Preempted
        on a signal."""
        cfg, acc, models, optimization = self.cfg, self.accelerator, self.models, self.optimization
        model, steps = models.model, self.data.steps_per_epoch
        model.train()
        resumed_sum = self.progress.loss_sums[acc.process_index] if first else 0.0
        loss_sum = torch.full((), resumed_sum, device=acc.device, dtype=torch.float64)
        progress = tqdm(
            total=steps,
            initial=first,
            desc=f"epoch {epoch + 1}/{self.start.values.epochs}",
            disable=not acc.is_main_process or not sys.stderr.isatty(),  # a job log gets the epoch line only
            leave=False,
            dynamic_ncols=True,
        )
        started, mean_loss = time.perf_counter(), None
        self.epoch_started, self.epoch_first_step = started, first
        loader = epoch_batches(self.data.train_loader, epoch, first, steps - first, cfg.seed, acc.process_index)
        batches = DeviceBatches(loader if _watch is None else _watch(loader), acc.device, self.data.augment)
        for step, (images, targets) in enumerate(batches, start=first):
            update, group = accumulation(step, steps, cfg.grad_accum_steps)
            if cfg.channels_last:
                images = images.contiguous(memory_format=torch.channels_last)
            if optimization.mixup is not None:
                with record_function("mixup"):
                    images, targets = optimization.mixup(images, targets)
            with record_function("forward_backward"), nullcontext() if update else acc.no_sync(model):
                outputs = models.forward(images)
                if models.teacher is not None:
                    with acc.autocast():
                        loss = optimization.train_loss(images, outputs, targets)
                else:
                    loss = optimization.train_loss(outputs, targets)
                acc.backward(loss / group if group > 1 else loss)
            if update:
                with record_function("optimizer"):
                    self._update()
                with record_function("ema"):
                    self._update_ema()
            with record_function("bookkeeping"):
                mean_loss = self._after_step(epoch, step, steps, loss, loss_sum, progress, update)
        if hasattr(optimization.optimizer.optimizer, "sync_lookahead"):  # timm's train.py, at each epoch's end
            optimization.optimizer.optimizer.sync_lookahead()
        progress.close()
        seconds = time.perf_counter() - started
        return {
            "train_loss": self._mean_loss(loss_sum, steps, epoch) if mean_loss is None else mean_loss,
            "lr": self._lr(),
            "images_per_sec": images_per_second(steps - first, cfg.batch_size, acc.num_processes, seconds),
            "data_wait_fraction": batches.wait_fraction(seconds),
        }

    def _update(self) -> None:
        """The optimizer's update from the gradients accumulated since the last one: clipping, the step, the
        gradients freed, the update counted and the schedule stepped. Each is a few multi-tensor ops for all
        parameters together, not a loop over them."""
        cfg, acc, optimization = self.cfg, self.accelerator, self.optimization
        if cfg.clip_grad:
            optim.clip_gradients(cfg, acc, self.models.model)
        optimization.optimizer.step()
        optimization.optimizer.zero_grad(set_to_none=True)
        self.progress.num_updates += 1
        optimization.scheduler.step_update(self.progress.num_updates)

    def _update_ema(self) -> None:
        """The EMA's update after an optimizer update (engine.optim.factory.ModelEma: multi-tensor ops), at its count."""
        if self.models.ema is not None:
            self.models.ema.update(self.models.whole_model(), step=self.progress.num_updates)

    def _after_step(
        self,
        epoch: int,
        step: int,
        steps: int,
        loss: torch.Tensor,
        loss_sum: torch.Tensor,
        progress: tqdm,
        updated: bool,
    ) -> float | None:
        """What follows a step (``updated``: an optimizer update ended it): the loss sum, every LOSS_CHECK_INTERVAL
        steps and at the epoch's last the one cross-rank reduction (finiteness, progress bar, --log-interval; the
        mean loss so far is returned then, else None), and after an update the mid-epoch resume points and
        preemption. Nothing else here reads a device value on the host."""
        cfg, acc = self.cfg, self.accelerator
        loss_sum += loss.detach().double()
        checked = (step + 1) % LOSS_CHECK_INTERVAL == 0 or step + 1 == steps
        logged = cfg.log_interval and (step + 1) % cfg.log_interval == 0 and step + 1 < steps
        mean_loss = None
        if checked or logged:  # one cross-rank reduction (a collective: the same steps on every rank)
            mean_loss = self._mean_loss(loss_sum, step + 1, epoch)
            progress.set_postfix(loss=f"{mean_loss:.4f}", lr=f"{self._lr():.2e}")
            if logged and not sys.stderr.isatty():  # a terminal has the progress bar
                seconds = time.perf_counter() - self.epoch_started
                trained = step + 1 - self.epoch_first_step
                speed = images_per_second(trained, cfg.batch_size, acc.num_processes, seconds)
                acc.print(
                    f"epoch {epoch + 1}/{self.start.values.epochs}  step {step + 1}/{steps}  train_loss "
                    f"{mean_loss:.4f}  lr {self._lr():.2e}  {pace(seconds, speed, self._seconds_left(epoch, step + 1))}"
                )
        progress.update(1)
        if updated and step + 1 < steps:
            self._maybe_stop_mid_epoch(epoch, step + 1, loss_sum)
        return mean_loss

    def _maybe_stop_mid_epoch(self, epoch: int, steps: int, loss_sum: torch.Tensor) -> None:
        """After an optimizer update: a resume point every --checkpoint-interval updates, and on a
        preemption signal or Ctrl-C a resume point then Preempted or Interrupted (every rank decides together,
        every engine.loop.preemption.PREEMPTION_CHECK_INTERVAL updates when several processes train)."""
        signals = self.preemption
        stop = signals.requested(self.accelerator, self.progress.num_updates)
        point = self.checkpointer.save(epoch, steps, loss_sum=loss_sum, force=stop)
        if stop and signals.interrupts:
            raise Interrupted(
                f"Ctrl-C after step {steps} of epoch {epoch + 1}; resume point {point} (continue with --resume auto)"
            )
        if stop:
            raise Preempted(self.preemption.name, point, epoch, steps)

    def _mean_loss(self, loss_sum: torch.Tensor, steps: int, epoch: int) -> float:
        """Mean loss over ranks and steps so far; stops the run when it is not finite."""
        total = self.accelerator.reduce(loss_sum.clone(), reduction="sum").item()
        mean = total / (steps * self.accelerator.num_processes)
        if not math.isfinite(mean):
            points = self.checkpointer.points()
            kept = f"the last good checkpoint is {points[0]}" if points else "no checkpoint was written yet"
            raise NonFiniteLossError(
                f"non-finite training loss ({mean}) in epoch {epoch + 1} by step {steps}; "
                f"stopping; {kept} (try a lower --lr or --clip-grad)"
            )
        return mean

    def evaluate(self, model: torch.nn.Module) -> dict[str, float]:
        """Exact loss, top-1 and top-5 (in %) over the whole validation set, across all processes."""
        return evaluate(self.accelerator, model, self.data.eval_loader, self.data.streamed, self.cfg.channels_last)

    # ------------------------------------------------------------------------------ reparametrization
    def _reparametrize(self) -> None:
        """Change the model's architecture mid-run, keep the optimizer state of surviving parameters, re-prepare."""
        cfg, acc, models, optimization = self.cfg, self.accelerator, self.models, self.optimization
        known = self.start.extensions.reparametrizations
        new_model = reparametrize(acc.unwrap_model(models.model), cfg, known).to(acc.device)
        optimizer = optim.rebuild_optimizer(cfg, new_model, self.start.values.lr, optimization.optimizer.optimizer)
        if models.ema is not None:
            models.ema.module = reparametrize(models.ema.module, cfg, known).to(acc.device)
        acc.free_memory()  # drop accelerate's references to the old model and optimizer
        models.model, optimization.optimizer = acc.prepare(new_model, optimizer)  # the eval loader stays prepared
        self.schedule.recreate()
        models.compile(cfg)
        self.progress.reparametrized = True
        acc.print(f"reparametrized the model with {cfg.reparametrize}({cfg.reparametrize_kwargs})")

    def _lr(self) -> float:
        return optim.main_lr(self.optimization.optimizer.param_groups)
