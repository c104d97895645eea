"""Relative stability to diffeomorphisms R_f over trained runs (Petrini et al. 2021): the measurement over runs and
its summaries over seeds (`study`), figures, paired contrasts and trajectories (`contrasts`), the CPU-scale plan
of runs (`runs`), and `convbias-stability` / `convbias-stability-contrasts` (`command`, `contrasts_command`).
R_f itself and the diffeomorphisms are convbias.evaluation's: the engine logs R_f during training too."""
