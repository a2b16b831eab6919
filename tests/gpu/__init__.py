"""Tests that need CUDA GPUs; each module skips itself, with the reason, where they are missing."""
