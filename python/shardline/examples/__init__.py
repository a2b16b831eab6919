"""Runnable examples; ``shardline.examples.train`` is the README's main job."""
