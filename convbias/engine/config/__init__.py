"""A run's configuration: the option declarations, the command line and YAML files over them, timm's
args.yaml read as options, and the values derived from them. Imports no torch and no other engine package."""
