"""Models: built through timm's registry, the output scale (alpha-trick), torch.compile."""
