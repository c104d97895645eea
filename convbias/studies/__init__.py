"""The studies, one package each with its own measurements, runs, report, figures and command line
(`command.main`, a console script); `intervals` is the statistics they share. The measurements several
studies (or the engine's diagnostics) use are convbias.evaluation's."""
