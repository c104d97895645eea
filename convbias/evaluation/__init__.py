"""Measurements of trained models that more than one study, or the engine's diagnostics, use: R_f and its
diffeomorphisms, the tangent kernel, ensembles, the loss landscape, and the figure helpers every drawing shares."""
