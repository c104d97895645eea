"""The generated timm train.py data agree with each other: tests/data/timm_train_args.yaml (timm's args.yaml),
convbias.engine.config.timm_train_options.TIMM_TRAIN_DEFAULTS and the table of docs/timm-options.md hold the same keys and
defaults (all three are written by tests/data/make_timm_train_args.py from timm's parser)."""

import json
import re

import yaml

from convbias.engine.config.timm_train_options import TIMM_TRAIN_COMMIT, TIMM_TRAIN_DEFAULTS


def test_args_yaml_is_timms_dump_of_the_defaults(repo):
    text = (repo / "tests" / "data" / "timm_train_args.yaml").read_text()
    header = [line for line in text.splitlines() if line.startswith("#")]
    assert any(TIMM_TRAIN_COMMIT in line for line in header)
    body = "".join(line + "\n" for line in text.splitlines() if not line.startswith("#"))
    assert body == yaml.safe_dump(TIMM_TRAIN_DEFAULTS, default_flow_style=False)  # as train.py writes it
    assert yaml.safe_load(text) == TIMM_TRAIN_DEFAULTS and len(TIMM_TRAIN_DEFAULTS) == 172


def test_the_options_table_lists_every_key_with_its_default(repo):
    rows = re.findall(r"^\| `(\w+)` \| `(.*?)` \|", (repo / "docs" / "timm-options.md").read_text(), re.MULTILINE)
    assert [key for key, _ in rows] == sorted(TIMM_TRAIN_DEFAULTS)
    assert all(json.loads(default.replace("\\|", "|")) == TIMM_TRAIN_DEFAULTS[key] for key, default in rows)


def test_the_options_table_says_what_this_engine_does_with_each_key(repo):
    """The table's last column is current: regenerate it (make_timm_train_args.py --docs) when an option
    changes group."""
    from convbias.engine.config.timm_args import timm_option_status

    rows = re.findall(r"^\| `(\w+)` \|.*\| ([a-z ]+): (.*) \|$", (repo / "docs" / "timm-options.md").read_text(), re.M)
    assert len(rows) == len(TIMM_TRAIN_DEFAULTS)
    for key, group, what in rows:
        assert (group, what.replace("\\|", "|")) == timm_option_status(key), key


def test_the_readme_counts_the_groups_as_the_table_does(repo):
    """README's summary of the table (how many of timm's keys are implemented, not applicable, refused)."""
    from collections import Counter

    from convbias.engine.config.timm_args import timm_option_status

    counts = Counter(timm_option_status(key)[0] for key in TIMM_TRAIN_DEFAULTS)
    readme = " ".join((repo / "README.md").read_text().split())
    expected = (
        f"of its {len(TIMM_TRAIN_DEFAULTS)} keys, {counts['implemented']} are implemented, "
        f"{counts['not applicable']} not applicable and {counts['refused']} refused"
    )
    assert expected in readme
