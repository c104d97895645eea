"""Experiments over many runs: grid sweeps and their reports, the eFCN relax-time protocol."""
