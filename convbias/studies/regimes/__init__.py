"""Lazy or feature training: the summary of a sweep over the output scale (`study`) and `convbias-regimes`
(`command`)."""
