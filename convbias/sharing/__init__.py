"""Sharing a trained model: a run exported as timm loads it (`deploy`, `hub`: `save_for_hf`, `local-dir:`,
`hf-hub:`) and predictions from a run or an export (`prediction`). Used by the console scripts `convbias-export`
and `convbias-predict`."""
