"""Radar metrics (conciseness, successful execution, reasoning length) and the chart (entry: radar.run)."""
