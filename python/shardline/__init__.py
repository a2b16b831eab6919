"""shardline."""
