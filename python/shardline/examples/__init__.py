"""Runnable examples; ``shardline.examples.train`` is the main job of the README's first command."""
