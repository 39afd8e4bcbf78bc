"""Scheduler side of the engine: plain Python and numpy, never torch or model code."""
