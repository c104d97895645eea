"""What every command reads of a run: its files (``run_files``), the manifests that vouch for its points
(``manifest``), the reader (``reader.RunDir``), the weights ``--checkpoint`` names (``choice``), timm's files
(``timm_files``), the output directory's lock (``lock``) and the checks of the options that name them."""
