"""Train or evaluate any model of this project: ``accelerate launch train.py --model convit_tiny ...``.

Options: ``python train.py --help``. The same as the installed ``convbias-train`` command.
"""

from convbias.cli.train import main

if __name__ == "__main__":
    raise SystemExit(main())
