"""Robustness of trained models (Sec. 8.3.3, Table G.1, Fig. 8.3): attacks, common corruptions and ImageNet-A/-R
accuracy (`measure`, `corruptions`), the study over models (`study`), its tables and plot (`report`) and
`convbias-robustness` (`command`)."""
