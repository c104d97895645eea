"""The deprecated-option helpers, kept importable here for the generic commands; they live in
``convbias.base.deprecation`` so that the studies' commands, below the console scripts' package, use them too."""

from convbias.base.deprecation import Deprecated, announce

__all__ = ["Deprecated", "announce"]
