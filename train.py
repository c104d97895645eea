"""Train or evaluate any model of this project: ``accelerate launch train.py --model convit_tiny ...``.

Options: ``python train.py --help``; the engine lives in ``engine/``.
"""
import engine

if __name__ == "__main__":
    raise SystemExit(engine.main())
