"""The training loop: one accelerate code path for CPU, one GPU, many GPUs and many nodes.

``Trainer(cfg)`` does every check that can fail on user input (data, model, checkpoints, output dir)
before it writes anything; ``Trainer.fit()`` then trains, evaluates, logs and checkpoints each epoch;
``Trainer.evaluate_only()`` prints top-1/top-5 of a checkpoint.

Distribution: the model and its optimizer go through ``accelerator.prepare`` together: DDP, or FSDP2
when the accelerate config asks for FSDP with ``fsdp_version: 2`` (FSDP1 is refused at set-up). Under
FSDP a resume point also holds every rank's shards of the weights and the optimizer state (engine.fsdp,
torch distributed checkpoint), from which ``--resume`` continues exactly; the EMA update and the
diagnostics read an ordinary copy of the model refreshed from the shards (``FullCopy``).
The train loader is *not* prepared: its sampler (from engine.data)
shards itself across ranks so that, with a fixed seed, the union of the ranks' batches at step t is the
1-process batch at step t. The eval loader is prepared and metrics use ``gather_for_metrics``, so they
are exact (no duplicated padding samples); a stream's loaders are not prepared (timm's reader splits the
stream between processes) and each process's sums are reduced once after evaluation. Gradient
accumulation uses ``accelerator.accumulate``; each epoch runs a multiple of ``--grad-accum-steps``
batches (the few left over are skipped) so every optimizer step sees the same number of batches.
"""

from __future__ import annotations

import math
import time
from functools import partial
from pathlib import Path
from typing import Any

import timm
import torch
import torch.nn.functional as F
from accelerate import Accelerator
from accelerate.utils import DistributedType, broadcast_object_list, gather_object, set_seed
from timm.utils import ModelEmaV3
from tqdm.auto import tqdm

from . import recipe
from .checkpoint import (
    EMA_FILE,
    WEIGHTS_FILE,
    CheckpointDir,
    find_resume_point,
    load_training_state,
    load_weights,
    rng_state,
    set_rng_state,
    weights_metadata,
)
from .compile import compile_counters, compiled
from .config import Config, effective_epochs, write_config
from .data import epoch_batches, first_images
from .diagnostics import ModelDiagnostics
from .errors import ConfigError, NonFiniteLossError
from .extensions import Extensions
from .fsdp import FullCopy, load_sharded, save_sharded
from .lock import RunLock, RunLockedError
from .lock import describe as describe_holder
from .modeling import check_model_name, create_model
from .output_scale import OutputScale, ScaledLoss
from .preemption import Preempted, PreemptionSignals, ignore_in_worker, parse_signals
from .run_dir import DEFAULT_WHICH, choose_checkpoint, is_run_dir
from .run_log import RunLog

LOSS_CHECK_INTERVAL = 10  # steps between cross-rank loss reductions (finiteness check, progress bar)


def _check_which_target(which: str | None, checkpoint: Path | None) -> None:
    if which is not None:
        raise ConfigError(
            f"--which {which} picks a checkpoint of a run directory; --checkpoint {checkpoint or '(none)'} is not one"
        )


class Trainer:
    """One run: set-up checks in ``__init__`` (nothing is written yet), then ``fit()`` or ``evaluate_only()``."""

    def __init__(self, cfg: Config, extensions: Extensions | None = None, lock: RunLock | None = None):
        self.cfg = cfg
        self.extensions = extensions or Extensions()
        self.accelerator = acc = Accelerator(
            mixed_precision=cfg.mixed_precision,
            gradient_accumulation_steps=cfg.grad_accum_steps,
            log_with="wandb" if cfg.log_wandb and not cfg.eval_only else None,
        )
        self.sharded = acc.is_fsdp2
        self.full_copy: FullCopy | None = None  # under FSDP, what whole_model() returns (made with the optimizer)
        self._check_fsdp()
        self.output = Path(cfg.output)
        self.epochs, self.warmup_epochs = effective_epochs(cfg)
        self.global_batch = cfg.batch_size * acc.num_processes * cfg.grad_accum_steps
        self.lr = cfg.lr if cfg.lr is not None else cfg.lr_base * self.global_batch / cfg.lr_base_size

        check_model_name(cfg.model)
        self._check_reparametrization()
        if cfg.distill_teacher:
            check_model_name(cfg.distill_teacher, "--distill-teacher")
        self.checkpoint_name = self._resolve_checkpoint()
        self.notes: list[str] = []  # said when training starts (stale lock taken over, restart)
        self._take_lock(lock)
        self.resume_point = self._check_output_dir()
        self.resume_state = load_training_state(self.resume_point) if self.resume_point else None
        if self.resume_state and self.resume_state.get("model") != cfg.model:
            raise ConfigError(
                f"--resume {self.resume_point} is a checkpoint of {self.resume_state.get('model')}, "
                f"not of --model {cfg.model}"
            )
        self.finished = self._finished_message()
        if self.finished:  # --resume of a finished run: nothing to set up, nothing to write
            return

        self._check_resume_world_size()

        from .data import build_datasets, build_eval_loader, build_stream_loader, dataset_info
        from .streams import is_stream

        cfg.img_size = cfg.img_size or dataset_info(cfg.dataset).default_img_size  # data and model agree
        self.data = build_datasets(cfg)
        model = self._build_model()
        self.preemption = PreemptionSignals(parse_signals(cfg.preempt_signals))
        # loader workers leave the preemption signals to this process (see engine.preemption)
        self.worker_init_fn = partial(ignore_in_worker, self.preemption.signals) if self.preemption.signals else None
        self.streamed = is_stream(cfg.dataset)  # timm's reader shards a stream itself: its loaders are not prepared
        if self.streamed:
            self.eval_loader = build_stream_loader(
                self.data.val,
                cfg.eval_batch_size or cfg.batch_size,
                cfg.workers,
                drop_last=False,
                worker_init_fn=self.worker_init_fn,
            )
        else:
            self.eval_loader = build_eval_loader(
                self.data.val, cfg.eval_batch_size or cfg.batch_size, cfg.workers, self.worker_init_fn
            )
        if cfg.eval_only:  # evaluation needs no sharding (and FSDP2 prepares a model only with its optimizer)
            self.model = model.to(acc.device) if self.sharded else acc.prepare(model)
            self.eval_loader = self.eval_loader if self.streamed else acc.prepare(self.eval_loader)
            self.forward = compiled(self.model, cfg, acc.device.type)
        else:
            self._set_up_training(model)

    def _build_model(self) -> torch.nn.Module:
        """The model with its starting weights: a resume point, else --checkpoint, else timm's init/pretrained."""
        cfg = self.cfg
        set_seed(cfg.seed)  # same initial weights on every rank
        model = create_model(cfg, self.data.num_classes, self.data.in_chans)
        if self.resume_state:
            self.reparametrized = self.resume_state["reparametrized"]
        else:  # a checkpoint written after --reparametrize-at-epoch needs the changed architecture
            metadata = weights_metadata(cfg.checkpoint) if cfg.checkpoint else {}
            self.reparametrized = metadata.get("reparametrized") == "True"
            cfg.reparametrize = cfg.reparametrize or metadata.get("reparametrization") or None
            self._check_reparametrization()
            if metadata.get("output_scale"):  # weights of an output-scaled run hold f_w0 too
                cfg.output_scale = cfg.output_scale or float(metadata["output_scale"])
        if self.reparametrized:
            model = self._reparametrized(model)
        if cfg.checkpoint and not self.resume_point:
            if metadata.get("output_scale"):
                model = OutputScale(model, cfg.output_scale)
            self._load_checkpoint(model)
        if self.resume_point:
            if cfg.output_scale:
                model = OutputScale(model, cfg.output_scale)
            load_weights(model, self.resume_point / WEIGHTS_FILE)
        if cfg.grad_checkpointing:
            self._set_grad_checkpointing(model.model if isinstance(model, OutputScale) else model)
        if cfg.output_scale and not isinstance(model, OutputScale):
            model = OutputScale(model, cfg.output_scale)  # f_w0: the network as this run starts
        return model

    def _load_checkpoint(self, model: torch.nn.Module) -> None:
        """--checkpoint's weights; a file that does not fit says how to rebuild the model it was written for."""
        try:
            load_weights(model, self.cfg.checkpoint)
        except ValueError as e:
            if "does not fit" not in str(e):
                raise
            raise ConfigError(
                f"{e}; give the model options the weights were trained with (--model, --model-kwargs, "
                f"--img-size, --num-classes), or pass the run directory, whose config.yaml has them"
            ) from None

    def _set_grad_checkpointing(self, model: torch.nn.Module) -> None:
        """--grad-checkpointing: timm's own switch; the model must have one."""
        if not hasattr(model, "set_grad_checkpointing"):
            raise ConfigError(
                f"--grad-checkpointing: {type(model).__name__} ({self.cfg.model}) has no "
                f"set_grad_checkpointing(); run without it"
            )
        model.set_grad_checkpointing(True)

    def _set_up_training(self, model: torch.nn.Module) -> None:
        """Train loader, optimizer, schedule, losses, EMA, diagnostics; the resume point's state on top."""
        from .data import build_stream_loader, build_train_loader

        cfg, acc = self.cfg, self.accelerator
        self.teacher = self._create_teacher() if cfg.distill_teacher else None
        if self.streamed:
            self.train_loader = build_stream_loader(
                self.data.train, cfg.batch_size, cfg.workers, drop_last=True, worker_init_fn=self.worker_init_fn
            )
        else:
            self.train_loader = build_train_loader(
                self.data.train,
                cfg.batch_size,
                cfg.workers,
                cfg.repeated_aug,
                cfg.seed,
                acc.num_processes,
                acc.process_index,
                self.worker_init_fn,
            )
        self.steps_per_epoch = len(self.train_loader) // cfg.grad_accum_steps * cfg.grad_accum_steps
        if self.steps_per_epoch == 0:
            raise ConfigError(
                f"the training set ({len(self.data.train)} images) gives no full batch of "
                f"{cfg.batch_size} x {acc.num_processes} processes x {cfg.grad_accum_steps} "
                f"accumulation steps; lower --batch-size"
            )
        if hasattr(model, "set_distilled_training") and self.teacher is not None:
            model.set_distilled_training(True)

        before_reparametrization = cfg.reparametrize_at_epoch is not None and not self.reparametrized
        optimizer = recipe.create_optimizer(cfg, model, self.lr, require_all_patterns=not before_reparametrization)
        # the EMA (and under FSDP the full copy) from the model as built, before prepare() shards or wraps it
        self.ema = ModelEmaV3(model, decay=cfg.model_ema_decay, device=acc.device) if cfg.model_ema else None
        self.full_copy = FullCopy(model, acc.device) if self.sharded else None
        if self.sharded:  # every rank has built the whole model; accelerate's rank-0 loading (on by default)
            acc.state.fsdp_plugin.cpu_ram_efficient_loading = False  # serves transformers models only
        self.model, self.optimizer = acc.prepare(model, optimizer)
        self.scheduler = recipe.create_scheduler(
            cfg, self.optimizer, self.epochs, self.warmup_epochs, self.steps_per_epoch // cfg.grad_accum_steps
        )
        self.mixup = recipe.create_mixup(cfg, self.data.num_classes)
        self.train_loss = recipe.create_train_loss(cfg, self.mixup)
        if self.teacher is not None:
            self.train_loss = recipe.HardDistillationLoss(self.train_loss, self.teacher)
        if cfg.output_scale:
            self.train_loss = ScaledLoss(self.train_loss, cfg.output_scale)
        if not self.streamed:
            self.eval_loader = acc.prepare(self.eval_loader)
        self._compile()

        self.start_epoch, self.num_updates = 0, 0
        self.start_step, self.start_loss_sum = 0, 0.0  # the position inside start_epoch of a mid-epoch resume point
        self.best: dict[str, Any] = {}  # epoch, eval_top1, eval_top5 of the best evaluation so far
        self.final: dict[str, Any] = {}  # the latest evaluation
        if self.resume_state:
            self._restore_training_state(self.resume_state)
        self.checkpoints = CheckpointDir(self.output)
        self.diagnostics = None
        if cfg.diagnostics:
            images = first_images(self.data.val, min(cfg.diagnostics_images, len(self.data.val))).to(acc.device)
            self.diagnostics = ModelDiagnostics(images, self.extensions.diagnostics)

    # ------------------------------------------------------------------------------------ set-up checks
    def _resolve_checkpoint(self) -> str | None:
        """--checkpoint (or --eval-only) naming a run directory becomes its checkpoints/<--which> weights;
        returns how to name the weights in messages (the link and its epoch)."""
        cfg = self.cfg
        if cfg.checkpoint is None:
            _check_which_target(cfg.which, None)
            return None
        run = Path(cfg.checkpoint)
        if (run / "checkpoints").is_dir() or is_run_dir(run):
            chosen = choose_checkpoint(run, cfg.which or DEFAULT_WHICH)
            cfg.checkpoint = str(chosen.weights)
            return chosen.describe()
        _check_which_target(cfg.which, run)
        epoch = weights_metadata(run).get("epoch")
        return f"{run}, epoch {epoch}" if epoch else str(run)

    def _take_lock(self, lock: RunLock | None) -> None:
        """The output dir's lock (engine.lock), taken by the main process before anything there is read or
        written; every process stops when another live run holds it."""
        acc, message = self.accelerator, None
        if lock is None:
            return
        if acc.is_main_process:
            try:
                lock.acquire()
            except RunLockedError as e:
                message = str(e)
            if lock.stale:
                self.notes.append(f"took over the stale lock of {describe_holder(lock.stale)} (that process is gone)")
        if acc.num_processes > 1:
            message = broadcast_object_list([message])[0]
        if message:
            raise ConfigError(message)

    def _check_output_dir(self) -> Path | None:
        """The resume point, or None for a fresh run; refuses to overwrite an earlier run's results.

        A directory without a resume point or results.json holds only the start of a run that failed
        before its first checkpoint (config.yaml, summary.csv...): the run starts over there."""
        cfg = self.cfg
        if cfg.eval_only:
            return None
        point = find_resume_point(cfg.resume, self.output) if cfg.resume else None
        if point is None and self.output.is_dir():
            earlier = [
                name
                for name, there in (
                    ("checkpoints/last", CheckpointDir(self.output).last is not None),
                    ("results.json", (self.output / "results.json").exists()),
                )
                if there
            ]
            if earlier and cfg.resume is None:
                raise ConfigError(
                    f"output dir {self.output} already holds a run ({', '.join(earlier)}); "
                    f"pass --resume auto to continue it, or choose another --output"
                )
            leftovers = [name for name in ("config.yaml", "summary.csv", "log.jsonl") if (self.output / name).exists()]
            if leftovers and not earlier:
                self.notes.append(
                    f"starting over: {self.output} holds no checkpoint of an earlier attempt "
                    f"(its {', '.join(leftovers)} are replaced)"
                )
        return point

    def _finished_message(self) -> str | None:
        """What --resume of a run that already trained all its epochs says instead of training again."""
        state = self.resume_state
        if (
            not state
            or state.get("step")
            or state["epoch"] < self.epochs
            or not (self.output / "results.json").is_file()
        ):
            return None
        final, best = state.get("final") or {}, state.get("best") or {}
        return (
            f"{self.output} is already finished (epoch {state['epoch']}/{self.epochs}, final top-1 "
            f"{final.get('eval_top1', float('nan')):.2f}, best top-1 {best.get('eval_top1', float('nan')):.2f} "
            f"at epoch {best.get('epoch')}); nothing to do (a larger --epochs trains on)"
        )

    def kept(self) -> str:
        """What an interrupted run leaves behind, in one sentence."""
        if self.cfg.eval_only:
            return "nothing was written"
        last = CheckpointDir(self.output).last
        if last is None:
            return f"no checkpoint was written yet in {self.output}; rerun the same command to start over"
        epoch = weights_metadata(last / WEIGHTS_FILE).get("epoch", "?")
        return f"kept {self.output}/checkpoints/last (epoch {epoch}); continue with --resume auto"

    def _check_resume_world_size(self) -> None:
        """A mid-epoch resume point continues exactly only on as many processes as wrote it (each rank's
        sampler offset, RNG streams and loss sum); an end-of-epoch one continues on any number."""
        state, world = self.resume_state, self.accelerator.num_processes
        if state and state.get("step") and len(state["rng"]) != world:
            raise ConfigError(
                f"--resume {self.resume_point} is a mid-epoch resume point ({state['step']} steps into epoch "
                f"{state['epoch'] + 1}) written by {len(state['rng'])} processes, and this run has {world}: its "
                f"position in the epoch cannot be continued exactly; resume with {len(state['rng'])} processes, "
                f"or keep its weights only with --checkpoint {self.resume_point / WEIGHTS_FILE} in a new --output"
            )

    def _compile(self) -> None:
        """The compiled views used by the training step and evaluation (engine.compile): checkpoints,
        EMA updates, reparametrizations and diagnostics keep using the modules themselves."""
        device_type = self.accelerator.device.type
        self.forward = compiled(self.model, self.cfg, device_type)
        self.ema_forward = compiled(self.ema.module, self.cfg, device_type) if self.ema is not None else None

    def _check_fsdp(self) -> None:
        """FSDP through fsdp_version 2 only, and without a mid-run change of architecture."""
        acc, cfg = self.accelerator, self.cfg
        if acc.distributed_type == DistributedType.FSDP and not self.sharded:
            raise ConfigError(
                "FSDP1 (fsdp_version 1) is not supported: its resume points cannot be continued; set "
                "fsdp_version: 2 in the accelerate config (or --fsdp_version 2), or train with DDP"
            )
        if self.sharded and cfg.reparametrize_at_epoch is not None and not cfg.eval_only:
            raise ConfigError(
                "--reparametrize-at-epoch changes the model's architecture mid-run, which FSDP's "
                "sharded parameters cannot follow; run it with DDP"
            )

    def whole_model(self) -> torch.nn.Module:
        """The model with whole (unsharded) weights, as the EMA update and the diagnostics read it: under FSDP
        an ordinary copy refreshed from the shards (every rank calls it), else the unwrapped module."""
        if self.full_copy is not None:
            return self.full_copy.refresh(self.model)
        return self.accelerator.unwrap_model(self.model)

    def _check_reparametrization(self) -> None:
        """--reparametrize names one of the composition root's reparametrizations (needed by
        --reparametrize-at-epoch, and to rebuild a model from a checkpoint written after one)."""
        name, known = self.cfg.reparametrize, self.extensions.reparametrizations
        if name is not None and name not in known:
            raise ConfigError(f"unknown --reparametrize '{name}'; choices: {', '.join(known) or 'none registered'}")
        if self.cfg.reparametrize_at_epoch is not None and name is None:
            raise ConfigError(
                f"--reparametrize-at-epoch needs --reparametrize NAME; choices: {', '.join(known) or 'none registered'}"
            )

    def _reparametrized(self, model: torch.nn.Module) -> torch.nn.Module:
        """The model after the run's reparametrization (--reparametrize with --reparametrize-kwargs)."""
        if self.cfg.reparametrize is None:
            raise ConfigError(
                "the weights to load were written after a reparametrization: pass the run's "
                "--reparametrize NAME and --reparametrize-kwargs to rebuild its architecture"
            )
        return self.extensions.reparametrizations[self.cfg.reparametrize](model, **self.cfg.reparametrize_kwargs)

    def _create_teacher(self) -> torch.nn.Module:
        cfg = self.cfg
        teacher = timm.create_model(
            cfg.distill_teacher,
            num_classes=self.data.num_classes,
            in_chans=None if self.data.in_chans == 3 else self.data.in_chans,
        )
        load_weights(teacher, cfg.distill_teacher_file)
        return teacher.to(self.accelerator.device).eval()

    def _restore_training_state(self, state: dict) -> None:
        acc = self.accelerator
        if state.get("sharded"):  # weights and optimizer state from every rank's shards, on any number of ranks
            load_sharded(self.resume_point, self.model, self.optimizer.optimizer)
        elif state["optimizer"] is None:
            raise ConfigError(
                f"{self.resume_point} was written under FSDP1, whose sharded optimizer state was not "
                f"saved; start a new run from its weights with --checkpoint instead"
            )
        elif self.sharded:
            raise ConfigError(
                f"{self.resume_point} was written without FSDP: its optimizer state is not sharded; "
                f"continue it without FSDP, or start a new run from its weights with --checkpoint"
            )
        else:
            self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        if self.ema is not None:
            ema_file = self.resume_point / EMA_FILE
            if ema_file.is_file():
                load_weights(self.ema.module, ema_file)
        if acc.scaler is not None and state.get("scaler"):
            acc.scaler.load_state_dict(state["scaler"])
        self.start_epoch = state["epoch"]
        self.num_updates = state["num_updates"]
        if state.get("step"):
            self.start_step = state["step"]
            self.start_loss_sum = state["loss_sums"][acc.process_index]
        self.best, self.final = state["best"], state["final"]
        self.scheduler.step_update(self.num_updates)

    # ------------------------------------------------------------------------------------- main entry
    def fit(self) -> dict[str, Any]:
        cfg, acc = self.cfg, self.accelerator
        for note in self.notes:
            acc.print(note)
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
                config={**cfg, **derived},
                init_kwargs={"wandb": {"name": self.output.name, "dir": str(self.output)}},
            )
        log = RunLog(self.output, acc.is_main_process, acc if cfg.log_wandb else None)
        log.start(self.start_epoch)
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
        cfg = self.cfg
        return {
            "model": cfg.model,
            "dataset": cfg.dataset,
            "train_fraction": cfg.train_fraction,
            "seed": cfg.seed,
            "epochs": self.epochs,
            "final_top1": self.final.get("eval_top1"),
            "final_top5": self.final.get("eval_top5"),
            "best_top1": self.best.get("eval_top1"),
            "best_top5": self.best.get("eval_top5"),
            "best_epoch": self.best.get("epoch"),
        }

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
            disable=not acc.is_main_process,
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
            last = self.checkpoints.last
            kept = f"the last good checkpoint is {last}" if last else "no checkpoint was written yet"
            raise NonFiniteLossError(
                f"non-finite training loss ({mean}) in epoch {epoch + 1} by step {steps}; "
                f"stopping; {kept} (try a lower --lr or --clip-grad)"
            )
        return mean

    def _lr(self) -> float:
        """The lr of the first group without a --param-group-lr override (the run's main lr)."""
        groups = self.optimizer.param_groups
        return next((g["lr"] for g in groups if g.get("lr_pattern") is None), groups[0]["lr"])

    @torch.no_grad()
    def evaluate(self, model: torch.nn.Module) -> dict[str, float]:
        """Exact loss, top-1 and top-5 (in %) over the whole validation set, across all processes."""
        acc = self.accelerator
        was_training = model.training
        model.eval()
        totals = torch.zeros(4, dtype=torch.float64, device=acc.device)  # loss sum, top-1 and top-5 hits, images
        for images, targets in self.eval_loader:
            images, targets = images.to(acc.device), targets.to(acc.device)  # a stream's loader is not prepared
            with acc.autocast():
                logits = model(images)
            loss = F.cross_entropy(logits.float(), targets, reduction="none")
            top = logits.topk(min(5, logits.shape[1]), dim=1).indices
            correct1 = top[:, 0] == targets
            correct5 = (top == targets[:, None]).any(dim=1)
            if not self.streamed:  # the prepared loader pads the last batches alike; gather_for_metrics drops that
                loss, correct1, correct5 = acc.gather_for_metrics((loss, correct1, correct5))
            totals += torch.stack(
                [
                    loss.double().sum(),
                    correct1.double().sum(),
                    correct5.double().sum(),
                    torch.tensor(loss.numel(), dtype=torch.float64, device=acc.device),
                ]
            )
        if self.streamed:  # each process read its own part of the stream, in batches of its own number and sizes
            totals = acc.reduce(totals, reduction="sum")
        model.train(was_training)
        loss_sum, top1, top5, count = totals.tolist()
        return {"eval_loss": loss_sum / count, "eval_top1": 100.0 * top1 / count, "eval_top5": 100.0 * top5 / count}

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
            save_sharded(broadcast_object_list([staging])[0], self.model, self.optimizer.optimizer)
            acc.wait_for_everyone()
        point = None
        if acc.is_main_process:
            state = {
                "model": self.cfg.model,
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
