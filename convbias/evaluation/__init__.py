"""Model-agnostic evaluation: robustness (attacks, corruptions, ImageNet-C/A/R), loss landscape, figures."""
