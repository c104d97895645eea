"""Data: datasets, streams, class maps, loaders, and the augmentation a batch gets on the training device."""
