"""The (width, alpha~) phase diagram of Geiger, Petrini & Wyart at CPU scale: the grid of batched nets (`study`), its
tables with intervals (`tables`) and `convbias-phase-diagram` (`command`)."""
