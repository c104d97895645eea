"""What the training loop saves and resumes: resume points (``points``), random streams (``rng``), the parts a
point holds (``parts``), resume with every check of a run against its point (``resume``), timm's checkpoint
continued (``timm_resume``), FSDP shards (``shards``) and the manager the loop calls (``manager``)."""
