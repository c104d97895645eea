"""Ensembles of train.py runs that differ by their seed: `convbias-ensemble` (`command`). The measurement,
convbias.evaluation.ensembles, is shared with the sweep, the regimes and the phase diagram."""
