"""convbias: the shared layers of the convolutional-inductive-biases package, from the bottom.

- `convbias.base`: errors and exit codes, the one reporter, file reads and writes, the run directory's layout,
  weight files;
- `convbias.gpsa`: gated positional self-attention (used by `convit` and `transformed_cnn`), its positional
  products and fused kernels;
- `convbias.engine`: the generic accelerate training engine (names no model family);
- `convbias.evaluation`: the measurements several studies share (R_f and diffeomorphisms, the tangent kernel,
  ensembles, loss landscape, figures);
- `convbias.families`: the composition root (imports the families, builds the engine's extensions);
- `convbias.studies`: one package per study (sweeps, robustness, relative stability, regimes, the phase diagram,
  ensembles, the eFCN relax-time protocol), each with its runs, report, figures and console script;
  `convbias.sharing`: export, the Hub, prediction;
- `convbias.cli`: the generic console scripts (`convbias-train`, `convbias-launch`, `convbias-diagnostics`, ...).

Each imports only the parts listed before it (tests/repository/test_package_imports.py). Importing `convbias` registers
no model.
"""
