"""convbias: the shared layers of the convolutional-inductive-biases package.

- `convbias.gpsa`: gated positional self-attention (used by `convit` and `transformed_cnn`);
- `convbias.weights`: safe weight-file loading with one-line errors;
- `convbias.engine`: the generic accelerate training engine (names no model family);
- `convbias.evaluation`: model-agnostic measurements (robustness, loss landscape, figures);
- `convbias.experiments`: sweeps, reports, the eFCN relax-time protocol;
- `convbias.families`: the composition root (imports the families, builds the engine's extensions);
- `convbias.cli`: the console scripts (`convbias-train`, `convbias-sweep`, ...).

Importing `convbias` registers no model.
"""
