"""The eFCN relax-time protocol over seeds: per relax time, each metric's mean with its 95% t-interval over
the protocol outputs of several seeds (`convbias-efcn-protocol --stage summarize --seed-dirs ...`), and the
gaps final eFCN accuracy - CNN and - FCN paired by seed; and one seed's accuracies with their Wilson
intervals over the test images (`--stage single-seed`).
"""

from __future__ import annotations

import os
from pathlib import Path

from convbias.base import tables
from convbias.base.errors import ConfigError, DamagedInputError
from convbias.base.inputs import read_yaml
from convbias.base.run_layout import BASELINES_TABLE, EFCN_PROTOCOL_FOLDER, PROTOCOL_CONFIG, RELAX_TIMES_TABLE
from convbias.base.storage import check_output, output_folder, write_text
from convbias.base.tables import markdown_table, write_csv
from convbias.engine import declared_value

from ..intervals import cell, interval, wilson
from .protocol import DECLARED

SUMMARY_METRICS = (  # per relax time: mean [95% t-interval] over seeds
    "final_test_acc",
    "best_test_acc",
    "deviation_total",
    "weight_sharing_total",
    "local_only_test_acc",
    "off_local_only_test_acc",
    "grad_norm_start",
    "hessian_top_start",
    "grad_norm_end",
    "hessian_top_end",
)
BASELINE_METRICS = ("cnn_final_test_acc", "fcn_final_test_acc", "fcn_deviation_total")
SINGLE_SEED_ACCURACIES = ("final_test_acc", "local_only_test_acc", "off_local_only_test_acc")


def _cell(column: str, value: str) -> float:
    """A protocol table's cell: the relax time a whole number, an accuracy finite, any other measure a number."""
    if column == "relax_time":
        return tables.integer(column, value)
    return tables.finite(column, value) if column.endswith("_acc") else tables.number(column, value)


def _read_csv(path: Path, required: tuple[str, ...] = ()) -> list[dict]:
    """relax_times.csv or baselines.csv of a protocol output (``protocol.analyze_stage``), with the ``required``
    columns and at least one row; a damaged one is a DamagedInputError naming the file (and line and column)."""
    if not os.path.lexists(path):
        raise ConfigError(f"{path} not found: run the protocol (--stage all) in that directory first")
    return tables.read_csv(path, "protocol results", _cell, required, rows=True)


def _seed(folder: Path) -> int:
    """The seed a protocol output records in its protocol_config.yaml, checked as the protocol's seed is."""
    path = folder / PROTOCOL_CONFIG
    if not os.path.lexists(path):
        raise ConfigError(f"{path} not found: run the protocol (--stage all) in that directory first")
    recorded = read_yaml(path, "protocol record", DamagedInputError, plain=True)
    label = f"protocol record {path}: seed"
    if not isinstance(recorded, dict) or "seed" not in recorded:
        raise DamagedInputError(f"{label} is missing")
    try:
        return declared_value(DECLARED["seed"], recorded["seed"], label)
    except ConfigError as e:
        raise DamagedInputError(str(e)) from None


def summarize_seeds(seed_dirs: list[Path], out: Path) -> list[Path]:
    """Per relax time, over the protocols in `seed_dirs` (one per seed): n and each metric's mean with its 95%
    t-interval, and the per-seed paired differences final eFCN accuracy - CNN and - FCN (the gaps the paper
    claims). Writes relax_times_seeds.csv, baselines_seeds.csv and seeds.md into `out`."""
    check_output(out, owned=EFCN_PROTOCOL_FOLDER)
    per_seed = [
        (
            _read_csv(d / RELAX_TIMES_TABLE, ("relax_time", *SUMMARY_METRICS)),
            _read_csv(d / BASELINES_TABLE, BASELINE_METRICS)[0],
        )
        for d in seed_dirs
    ]
    seeds = [_seed(d) for d in seed_dirs]
    times = sorted({r["relax_time"] for rows, _ in per_seed for r in rows})
    output_folder(out, owned=EFCN_PROTOCOL_FOLDER)
    rows, baselines = [], {}
    for key in BASELINE_METRICS:
        n, mean, low, high = interval([b[key] for _, b in per_seed])
        baselines.update({"n": n, key: mean, f"{key}_low": low, f"{key}_high": high})
    for t in times:
        at = [(next(r for r in rows_ if r["relax_time"] == t), b) for rows_, b in per_seed]
        row = {"relax_time": int(t), "n": len(at), "seeds": " ".join(map(str, seeds))}
        for key in SUMMARY_METRICS:
            _, mean, low, high = interval([r[key] for r, _ in at])
            row.update({key: mean, f"{key}_low": low, f"{key}_high": high})
        for base in ("cnn", "fcn"):
            _, mean, low, high = interval([r["final_test_acc"] - b[f"{base}_final_test_acc"] for r, b in at])
            key = f"gap_vs_{base}"
            row.update({key: mean, f"{key}_low": low, f"{key}_high": high})
        rows.append(row)
    files = [write_csv(rows, out / "relax_times_seeds.csv"), write_csv([baselines], out / "baselines_seeds.csv")]

    def c(row: dict, key: str, digits: str) -> str:
        return cell(row[key], row[f"{key}_low"], row[f"{key}_high"], digits)

    n = len(per_seed)
    text = (
        f"eFCN relax-time protocol over n = {n} seeds ({', '.join(map(str, seeds))}): mean [95% t-interval]\n\n"
        + markdown_table(
            ["model", "n", "final test acc %", "deviation delta"],
            [
                ["CNN", n, c(baselines, "cnn_final_test_acc", ".2f"), "0"],
                [
                    "standard FCN",
                    n,
                    c(baselines, "fcn_final_test_acc", ".2f"),
                    c(baselines, "fcn_deviation_total", ".3g"),
                ],
            ],
        )
        + "\n"
        + markdown_table(
            ["t_w", "n", "final test acc %", "eFCN - CNN (points)", "eFCN - FCN (points)", "deviation delta"]
            + ["off-local only acc %", "lambda_max start", "lambda_max end"],
            [
                [
                    r["relax_time"],
                    r["n"],
                    c(r, "final_test_acc", ".2f"),
                    c(r, "gap_vs_cnn", ".2f"),
                    c(r, "gap_vs_fcn", ".2f"),
                    c(r, "deviation_total", ".2g"),
                    c(r, "off_local_only_test_acc", ".1f"),
                    c(r, "hessian_top_start", ".3g"),
                    c(r, "hessian_top_end", ".3g"),
                ]
                for r in rows
            ],
        )
    )
    write_text(out / "seeds.md", text)
    return [*files, out / "seeds.md"]


def single_seed_intervals(folder: Path, test_images: int) -> list[Path]:
    """One protocol output's accuracies (relax_times.csv, baselines.csv in `folder`) with their 95% Wilson
    intervals over the `test_images` test images: the test-set sampling uncertainty of each network, which
    leaves out the spread between seeds (summarize_seeds). Writes single_seed.csv and single_seed.md there."""
    check_output(folder, owned=EFCN_PROTOCOL_FOLDER)
    fcn_columns = tuple(f"fcn_{key}" for key in SINGLE_SEED_ACCURACIES)
    base = _read_csv(folder / BASELINES_TABLE, ("cnn_final_test_acc", *fcn_columns))[0]
    fcn = {key: base[f"fcn_{key}"] for key in SINGLE_SEED_ACCURACIES}
    rows = [dict(model="CNN", relax_time="", final_test_acc=base["cnn_final_test_acc"])]
    rows.append(dict(model="standard FCN", relax_time="", **fcn))
    for r in _read_csv(folder / RELAX_TIMES_TABLE, ("relax_time", *SINGLE_SEED_ACCURACIES)):
        rows.append(dict(model="eFCN", relax_time=int(r["relax_time"]), **{k: r[k] for k in SINGLE_SEED_ACCURACIES}))
    for row in rows:
        row.update(seeds=1, test_images=test_images)
        for key in SINGLE_SEED_ACCURACIES:
            if key in row:
                row[f"{key}_low"], row[f"{key}_high"] = wilson(row[key], test_images)

    def accuracy(row: dict, key: str) -> str:
        return f"{row[key]:.2f} [{row[f'{key}_low']:.1f}, {row[f'{key}_high']:.1f}]" if key in row else ""

    body = [
        [r["model"], r["relax_time"], 1, accuracy(r, "final_test_acc"), accuracy(r, "off_local_only_test_acc")]
        for r in rows
    ]
    head = ["model", "t_w", "seeds", f"final test acc % [95% Wilson, {test_images} images]", "off-local only acc %"]
    text = (
        f"One seed (the figures' run): accuracies with their 95% Wilson interval over the {test_images} test "
        "images (test-set sampling only); the spread between seeds and the deviation delta: seeds.md.\n\n"
        + markdown_table(head, body)
    )
    output_folder(folder, owned=EFCN_PROTOCOL_FOLDER)
    write_text(folder / "single_seed.md", text)
    return [write_csv(rows, folder / "single_seed.csv"), folder / "single_seed.md"]
