"""The composition root: the model families, and what they contribute to the generic engine.

`load_families()` imports convit, transformed_cnn and efcn (each registers its models in timm's
registry) and returns the engine's `Extensions`: the per-evaluation diagnostics (attention locality
of ConViT/DeiT/T-CNN layers, the eFCN's deviation from locality, and the model-agnostic relative
stability to diffeomorphisms R_f of any model, per layer) and the T-CNN reparametrization
(`--reparametrize tcnn`). Every command that builds models calls it first; nothing below it does.
"""

from __future__ import annotations

from convbias.engine import Extensions


def load_families() -> Extensions:
    """Register every family's models in timm and collect their engine extensions."""
    # Imported here, not at the top: importing a family registers its models, which happens when a command
    # asks for it (`train.py --help` registers nothing and loads no model code).
    import convit.diagnostics
    import efcn.diagnostics
    import transformed_cnn
    from convbias.evaluation import stability
    from convbias.evaluation.ntk import NTKChange

    return Extensions(
        diagnostics={
            "ntk": NTKChange(),
            "attention": convit.diagnostics.summary,
            "efcn": efcn.diagnostics.summary,
            "stability": stability.diagnostic,
        },
        reparametrizations={"tcnn": transformed_cnn.transform},
    )
