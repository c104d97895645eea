"""The benchmarks: scripts run as `python benchmarks/NAME.py`, each importing its neighbours by name. A package
so that the tests import what they share with them (`benchmarks.dispatch_cost`) from the repository's root."""
