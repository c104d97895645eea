"""Preemption: a scheduler's signal ends the run after the current optimizer step, with a resume point.

Clusters that preempt jobs signal them first (SLURM: SIGTERM, or the signal of ``--signal=USR1@120``); a
closed terminal or ssh session sends SIGHUP, handled the same way.
``PreemptionSignals`` records the signal in a handler that only sets a flag; the training loop asks
``requested()`` after every optimizer update, writes a mid-epoch resume point and raises ``Preempted``. One
process reads its flag at every update. Several processes decide together every
``PREEMPTION_CHECK_INTERVAL`` updates (one tiny all-reduce, so that every rank stops at the same update
even when the signal reached them at different ones): a collective read on the host at every update would
make each GPU wait for its queued work, and a few updates are nothing against a scheduler's grace time. The
command exits with ``convbias.base.errors.EXIT_REQUEUE`` (75), which a job script maps to a requeue
(README: SLURM recipe); ``--resume auto`` continues from that step.

Ctrl-C (SIGINT) stops the same way, with the same mid-epoch resume point, and says so when it is pressed; the
command then exits with ``convbias.base.errors.EXIT_INTERRUPTED`` (130), as a shell reports Ctrl-C. A second Ctrl-C
stops at once (Python's KeyboardInterrupt), keeping the newest point written before.

DataLoader workers ignore these signals when the scheduler or the terminal sends them (``ignore_in_worker``): a
scheduler signals every process of the job, a terminal its whole foreground job, and a worker killed by either
would end the run before its resume point is written. A SIGTERM from the main process (the DataLoader's
shutdown) still ends them.

torch is imported inside functions: the engine's facade imports this module before it parses the command
line (``train.py --help`` loads no torch).
"""

from __future__ import annotations

import os
import signal
import threading
from collections.abc import Sequence
from typing import Any

# Updates between the ranks' joint decisions (an all-reduce and a host read each) when several processes
# train: at most this many updates pass between a signal and the resume point (about a second on a GPU)
PREEMPTION_CHECK_INTERVAL = 10
INTERRUPT_NOTE = "Ctrl-C: stopping after this step with a resume point (Ctrl-C again stops at once)"


class PreemptionSignals:
    """Installs flag-setting handlers for ``signals`` and for Ctrl-C (main thread only); ``restore()`` puts the old
    ones back."""

    def __init__(self, signals: Sequence[signal.Signals]):
        self.signals = list(signals)
        self.received: signal.Signals | None = None
        self.interrupted = False  # Ctrl-C in this process
        self.interrupts = False  # the decision of requested(): the run stops on Ctrl-C (of some rank), not preempted
        self._previous: dict[signal.Signals, Any] = {}

    @property
    def handled(self) -> list[signal.Signals]:
        """The signals that stop the run after a step with a resume point: the preemption signals, and Ctrl-C."""
        return [*self.signals, signal.SIGINT]

    def install(self) -> PreemptionSignals:
        for sig in self.signals:
            self._previous[sig] = signal.signal(sig, self._handle)
        self._previous[signal.SIGINT] = signal.signal(signal.SIGINT, self._interrupt)
        return self

    def restore(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()

    def _handle(self, signum: int, frame: Any) -> None:
        self.received = signal.Signals(signum)

    def _interrupt(self, signum: int, frame: Any) -> None:
        """Ctrl-C: stop after this step; a second one stops at once."""
        self.interrupted = True
        signal.signal(signal.SIGINT, signal.default_int_handler)
        if os.environ.get("RANK", "0") == "0":  # os.write: a signal handler may run inside a print
            os.write(2, f"\n{INTERRUPT_NOTE}\n".encode())

    def requested(self, accelerator: Any, updates: int) -> bool:
        """Whether to stop after update number ``updates``, the same answer on every rank: one process, its own
        flags; several, True when any rank has received a signal, decided every PREEMPTION_CHECK_INTERVAL
        updates (a collective then: every rank must call it after every update) and False in between. Sets
        ``interrupts`` when the stop is Ctrl-C's alone (a scheduler's signal makes it a preemption)."""
        preempted, interrupted = self.received is not None, self.interrupted
        if accelerator.num_processes > 1:
            if updates % PREEMPTION_CHECK_INTERVAL:
                return False
            import torch  # only with several processes: engine/__init__ imports this module without torch

            flags = torch.tensor([float(preempted), float(interrupted)], device=accelerator.device)
            preempted, interrupted = (accelerator.reduce(flags, reduction="sum") > 0).tolist()
        self.interrupts = interrupted and not preempted
        return preempted or interrupted

    @property
    def name(self) -> str:
        return self.received.name if self.received is not None else "a signal of another rank"


def ignore_in_worker(signals: Sequence[signal.Signals], worker_id: int = 0) -> None:
    """A DataLoader ``worker_init_fn`` (with ``functools.partial``): the worker ignores the preemption
    signals of the scheduler, the main process decides when to stop.

    The worker still obeys its parent: the DataLoader's and multiprocessing's shutdown end workers with
    ``terminate()`` (SIGTERM from the main process), and a worker deaf to it would hang the main process
    at exit (after an error in a worker, say). So the signals are blocked and a thread waits for them,
    ending the worker when the sender is its parent and dropping them otherwise."""
    parent = os.getppid()
    if not hasattr(signal, "sigwaitinfo"):  # not on macOS: ignore them outright
        for sig in signals:
            signal.signal(sig, signal.SIG_IGN)
        return
    signal.pthread_sigmask(signal.SIG_BLOCK, signals)

    def obey_parent_only() -> None:
        while True:
            if signal.sigwaitinfo(signals).si_pid == parent:
                os._exit(0)  # a clean exit: torch reports a worker that exits non-zero as a failure

    threading.Thread(target=obey_parent_only, name="preemption-signals", daemon=True).start()
