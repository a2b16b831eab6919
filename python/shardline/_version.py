"""The package version, in one place: ``shardline.__version__``, checkpoints, ``--version``."""

__version__ = "0.1.0"
