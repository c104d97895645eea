"""What a run writes besides checkpoints: summary.csv, log.jsonl, results.json, and tracker calls.

``summary.csv`` has exactly the columns of ``SUMMARY_FIELDS``, one row per epoch (``epoch`` counts
completed epochs, from 1). ``log.jsonl`` holds the same fields plus diagnostics and counters.
When a run resumes from epoch E, rows after E (written before a kill, for an epoch that is now
redone) are dropped, and so is a line cut short by a kill or a full disk, so the files read as if the run
had never stopped. Only the main process writes.
"""

from __future__ import annotations

import contextlib
import csv
import json
import os
from pathlib import Path
from typing import Any

from ..tables import csv_text
from .checkpoint import atomic_write

SUMMARY_FIELDS = ("epoch", "train_loss", "eval_loss", "eval_top1", "eval_top5", "lr", "images_per_sec", "epoch_seconds")


def _append_line(path: Path, line: str) -> None:
    """Append one whole line: a write that fails (disk full) is cut back, so no half line is left when the
    disk allows it (``start`` drops one that stays, when the run resumes)."""
    size = path.stat().st_size
    try:
        with open(path, "a", newline="") as f:
            f.write(line)
    except OSError:
        with contextlib.suppress(OSError):
            os.truncate(path, size)
        raise


class RunLog:
    def __init__(self, output: str | Path, enabled: bool, tracker=None):
        self.output = Path(output)
        self.enabled = enabled
        self.tracker = tracker  # an accelerate.Accelerator with trackers initialized, or None
        self.summary = self.output / "summary.csv"
        self.jsonl = self.output / "log.jsonl"

    def start(self, completed_epochs: int) -> None:
        """Fresh files, or the existing ones cut back to ``completed_epochs`` rows when resuming."""
        if not self.enabled:
            return
        rows = self._read_summary() if completed_epochs else []
        rows = [r for r in rows if int(r["epoch"]) <= completed_epochs]
        lines = self._read_jsonl() if completed_epochs else []
        lines = [r for r in lines if int(r.get("epoch", 0)) <= completed_epochs]

        atomic_write(self.summary, lambda tmp: tmp.write_text(csv_text(rows, SUMMARY_FIELDS), newline=""))
        atomic_write(self.jsonl, lambda tmp: tmp.write_text("".join(json.dumps(r) + "\n" for r in lines)))

    def _read_summary(self) -> list[dict[str, str]]:
        if not self.summary.is_file():
            return []
        with open(self.summary, newline="") as f:
            return [r for r in csv.DictReader(f) if r.get("epoch", "").isdigit() and None not in r.values()]

    def _read_jsonl(self) -> list[dict[str, Any]]:
        if not self.jsonl.is_file():
            return []
        records = []
        for line in self.jsonl.read_text().splitlines():
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError:  # a line cut short by a kill
                continue
        return records

    def log_epoch(self, record: dict[str, Any]) -> None:
        """Append one epoch: the summary fields to summary.csv, everything to log.jsonl and the trackers."""
        if self.tracker is not None:
            self.tracker.log({k: v for k, v in record.items() if isinstance(v, (int, float))}, step=record["epoch"])
        if not self.enabled:
            return
        _append_line(self.summary, csv_text([record], SUMMARY_FIELDS, header=False))
        _append_line(self.jsonl, json.dumps(record) + "\n")

    def write_results(self, results: dict[str, Any]) -> None:
        """results.json, atomically: its presence marks the run as complete."""
        if self.enabled:
            atomic_write(self.output / "results.json", lambda tmp: tmp.write_text(json.dumps(results, indent=2) + "\n"))
